"""Streams and events that record what waits for what, for testing copy ordering on a CPU build.

:class:`RecordingStreams` stands in for :class:`lightning_zinf.engine.transfer.Streams`. Each
stream keeps a vector clock: its own count of work blocks queued (a block queued with
``use(stream)``, or :meth:`RecordingStreams.compute_work` for the compute stream) and, for every
other stream, how much of that stream's work it is ordered after (through ``wait_stream`` and
``wait_event``). An event's clock is its stream's at ``record``; the host waiting on an event or a
stream sees that clock. So a test reads off which compute work a copy, or the host, waited for,
and which memory was recorded for which stream.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


class RecordingStream:
    """A stream of the recording: its name, its vector clock."""

    def __init__(self, name: str, owner: "RecordingStreams") -> None:
        self.name = name
        self.owner = owner
        self.clock: dict[str, int] = {name: 0}

    def snapshot(self) -> dict[str, int]:
        return dict(self.clock)

    def _after(self, clock: dict[str, int]) -> None:
        for name, pos in clock.items():
            if name != self.name:
                self.clock[name] = max(self.clock.get(name, 0), pos)

    def wait_stream(self, other: "RecordingStream") -> None:
        self.owner.log.append(("wait_stream", self.name, other.name))
        self._after(other.snapshot())

    def wait_event(self, event: "RecordingEvent") -> None:
        self.owner.log.append(("wait_event", self.name, event.stream))
        self._after(event.clock)

    def synchronize(self) -> None:
        self.owner.host_waits.append((self.name, self.snapshot()))


class RecordingEvent:
    """An event of the recording: the stream and clock it was recorded at."""

    def __init__(self, owner: "RecordingStreams") -> None:
        self.owner = owner
        self.stream = ""
        self.clock: dict[str, int] = {}

    def record(self, stream: RecordingStream) -> None:
        self.stream, self.clock = stream.name, stream.snapshot()

    def synchronize(self) -> None:
        self.owner.host_waits.append((self.stream, dict(self.clock)))

    def query(self) -> bool:
        """Whether the device got there: never, in the recording (nothing runs)."""
        return False


class RecordingStreams:
    """The stand-in for ``Streams``: a compute stream, the copy streams ``Transfers`` makes
    (``copy0``, ``copy1``...), and logs: ``log`` (waits), ``host_waits`` ((stream, clock) the host
    waited for), ``recorded`` ((storage identity, stream name) of every ``record_stream``) and
    ``blocks`` ((stream, clock after) of every block queued on a copy stream)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, str]] = []
        self.host_waits: list[tuple[str, dict[str, int]]] = []
        self.recorded: list[tuple[int, str]] = []
        self.blocks: list[tuple[str, dict[str, int]]] = []
        self.compute = RecordingStream("compute", self)
        self._current = [self.compute]
        self._copies = 0

    def compute_work(self) -> int:
        """Queue one block of work on the compute stream; its position."""
        self.compute.clock["compute"] += 1
        return self.compute.clock["compute"]

    def current(self, device: torch.device) -> RecordingStream:
        return self._current[-1]

    def new_stream(self, device: torch.device) -> RecordingStream:
        self._copies += 1
        return RecordingStream(f"copy{self._copies - 1}", self)

    def new_event(self, device: torch.device) -> RecordingEvent:
        return RecordingEvent(self)

    @contextmanager
    def use(self, stream: RecordingStream) -> Iterator[None]:
        stream.clock[stream.name] += 1
        self._current.append(stream)
        try:
            yield
        finally:
            self._current.pop()
            self.blocks.append((stream.name, stream.snapshot()))

    def record_stream(self, tensor: torch.Tensor, stream: RecordingStream) -> None:
        self.recorded.append((tensor.untyped_storage()._cdata, stream.name))
