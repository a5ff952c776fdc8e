"""`make lab LAB_EXTRAS=` installs neither CuPy nor NVRTC (README): the kernel-ladder notebooks, the ones that
compile kernels for their tables (06 the forward rungs, 10 the decode rungs, 11 the Hopper rungs), must still run top
to bottom and say what they skipped."""
from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
#: notebook -> (the id of a cell that compiles kernels, how its output starts without CuPy and NVRTC)
NOTEBOOKS = {"06_kernel_ladder.ipynb": ("11d25197", "CUDA kernels not compiled"),             # the compile report
             "10_decode_kernel_ladder.ipynb": ("decode-little-table", "the machine code is not read here"),
             "11_hopper_kernels.ipynb": ("wg-pipes-table", "the machine code is not read here")}


def _blocked_packages(folder: Path) -> Path:
    """A folder that, first on PYTHONPATH, makes ``import cupy`` (and its two sibling packages) fail as on
    a machine without them."""
    for name in ("cupy", "cupy_backends", "cupyx"):
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(f'raise ImportError("No module named {name!r} (blocked)")\n')
    return folder


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_the_kernel_ladder_runs_without_cupy_and_says_so(tmp_path, name):
    path = ROOT / "notebooks" / name
    blocked = _blocked_packages(tmp_path / "blocked")
    nb = nbformat.read(path, as_version=4)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocked), str(ROOT)]), MPLBACKEND="Agg")
    client = NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    client.execute(env=env)
    errors = [(i, o["ename"], o["evalue"]) for i, c in enumerate(nb.cells) if c.cell_type == "code"
              for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "CuPy/NVRTC are not installed" in text             # lessons.gpu.gpu_status() where kernels compile
    assert "the machine code is not read here" in text       # lessons.gpu.sass.tools_missing()
    cell, start = NOTEBOOKS[name]
    report = next(c for c in nb.cells if c.get("id") == cell)
    assert "".join(o.get("text", "") for o in report.outputs).startswith(start), name
