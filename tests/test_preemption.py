"""Preemption: a real signal to one rank of a real 2-process run saves a checkpoint on every rank at
the same step and ends every process with the documented status; resuming from that checkpoint
reproduces an uninterrupted run's losses exactly.

Each run is ``tests/preemption_script.py`` (a Trainer, or a Fabric loop, 8 steps, AdamW and a
step-interval LR scheduler), started as a subprocess through Lightning's own launcher
(``python script.py``: rank 0 starts rank 1) or through torchrun. The rank to be signalled waits
inside step 3 until the test has sent the signal with ``os.kill`` to that rank's pid alone, so the
signal arrives at a known step. The reference is the same script run to the end without a signal.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch

from lightning_zinf import PreemptionConfig, ZeroInfinityStrategy

SCRIPT = Path(__file__).resolve().parent / "preemption_script.py"
ROOT = SCRIPT.parents[1]
STEPS, STOP_AT = 8, 3
SIG_DFL = repr(signal.Handlers.SIG_DFL)


def _env(out: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, OUT=str(out), STEPS=str(STEPS), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)
    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "TORCHELASTIC_RUN_ID",
                "LIGHTNING_ZINF_LAUNCHER_PID"):
        env.pop(key, None)
    return env


def _command(launcher: str) -> list[str]:
    if launcher == "lightning":
        return [sys.executable, str(SCRIPT)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
            f"--master_port={port}", str(SCRIPT)]


def _run(out: Path, launcher: str = "lightning", **extra: str) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.run(_command(launcher), env=_env(out, **extra), cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def _preempt(out: Path, launcher: str, signum: int, rank: int, **extra: str) -> tuple[int, str]:
    """Start a run that stops inside step ``STOP_AT``, send ``signum`` to rank ``rank``'s process
    alone, let the run go on; its exit status and stderr."""
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(_command(launcher), env=_env(out, STOP_AT=str(STOP_AT), **extra), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not (out / "at_step").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the run never reached step {STOP_AT}:\n{proc.communicate()[1][-3000:]}")
            time.sleep(0.05)
        time.sleep(0.2)  # the other rank is now waiting for this one inside a collective
        os.kill(int((out / f"pid{rank}").read_text()), signum)
        (out / "signalled").touch()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


def _losses(out: Path, rank: int, run: str) -> list[tuple[int, float]]:
    lines = (out / f"losses{rank}.{run}").read_text().split()
    return [(int(step), float.fromhex(value)) for step, value in zip(lines[::2], lines[1::2])]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().split()[2] != "Z"


def _assert_no_process_left(out: Path) -> None:
    pids = [int((out / f"pid{rank}").read_text()) for rank in range(2)]
    deadline = time.monotonic() + 10
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, pids)), f"a rank outlived the run: {[p for p in pids if _alive(p)]}"


def _assert_resumes_exactly(out: Path, reference: dict[int, list], launcher: str, **extra: str) -> None:
    """The losses before the stop are the reference's; resumed, the run trains the remaining
    steps with exactly the reference's losses (rtol 0: the same float32 bits)."""
    for rank in range(2):
        assert _losses(out, rank, "first") == reference[rank][: STOP_AT + 1]
    done = _run(out, launcher, RESUME="1", **extra)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(2):
        resumed = _losses(out, rank, "resumed")
        assert [step for step, _ in resumed] == list(range(STOP_AT + 1, STEPS))
        assert torch.equal(torch.tensor([v for _, v in resumed]), torch.tensor([v for _, v in reference[rank][STOP_AT + 1:]]))
    _assert_no_process_left(out)
    if (out / "checkpoints").is_dir():  # the resumed run's ModelCheckpoint(save_last=True) took last.ckpt as its own
        assert not list((out / "checkpoints").glob("last-v*.ckpt")), sorted(p.name for p in (out / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list]:
    """The losses of the uninterrupted run, by rank; while it trained, SIGTERM was the strategy's
    flag-only handler on both ranks (not Lightning's), and its previous handling is back after fit."""
    out = tmp_path_factory.mktemp("reference")
    done = _run(out)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(2):
        assert (out / f"handler{rank}.first").read_text() == "Preemption._on_signal"
        assert (out / f"handler_after{rank}.first").read_text() == SIG_DFL
    losses = {rank: _losses(out, rank, "first") for rank in range(2)}
    assert all([step for step, _ in losses[rank]] == list(range(STEPS)) for rank in range(2))
    return losses


def test_sigterm_to_rank_1_under_lightnings_launcher_saves_last_and_resumes_exactly(
        tmp_path: Path, reference: dict[int, list]) -> None:
    """``python script.py`` (rank 0 launched rank 1): SIGTERM to rank 1 only. Both ranks finish
    step 3, save ``checkpoints/last.ckpt`` and end: rank 0, whose status the scheduler sees, with
    143 (128 + SIGTERM); rank 1, which rank 0 launched, with 0 (else rank 0's launcher would kill
    everything as after a crash). No gloo error, no traceback."""
    code, err = _preempt(tmp_path, "lightning", signal.SIGTERM, rank=1)
    assert code == 143, err[-3000:]
    assert (tmp_path / "exit0.first").read_text() == "143" and (tmp_path / "exit1.first").read_text() == "0"
    assert "preempted (SIGTERM received by rank(s) 1; exit status 143)" in err
    assert "Traceback" not in err and "EnforceNotMet" not in err and "Connection closed" not in err, err[-3000:]
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()
    _assert_no_process_left(tmp_path)
    _assert_resumes_exactly(tmp_path, reference, "lightning")


def test_sigterm_to_rank_1_under_torchrun_ends_every_worker_with_143_and_resumes_exactly(
        tmp_path: Path, reference: dict[int, list]) -> None:
    """torchrun: both workers save and exit with 143; torchrun, seeing failed workers, exits 1 (its
    status for any failed worker), listing exit code 143 for each."""
    code, err = _preempt(tmp_path, "torchrun", signal.SIGTERM, rank=1)
    assert code == 1, err[-3000:]
    assert (tmp_path / "exit0.first").read_text() == "143" and (tmp_path / "exit1.first").read_text() == "143"
    assert err.count("exitcode  : 143") == 2, err[-3000:]
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()
    _assert_no_process_left(tmp_path)
    _assert_resumes_exactly(tmp_path, reference, "torchrun")


def test_sigusr1_to_rank_0_waiting_in_a_collective_saves_an_hpc_checkpoint(
        tmp_path: Path, reference: dict[int, list]) -> None:
    """``signals=["SIGUSR1"]`` and no ModelCheckpoint: SIGUSR1 reaches rank 0 while it waits for rank
    1 inside a collective (the handler runs when the collective returns). The checkpoint is
    Lightning's ``hpc_ckpt_1.ckpt``, the status 138 (128 + SIGUSR1), and ``ckpt_path="hpc"`` resumes
    exactly."""
    extra = dict(SIGNALS="SIGUSR1", NO_CHECKPOINT_CALLBACK="1")
    code, err = _preempt(tmp_path, "lightning", signal.SIGUSR1, rank=0, **extra)
    assert code == 138, err[-3000:]
    assert "preempted (SIGUSR1 received by rank(s) 0; exit status 138)" in err
    assert (tmp_path / "hpc_ckpt_1.ckpt").exists() and not (tmp_path / "checkpoints").exists()
    _assert_no_process_left(tmp_path)
    _assert_resumes_exactly(tmp_path, reference, "lightning", **extra)


def test_a_fabric_loop_stops_saves_and_resumes_exactly_with_its_exit_code(
        tmp_path: Path, reference: dict[int, list]) -> None:
    """A Fabric loop that checks ``fabric.strategy.preempted()`` after each step, saves with
    ``fabric.save`` and ends with ``exit_preempted()``; ``exit_code=75``. The same training as the
    Trainer's (the same engine), so the Trainer's reference losses are its own."""
    code, err = _preempt(tmp_path, "lightning", signal.SIGTERM, rank=1, FABRIC="1", EXIT_CODE="75")
    assert code == 75, err[-3000:]
    assert (tmp_path / "exit0.first").read_text() == "75" and (tmp_path / "exit1.first").read_text() == "0"
    assert (tmp_path / "fabric.ckpt").exists()
    _assert_no_process_left(tmp_path)
    _assert_resumes_exactly(tmp_path, reference, "lightning", FABRIC="1")


def test_preemption_config_errors_name_the_field_the_value_and_what_is_allowed() -> None:
    assert PreemptionConfig(signals=["term", 10, "SIGTERM"]).signals == ("SIGTERM", "SIGUSR1")
    assert PreemptionConfig(signals="SIGUSR2").signals == ("SIGUSR2",)
    assert PreemptionConfig(enabled=False, signals=()).signals == ()
    assert PreemptionConfig(checkpoint=Path("/x/y.ckpt")).checkpoint == "/x/y.ckpt"
    cases = [
        (dict(signals=["SIGKILL"]), r"PreemptionConfig.signals='SIGKILL' is invalid: allowed values are a non-empty "
                                    r"list of signal names or numbers among SIGTERM, SIGUSR1"),
        (dict(signals=["SIGFOO"]), r"PreemptionConfig.signals='SIGFOO' is invalid"),
        (dict(signals=[9]), r"PreemptionConfig.signals=9 is invalid"),
        (dict(signals=[]), r"PreemptionConfig.signals=\[\] is invalid: .*\(or enabled=False\)"),
        (dict(exit_code=256), r"PreemptionConfig.exit_code=256 is invalid: allowed values are None \(128 \+ the "
                              r"signal's number\) or an integer from 0 to 255"),
        (dict(exit_code=True), r"PreemptionConfig.exit_code=True is invalid"),
        (dict(checkpoint=""), r"PreemptionConfig.checkpoint='' is invalid: allowed values are 'last', 'hpc' or a path"),
        (dict(enabled="yes"), r"PreemptionConfig.enabled='yes' is invalid: allowed values are True or False"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            PreemptionConfig(**kwargs)
    with pytest.raises(ValueError, match=r"PreemptionConfig has no option 'signal'. Did you mean 'signals'\?"):
        ZeroInfinityStrategy(preemption={"signal": ["SIGTERM"]})
    with pytest.raises(ValueError, match=r"PreemptionConfig.exit_code=-1 is invalid"):
        ZeroInfinityStrategy(preemption={"exit_code": -1})


_YAML = """
trainer:
  accelerator: cpu
  devices: 1
  logger: false
  strategy:
    class_path: lightning_zinf.ZeroInfinityStrategy
    init_args:
      preemption: {{signals: [SIGUSR1, SIGTERM], checkpoint: hpc, exit_code: {code}}}
model:
  class_path: lightning.pytorch.demos.boring_classes.BoringModel
"""


def test_preemption_is_set_from_a_lightningcli_yaml(tmp_path: Path) -> None:
    """What ``zinf fit --config`` parses (it is ``LightningCLI`` with the package imported); a value
    the config refuses fails with its message (``zinf`` shows it as a usage error)."""
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(_YAML.format(code=75))
    cli = LightningCLI(L.LightningModule, run=False, subclass_mode_model=True, args=["--config", str(config)])
    assert cli.trainer.strategy.options.preemption == PreemptionConfig(signals=("SIGUSR1", "SIGTERM"),
                                                                       checkpoint="hpc", exit_code=75)
    config.write_text(_YAML.format(code=300))
    with pytest.raises(ValueError, match=r"PreemptionConfig.exit_code=300 is invalid"):
        LightningCLI(L.LightningModule, run=False, subclass_mode_model=True, args=["--config", str(config)])
