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


def test_each_page_links_to_the_index_and_to_its_neighbours(site):
    out, pages = site
    order = [n[:-6] + ".html" for n in NOTEBOOKS]
    for i, name in enumerate(order):
        text = (out / name).read_text(encoding="utf-8")
        navs = re.findall(r'<nav class="course-nav"[^>]*>(.*?)</nav>', text, re.S)
        assert len(navs) == 2, f"{name}: {len(navs)} lines of page links, expected one at the top and one at the bottom"
        expected = ([order[i - 1]] if i else []) + ["index.html"] + ([order[i + 1]] if i + 1 < len(order) else [])
        for nav in navs:
            assert re.findall(r'href="([^"]+)"', nav) == expected, name
        assert text.index(navs[0]) < text.index("<h1"), f"{name}: the page links are not above the title"
    for target in {t for name in order for t in re.findall(r'href="([^"#:]+\.html)"', (out / name).read_text())}:
        assert (out / target).is_file(), f"a page links to {target}, which the build did not write"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_widget_on_a_page_is_labelled(site, name):
    html, nb = site[1][name]
    widgets = sum(build_html.WIDGET_VIEW in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
                  for o in c.get("outputs", []))
    assert widgets, f"{name}: the executed notebook shows no widget (its self-test quiz is one)"
    assert html.count('class="static-widget-note"') == widgets


def _widget_output(model_id="abc"):
    return nbformat.v4.new_output("display_data", data={
        build_html.WIDGET_VIEW: {"model_id": model_id, "version_major": 2, "version_minor": 0},
        "text/plain": "TileStepper(...)"})


def test_a_widget_gets_a_note_before_it_and_a_quiz_is_pointed_to_its_static_copy(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# A lesson"),
        nbformat.v4.new_code_cell("stepper", outputs=[_widget_output("a")], execution_count=1),
        nbformat.v4.new_code_cell('quiz_widget("01_online_softmax")', outputs=[_widget_output("b")], execution_count=2),
        nbformat.v4.new_code_cell("x = 1", outputs=[], execution_count=3)])
    source = tmp_path / "01_x.ipynb"
    source.write_text(nbformat.writes(nb))
    page, done, _ = build_html.build_page(source, tmp_path, executed=nbformat.reads(nbformat.writes(nb), as_version=4))
    stepper, quiz, plain = (c.outputs for c in done.cells[1:])
    assert [build_html.WIDGET_VIEW in o.data for o in stepper] == [False, True]     # the note, then the widget
    assert "pictures and text around it" in stepper[0].data["text/html"]
    assert "static version follows" in quiz[0].data["text/html"]
    assert build_html.WIDGET_VIEW in quiz[1].data and "Self-test (static version)" in quiz[2].data["text/html"]
    assert plain == []
    text = page.read_text(encoding="utf-8")
    assert text.count('class="static-widget-note"') == 2
    assert text.index("static version follows") < text.index("Self-test (static version)")


def test_static_quiz_letters_its_choices_as_its_answer_names_them():
    from lessons.course.quiz import static_quiz_html

    quiz = static_quiz_html("01_online_softmax")
    # JupyterLab's style sheet letters a list nested in a list A, B, ...: the answer says "(c)"
    lists = re.findall(r"<ol type='a'([^>]*)>", quiz)
    assert lists and all("list-style-type: lower-alpha" in attrs for attrs in lists)


def test_page_links_for_the_first_middle_and_last_page(tmp_path):
    pages = [(tmp_path / f"{n}.html", f"Title {n}") for n in ("01_a", "02_b", "03_c")]
    for p, _ in pages:
        p.write_text('<html><body class="jp-Notebook">\n<h1>x</h1>\n</body></html>', encoding="utf-8")
    build_html.add_navigation(pages)
    hrefs = [re.findall(r'href="([^"]+)"', p.read_text().split("<h1>")[0]) for p, _ in pages]
    assert hrefs == [["index.html", "02_b.html"], ["01_a.html", "index.html", "03_c.html"], ["02_b.html", "index.html"]]
    middle = pages[1][0].read_text()
    assert "&larr; Title 01_a" in middle and "Title 03_c &rarr;" in middle
    assert middle.count('<nav class="course-nav"') == 2 and middle.rstrip().endswith("</nav>\n</body></html>")
    bare = tmp_path / "04_d.html"
    bare.write_text("<p>no body</p>")
    with pytest.raises(ValueError, match="04_d.html has no <body>"):
        build_html.add_navigation([(bare, "d")])
