"""`make html`: every notebook executed into one static page that carries its own figures.

The series is built once per test session into a temporary folder with
``scripts/build_html.py``, the script behind `make html`. A notebook that the browser tests
already ran top to bottom in this process (JupyterLab's saved copy after Run All, in
``jlab.EXECUTED``) is converted, not run a second time; every other notebook, and always
the first, is executed here as `make html` does.
"""
from __future__ import annotations

import base64
import importlib.util
import re
import struct
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
_spec = importlib.util.spec_from_file_location("build_html", ROOT / "scripts" / "build_html.py")
build_html = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_html)

# The build executes every notebook and fails on any error: nbval need not run them again (conftest.py).
pytestmark = pytest.mark.notebook(*NOTEBOOKS)

_DATA_PNG = re.compile(r'<img\b[^>]*\bsrc="data:image/png;base64,([^"]+)"')


@pytest.fixture(scope="session")
def site(tmp_path_factory):
    """(output folder, {notebook name: (html text, executed notebook)}) of one build."""
    out = tmp_path_factory.mktemp("html")
    executed = dict(getattr(sys.modules.get("jlab"), "EXECUTED", {}))
    executed.pop(NOTEBOOKS[0], None)                 # make html's own execution, checked every run
    built = build_html.build(out, log=lambda *args: None, executed=executed)
    return out, {path.name: (page.read_text(encoding="utf-8"), nb) for path, (page, nb, _) in built.items()}


def _b64(s: str) -> str:
    return re.sub(r"\s+", "", s)


def _png_size(b64: str) -> tuple[int, int]:
    """(width, height) from a base64 PNG's IHDR chunk; raises AssertionError if it is not a PNG."""
    raw = base64.b64decode(b64)
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and raw[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", raw[16:24])


def _figures(nb) -> list[tuple[int, str]]:
    """(cell index, base64 PNG) of every figure the executed notebook shows in its cell outputs."""
    return [(i, _b64(out["data"]["image/png"])) for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
            for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]


def test_a_page_per_notebook_and_an_index_in_order(site):
    out, pages = site
    assert sorted(pages) == NOTEBOOKS
    assert sorted(p.name for p in out.glob("*.html")) == sorted(["index.html"] + [n[:-6] + ".html" for n in NOTEBOOKS])
    links = re.findall(r'<a href="([^"]+)"', (out / "index.html").read_text(encoding="utf-8"))
    assert links == [n[:-6] + ".html" for n in NOTEBOOKS]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_page_inlines_every_figure_of_its_notebook(site, name):
    html, nb = site[1][name]
    figures = _figures(nb)
    assert figures, f"{name}: the executed notebook shows no figure"
    inlined = [_b64(m) for m in _DATA_PNG.findall(html)]
    missing = [i for i, fig in figures if fig not in inlined]
    assert not missing, f"{name}: figures of cells {missing} are not in the page as data:image/png"
    for b64 in inlined:
        width, height = _png_size(b64)
        assert width >= 100 and height >= 50, f"{name}: a {width}x{height} image is too small to be a figure"
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                if o.get("output_type") == "error"]


def test_notebook_02_page_shows_the_final_step_picture(site):
    name = next(n for n in NOTEBOOKS if n.startswith("02_"))
    html, nb = site[1][name]
    cells = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "final_step_figure(" in c.source]
    assert len(cells) == 1, f"{name}: expected one cell drawing final_step_figure, found {len(cells)}"
    pictures = [fig for i, fig in _figures(nb) if i == cells[0]]
    assert len(pictures) == 1, f"{name}: the final_step_figure cell shows {len(pictures)} pictures"
    assert pictures[0] in [_b64(m) for m in _DATA_PNG.findall(html)]
    width, height = _png_size(pictures[0])
    assert width >= 600 and height >= 300, f"the final-step picture is only {width}x{height}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_page_has_a_static_copy_of_its_quiz(site, name):
    import html as html_lib

    from lessons.course.quiz import QUIZZES

    page, _ = site[1][name]
    questions = QUIZZES[name[:-6]]
    assert page.count("<summary>Show the answer</summary>") == len(questions)
    for q in questions:
        assert html_lib.escape(q.question, quote=False) in page     # the static copy (quotes come out unescaped)


def _ran_notebook(outputs):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# A lesson"),
                                         nbformat.v4.new_code_cell("x = 1", outputs=outputs, execution_count=1)])
    return nbformat.writes(nb)


def test_an_executed_notebook_is_converted_not_run_again(tmp_path):
    source = tmp_path / "01_x.ipynb"
    source.write_text(_ran_notebook([]))                  # the file on disk has no output at all
    shown = nbformat.v4.new_output("stream", name="stdout", text="printed in JupyterLab\n")
    executed = nbformat.reads(_ran_notebook([shown]), as_version=4)
    page, nb, _ = build_html.build_page(source, tmp_path, executed=executed)
    assert "printed in JupyterLab" in page.read_text(encoding="utf-8")
    assert nb.cells[1].outputs[0].text == "printed in JupyterLab\n"


def test_an_executed_notebook_with_an_error_is_refused(tmp_path):
    source = tmp_path / "01_x.ipynb"
    source.write_text(_ran_notebook([]))
    failed = nbformat.v4.new_output("error", ename="ZeroDivisionError", evalue="division by zero", traceback=[])
    with pytest.raises(ValueError, match="ZeroDivisionError"):
        build_html.build_page(source, tmp_path, executed=nbformat.reads(_ran_notebook([failed]), as_version=4))
    assert not (tmp_path / "01_x.html").exists()
