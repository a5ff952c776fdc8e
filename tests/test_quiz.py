"""The self-test quizzes: well-formed data, and a widget that reveals the explanation after an answer."""
import json
from pathlib import Path

import pytest

from lessons.course.quiz import QUIZZES, Question, check_answer, quiz_widget

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ["01_online_softmax", "02_flash_attention_tile_by_tile", "03_query_blocks_and_causal",
             "04_backward_pass", "05_io_awareness", "06_kernel_ladder", "07_paged_attention", "08_flash_decoding_and_ring", "09_paged_gqa_decode",
             "10_decode_kernel_ladder", "11_hopper_kernels"]
ALL = [(key, i, q) for key in QUIZZES for i, q in enumerate(QUIZZES[key])]
IDS = [f"{key[:2]}-{i}" for key, i, _ in ALL]


def test_one_quiz_per_notebook():
    assert list(QUIZZES) == NOTEBOOKS
    assert all(len(QUIZZES[k]) >= 3 for k in NOTEBOOKS)


@pytest.mark.parametrize("key, i, q", ALL, ids=IDS)
def test_question_is_well_formed(key, i, q):
    assert isinstance(q, Question)
    assert len(q.choices) >= 2 and len(set(q.choices)) == len(q.choices)
    assert isinstance(q.answer, int) and 0 <= q.answer < len(q.choices)
    assert "reread" in q.explanation.lower(), f"{key} #{i}: the explanation says what to reread"


@pytest.mark.parametrize("key, i, q", ALL, ids=IDS)
def test_exactly_one_choice_is_right(key, i, q):
    verdicts = [check_answer(q, j)[0] for j in range(len(q.choices))]
    assert verdicts.count(True) == 1 and verdicts.index(True) == q.answer


def test_the_seed_question_is_asked():
    q = next(q for q in QUIZZES["02_flash_attention_tile_by_tile"]
             if q.question == "What does FlashAttention actually reduce?")
    right = q.choices[q.answer].lower()
    assert "hbm" in right and "o(n^2)" in right and "not the flops" in right
    assert any("flops" in c.lower() for j, c in enumerate(q.choices) if j != q.answer), "FLOPs is a wrong choice"


def test_right_answers_are_not_all_in_one_place():
    positions = {q.answer for _, _, q in ALL}
    assert len(positions) >= 3
    # nor within one self-test: no position holds more than half of a notebook's right answers (a learner who
    # noticed "always the second" would pass without reading)
    for key in QUIZZES:
        answers = [q.answer for q in QUIZZES[key]]
        most = max(answers.count(a) for a in set(answers))
        assert most <= len(answers) / 2, f"{key}: right answers at {answers}"


def test_sections_named_in_explanations_exist():
    """Every 'section N, <title>' an explanation cites is a heading of its notebook."""
    import re
    for key, i, q in ALL:
        nb = ROOT / "notebooks" / f"{key}.ipynb"
        if not nb.is_file():
            pytest.skip(f"{nb.name} not present")
        headings = " ".join(
            line for cell in json.loads(nb.read_text())["cells"] if cell["cell_type"] == "markdown"
            for line in "".join(cell["source"]).splitlines() if line.startswith("#"))
        for number, title in re.findall(r"section (\d), '([^']+)'", q.explanation):
            assert f"## {number}. {title}" in headings, f"{key} #{i} cites section {number}, {title!r}"


@pytest.mark.parametrize("bad, match", [
    (dict(choices=("only one",)), "at least 2"),
    (dict(choices=("a", "a")), "distinct"),
    (dict(answer=2), "index"),
    (dict(answer=True), "index"),
    (dict(explanation=" "), "explanation"),
])
def test_question_rejects_bad_data(bad, match):
    args = dict(question="q?", choices=("a", "b"), answer=0, explanation="why; reread section 1")
    with pytest.raises(ValueError, match=match):
        Question(**(args | bad))


def test_widget_reveals_the_explanation_after_an_answer():
    key = "03_query_blocks_and_causal"
    box = quiz_widget(key)
    views = box.questions
    assert len(views) == len(QUIZZES[key])
    for view, q in zip(views, QUIZZES[key]):
        assert view["feedback"].value == ""                       # nothing revealed before answering
        assert [label for label, _ in view["radio"].options] == list(q.choices)
        view["button"].click()                                    # no answer picked yet
        assert "Pick an answer" in view["feedback"].value and "Reread" not in view["feedback"].value
        wrong = (q.answer + 1) % len(q.choices)
        view["radio"].value = wrong
        view["button"].click()
        assert view["feedback"].value.startswith("<b>Not quite.</b>")
        assert "Reread section" in view["feedback"].value
        view["radio"].value = q.answer
        view["button"].click()
        assert view["feedback"].value.startswith("<b>Right.</b>")


def test_widget_escapes_text_and_names_unknown_keys():
    box = quiz_widget("03_query_blocks_and_causal")
    view = box.questions[0]                                  # its explanation contains "j <= i + 3"
    view["radio"].value = 0
    view["button"].click()
    text = view["feedback"].value
    assert "&lt;=" in text
    assert "<=" not in text.replace("<br>", "").replace("<b>", "").replace("</b>", "")
    with pytest.raises(ValueError, match="01_online_softmax"):
        quiz_widget("no_such_notebook")


def test_no_choice_carries_its_own_justification():
    """A choice is an answer, not an argument: no worked formula in brackets (the explanation has it)."""
    import re

    from lessons.course.quiz import QUIZZES

    worked = re.compile(r"\([^)]*(=|//|%)[^)]*\)")
    bad = [(key, c) for key, qs in QUIZZES.items() for q in qs for c in q.choices if worked.search(c)]
    assert not bad, bad


def test_static_quiz_has_question_choices_and_answer_behind_details():
    import html as html_lib
    import re

    from lessons.course.quiz import QUIZZES, static_quiz_html

    for key, qs in QUIZZES.items():
        page = static_quiz_html(key)
        assert page.count("<details>") == len(qs) and page.count("<summary>Show the answer</summary>") == len(qs)
        for q, block in zip(qs, re.findall(r"<li><p><b>.*?</details></li>", page)):
            assert html_lib.escape(q.question) in block
            shown = re.findall(r"<li>(.*?)</li>", re.split(r"<ol type='a'[^>]*>", block.split("<details>")[0])[1])
            assert shown == [html_lib.escape(c) for c in q.choices]
            hidden = block.split("<details>")[1]
            letter = "abcdefgh"[q.answer]
            assert f"({letter}) {html_lib.escape(q.choices[q.answer])}" in hidden
            assert html_lib.escape(q.explanation) in hidden
            assert html_lib.escape(q.explanation) not in block.split("<details>")[0]
    with pytest.raises(ValueError, match="quizzes"):
        static_quiz_html("99_nope")


def test_html_build_adds_the_static_quiz_to_the_quiz_cell():
    import importlib.util
    from pathlib import Path

    import nbformat

    from lessons.course.quiz import static_quiz_html

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("build_html_for_quiz", root / "scripts" / "build_html.py")
    build_html = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_html)
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("x = 1"),
        nbformat.v4.new_code_cell('from lessons.course.quiz import quiz_widget\n\nquiz_widget("05_io_awareness")')])
    assert build_html.add_static_quizzes(nb) == 1
    assert nb.cells[0].get("outputs", []) == []
    (out,) = nb.cells[1].outputs
    assert out["output_type"] == "display_data" and out["data"]["text/html"] == static_quiz_html("05_io_awareness")
    # every notebook's self-test cell is found by the build
    for path in sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        assert build_html.add_static_quizzes(nb) == 1, path.name
