"""Notebooks are committed stripped of outputs, numbered, and each names its learning goals."""
import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks found under notebooks/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stripped_and_numbered(path):
    nb = json.loads(path.read_text())
    assert re.match(r"^\d\d_[a-z0-9_]+\.ipynb$", path.name)
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [], f"{path.name}: a code cell holds outputs"
            assert cell.get("execution_count") is None, f"{path.name}: a code cell holds an execution count"
    assert nb["metadata"].get("kernelspec", {}).get("name") == "python3"
