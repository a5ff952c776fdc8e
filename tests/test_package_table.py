"""The notebook -> schedule -> view -> kernel -> exercise table names things that exist."""
import importlib
import re
from pathlib import Path

import lessons

ROOT = Path(__file__).resolve().parents[1]


def readme_rows():
    text = (ROOT / "README.md").read_text()
    start = text.index("| notebook | schedule | view | kernel | exercise |")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append([re.findall(r"`([^`]+)`", cell) for cell in line.strip("|").split("|")])
    return rows


def test_every_notebook_has_a_row_and_every_name_exists():
    rows = readme_rows()
    assert sorted(r[0][0] for r in rows) == sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9]*.ipynb"))
    for notebook, schedules, views, kernels, exercises in rows:
        for module in schedules + views:
            importlib.import_module("lessons." + module.replace("/", "."))
        for kernel in kernels:
            assert (ROOT / "lessons" / "gpu" / "kernels" / kernel).is_file(), kernel
        for exercise in exercises:
            assert (ROOT / "exercises" / f"{exercise}.py").is_file(), exercise
            assert (ROOT / "solutions" / f"{exercise}.py").is_file(), exercise
        # the notebook itself points the learner at its exercises
        source = (ROOT / "notebooks" / f"{notebook[0]}.ipynb").read_text()
        assert all(f"exercises/{e}" in source for e in exercises), notebook


def test_the_package_docstring_holds_the_same_table():
    doc = lessons.__doc__
    for notebook, schedules, views, kernels, exercises in readme_rows():
        number = notebook[0][:2]
        assert re.search(rf"^{number} ", doc, re.M), number
        for name in [m.replace("/", ".") for m in schedules + views] + kernels + exercises:
            assert name in doc, name


def _sections(notebook: Path) -> list[str]:
    """The notebook's "## " headings, in order."""
    import json
    cells = json.loads(notebook.read_text())["cells"]
    return [line[3:].strip() for c in cells if c["cell_type"] == "markdown"
            for line in "".join(c["source"]).splitlines() if line.startswith("## ")]


def test_the_notebooks_end_as_the_readme_says():
    """README: every notebook ends with "Your turn", a self-test and (all but 06, 10 and 11) a GPU appendix."""
    readme = " ".join((ROOT / "README.md").read_text().split())

    def named(pattern):
        """The notebooks named in backticks in the first phrase of README that ``pattern`` finds."""
        return set(re.findall(r"`(\d\d_\w+)`", re.search(pattern, readme).group(1)))

    without = named(r"all but ((?:`\d\d_\w+`(?:,| and) ?)*`\d\d_\w+`)")
    assert without == named(r"Each notebook but ((?:`\d\d_\w+`(?:,| and) ?)*`\d\d_\w+`) ends with a section"), without
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        heads = _sections(path)
        if path.stem in without:
            assert heads[-2:] == ["Your turn", "Self-test"], (path.name, heads[-3:])
        else:
            assert heads[-3:-1] == ["Your turn", "Self-test"] and heads[-1].startswith("Appendix"), (path.name, heads[-3:])
            assert "lessons.gpu" in path.read_text(), path.name
