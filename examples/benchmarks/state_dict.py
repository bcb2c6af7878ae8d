"""``state_dict()`` / ``load_state_dict()`` of a partitioned model: zinf vs FSDP2, with DDP as the bound.

The examples' GPT (``examples/gpt.py``, fp32, tied embeddings; by default width 1024, 12 layers,
16 heads, vocabulary 8192, context 128: 159.7M parameters, 639 MB) on 2 ranks on CPU with gloo,
one thread per rank, each contender a ``torchrun`` job of its own, in plain PyTorch:

  zinf   ``ZeroEngine(model, block_classes=["Block"])`` on a model built under
         ``meta_parameters()`` (initialised unit by unit, as eager ``reset_parameters()`` would)
  fsdp2  the model built eagerly from the same seed, ``fully_shard`` on every block and on the root
  ddp    the model built eagerly from the same seed, ``DistributedDataParallel`` (every rank holds
         it whole: the bound for copying it)

Phases, each timed from a barrier to a barrier (so the time is until the slowest rank is done):

  full get   zinf: ``with state_dict_options(model, rank0_only=True): model.state_dict()``;
             fsdp2: ``get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
             cpu_offload=True))`` (rank 0 only); ddp: rank 0 copies ``model.module.state_dict()``
             (a tied tensor once).
  full load  of the file rank 0 wrote (``torch.save`` of its full dict, read back with
             ``torch.load(mmap=True)``, inside the timing), after zeroing every parameter:
             zinf: every rank ``model.load_state_dict(sd)`` (what it requires: every rank the
             same dict); fsdp2 "bcast": ``set_model_state_dict(model, sd, StateDictOptions(
             full_state_dict=True, broadcast_from_rank0=True))`` with the dict on rank 0 only (the
             variant torch documents for large models); fsdp2 "every": the same without broadcast,
             every rank passing the dict (the variant that matches zinf's contract); ddp: every rank
             ``model.module.load_state_dict(sd)``.
  dcp save   zinf: ``state_dict_options(model, sharded=True)`` + ``model.state_dict()`` (Shard(0)
             DTensors) + ``torch.distributed.checkpoint.save``; fsdp2: ``get_model_state_dict`` +
             ``dcp.save``; ddp: ``dcp.save`` of the replicated dict (DCP writes each tensor once).
  dcp load   after zeroing: the same dict as template, ``dcp.load`` into it, then
             ``model.load_state_dict`` / ``set_model_state_dict``.

Memory per rank and phase: the phase's peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` before it) minus the resident set before it, and a thread sampling
``RssAnon`` every millisecond (its peak growth: memory not backed by a file, so the mmap'd
checkpoint pages of a load do not count there). The claim under test: a zinf rank holds at most one
gathered unit beyond its shards, plus the result on rank 0.

Correctness, checked here: the full dicts of the three contenders are equal key for key and bit
for bit (same seed); after every load, a forward gives exactly the output of the freshly built model
(and the outputs agree across contenders). zinf's time is split by where it goes: the gathers
(``hold_exact``), releases and write-backs (``drop_exact``), the copies out (``_copy``) and the settle
(``begin_unit_access``).

    python examples/benchmarks/state_dict.py [--d-model 1024] [--layers 12] [--heads 16] [--vocab 8192]
        [--only zinf,fsdp2,ddp] [--dir /tmp/state_dict_bench]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))
from measure import add_self_launch_options, chosen_contenders, run_record, self_launched_rank  # noqa: E402

CONTENDERS = ("zinf", "fsdp2", "ddp")
MIB = 1 << 20


# --- memory ------------------------------------------------------------------------------------------
def _status() -> dict[str, int]:
    """``VmRSS``, ``VmHWM``, ``RssAnon``, ``RssFile`` of this process, bytes."""
    text = Path("/proc/self/status").read_text()
    return {k: int(re.search(rf"^{k}:\s+(\d+) kB", text, re.M).group(1)) * 1024
            for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}  # fmt: skip


def _malloc_trim() -> None:
    """Hand the C heap's free memory back to the OS (glibc), so that the resident set before a phase
    is what is live and the phase's growth cannot hide in memory freed earlier."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class Watch:
    """One phase of one rank: wall time from a barrier to a barrier, peak RSS growth (``VmHWM``,
    reset first) and peak ``RssAnon`` growth (sampled every millisecond by a thread); ``part(name)``
    records the time since the last part (the phase's steps, on this rank)."""

    def __init__(self, name: str, results: dict) -> None:
        self.name, self.results = name, results
        self.parts: dict[str, float] = {}

    def part(self, name: str) -> None:
        now = time.perf_counter()
        self.parts[name] = now - self._last
        self._last = now

    def __enter__(self) -> "Watch":
        import gc

        import torch.distributed as dist

        gc.collect()
        _malloc_trim()
        dist.barrier()
        try:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        except OSError:
            pass
        self.before = _status()
        self.peak_anon = self.before["RssAnon"]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        self.t0 = self._last = time.perf_counter()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_anon = max(self.peak_anon, _status()["RssAnon"])
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        if exc[0] is not None:
            return
        own = time.perf_counter() - self.t0
        dist.barrier()
        wall = time.perf_counter() - self.t0
        self._stop.set()
        self._thread.join()
        after = _status()
        self.results[self.name] = {
            "wall_s": wall, "own_s": own,
            "rss_before_mib": self.before["VmRSS"] / MIB,
            "hwm_growth_mib": (after["VmHWM"] - self.before["VmRSS"]) / MIB,
            "anon_growth_mib": (max(self.peak_anon, after["RssAnon"]) - self.before["RssAnon"]) / MIB,
            "rss_after_growth_mib": (after["VmRSS"] - self.before["VmRSS"]) / MIB,
            "parts_s": self.parts,
        }  # fmt: skip


