"""claim(): prints a tick for a claim that holds, fails loudly for one that does not."""
import numpy as np
import pytest

from lessons.course.claims import claim


def test_a_true_claim_prints_a_tick(capsys):
    assert claim(True, "one is one") is None
    claim(np.isclose(1.0, 1.0), "a NumPy bool works too")
    assert capsys.readouterr().out == "✓ one is one\n✓ a NumPy bool works too\n"


def test_a_false_claim_raises_and_prints_nothing(capsys):
    with pytest.raises(AssertionError, match=r"^claim failed: two is one$"):
        claim(False, "two is one")
    with pytest.raises(AssertionError, match="claim failed: all NaN"):
        claim(np.isnan(np.array([1.0])).all(), "all NaN")
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("holds", [1, 0, None, "yes", np.array([True, True]), np.float64(1.0)],
                         ids=["int1", "int0", "None", "str", "array", "float64"])
def test_holds_must_be_a_bool(holds):
    with pytest.raises(TypeError, match="holds must be a bool or a NumPy bool"):
        claim(holds, "typed")
