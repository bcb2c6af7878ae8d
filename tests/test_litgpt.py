"""LitGPT as a real client: its own ``pretrain`` and ``finetune_lora`` entry points (the ``main``
functions its CLI calls after ``setup``), driven through ``Fabric(strategy="zero_infinity")`` on two
CPU processes, against the same under Fabric's DDP: equal losses from the first step, LitGPT's
``load_checkpoint`` of the base model, LitGPT's LoRA save and merge, and ``litgpt generate`` on the
merged checkpoint. How the runs are set up, and how they differ from a plain ``litgpt`` run (the same
for both strategies), is in :mod:`tests.litgpt_runs`.

Needs LitGPT installed next to this project: ``pip install --no-deps litgpt==0.5.13 && pip install
requests`` (see :mod:`tests.litgpt_runs` for why ``--no-deps``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests import litgpt_runs as R
from tests.harness import run_distributed

RTOL, ATOL = 1e-4, 1e-6  # float tolerance for losses
W_RTOL, W_ATOL = 1e-4, 1e-5  # and for weights
FINETUNE_STEPS = 100  # enough for the fine-tuned model to answer the training prompt (greedy)
FINETUNE_LR = 2e-2


def _pretrain(work: Path, strategy: str, out: Path, **kwargs) -> list[dict]:
    return run_distributed(R.pretrain_rank, 2, strategy, str(work), str(out), kwargs.pop("initial", None),
                           kwargs.pop("resume", False), kwargs.pop("max_iters", 12), kwargs.pop("compile", False),
                           init_pg=False, timeout=kwargs.pop("timeout", 240))


def _finetune(work: Path, strategy: str, base: Path, out: Path, steps: int = FINETUNE_STEPS, eval_interval: int = 1000,
              eager_init=None, epochs: int = 100, timeout: float = 240) -> list[dict]:
    return run_distributed(R.finetune_rank, 2, strategy, str(work), str(base), str(out), steps, eval_interval,
                           eager_init, FINETUNE_LR, 4, epochs, init_pg=False, timeout=timeout)


def _assert_same_losses(reference: list[dict], got: list[dict], what: str) -> None:
    """Every logged loss of every rank (train: per iteration; validation) equal to float tolerance."""
    for rank, (ref, run) in enumerate(zip(reference, got)):
        for kind in ("train", "val"):
            ref_steps = [s for s, _ in ref[kind]]
            assert [s for s, _ in run[kind]] == ref_steps, f"{what}: rank {rank} logged {kind} losses at other steps"
            for (step, a), (_, b) in zip(ref[kind], run[kind]):
                assert b == pytest.approx(a, rel=RTOL, abs=ATOL), (
                    f"{what}: rank {rank}, {kind} loss at step {step}: zero_infinity {b!r} != DDP {a!r}\n"
                    f"DDP:           {ref[kind][:6]}...\nzero_infinity: {run[kind][:6]}...")
        assert len(ref["train"]) > 0


def _assert_same_weights(reference: dict, got: dict, what: str) -> None:
    assert sorted(got) == sorted(reference), f"{what}: other tensor names"
    for name, ref in reference.items():
        assert got[name].shape == ref.shape, (
            f"{what}: {name} has shape {tuple(got[name].shape)}, DDP's {tuple(ref.shape)}")
        torch.testing.assert_close(got[name], ref, rtol=W_RTOL, atol=W_ATOL, msg=lambda m: f"{what}: {name}: {m}")


# --- shared runs ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """The tokenizer (trained here on stdlib files) and the fine-tuning data."""
    work = tmp_path_factory.mktemp("litgpt")
    R.build_tokenizer(work / "tokenizer")
    R.build_sft_data(work / "sft")
    return work


@pytest.fixture(scope="module")
def ddp_pretrain(work: Path) -> tuple[Path, list[dict]]:
    out = work / "pretrain_ddp"
    return out, _pretrain(work, "ddp", out)


@pytest.fixture(scope="module")
def zinf_pretrain(work: Path) -> tuple[Path, list[dict]]:
    """With one-file checkpoints (``state_dict_type="full"``), as LitGPT's pretraining configures
    its own FSDP strategy, so that LitGPT's ``convert_pretrained_checkpoint`` reads them."""
    out = work / "pretrain_zinf"
    return out, _pretrain(work, "zero_infinity_full", out)


@pytest.fixture(scope="module")
def base(work: Path, ddp_pretrain) -> Path:
    """The base checkpoint for fine-tuning: DDP's pretraining run through LitGPT's
    ``convert_pretrained_checkpoint`` (``lit_model.pth``, ``model_config.yaml``, tokenizer files)."""
    return R.make_base_checkpoint(ddp_pretrain[0], work / "base")


