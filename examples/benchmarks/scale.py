"""The largest model this machine trains: a multi-billion-parameter GPT with ZeRO-Infinity NVMe offload.

``zinf`` (the default): one process builds a GPT (examples/gpt.py) on the meta device, partitions it
with :class:`~lightning_zinf.ZeroEngine` (transformer blocks as units) with parameters and optimizer
state on NVMe (``OffloadConfig(param="nvme", optimizer="nvme")``), and takes real AdamW steps
(``fused=True``, torch's vectorised CPU AdamW) on random tokens, micro-batch 1 x 128 tokens, fp32
(``--precision bf16-mixed``: gathered and computed in bf16, ``MixedPrecisionConfig(param_dtype=bf16)``,
each shard's bf16 compute copy on NVMe as well). Measured in the same run:
  - the training state: bytes per parameter on NVMe (fp32 master, which is the parameter shard, the
    fp32 gradient and the two Adam moments, and under bf16 the compute copies the staging memory
    does not hold: docs/offload.md) and its total against this machine's RAM;
  - per step: wall time, bytes read from and written to the swap files (the swapper's counters),
    per parameter against ZeRO-Infinity's arithmetic for this layout;
  - peak RSS (``ru_maxrss``) against RAM;
  - the bound: bytes read / the disk's read bandwidth + bytes written / its write bandwidth + the
    step's matmul FLOPs (6 x parameters x tokens) / the measured matmul rate. Both rates are
    measured first, in this run: sequential ``O_DIRECT`` writes and reads of a 2 GiB file in 1 MiB
    blocks, by 1 and by 4 threads (the better is used), in the swap folder's filesystem, and an fp32 (bf16)
    ``(128, d) x (d, 4d)`` matmul, the shape of the model's largest;
  - the largest model that DDP and FSDP2 could train here, by arithmetic: fp32 AdamW keeps 16 bytes
    per parameter in RAM (parameter, gradient, two moments), replicated per rank under DDP and
    sharded under FSDP2, whose ranks share this machine's RAM.

``overlap``: the same training at a given size twice, with overlap on (prefetch along the trace,
shards read ahead, the next optimizer sub-group read while one steps, writes behind) and off
(``OffloadConfig(overlap=False, read_ahead=0)``, ``PrefetchConfig(enabled=False)``), and the ratio.

``ddp``: plain single-process PyTorch, what each DDP rank holds (the model, its gradients and AdamW
state in RAM), at the given size, with the address space limited to this machine's RAM so that a
model too large fails with an allocation error instead of invoking the kernel's OOM killer. Run it
just above the arithmetic limit to confirm it. ``fsdp2``: the same with FSDP2 (``fully_shard`` per
block and on the root) on 2 ranks, each capped at half the RAM.

    python examples/benchmarks/scale.py zinf [--layers 29 --d-model 3072] [--steps 3] [--nvme-root /tmp] [--precision bf16-mixed]
    python examples/benchmarks/scale.py overlap --layers 8 --d-model 2048 --steps 4
    python examples/benchmarks/scale.py ddp --layers 14 --d-model 3072
    python examples/benchmarks/scale.py fsdp2 --layers 14 --d-model 3072

--nvme-root needs room for 16 bytes per parameter (53 GB for the default 3.3B model).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from examples.gpt import GPT, Block, GPTConfig, lm_loss  # noqa: E402
from lightning_zinf import MixedPrecisionConfig, OffloadConfig, PrefetchConfig, ZeroEngine, meta_parameters  # noqa: E402
from lightning_zinf.offload import aligned_empty  # noqa: E402
from lightning_zinf.offload.aligned import memory_view  # noqa: E402

GIB = 1 << 30
TOKENS = 128
BYTES_PER_PARAM_RAM = 16  # fp32 AdamW in RAM: parameter, gradient, exp_avg, exp_avg_sq


def ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def disk_bandwidth(folder: Path, threads: int, nbytes: int, chunk: int = 256 << 20) -> tuple[float, float]:
    """Sequential O_DIRECT write and read bandwidth of ``folder``'s disk, bytes/s: a ``nbytes`` file
    written, then read, in 1 MiB blocks by ``threads`` threads from one ``chunk``-byte buffer (so
    the measurement adds little to the peak RSS reported later)."""
    chunk = min(chunk, nbytes)
    buf = aligned_empty(chunk, torch.uint8).random_(0, 256)
    view = memory_view(buf.data_ptr(), chunk)
    block = 1 << 20
    path = folder / "bandwidth.bin"
    rates = []
    for flags, call in ((os.O_WRONLY | os.O_CREAT, os.pwritev), (os.O_RDONLY, os.preadv)):
        try:
            fd = os.open(path, flags | os.O_DIRECT, 0o600)
        except OSError:  # tmpfs and others refuse O_DIRECT: buffered, timed up to the fsync
            fd = os.open(path, flags, 0o600)
        start = time.perf_counter()
        try:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda off: call(fd, [view[off % chunk : off % chunk + block]], off),
                              range(0, nbytes, block)))
            if call is os.pwritev:
                os.fsync(fd)
        finally:
            os.close(fd)
        rates.append(nbytes / (time.perf_counter() - start))
    path.unlink()
    return rates[0], rates[1]


def matmul_rate(d: int, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s in ``dtype`` of the model's largest matmul shape, (TOKENS, d) x (d, 4d)."""
    x, w = torch.randn(TOKENS, d, dtype=dtype), torch.randn(4 * d, d, dtype=dtype)
    torch.nn.functional.linear(x, w)
    start = time.perf_counter()
    for _ in range(5):
        torch.nn.functional.linear(x, w)
    return 5 * 2 * TOKENS * d * 4 * d / (time.perf_counter() - start)


