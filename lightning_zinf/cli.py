"""The ``zinf`` command: Lightning's CLI with this package imported, and ``zinf plan``.

``zinf fit --config examples/configs/gpt_stdlib.yaml`` is ``LightningCLI`` with one difference:
``lightning_zinf`` is imported first, so a YAML file may say ``strategy: zero_infinity`` (a plain
``LightningCLI`` only knows that name once something has imported the package). The class-path form,
``strategy: {class_path: lightning_zinf.ZeroInfinityStrategy, init_args: {...}}``, works in both.
``zinf plan --config run.yaml`` prints the placement the config's ``memory_budget`` gives
(:func:`plan`), without training.

A configuration error ends the command as argparse ends it (usage, the error, exit status 2), and
its last line is the cause: jsonargparse reports a value it cannot fit as a tree of every type it
tried (the strategy is ``Union[str, Strategy]``, each config ``Optional[...]``), with the error
our config classes raised (``PrefetchConfig.bucket_size=-1 is invalid: allowed values are ...``)
some fifty lines deep; the last line repeats that error with the path of the option in the config
file (``zinf: error: trainer.strategy.init_args.prefetch: PrefetchConfig.bucket_size=-1 is
invalid: ...``), and for an unknown option the accepted ones closest to it.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib
import inspect
import os
import re
import sys
from typing import Any, NoReturn, Optional

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_zinf  # noqa: F401  (registers the "zero_infinity" strategy name)

__all__ = ["main", "plan", "config_error_cause"]

# The lines of a jsonargparse error that are its structure, not a cause: the tree of union members
# tried, the value given, and the trivial members (a strategy *name*, ``None``) that a mapping fails.
_STRUCTURE = re.compile(
    r"(- )?(Parser key \"|Does not validate against any of the Union subtypes|Subtypes: |Errors:|Given value( type)?: "
    r"|Problem with given class_path |Expected a <class '(str|NoneType)'>$)"
)
_KEY = re.compile(r'(?:- )?Parser key "([^"]+)":')
_CLASS = re.compile(r"(?:- )?Problem with given class_path '([^']+)':")
_UNKNOWN = re.compile(r"(?:- )?Option '([^']+)' is not accepted")
_MARKERS = ("Does not validate against any of the Union subtypes", "Parser key \"", "Problem with given class_path",
            "is not accepted", "does not accept option")


def config_error_cause(message: str) -> Optional[str]:
    """The cause in a jsonargparse error ``message``: its deepest line that is not structure (the
    error a config class raised, or jsonargparse's own for a type or an unknown key), prefixed with
    the path of the option in the config (``trainer.strategy.init_args.zero_pp``); for an unknown
    option, the accepted ones closest to it. ``None`` when ``message`` has no such line."""
    best: Optional[tuple[int, str]] = None
    stack: list[tuple[int, str, str]] = []  # (indent, "key" or "class", name) of the lines above
    lines = message.splitlines()
    for index, raw in enumerate(lines):
        text = raw.strip()
        if not text:
            continue
        indent = len(raw) - len(raw.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key, cls = _KEY.match(text), _CLASS.match(text)
        if key or cls:
            stack.append((indent, "key" if key else "class", (key or cls).group(1)))  # type: ignore[union-attr]
            continue
        if _STRUCTURE.match(text) or (best is not None and indent <= best[0]):
            continue
        best = (indent, _describe(text.removeprefix("- "), stack, lines[index + 1:]))
    return best[1] if best is not None else None


def _describe(cause: str, stack: list[tuple[int, str, str]], rest: list[str]) -> str:
    """``cause`` with the option path of ``stack`` (a subclass's arguments are under ``init_args``,
    a dataclass's fields are not), and the closest accepted options for an unknown one."""
    path: list[str] = []
    owner: Any = None
    for _, kind, name in stack:
        if kind == "key":
            path.append(name)
            continue
        owner = _import(name)
        if owner is not None and not dataclasses.is_dataclass(owner):
            path.append("init_args")
    unknown = _UNKNOWN.match(cause)
    if unknown is None or owner is None:
        return f"{'.'.join(path)}: {cause}" if path else cause
    name = unknown.group(1)
    value = _given_value(rest, name.split(".")[0])
    try:
        accepted = [p for p in inspect.signature(owner).parameters if p not in ("self", "args", "kwargs")]
    except (TypeError, ValueError):  # no signature to read
        return f"{'.'.join(path)}: {cause}" if path else cause
    close = difflib.get_close_matches(name.split(".")[0], accepted, n=3)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    accepted_list = "" if close else f" (accepted: {', '.join(accepted)})"
    where = ".".join(path + [name.split(".")[0]])
    return (f"{where}{'=' + value if value else ''}: {getattr(owner, '__qualname__', owner)} has no option "
            f"{name.split('.')[0]!r}{hint}{accepted_list}")


def _import(class_path: str) -> Any:
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except Exception:
        return None


def _given_value(rest: list[str], key: str) -> str:
    """The value given for ``key`` in the next ``Given value: {...}`` line, if it reads as a literal."""
    for raw in rest:
        text = raw.strip()
        if text.startswith("Given value: "):
            try:
                given = ast.literal_eval(text.removeprefix("Given value: "))
            except (ValueError, SyntaxError):
                return ""
            if isinstance(given, dict) and isinstance(given.get("init_args"), dict):
                given = given["init_args"]  # a subclass's arguments
            return repr(given[key]) if isinstance(given, dict) and key in given else ""
    return ""


class _Parser(LightningArgumentParser):
    """Lightning's parser, whose configuration errors end with their cause
    (:func:`config_error_cause`), at parse time and when the classes are built."""

    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        """Print the usage and ``message``, its cause last, and exit with status 2 (as argparse);
        raise instead where jsonargparse asked this parser not to exit (it tries alternatives)."""
        cause = config_error_cause(message) if self.exit_on_error else None
        if cause is not None and cause != message.strip().splitlines()[-1].strip():
            message = f"{message}\nzinf: error: {cause}"
        super().error(message, ex)

    def instantiate(self, cfg: Any, *args: Any, **kwargs: Any) -> Any:
        """Build the configured classes; a value a class refuses (our config classes' checks, which
        jsonargparse wraps in the tree of union members it tried) is a configuration error:
        :meth:`error`.

        Raises:
            SystemExit: (status 2) a configuration error.
        """
        try:
            return super().instantiate(cfg, *args, **kwargs)
        except (ValueError, TypeError) as error:
            text = str(error)
            if not self.exit_on_error or not any(marker in text for marker in _MARKERS):
                raise
            self.error(text, error)


def main(args: Optional[list[str]] = None) -> None:
    """Run ``LightningCLI`` (subcommands ``fit``, ``validate``, ``test``, ``predict``), or, for
    ``plan``, print the memory plan of the configured run (:func:`plan`).

    Models and data modules are given by class path in the config. The current directory is put on
    ``sys.path``, as ``python -m`` does, so class paths into a checkout (``examples.gpt...``) import.

    A configuration error (an unknown option, a value of the wrong type, a value a config class
    refuses) prints the usage and the error, its cause on the last line (``zinf: error: <option
    path>: <cause>``), and exits with status 2, as argparse does.

    Args:
        args: Command-line arguments; ``None`` reads ``sys.argv``.

    Raises:
        SystemExit: status 2 on a configuration error (0 after ``--help``).
    """
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if (sys.argv[1:2] if args is None else list(args)[:1]) == ["plan"]:
        if args is None:
            del sys.argv[1]  # LightningCLI reads the rest from sys.argv
        plan(None if args is None else list(args)[1:])
        return
    LightningCLI(args=args, save_config_kwargs={"overwrite": True}, parser_class=_Parser)


def plan(args: Optional[list[str]] = None) -> None:
    """``zinf plan --config run.yaml``: print the memory plan the run's ``memory_budget`` gives
    (:meth:`~lightning_zinf.ZeroInfinityStrategy.memory_plan`) without training or starting the
    other ranks: the Trainer and the model are built from the same arguments as ``zinf fit``
    takes, the model's parameters on the meta device (no memory, no initialisation). ``args``:
    the arguments after ``plan``; ``None`` reads ``sys.argv``.

    Raises:
        SystemExit: status 2 when the configuration is invalid, its strategy is not this package's
            or has no ``memory_budget``, or no placement fits (the message names the smallest
            budget that would).
    """
    from lightning_zinf.planning import BudgetError
    from lightning_zinf.strategy import ZeroInfinityStrategy

    cli = LightningCLI(args=args, run=False, parser_class=_Parser, save_config_callback=None)
    strategy = cli.trainer.strategy
    if not isinstance(strategy, ZeroInfinityStrategy) or strategy.options.memory_budget is None:
        cli.parser.error("zinf plan needs the strategy lightning_zinf.ZeroInfinityStrategy with a memory_budget: "
                         "trainer.strategy: {class_path: lightning_zinf.ZeroInfinityStrategy, init_args: "
                         "{memory_budget: 12GiB, offload: {nvme_path: /local_nvme}}}")
    try:
        print(strategy.memory_plan(cli.model).describe())
    except BudgetError as error:
        print(f"zinf plan: {error}", file=sys.stderr)  # the refusal alone, not the command's usage
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
