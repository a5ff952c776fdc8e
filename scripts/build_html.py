"""Build a static, executed HTML version of the notebook series.

Every notebook in ``notebooks/`` is run top to bottom (a fresh ``python3``
kernel each, working directory ``notebooks/``) and written as one HTML page
under the output folder, with its figures inlined as PNG data; an
``index.html`` links the pages in order. The notebooks themselves are not
modified. Widgets need a live kernel, so a page shows the static figures the
lessons draw next to them, a note where each widget would be, and each self-test quiz (a widget)
gets a static copy: question, choices, and the answer behind a collapsible ``<details>``.
Every page links to the index and to the pages before and after it.

    python scripts/build_html.py                 # -> _build/html/
    python scripts/build_html.py --out DIR NB... # only some notebooks

The exercise cells grade the untouched stubs (``--answers grading/stubs``, the default), so a page
shows what a new learner sees, never the answers in the builder's ``exercises/``.

Exit status 1 (and the failing cell's traceback) when a notebook raises.
"""
from __future__ import annotations

import argparse
import html
import os
import re
import sys
import time
from pathlib import Path

import nbformat
from nbconvert import HTMLExporter
from nbconvert.preprocessors import CellExecutionError, ExecutePreprocessor

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
DEFAULT_OUT = ROOT / "_build" / "html"


