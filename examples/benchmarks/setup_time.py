"""Setup time against the number of units: lightning_zinf's ``ZeroEngine`` beside FSDP2's
``fully_shard``, on the same model, in one process (a world of one, gloo).

    python examples/benchmarks/setup_time.py [--units 1000 4000 16000] [--width 16]
    python examples/benchmarks/setup_time.py --model llama --units 32 128 512 [--width 16]

The model is ``nn.Sequential`` of ``units`` ``nn.Linear(width, width)`` layers, so every layer is a
unit (zinf's default: a module's own parameters; FSDP2: ``fully_shard`` on each layer, then on the
root). Each is built twice: on the meta device (zinf: ``meta_parameters()``, initialised unit by
unit at setup; FSDP2: ``torch.device("meta")``, then ``to_empty`` and ``reset_parameters`` per
layer, its documented meta-device recipe) and with real weights. Printed: seconds per setup, and
the growth exponent between consecutive sizes (``log(t2/t1) / log(n2/n1)``: 1 is linear, 2
quadratic), for each contender. Writes ``results/setup_time.json`` beside this script.

``--model llama`` / ``--model gpt2``: a ``transformers`` ``LlamaForCausalLM`` / ``GPT2LMHeadModel``
built from a config (nothing downloaded) with ``--units`` decoder layers of width ``--width``:
zinf's units are each module's own parameters (9 per Llama layer, 7 per GPT-2 layer), initialised
by the model's own ``_init_weights``, which also acts on modules without parameters of their own
(GPT-2 rescales each block's ``c_proj``); FSDP2 ``fully_shard``s the same modules, then the root,
and on meta calls ``to_empty`` and the model's ``_init_weights`` on every module. Writes
``results/setup_time_<model>.json``.

Each row also gives the construction's time: under ``meta_parameters()`` construction records what
``__init__`` does and runs its random draws once (so the values are eager's), where FSDP2's meta
construction costs nothing and its setup initialises.

Issue 28 asked for setup linear in the number of units (it was quadratic: 2,000 units took 20.9 s).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

HERE = Path(__file__).resolve().parent


MODEL = "linear"  # --model: "linear", "llama" or "gpt2"


def _build(units: int, width: int) -> nn.Module:
    if MODEL == "linear":
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(units)])
    import transformers

    if MODEL == "llama":
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=width, intermediate_size=2 * width,
                                          num_hidden_layers=units, num_attention_heads=2, num_key_value_heads=2,
                                          max_position_embeddings=32)
        return transformers.LlamaForCausalLM(config)
    config = transformers.GPT2Config(vocab_size=64, n_embd=width, n_layer=units, n_head=2, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def _model(units: int, width: int, meta: bool) -> nn.Module:
    if meta:
        from lightning_zinf import meta_parameters

        with meta_parameters():
            return _build(units, width)
    return _build(units, width)


def _zinf(units: int, width: int, meta: bool) -> tuple[float, float]:
    from lightning_zinf import PrefetchConfig, ZeroEngine

    start = time.perf_counter()
    model = _model(units, width, meta)
    built = time.perf_counter()
    ZeroEngine(model, prefetch=PrefetchConfig(persistence_threshold=0))
    return built - start, time.perf_counter() - built


def _fsdp2(units: int, width: int, meta: bool) -> tuple[float, float]:
    from torch.distributed.fsdp import fully_shard

    begin = time.perf_counter()
    if meta:
        with torch.device("meta"):
            model = _build(units, width)
    else:
        model = _build(units, width)
    start = time.perf_counter()
    owners = [m for m in model.modules() if m is not model and any(True for _ in m.parameters(recurse=False))]
    for layer in reversed(owners):  # the same units as zinf's: each module's own parameters
        fully_shard(layer)
    fully_shard(model)
    if meta:
        model.to_empty(device="cpu")
        with torch.no_grad():
            for layer in owners if MODEL == "linear" else model.modules():
                if MODEL == "linear":
                    layer.reset_parameters()
                else:
                    model._init_weights(layer)  # what the model's post_init applies, module by module
    return start - begin, time.perf_counter() - start


CONTENDERS = {"zinf": _zinf, "fsdp2": _fsdp2}


def _exponents(sizes: list[int], times: list[float]) -> list[float]:
    return [math.log(t2 / t1) / math.log(n2 / n1) for (n1, t1), (n2, t2) in zip(zip(sizes, times), zip(sizes[1:], times[1:]))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--units", type=int, nargs="+", default=[1000, 4000, 16000], help="default: %(default)s")
    parser.add_argument("--width", type=int, default=16, help="features of each Linear (default: %(default)s)")
    parser.add_argument("--model", choices=["linear", "llama", "gpt2"], default="linear",
                        help="nn.Sequential of Linear layers, or a transformers model of --units layers "
                             "(default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON results path (default: results/setup_time[_<model>].json beside this script)")
    args = parser.parse_args()
    global MODEL
    MODEL = args.model
    suffix = "" if MODEL == "linear" else f"_{MODEL}"
    args.out = args.out or HERE / "results" / f"setup_time{suffix}.json"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    results: dict[str, dict[str, list[float]]] = {}
    try:
        for name, setup in CONTENDERS.items():
            for meta in (True, False):
                key = f"{name}-{'meta' if meta else 'real'}"
                results[key] = {"seconds": [], "construction": []}
                for units in args.units:
                    construction, seconds = setup(units, args.width, meta)
                    results[key]["seconds"].append(seconds)
                    results[key]["construction"].append(construction)
                    print(f"[setup_time] {key:11s} {units:6d} {'units' if MODEL == 'linear' else 'layers'}: "
                          f"{seconds:7.2f} s (construction {construction:.2f} s)", flush=True)
                results[key]["exponents"] = _exponents(args.units, results[key]["seconds"])
    finally:
        dist.destroy_process_group()
    what = "units" if MODEL == "linear" else "layers"
    print(f"\n| contender | {' | '.join(f'{n:,} {what} s' for n in args.units)} | growth exponents | zinf/FSDP2 at {args.units[-1]:,} |")
    print("|---|" + "---|" * (len(args.units) + 2))
    for key, row in results.items():
        peer = results[key.replace("zinf", "fsdp2")]["seconds"][-1]
        ratio = f"{row['seconds'][-1] / peer:.2f}" if key.startswith("zinf") else ""
        print(f"| {key} | {' | '.join(f'{s:.2f}' for s in row['seconds'])} | "
              f"{', '.join(f'{e:.2f}' for e in row['exponents'])} | {ratio} |")
    # Construction plus setup: zinf's meta construction records (and runs the random draws once),
    # FSDP2's meta construction costs nothing and its setup initialises.
    print(f"\n| contender | {' | '.join(f'{n:,} {what}: construction + setup s' for n in args.units)} |")
    print("|---|" + "---|" * len(args.units))
    for key, row in results.items():
        print(f"| {key} | {' | '.join(f'{c:.2f} + {s:.2f}' for c, s in zip(row['construction'], row['seconds']))} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": MODEL, "units": args.units, "width": args.width, "results": results},
                                   indent=2))
    print(f"\nresults: {args.out}")


if __name__ == "__main__":
    main()
