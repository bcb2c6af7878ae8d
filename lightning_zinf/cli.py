"""The ``zinf`` command: Lightning's CLI with this package imported.

``zinf fit --config examples/configs/gpt_stdlib.yaml`` is ``LightningCLI`` with one difference:
``lightning_zinf`` is imported first, so a YAML file may say ``strategy: zero_infinity`` (a plain
``LightningCLI`` only knows that name once something has imported the package). The class-path form,
``strategy: {class_path: lightning_zinf.ZeroInfinityStrategy, init_args: {...}}``, works in both.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from lightning.pytorch.cli import LightningCLI

import lightning_zinf  # noqa: F401  (registers the "zero_infinity" strategy name)

__all__ = ["main"]


def main(args: Optional[list[str]] = None) -> None:
    """Run ``LightningCLI`` (subcommands ``fit``, ``validate``, ``test``, ``predict``).

    Models and data modules are given by class path in the config. The current directory is put on
    ``sys.path``, as ``python -m`` does, so class paths into a checkout (``examples.gpt...``) import.

    Args:
        args: Command-line arguments; ``None`` reads ``sys.argv``.
    """
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    LightningCLI(args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
