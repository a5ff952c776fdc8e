"""The fast decode rungs (paged_decode_split_gpu, and its prefetch build) against NumPy (emulator, and the GPU where one is
present), its split count picked from the shape, its compiled code (16-byte loads, no spills),
its place in the ladder, and the decode benchmark's arithmetic and no-device run."""
import csv
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lessons
import lessons.gpu as gpu
from lessons.gpu import ladder
from lessons.gpu.source import decode_split_cost, decode_split_terms, decode_splits, paged_decode_split_layout, paged_decode_split_smem_bytes
from test_gpu_kernels import (SEQ_LENS, assert_decode_close, decode_args, decode_reference, paged_case,
                              sequence_kv, skip_left_out, split_state_float32, values)
from kernel_tolerance import assert_within_baseline

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = [
    pytest.param("emulator", marks=pytest.mark.skipif(not gpu.emulator_available(), reason="no C++ compiler")),
    pytest.param("cupy", marks=pytest.mark.skipif(not gpu.device_available(), reason="no CUDA device")),
]
needs_nvrtc = pytest.mark.skipif(not gpu.nvrtc_available(), reason="CuPy/NVRTC not installed")


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


# ---------------------------------------------------------------------------
# the split count, by hand
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("num_seqs, seq_len, want", [
    (64, 4096, 1),        # 64 x 8 = 512 blocks: 528 // 512 = 1, a second split would not fit the wave
    (8, 32768, 8),        # 64 blocks per split: 8 -> 512 blocks, one wave; 9 -> 576, a second wave of 48
    (1, 131072, 66),      # 8 blocks per split: 528 / 8 = 66
    (2, 4096, 33),        # 16 blocks per split: 528 / 16 = 33 (256 pages allow it)
    (1, 100, 7),          # ceil(100 / 16) = 7 pages: never more splits than pages
    (1, 16, 1),           # one page
    (1, 0, 1),            # nothing to split
    (53, 4096, 1),        # 424 blocks: 528 // 424 = 1
    (52, 4096, 1),        # 416 blocks: 2 splits are 832 blocks, 2 waves of half the pages: a tie, the fewer kept
    (3, 50000, 22),       # 24 blocks per split: 22 x 24 = 528, exactly one wave
    (4, 32768, 16),       # 32 blocks per split: 16 -> 512 (cost 1 x 128); 17 -> 544 (2 x 121)
])
def test_decode_splits_fill_an_h200(num_seqs, seq_len, want):
    assert decode_splits(num_seqs, 8, seq_len) == want


@pytest.mark.parametrize("num_splits, per_split, pages, wave, waves, pages_per_block", [
    (8, 64, 2048, 528, 1, 256),      # 512 blocks: one wave; 2048 / 8 pages per block
    (9, 64, 2048, 528, 2, 228),      # 576 blocks: two waves; ceil(2048 / 9) = 228
    (66, 8, 8192, 528, 1, 125),      # 528 blocks; ceil(8192 / 66) = 125
    (1, 416, 256, 528, 1, 256),
    (2, 416, 256, 528, 2, 128),
    (3, 1, 7, 1, 3, 3),              # a wave of one block: every block is a wave
])
def test_decode_split_cost_by_hand(num_splits, per_split, pages, wave, waves, pages_per_block):
    assert decode_split_terms(num_splits, per_split, pages, wave) == (waves, pages_per_block)
    assert decode_split_cost(num_splits, per_split, pages, wave) == waves * pages_per_block


def _model_time(splits, per_split, pages, wave):
    """waves x pages per block, counted with loops: blocks dealt to waves of ``wave``, pages dealt to splits."""
    waves = 0
    while waves * wave < splits * per_split:
        waves += 1
    most = 0
    for first in range(splits):
        most = max(most, len(range(first, pages, splits)))
    return waves * max(most, 1)


@settings(max_examples=300, deadline=None)
@given(per_split=st.integers(1, 700), pages=st.integers(1, 3000), sms=st.integers(1, 140),
       per_sm=st.integers(1, 4))
def test_decode_splits_is_the_cheapest_count_needing_at_most_one_partial_wave_more(per_split, pages, sms, per_sm):
    # one sequence of `pages` pages of one token, one KV head with `per_split` blocks: the library's own units
    wave = sms * per_sm
    got = decode_splits(1, 1, pages, block_size=1, heads_per_kv_head=per_split, num_sms=sms, blocks_per_sm=per_sm)
    assert 1 <= got <= pages
    mine = _model_time(got, per_split, pages, wave)
    assert mine == decode_split_cost(got, per_split, pages, wave)
    for s in range(1, -(-wave // per_split) + 1):          # every count up to the fewest that fill the wave
        assert mine <= _model_time(s, per_split, pages, wave), (got, s)
    # it never spills past one wave unless one split already does
    assert got * per_split <= wave or got == 1, (got, per_split, wave)
    # and it is the most that fit: one more is past the pages or past the wave
    assert got == pages or (got + 1) * per_split > wave


def test_decode_split_cost_refuses_bad_arguments():
    with pytest.raises(ValueError, match="num_splits"):
        decode_split_cost(0, 1, 1, 1)
    with pytest.raises(ValueError, match="wave"):
        decode_split_cost(1, 1, 1, 0)
    with pytest.raises(TypeError, match="pages"):
        decode_split_cost(1, 1, 2.0, 1)


def test_decode_splits_follow_the_gpu_and_the_grid():
    assert decode_splits(1, 8, 131072, num_sms=108) == 54                 # an A100: 108 x 4 / 8
    assert decode_splits(1, 8, 131072, blocks_per_sm=2) == 33
    assert decode_splits(1, 8, 131072, heads_per_kv_head=2) == 33         # two blocks per group
    assert decode_splits(1, 1, 1 << 30, max_splits=100) == 100
    assert decode_splits(0, 8, 4096) == 1


def test_the_exercise_spells_out_how_to_call_the_library_decode_splits():
    """The exercise's decode_splits takes (blocks_per_split, pages, wave), the library's the shape; the stub's
    docstring and notebook 10's "Your turn" give one call of each, and the two must pick the same count."""
    import ast
    import importlib.util
    import json
    import re

    spec = importlib.util.spec_from_file_location("solution_decode_splits", ROOT / "solutions" / "decode_splits.py")
    solution = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(solution)
    stub = ast.parse((ROOT / "grading" / "stubs" / "decode_splits.py").read_text())
    doc = next(ast.get_docstring(f) for f in stub.body if isinstance(f, ast.FunctionDef) and f.name == "decode_splits")
    nb = json.loads((ROOT / "notebooks" / "10_decode_kernel_ladder.ipynb").read_text())
    turn = next("".join(c["source"]) for c in nb["cells"] if c.get("id") == "decode-your-turn")
    call = r"decode_splits\((\d+), (\d+), (\d+)\)"
    for where, text in (("the stub's docstring", doc), ("notebook 10's Your turn", turn)):
        pair = re.search(call + r"`*\s+(?:there\s+)?is\s+(?:your\s+)?`*" + call, " ".join(text.split()))
        assert pair, f"{where} does not spell out a library call and the exercise call it equals"
        num_seqs, kv_heads, seq_len, per_split, pages, wave = map(int, pair.groups())
        assert (per_split, pages, wave) == (num_seqs * kv_heads, -(-seq_len // 16), 132 * 4), where
        assert decode_splits(num_seqs, kv_heads, seq_len) == solution.decode_splits(per_split, pages, wave), where


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_seqs=-1, num_kv_heads=8, seq_len=10), "num_seqs"),
    (dict(num_seqs=1, num_kv_heads=0, seq_len=10), "num_kv_heads"),
    (dict(num_seqs=1, num_kv_heads=8, seq_len=-5), "seq_len"),
    (dict(num_seqs=1, num_kv_heads=8, seq_len=10, num_sms=0), "num_sms"),
])
def test_decode_splits_refuse_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        decode_splits(**kwargs)
    with pytest.raises(TypeError, match="num_seqs"):
        decode_splits(1.5, 8, 10)


