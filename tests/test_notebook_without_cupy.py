"""`make lab LAB_EXTRAS=` installs neither CuPy nor NVRTC (README): the kernel-ladder notebook, the one that
compiles kernels for its tables, must still run top to bottom and say what it skipped."""
from __future__ import annotations

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "06_kernel_ladder.ipynb"


def _blocked_packages(folder: Path) -> Path:
    """A folder that, first on PYTHONPATH, makes ``import cupy`` (and its two sibling packages) fail as on
    a machine without them."""
    for name in ("cupy", "cupy_backends", "cupyx"):
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(f'raise ImportError("No module named {name!r} (blocked)")\n')
    return folder


def test_the_kernel_ladder_runs_without_cupy_and_says_so(tmp_path):
    blocked = _blocked_packages(tmp_path / "blocked")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocked), str(ROOT)]), MPLBACKEND="Agg")
    client = NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute(env=env)
    errors = [(i, o["ename"], o["evalue"]) for i, c in enumerate(nb.cells) if c.cell_type == "code"
              for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "CuPy/NVRTC are not installed" in text             # lessons.gpu.gpu_status() where kernels compile
    assert "the machine code is not read here" in text       # lessons.gpu.sass.tools_missing()
    report = next(c for c in nb.cells if c.get("id") == "11d25197")        # the compile report's cell
    assert "".join(o.get("text", "") for o in report.outputs).startswith("CUDA kernels not compiled")
