"""The notebook runs: every code cell in order, in one namespace, with a fast setting."""
import json
import os

from helpers import ROOT

NB = os.path.join(ROOT, "notebook.ipynb")


def test_notebook_is_small_and_has_no_outputs():
    assert os.path.getsize(NB) < 1_000_000
    nb = json.load(open(NB))
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None


def test_every_code_cell_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("NOTEBOOK_FAST", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.chdir(tmp_path)
    nb = json.load(open(NB))
    ns = {"__name__": "__notebook__"}
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            code = "".join(cell["source"])
            assert "def grpo_loss" not in code and "def compute_advantages" not in code  # imports, never re-implements
            exec(compile(code, f"cell {i}", "exec"), ns)
    assert ns["evals"] and ns["steps"]