def test_decode_split_sweep_lays_out_the_model_by_hand():
    from lessons.gpu.source import decode_split_sweep

    sw = decode_split_sweep(8, 32768)                   # 32 heads on 8 KV heads, one block per group of 4
    assert (sw["blocks_per_split"], sw["pages"], sw["wave"]) == (8 * 8, 32768 // 16, 132 * 4)
    assert (sw["fit"], sw["fill"], sw["pick"]) == (8, 9, 8)
    assert sorted(sw["costs"]) == list(range(1, 19))                  # up to twice the fewest that fill the wave
    # each count's time counted here: blocks dealt to waves of 528, pages dealt to the splits
    for s, cost in sw["costs"].items():
        waves = len(range(0, s * 64, 528))
        assert cost == waves * max(len(range(i, 2048, s)) for i in range(s)), s
    assert sw["costs"][9] == 2 * 228 and sw["costs"][8] == 256 and sw["bound"] == 64 * 2048 / 528
    assert min(sw["costs"].values()) >= sw["bound"] and sw["best"] == 8       # of 1..18, one wave is cheapest
    full = decode_split_sweep(8, 32768, max_splits=2048)                # every count: several waves can win
    cheapest = min(full["costs"].values())
    assert full["best"] == min(s for s, c in full["costs"].items() if c == cheapest)
    assert full["costs"][41] == 5 * 50 and cheapest == full["costs"][full["best"]] < 256   # 41 x 64 = 2624 blocks
    assert full["pick"] == 8 and full["costs"][8] <= full["bound"] * 1.05                 # within 5% of all busy
    # the counts cheaper than the pick, each timed here with loops: up to 64 splits, 33, 41, 49 and 57, all several waves
    from lessons.gpu.source import cheaper_than_pick
    upto64 = decode_split_sweep(8, 32768, max_splits=64)
    assert cheaper_than_pick(upto64) == [s for s in range(1, 65) if _model_time(s, 64, 2048, 528) < 256] \
        == [33, 41, 49, 57]
    short = decode_split_sweep(1, 100)                  # 7 pages: nothing past them
    assert cheaper_than_pick(sw) == [] and cheaper_than_pick(short) == []
    with pytest.raises(TypeError, match="sweep lacks costs"):
        cheaper_than_pick({k: v for k, v in short.items() if k != "costs"})
    assert (short["fit"], short["fill"], short["pick"]) == (7, 7, 7) and sorted(short["costs"]) == list(range(1, 8))
    assert decode_split_sweep(1, 131072, blocks_per_sm=3)["pick"] == 49      # the prefetch build's wave of 396
    assert decode_split_sweep(64, 4096, max_splits=3)["costs"] == {1: 256, 2: 256, 3: 3 * 86}
    with pytest.raises(ValueError, match="num_seqs"):
        decode_split_sweep(0, 4096)
    with pytest.raises(ValueError, match="num_heads must be a multiple of num_kv_heads"):
        decode_split_sweep(1, 4096, num_heads=12)
    with pytest.raises(TypeError, match="max_splits"):
        decode_split_sweep(1, 4096, max_splits=2.0)


def test_split_sweep_markdown_and_its_figure():
    from lessons.gpu.source import decode_split_sweep
    from lessons.views.decode_splits import split_cost_figure

    sweeps = {shape: decode_split_sweep(*shape) for shape in ladder.DECODE_SHAPES}
    lines = ladder.split_sweep_markdown(sweeps).splitlines()
    assert len(lines) == 2 + len(ladder.DECODE_SHAPES)
    ran = next(e for e in ladder.decode_table() if e["name"] == "paged_decode_split")["splits"]
    row = next(line for line in lines if line.startswith("| 8 x 32,768 |"))
    assert "| **8: 1 x 256 = 256** | 9: 2 x 228 = 456 | none of 1..18 |" in row and row.endswith(f"| {ran[(8, 32768)]} |")
    short = ladder.split_sweep_markdown({(1, 100): decode_split_sweep(1, 100)})
    assert "| **7: 1 x 1 = 1** | - (7 pages) | none of 1..7 |" in short        # 7 splits of one page
    # the full sweep: 33 splits are 2112 = 4 x 528 blocks, 63 pages each; 683 are 83 waves of 3 pages
    full = {shape: decode_split_sweep(*shape, max_splits=-(-shape[1] // 16)) for shape in ladder.DECODE_SHAPES}
    row = next(line for line in ladder.split_sweep_markdown(full).splitlines() if line.startswith("| 8 x 32,768 |"))
    cheaper = sum(c < 256 for c in full[(8, 32768)]["costs"].values())
    assert (f"| {cheaper} of 1..2,048; the fewest splits 33: 4 x 63 = 252; the cheapest 683: 83 x 3 = 249, "
            f"{100 * 7 / 256:.1f}% under the pick |") in row
    with pytest.raises(TypeError, match="sweeps"):
        ladder.split_sweep_markdown({"8 x 32768": sweeps[(8, 32768)]})
    fig = split_cost_figure({f"{s} x {n}": sw for (s, n), sw in sweeps.items()})
    axes = fig.get_axes()
    assert len(axes) == 3
    middle = axes[1]
    labels = [t.get_text() for t in middle.get_legend().get_texts()]
    assert labels[0].startswith("picked: 8 splits") and "one more, 9: 48 blocks in wave 2" in labels[1]
    x, y = middle.get_lines()[0].get_data()
    assert list(x) == list(range(1, 19)) and y[8] == pytest.approx(456 / sweeps[(8, 32768)]["bound"])
    wide = split_cost_figure({f"{s} x {n}": sw for (s, n), sw in full.items()}, zoom=True)
    axes = wide.get_axes()
    assert len(axes) == 6 and axes[1].get_xscale() == "log"              # a row of full sweeps, a row zoomed
    labels = [t.get_text() for t in axes[1].get_legend().get_texts()]
    assert labels[2].startswith("cheapest: 683, 83 waves x 3 = 249")
    zoomed = [t.get_text() for t in axes[4].get_legend().get_texts()]
    assert zoomed[1].startswith(f"{cheaper} counts cheaper, all of 4+ waves")
    with pytest.raises(TypeError, match="sweeps"):
        split_cost_figure({})
    with pytest.raises(TypeError, match="zoom"):
        split_cost_figure({"8 x 32768": sweeps[(8, 32768)]}, zoom=1)


def test_split_sweep_bad_input_names_the_argument():
    import numpy as np
    from lessons.gpu.source import decode_split_sweep
    from lessons.views.decode_splits import split_cost_figure

    # NumPy ints in: the same sweep as Python ints, every value a Python int (no int32 overflow on the way)
    plain = decode_split_sweep(8, 32768)
    typed = decode_split_sweep(8, 32768, num_heads=np.int32(32), num_kv_heads=np.int32(8), block_size=np.int64(16))
    assert typed == plain and all(type(typed[k]) is int for k in ("blocks_per_split", "pages", "fit", "fill"))
    # 2**20 sequences x 4096 KV heads, one block per KV head: 2**32 blocks per split, past int32 but a valid shape
    big = decode_split_sweep(1 << 20, 32768, num_heads=np.int32(4096), num_kv_heads=np.int32(4096), max_splits=2)
    assert big["blocks_per_split"] == (1 << 20) * 4096 and big["pick"] == 1
    assert big["costs"] == {1: -(-(1 << 32) // 528) * 2048, 2: -(-(1 << 33) // 528) * 1024}
    with pytest.raises(ValueError, match=r"num_seqs x num_kv_heads x blocks per group must be at most 2\*\*40"):
        decode_split_sweep(1 << 31, 32768, num_heads=1 << 14, num_kv_heads=1 << 14)
    with pytest.raises(ValueError, match="max_splits must be in 1..1048576"):   # no dict of 2**36 counts
        decode_split_sweep(8, 1 << 40, max_splits=(1 << 40) // 16)
    # a sweep whose costs stop before its pick (max_splits 4, pick 8): named, not a KeyError from inside
    short = decode_split_sweep(8, 32768, max_splits=4)
    assert short["pick"] == 8 and sorted(short["costs"]) == [1, 2, 3, 4]
    for draw in (lambda sw: ladder.split_sweep_markdown({(8, 32768): sw}),
                 lambda sw: split_cost_figure({"8 x 32768": sw}),
                 lambda sw: split_cost_figure({"8 x 32768": sw}, zoom=True)):
        with pytest.raises(ValueError, match=r"\['costs'\] holds 1..4 splits, not the pick \(8\).*>= 8"):
            draw(short)
        with pytest.raises(ValueError, match=r"\['costs'\] must be a non-empty dict"):
            draw({**plain, "costs": {}})
        with pytest.raises(TypeError, match=r"lacks best, bound: expected the dict decode_split_sweep"):
            draw({k: v for k, v in plain.items() if k not in ("bound", "best")})
    with pytest.raises(TypeError, match=r"keyed by \(num_seqs, seq_len\), two ints, got the key \('8', 'x'\)"):
        ladder.split_sweep_markdown({("8", "x"): plain})
    assert "| 8 x 32,768 |" in ladder.split_sweep_markdown({(np.int64(8), np.int64(32768)): plain})
    with pytest.raises(TypeError, match="keyed by titles"):
        split_cost_figure({1: plain})


def test_the_default_split_sweep_stops_at_the_most_counts_a_sweep_takes():
    # a wave of 8192 SMs x 1024 blocks, 8 blocks per split: the fewest splits that fill it are 2**20, twice that is
    # past the 2**20 counts a sweep costs; without max_splits the sweep stops there, rather than blaming a
    # max_splits the caller never gave
    from lessons.gpu.source import decode_split_sweep

    sw = decode_split_sweep(1, 1 << 30, num_sms=1 << 13, blocks_per_sm=1 << 10)
    assert (sw["wave"], sw["blocks_per_split"], sw["fill"]) == (1 << 23, 8, 1 << 20)
    assert len(sw["costs"]) == 1 << 20 and max(sw["costs"]) == 1 << 20 and sw["pick"] == 65535   # decode_splits' cap
    assert sw["costs"][1 << 20] == 1 * (1 << 26) // (1 << 20)       # 2**23 blocks, one wave; 2**26 pages


def test_the_split_figure_takes_a_numpy_bool_for_zoom():
    # a flag computed with NumPy (np.bool_) is a bool as everywhere else in the library (check_flag)
    from lessons.gpu.source import decode_split_sweep
    from lessons.views.decode_splits import split_cost_figure

    sweeps = {"1 x 100": decode_split_sweep(1, 100)}
    assert len(split_cost_figure(sweeps, zoom=np.bool_(True)).get_axes()) == 2
    assert len(split_cost_figure(sweeps, zoom=np.bool_(False)).get_axes()) == 1
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match="zoom must be True or False"):
            split_cost_figure(sweeps, zoom=bad)


def test_a_sweep_with_values_of_the_wrong_type_is_named_before_it_is_drawn():
    import json

    from lessons.gpu.source import cheaper_than_pick, check_split_sweep, decode_split_sweep
    from lessons.views.decode_splits import split_cost_figure

    plain = decode_split_sweep(1, 100)                  # 7 pages, pick 7, costs 1..7
    # read back from JSON: the costs are keyed by "1" .. "7", so 7 is not among them, though they are 1..7
    loaded = json.loads(json.dumps(plain))
    draws = (lambda sw: check_split_sweep(sw, "sw"), cheaper_than_pick,
             lambda sw: ladder.split_sweep_markdown({(1, 100): sw}), lambda sw: split_cost_figure({"1 x 100": sw}))
    for draw in draws:
        with pytest.raises(TypeError, match=r"\['costs'\] must be keyed by split counts \(ints\), got the key '1' "
                                            r"\(str\).*JSON"):
            draw(loaded)
    for key, value, match in (("pick", 7.0, r"\['pick'\] must be an int of at least 1, got float 7.0"),
                              ("best", True, r"\['best'\] must be an int of at least 1, got bool True"),
                              ("pages", "7", r"\['pages'\] must be an int of at least 1, got str '7'"),
                              ("blocks_per_split", 0, r"\['blocks_per_split'\] must be an int of at least 1, got int 0"),
                              ("bound", 0, r"\['bound'\] must be a positive finite number, got 0"),
                              ("bound", float("nan"), r"\['bound'\] must be a positive finite number, got nan"),
                              ("costs", {**plain["costs"], 3: None}, r"\['costs'\]\[3\] must be a positive finite "
                                                                     r"number, got None")):
        bad = {**plain, key: value}
        for draw in draws:
            with pytest.raises((TypeError, ValueError), match=match):
                draw(bad)
    # NumPy ints and floats are numbers as any other
    typed = {**plain, "pick": np.int64(7), "costs": {np.int64(k): np.int64(v) for k, v in plain["costs"].items()},
             "bound": np.float64(plain["bound"])}
    assert cheaper_than_pick(typed) == [] and "| 1 x 100 |" in ladder.split_sweep_markdown({(1, 100): typed})


def test_targets_markdown_keeps_one_kind():
    every = ladder.targets_markdown().splitlines()
    decode = ladder.targets_markdown(kind="decode").splitlines()
    forward = ladder.targets_markdown(kind="forward").splitlines()
    assert decode[:2] == forward[:2] == every[:2]
    assert decode[2:] == [line for line in every[2:] if line.startswith("| decode:")] and len(decode) == 3
    assert forward[2:] == [line for line in every[2:] if not line.startswith("| decode:")]
    with pytest.raises(ValueError, match="kind"):
        ladder.targets_markdown(kind="backward")


def test_layout_of_a_row_over_a_warp():
    # d = 128 fp16: 256 bytes = 16 lanes x 16 bytes, 2 rows per warp instruction, 8 states per block
    assert paged_decode_split_layout(128, "float16") == dict(vec=8, lanes=16, chunks=1, keys_per_warp=2,
                                                             num_states=8, unroll=4)
    assert paged_decode_split_layout(128, "float32") == dict(vec=4, lanes=32, chunks=1, keys_per_warp=1,
                                                             num_states=4, unroll=4)
    assert paged_decode_split_layout(256, "float32")["chunks"] == 2
    assert paged_decode_split_layout(3, "float16") == dict(vec=1, lanes=4, chunks=1, keys_per_warp=8,
                                                           num_states=32, unroll=4)
    assert paged_decode_split_layout(128, "bfloat16")["unroll"] == 2
    assert paged_decode_split_layout(64, "float32")["lanes"] == 16        # 4 keys x 4 heads: the scatter path
    # shared memory: 8 states x 4 heads x (128 + 2) floats
    assert paged_decode_split_smem_bytes(128, 4, "float16") == 4 * 8 * 4 * 130


# ---------------------------------------------------------------------------
# against NumPy
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("num_heads, num_kv_heads", [(8, 8), (8, 4), (8, 2), (8, 1), (6, 2)],
                         ids=["MHA", "group2", "group4", "MQA-group8", "group3"])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_split_decode_every_gqa_ratio(backend, num_heads, num_kv_heads, num_splits):
    c = paged_case(10, num_heads, num_kv_heads, 64, 16, SEQ_LENS)
    out, lse = gpu.paged_decode_split_gpu(*decode_args(c), num_splits, backend=backend)
    assert out.dtype == c.q.dtype and lse.dtype == np.float32 and out.shape == c.q.shape
    assert not np.isnan(out).any()                      # nothing stale (NaN) past seq_len was read
    assert_decode_close(out, lse, c)
    assert np.all(out[1] == 0) and np.all(np.isneginf(lse[1]))    # the empty sequence


@pytest.mark.parametrize("d, block_size, dtype, seq_lens", [
    (3, 8, "float16", SEQ_LENS), (80, 32, "bfloat16", SEQ_LENS), (128, 16, "float32", SEQ_LENS),
    (128, 16, "float16", [300, 0, 17]), (256, 16, "float32", [40, 3]), (256, 8, "bfloat16", [40, 3]),
    (1, 1, "float32", [5, 0, 2, 1]),                    # one token per page
])
def test_split_decode_head_dims_page_sizes_and_dtypes(backend, d, block_size, dtype, seq_lens):
    c = paged_case(11, 8, 2, d, block_size, seq_lens, dtype)
    for num_splits in (None, 2):
        out, lse = gpu.paged_decode_split_gpu(*decode_args(c), num_splits, bfloat16=dtype == "bfloat16",
                                              backend=backend)
        assert not np.isnan(values(out, dtype)).any()
        assert_decode_close(out, lse, c)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 16])    # 16 splits > 3 pages: most splits are empty
def test_split_decode_partial_states_are_each_splits_own(backend, num_splits):
    c = paged_case(13, 8, 2, 64, 16, SEQ_LENS)
    out, lse, parts = gpu.paged_decode_split_gpu(*decode_args(c), num_splits, return_partials=True,
                                                 backend=backend)
    assert parts["m"].shape == (4, 8, num_splits) and parts["o"].shape == (4, 8, num_splits, 64)
    assert_decode_close(out, lse, c)
    block_size, scale = 16, 1 / 8
    got, ref, base = ([], [], []), ([], [], []), ([], [], [])
    for s in range(len(SEQ_LENS)):
        n_pages = -(-int(c.seq_lens[s]) // block_size)
        per = -(-n_pages // num_splits)
        for h in range(8):
            k, v = sequence_kv(c, s, h // 4)
            for split in range(num_splits):
                lo, hi = split * per * block_size, min((split + 1) * per * block_size, int(c.seq_lens[s]))
                state = tuple(parts[key][s, h, split] for key in ("m", "l", "o"))
                if lo >= hi:                             # an empty split is the empty state
                    assert np.isneginf(state[0]) and state[1] == 0 and np.all(state[2] == 0)
                    continue
                scores = k[lo:hi] @ c.q64[s, h] * scale
                p = np.exp(scores - scores.max())
                for i, (g, r, b) in enumerate(zip(state, (scores.max(), p.sum(), p @ v[lo:hi]),
                                                  split_state_float32(c.q64[s, h], k[lo:hi], v[lo:hi], scale,
                                                                      block_size))):
                    got[i].append(g), ref[i].append(r), base[i].append(b)
    for i, what in enumerate("mlo"):
        assert_within_baseline(np.array(got[i]), np.array(ref[i]), np.array(base[i]), what=what)
    # folding the returned partial states with lessons.merge gives the output
    for s in (0, 2, 3):
        for h in range(8):
            state = lessons.State.empty(1, 64)
            for i in range(num_splits):
                state = lessons.merge(state, lessons.State(m=parts["m"][s, h, i][None].astype(np.float64),
                                                           l=parts["l"][s, h, i][None].astype(np.float64),
                                                           o=parts["o"][s, h, i][None].astype(np.float64)))
            np.testing.assert_allclose(out[s, h], state.o[0] / state.l[0], rtol=1e-5, atol=1e-6)


def test_split_decode_agrees_with_flash_decoding_and_is_bitwise_reproducible(backend):
    c = paged_case(15, 8, 2, 64, 16, SEQ_LENS)
    first = gpu.paged_decode_split_gpu(*decode_args(c), 3, backend=backend)
    again = gpu.paged_decode_split_gpu(*decode_args(c), 3, backend=backend)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(first, again))
    fd_out, fd_lse = gpu.flash_decoding_gpu(*decode_args(c), 3, backend=backend)
    np.testing.assert_allclose(first[0], fd_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(first[1], fd_lse, rtol=1e-6, atol=1e-6)


# (4 heads on 2, d = 16): one butterfly per (key, head); (8 heads on 2, d = 64): the reduce-scatter
# softmax (16 lanes per row, 4 keys x 4 heads), the path the fp16 d = 128 build takes
BOTH_SOFTMAX_PATHS = pytest.mark.parametrize("num_heads, d", [(4, 16), (8, 64)], ids=["butterfly", "scatter"])


@BOTH_SOFTMAX_PATHS
def test_split_decode_keeps_nan_input_nan(backend, num_heads, d):
    from test_gpu_kernels import assert_same_nan_rows

    c = paged_case(14, num_heads, 2, d, 8, [20, 9])
    group = num_heads // 2
    page, slot = c.tables[0, 1], 3             # token 11 of sequence 0, kv head 1 (query heads group..)
    c.k[page, slot, 1, 5] = np.nan
    c.k64[page, slot, 1, 5] = np.nan
    ref, ref_lse = decode_reference(c)
    for num_splits in (1, 2):
        out, lse = gpu.paged_decode_split_gpu(*decode_args(c), num_splits, backend=backend)
        assert_same_nan_rows(out, lse, ref, ref_lse, *decode_reference(c, "float32"))
    assert np.isnan(ref_lse[0, group:]).all() and np.isfinite(ref_lse[0, :group]).all()


@BOTH_SOFTMAX_PATHS
@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("variant", ["plain", "prefetch", "cp_async"])
def test_split_decode_never_sees_slots_past_seq_len_or_unused_pages(backend, poison, num_heads, d, variant):
    from types import SimpleNamespace

    options = {} if variant == "plain" else {variant: True}
    if options:
        skip_left_out(backend, f"paged_decode_{variant}")      # (where gpu_check.sh left the rung out)

    from test_gpu_kernels import stored

    c = paged_case(16, num_heads, 2, d, 8, [20, 0, 8, 3])
    unused = np.isnan(c.k64)
    spare = sorted(set(range(c.k.shape[0])) - set(c.tables[c.tables >= 0].tolist()))
    zero, _ = stored(np.zeros(1), "float32")
    bad, _ = stored(np.full(1, poison), "float32")
    clean = SimpleNamespace(**{**vars(c), "k": np.where(unused, zero[0], c.k), "v": np.where(unused, zero[0], c.v)})
    dirty = SimpleNamespace(**{**vars(c), "k": np.where(unused, bad[0], c.k), "v": np.where(unused, bad[0], c.v),
                               "tables": np.where(c.tables < 0, spare[0], c.tables).astype(np.int32)})
    dirty.k[spare[0]] = dirty.v[spare[0]] = bad[0]
    for num_splits in (1, 3):
        out, lse = gpu.paged_decode_split_gpu(*decode_args(clean), num_splits, backend=backend, **options)
        out_p, lse_p = gpu.paged_decode_split_gpu(*decode_args(dirty), num_splits, backend=backend, **options)
        assert out_p.tobytes() == out.tobytes() and lse_p.tobytes() == lse.tobytes()
        assert_decode_close(out, lse, c)


# the prefetch rung: the same keys in the same order per lane group, so the same bits; shapes where a
# lane group's next step is past the split (prefetching nothing), pages of 1 and 3 keys (each key looks
# its page up: 4 keys per step do not divide them), a step that straddles a split's end
@pytest.mark.parametrize("d, block_size, dtype, num_heads, seq_lens", [
    (128, 16, "float16", 8, [300, 0, 17]), (64, 16, "float16", 8, SEQ_LENS), (80, 32, "bfloat16", 8, SEQ_LENS),
    (3, 3, "float16", 6, SEQ_LENS), (128, 16, "float32", 8, [77, 5]), (16, 1, "float32", 4, [9, 40, 1]),
])
def test_prefetch_decode_is_bitwise_the_plain_build(backend, d, block_size, dtype, num_heads, seq_lens):
    skip_left_out(backend, "paged_decode_prefetch")
    c = paged_case(17, num_heads, 2, d, block_size, seq_lens, dtype)
    assert_bitwise_the_plain_build(c, dtype, backend, (1, 2, 5), prefetch=True)


def assert_bitwise_the_plain_build(c, dtype, backend, splits, **build):
    """At each split count: the split kernel's ``build`` (prefetch=True or cp_async=True) gives out and lse close to
    the reference, and out, lse and the partial states (m, l, o) bit for bit the plain build's."""
    kw = dict(bfloat16=dtype == "bfloat16", return_partials=True, backend=backend)
    for num_splits in splits:
        plain = gpu.paged_decode_split_gpu(*decode_args(c), num_splits, **kw)
        other = gpu.paged_decode_split_gpu(*decode_args(c), num_splits, **build, **kw)
        assert_decode_close(other[0], other[1], c)
        assert other[0].tobytes() == plain[0].tobytes() and other[1].tobytes() == plain[1].tobytes()
        assert all(other[2][k].tobytes() == plain[2][k].tobytes() for k in ("m", "l", "o"))


# the cp.async rung: the rows of each step land in a ring in shared memory, and are read back as load_step would
# have loaded them (zeros past the split); the same shapes as above but d = 3 (no 16-byte pieces), and 5 splits
# of 17 keys, so most lane groups copy nothing for their last two steps
@pytest.mark.parametrize("d, block_size, dtype, num_heads, seq_lens", [
    (128, 16, "float16", 8, [300, 0, 17]), (64, 16, "float16", 8, SEQ_LENS), (80, 32, "bfloat16", 8, SEQ_LENS),
    (128, 16, "float32", 8, [77, 5]), (16, 1, "float32", 4, [9, 40, 1]), (256, 3, "float16", 4, [85, 2]),
])
def test_cp_async_decode_is_bitwise_the_plain_build(backend, d, block_size, dtype, num_heads, seq_lens):
    skip_left_out(backend, "paged_decode_cp_async")
    c = paged_case(19, num_heads, 2, d, block_size, seq_lens, dtype)
    assert_bitwise_the_plain_build(c, dtype, backend, (1, 2, 5), cp_async=True)


# the same, with each copy landing as soon as it is issued (the earliest a GPU may land it; the emulator's default
# is the latest, at its wait): a slot refilled before the thread read what it held would show here, not above.
# Long sequences, so each lane group goes round the ring of 3 slots several times.
@pytest.mark.skipif(not gpu.emulator_available(), reason="no C++ compiler")
@pytest.mark.parametrize("d, block_size, dtype, num_heads, seq_lens", [
    (128, 16, "float16", 8, [300, 0, 17]), (80, 32, "bfloat16", 8, [200, 33]), (16, 1, "float32", 4, [9, 600, 1]),
])
def test_cp_async_decode_is_bitwise_the_plain_build_when_copies_land_at_once(monkeypatch, d, block_size, dtype,
                                                                              num_heads, seq_lens):
    c = paged_case(23, num_heads, 2, d, block_size, seq_lens, dtype)
    monkeypatch.setenv("LESSONS_EMULATOR_CP_ASYNC", "issue")           # (the plain build issues no cp.async)
    assert_bitwise_the_plain_build(c, dtype, "emulator", (1, 3), cp_async=True)
    monkeypatch.setenv("LESSONS_EMULATOR_CP_ASYNC", "early")
    with pytest.raises(ValueError, match="LESSONS_EMULATOR_CP_ASYNC must be 'wait' .* or 'issue' .*got 'early'"):
        gpu.paged_decode_split_gpu(*decode_args(c), 1, cp_async=True, bfloat16=dtype == "bfloat16",
                                   backend="emulator")


def test_cp_async_decode_fills_a_wave_of_four_blocks_and_refuses_what_it_cannot_copy():
    from lessons.gpu.source import (DECODE_ASYNC_BLOCKS_PER_SM, DECODE_ASYNC_STAGES,
                                    paged_decode_split_auto_splits as auto)

    assert (DECODE_ASYNC_STAGES, DECODE_ASYNC_BLOCKS_PER_SM) == (3, 4)
    # the plain build's wave: 528 blocks, 8 per split at one sequence of 131072 tokens -> 66 splits
    assert auto(1, 131072, 128, 16, 32, 8, cp_async=True) == 66 == decode_splits(1, 8, 131072, blocks_per_sm=4)
    with pytest.raises(TypeError, match="cp_async"):
        auto(1, 4096, 128, 16, 32, 8, cp_async=1)
    c = paged_case(1, 8, 2, 64, 16, [20])
    with pytest.raises(ValueError, match="at most one"):
        gpu.paged_decode_split_gpu(*decode_args(c), prefetch=True, cp_async=True, backend="emulator")
    with pytest.raises(TypeError, match="cp_async"):
        gpu.paged_decode_split_gpu(*decode_args(c), cp_async="yes", backend="emulator")
    # 16-byte pieces: d = 12 in float16 is 24 bytes a row (the plain build reads it a value at a time)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 8 in float16, got 12"):
        gpu.paged_decode_split_build(12, 16, 8, 2, "float16", cp_async=True)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 4 in float32, got 6"):
        gpu.paged_decode_split_build(6, 16, 8, 2, "float32", cp_async=True)
    gpu.paged_decode_split_build(12, 16, 8, 2, "float32", cp_async=True)     # 48 bytes: three pieces


def test_the_split_build_names_an_unknown_dtype_before_the_head_dim_it_would_need():
    # d = 12 is 24 bytes a row in float16: no whole 16-byte pieces; but float64 is no dtype of the kernel at all,
    # and that is what the error must say (not "a multiple of 8 in float64")
    for dtype in ("float64", "fp16", np.float16, None, ["float16"]):
        with pytest.raises(ValueError, match=r"dtype must be one of \['bfloat16', 'float16', 'float32'\]"):
            gpu.paged_decode_split_build(12, 16, 8, 2, dtype, cp_async=True)
        with pytest.raises(ValueError, match="dtype must be one of"):
            paged_decode_split_layout(128, dtype)
        with pytest.raises(ValueError, match="dtype must be one of"):
            gpu.KernelBuild.make("paged_decode", dtype)
        with pytest.raises(ValueError, match="dtype must be one of"):
            gpu.paged_decode_split_build(128, 16, 8, 2, dtype)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 8 in bfloat16, got 12"):
        gpu.paged_decode_split_build(12, 16, 8, 2, "bfloat16", cp_async=True)


def test_the_split_count_of_both_builds_at_once_is_refused_as_the_build_is():
    # prefetch and cp_async together are no build (paged_decode_split_build refuses them): the blocks per SM and
    # the automatic split count of such a build are refused the same way, not taken for the cp.async build's
    from lessons.gpu.source import paged_decode_split_auto_splits as auto
    from lessons.gpu.source import paged_decode_split_blocks_per_sm as per_sm

    with pytest.raises(ValueError, match="at most one"):
        gpu.paged_decode_split_build(128, 16, 32, 8, prefetch=True, cp_async=True)
    with pytest.raises(ValueError, match="at most one"):
        per_sm(prefetch=True, cp_async=True)
    with pytest.raises(ValueError, match="at most one"):
        auto(1, 131072, 128, 16, 32, 8, prefetch=True, cp_async=True)
    with pytest.raises(ValueError, match="at most one"):
        per_sm(prefetch=np.bool_(True), cp_async=np.bool_(True))
    assert [per_sm(prefetch=np.bool_(p)) for p in (False, True)] == [4, 3]


def test_prefetch_decode_fills_a_wave_of_three_blocks_per_sm():
    # 3 blocks per SM: one wave is 396 blocks; 1 x 131072 at 8 blocks per split -> 396 / 8 = 49 splits
    # (the plain build: 528 / 8 = 66), read back from the partial states the launcher allocated
    from lessons.gpu.source import DECODE_BLOCKS_PER_SM

    assert DECODE_BLOCKS_PER_SM == {False: 4, True: 3}
    assert decode_splits(1, 8, 131072, blocks_per_sm=3) == 49
    # the one function the launcher, the benchmark and the sweep ask (32 query heads on 8, d = 128, pages of 16)
    from lessons.gpu.source import paged_decode_split_auto_splits as auto
    assert [auto(1, 131072, 128, 16, 32, 8, prefetch=p) for p in (False, True)] == [66, 49]
    assert auto(8, 32768, 128, 16, 32, 8) == 8 and auto(64, 4096, 128, 16, 32, 8, prefetch=True) == 1
    assert auto(1, 131072, 128, 16, 64, 8) == 33    # groups of 8 heads: 2 blocks of 4 each, 16 per split -> 528 / 16
    with pytest.raises(TypeError, match="prefetch"):
        auto(1, 4096, 128, 16, 32, 8, prefetch="yes")
    # the blocks per SM each build is made for: the wave its pick fills (528 / 8 = 66 splits, 396 / 8 = 49)
    from lessons.gpu.source import paged_decode_split_blocks_per_sm as per_sm
    assert [per_sm(), per_sm(prefetch=True), per_sm(cp_async=True)] == [4, 3, 4]
    assert [132 * per_sm(prefetch=p) // 8 for p in (False, True)] == [66, 49]
    with pytest.raises(TypeError, match="cp_async"):
        per_sm(cp_async=1)
    # one sequence, 2 KV heads (2 blocks per split), its block table 400 pages wide (the launcher reads the
    # longest sequence off the table's width): 264 splits fill the 4-block wave, 198 the 3-block one
    c = paged_case(18, 8, 2, 16, 16, [16 * 400])
    assert c.tables.shape[1] >= 400
    parts = [gpu.paged_decode_split_gpu(*decode_args(c), prefetch=p, return_partials=True, backend="emulator")[2]
             for p in (False, True)] if gpu.emulator_available() else None
    if parts is not None:
        assert parts[0]["m"].shape[-1] == 264 and parts[1]["m"].shape[-1] == 198


def test_split_decode_refuses_bad_input():
    c = paged_case(1, 8, 2, 64, 16, [20])
    with pytest.raises(ValueError, match="num_splits"):
        gpu.paged_decode_split_gpu(*decode_args(c), 0, backend="emulator")
    with pytest.raises(TypeError, match="num_splits"):
        gpu.paged_decode_split_gpu(*decode_args(c), 2.5, backend="emulator")
    with pytest.raises(ValueError, match="num_kv_heads"):
        bad = paged_case(1, 6, 4, 64, 16, [20])
        gpu.paged_decode_split_gpu(*decode_args(bad), backend="emulator")
    with pytest.raises(TypeError, match="return_partials"):
        gpu.paged_decode_split_gpu(*decode_args(c), return_partials="yes", backend="emulator")
    with pytest.raises(ValueError, match="backend"):
        gpu.paged_decode_split_gpu(*decode_args(c), backend="cuda")
    with pytest.raises(TypeError, match="prefetch"):
        gpu.paged_decode_split_gpu(*decode_args(c), prefetch=1, backend="emulator")


# ---------------------------------------------------------------------------
# the compiled code
# ---------------------------------------------------------------------------

@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("d, dtype", [(128, "float16"), (128, "bfloat16"), (128, "float32"), (64, "float16"),
                                      (256, "float16"), (80, "bfloat16")])
@pytest.mark.parametrize("variant", ["plain", "prefetch", "cp_async"])
def test_split_decode_compiles_without_spills(arch, d, dtype, variant):
    options = {} if variant == "plain" else {variant: True}
    build = gpu.paged_decode_split_build(d, 16, 32, 8, dtype, **options)
    res = gpu.compile_kernel(build, arch).resources
    # the launch bounds: 4 blocks of 128 threads per SM (<= 128 registers), 3 with prefetch (<= 168)
    assert res["paged_decode_gqa_split"].registers <= 65536 // (128 * (3 if variant == "prefetch" else 4))
    for entry in ("paged_decode_gqa_split", "merge_split_states"):
        assert res[entry].spill_store_bytes == 0 and res[entry].spill_load_bytes == 0, entry
        assert res[entry].stack_bytes == 0, entry
    # the cp.async build: a ring of 3 steps, 16 KiB each at d = 128 in fp16 (8 pieces of 16 bytes per thread),
    # 8 KiB in bfloat16 (2 keys a step), the merge's states in the same bytes
    stages = 3 if variant == "cp_async" else 0
    assert res["paged_decode_gqa_split"].smem_bytes == paged_decode_split_smem_bytes(d, 4, dtype, stages)
    if (d, dtype, variant) in ((128, "float16", "cp_async"), (128, "bfloat16", "cp_async")):
        assert res["paged_decode_gqa_split"].smem_bytes == 3 * (4 if dtype == "float16" else 2) * 2 * 128 * 16
    assert res["merge_split_states"].smem_bytes == build.entry_smem_bytes("merge_split_states") == 4 * 4 * (2 + d)


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_split_decode_reads_k_and_v_16_bytes_at_a_time(arch):
    from lessons.gpu.compile import compile_ptx

    ptx = compile_ptx(gpu.paged_decode_split_build(128, 16, 32, 8, "float16"), arch)
    body = ptx.split(".entry merge_split_states")[0]       # the decode entry comes first
    assert "ld.global.nc.v4.u32" in body
    # q (4 heads) and K, V of 4 keys per step: at least 4 + 2 x 4 vector loads, and no 16-bit global loads
    assert body.count("ld.global.nc.v4.u32") >= 12
    assert "ld.global.nc.u16" not in body and "ld.global.u16" not in body
    # the reduce-scatter softmax: the p of each (key, head) broadcast from the lane that computed it
    assert body.count("shfl.sync.idx") >= 16
    # the paged_decode rung below reads K and V one half at a time
    old = compile_ptx(gpu.paged_decode_build(128, 16, 32, 8, "float16"), arch)
    assert "ld.global.nc.v4" not in old and "ld.global.nc.u16" in old


# ---------------------------------------------------------------------------
# the ladder's decode rungs
# ---------------------------------------------------------------------------

def test_decode_rungs_carry_the_recorded_csv():
    import csv

    names = [r.name for r in ladder.DECODE_RUNGS]
    assert names == ["paged_decode", "flash_decoding", "paged_decode_split", "paged_decode_prefetch",
                     "paged_decode_cp_async"]
    for top in map(ladder.decode_rung, ("paged_decode_split", "paged_decode_prefetch", "paged_decode_cp_async")):
        assert top.kernel == "paged_decode_split" and top.launcher == "lessons.gpu.paged_decode_split_gpu"
    measured, names = names[:3], names             # the recorded run predates the prefetch and cp.async rungs
    assert ladder.DECODE_RECORDED.parent.parent.name == "gpu_h200_2026-12-01"
    # the same file read with the csv module alone: the best split count per (kernel, shape)
    best = {}
    with open(ladder.DECODE_RECORDED, newline="") as f:
        for r in csv.DictReader(f):
            key = (r["kernel"].split()[0], int(r["num_seqs"]), int(r["seq_len"]))
            if float(r["pct_of_copy"]) > best.get(key, (-1,))[0]:
                best[key] = (float(r["pct_of_copy"]), int(r["num_splits"]))
    table = {e["name"]: e for e in ladder.decode_table()}
    for name in names[3:]:
        assert table[name]["figure"] == ladder.NOT_MEASURED and table[name]["pct"] is None
    for name in measured:
        assert table[name]["figure"] != ladder.NOT_MEASURED
        assert table[name]["pct"] == {(s, n): p for (k, s, n), (p, _) in best.items() if k == name}
        assert table[name]["splits"] == {(s, n): c for (k, s, n), (_, c) in best.items() if k == name}
    # the run's README: the split kernel at 68%, 51%, 66% with 1, 9 and 66 splits chosen from the shape;
    # flash_decoding at best (32 splits) 14%, 11%, 4%
    assert {k: round(v) for k, v in table["paged_decode_split"]["pct"].items()} == \
        {(64, 4096): 68, (8, 32768): 51, (1, 131072): 66}
    assert table["paged_decode_split"]["splits"] == {(64, 4096): 1, (8, 32768): 9, (1, 131072): 66}
    assert {k: round(v) for k, v in table["flash_decoding"]["pct"].items()} == \
        {(64, 4096): 14, (8, 32768): 11, (1, 131072): 4}
    assert "1 x 131072: 66% (66 splits)" in table["paged_decode_split"]["figure"]
    rows = ladder.decode_recorded_rows()
    assert all(r["kv_bytes"] / (r["ms"] / 1e3) / 1e12 == pytest.approx(r["tb_per_s"]) for r in rows)
    md = ladder.decode_markdown()
    assert md.count("\n") == 1 + len(names) and "`paged_decode_split`" in md
    # a rung without rows in a run shows no number
    only_old = [r for r in rows if r["name"] != "paged_decode_split"]
    assert ladder.decode_recorded("paged_decode_split", only_old) is None
    assert {e["name"]: e["figure"] for e in ladder.decode_table(only_old)}["paged_decode_split"] == ladder.NOT_MEASURED
    with pytest.raises(ValueError, match="decode rung"):
        ladder.decode_rung("nope")


@needs_nvrtc
@pytest.mark.parametrize("name", ["paged_decode", "flash_decoding", "paged_decode_split", "paged_decode_prefetch",
                                  "paged_decode_cp_async"])
def test_each_decode_rung_holds_its_instruction(name):
    from lessons.gpu.compile import compile_ptx

    r = ladder.decode_rung(name)
    assert r.ptx_grep in compile_ptx(ladder.decode_rung_build(r), "sm_80")


@needs_nvrtc
def test_the_prefetch_rung_loads_a_step_ahead():
    # d = 128 fp16: q is 4 vector loads (one per head), a step 8 (K and V of 4 keys). The plain build issues a
    # step's loads in the loop only (4 + 8); the prefetch build also before the loop, the first step's, and its loop
    # is two steps, one per register set (4 + 8 + 2 x 8)
    from lessons.gpu.compile import compile_ptx

    def loads(build):
        return compile_ptx(build, "sm_80").split(".entry merge_split_states")[0].count("ld.global.nc.v4.u32")

    assert loads(ladder.decode_rung_build("paged_decode_split")) == 12
    assert loads(ladder.decode_rung_build("paged_decode_prefetch")) == 28
    assert dict(ladder.decode_rung_build("paged_decode_prefetch").defines) == dict(
        HEAD_DIM=128, BLOCK_SIZE=16, HEADS_PER_BLOCK=4, PREFETCH=1, MIN_BLOCKS=3)


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_cp_async_rung_copies_two_steps_ahead(arch):
    # d = 128 fp16: a step is 8 copies of 16 bytes per thread (K and V of 4 keys). Two steps are copied before
    # the loop and one in it (3 x 8); the only 16-byte global loads left are q's (4 heads); in the loop the thread
    # waits with 2 groups still in flight, after the loop with none; the pieces come back from shared memory
    from lessons.gpu.compile import compile_ptx

    build = ladder.decode_rung_build("paged_decode_cp_async")
    assert dict(build.defines) == dict(HEAD_DIM=128, BLOCK_SIZE=16, HEADS_PER_BLOCK=4, ASYNC_STAGES=3, MIN_BLOCKS=4)
    body = compile_ptx(build, arch).split(".entry merge_split_states")[0]
    assert body.count("cp.async.cg.shared.global") == 24
    assert body.count("cp.async.commit_group") == 3
    assert body.count("cp.async.wait_group 2;") == 1 and body.count("cp.async.wait_group 0;") == 1
    assert body.count("ld.global.nc.v4.u32") == 4
    assert body.count("ld.shared.v4.u32") >= 8
    plain = compile_ptx(ladder.decode_rung_build("paged_decode_split"), arch)
    assert "cp.async" not in plain.split(".entry merge_split_states")[0]


# ---------------------------------------------------------------------------
# the benchmark
# ---------------------------------------------------------------------------

def _benchmark():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_decode
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return gpu_decode


def test_benchmark_counts_bytes_and_percentages_by_hand():
    b = _benchmark()
    assert b.kv_bytes(64, 4096) == 2**30                        # 64 x 4096 x 8 x 128 x 2 bytes x (K and V)
    assert b.kv_bytes(1, 131072) == 2**29
    assert b.kv_bytes(2, 10, num_kv_heads=1, head_dim=4, element_size=4) == 2 * 2 * 10 * 4 * 4
    assert b.copy_rate(10**9, 0.5) == 4e9                        # read + written
    assert b.pct_of_copy(2**30, 2**30 / 3e12, 4e12) == pytest.approx(75.0)
    row = b.result_row("k", 64, 4096, 1, 2**30 / 3e12, 4e12, 0.0)
    assert row["tb_per_s"] == pytest.approx(3.0) and row["pct_of_copy"] == pytest.approx(75.0)
    assert "75% of the copy rate" in b.format_row(row)
    with pytest.raises(ValueError, match="positive"):
        b.pct_of_copy(1, 0.0, 1.0)


def test_benchmark_times_the_split_kernel_beside_its_pick():
    b = _benchmark()
    runs = b.kernel_runs(8, 32768, 132)
    assert runs[:len(b.KERNELS)] == list(b.KERNELS)
    assert runs[len(b.KERNELS):] == [("paged_decode_split s=7", "paged_decode_split_gpu", 7),
                                     ("paged_decode_split s=9", "paged_decode_split_gpu", 9)]
    assert [r[2] for r in b.kernel_runs(64, 4096, 132)[len(b.KERNELS):]] == [2]     # auto 1: no s=0
    assert [r[2] for r in b.kernel_runs(1, 131072, 132)[len(b.KERNELS):]] == [65, 67]
    assert [r[2] for r in b.kernel_runs(1, 48, 132)[len(b.KERNELS):]] == [2]        # 3 pages: auto 3, no s=4
    # the prefetch rung: the split launcher's prefetch build, at its own pick
    assert ("paged_decode_prefetch auto", "paged_decode_split_gpu", None) in b.KERNELS
    assert b.RUNG_OPTIONS == {"paged_decode_prefetch": dict(prefetch=True), "paged_decode_cp_async": dict(cp_async=True)}
    assert ("paged_decode_cp_async auto", "paged_decode_split_gpu", None) in b.KERNELS
    assert {label.split()[0] for label, *_ in b.KERNELS} == {r.name for r in ladder.DECODE_RUNGS}


def test_benchmark_writes_its_tables(tmp_path):
    b = _benchmark()
    rows = [b.result_row("paged_decode", 64, 4096, 1, 2.413e-3, 4.2e12, 1e-3),
            b.result_row("paged_decode_split auto", 1, 131072, 66, 0.2e-3, 4.2e12, 2e-3)]
    b.write_results(rows, tmp_path / "out", 4.2, "TEST GPU")
    with open(tmp_path / "out" / "results.csv") as f:
        got = list(csv.DictReader(f))
    assert [r["kernel"] for r in got] == ["paged_decode", "paged_decode_split auto"]
    assert float(got[0]["pct_of_copy"]) == pytest.approx(100 * 2**30 / 2.413e-3 / 4.2e12)   # 10.6%
    md = (tmp_path / "out" / "results.md").read_text()
    assert "TEST GPU" in md and "| paged_decode | 64 x 4096 | 1 | 2.413 | 1.00 | 0.44 | 11% |" in md


def test_benchmark_leaves_out_the_prefetch_row_when_its_first_run_failed(tmp_path):
    b = _benchmark()
    env = {"GPU_CHECK_LEFT_OUT": "paged_decode_prefetch"}
    why = "failed its first run on this machine (scripts/first_run.py)"
    labels = [label for label, *_ in b.kernel_runs(8, 32768, 132)]
    assert [label for label in labels if b.skip_reason(label, env)] == ["paged_decode_prefetch auto"]
    assert b.skip_reason("paged_decode_prefetch auto", env) == why
    assert all(b.skip_reason(label, {}) is None for label in labels)
    assert b.skip_reason("paged_decode_split s=7", {"GPU_CHECK_LEFT_OUT": "paged_decode_split"}) == why
    # results.md names what was not run, and why; the CSV holds only rows that ran
    rows = [b.result_row("paged_decode_split auto", 8, 32768, 8, 0.2e-3, 4.2e12, 2e-3)]
    b.write_results(rows, tmp_path, 4.2, "TEST GPU", [("paged_decode_prefetch auto", why)])
    assert (tmp_path / "results.md").read_text().endswith(f"\nNot run: paged_decode_prefetch auto: {why}.\n")
    with open(tmp_path / "results.csv") as f:
        assert [r["kernel"] for r in csv.DictReader(f)] == ["paged_decode_split auto"]


@pytest.mark.skipif(gpu.device_available(), reason="a CUDA device is present: the benchmark would measure")
def test_benchmark_without_a_device_says_so_and_exits_0(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_decode.py"), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device" in proc.stdout
    assert not (tmp_path / "o").exists()


@needs_nvrtc
def test_the_prefetch_rungs_text_quotes_the_compiler():
    # the rung's text and notebook 10 quote 168 registers at 3 blocks per SM; at 4 it would spill 388 / 452 bytes
    import json

    from lessons.gpu.compile import nvrtc_version
    from lessons.gpu.source import KernelBuild

    text = ladder.decode_rung("paged_decode_prefetch").predicted
    notebook = "".join("".join(c["source"]) for c in json.loads(
        (ROOT / "notebooks" / "10_decode_kernel_ladder.ipynb").read_text())["cells"])
    assert "168 registers" in text and "168 registers" in notebook and "3 blocks per SM" in notebook
    if nvrtc_version()[:2] == (12, 9):                # the version the texts name
        build = ladder.decode_rung_build("paged_decode_prefetch")
        at_four = KernelBuild.make("paged_decode_split", "float16", False, **{**dict(build.defines), "MIN_BLOCKS": 4})
        spills = []
        for arch in ("sm_80", "sm_90"):
            assert gpu.compile_kernel(build, arch).resources["paged_decode_gqa_split"].registers == 168
            spills.append(gpu.compile_kernel(at_four, arch).resources["paged_decode_gqa_split"].spill_bytes)
        assert f"{spills[0]} / {spills[1]} bytes of spill" in text and spills == [388, 452]


def test_cp_async_decode_refuses_a_gpu_without_cp_async(monkeypatch):
    # a Turing card (compute capability 7.5) has no cp.async: the launcher says so before it builds anything
    from lessons.gpu import launch

    class OldDevice:
        compute_capability = "75"

    fake = type("cupy", (), {"cuda": type("cuda", (), {"Device": OldDevice})})

    class FakeRunner:
        def __init__(self, backend, kind=None):
            self.backend, self.xp = "cupy", fake

    monkeypatch.setattr(launch, "Runner", FakeRunner)
    c = paged_case(1, 8, 2, 64, 16, [20])
    with pytest.raises(RuntimeError, match="cp.async decode kernel needs a GPU of compute capability 8.0 or newer "
                                           ".* this one is 7.5. Use paged_decode_split_gpu without cp_async"):
        gpu.paged_decode_split_gpu(*decode_args(c), cp_async=True, backend="cupy")
