"""Ranks that diverge or fail: every rank ends, within the strategy's timeout, with the message of
the rank that went wrong, and no process outlives the run.

Each case runs ``tests/failure_script.py`` (a real Trainer, ``timeout=20 s``) as two real processes
and observes them from outside: exit codes, each process's stderr, wall time, and whether a pid is
still alive afterwards. Started with the rendezvous variables set (as torchrun starts them), or
through Lightning's own launcher (rank 0 starts rank 1).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "failure_script.py"
ROOT = SCRIPT.parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(scenario: str, out: Path) -> dict[str, str]:
    env = dict(os.environ, FAILURE=scenario, OUT=str(out), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        env.pop(key, None)
    return env


def _run_ranks(scenario: str, out: Path, timeout: float = 120) -> tuple[list[tuple[int, str]], float]:
    """Both ranks as separate processes with the rendezvous variables set; (exit code, stderr) per
    rank and the wall time until the last one ended."""
    port = _port()
    procs = []
    start = time.monotonic()
    for rank in range(2):
        env = _env(scenario, out) | dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
                                         RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0")
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"{scenario}: a rank still ran after {timeout} s")
        results.append((proc.returncode, err))
    return results, time.monotonic() - start


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.mark.parametrize("scenario", ["rank_only_first", "rank_only_later", "rank_only_validation",
                                      "rank_only_predict", "fabric_rank0_forward"])
def test_a_module_run_on_one_rank_no_longer_stops_the_run(scenario: str, tmp_path: Path) -> None:
    """Rank 0 alone runs a module: from the first step, from step 2 (after the ranks agreed on a
    trace), in validation, in ``trainer.predict``, and LitGPT's fine-tuning pattern (a forward on
    rank 0 alone, ``generate_example``, then ``fabric.barrier()``). The other ranks serve its gathers
    (:mod:`lightning_zinf.engine.negotiation`) and every rank finishes: these runs used to end
    with "Ranks diverged", or with the watch reporting a deadlock (rank 0 in the forward's
    agreement check, rank 1 in the barrier). tests/test_divergence.py checks the results against DDP.

    At the end no gloo thread is left for the interpreter's shutdown (which aborted rank 1 of the
    Fabric loop once in CI with "terminate called without an active exception", after its last
    step): the script's first exit handler, run last, lists the process's threads."""
    results, wall = _run_ranks(scenario, tmp_path)
    for code, err in results:
        assert code == 0, err[-3000:]
        assert "Ranks diverged" not in err and "deadlocked" not in err
    assert wall < 60
    for rank in range(2):
        threads = (tmp_path / f"threads{rank}").read_text().split()
        assert threads and not [name for name in threads if "gloo" in name], (rank, threads)


def test_a_generation_phase_entered_on_one_rank_is_named_on_every_rank(tmp_path: Path) -> None:
    """From step 2 rank 0 alone enters ``strategy.generation()`` (a rollout only it runs) while rank 1
    goes on to the agreed trace's gathers: rank 0's entry check posts a notice the watch sees
    unmatched, and both ranks end with the divergence naming the phase, not at the timeout."""
    results, wall = _run_ranks("generation_rank0_only", tmp_path)
    for code, err in results:
        assert code == 1, err[-3000:]
        assert "Ranks diverged" in err and "generation phase" in err, err[-3000:]
    assert wall < 60


def test_an_exception_on_one_rank_ends_every_rank_with_its_message(tmp_path: Path) -> None:
    results, wall = _run_ranks("raise", tmp_path)
    for code, err in results:
        assert code == 1
        assert "ValueError: boom in rank 1's training_step" in err, err[-3000:]
    assert "lightning_zinf: the run failed first: rank 1: ValueError: boom" in results[0][1]
    assert wall < 45


def test_an_exception_in_the_offloaded_step_in_the_background_ends_every_rank_with_its_message(tmp_path: Path) -> None:
    """The optimizer's update raises on rank 1 alone, in the step running in the background
    (``overlap_step``): rank 1 raises it at its next wait (the next forward's first gather), and
    rank 0, blocked in that gather's collective, is ended with the message."""
    results, wall = _run_ranks("step_raise", tmp_path)
    for code, err in results:
        assert code == 1
        assert "ValueError: boom in rank 1's optimizer step" in err, err[-3000:]
    assert "in wait_stepped" in results[1][1], results[1][1][-3000:]  # raised at the wait, not in step()
    assert "lightning_zinf: the run failed first: rank 1: ValueError: boom" in results[0][1]
    assert wall < 45


def test_an_exception_in_a_fabric_loop_ends_every_rank_with_its_message(tmp_path: Path) -> None:
    """No Trainer to call ``on_exception``: the uncaught exception itself is reported."""
    results, wall = _run_ranks("fabric_raise", tmp_path)
    for code, err in results:
        assert code == 1
        assert "ValueError: boom in rank 1's Fabric loop" in err, err[-3000:]
    assert "what the error above follows from: rank 1: ValueError" in results[0][1]
    assert wall < 45


def test_a_corrupt_shard_file_is_named_on_every_rank(tmp_path: Path) -> None:
    results, _ = _run_ranks("save", tmp_path)
    assert all(code == 0 for code, _ in results), results[0][1][-2000:]
    (shard,) = (tmp_path / "ckpt").glob("save-*/rank_00001.safetensors")
    data = bytearray(shard.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")  # after the header, which still parses
    data[start:start + 64] = bytes(b ^ 0xFF for b in data[start:start + 64])  # the first tensor's head (a shard's tail may be padding)
    shard.write_bytes(bytes(data))
    results, wall = _run_ranks("corrupt", tmp_path)
    for code, err in results:
        assert code == 1
        assert "rank_00001.safetensors" in err, err[-3000:]
    assert wall < 45


@pytest.mark.parametrize("scenario", ["stuck", "killed"])
def test_a_stuck_or_dead_rank_ends_every_survivor_naming_it(scenario: str, tmp_path: Path) -> None:
    """Rank 1 hangs in its step (rank 0's collective times out after 20 s) or is killed (rank 0's
    collective breaks at once): rank 0 ends naming rank 1, and a hanging rank 1 is ended too."""
    results, wall = _run_ranks(scenario, tmp_path)
    code, err = results[0]
    assert code == 1
    named = "rank 1 is at collective #" if scenario == "stuck" else "rank 1 (pid "
    assert "lightning_zinf: this collective failed: rank 0: " in err and named in err, err[-3000:]
    if scenario == "stuck":
        assert results[1][0] == 1 and "ending this rank because another one failed" in results[1][1]
    assert wall < 20 + 5 + 20  # the timeout, the grace period, start-up


def test_a_rank_dead_in_hybrid_shardings_all_reduce_ends_the_survivor_naming_it(tmp_path: Path) -> None:
    """Hybrid sharding with a group per rank: each gradient shard is all-reduced across the groups
    on a thread of its own (gloo) while backward goes on. Rank 1 is killed in backward with that
    all-reduce under way: rank 0 does not hang in it or in the step after; it ends naming rank 1."""
    results, wall = _run_ranks("killed_in_reduce", tmp_path)
    assert results[1][0] == -signal.SIGKILL
    code, err = results[0]
    assert code == 1
    assert "rank 1 (pid " in err, err[-3000:]
    assert wall < 20 + 5 + 20


def test_an_exception_in_the_quantized_all_reduce_on_one_rank_ends_every_rank_with_its_message(tmp_path: Path) -> None:
    """Hybrid sharding with qgZ, a group per rank: the all-reduce across the groups moves codes in
    two collectives on a thread of its own. Its middle kernel raises on rank 1 alone, between
    them: rank 1 raises it at its wait, and rank 0, blocked in the second collective or the next,
    is ended with the message rather than left to the backend's timeout."""
    results, wall = _run_ranks("raise_in_quantized_reduce", tmp_path)
    for code, err in results:
        assert code == 1
        assert "ValueError: boom in rank 1's quantized all-reduce" in err, err[-3000:]
    assert "_all_reduce_mean_quantized" in results[1][1], results[1][1][-3000:]  # where it was raised
    assert "lightning_zinf: the run failed first: rank 1: ValueError: boom" in results[0][1], results[0][1][-3000:]
    assert wall < 45


def test_a_dead_rank_is_noticed_without_a_collective(tmp_path: Path) -> None:
    """Rank 1 is killed while rank 0 computes (no collective breaks to tell it, as a peer's death
    leaves an NCCL collective hanging): rank 0's watch sees rank 1's beats stop and ends it, well
    before rank 0's 120 s of work would have."""
    results, wall = _run_ranks("killed_quiet", tmp_path)
    assert results[0][0] == 1
    assert "rank 1 died or froze: no sign of life for" in results[0][1], results[0][1][-3000:]
    assert wall < 60


@pytest.mark.parametrize("scenario", ["killed_zero", "killed_zero_quiet"])
def test_a_dead_rank_0_that_hosts_the_store_is_named_by_the_survivor(scenario: str, tmp_path: Path) -> None:
    """Rank 0 hosts the rendezvous store (as under Lightning's launcher): when it is killed, the
    failure channel goes with it. Rank 1, in a collective that breaks (``killed_zero``) or computing
    outside any (``killed_zero_quiet``), still ends within the watch's interval and grace period,
    its last line naming rank 0 and its pid, with no C++ stack trace of the lost store."""
    results, _ = _run_ranks(scenario, tmp_path)
    ended = time.time()
    assert results[0][0] == -signal.SIGKILL
    code, err = results[1]
    assert code == 1, err[-3000:]
    pid0 = (tmp_path / "pid0").read_text()
    named = f"rank 0 (pid {pid0} on {socket.gethostname()}; it hosts the rendezvous store at 127.0.0.1:"
    last = err.strip().splitlines()[-1]
    assert named in last and "is gone: its process is dead" in last, err[-3000:]
    assert "TCPStore" not in err and "frame #" not in err, err[-3000:]
    assert err.count("Traceback") <= 1, err  # the broken collective's own, not a second one at teardown
    assert ended - float((tmp_path / "killed_at").read_text()) < 1 + 5 + 5  # interval, grace, slack
    for rank in range(2):
        assert not _alive(int((tmp_path / f"pid{rank}").read_text())), f"rank {rank} outlived the run"


def test_no_process_outlives_the_run_under_lightnings_launcher(tmp_path: Path) -> None:
    """``python script.py`` with devices=2: rank 0 starts rank 1; rank 1 hangs in user code. When
    rank 0 has ended, rank 1 is gone too."""
    done = subprocess.run([sys.executable, str(SCRIPT)], env=_env("stuck", tmp_path), cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    pid = int((tmp_path / "pid1").read_text())
    deadline = time.monotonic() + 15
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _alive(pid), "rank 1 outlived the run"


def test_no_process_outlives_the_run_under_torchrun(tmp_path: Path) -> None:
    """The same hang under ``torchrun --nproc_per_node 2`` (its agent hosts the store): rank 0
    ends naming rank 1, and neither process is left."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(SCRIPT)], env=_env("stuck", tmp_path), cwd=ROOT, capture_output=True, text=True,
                          timeout=150)
    assert done.returncode != 0
    assert "rank 1 is at collective #" in done.stderr, done.stderr[-3000:]
    for rank in range(2):
        assert not _alive(int((tmp_path / f"pid{rank}").read_text())), f"rank {rank} outlived the run"
