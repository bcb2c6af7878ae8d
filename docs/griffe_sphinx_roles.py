"""A griffe extension for the API pages: Sphinx roles in docstrings become cross-references.

The docstrings are Google style, with Sphinx roles inside (``:class:`~lightning_zinf.PrefetchConfig```,
``:meth:`gathered_parameters```...), which Markdown would print as they are. Each role becomes its
target in code font, linked when the target has a page in these docs (an *optional* cross-reference
of mkdocs-autorefs, the kind mkdocstrings itself writes for annotations: an unknown target, such as
``ValueError`` or an internal helper, stays plain code instead of failing the strict build).

A ``~`` before the target shows its last name only, as in Sphinx. An unqualified target is resolved
from the documented object's scope (its members, then its parents' and its module's names).
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?P<role>class|meth|func|attr|data|mod|obj|exc|const):`(?P<target>[^`]+)`")


def _identifier(obj: griffe.Object, target: str) -> str:
    """The full path ``target`` names from ``obj``'s docstring (itself when it cannot be resolved)."""
    head, _, rest = target.partition(".")
    if head in ("lightning_zinf", "triton_kernels"):
        return target
    try:
        path = obj.resolve(head)
    except Exception:  # noqa: BLE001 - not resolvable (a builtin, a name of another library): as written
        return target
    return f"{path}.{rest}" if rest else path


def _replace(obj: griffe.Object, match: re.Match[str]) -> str:
    target = match["target"].strip()
    short = target.startswith("~")
    target = target.lstrip("~").strip()
    if target.endswith("()"):
        target = target[:-2]
    title = target.rsplit(".", 1)[-1] if short else target
    if match["role"] in ("meth", "func"):
        title += "()"
    identifier = _identifier(obj, target)
    return f'<autoref identifier="{html.escape(identifier)}" optional><code>{html.escape(title)}</code></autoref>'


def _rewrite(obj: griffe.Object, seen: set[int]) -> None:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if obj.docstring is not None and ":" in obj.docstring.value:
        obj.docstring.value = _ROLE.sub(lambda m: _replace(obj, m), obj.docstring.value)
    for member in obj.members.values():
        if not member.is_alias:
            _rewrite(member, seen)


class SphinxRoles(griffe.Extension):
    """Rewrite the Sphinx roles of every docstring of a package once it is loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        _rewrite(pkg, set())


if not hasattr(griffe.Extension, "on_package"):  # older griffe (1.x) names this event on_package_loaded
    SphinxRoles.on_package_loaded = SphinxRoles.on_package  # type: ignore[attr-defined]
