"""Whether the gathers cost more than the compute they overlap: measured on one training forward.

Prefetch hides a unit's all-gather behind the compute of the units before it (ZeRO-Infinity,
Rajbhandari et al., SC'21, §6.2, overlap-centric design) only while the gather takes less time
than that compute. Where it takes more, what the user sees is a step slower than DDP's and no
reason: units too small for their latency, a micro-batch too small for the bytes, a link slower
than the model needs. :class:`GatherExposure` measures, on one training pass (:data:`MEASURED`,
after the trace is recorded and agreed, so that the pass prefetches as every later one does), how
long the compute spent on gathers in the forward (issuing them, and waiting for them), unit by
unit, against the rest of the forward, and warns on rank 0 when the gathers take the larger part,
naming the units that cost most and what cuts the bytes or the latency.

The clock is the compute's: on the CPU the host's (the host computes, blocks in a gather's wait,
and issuing a gather on gloo takes its time too); on an accelerator events on the compute stream,
recorded before and after each issue and wait (the stream stalls between them while the
collective runs) and at the forward's start and end, read once at the end of the measured forward
(one wait for the device, once per run).
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Optional

import torch

__all__ = ["GatherExposure", "MEASURED"]

#: The training pass measured (1-based): the first records the trace, the second replays it once
#: agreed; the third runs as the run's steady state does.
MEASURED = 3

#: Training passes after which no measurement is tried any more: one that gathered nothing (every
#: unit persistent or kept, or another pass began before its forward) is retried until then.
_LAST_TRY = MEASURED + 10


class _Clock:
    """Points in time on the compute's clock, and the seconds between two of them."""

    def __init__(self, device: torch.device) -> None:
        self.host = device.type == "cpu"
        self.device = device

    def now(self) -> Any:
        if self.host:
            return time.perf_counter()
        event = torch.Event(device=self.device, enable_timing=True)
        # On the engine's device's current stream, which the engine computes and waits on (not
        # the current device's, which may be another GPU).
        event.record(torch.accelerator.current_stream(self.device))
        return event

    def seconds(self, start: Any, end: Any) -> float:
        if self.host:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000.0


class GatherExposure:
    """Measures what one training forward spends on parameter gathers and warns when it exceeds
    the forward's compute (module docstring).

    Args:
        device: The compute device.
        rank: This rank (only rank 0 warns; every rank measures, none communicates).
        prefetch: Whether the engine gathers ahead (the advice differs when it does not).

    Attributes:
        report: After the measured forward: ``(waited, computed, waits)``: seconds the compute
            spent on gathers (issuing them, waiting for them), seconds of the rest of the forward,
            and each unit's seconds on its gathers, by the unit's name (``""``: the root's).
            ``None`` before, and if no training forward from the :data:`MEASURED`-th to the
            :data:`_LAST_TRY`-th gathered anything.
    """

    def __init__(self, device: torch.device, rank: int, prefetch: bool) -> None:
        self._clock = _Clock(device)
        self._rank = rank
        self._prefetch = prefetch
        self._training_passes = 0
        self._start: Any = None  # the measured forward's start while it runs
        self._measured = 0  # which training pass it is (1-based)
        self._waits: list[tuple[str, Any, Any]] = []
        self.report: Optional[tuple[float, float, dict[str, float]]] = None

    @property
    def measuring(self) -> bool:
        """The measured forward is running."""
        return self._start is not None

    @property
    def finished(self) -> bool:
        """Nothing more will be measured (reported, or given up after :data:`_LAST_TRY` passes)."""
        return self.report is not None or self._training_passes >= _LAST_TRY

    def pass_begins(self, training: bool) -> None:
        """A pass began, the previous one settled: a training pass from the :data:`MEASURED`-th on is
        measured, while nothing is reported."""
        if not training or self.finished:
            return
        self._training_passes += 1
        if self._training_passes >= MEASURED:
            self._start = self._clock.now()
            self._measured = self._training_passes

    def wait_begins(self) -> Any:
        """Before issuing a unit's gather or waiting for it: a point on the clock for
        :meth:`wait_ends` (``None`` outside the measured forward, where nothing is counted)."""
        return self._clock.now() if self.measuring else None

    def wait_ends(self, name: str, began: Any) -> None:
        """After issuing unit ``name``'s gather or waiting for it since ``began`` (:meth:`wait_begins`):
        the compute's time spent on it."""
        if began is not None and self.measuring:
            self._waits.append((name, began, self._clock.now()))

    def forward_end(self) -> None:
        """The measured forward ended: read the clock, and warn if the gathers cost more than the
        compute. Called when its backward starts (the forward runs from its pass's start to the
        first of its backward's hooks, the loss included) and, before settling, when the next pass
        begins: a forward with no backward yet ends there (a reference model's forward under
        ``no_grad`` between a policy's forward and its backward; a forward never run backward).
        One that gathered nothing (a generation phase's pass begun first in the training step) is
        measured again at the next training pass."""
        if not self.measuring:
            return
        end, start = self._clock.now(), self._start
        self._start = None
        if not self._waits:  # nothing gathered: tried again at the next training pass
            return
        waits: dict[str, float] = {}
        for name, before, after in self._waits:
            waits[name] = waits.get(name, 0.0) + self._clock.seconds(before, after)
        self._waits = []
        waited = sum(waits.values())
        computed = max(self._clock.seconds(start, end) - waited, 0.0)
        self.report = (waited, computed, waits)
        if waited > computed and self._rank == 0:
            warnings.warn(self.describe(), stacklevel=2)

    def describe(self) -> str:
        """The warning's text, from :attr:`report`."""
        assert self.report is not None
        waited, computed, waits = self.report
        longest = sorted(waits.items(), key=lambda item: -item[1])[:3]
        named = ", ".join(f"'{name or '<root>'}' {seconds * 1e3:.1f} ms" for name, seconds in longest)
        ahead = ("" if self._prefetch else " Prefetch is off (PrefetchConfig(enabled=False)): turned on, each "
                 "gather overlaps the compute before it.")
        return (
            f"lightning_zinf: in training forward {self._measured}, the compute spent {waited * 1e3:.1f} ms on parameter "
            f"all-gathers (issuing them and waiting for them) against {computed * 1e3:.1f} ms of computing "
            f"({len(waits)} units gathered; the longest: "
            f"{named}): the gathers cost more than the compute they overlap, so the step runs at the link's speed, "
            f"not the device's.{ahead} What helps: more compute per gathered byte (a larger micro-batch or sequence); "
            "fewer bytes (ZeroPPConfig(qwz=True): INT8 gathers; hpZ across nodes); units kept gathered "
            "(PrefetchConfig.persistence_threshold above the units named, within persistence_limit); fewer, larger "
            "units (PrefetchConfig.unit_size, or block_classes naming larger blocks) where each gather is short; "
            "and, if the whole model fits on each device, sharding='grad_op' (each unit gathered once a step, not "
            "twice) or DDP."
        )
