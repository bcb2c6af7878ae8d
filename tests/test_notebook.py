"""The quickstart notebook, executed headless (nbclient, a real IPython kernel) in a tiny
configuration: ``Trainer(strategy="zero_infinity", devices=2)`` under Lightning's fork launcher,
with the trained weights handed back to the notebook's process."""

from __future__ import annotations

import math
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from examples.gpt import GPT, GPTConfig

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "notebooks" / "quickstart.ipynb"


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")


def test_quickstart_notebook_trains_and_returns_the_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUICKSTART_STEPS", "4")
    monkeypatch.setenv("QUICKSTART_WIDTH", "64")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    code = [c for c in nb.cells if c.cell_type == "code"]

    assert "Starting with 2 processes" in _text(code[1])  # the fork launcher ran 2 workers
    assert any("image/png" in o.get("data", {}) for o in code[2]["outputs"])  # the inline plot

    # The notebook's own model (built by configure_model in the notebook process) has every
    # parameter of the trained GPT...
    expected = sum(p.numel() for p in GPT(GPTConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4)).parameters())
    assert f"{expected:,} parameters in the notebook's model" in _text(code[3])
    # ...with the trained values: it reproduces the validation loss the workers logged.
    here, logged = map(float, re.search(r"here: ([\d.]+); logged by the workers: ([\d.]+)", _text(code[4])).groups())
    assert here == pytest.approx(logged, abs=1e-4)
    assert logged < math.log(256) - 0.2  # it trained (uniform bytes: ln 256 = 5.55)
