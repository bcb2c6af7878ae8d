"""An offloaded optimizer step that overlaps the next forward (ZeRO-Offload's delayed-parameter-free
overlap: Ren et al., ATC'21, §4.2 overlaps the CPU step with the GPU's work; ZeRO-Infinity, SC'21,
§6.2, overlaps NVMe transfers with compute).

``optimizer.step()`` with the optimizer on the ``cpu`` or ``nvme`` tier returns once the step is
*started*: a :class:`StepPipeline` steps the flat groups in sub-groups, in the order the next
forward gathers them (persistent units first: they are gathered again right after the step), and
the forward of a unit waits only for its own groups (:meth:`StepPipeline.wait`). The update itself
is the same arithmetic as the synchronous step's, on the same tensors, in the same order per
tensor, so the result is bit-identical; only *when* it happens changes.

Division of labour, so that no state is shared between threads without an order:

- the worker thread (one per engine) runs only the user's optimizer arithmetic of one sub-group
  at a time, on *proxies* of the master fragments (``fragment.detach()``: the same memory, with
  their gradients as ``.grad``, built by the main thread) and on the optimizer's per-fragment
  state dicts; torch's kernels release the GIL, so it runs beside the training loop;
- the main thread does everything else: swapping records in and out of NVMe (the swapper and
  its staging pool are not thread-safe), copies to the device (streams are per thread), the
  optimizer's own ``param_groups`` and ``zero_grad`` (the proxies keep them away from the worker).
  It advances the pipeline whenever the engine calls in (:meth:`StepPipeline.pump`, at each gather),
  and when it waits.

The hyper-parameters are those of the call: each param group's options are copied when the step
starts (a learning-rate scheduler stepping right after ``optimizer.step()`` changes the next step's
rate, not this one's), tensors among them cloned. An exception in the worker is raised, as it was
raised, at the next wait of the main thread (every rank whose step failed raises it; the others
learn it from the failure channel, :mod:`lightning_zinf.comm.watch`).
"""

from __future__ import annotations

import collections
import traceback
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, Optional, Protocol

import torch
from torch import Tensor

__all__ = ["OffloadedSide", "StepPipeline", "hyper_parameters"]


class OffloadedSide(Protocol):
    """What a :class:`StepPipeline` needs of the optimizer offload
    (:class:`~lightning_zinf.offload.optimizer.OptimizerOffload`): its flat groups and tier, the
    clipping coefficient, and the main thread's work on a sub-group's records (``nvme``: read in,
    kept, made resident, settled, given back) and on a stepped group (sent out)."""

    groups: list
    nvme: bool
    clip_coef: Optional[Tensor]

    def claim(self, members: list[int], ahead: bool) -> None: ...
    def keep_resident(self, members: list[int]) -> None: ...
    def reads_complete(self, members: list[int]) -> bool: ...
    def make_resident(self, members: list[int]) -> None: ...
    def send_out(self, optimizer: torch.optim.Optimizer, i: int) -> None: ...
    def settle(self, members: list[int]) -> None: ...
    def release_unstepped(self, members: list[int]) -> None: ...


_PENDING, _READING, _STEPPING, _DONE = range(4)