def fmt_bytes(n: float) -> str:
    return f"{n / 1e9:.1f} GB ({n / GIB:.1f} GiB)"


def train(cfg: GPTConfig, steps: int, folder: Path, param_dtype: torch.dtype | None = None,
          **offload) -> tuple[int, int, list[tuple[float, int, int, float]]]:
    """Partition a GPT onto NVMe under ``folder`` and take ``steps`` AdamW steps, gathering in
    ``param_dtype`` (``None``: fp32).

    Returns:
        ``(parameters, bytes on NVMe, rows)``, one row per step: seconds, bytes read, bytes
        written, loss.
    """
    torch.manual_seed(0)
    start = time.perf_counter()
    with meta_parameters():
        model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    engine = ZeroEngine(model, block_classes=[Block], prefetch=PrefetchConfig(enabled=offload.pop("prefetch", True)),
                        offload=OffloadConfig(param="nvme", optimizer="nvme", nvme_path=str(folder), **offload),
                        mixed_precision=MixedPrecisionConfig(param_dtype=param_dtype))
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
    print(f"{n_params / 1e9:.2f}B parameters, partitioned onto NVMe in {time.perf_counter() - start:.0f} s", flush=True)
    swapper = engine.swapper
    rows = []
    for step in range(steps):
        x = torch.randint(0, cfg.vocab_size, (1, TOKENS + 1), generator=torch.Generator().manual_seed(step))
        read0, written0 = swapper.bytes_read, swapper.bytes_written
        marks = [time.perf_counter()]
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        marks.append(time.perf_counter())
        loss.backward()
        marks.append(time.perf_counter())
        opt.step()
        opt.zero_grad()
        engine.release_all()
        marks.append(time.perf_counter())
        seconds = marks[-1] - marks[0]
        rows.append((seconds, swapper.bytes_read - read0, swapper.bytes_written - written0, loss.item()))
        phases = ", ".join(f"{name} {b - a:.1f}" for name, a, b in zip(("forward", "backward", "step"), marks, marks[1:]))
        print(f"step {step}: {seconds:.1f} s ({phases}), loss {loss.item():.4f}, read {fmt_bytes(rows[-1][1])}, "
              f"written {fmt_bytes(rows[-1][2])}, peak RSS {fmt_bytes(peak_rss())}", flush=True)
    on_disk = engine.resident_bytes()["nvme"]
    swapper.close()
    return n_params, on_disk, rows


def steady(rows: list[tuple[float, int, int, float]]) -> tuple[float, float, float]:
    """Mean seconds, bytes read and bytes written per step, without step 0 (which creates the Adam
    moments: they are written, never read)."""
    kept = rows[1:] or rows
    return tuple(sum(r[k] for r in kept) / len(kept) for k in range(3))  # type: ignore[return-value]


