"""A section named in one notebook's prose is found where the prose says it is.

The notebooks cite sections by their heading in italics (*Bytes in flight: Little's law*). When a
section moves to another notebook, a citation that does not name that notebook sends a learner
looking for a heading that is not there. These tests read every markdown cell of ``notebooks/``:
a citation of a section heading (level 2 and below) that only another notebook holds must name
that notebook in the same paragraph, by its file name (``10_decode_kernel_ladder``) or its number
(``notebook 10``).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
#: *Title* in italics: one asterisk on each side, not part of **bold**
CITATION = re.compile(r"(?<![*\w])\*([A-Z][^*\n]{7,}?)\*(?![*\w])")
HEADING = re.compile(r"^(#{2,6})\s+(?:\d+\.\s+)?(.+?)\s*$")


def _markdown(path: Path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown"]


def _section_headings(path: Path) -> list[str]:
    """Headings of level 2 and below of one notebook, without their section numbers."""
    return [m.group(2) for text in _markdown(path) for line in text.splitlines() if (m := HEADING.match(line))]


def _holds(headings: list[str], title: str) -> bool:
    """Whether a citation names one of these headings: in full, or the part before its colon."""
    return any(h == title or h.startswith(title + ":") for h in headings)


def _names(paragraph: str, stem: str) -> bool:
    return stem in paragraph or re.search(rf"\bnotebooks? {stem[:2]}\b", paragraph, re.IGNORECASE) is not None


def misplaced_citations(paths=NOTEBOOKS) -> list[str]:
    """Citations of another notebook's section that do not name that notebook in their paragraph."""
    headings = {p.stem: _section_headings(p) for p in paths}
    bad = []
    for path in paths:
        for text in _markdown(path):
            for paragraph in re.split(r"\n\s*\n", text):
                for m in CITATION.finditer(paragraph):
                    title = m.group(1).strip()
                    if _holds(headings[path.stem], title):
                        continue
                    for other, heads in headings.items():
                        if other != path.stem and _holds(heads, title) and not _names(paragraph, other):
                            bad.append(f"{path.name}: *{title}* is a section of {other}, which the paragraph does not "
                                       f"name: ...{paragraph[max(0, m.start() - 80):m.end() + 40]}...")
    return bad


def test_there_are_notebooks_with_sections():
    assert len(NOTEBOOKS) >= 11 and all(_section_headings(p) for p in NOTEBOOKS)


def test_a_section_of_another_notebook_is_cited_with_that_notebook():
    bad = misplaced_citations()
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("prose, ok", [
    ("the kernel-ladder notebook's *Bytes in flight: Little's law* shows it", False),
    ("*10_decode_kernel_ladder*, *Bytes in flight: Little's law*, shows it", True),
    ("notebook 10's *Bytes in flight: Little's law* shows it", True),
    ("(*Bytes in flight* in notebook 10)", True),
    ("(notebook 06, *Bytes in flight: Little's law*)", False),
    ("**Bytes in flight: Little's law** in bold is not a citation", True),
])
def test_the_check_catches_a_citation_without_its_notebook(tmp_path, prose, ok):
    """Two made-up notebooks: 10 holds the section, 09 cites it."""
    def write(name, *cells):
        nb = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": c} for c in cells],
              "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
        (tmp_path / name).write_text(json.dumps(nb))
        return tmp_path / name

    cited = write("10_decode_kernel_ladder.ipynb", "# The decode ladder", "### Bytes in flight: Little's law\n\ntext")
    citing = write("09_paged_gqa_decode.ipynb", "# Decode", "## 1. Sizes\n\n" + prose)
    bad = misplaced_citations([citing, cited])
    assert (bad == []) == ok, bad
