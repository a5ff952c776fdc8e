"""The self-test quizzes: well-formed data, and a widget that reveals the explanation after an answer."""
import json
from pathlib import Path

import pytest

from lessons.course.quiz import QUIZZES, Question, check_answer, quiz_widget

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ["01_online_softmax", "02_flash_attention_tile_by_tile", "03_query_blocks_and_causal",
             "04_backward_pass", "04_io_awareness", "05_paged_attention", "06_flash_decoding_and_ring", "07_paged_gqa_decode"]
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