def run_zinf(cfg: GPTConfig, steps: int, nvme_root: Path, bandwidth_bytes: int = 2 * GIB,
             param_dtype: torch.dtype | None = None) -> int:
    ram = ram_bytes()
    folder = Path(tempfile.mkdtemp(prefix="zinf-scale-", dir=nvme_root))
    try:
        # The disk's best: one stream, or as many as the swapper runs (AioConfig's default 4 threads).
        measured = {threads: disk_bandwidth(folder, threads, bandwidth_bytes) for threads in (1, 4)}
        write_bw = max(w for w, _ in measured.values())
        read_bw = max(r for _, r in measured.values())
        flops_rate = matmul_rate(cfg.d_model, param_dtype or torch.float32)
        for threads, (w, r) in measured.items():
            print(f"disk (O_DIRECT, 1 MiB blocks, {threads} thread(s)): write {w / 1e9:.2f} GB/s, read {r / 1e9:.2f} GB/s")
        print(f"matmul (128 x {cfg.d_model}) x ({cfg.d_model} x {4 * cfg.d_model}) {param_dtype or torch.float32}: "
              f"{flops_rate / 1e9:.0f} GFLOP/s", flush=True)
        n_params, on_disk, rows = train(cfg, steps, folder, param_dtype)
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    seconds, read, written = steady(rows)
    flops = 6 * n_params * TOKENS
    bound = read / read_bw + written / write_bw + flops / flops_rate
    largest_ddp = ram / BYTES_PER_PARAM_RAM
    print()
    print(f"model                    {n_params / 1e9:.2f}B parameters (d_model {cfg.d_model}, {cfg.n_layers} layers)")
    print(f"training state on NVMe   {fmt_bytes(on_disk)} = {on_disk / n_params:.1f} B/parameter "
          f"= {on_disk / ram:.2f}x this machine's RAM ({fmt_bytes(ram)})")
    print(f"peak RSS                 {fmt_bytes(peak_rss())} = {peak_rss() / ram:.2f}x RAM (target < 0.5)")
    print(f"step time (steps 1-)     {seconds:.1f} s")
    print(f"bytes per step           read {fmt_bytes(read)}, written {fmt_bytes(written)}")
    # ZeRO-Infinity's arithmetic (SC'21, section 4) for this layout: each forward and backward reads every
    # parameter in the gather dtype; the step reads and writes the fp32 master and both moments, and
    # the fp32 gradient shard (written by backward, read by the step); a 16-bit gather dtype adds the
    # write of the compute copy. Gradients and compute copies held in staging memory move nothing, so
    # the measured is lower while staging holds them. Per parameter, against the measured:
    gathered = (param_dtype or torch.float32).itemsize
    expect_read, expect_written = 2 * gathered + 12 + 4, 12 + 4 + (gathered if gathered < 4 else 0)
    print(f"per parameter            read {read / n_params:.2f} B (arithmetic {expect_read}), "
          f"written {written / n_params:.2f} B (arithmetic {expect_written})")
    print(f"bound                    {bound:.1f} s = read {read / read_bw:.1f} + write {written / write_bw:.1f} "
          f"+ compute {flops / flops_rate:.1f}")
    print(f"step / bound             {seconds / bound:.2f} (target <= 2)")
    print(f"DDP, by arithmetic       fp32 AdamW holds {BYTES_PER_PARAM_RAM} B/parameter in RAM per replica: at most "
          f"{largest_ddp / 1e9:.2f}B parameters with 1 rank, {largest_ddp / 2e9:.2f}B with 2 (before activations)")
    print(f"FSDP2, by arithmetic     the same {BYTES_PER_PARAM_RAM} B/parameter sharded over ranks that share this RAM: "
          f"at most {largest_ddp / 1e9:.2f}B parameters (CPU offload moves it to the same RAM)")
    print(f"this run / DDP limit     {n_params / largest_ddp:.1f}x")
    return 0


def run_overlap(cfg: GPTConfig, steps: int, nvme_root: Path) -> int:
    """The same training with every overlap on (prefetch along the trace, shards read ahead, the
    next optimizer sub-group read while one steps, writes behind) and off (each transfer completes
    before the work that follows it starts); small sub-groups so that the step has several."""
    results, losses = {}, {}
    for name, knobs in (("on", {}), ("off", {"overlap": False, "read_ahead": 0, "prefetch": False})):
        folder = Path(tempfile.mkdtemp(prefix="zinf-overlap-", dir=nvme_root))
        try:
            print(f"overlap {name}:", flush=True)
            _, _, rows = train(cfg, steps, folder, sub_group_size=10_000_000, **knobs)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        results[name] = steady(rows)[0]
        losses[name] = [r[3] for r in rows]
    print(f"losses equal with overlap on and off: {losses['on'] == losses['off']}")
    print(f"\ns/step: overlap on {results['on']:.2f}, off {results['off']:.2f}; "
          f"speed-up from overlap {results['off'] / results['on']:.2f}x")
    return 0


