"""A two-node cluster on one machine: ZeRO-3 vs ZeRO++ over a slow inter-node link.

Builds two Linux network namespaces (the "nodes") joined by a veth pair, and limits each end of the
pair with a token bucket (``tc qdisc ... tbf rate R``), so that traffic between the nodes crosses a
link of bandwidth R while traffic inside a node stays on that namespace's loopback (a rank reaching
the other rank of its own node connects to its own node's address, which the kernel delivers
locally). In each namespace it starts ``train.py`` as node 0 or 1 of a real multi-node Lightning
job (``NODE_RANK``, ``MASTER_ADDR`` on node 0's veth address, gloo bound to the veth with
``GLOO_SOCKET_IFNAME``), 2 ranks per node. For every bandwidth it runs each ``--contenders`` entry
(``train.py``'s: ZeRO-3, ZeRO++ with hpZ, qwZ and qgZ, grad_op, hybrid, FSDP2's ZeRO-3 and its HSDP,
and ``compute``, the same step with no communication at all, the testbed's bound; by default ZeRO-3
and ZeRO++) ``--repeats`` times, and reports the step time (the median over
repeats of each run's mean after the first 5 steps), each contender's throughput against ZeRO-3's,
and the bytes that crossed the link per step from the veth's counters next to the engine's own
count.

Needs root (namespaces, veth, tc) and the ``ip`` and ``tc`` commands; without them it says why and
exits 0. Everything it creates is removed at the end, also after a failure. The kernel here has no
``netem`` qdisc, so the link has no added delay, only the bandwidth limit.

    sudo python examples/benchmarks/cluster/cluster.py [--rates 1000mbit 100mbit] [--steps 30]
        [--contenders zero3 zero_pp grad_op hybrid fsdp2 fsdp2_hsdp] [--repeats 3]

``--job rlhf`` runs the RLHF example's GRPO step instead (``rlhf_train.py``: a LoRA actor and a
frozen reward model built from seeds, ``--width``/``--layers``), at each ``--budgets`` value of
``inference_budget``, and reports per contender the generation phase's bytes generated per second
per rank, the training phase's seconds per step, the engine's inter-node bytes of each phase, and
peak memory per rank (the ledger's, and the process's RSS), with ZeRO++'s ratios to ZeRO-3:

    sudo python examples/benchmarks/cluster/cluster.py --job rlhf --steps 6 [--width 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
NODES = ("zinf-node0", "zinf-node1")
VETH = ("zinf-veth0", "zinf-veth1")
ADDR = ("10.213.0.1", "10.213.0.2")
PORT = 29533
WARM = 5  # steps left out of the train job's means


def sh(*cmd: str, ns: str | None = None, check: bool = True) -> str:
    """Run a command (inside namespace ``ns``), return its stdout."""
    full = ["ip", "netns", "exec", ns, *cmd] if ns else list(cmd)
    return subprocess.run(full, check=check, capture_output=True, text=True).stdout


def teardown() -> None:
    """Remove the namespaces (which removes the veth pair and its qdiscs with them)."""
    for ns in NODES:
        sh("ip", "netns", "del", ns, check=False)


def build(rate: str) -> None:
    """Two namespaces, a veth pair between them, an address on each end, the rate limit on both."""
    teardown()
    for ns in NODES:
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "set", "lo", "up", ns=ns)
    sh("ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
    for ns, dev, addr in zip(NODES, VETH, ADDR):
        sh("ip", "link", "set", dev, "netns", ns)
        sh("ip", "addr", "add", f"{addr}/24", "dev", dev, ns=ns)
        sh("ip", "link", "set", dev, "up", ns=ns)
        # Egress shaping on both ends: each direction of the link gets `rate`.
        sh("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb", "latency", "100ms", ns=ns)


def link_bytes() -> int:
    """Bytes node 0 has sent and received over the veth so far."""
    stats = Path("/sys/class/net") / VETH[0] / "statistics"
    return sum(int(sh("cat", str(stats / name), ns=NODES[0])) for name in ("tx_bytes", "rx_bytes"))


def run(contender: str, steps: int, workdir: Path, script: str = "train.py", extra: tuple[str, ...] = (),
        tag: str = "") -> dict:
    """``script`` (one node's side of the job) on both nodes; returns rank 0's result plus the
    link's byte count."""
    out = workdir / f"{contender}{tag}.json"
    env = {**os.environ, "MASTER_ADDR": ADDR[0], "MASTER_PORT": str(PORT), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    before = link_bytes()
    procs = []
    for node, (ns, dev) in enumerate(zip(NODES, VETH)):
        node_env = {**env, "NODE_RANK": str(node), "GLOO_SOCKET_IFNAME": dev}
        cmd = ["ip", "netns", "exec", ns, sys.executable, str(HERE / script), contender, "--steps", str(steps),
               "--out", str(out), *extra]
        log = open(workdir / f"{contender}-node{node}.log", "w")
        procs.append(subprocess.Popen(cmd, env=node_env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
    codes = [p.wait(timeout=3600) for p in procs]
    if any(codes):
        tail = (workdir / f"{contender}-node0.log").read_text()[-3000:]
        raise RuntimeError(f"{contender} failed (exit codes {codes}); node 0's log ends with:\n{tail}")
    result = json.loads(out.read_text())
    result["link_bytes"] = link_bytes() - before
    return result


def train_job(args: argparse.Namespace, tmp: Path) -> dict:
    """The main job's training (``train.py``), each contender ``--repeats`` times at each rate:
    the median of the runs' mean step times, and their link bytes per step."""
    results: dict = {"warm_up_steps": WARM, "repeats": args.repeats}
    for rate in args.rates:
        build(rate)
        for contender in args.contenders:
            began = time.perf_counter()
            runs = [run(contender, args.steps, tmp) for _ in range(args.repeats)]
            means = sorted(sum(got["step_s"][WARM:]) / len(got["step_s"][WARM:]) for got in runs)
            got = runs[0]
            engine = sum(got["node_inter_bytes"]) / len(got["node_inter_bytes"])
            results[f"{rate}/{contender}"] = {
                "step_s": means[len(means) // 2],
                "step_s_runs": means,
                "engine_inter_bytes_per_step": engine,
                "link_bytes_per_step": sum(r["link_bytes"] / len(r["step_s"]) for r in runs) / len(runs),
                "wall_s": time.perf_counter() - began,
                **({"choice": got["choice"]} if got.get("choice") else {}),
            }
            r = results[f"{rate}/{contender}"]
            if r.get("choice"):
                print(f"{rate:>9} {contender:>10}: {r['choice']}", flush=True)
            print(f"{rate:>9} {contender:>10}: {r['step_s']:.3f} s/step (runs {', '.join(f'{m:.3f}' for m in means)}), "
                  f"across the link per step: {r['link_bytes_per_step'] / 1e6:.2f} MB (veth, both directions, whole "
                  f"run / steps), {engine / 1e6:.2f} MB (engine, node 0's ranks)", flush=True)
        if "zero3" in args.contenders:
            base = results[f"{rate}/zero3"]
            results[f"{rate}/speedup"] = speedup = {
                f"{c}_over_zero3": base["step_s"] / results[f"{rate}/{c}"]["step_s"] for c in args.contenders if c != "zero3"}
            results[f"{rate}/link_bytes_ratio"] = {
                f"{c}_over_zero3": results[f"{rate}/{c}"]["link_bytes_per_step"] / base["link_bytes_per_step"]
                for c in args.contenders if c != "zero3"}
            for key, value in speedup.items():
                print(f"{rate:>9} {key.replace('_over_zero3', '')} throughput / ZeRO-3: {value:.2f}x", flush=True)
        if "hybrid" in args.contenders and "fsdp2_hsdp" in args.contenders:
            ratio = results[f"{rate}/fsdp2_hsdp"]["step_s"] / results[f"{rate}/hybrid"]["step_s"]
            results[f"{rate}/hybrid_over_fsdp2_hsdp"] = ratio
            print(f"{rate:>9} hybrid throughput / FSDP2 HSDP: {ratio:.2f}x", flush=True)
    return results


def rlhf_job(args: argparse.Namespace, tmp: Path) -> dict:
    """RLHF's GRPO step (``rlhf_train.py``), ZeRO-3 then ZeRO++, at each rate and inference
    budget: generation bytes/s per rank, the training phase's seconds per step, the engine's
    inter-node bytes of each phase, and peak memory per rank."""
    sys.path.insert(0, str(REPO))
    from examples.rlhf import save_stand_in_models

    # From seeds: the actor's base, and a reward model of half its width and depth.
    sft, reward = save_stand_in_models(tmp, args.width, args.layers, args.width // 2, max(1, args.layers // 2))
    warm = 1
    results: dict = {"warm_up_steps": warm, "width": args.width, "layers": args.layers}
    for rate in args.rates:
        build(rate)
        for budget in args.budgets:
            for contender in ("zero3", "zero_pp"):
                began = time.perf_counter()
                got = run(contender, args.steps, tmp, "rlhf_train.py",
                          ("--sft", str(sft), "--reward", str(reward), "--budget", str(budget)), f"-{budget}")
                step, gen = got["step_s"][warm:], got["generation_s"][warm:]
                n = len(step)
                r = results[f"{rate}/budget{budget}/{contender}"] = {
                    "generated_per_rank_per_s": sum(got["generated_per_rank"][warm:]) / sum(gen),
                    "generation_s": sum(gen) / n,
                    "training_phase_s": (sum(step) - sum(gen)) / n,
                    "generation_inter_bytes": sum(got["node_inter_bytes_generation"][warm:]) / n,
                    "training_inter_bytes": (sum(got["node_inter_bytes_step"][warm:])
                                             - sum(got["node_inter_bytes_generation"][warm:])) / n,
                    "link_bytes_per_step": got["link_bytes"] / len(got["step_s"]),
                    "ledger_peak_bytes": max(got["ledger_peak_bytes"]),
                    "peak_rss_bytes": max(got["peak_rss_bytes"]),
                    "wall_s": time.perf_counter() - began,
                }
                print(f"{rate:>9} budget {budget:>12} {contender:>8}: generation {r['generated_per_rank_per_s']:.1f} "
                      f"bytes/s per rank ({r['generation_s']:.2f} s, {r['generation_inter_bytes'] / 1e6:.2f} MB "
                      f"across nodes), training phase {r['training_phase_s']:.2f} s "
                      f"({r['training_inter_bytes'] / 1e6:.2f} MB across nodes), ledger peak "
                      f"{r['ledger_peak_bytes'] / 2**20:.1f} MiB, peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB",
                      flush=True)
            z3, zpp = results[f"{rate}/budget{budget}/zero3"], results[f"{rate}/budget{budget}/zero_pp"]
            results[f"{rate}/budget{budget}/speedup"] = speedup = {
                "generation": zpp["generated_per_rank_per_s"] / z3["generated_per_rank_per_s"],
                "training_phase": z3["training_phase_s"] / zpp["training_phase_s"]}
            print(f"{rate:>9} budget {budget:>12} ZeRO++ / ZeRO-3: generation {speedup['generation']:.2f}x, "
                  f"training phase {speedup['training_phase']:.2f}x", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", nargs="+", default=["1000mbit", "100mbit"], help="inter-node bandwidths (tc syntax)")
    parser.add_argument("--job", choices=["train", "rlhf"], default="train",
                        help="train: the main job's training (train.py); rlhf: the RLHF example's GRPO step (rlhf_train.py)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--contenders", nargs="+", default=["zero3", "zero_pp"],
                        choices=["zero3", "zero_pp", "grad_op", "hybrid", "hybrid_qgz", "hybrid_qgz8", "fsdp2",
                                 "fsdp2_hsdp", "auto", "compute"],
                        help="train: train.py's contenders, in this order at each rate (zero3 first for the ratios)")
    parser.add_argument("--repeats", type=int, default=1, help="train: runs per contender and rate (the median is kept)")
    parser.add_argument("--width", type=int, default=256, help="rlhf: the actor's width (the reward model's is half)")
    parser.add_argument("--layers", type=int, default=4, help="rlhf: the actor's layers (the reward model's: half)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[0, 1 << 40],
                        help="rlhf: inference_budget values, bytes (0: gather per forward; 2**40: the whole models)")
    parser.add_argument("--out", type=Path, default=HERE.parent / "results" / "cluster.json")
    args = parser.parse_args(argv)
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if os.geteuid() != 0 or missing:
        print(f"skipped: needs root and the ip and tc commands (euid {os.geteuid()}, missing {missing or 'none'})")
        return 0
    try:
        with tempfile.TemporaryDirectory(prefix="zinf-cluster-") as tmp:
            results = (rlhf_job if args.job == "rlhf" else train_job)(args, Path(tmp))
    finally:
        teardown()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"job": args.job, "steps": args.steps, **results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