class Breakdown:
    """Seconds and calls of the engine methods zinf's state-dict hooks call, on one rank
    (instance attributes wrapping the bound methods; lightning_zinf is not changed)."""

    def __init__(self, engine) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        for owner, name in ((engine, "begin_unit_access"), (engine, "hold_exact"), (engine, "drop_exact"),
                            (engine, "end_unit_access"), (engine.state_dict_hooks, "_copy")):  # fmt: skip
            self._wrap(owner, name)

    def _wrap(self, owner, name: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - t0)

        setattr(owner, name, timed)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.calls[name] = self.calls.get(name, 0) + 1

    def take(self) -> dict:
        out = {"seconds": self.seconds, "calls": self.calls}
        self.seconds, self.calls = {}, {}
        return out


# --- one rank ----------------------------------------------------------------------------------------
def run_rank(contender: str, args: argparse.Namespace) -> None:
    """One rank of one contender (under torchrun)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)  # fmt: skip

    from examples.gpt import GPT, Block, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    work = Path(args.dir) / contender
    if rank == 0:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
    dist.barrier()
    cfg = GPTConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                    seq_len=args.seq_len)  # fmt: skip
    torch.manual_seed(0)
    engine = breakdown = None
    info: dict = {}
    if contender == "zinf":
        from lightning_zinf import ZeroEngine, meta_parameters, state_dict_options

        with meta_parameters():
            model = GPT(cfg)
        engine = ZeroEngine(model, block_classes=[Block], device="cpu")
        info["params"] = sum(u.numel for u in engine.units)
        info["units"] = len(engine.units)
        info["largest_unit_mib"] = max(u.numel for u in engine.units) * 4 / MIB
        info["persistent_units"] = sum(u.persistent for u in engine.units)
        breakdown = Breakdown(engine)
        plain = model
        # zinf's load pre-hook calls DTensor.full_tensor() on each sharded value: time it too.
        from torch.distributed.tensor import DTensor

        full_tensor = DTensor.full_tensor

        def timed_full_tensor(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return full_tensor(self, *a, **k)
            finally:
                breakdown.add("DTensor.full_tensor", time.perf_counter() - t0)

        DTensor.full_tensor = timed_full_tensor
    else:
        model = GPT(cfg)
        if contender == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
            plain = model
        else:
            model = torch.nn.parallel.DistributedDataParallel(model)
            plain = model.module
    if engine is None:
        info["params"] = sum(p.numel() for p in plain.parameters())  # tied: counted once
    idx = torch.randint(cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(1))

    @torch.no_grad()
    def forward() -> torch.Tensor:
        out = plain(idx)
        if contender == "fsdp2":
            model.reshard()  # the root stays unsharded after its forward (expecting a backward)
        return out

    @torch.no_grad()
    def zero_parameters() -> None:
        if engine is not None:
            with engine.gathered(write_back=True):
                for p in plain.parameters():
                    p.zero_()
        else:
            for p in plain.parameters():
                p.zero_()
        if forward().abs().max().item() != 0.0:  # lm_head is zero: so are the logits
            raise AssertionError("zeroing the parameters did not reach the forward")

    reference = forward()
    checks: dict[str, float] = {}

    def check(name: str) -> None:
        checks[name] = (forward() - reference).abs().max().item()

    phases: dict[str, dict] = {}
    zinf_split: dict[str, dict] = {}
    full_file = work / "full.pt"

    # 1. full state dict to CPU, on rank 0
    if breakdown is not None:
        breakdown.take()
    with Watch("full_get", phases):
        if contender == "zinf":
            with state_dict_options(model, rank0_only=True):
                sd = model.state_dict()
        elif contender == "fsdp2":
            sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            sd = {}
            if rank == 0:
                copies: dict[int, torch.Tensor] = {}  # storage -> its copy: a tied tensor is copied once
                for k, v in plain.state_dict().items():
                    ptr = v.untyped_storage().data_ptr()
                    if ptr not in copies:
                        copies[ptr] = v.detach().clone()
                    sd[k] = copies[ptr]
    if breakdown is not None:
        zinf_split["full_get"] = breakdown.take()
    if rank == 0:
        info["full_keys"] = len(sd)
        storages = {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes() for v in sd.values()}
        info["full_result_mib"] = sum(storages.values()) / MIB  # tied tensors: once if they share storage
        torch.save(sd, full_file)
    elif len(sd):
        raise AssertionError(f"rank {rank}'s full state dict has {len(sd)} entries, expected none")
    del sd
    dist.barrier()

    # 2. full load
    def full_load(name: str, every_rank: bool, broadcast: bool = False) -> None:
        zero_parameters()
        if breakdown is not None:
            breakdown.take()
        with Watch(name, phases) as watch:
            sd = torch.load(full_file, mmap=True, weights_only=True) if every_rank or rank == 0 else {}
            watch.part("torch.load")
            if contender == "zinf":
                model.load_state_dict(sd)
            elif contender == "fsdp2":
                set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True,
                                                                          broadcast_from_rank0=broadcast))
            else:
                plain.load_state_dict(sd)
            watch.part("load")
            del sd
        if breakdown is not None:
            zinf_split[name] = breakdown.take()
        check(name)

    if contender == "fsdp2":
        full_load("full_load_bcast", every_rank=False, broadcast=True)
        full_load("full_load", every_rank=True)
    else:
        full_load("full_load", every_rank=True)

    # 3. sharded, through torch.distributed.checkpoint
    def sharded_sd() -> dict:
        if contender == "zinf":
            with state_dict_options(model, sharded=True):
                return model.state_dict()
        if contender == "fsdp2":
            return get_model_state_dict(model)
        return plain.state_dict()

    ckpt = work / "dcp"
    if breakdown is not None:
        breakdown.take()
    with Watch("dcp_get", phases):
        sd = sharded_sd()
    with Watch("dcp_save", phases):
        dcp.save(sd, checkpoint_id=ckpt)
    if breakdown is not None:
        zinf_split["dcp_get"] = breakdown.take()
    del sd
    zero_parameters()
    if breakdown is not None:
        breakdown.take()
    with Watch("dcp_load", phases) as watch:
        sd = sharded_sd()
        watch.part("template")
        dcp.load(sd, checkpoint_id=ckpt)
        watch.part("dcp.load")
        if contender == "fsdp2":
            set_model_state_dict(model, sd)
        else:
            plain.load_state_dict(sd)
        watch.part("load")
        del sd
    if breakdown is not None:
        zinf_split["dcp_load"] = breakdown.take()
    check("dcp_load")

    if rank == 0:
        torch.save(reference, work / "reference.pt")
        info["dcp_bytes"] = sum(f.stat().st_size for f in ckpt.iterdir())
    mine = {"rank": rank, "phases": phases, "checks": checks, "zinf_split": zinf_split}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    dist.barrier()  # every rank done: what rank 0 writes stands whatever the teardown does
    if rank == 0:
        Path(args.result).write_text(json.dumps({"info": info, "ranks": everyone, "dir": str(work)}))
    dist.barrier()
    # gloo's teardown here sometimes aborted one rank ("terminate called without an active
    # exception") and left the other waiting in destroy_process_group: leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --- driver ------------------------------------------------------------------------------------------
def compare_full(results: dict) -> dict:
    """Key sets and bitwise equality of the contenders' full dicts and forward references."""
    loaded = {name: torch.load(Path(r["dir"]) / "full.pt", mmap=True, weights_only=True)
              for name, r in results.items() if r["status"] == "ok"}  # fmt: skip
    refs = {name: torch.load(Path(r["dir"]) / "reference.pt", weights_only=True)
            for name, r in results.items() if r["status"] == "ok"}  # fmt: skip
    out: dict = {}
    names = list(loaded)
    for a, b in zip(names, names[1:]):
        sa, sb = loaded[a], loaded[b]
        differing = [k for k in sa.keys() & sb.keys() if not torch.equal(sa[k], sb[k])]
        out[f"{a}=={b}"] = {"keys_only_in_" + a: sorted(sa.keys() - sb.keys()),
                            "keys_only_in_" + b: sorted(sb.keys() - sa.keys()),
                            "values_differing": sorted(differing),
                            "forward_max_abs_diff": (refs[a] - refs[b]).abs().max().item()}  # fmt: skip
    return out


