"""Re-execute notebook.ipynb top to bottom and store its outputs, so that it reads on GitHub.

    pip install nbclient ipykernel matplotlib && python tests/execute_notebook.py

Progress bars (tqdm writes them to stderr, one output per refresh) are dropped from the stored copy;
everything else the cells print or plot is kept. tests/test_notebook.py checks the stored copy.
"""
import os
import sys

import nbclient
import nbformat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
path = os.path.join(ROOT, "notebook.ipynb")
os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
nb = nbformat.read(path, as_version=4)
nbclient.NotebookClient(nb, timeout=1800, kernel_name="python3", resources={"metadata": {"path": ROOT}}).execute()
for cell in nb.cells:
    if cell.cell_type == "code":
        cell.outputs = [o for o in cell.outputs if not (o.output_type == "stream" and o.name == "stderr")]
nbformat.write(nb, path)
print(f"executed {path}: {os.path.getsize(path) / 1e3:.0f} kB", file=sys.stderr)
