"""lessons.gpu.warpgroup_pipes: a Hopper rung's consumer warp per key tile, tensor cores, MUFU and issue slots."""
import pytest

from lessons.gpu import ladder, sass, source
from lessons.gpu import warpgroup_pipes as wp
from lessons.gpu.hopper import overlap_schedule

from test_gpu_sass import _shortest_pass, _successors, needs_tools

# a key-tile loop (.L_x_0 .. its BRA back) with an mbarrier wait whose retry block, at the end, jumps back into
# the loop: that retry is a loop too and spans the same products, but it is larger
SPIN = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R2+URZ], R3 ;
        /*0020*/              @!P0 BRA `(.L_x_9) ;
.L_x_1:
        /*0030*/                   HGMMA.64x128x16.F32 R24, gdesc[UR8], RZ, !UPT ;
        /*0040*/                   HGMMA.64x128x16.F32 R24, gdesc[UR8], R24, gsb0 ;
        /*0050*/                   MUFU.EX2 R5, R5 ;
        /*0060*/                   FMNMX R6, R5, R6, !PT ;
        /*0070*/                   HGMMA.64x64x16.F32 R88, R120, gdesc[UR12].tnspB, R88, gsb0 ;
        /*0080*/               @P1 BRA `(.L_x_0) ;
        /*0090*/                   EXIT ;
.L_x_9:
        /*00a0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R2+URZ], R3 ;
        /*00b0*/              @!P0 BRA `(.L_x_9) ;
        /*00c0*/                   BRA `(.L_x_1) ;
