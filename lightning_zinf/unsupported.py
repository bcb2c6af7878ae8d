"""What the strategies refuse rather than silently do otherwise: the error they raise for it, and a
user's ``CheckpointIO`` plugin."""

from __future__ import annotations

from typing import Optional

from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.exceptions import MisconfigurationException

__all__ = ["NotSupportedError", "refuse_checkpoint_io"]


class NotSupportedError(MisconfigurationException, NotImplementedError, ValueError):
    """A combination of options and calls the strategy cannot honour (clipping gradients by value
    while they are on NVMe...), raised before it would silently do something else.

    It is each type Lightning's sharded strategies raise for such a case, so code written for them
    catches it: ``MisconfigurationException`` (the Trainer's ``DeepSpeedStrategy``, e.g. for
    ``gradient_clip_algorithm="value"``), ``NotImplementedError`` (Fabric's ``DeepSpeedStrategy``
    and ``FSDPStrategy``), and ``ValueError`` (what this package raised for it before).
    """


def refuse_checkpoint_io(checkpoint_io: Optional[CheckpointIO], strategy: str) -> None:
    """Refuse a user's ``CheckpointIO`` plugin (``plugins=[...]``, or the strategy's ``checkpoint_io=``).

    The strategies write and read their checkpoints themselves (every rank its own shard files,
    :mod:`lightning_zinf.checkpoint`), so a plugin would never be called, and the storage, format
    or asynchrony the user chose would be lost without a word. Lightning's Fabric ``FSDPStrategy``
    and ``ModelParallelStrategy`` refuse one the same way, with this type (its Trainer strategies
    ignore it).

    Args:
        checkpoint_io: The plugin given, or ``None``.
        strategy: The strategy's class name, for the message.

    Raises:
        NotImplementedError: ``checkpoint_io`` is not ``None``.
    """
    if checkpoint_io is not None:
        raise NotImplementedError(
            f"{strategy} does not use a CheckpointIO plugin: it writes and reads its checkpoints itself (every "
            f"rank its own shards), so {type(checkpoint_io).__name__} would never be called. Remove it from "
            "`plugins=` (or `checkpoint_io=`); give the checkpoint's path to ModelCheckpoint(dirpath=...), "
            "trainer.save_checkpoint(path) or fabric.save(path, ...) to choose where it is written."
        )