def notebook_title(nb, fallback: str) -> str:
    """The first Markdown heading of NB, or FALLBACK."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return fallback


_QUIZ_CALL = re.compile(r"""quiz_widget\(\s*["']([^"']+)["']\s*\)""")


def add_static_quizzes(nb) -> int:
    """Append the static HTML of each quiz to the outputs of the cell that calls ``quiz_widget("KEY")``.

    ``nb``: an executed notebook node (changed in place). Returns how many quizzes were added.
    """
    from lessons.course.quiz import static_quiz_html

    added = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for key in _QUIZ_CALL.findall(cell.source):
            cell.setdefault("outputs", []).append(nbformat.v4.new_output(
                "display_data", data={"text/html": static_quiz_html(key), "text/plain": f"quiz {key}"}))
            added += 1
    return added


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_NOTE = ('<p class="static-widget-note"><i>[Interactive widget: it runs only with a live kernel, in '
               'JupyterLab. {where}]</i></p>')


def label_widgets(nb) -> int:
    """Put a note before every widget output of NB, which a page read without a kernel would leave blank.

    ``nb``: an executed notebook node (changed in place). The widget output itself is kept. The note
    points a quiz's reader to its static copy (:func:`add_static_quizzes`) and any other widget's reader
    to the static pictures and text around it. Returns how many notes were added.
    """
    added = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        where = ("Its static version follows." if _QUIZ_CALL.search(cell.source)
                 else "On this page, the pictures and text around it show what it shows.")
        outputs = []
        for out in cell.get("outputs", []):
            if WIDGET_VIEW in out.get("data", {}):
                outputs.append(nbformat.v4.new_output(
                    "display_data", data={"text/html": WIDGET_NOTE.format(where=where),
                                          "text/plain": "[interactive widget: needs a live kernel]"}))
                added += 1
            outputs.append(out)
        cell.outputs = outputs
    return added


def build_page(path: Path, out_dir: Path, timeout: float = 600, executed=None) -> tuple[Path, object, float]:
    """Execute notebook PATH and write OUT_DIR/<stem>.html.

    ``executed``: PATH already run top to bottom elsewhere (an nbformat dict or node, e.g. as
    JupyterLab saved it after Run All): converted as it is, not run again.
    Returns (html path, executed notebook node, seconds). Raises
    nbconvert's CellExecutionError when a cell fails, ValueError for an ``executed`` notebook
    that holds an error output.
    """
    t0 = time.perf_counter()
    if executed is not None:
        nb = nbformat.from_dict(executed)
        errors = [o.get("ename") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                  if o.get("output_type") == "error"]
        if errors:
            raise ValueError(f"the executed copy of {path.name} holds error outputs: {errors}")
    else:
        nb = nbformat.read(path, as_version=4)
        ExecutePreprocessor(timeout=timeout, kernel_name="python3").preprocess(
            nb, {"metadata": {"path": str(path.parent)}})
    label_widgets(nb)
    add_static_quizzes(nb)
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(
        nb, resources={"metadata": {"name": notebook_title(nb, path.stem)}})
    out = out_dir / f"{path.stem}.html"
    out.write_text(body, encoding="utf-8")
    return out, nb, time.perf_counter() - t0


def write_index(pages: list[tuple[Path, str]], out_dir: Path) -> Path:
    """OUT_DIR/index.html linking PAGES ((html path, title) pairs) in order."""
    items = "\n".join(f'  <li><a href="{html.escape(p.name)}">{html.escape(t)}</a></li>' for p, t in pages)
    index = out_dir / "index.html"
    index.write_text(
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>Flash Attention, tile by tile</title>"
        "</head>\n<body>\n<h1>Flash Attention, tile by tile</h1>\n<ol>\n" + items + "\n</ol>\n</body></html>\n",
        encoding="utf-8")
    return index


_BODY_OPEN = re.compile(r"<body\b[^>]*>")


def nav_html(pages: list[tuple[Path, str]], i: int) -> str:
    """A line of links for page I of PAGES ((html path, title) pairs in order): the index, and the
    pages before and after it where there are some."""
    links = ['<a href="index.html">Contents</a>']
    if i > 0:
        links.insert(0, f'<a href="{html.escape(pages[i - 1][0].name)}" rel="prev">&larr; {html.escape(pages[i - 1][1])}</a>')
    if i + 1 < len(pages):
        links.append(f'<a href="{html.escape(pages[i + 1][0].name)}" rel="next">{html.escape(pages[i + 1][1])} &rarr;</a>')
    return ('<nav class="course-nav" style="margin: 0.5em 0; font-size: 14px;">'
            + " &nbsp;|&nbsp; ".join(links) + "</nav>")


def add_navigation(pages: list[tuple[Path, str]]) -> None:
    """Write the links of :func:`nav_html` at the top and the bottom of each page of PAGES (in place).

    Raises ValueError for a page without a ``<body>`` or ``</body>`` tag.
    """
    for i, (page, _) in enumerate(pages):
        text = page.read_text(encoding="utf-8")
        opening = _BODY_OPEN.search(text)
        if opening is None or "</body>" not in text:
            raise ValueError(f"{page.name} has no <body> ... </body> to put the page links in")
        nav = nav_html(pages, i)
        end = text.rindex("</body>")
        text = text[:opening.end()] + "\n" + nav + text[opening.end():end] + nav + "\n" + text[end:]
        page.write_text(text, encoding="utf-8")


def build(out_dir: Path = DEFAULT_OUT, notebooks=None, log=print, executed=None) -> dict:
    """Build every notebook (or the given paths) into OUT_DIR.

    ``executed``: {notebook file name: that notebook already run top to bottom} for those that
    need not run again (see :func:`build_page`); the others are executed here.
    Returns {notebook path: (html path, executed notebook, seconds)}; raises
    CellExecutionError on the first failing notebook.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [Path(p) for p in notebooks] if notebooks else sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    if not paths:
        raise FileNotFoundError(f"no notebooks found under {NOTEBOOKS}")
    built = {}
    for path in paths:
        page, nb, seconds = build_page(path, out_dir, executed=(executed or {}).get(path.name))
        built[path] = (page, nb, seconds)
        log(f"{path.name}: {seconds:.1f} s -> {os.path.relpath(page)}")
    pages = [(page, notebook_title(nb, p.stem)) for p, (page, nb, _) in built.items()]
    add_navigation(pages)
    write_index(pages, out_dir)
    return built


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: _build/html)")
    parser.add_argument("notebooks", nargs="*", type=Path, help="notebooks to build (default: all)")
    parser.add_argument("--answers", default="grading/stubs",
                        help="folder of exercise answers the notebooks' check() cells grade (default: the "
                             "untouched stubs, as a new learner sees them; 'exercises' for yours)")
    args = parser.parse_args(argv)
    if not (ROOT / args.answers).is_dir():
        parser.error(f"argument --answers: no folder {args.answers!r} in the repository")
    os.environ["LESSONS_ANSWERS"] = args.answers      # the notebooks' kernels inherit it
    try:
        build(args.out, args.notebooks)
    except CellExecutionError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"open {args.out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