def drive(args: argparse.Namespace) -> None:
    results: dict[str, dict] = {}
    options = ["--d-model", str(args.d_model), "--layers", str(args.layers), "--heads", str(args.heads),
               "--vocab", str(args.vocab), "--seq-len", str(args.seq_len), "--dir", str(args.dir)]  # fmt: skip
    for name in args.only:
        print(f"[state_dict] running {name} ...", flush=True)
        start = time.perf_counter()
        data, error = self_launched_rank(__file__, name, options, args.timeout)
        if data is None:
            results[name] = {"status": "failed", "error": error}
            print(error)
            continue
        results[name] = {"status": "ok", "job_s": time.perf_counter() - start, **data}
    equality = compare_full(results)
    ok = {n: r for n, r in results.items() if r["status"] == "ok"}
    info = next(iter(ok.values()))["info"] if ok else {}
    zinfo = ok.get("zinf", {}).get("info", {})
    model_mib = info.get("params", 0) * 4 / MIB
    print(f"\nGPT {info.get('params', 0) / 1e6:.1f}M parameters ({model_mib:.0f} MiB fp32), 2 ranks, gloo, "
          f"torch {torch.__version__}")  # fmt: skip
    if zinfo:
        print(f"zinf: {zinfo['units']} units ({zinfo['persistent_units']} persistent), the largest "
              f"{zinfo['largest_unit_mib']:.0f} MiB; the claim for a full state dict: rank 0 grows by at most "
              f"{model_mib + zinfo['largest_unit_mib']:.0f} MiB (the result + one unit), rank 1 by "
              f"{zinfo['largest_unit_mib']:.0f} MiB")  # fmt: skip
    for name, r in ok.items():
        print(f"{name}: rank 0's full state dict holds {r['info']['full_result_mib']:.0f} MiB "
              f"({r['info']['full_keys']} keys)")
    rows = [("full_get", "full state dict to CPU, rank 0"), ("full_load", "full load (every rank the dict)"),
            ("full_load_bcast", "full load (rank 0 the dict, broadcast)"), ("dcp_get", "sharded dict"),
            ("dcp_save", "dcp.save"), ("dcp_load", "sharded load (dict + dcp.load + load)")]  # fmt: skip

    def phase(name: str, phase_name: str) -> dict | None:
        r = ok.get(name)
        if r is None or phase_name not in r["ranks"][0]["phases"]:
            return None
        return {"wall_s": r["ranks"][0]["phases"][phase_name]["wall_s"],
                "hwm": [rk["phases"][phase_name]["hwm_growth_mib"] for rk in r["ranks"]],
                "anon": [rk["phases"][phase_name]["anon_growth_mib"] for rk in r["ranks"]]}  # fmt: skip

    print("\n| phase | contender | s | zinf s / this s | peak RSS growth r0 / r1 MiB | peak anon growth r0 / r1 MiB |")
    print("|---|---|---|---|---|---|")
    table = []
    for phase_name, label in rows:
        mine = phase("zinf", phase_name if phase_name != "full_load_bcast" else "full_load")
        for name in ok:
            p = phase(name, phase_name)
            if p is None or (phase_name == "full_load_bcast" and name != "fsdp2"):
                continue
            ratio = mine["wall_s"] / p["wall_s"] if mine and name != "zinf" else None
            shown = name + (" (bcast)" if phase_name == "full_load_bcast" else "")
            print(f"| {label} | {shown} | {p['wall_s']:.3f} | {'' if ratio is None else f'{ratio:.2f}'} "
                  f"| {p['hwm'][0]:.0f} / {p['hwm'][1]:.0f} | {p['anon'][0]:.0f} / {p['anon'][1]:.0f} |")  # fmt: skip
            table.append({"phase": phase_name, "contender": name, **p, "zinf_over_this": ratio})
    print("\ncorrectness:")
    for pair, eq in equality.items():
        diff_keys = {k: v for k, v in eq.items() if k.startswith("keys_only") and v}
        print(f"  full dicts {pair}: {'EQUAL' if not diff_keys and not eq['values_differing'] else 'DIFFERENT'}"
              f" ({len(eq['values_differing'])} values differ{', ' + str(diff_keys) if diff_keys else ''});"
              f" reference forward max |diff| {eq['forward_max_abs_diff']:.2e}")  # fmt: skip
    for name, r in ok.items():
        worst = max(max(rk["checks"].values()) for rk in r["ranks"])
        print(f"  {name}: forward after every load, max |out - out before| = {worst:.2e} "
              f"({', '.join(r['ranks'][0]['checks'])})")
        if "exit_note" in r:
            print(f"  note: {r['exit_note']}")
    print("\nsteps of the loads, rank 0, seconds:")
    for name, r in ok.items():
        for phase_name, p in r["ranks"][0]["phases"].items():
            if p["parts_s"]:
                print(f"  {name} {phase_name}: " + ", ".join(f"{k} {v:.3f}" for k, v in p["parts_s"].items()))
    if "zinf" in ok:
        print("\nzinf, rank 0, seconds in the engine methods the hooks call (calls):")
        for phase_name, split in ok["zinf"]["ranks"][0]["zinf_split"].items():
            parts = ", ".join(f"{k} {v:.3f} ({split['calls'][k]})" for k, v in split["seconds"].items())
            print(f"  {phase_name}: {parts}")
    record = run_record(config={"d_model": args.d_model, "layers": args.layers, "heads": args.heads,
                                "vocab": args.vocab, "seq_len": args.seq_len},
                        table=table, equality=equality, results=results)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(f"\nresults: {args.out}")
    if not args.keep:
        for r in ok.values():
            shutil.rmtree(r["dir"], ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=1024, help="default: %(default)s")
    parser.add_argument("--layers", type=int, default=12, help="default: %(default)s")
    parser.add_argument("--heads", type=int, default=16, help="default: %(default)s")
    parser.add_argument("--vocab", type=int, default=8192, help="default: %(default)s")
    parser.add_argument("--seq-len", type=int, default=128, help="default: %(default)s")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "state_dict_bench",
                        help="scratch folder for the full-dict files and DCP checkpoints (default: %(default)s)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch files")
    add_self_launch_options(parser, CONTENDERS, HERE / "results" / "state_dict.json")
    args = parser.parse_args()
    if args.rank_of:
        run_rank(args.rank_of, args)
        return
    chosen_contenders(parser, args, CONTENDERS)
    drive(args)


if __name__ == "__main__":
    main()
