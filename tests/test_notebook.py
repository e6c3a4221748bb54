"""Executes experiments/trees_notebook.ipynb (QUICK = True) so it cannot rot.

The kernel is this interpreter: a throwaway kernelspec whose argv is `sys.executable -m
ipykernel_launcher`, so no installed `python3` spec (another venv's, a user-wide one) is
picked up, in CI (`pip install -e .[test]`) as here.
"""

import json
import os
import re
import sys
import time

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from experiments import make_notebook

NOTEBOOK = make_notebook.PATH
CELL_TIMEOUT_S = 150
# The QUICK run takes about 60-90 s on 2 busy CPU cores; this only catches a run that is
# no longer QUICK (a full SFT takes minutes), not a slow machine.
TOTAL_BUDGET_S = 240


def _kernel_manager(tmp_path):
  spec_dir = tmp_path / "kernels" / "python3"
  spec_dir.mkdir(parents=True)
  (spec_dir / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "Python 3 (this interpreter)", "language": "python"}))
  ksm = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")], ensure_native_kernel=False)
  km = KernelManager(kernel_name="python3", kernel_spec_manager=ksm)
  assert km.kernel_spec.argv[0] == sys.executable
  return km


def _by_tag(nb):
  return {tag: cell for cell in nb.cells for tag in cell.metadata.get("tags", [])}


def _text(cell):
  """The cell's stdout (warnings and logs go to stderr)."""
  return "".join(o.text for o in cell.outputs
                 if o.output_type == "stream" and o.name == "stdout")


def _data(cell, mime):
  return [o["data"][mime] for o in cell.outputs
          if o.output_type in ("display_data", "execute_result") and mime in o.get("data", {})]


def test_committed_notebook_is_generated_and_clean():
  with open(NOTEBOOK) as f:
    committed = f.read()
  assert committed == make_notebook.text(), (
      "experiments/trees_notebook.ipynb is stale: run python experiments/make_notebook.py")
  nb = nbformat.reads(committed, as_version=4)
  nbformat.validate(nb)
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert not cell.outputs and cell.execution_count is None
  assert "QUICK = False" in _by_tag(nb)["parameters"].source


def test_notebook_runs(tmp_path, monkeypatch):
  monkeypatch.delenv("MPLBACKEND", raising=False)  # let the kernel use the inline backend
  nb = nbformat.read(NOTEBOOK, as_version=4)
  params = _by_tag(nb)["parameters"]
  params.source += f"\nQUICK = True\nWORKDIR = {str(tmp_path / 'work')!r}\n"

  km = _kernel_manager(tmp_path)
  client = NotebookClient(nb, km=km, timeout=CELL_TIMEOUT_S,
                          resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}})
  t0 = time.time()
  try:
    client.execute()  # raises CellExecutionError on any error
  finally:  # a client given its own km leaves the kernel running
    if client.kc is not None:
      client.kc.stop_channels()
    if km.has_kernel:
      km.shutdown_kernel(now=True)
  wall = time.time() - t0
  assert wall < TOTAL_BUDGET_S, f"notebook took {wall:.0f}s"

  for cell in nb.cells:
    if cell.cell_type == "code":
      assert not [o for o in cell.outputs if o.output_type == "error"]
  cells = _by_tag(nb)
  assert _text(cells["sft"]).startswith("SFT 40 steps: loss")  # QUICK took effect
  group = _text(cells["group"])
  length = int(re.search(r", G = 8, L = (\d+)", group).group(1))
  assert len(re.findall(r"^  \d  R=[01]  ", group, re.M)) == 8

  text = _text(cells["render_text"])
  assert text.startswith("root  n=8  V=")
  assert re.search(r"^\s*[* ]\[.+\]  n=\d+  V=-?\d\.\d{3}  TD=[+-]\d\.\d{3}$", text, re.M)
  assert len(re.findall(r"-> response \d+: R=", text)) == 8

  graphviz = cells["graphviz"]
  assert _data(graphviz, "image/svg+xml") or "digraph prefix_tree {" in _text(graphviz)

  assert any("treescope" in html.lower() for html in _data(cells["treescope"], "text/html"))

  credit_text = _text(cells["credit"])
  for name in ("grpo", "tempo"):
    assert f"{name}: advantages (8, {length}) float32" in credit_text
  assert "mean A=" in credit_text

  assert _data(cells["plot"], "image/png")
