"""Sharded checkpoints: every rank writes its own shards, any world size can read them back.

A checkpoint is a directory::

    meta.pt                        rank 0: the caller's state (Lightning's loops, callbacks,
                                   schedulers, buffers...) plus ``"zinf"``: the layout of every flat
                                   group (parameter names and tied aliases, shapes, offsets in the
                                   flat buffer, dtype), the world size that wrote it, the save's id,
                                   the folder holding its shards and a SHA-256 checksum of each
    save-<id>/                     the shard files of the save ``meta.pt`` names
        rank_00000.safetensors     rank r's shards: per flat group ``g``, ``g.param`` (its shard in
        rank_00001.safetensors     the parameter dtype), ``g.master`` (fp32 master, when separate)
        ...                        and ``g.opt<o>.<key>`` (optimizer ``o``'s per-element state, laid
                                   out like the shard); per-parameter scalar state (Adam's ``step``)
                                   as ``g.opt<o>.<key>.scalar``, one value per parameter. The header
                                   records the save's id, the rank and the world size.

(Checkpoints of earlier versions keep the shard files beside ``meta.pt``; they load the same way.)

``meta.pt`` is a pickle, so reading it could run code the file names. It is read with torch's
weights-only unpickler, which builds tensors, containers and primitives only, plus the few classes
Lightning's checkpoint state holds (:data:`CHECKPOINT_GLOBALS`); anything else is refused unless the
caller passes ``weights_only=False`` for a file they trust.

Because every per-element tensor is stored in the flat layout of its group, a rank of any new world
size computes which elements it owns and reads just those byte ranges of the old files
(safetensors reads slices without loading whole tensors).

Saves are crash-safe (:mod:`lightning_zinf.checkpoint.durable`): a save writes its shards into a new
``save-<id>`` folder and flushes them to the disk, then replaces ``meta.pt`` in one atomic step (a
new checkpoint's whole folder is staged beside it and renamed into place), and only then removes the
previous save's folder. Whenever a process dies, the checkpoint's name holds the previous complete
checkpoint or the new one.

The modules: :mod:`~lightning_zinf.checkpoint.format` (the on-disk format: ``meta.pt``, the layout
record, shard files and their reader), :mod:`~lightning_zinf.checkpoint.save` (sharded save),
:mod:`~lightning_zinf.checkpoint.load` (sharded load at any world size),
:mod:`~lightning_zinf.checkpoint.full` (full state in and out: one-file checkpoints and the plain
optimizer state dict), :mod:`~lightning_zinf.checkpoint.sources` (outside weights, Hugging Face and
plain state dicts, through ``load_state_dict``), :mod:`~lightning_zinf.checkpoint.raw` (plain state
dicts loaded before the strategy set the model or optimizer up) and
:mod:`~lightning_zinf.checkpoint.durable` (the filesystem steps that make saves crash-safe).
"""

from lightning_zinf.checkpoint.format import (CHECKPOINT_GLOBALS, FORMAT, META_FILE, MODEL_KEY, MODELS_DIR_KEY,
                                             MODELS_KEY, OPTIMIZER_KEYS, OWN_ENTRIES, RESERVED_KEYS, SAFETENSORS_DTYPES,
                                             USER_STATE_KEY, VERSION, CheckpointError, CheckpointNotFoundError,
                                             OptimizerCountError, ShardReader, check_version, enclosing_checkpoint,
                                             is_sharded_checkpoint, model_folders, read_meta, refuse_reserved_keys,
                                             require_checkpoint, shard_file, user_entries)
from lightning_zinf.checkpoint.load import load_sharded, placed_scalar_state
from lightning_zinf.checkpoint.save import optimizer_owners, save_sharded, save_sharded_models, shard_layout_state
from lightning_zinf.checkpoint.sources import (checkpoint_keys, load_full_state_dict, load_full_state_dicts, matching_prefix,
                                              overlapping_prefixes, provided_parameters)
from lightning_zinf.checkpoint.durable import CheckpointWriteError, remove_checkpoint
from lightning_zinf.checkpoint.full import (full_optimizer_state_dict, load_full_checkpoint,
                                            load_full_optimizer_state_dict, save_full_checkpoint)

__all__ = ["save_sharded", "save_sharded_models", "shard_layout_state", "optimizer_owners", "placed_scalar_state",
           "MODELS_KEY", "MODELS_DIR_KEY", "OPTIMIZER_KEYS", "MODEL_KEY", "USER_STATE_KEY", "RESERVED_KEYS",
           "OWN_ENTRIES", "user_entries", "refuse_reserved_keys", "model_folders", "load_sharded",
           "load_full_state_dict", "load_full_state_dicts", "overlapping_prefixes",
           "checkpoint_keys", "matching_prefix", "provided_parameters", "is_sharded_checkpoint", "read_meta",
           "check_version", "shard_file", "ShardReader", "SAFETENSORS_DTYPES", "CheckpointError",
           "CheckpointNotFoundError", "OptimizerCountError", "enclosing_checkpoint", "require_checkpoint",
           "CheckpointWriteError", "CHECKPOINT_GLOBALS", "META_FILE", "FORMAT", "VERSION", "remove_checkpoint",
           "full_optimizer_state_dict", "load_full_optimizer_state_dict", "save_full_checkpoint", "load_full_checkpoint"]