def hyper_parameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Per param group of ``optimizer``, its options as they are now (without ``params``): tensors
    cloned, so that a scheduler writing into a tensor learning rate later does not reach them."""
    return [{k: (v.clone() if isinstance(v, Tensor) else v) for k, v in group.items() if k != "params"}
            for group in optimizer.param_groups]


class StepPipeline:
    """One offloaded optimizer step in flight: sub-groups of flat groups (by index into the
    offload's groups), each read in (``nvme``), stepped by the worker, sent out.

    Args:
        offload: The optimizer offload (its records, its swap primitives).
        optimizer: The user's optimizer (sharded: its params are master fragments).
        subgroups: Group indices, sub-group by sub-group, in the order they are needed.
        owned: Ids of the fragments ``optimizer`` holds.
        worker: The thread that runs the arithmetic.
        read_ahead: How many sub-groups beyond the one being stepped are read ahead (``nvme``) or
            handed to the worker (``cpu``: all of them).
        write_behind: How many sub-groups' writes may still be in flight behind the one being
            sent out (``nvme``; ``0``: each completes first).
    """

    def __init__(self, offload: OffloadedSide, optimizer: torch.optim.Optimizer, subgroups: list[list[int]],
                 owned: set[int], worker: ThreadPoolExecutor, read_ahead: int, write_behind: int) -> None:
        self.offload = offload
        self.optimizer = optimizer
        self.subgroups = subgroups
        self.owned = owned
        self.worker = worker
        self.read_ahead = read_ahead
        self.write_behind = write_behind
        self.raw_step: Callable = getattr(type(optimizer).step, "__wrapped__", type(optimizer).step)
        self.hyper = hyper_parameters(optimizer)
        self._param_group = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
        self.clip_coef = offload.clip_coef
        self.stage = [_PENDING] * len(subgroups)
        self.futures: list[Optional[Future]] = [None] * len(subgroups)
        self.of_group = {i: k for k, members in enumerate(subgroups) for i in members}
        self._done = 0  # sub-groups before this one are done
        # What the step consumes is taken at the call, so that zero_grad() or a new backward after
        # it cannot change which fragments this step updates: cpu, each fragment's gradient;
        # nvme, which fragments have one in the gradient shard.
        self._grads: dict[int, Tensor] = {}
        self._exposed: dict[int, list[bool]] = {}
        for members in subgroups:
            for i in members:
                group = offload.groups[i]
                if offload.nvme:
                    self._exposed[i] = list(group.exposed)
                    group.exposed = [has and id(f) not in owned for f, has in zip(group.fragments, group.exposed)]
                    continue
                for fragment in group.fragments:
                    if id(fragment) in owned and fragment.grad is not None:
                        self._grads[id(fragment)] = fragment.grad
                        fragment.grad = None  # consumed by the step, as after a synchronous one
            if offload.nvme:  # what backward left in memory (gradients being written) stays for the step
                offload.keep_resident(members)

    @property
    def finished(self) -> bool:
        """Every sub-group is done (stepped and sent out)."""
        return self._done == len(self.subgroups)

    def pending(self, index: int) -> bool:
        """Group ``index`` is part of this step and not done yet."""
        k = self.of_group.get(index)
        return k is not None and self.stage[k] != _DONE

    # --- driving ----------------------------------------------------------------------------------
    def pump(self) -> None:
        """Advance without blocking: reads ahead are started, sub-groups whose reads completed go
        to the worker (in order: it steps them first come, first served), stepped ones are sent out.

        A sub-group whose step raised is left for the wait that needs it to raise: that wait is
        at the same point on every rank whose step failed there (the gather of the same unit),
        where finding it here would depend on the worker's timing.
        """
        for k in range(self._done, len(self.subgroups)):
            if self.stage[k] == _PENDING and k <= self._done + self.read_ahead:
                self._read(k, ahead=k > self._done)
            elif self.stage[k] == _READING and k == self._done and not self._read_complete(k):
                self._read(k, ahead=False)  # first in line: what a read ahead skipped is read now
            if self.stage[k] == _READING and self._read_complete(k) and all(
                    stage >= _STEPPING for stage in self.stage[self._done : k]):
                self._submit(k)
            if self.stage[k] == _STEPPING and self.futures[k].done():
                if self.futures[k].exception() is not None:
                    break
                self._finish(k)
        self._advance_done()

    def wait(self, index: int) -> None:
        """Block until group ``index``'s sub-group is done (and every one before it).

        Raises:
            BaseException: what the optimizer's step raised in the worker for this sub-group or
                one before it (the step ends there: see :meth:`abort`).
        """
        k = self.of_group.get(index)
        if k is not None:
            self._drive(k)

    def wait_all(self) -> None:
        """Block until the whole step is done. Raises what the worker raised, as :meth:`wait`."""
        if self.subgroups:
            self._drive(len(self.subgroups) - 1)

    def _drive(self, last: int) -> None:
        while self._done <= last:
            k = self._done
            self.pump()
            if self.stage[k] == _PENDING:
                self._read(k, ahead=False)
            if self.stage[k] == _READING:
                self._submit(k)
            if self.stage[k] == _STEPPING:
                for j in range(k + 1, min(k + 1 + self.read_ahead, len(self.subgroups))):
                    if self.stage[j] == _PENDING:
                        self._read(j, ahead=True)
                self._finish(k)
            self._advance_done()

    def _advance_done(self) -> None:
        while self._done < len(self.subgroups) and self.stage[self._done] == _DONE:
            self._done += 1

    # --- stages -------------------------------------------------------------------------------------
    def _read(self, k: int, ahead: bool) -> None:
        if self.offload.nvme:
            self.offload.claim(self.subgroups[k], ahead)
        self.stage[k] = _READING

    def _read_complete(self, k: int) -> bool:
        return not self.offload.nvme or self.offload.reads_complete(self.subgroups[k])

    def _submit(self, k: int) -> None:
        """Hand sub-group ``k`` (in memory) to the worker."""
        members = self.subgroups[k]
        if self.offload.nvme:
            self.offload.make_resident(members)  # what a read ahead gave up, read now
        pairs: list[tuple[Tensor, Tensor, int]] = []  # (fragment, its gradient, its param group)
        for i in members:
            group = self.offload.groups[i]
            for j, fragment in enumerate(group.fragments):
                if id(fragment) not in self.owned:
                    continue
                if self.offload.nvme:
                    if self._exposed[i][j]:
                        pairs.append((fragment, group.gradient_view(j), self._param_group[id(fragment)]))
                elif id(fragment) in self._grads:
                    pairs.append((fragment, self._grads.pop(id(fragment)), self._param_group[id(fragment)]))
        work = [self._twin(pairs), [grad for _, grad, _ in pairs]]
        self.futures[k] = self.worker.submit(_step, self.raw_step, work, self.clip_coef)
        self.stage[k] = _STEPPING

    def _twin(self, pairs: list[tuple[Tensor, Tensor, int]]) -> torch.optim.Optimizer:
        """A shallow copy of the optimizer that steps ``pairs`` (fragment, gradient, param group
        index): its param groups hold proxies of the fragments (their memory, not their identity,
        each with its gradient) with the options of the call, and its state maps each proxy to the
        fragment's own state dict, created here if new: the worker never inserts into the
        optimizer's own (default)dict while the main thread may read it."""
        # Every attribute of the optimizer (a subclass's own too), but no step hooks: a subclass
        # whose step calls super().step() must not run the engine's hooks a second time.
        twin = object.__new__(type(self.optimizer))
        twin.__dict__.update(self.optimizer.__dict__)
        twin._optimizer_step_pre_hooks = collections.OrderedDict()
        twin._optimizer_step_post_hooks = collections.OrderedDict()
        groups = [{**options, "params": []} for options in self.hyper]
        twin.state = {}
        for fragment, grad, g in pairs:
            proxy = fragment.detach()
            proxy.grad = grad
            groups[g]["params"].append(proxy)
            twin.state[proxy] = self.optimizer.state[fragment]
        twin.param_groups = groups
        return twin

    def _finish(self, k: int) -> None:
        """Sub-group ``k`` was handed to the worker: wait for it, then send it out."""
        try:
            self.futures[k].result()
        except BaseException:
            self.abort()
            raise
        for i in self.subgroups[k]:
            self.offload.send_out(self.optimizer, i)
        if k >= self.write_behind:
            # With write_behind 2, the writes of the sub-group before the previous one had two
            # sub-groups' time: settling them keeps about three sub-groups in staging memory.
            self.offload.settle(self.subgroups[k - self.write_behind])
        self.stage[k] = _DONE

    def abort(self) -> None:
        """End the step after an error (the optimizer's, a swap's, an interrupted wait): every
        sub-group handed to the worker is waited for (its memory may not be reused under it); those
        it stepped are sent out as usual where that works, the others' records given back
        unwritten (their files keep the state before the step; the gradients are dropped).
        Idempotent."""
        submitted = [f for k, f in enumerate(self.futures) if f is not None and self.stage[k] != _DONE]
        interrupted: Optional[BaseException] = None
        while True:  # not even an interrupt may leave the worker stepping memory that is given back
            try:
                wait(submitted)
                break
            except BaseException as error:  # a KeyboardInterrupt: wait on, raise it once cleaned up
                interrupted = interrupted or error
        for k in range(len(self.subgroups)):
            if self.stage[k] == _DONE:
                continue
            future = self.futures[k]
            stepped = future is not None and future.exception() is None
            self.stage[k] = _DONE
            try:
                if stepped:
                    for i in self.subgroups[k]:
                        self.offload.send_out(self.optimizer, i)
                    continue
            except BaseException:  # the first error is the one raised
                pass
            self.offload.release_unstepped(self.subgroups[k])
        self._done = len(self.subgroups)
        if interrupted is not None:
            raise interrupted


def _step(raw_step: Callable, work: list, clip_coef: Optional[Tensor]) -> None:
    """(The worker.) ``work`` is ``[twin, grads]`` (:meth:`StepPipeline._twin`, the gradients it
    steps with): scale the gradients by the clipping coefficient, if any, and run the optimizer's
    own step function (no hooks) on the twin.

    Nothing of the sub-group's memory is referenced by this thread once the step's future
    resolves: the main thread then gives the staging buffers back and the pool may free them
    (unregistering page-locked memory, :mod:`lightning_zinf.offload.staging`), while the thread
    pool keeps a finished task's arguments a while longer. So ``work`` is emptied here, and the
    frames of an exception (kept by the future) lose their locals.
    """
    twin, grads = work
    work.clear()
    try:
        if clip_coef is not None:
            for grad in grads:
                grad.mul_(clip_coef)
        raw_step(twin)
    except BaseException as error:
        traceback.clear_frames(error.__traceback__)  # the step's frames: the twin, its proxies
        raise
    finally:
        del twin, grads
