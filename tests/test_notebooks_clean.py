"""Notebooks are committed stripped of outputs, numbered, and each names its learning goals."""
import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def how_to_clean(name: str) -> str:
    """What a failure tells a learner who ran and saved a notebook of notebooks/ itself."""
    saved = name.replace(".ipynb", "-saved.ipynb")
    return (f". notebooks/ is committed without outputs; `make lab` opens your own copies in my_notebooks/. "
            f"To keep this run: cp notebooks/{name} my_notebooks/{saved}; then restore the committed "
            f"notebook: git checkout -- notebooks/{name}")


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks found under notebooks/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stripped_and_numbered(path):
    nb = json.loads(path.read_text())
    assert re.match(r"^\d\d_[a-z0-9_]+\.ipynb$", path.name)
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            hint = how_to_clean(path.name)
            assert cell.get("outputs") == [], f"{path.name}: a code cell holds outputs" + hint
            assert cell.get("execution_count") is None, f"{path.name}: a code cell holds an execution count" + hint
    assert nb["metadata"].get("kernelspec", {}).get("name") == "python3"
