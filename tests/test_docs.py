"""The documentation site builds, strictly, and its API reference is not empty.

``mkdocs build --strict`` (mkdocs.yml at the repository root) fails on any warning: a link between
pages, or to a heading, that is not there; a page left out of the nav; a ``::: name`` block naming
something that does not exist (mkdocstrings); a docstring that griffe cannot parse against its
function's signature (a documented parameter that is not in it); a README or RESULTS.md part the
pages include that has gone. The tools come with the ``docs`` extra, which the ``test`` extra
includes.
"""

from __future__ import annotations

import html
import inspect
import re
import subprocess
import sys
from pathlib import Path

import lightning_zinf

ROOT = Path(__file__).resolve().parent.parent


def _text(page: str) -> str:
    """A built page's visible text, tags removed, entities decoded, whitespace collapsed."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", page)).split())


def _first_sentence(docstring: str) -> str:
    """The docstring's first sentence, its inline markup (````code````) removed."""
    paragraph = " ".join(docstring.split("\n\n")[0].split()).replace("`", "")
    match = re.match(r"(.+?[.!?])(\s|$)", paragraph)
    assert match, f"no sentence in {paragraph!r}"
    return match.group(1)


def test_docs_build_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, (
        f"mkdocs build --strict failed (rc {proc.returncode}; the tools: pip install -e '.[docs]'):\n"
        f"{proc.stdout}\n{proc.stderr}"
    )

    # The API page of ZeroInfinityStrategy: found by its anchor wherever the API pages put it, and
    # holding its docstring's first sentence (an API page that renders empty fails here).
    anchor = 'id="lightning_zinf.ZeroInfinityStrategy"'
    pages = [p for p in site.rglob("*.html") if anchor in p.read_text(encoding="utf-8")]
    assert pages, f"no built page has {anchor}: the API reference lost ZeroInfinityStrategy"
    sentence = _first_sentence(inspect.getdoc(lightning_zinf.ZeroInfinityStrategy) or "")
    text = _text(pages[0].read_text(encoding="utf-8"))
    assert sentence in text, f"{pages[0]} lacks the docstring's first sentence {sentence!r}"

    # The home page shows the README's commands (included from README.md, not copied).
    index = _text((site / "index.html").read_text(encoding="utf-8"))
    for command in ('pip install -e ".[examples]"', 'pip install -e ".[test]"'):
        assert command in index, f"the home page lacks the README's command ({command})"
