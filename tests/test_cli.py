"""`python -m lessons trace`: the printed table must be the real running state.

The expected numbers are computed here another way: from the full score row of the
query, by taking the max / sum / softmax over the keys seen up to each tile (prefix
by prefix), not from the trace the command prints.
"""
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lessons import attention
from lessons.course.cli import main
from lessons.course.data import load_sample, make_case

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _plain_wide_terminal(monkeypatch):
    """No colour codes, and wide enough that rich never wraps a table row."""
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "160")


def run_trace(capsys, *argv):
    assert main(["trace", *argv]) == 0
    return capsys.readouterr().out


def parse_table(text):
    """The body rows of the rich table as lists of cell strings."""
    rows = []
    for line in text.splitlines():
        if line.startswith("│"):
            rows.append([c.strip() for c in line.strip("│").split("│")])
    return rows


def num(cell):
    return float(cell.rstrip("*"))


def prefix_states(q, k, v, row, tile, causal=False, block_q=64):
    """Expected (key_start, key_stop, m, alpha, l, error) per absorbed tile, from prefix softmaxes."""
    nq, nk = q.shape[0], k.shape[0]
    s = (q[row] @ k.T) / math.sqrt(q.shape[1])
    if causal:
        s = np.where(np.arange(nk) <= row + nk - nq, s, -np.inf)
    exact = attention(q, k, v, causal=causal)[row]
    block_end = (row // block_q + 1) * block_q - 1        # last query row of this row's block
    out, m_prev = [], -np.inf
    for start in range(0, nk, tile):
        if causal and start > min(block_end, nq - 1) + nk - nq:
            break
        stop = min(start + tile, nk)
        seen = s[:stop]
        m = seen.max()
        p = np.exp(seen - m)
        o_over_l = (p @ v[:stop]) / p.sum()
        out.append((start, stop, m, math.exp(m_prev - m), p.sum(), np.abs(o_over_l - exact).max()))
        m_prev = m
    return out


def check_table(rows, expected, *, err_rtol=0.02, err_atol=1e-15, causal=False):
    assert len(rows) == len(expected)
    for i, (cells, (start, stop, m, alpha, l, err)) in enumerate(zip(rows, expected)):
        if causal:
            del cells[2]                                    # the 'visible' column
        tile, keys, m_c, alpha_c, l_c, err_c = cells
        assert int(tile) == i + 1                           # counted from 1, as the stepper does
        assert keys == f"[{start}, {stop})"
        assert num(m_c) == pytest.approx(m, rel=1e-5)
        assert num(alpha_c) == pytest.approx(alpha, rel=1e-5, abs=1e-12)
        assert num(l_c) == pytest.approx(l, rel=1e-5)
        assert num(err_c) == pytest.approx(err, rel=err_rtol, abs=err_atol)


def test_no_command_prints_help(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "usage: python -m lessons" in out and "trace" in out


def test_trace_help_has_an_example(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["trace", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "python -m lessons trace --row" in out and "--tile" in out


def test_real_row_matches_prefix_softmax(capsys):
    out = run_trace(capsys, "--row", "5", "--tile", "16", "--layer", "2", "--head", "3")
    q, k, v = make_case("real", layer=2, head=3)
    check_table(parse_table(out), prefix_states(q, k, v, 5, 16))


def test_header_names_model_and_token(capsys):
    sample = load_sample()
    out = run_trace(capsys, "--row", "7")
    assert sample.model.split("/")[-1] in out
    assert f"query row 7: token {sample.tokens[7]!r}" in out


def test_last_error_is_rounding_level(capsys):
    for dtype, bound in (("float64", 1e-14), ("float32", 1e-6)):
        rows = parse_table(run_trace(capsys, "--row", "3", "--tile", "32", "--dtype", dtype))
        assert len(rows) == 4
        assert num(rows[-1][-1]) < bound
        assert num(rows[0][-1]) > 1e-3                      # after one tile it was far off


def test_the_closing_line_counts_tiles_in_words(capsys):
    assert "after 4 tiles: max |o/l - exact|" in run_trace(capsys, "--row", "3", "--tile", "32")
    one = run_trace(capsys, "--row", "0", "--tile", "32", "--causal", "--block-q", "1")   # row 0 sees one tile
    assert len(parse_table(one)) == 1 and "after 1 tile: max |o/l - exact|" in one


def test_late_max_shows_the_rescale(capsys):
    # Built so row 0's max is 1.0 until the last tile, where it jumps to 4.0:
    # alpha = exp(1 - 4), by hand.
    rows = parse_table(run_trace(capsys, "--data", "late-max", "--tile", "16"))
    q, k, v = make_case("late-max", tile=16)
    check_table(rows, prefix_states(q, k, v, 0, 16))
    assert [r[3].endswith("*") for r in rows] == [False, False, False, True]
    assert num(rows[-1][3]) == pytest.approx(math.exp(-3.0), rel=1e-5)
    assert num(rows[-1][2]) == 4.0


@pytest.mark.parametrize("tile", [64, 70])
def test_late_max_works_at_a_large_tile(capsys, tile):
    # make_case builds max(64, 2 * tile) keys: two tiles, the max jumps in the second.
    out = run_trace(capsys, "--data", "late-max", "--tile", str(tile))
    q, k, v = make_case("late-max", tile=tile)
    assert q.shape == (2 * tile, 8) and f"N = {2 * tile} keys" in out
    rows = parse_table(out)
    check_table(rows, prefix_states(q, k, v, 0, tile))
    assert [r[0] for r in rows] == ["1", "2"]
    assert num(rows[-1][3]) == pytest.approx(math.exp(-3.0), rel=1e-5) and rows[-1][3].endswith("*")


def test_causal_row_skips_future_tiles(capsys):
    out = run_trace(capsys, "--data", "random", "--causal", "--row", "20", "--tile", "8", "--block-q", "1")
    q, k, v = make_case("random")
    rows = parse_table(out)
    assert [r[2] for r in rows] == ["8", "8", "5"]          # keys 0..20 visible: 8 + 8 + 5
    check_table(rows, prefix_states(q, k, v, 20, 8, causal=True, block_q=1), causal=True)
    assert "visible 0" not in " ".join(out.split())       # no tile the row cannot see: no note about them


def test_causal_block_absorbs_tiles_the_row_cannot_see(capsys):
    out = run_trace(capsys, "--data", "random", "--causal", "--row", "20", "--tile", "8")
    q, k, v = make_case("random")
    rows = parse_table(out)
    assert len(rows) == 8                                   # block rows 0..63 reach keys 0..63
    assert "visible 0: the tile was absorbed" in " ".join(out.split())
    check_table(rows, prefix_states(q, k, v, 20, 8, causal=True), causal=True)


def test_default_row_with_causal_is_the_last(capsys):
    out = run_trace(capsys, "--data", "random", "--causal")
    assert "query row 127" in out
    assert len(parse_table(out)) == 128 // 16


@pytest.mark.parametrize("argv, option", [
    (["--row", "128"], "--row"),
    (["--row", "-1"], "--row"),
    (["--layer", "6"], "--layer"),
    (["--head", "12"], "--head"),
    (["--head", "-1"], "--head"),
    (["--tile", "0"], "--tile"),
    (["--tile", "two"], "--tile"),
    (["--data", "late-max", "--tile", "100000"], "--tile"),     # N = 200000: S would need 320 GB
    (["--data", "random", "--layer", "1"], "--layer"),
])
def test_bad_option_exits_2_naming_it(capsys, argv, option):
    with pytest.raises(SystemExit) as exc:
        main(["trace", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"python -m lessons trace: error: argument {option}:")
    assert "Traceback" not in err


def test_module_entry_point_subprocess():
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "160", "PYTHONPATH": str(ROOT)}
    env.pop("FORCE_COLOR", None)
    ok = subprocess.run([sys.executable, "-m", "lessons", "trace", "--data", "late-max"],
                        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert ok.returncode == 0, ok.stderr
    rows = parse_table(ok.stdout)
    assert len(rows) == 4 and rows[-1][3] == "0.0497871*"
    bad = subprocess.run([sys.executable, "-m", "lessons", "trace", "--row", "999"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert bad.returncode == 2
    assert "argument --row" in bad.stderr and "Traceback" not in bad.stderr