@pytest.fixture(scope="module")
def ddp_finetune(work: Path, base: Path) -> tuple[Path, list[dict]]:
    out = work / "lora_ddp"
    return out, _finetune(work, "ddp", base, out)


@pytest.fixture(scope="module")
def zinf_finetune(work: Path, base: Path) -> tuple[Path, list[dict]]:
    out = work / "lora_zinf"
    return out, _finetune(work, "zero_infinity", base, out)


# --- pretraining ----------------------------------------------------------------------------------

def test_pretrain_losses_match_ddp(ddp_pretrain, zinf_pretrain) -> None:
    """``litgpt.pretrain.main``: LitGPT's GPT-NeoX init (``reset_parameters`` on the model built
    with ``empty_init=True``), gradient accumulation, clipping, AdamW with LitGPT's cosine schedule,
    validation every 3 steps: every loss equal to DDP's from the first step."""
    _assert_same_losses(ddp_pretrain[1], zinf_pretrain[1], "pretrain")


def test_pretrain_checkpoint_holds_ddps_weights(ddp_pretrain, zinf_pretrain) -> None:
    """The final checkpoint LitGPT saves with ``fabric.save`` holds the weights DDP's holds (one file,
    in DDP's format)."""
    _assert_same_weights(R.pretrained_weights(ddp_pretrain[0]), R.pretrained_weights(zinf_pretrain[0]),
                         "pretrain final checkpoint")


def test_pretrain_checkpoint_converts_with_litgpt(work: Path, base: Path, zinf_pretrain) -> None:
    """LitGPT's next step after pretraining, ``litgpt convert_pretrained_checkpoint``, turns
    zero_infinity's final checkpoint into the same ``lit_model.pth`` as DDP's."""
    converted = R.make_base_checkpoint(zinf_pretrain[0], work / "base_from_zinf")
    _assert_same_weights(torch.load(base / "lit_model.pth", weights_only=True),
                         torch.load(converted / "lit_model.pth", weights_only=True), "converted checkpoint")


def test_continued_pretraining_loads_the_initial_checkpoint(work: Path, base: Path, ddp_pretrain) -> None:
    """``initial_checkpoint_dir``: LitGPT loads ``lit_model.pth`` with ``fabric.load_raw`` into the
    set-up model; losses equal DDP's, and start below the from-scratch run's (the weights loaded)."""
    ddp = _pretrain(work, "ddp", work / "continued_ddp", initial=str(base))
    zinf = _pretrain(work, "zero_infinity", work / "continued_zinf", initial=str(base))
    _assert_same_losses(ddp, zinf, "continued pretraining")
    assert zinf[0]["train"][0][1] < ddp_pretrain[1][0]["train"][0][1] - 0.3


def test_pretrain_resumes_from_its_checkpoint(work: Path, ddp_pretrain, zinf_pretrain) -> None:
    """``resume``: LitGPT restores model, optimizer and counters with ``fabric.load`` from the
    step-3 checkpoint each strategy wrote; the resumed runs' losses are equal."""
    runs = []
    for strategy, (out, _) in (("ddp", ddp_pretrain), ("zero_infinity_full", zinf_pretrain)):
        copy = work / f"resumed_{strategy}"
        shutil.copytree(out, copy)
        runs.append(_pretrain(work, strategy, copy, resume=str(copy / "step-00000003" / "lit_model.pth")))
    ddp, zinf = runs
    assert [s for s, _ in ddp[0]["train"]] == [7, 9, 11]  # resumed after iteration 6
    _assert_same_losses(ddp, zinf, "resumed pretraining")


def test_pretrain_with_torch_compile(work: Path) -> None:
    """``litgpt.pretrain.main`` as it is, with its ``torch.compile(model)`` before ``fabric.setup``
    (inductor on CPU: slow)."""
    ddp = _pretrain(work, "ddp", work / "compiled_ddp", compile=True, timeout=400)
    zinf = _pretrain(work, "zero_infinity", work / "compiled_zinf", compile=True, timeout=400)
    _assert_same_losses(ddp, zinf, "compiled pretraining")


# --- LoRA fine-tuning -----------------------------------------------------------------------------

def test_finetune_lora_losses_match_ddp(ddp_finetune, zinf_finetune) -> None:
    """``litgpt.finetune.lora.main``: the LoRA GPT built in ``fabric.init_module(empty_init=True)``,
    frozen base weights from LitGPT's ``load_checkpoint``, adapters on every linear layer and the
    head: every loss equal to DDP's (whose model is initialised eagerly from the same seed)."""
    _assert_same_losses(ddp_finetune[1], zinf_finetune[1], "finetune_lora")
    assert ddp_finetune[1][0]["train"][-1][1] < 1.5  # the adapters learned the training set


