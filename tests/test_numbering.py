"""One numbering: tiles, steps and visits are counted from 1 wherever a learner reads them.

Array indices (rows, key positions, pages, logical blocks) stay 0-based. Each test
runs a learner-facing printer, table, message or figure axis on a case whose first
tile is known and checks that it reads 1 (and the last reads the number of tiles).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from lessons.course.claims import claim
from lessons import flash_attention
from lessons.schedules.softmax import online_softmax
from lessons.schedules.variants import example_case, run_variants

ROOT = Path(__file__).resolve().parents[1]
X = np.array([0.3, 1.2, -0.5, 2.0, 0.1, 1.9, 3.1, 0.4, 2.2, -1.0, 0.7])      # notebook 01: 4 tiles of 3


def _notebook_cell(name: str, needle: str) -> str:
    nb = json.loads((ROOT / "notebooks" / name).read_text())
    hits = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code" and needle in "".join(c["source"])]
    assert len(hits) == 1, f"{name}: {len(hits)} code cells hold {needle!r}"
    return hits[0]


def test_online_softmax_figure_labels_tiles_from_1():
    from lessons.views.softmax import online_softmax_figure

    _, trace = online_softmax(X, tile=3, return_trace=True)
    texts = [t.get_text() for t in online_softmax_figure(X, trace).axes[0].texts if t.get_text().startswith("tile")]
    assert texts == ["tile 1", "tile 2", "tile 3", "tile 4"]


def test_variant_figures_tables_and_verdicts_count_tiles_from_1():
    from lessons.views.softmax import VariantExplorer, variant_errors_figure

    traces = {"ordinary": run_variants(example_case("ordinary"))}
    t = traces["ordinary"]["no_alpha_on_l"]
    ticks = [x.get_text() for x in variant_errors_figure(traces["ordinary"]).axes[0].get_xticklabels()]
    assert ticks[0] == "1" and ticks[-1] == str(len(t))
    # the verdict names the first wrong tile counted from 1; first_divergence is the 0-based index
    first = t.first_divergence
    assert f"leaves the exact result at tile {first + 1} " in t.verdict
    c0, c1 = int(t.key_start[first]), int(t.key_stop[first])
    assert f"(keys {c0}..{c1 - 1})" in t.verdict                     # key positions stay 0-based
    ex = VariantExplorer(traces, case="ordinary", variant="no_alpha_on_l")
    ex.slider.value = 1
    first_cell = re.search(r"<tbody><tr[^>]*><td[^>]*>([^<]*)</td>", ex.table.value).group(1)
    assert first_cell == "1"
    fig = VariantExplorer._figure(t, 0, 2)
    assert [x.get_text() for x in fig.axes[0].get_xticklabels()][0] == "1"


def test_recovering_variant_names_its_tile_from_1():
    case = example_case("padded")
    finite = run_variants(case)["finite_init"]
    if finite.recovers_at is not None:
        assert f"exact again from tile {finite.recovers_at + 1} on" in finite.verdict


def test_tile_stepper_readout_table_and_axis_count_from_1():
    from lessons.views.stepper import TileStepper

    s = TileStepper(kind="random", row=0, tile=32)
    s.slider.value = 1
    assert re.sub(r"<[^>]+>", "", s.readouts["tile"].value).startswith("tile 1 of")
    first_cell = re.search(r"<tbody><tr[^>]*><td[^>]*>([^<]*)</td>", s.table.value).group(1)
    assert first_cell == "1"
    labels = [x.get_text() for x in s._figure.ax_keys.get_xticklabels()]
    assert labels[0] == "1" and labels[-1] == str(len(s.row_trace))
    assert "Query row 0" in s.caption.value and "tile 1 of" in s.caption.value


def test_cli_trace_rows_count_tiles_from_1():
    from lessons.course.cli import trace_rows

    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((4, 8)), rng.standard_normal((20, 8)), rng.standard_normal((20, 3))
    rows = trace_rows(q, k, v, 0, tile=8)
    assert [r["tile"] for r in rows] == [1, 2, 3]
    assert [(r["key_start"], r["key_stop"]) for r in rows] == [(0, 8), (8, 16), (16, 20)]


def test_notebook_01_first_wrong_tile_table_counts_from_1():
    from lessons.schedules.variants import EXAMPLE_CASES, VARIANTS

    cases = {name: example_case(name) for name in EXAMPLE_CASES}
    traces = {name: run_variants(case) for name, case in cases.items()}
    src = _notebook_cell("01_online_softmax.ipynb", "first tile (counted from 1)")
    lines = []
    exec(src, {"print": lambda *a, **k: lines.append(" ".join(map(str, a))), "traces": traces, "cases": cases,
               "VARIANTS": VARIANTS, "np": np, "claim": claim})
    row = next(line for line in lines if line.startswith("no_guard"))
    padded = list(cases).index("padded")
    assert row.split()[1 + padded] == str(traces["padded"]["no_guard"].first_divergence + 1) == "1"


def test_notebook_03_visits_and_steps_count_from_1():
    from lessons.schedules.causal import tile_schedule

    src = _notebook_cell("03_query_blocks_and_causal.ipynb", "visit {")
    lines = []
    exec(src, {"print": lambda *a, **k: lines.append(" ".join(map(str, a))), "tile_schedule": tile_schedule})
    assert re.match(r"visit\s+1 \(step\s+1\)", lines[0]), lines[0]
    assert re.match(rf"visit\s+{len(lines)} ", lines[-1]), lines[-1]
    assert "query rows  0-7" in lines[0]                            # row indices stay 0-based


def test_causal_schedule_figure_and_state_text_count_from_1():
    from lessons.schedules.causal import tile_schedule
    from lessons.views.causal import block_state_text, schedule_figure

    visits = tile_schedule(16, 16, 8, 8)
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((16, 4)) for _ in range(3))
    _, trace = flash_attention(q, k, v, 8, block_q=8, causal=True, return_trace=True)
    assert "after key tile 1 " in block_state_text(trace, 1)
    texts = [t.get_text() for t in schedule_figure(visits, 1).axes[0].texts]
    assert "1" in texts and "0" not in texts                          # step numbers drawn in the tiles


def test_no_learner_string_counts_tiles_from_0():
    """No notebook prints or says 'tile 0', 'visit 0' or 'step 0' (tiles, visits and steps count from 1)."""
    bad = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            text = "".join(cell["source"])
            for m in re.finditer(r"\b(tile|visit|step|Tile|Visit|Step) 0\b", text):
                bad.append(f"{path.name}: ...{text[max(0, m.start() - 40):m.end() + 20]}...")
    assert not bad, "\n".join(bad)


def test_pipeline_and_prefetch_figures_label_tiles_and_steps_from_1():
    from lessons.gpu.hopper import pipeline_schedule
    from lessons.views.pipeline import pipeline_figure, prefetch_figure

    fig = pipeline_figure({"two stages": pipeline_schedule(5, 2)})
    labels = {t.get_text() for t in fig.axes[0].texts}
    assert labels == {f"tile {j}" for j in range(1, 6)}, labels            # each tile's copy and its products
    fig = prefetch_figure(4, latency=3.0, compute=1.5)
    for ax in fig.axes:
        steps = {t.get_text() for t in ax.texts if t.get_text().startswith("step")}
        assert steps == {"step 1", "step 2", "step 3", "step 4"}, steps
