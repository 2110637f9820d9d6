"""Execute a notebook with nbclient in a kernel running THIS interpreter (the project's venv).

No kernelspec is installed: a temporary one names `sys.executable -m ipykernel_launcher`, so a
fresh `make test` needs nothing set up by hand and a user's own "python3" kernel is never used.
The kernel imports pyramidkv from this checkout (PYTHONPATH = repository root).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
KERNEL_NAME = "pyramidkv-test-venv"


def execute_notebook(nb: nbformat.NotebookNode, cwd: Path, timeout: int = 600) -> nbformat.NotebookNode:
    """Run every cell top to bottom; raises nbclient's CellExecutionError (with the cell's
    traceback) on the first failing cell, and its timeout error for a cell that runs past `timeout` seconds
    (a hang, not a speed check: the notebook's time is measured nowhere in the tests). Returns the executed
    notebook."""
    with tempfile.TemporaryDirectory() as kernels:
        spec_dir = Path(kernels) / KERNEL_NAME
        spec_dir.mkdir()
        (spec_dir / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "pyramidkv venv", "language": "python",
            "env": {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                    "MPLBACKEND": "module://matplotlib_inline.backend_inline", "OMP_NUM_THREADS": "1"},
        }))
        specs = KernelSpecManager(kernel_dirs=[kernels])
        manager = KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=specs)
        client = NotebookClient(nb, km=manager, timeout=timeout, kernel_name=KERNEL_NAME,
                                resources={"metadata": {"path": str(cwd)}})
        client.execute()
        return nb


def cell_stdout(nb: nbformat.NotebookNode) -> str:
    return "".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                   for out in cell.get("outputs", []) if out.get("output_type") == "stream")