def test_finetune_lora_with_eager_init_matches_ddp(work: Path, base: Path, ddp_finetune) -> None:
    """The same with zero_infinity's model built for real (``empty_init=False``, partitioned from
    rank 0's values at setup): isolates everything but the adapters' initialisation."""
    zinf = _finetune(work, "zero_infinity", base, work / "lora_zinf_eager", eager_init=True)
    _assert_same_losses(ddp_finetune[1], zinf, "finetune_lora (eager init)")


def test_lora_checkpoint_matches_ddp(ddp_finetune, zinf_finetune) -> None:
    """LitGPT's ``save_lora_checkpoint`` (``model.state_dict()`` filtered to ``lora_``, written by
    rank 0) writes every adapter tensor whole, equal to DDP's."""
    lora = R.tiny_config(**R.LORA)
    ddp = torch.load(ddp_finetune[0] / "final" / "lit_model.pth.lora", weights_only=True)["model"]
    zinf = torch.load(zinf_finetune[0] / "final" / "lit_model.pth.lora", weights_only=True)["model"]
    assert len(ddp) == 2 * 5 * lora.n_layer + 2  # A and B of qkv, proj, fc_1, fc_2, mlp.proj per layer, and head
    assert all(t.numel() > 0 for t in zinf.values()), {k: tuple(t.shape) for k, t in zinf.items()}
    _assert_same_weights(ddp, zinf, "lit_model.pth.lora")


def test_merged_checkpoint_matches_ddp(base: Path, ddp_finetune, zinf_finetune) -> None:
    """LitGPT's ``merge_lora`` (run by ``finetune_lora`` on rank 0) on zero_infinity's adapters gives
    DDP's merged weights; the merge changed the adapted layers."""
    ddp = torch.load(ddp_finetune[0] / "final" / "lit_model.pth", weights_only=True)
    zinf = torch.load(zinf_finetune[0] / "final" / "lit_model.pth", weights_only=True)
    original = torch.load(base / "lit_model.pth", weights_only=True)
    assert sorted(zinf) == sorted(original)
    assert not torch.equal(zinf["transformer.h.0.attn.qkv.weight"], original["transformer.h.0.attn.qkv.weight"])
    torch.testing.assert_close(zinf["transformer.wte.weight"], original["transformer.wte.weight"], rtol=0, atol=0)
    _assert_same_weights(ddp, zinf, "merged lit_model.pth")


def test_litgpt_generate_on_the_merged_checkpoint(ddp_finetune, zinf_finetune) -> None:
    """``litgpt generate`` (the command, greedy) on zero_infinity's merged checkpoint prints what it
    prints for DDP's: the prompt, then the training answer."""
    ddp = R.litgpt_generate(ddp_finetune[0] / "final")
    zinf = R.litgpt_generate(zinf_finetune[0] / "final")
    assert ddp.rstrip().endswith(f"### Response:\n{R.ANSWER}"), ddp
    assert zinf == ddp


def test_generate_under_zero_infinity(ddp_finetune) -> None:
    """``litgpt generate``'s steps (``fabric.init_module``, KV cache, ``setup_module``, LitGPT's
    ``load_checkpoint``, ``generate``) with a 2-process zero_infinity Fabric instead of its
    one-device one, on DDP's merged checkpoint: the same text as the ``litgpt generate`` command."""
    ranks = run_distributed(R.generate_rank, 2, "zero_infinity", str(ddp_finetune[0] / "final"), init_pg=False,
                            timeout=240)
    expected = R.litgpt_generate(ddp_finetune[0] / "final")
    for rank in ranks:
        assert rank["text"] + "\n" == expected
    assert ranks[0]["tokens"] == ranks[1]["tokens"]


def test_finetune_lora_with_generate_example_on_rank_0_matches_ddp(work: Path, base: Path) -> None:
    """``finetune_lora`` runs ``generate_example`` on rank 0 alone while rank 1 waits in
    ``fabric.barrier()`` (every ``eval.interval`` steps, and when the last epoch ends: how a default
    ``litgpt finetune_lora`` run, ``epochs=5``, ends). Rank 1 serves rank 0's gathers from the
    barrier (:mod:`lightning_zinf.engine.negotiation`): the run finishes with DDP's losses, where
    under ZeRO-3 (DeepSpeed, FSDP) it cannot, each unit being gathered from every rank (it used to
    end both ranks within seconds, the watch naming the deadlock)."""
    ddp = _finetune(work, "ddp", base, work / "lora_examples_ddp", steps=4, eval_interval=2, eager_init=True)
    zinf = _finetune(work, "zero_infinity", base, work / "lora_examples_zinf", steps=4, eval_interval=2,
                     eager_init=True)
    _assert_same_losses(ddp, zinf, "finetune_lora with generate_example on rank 0")