def run_ddp(cfg: GPTConfig) -> int:
    ram = ram_bytes()
    resource.setrlimit(resource.RLIMIT_AS, (ram, ram))
    n_params = 12 * cfg.n_layers * cfg.d_model**2 + (cfg.vocab_size + cfg.seq_len) * cfg.d_model
    print(f"plain PyTorch (one DDP rank's state), {n_params / 1e9:.2f}B parameters, "
          f"needs {fmt_bytes(BYTES_PER_PARAM_RAM * n_params)} for fp32 AdamW; address space capped at RAM "
          f"({fmt_bytes(ram)})", flush=True)
    stage = "building the model"
    try:
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        x = torch.randint(0, cfg.vocab_size, (1, TOKENS + 1))
        stage = "forward and backward"
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        stage = "the optimizer step"
        opt.step()
    except (MemoryError, RuntimeError) as error:
        print(f"FAILED during {stage}: {type(error).__name__}: {str(error).splitlines()[0][:200]}; "
              f"peak RSS {fmt_bytes(peak_rss())}")
        return 1
    print(f"trained one step; peak RSS {fmt_bytes(peak_rss())}")
    return 0


def _fsdp2_rank(rank: int, cfg: GPTConfig, port: int) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    share = ram_bytes() // 2  # the two ranks share this machine's RAM
    resource.setrlimit(resource.RLIMIT_AS, (share, share))
    stage = "building and sharding the model"
    try:
        with torch.device("meta"):
            model = GPT(cfg)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device="cpu")
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        x = torch.randint(0, cfg.vocab_size, (1, TOKENS + 1), generator=torch.Generator().manual_seed(rank))
        stage = "forward and backward"
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        stage = "the optimizer step"
        opt.step()
    except (MemoryError, RuntimeError) as error:
        print(f"rank {rank}: FAILED during {stage}: {type(error).__name__}: {str(error).splitlines()[0][:160]}; "
              f"peak RSS {fmt_bytes(peak_rss())}", flush=True)
        os._exit(1)  # no collective may follow: the other rank may be dead
    print(f"rank {rank}: trained one step; peak RSS {fmt_bytes(peak_rss())}", flush=True)
    dist.destroy_process_group()


def run_fsdp2(cfg: GPTConfig) -> int:
    import torch.multiprocessing as mp

    n_params = 12 * cfg.n_layers * cfg.d_model**2 + (cfg.vocab_size + cfg.seq_len) * cfg.d_model
    print(f"FSDP2 (fully_shard per block and on the root), 2 ranks, gloo, {n_params / 1e9:.2f}B parameters, "
          f"{fmt_bytes(BYTES_PER_PARAM_RAM * n_params)} of fp32 AdamW state in all; each rank's address space "
          f"capped at half the RAM ({fmt_bytes(ram_bytes() // 2)})", flush=True)
    context = mp.start_processes(_fsdp2_rank, args=(cfg, 29000 + os.getpid() % 1000), nprocs=2, join=False,
                                 start_method="spawn")
    for process in context.processes:
        process.join()
    return max(p.exitcode or 0 for p in context.processes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", choices=("zinf", "overlap", "ddp", "fsdp2"), default="zinf")
    parser.add_argument("--layers", type=int, default=29)
    parser.add_argument("--d-model", type=int, default=3072)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (zinf); the first creates the moments")
    parser.add_argument("--nvme-root", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--bandwidth-mib", type=int, default=2048, help="bytes of the disk measurement (zinf), MiB")
    parser.add_argument("--precision", choices=("32-true", "bf16-mixed"), default="32-true",
                        help="zinf: gather and compute in bf16 (fp32 shards, masters and moments; bf16 compute copies)")
    args = parser.parse_args(argv)
    cfg = GPTConfig(vocab_size=8192, d_model=args.d_model, n_layers=args.layers, n_heads=args.d_model // 128,
                    seq_len=TOKENS)
    if args.mode == "ddp":
        return run_ddp(cfg)
    if args.mode == "fsdp2":
        return run_fsdp2(cfg)
    if args.mode == "overlap":
        return run_overlap(cfg, args.steps, args.nvme_root)
    return run_zinf(cfg, args.steps, args.nvme_root, args.bandwidth_mib << 20,
                    torch.bfloat16 if args.precision == "bf16-mixed" else None)


if __name__ == "__main__":
    sys.exit(main())