"""


def test_hgmma_flops_are_read_from_the_shape():
    assert wp.hgmma_flops("HGMMA.64x128x16.F32") == 2 * 64 * 128 * 16 == 262144
    assert wp.hgmma_flops("HGMMA.64x64x16.F32.BF16") == 131072
    with pytest.raises(ValueError, match="opcode must be an HGMMA"):
        wp.hgmma_flops("HMMA.16816.F32")
    for empty in ("HGMMA.0x128x16.F32", "HGMMA.64x0x16.F32", "HGMMA.64x128x00.F32"):
        with pytest.raises(ValueError, match="opcode must be an HGMMA"):
            wp.hgmma_flops(empty)
    with pytest.raises(TypeError, match="opcode must be a str"):
        wp.hgmma_flops(64)


def test_the_key_tile_loop_is_the_smallest_that_holds_one_tiles_products():
    instructions, labels = sass.parse_sass(SPIN)
    flops = 2 * 262144 + 131072
    assert wp._key_tile_loop(instructions, labels, flops) == (1, 8)      # not the retry's (3, 12)
    assert (3, 12) in {(j, i) for i in range(len(instructions)) for j in sass._successors(instructions, labels, i)
                       if j <= i}
    # the pass takes the wait that succeeds at once: no retry block
    assert sass.interior_pass(instructions, labels, 1, 8, 3, is_copy=lambda x: x.base == "HGMMA") == [1, 2, 3, 4, 5,
                                                                                                        6, 7, 8]
    with pytest.raises(ValueError, match="no loop of the SASS holds HGMMA of 1 FLOPs"):
        wp._key_tile_loop(instructions, labels, 1)


def _pass(rung, d):
    """The test's own count: the instructions of the shortest pass through the loop warpgroup_tile chose, with
    the other loops' branches back barred and no product asked for, and that loop's products by shape."""
    build = ladder.rung_build(rung, d)
    instructions, labels = sass.parse_sass(sass.disassemble(build, build.arch, ladder.rung_entry(rung, d)))
    _, block_k = source.WGMMA_CONFIGS[d]
    first, last = wp._key_tile_loop(instructions, labels, 4 * 64 * block_k * d)
    loops = [(j, i) for i in range(len(instructions)) for j in _successors(instructions, labels, i) if j <= i]
    barred = {(b, h) for h, b in loops if (h, b) != (first, last)}
    shortest = _shortest_pass(instructions, labels, first, last, lambda i: 1, {}, barred)
    shapes = {}
    for x in instructions[first:last + 1]:
        if x.base == "HGMMA":
            shapes[x.opcode.split(".")[1]] = shapes.get(x.opcode.split(".")[1], 0) + 1
    return shortest, shapes


@needs_tools
@pytest.mark.parametrize("rung", wp.HOPPER_RUNGS)
@pytest.mark.parametrize("d", [64, 128])
def test_the_interior_pass_does_one_tiles_products_and_exponentials(rung, d):
    tile = wp.warpgroup_tile(rung, d)
    block_q, block_k = source.WGMMA_CONFIGS[d]
    assert (tile.block_q, tile.block_k, tile.consumers) == (block_q, block_k, 2)
    # S = Q K^T: d / 16 products of 64 x block_k x 16; P V: block_k / 16 of 64 x d x 16
    shortest, shapes = _pass(rung, d)
    assert shapes == {f"64x{block_k}x16": d // 16, f"64x{d}x16": block_k // 16}
    assert tile.hgmma == d // 16 + block_k // 16 == 12
    assert tile.flops == 2 * 2 * 64 * block_k * d
    assert tile.tensor_clocks == 512                  # 4 x 64 x block_k x d / 4096 per SM clock, both configs
    # 64 x block_k scores over 128 threads, and at most the rescale alpha of the thread's 2 rows: the lazy
    # rescale's cheapest pass (no row of the warp moved its max) has none
    exps = 64 * block_k // 128
    assert tile.exps == exps and exps <= tile.mufu <= exps + 2 and tile.mufu_clocks == 8 * tile.mufu
    print(f"\n{rung} d={d}: interior {tile.instructions}, unconstrained {shortest}")
    assert shortest <= tile.instructions
    classes = tile.classes
    assert sum(classes.values()) == tile.instructions and classes["tensor"] == 12 and classes["other"] == 0
    assert classes["exponentials"] == tile.mufu


@needs_tools
@pytest.mark.parametrize("rung", wp.HOPPER_RUNGS)
def test_the_shares_follow_from_the_three_times_by_hand(rung):
    for d in (64, 128):
        tile = wp.warpgroup_tile(rung, d)
        t, m, i = tile.tensor_clocks, tile.mufu_clocks, tile.issue_clocks
        s = max(m, i)
        assert tile.softmax_clocks == s
        assert tile.shares == pytest.approx(dict(plain=t / (t + s), overlap=t / (t / 2 + max(s, t / 2)),
                                                 turns=t / max(t, s)))
        assert tile.shares["plain"] <= tile.shares["overlap"] <= tile.shares["turns"] <= 1
        assert tile.share == tile.shares[{"wgmma": "plain", "wgmma_overlap": "overlap",
                                          "wgmma_pingpong": "turns"}[rung]]
        assert tile.bound == ("tensor" if t >= s else "MUFU" if m > i else "issue")


@needs_tools
@pytest.mark.parametrize("d", [64, 128])
def test_the_overlap_schedule_with_the_sass_times_gives_the_same_shares(d):
    """overlap_schedule, a step-by-step model, run with the SASS's times over many tiles, comes to the per-tile
    formulas the shares use."""
    n = 400
    for rung, overlap in (("wgmma", False), ("wgmma_overlap", True)):
        tile = wp.warpgroup_tile(rung, d)
        times = wp.overlap_times(tile)
        assert times["qk"] + times["pv"] == tile.tensor_clocks and times["softmax"] == tile.softmax_clocks
        makespan = max(e.end for e in overlap_schedule(n, **times, overlap=overlap))
        assert n * tile.tensor_clocks / makespan == pytest.approx(tile.share, rel=2 / n)
    with pytest.raises(TypeError, match="tile must be a WarpgroupTile"):
        wp.overlap_times(dict(times))


@needs_tools
def test_the_ceilings_leave_room_for_the_target_and_the_table_reads_them():
    table = wp.warpgroup_table()
    assert [(r["rung"], r["d"]) for r in table] == [(r, d) for r in wp.HOPPER_RUNGS for d in (64, 128)]
    for row in table:
        assert row["ceiling"] == pytest.approx(row["share"] * 989e12)
        assert row["any_order"] == pytest.approx(row["shares"]["turns"] * 989e12) and row["any_order"] >= row["ceiling"]
    # what a GPU run records of a Hopper rung can pass its own order's ceiling (two consumers that drift apart
    # overlap by themselves) but not the bound of every order
    bound = {(row["rung"], row["d"]): row["any_order"] for row in table}
    for r in wp.HOPPER_RUNGS:
        for rec in ladder.recorded_rows():
            if rec["impl"] == ladder.rung(r).impl and rec["tflops"] is not None and not rec["causal"]:
                assert rec["tflops"] < bound[r, rec["d"]] / 1e12, (r, rec)
    # the 0.75x SDPA the Hopper target asks for (SDPA as recorded on the H200) is under the turns' ceiling
    (target,) = [t for t in ladder.target_outcomes() if t["rung"] == "wgmma_pingpong"]
    for row in table:
        if row["rung"] == "wgmma_pingpong":
            assert row["ceiling"] / 1e12 > target["needs"][row["d"]]
    text = wp.warpgroup_markdown(table)
    assert text.count("\n") == len(table) + 1
    first = table[0]
    assert (f"| {first['rung']} | {first['d']} | {first['block_q']} x {first['block_k']} | 512 | "
            f"{first['mufu_clocks']} | {first['issue_clocks']} |") in text
    assert text.splitlines()[2].endswith(f"| {first['ceiling'] / 1e12:.0f} | {first['any_order'] / 1e12:.0f} |")
    small = wp.warpgroup_table("wgmma_overlap", [128], peak_flops=1e15)
    assert len(small) == 1 and small[0]["ceiling"] == pytest.approx(small[0]["share"] * 1e15)


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="rung must be a Hopper"):
        wp.warpgroup_tile("mma_fa2", 64)
    with pytest.raises(ValueError, match="d must be one of"):
        wp.warpgroup_tile("wgmma", 96)
    with pytest.raises(TypeError, match="d must be an int"):
        wp.warpgroup_tile("wgmma", True)
    with pytest.raises(ValueError, match="peak_flops"):
        wp.warpgroup_table("wgmma", [64], peak_flops=-1.0)
    with pytest.raises(TypeError, match="table"):
        wp.warpgroup_markdown([{"rung": "wgmma"}])


@needs_tools
def test_the_pipes_figure_draws_the_three_times():
    from lessons.views.register_tiles import warpgroup_pipes_figure

    table = wp.warpgroup_table("wgmma_pingpong", [64, 128])
    fig = warpgroup_pipes_figure(table)
    ax = fig.axes[0]
    bars = [p for p in ax.patches]
    for row in table:
        widths = sorted(round(p.get_width(), 6) for p in bars)
        assert round(row["tensor_clocks"], 6) in widths and row["mufu_clocks"] in widths
    # the issue bar of each row is its classes stacked: the right ends reach the instructions
    ends = {round(p.get_x() + p.get_width()) for p in bars}
    assert all(row["issue_clocks"] in ends for row in table)
    texts = " ".join(t.get_text() for t in ax.texts)
    for row in table:
        assert f"at most\n{row['ceiling'] / 1e12:.0f} TFLOP/s ({row['share']:.0%} of the peak)" in texts
    # each issue class's legend entry gives its clocks over the rows, so that one too thin to see still reads
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    for name in {name for row in table for name, width in row["classes"].items() if width}:
        widths = [round(row["classes"][name]) for row in table if row["classes"].get(name)]
        lo, hi = min(widths), max(widths)
        span = (f"{lo} clock" + ("" if lo == 1 else "s")) if lo == hi else f"{lo}-{hi} clocks"
        assert f"I, issue slots: {name} ({span})" in legend, legend
    bad = [dict(table[0], classes={"other float": 1})]
    with pytest.raises(ValueError, match="must be a dict that sums"):
        warpgroup_pipes_figure(bad)
    with pytest.raises(TypeError, match="table must be a non-empty list"):
        warpgroup_pipes_figure([])


@needs_tools
def test_the_quiz_quotes_the_ping_pong_rungs_pipes():
    from lessons.course.quiz import QUIZZES
    from lessons.gpu.compile import nvrtc_version

    if nvrtc_version()[:2] != (12, 9):
        pytest.skip("the quiz quotes NVRTC 12.9's SASS")
    question = next(q for q in QUIZZES["11_hopper_kernels"] if "ping-pong Hopper rung at d = 64" in q.question)
    tile = wp.warpgroup_tile("wgmma_pingpong", 64)
    t, m, i = int(tile.tensor_clocks), tile.mufu_clocks, tile.issue_clocks
    assert (f"busy {t} clocks, its {tile.mufu} MUFU hold the special function unit {m} clocks, and it issues {i} "
            "instructions") in question.question
    # the lazy rescale's pass (no alpha): the exponentials of P alone, as long as the products
    assert tile.mufu == tile.exps and m == t == max(t, m, i) and tile.bound == "tensor"
    right = question.choices[question.answer]
    assert f"{t} / {m} = {tile.shares['turns']:.0%}" in right and "2 MUFU more" in right
    assert f"max({t}, {m}, {i}) = {m} clocks" in question.explanation
    moved = 8 * (tile.mufu + 2)                       # a tile that computes the 2 rows' alpha
    assert f"{tile.mufu + 2} MUFU, {moved} clocks, at most {t} / {moved} = {t / moved:.0%}" in question.explanation
    assert f"{i} instructions against {t} clocks" in question.choices[0] and i < t
    assert f"{t} + {m} + {i} clocks" in question.choices[3] and round(3 * t / (t + m + i), 1) == 1


# a row as warpgroup_table makes it (the ping-pong rung at d = 64), written out so the checks need no SASS
ROW = dict(rung="wgmma_pingpong", d=64, block_q=128, block_k=128, hgmma=12, instructions=520, mufu=66,
           classes={"tensor": 12, "exponentials": 66, "other float": 342, "integer and address": 75,
                    "control and sync": 25},
           tensor_clocks=512.0, mufu_clocks=528, issue_clocks=520, softmax_clocks=528, bound="MUFU",
           order=wp.ORDERS["wgmma_pingpong"], shares=dict(plain=0.49, overlap=0.49, turns=0.97), share=0.97,
           ceiling=0.97 * 989e12, any_order=0.97 * 989e12)


@pytest.mark.parametrize("key, value, error", [
    ("share", None, TypeError), ("ceiling", "x", TypeError), ("any_order", True, TypeError),
    ("tensor_clocks", float("nan"), ValueError), ("mufu_clocks", -8, ValueError), ("issue_clocks", float("inf"), ValueError),
    ("tensor_clocks", 0, ValueError), ("d", "64", TypeError), ("rung", None, TypeError), ("bound", 3, TypeError),
])
def test_the_markdown_and_the_figure_refuse_a_bad_value_by_name(key, value, error):
    from lessons.views.register_tiles import warpgroup_pipes_figure

    assert wp.warpgroup_markdown([ROW]).count("\n") == 2 and warpgroup_pipes_figure([ROW]) is not None
    for call in (wp.warpgroup_markdown, warpgroup_pipes_figure):
        if key in ("bound", "any_order") and call is warpgroup_pipes_figure:
            continue                                     # the figure does not read them
        with pytest.raises(error, match=rf"table\[0\]\['{key}'\]"):
            call([dict(ROW, **{key: value})])


@pytest.mark.parametrize("count, error", [("a", TypeError), (-12, ValueError), (float("nan"), ValueError)])
def test_the_figure_refuses_bad_class_counts_by_name(count, error):
    from lessons.views.register_tiles import warpgroup_pipes_figure

    classes = dict(ROW["classes"], tensor=count)
    with pytest.raises(error, match=r"table\[0\]\['classes'\]\['tensor'\]"):
        warpgroup_pipes_figure([dict(ROW, classes=classes)])


def test_a_warpgroup_tile_by_hand_is_checked():
    tile = wp.WarpgroupTile("wgmma_pingpong", 64, 128, 128, 2, 12, 2 * 2 * 64 * 128 * 64, 520, {"MUFU": 66})
    assert tile.share == pytest.approx(512 / 528) and tile.bound == "MUFU"
    with pytest.raises(ValueError, match="rung must be one of"):
        wp.WarpgroupTile("mma_fa2", 64, 128, 128, 2, 12, 2097152, 520, {"MUFU": 66})
    with pytest.raises(ValueError, match="flops must be at least 1"):
        wp.WarpgroupTile("wgmma", 64, 128, 128, 2, 0, 0, 0, {})
    with pytest.raises(TypeError, match="instructions must be an int"):
        wp.WarpgroupTile("wgmma", 64, 128, 128, 2, 12, 2097152, 520.0, {})
    with pytest.raises(TypeError, match="counts must be a dict"):
        wp.WarpgroupTile("wgmma", 64, 128, 128, 2, 12, 2097152, 520, [("MUFU", 66)])
