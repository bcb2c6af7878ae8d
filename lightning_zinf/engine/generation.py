"""Generation inside training: units kept gathered across forward passes, and RLHF's generation
phase (rollouts, reward and reference forwards inside a training step).

:meth:`Generation.keep_gathered` keeps the units a forward finished with gathered within a budget,
so the decode steps of one ``generate()`` do not gather them again; :meth:`Generation.phase` adds
what ZeRO++ does for a generation phase (a trace per outermost module, one agreement check on
exit, qwZ's rows quantized once). Both tell ``transformers`` and Dynamo that the model is
partitioned, through FSDP2's markers (:func:`mark_partitioned`), except while the whole model is
kept gathered.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Hashable, Iterator, Optional

from torch import nn

from lightning_zinf.engine.agreement import RankAgreement
from lightning_zinf.engine.flat import FlatGroup
from lightning_zinf.engine.schedule import Schedule
from lightning_zinf.engine.trace import Tracer
from lightning_zinf.engine.units import Unit, UnitStates

__all__ = ["Generation", "mark_partitioned"]


class Generation:
    """Keeps units gathered between forward passes, and runs generation phases (the engine's
    :meth:`~lightning_zinf.ZeroEngine.keep_gathered` and
    :meth:`~lightning_zinf.ZeroEngine.generation_phase` delegate here).

    Args:
        module: The partitioned model.
        units: The engine's units.
        states: The unit state machine (its ``keep_budget`` says what stays gathered).
        tracer: The engine's trace of unit gathers.
        schedule: The engine's hooks (a pass per outermost forward inside a phase).
        agreement: The rank agreement (a phase's entry and exit are checked).
        settle: Finishes every collective and swap in flight (the engine's).
        begin_pass: The engine's pass boundary, called as ``begin_pass(kind, check=...)``.
        auto_pass: The engine starts a pass at every forward of ``module`` itself.

    Attributes:
        active: Inside :meth:`phase`.
        verifying: How many :meth:`keep_gathered` blocks with ``verify`` are open (the passes begun
            inside one are not checked at their start).
        resume_kind: The kind of the last pass begun outside a phase (``None``: none yet), begun
            again when a phase ends (the engine's :meth:`~lightning_zinf.ZeroEngine.begin_pass`
            records it).
    """

    def __init__(self, module: nn.Module, units: list[Unit], *, states: UnitStates, tracer: Tracer,
                 schedule: Schedule, agreement: RankAgreement, settle: Callable[[], None],
                 begin_pass: Callable[..., None], auto_pass: bool) -> None:
        self.module = module
        self.units = units
        self.states = states
        self.tracer = tracer
        self.schedule = schedule
        self.agreement = agreement
        self._settle = settle
        self._begin_pass = begin_pass
        self._auto_pass = auto_pass
        self.active = False
        self.resume_kind: Optional[Hashable] = None
        # keep_gathered blocks open that verify the ranks' collectives at their end (the passes in
        # them are not checked one by one: their ranks may run different numbers of passes).
        self.verifying = 0

    @property
    def groups(self) -> list[FlatGroup]:
        """All flat groups, unit by unit."""
        return [g for u in self.units for g in u.groups]

    @contextmanager
    def keep_gathered(self, budget: int, verify: bool = True) -> Iterator[None]:
        """Within the block, a unit that finishes its forward stays gathered while the gathered
        bytes stay within ``budget`` (bytes), so later forward passes (the decode steps of one
        ``generate()``) do not gather it again; on exit every unit kept is released. For passes
        without gradients; a backward inside the block still works (units are released as usual).
        Every rank must run the same forward passes in the block while gathers happen
        (``transformers``' ``generate`` does, with ``synced_gpus``, which it turns on for a model
        this engine partitions). When the budget holds every unit, only the first forward gathers,
        so ``generate`` runs without ``synced_gpus`` (no all-reduce per token): a rank whose
        sequences end first may stop. DeepSpeed's hybrid engine likewise gathers the model once per
        ``generate`` call; this does so within a memory budget.

        Args:
            budget: Most bytes of gathered parameters kept (``0``: release as usual).
            verify: On exit, check that every rank issued the same collectives in the block (a
                collective: every rank must leave the block at the same point). The Lightning
                strategy's steps leave it off and meet the other ranks at the end of the step
                instead, where ranks with more steps than the others go on.
        """
        previous = self.states.keep_budget
        self.states.keep_budget = budget
        self.verifying += verify
        whole = self._holds_whole_model(budget)
        if whole:
            mark_partitioned(self.module, False)
        try:
            yield
        finally:
            self.verifying -= verify
            if whole:
                mark_partitioned(self.module, True)
            self.states.keep_budget = previous
            if previous == 0:
                self.states.release_kept()
                if verify:
                    self.agreement.verify()
            elif budget > previous:
                # Inside a block that keeps less (an evaluation loop's): what this one kept beyond
                # that would stay kept for the rest of the outer block; the outer block's next
                # forwards keep their own again.
                self.states.release_kept()

    def _holds_whole_model(self, budget: int) -> bool:
        return budget >= sum(g.padded_numel * g.compute_dtype.itemsize for g in self.groups)

    @contextmanager
    def phase(self, budget: int) -> Iterator[None]:
        """A generation phase inside a training step: RLHF's rollouts (``generate()`` of the
        actor, a reward model's forward, a reference forward under PEFT's ``disable_adapter()``),
        with ZeRO++'s behaviour for it (Wang et al., "ZeRO++", 2023, §4 and its RLHF generation
        results; DeepSpeed's hybrid engine and DeepSpeed-Chat switch the same way between
        generation and training). Use under ``torch.no_grad()``; every rank enters and leaves it
        at the same point. Inside it:

        - every outermost forward of a module of the model starts a trace pass of its own kind,
          ``("generation", qualified name of that module)`` (:meth:`Schedule.pass_per_outer_forward
          <lightning_zinf.engine.schedule.Schedule.pass_per_outer_forward>`), so each decode step
          replays one stable trace: after the first forward of each kind no gather is checked with
          the other ranks one by one (a control exchange each, across nodes), and no pass
          boundary checks either; the ranks' collectives are verified once, on exit;
        - parameters may be frozen and unfrozen for a while (PEFT's ``disable_adapter()`` sets the
          adapters' ``requires_grad`` off): flags are read at the next training pass after it;
        - units stay gathered within ``budget`` bytes as in :meth:`keep_gathered` (a budget below
          the whole model keeps ``transformers``' ``synced_gpus`` on, the whole model turns it off);
        - with qwZ, each flat group's shard is quantized at most once: the packed row of codes and
          scales made at its first quantized gather is kept (accounted as ``"secondary"``) and sent
          again by later gathers, until the phase ends or the shard changes (a step, a load, an
          edit). Groups stored as frozen codes are never quantized, and hpZ's secondary partitions
          keep re-gathers inside the node already. The rows sit on the compute device (about one
          byte per element of this rank's shards, outside ``budget``): with parameters offloaded
          to the host or NVMe that is a quarter of the fp32 shards' bytes brought to the device
          for the phase.

        On exit the kept units are released, the kept rows dropped, the ranks' collectives verified
        (one exchange) and, without ``auto_pass``, a pass of the kind begun before the phase
        (``"train"``) starts again, so the training forward and backward that follow replay their
        own trace: switching costs at most one gather more of each unit. A phase entered inside
        another is part of it.

        Args:
            budget: Most bytes of gathered parameters kept between forward passes (``0``: none).

        Raises:
            ValueError: ``budget`` is not a non-negative int.
            RuntimeError: on exit, the ranks' collectives in the phase differ
                (:meth:`~lightning_zinf.ZeroEngine.verify_ranks_agree`).
        """
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise ValueError(f"generation_phase: budget must be a non-negative number of bytes (an int), got {budget!r}; "
                             "pass PrefetchConfig.inference_budget or 0.")
        if self.active:
            yield
            return
        previous = self.resume_kind
        self._settle()
        # Every rank must enter: one that does not goes on to the agreed trace's gathers, which
        # only the watch can tell from a slow rank (a hang until the timeout otherwise).
        self.agreement.check_entry("entry into a generation phase, strategy.generation()")
        self.active = True
        end_passes = self.schedule.pass_per_outer_forward(
            self.module, lambda name: self._begin_pass(("generation", name), check=False))
        for group in self.groups:
            group.keeps_qwz_row = True
        # The whole model kept: no synced_gpus, so ranks run different numbers of forward passes,
        # and a pass that leaves its kind's trace (a decode that skips a module only the prefill
        # runs) must not start a recording whose validation only some ranks would reach.
        self.tracer.rerecord = not self._holds_whole_model(budget)
        try:
            with self.keep_gathered(budget):  # verifies the ranks' collectives at its end
                try:
                    yield
                finally:
                    end_passes()
                    # Ranks may have run different numbers of decode passes: the last pass's trace is
                    # validated here, at the same point on every rank, before the check on exit.
                    self.tracer.end_pass()
        finally:
            self.active = False
            self.tracer.rerecord = True
            for group in self.groups:
                group.keeps_qwz_row = False
                group.drop_qwz_row()  # after the release above settled the gathers that send it
        if previous is not None and not self._auto_pass:  # with auto_pass the next forward starts its pass
            self._begin_pass(previous, check=False)


def mark_partitioned(module: nn.Module, on: bool) -> None:
    """Set (or clear) FSDP2's markers on ``module`` and every submodule: the model's parameters are
    partitioned, and gathered by forward passes collectively."""
    # transformers' generate() reads FSDP2's marker to keep all ranks stepping until every
    # rank's sequences are done (synced_gpus): forward passes gather collectively here too.
    # Dynamo reads the pair FSDP2 sets: parameters keep their identity while their storage comes
    # and goes, so it takes them as graph inputs and guards nothing on them (with the marker
    # alone it refuses the module and runs it uncompiled).
    for submodule in module.modules():
        submodule._is_fsdp_managed_module = on  # type: ignore[assignment]
        submodule._fsdp_use_orig_params = on  # type: ignore[assignment]
