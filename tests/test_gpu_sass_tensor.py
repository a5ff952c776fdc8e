"""lessons.gpu.sass, tensor-core rungs: the interior pass of the key-tile loop and its HMMA per issue slot."""
import math

import pytest

import lessons.gpu as gpu
from lessons.gpu import ladder, sass
from lessons.cost.traffic import H200

from test_gpu_sass import _shortest_pass, _successors, needs_tools

# a loop (.L_x_0 .. the BRA back) with a copy that a branch may skip (the last tile), an inner loop that copies
# once per pass (two passes wanted) and a fix-up that runs only sometimes
LOOP = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0020*/               @P0 BRA `(.L_x_2) ;
.L_x_1:
        /*0030*/                   LDGSTS.E.BYPASS.128 [R2], desc[UR4][R6.64] ;
        /*0040*/                   IADD3 R3, R3, 0x1, RZ ;
        /*0050*/               @P1 BRA `(.L_x_1) ;
.L_x_2:
        /*0060*/               @P2 BRA `(.L_x_3) ;
        /*0070*/                   LDG.E.U16 R9, desc[UR4][R6.64] ;
        /*0080*/                   FMUL R9, R9, RZ ;
.L_x_3:
        /*0090*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*00a0*/               @P3 BRA `(.L_x_0) ;
        /*00b0*/                   EXIT ;
"""


def test_interior_pass_issues_the_copies_and_skips_what_runs_only_sometimes():
    instructions, labels = sass.parse_sass(LOOP)
    # no copy wanted: the last tile's path, past the copy loop and the fix-up
    assert sass.interior_pass(instructions, labels, 1, 10, 0) == [1, 2, 6, 9, 10]
    # two copies: the inner loop twice, the fix-up still skipped
    assert sass.interior_pass(instructions, labels, 1, 10, 2) == [1, 2, 3, 4, 5, 3, 4, 5, 6, 9, 10]
    # the 16-bit load of the fix-up is no copy: only 16-byte reads of global memory are
    assert not sass._is_copy(instructions[7]) and sass._is_copy(instructions[3])
    with pytest.raises(ValueError, match="first, last must index"):
        sass.interior_pass(instructions, labels, 10, 1, 0)
    with pytest.raises(ValueError, match="copies must be"):
        sass.interior_pass(instructions, labels, 1, 10, -1)
    with pytest.raises(ValueError, match="no path from instruction 1 to 10 runs 1 copies"):
        sass.interior_pass(instructions, labels, 1, 10, 1, is_copy=lambda x: x.base == "EXIT")


def test_interior_pass_refuses_a_span_that_is_not_a_loop():
    instructions, labels = sass.parse_sass(LOOP)
    # 9 is the HMMA before the branch back, 6 a forward branch: neither goes back to the head
    for first, last in ((1, 9), (0, 10), (1, 6)):
        with pytest.raises(ValueError, match="does not branch back to"):
            sass.interior_pass(instructions, labels, first, last, 0)
    assert sass.interior_pass(instructions, labels, 3, 5, 1) == [3, 4, 5]             # the inner copy loop
    for first in (True, 1.0):
        with pytest.raises(TypeError, match="first must be an int"):
            sass.interior_pass(instructions, labels, first, 10, 0)


def test_every_opcode_lands_in_exactly_one_class():
    seen = [op for _, ops in sass.ISSUE_CLASSES for op in ops]
    assert len(seen) == len(set(seen))
    assert sass.issue_class("HMMA.16816.F32") == "tensor" and sass.issue_class("LDSM.16.MT88.4") == "shared loads"
    assert sass.issue_class("LDGSTS.E.BYPASS.128") == "copies" and sass.issue_class("MUFU.EX2") == "exponentials"
    assert sass.issue_class("BAR.SYNC.DEFER_BLOCKING") == "control and sync" and sass.issue_class("XYZ") == "other"
    with pytest.raises(TypeError, match="opcode must be a str"):
        sass.issue_class(3)


def _hand_counts(rung, d, arch="sm_90"):
    from lessons.gpu.compile import compile_kernel

    block_q, block_k = ladder.rung_tiles(rung, d)
    threads = compile_kernel(ladder.rung_build(rung, d), arch).resources[ladder.rung_entry(rung, d)].threads_per_block
    rows_per_warp = block_q // (threads // 32)
    return rows_per_warp * block_k * d // 1024, 2 * block_k * d * 2 // 16 // threads


def _unconstrained(rung, d, arch="sm_90"):
    """The test's own shortest pass through the key-tile loop (inner loops' branches back barred, no copy asked)
    and the loop's body size."""
    instructions, labels = sass.parse_sass(sass.disassemble(ladder.rung_build(rung, d), arch, ladder.rung_entry(rung, d)))
    n = len(instructions)
    loops = [(j, i) for i in range(n) for j in _successors(instructions, labels, i) if j <= i]
    hmma = [i for i, x in enumerate(instructions) if x.base == "HMMA"]
    around = [(h, b) for h, b in loops if h <= hmma[0] and b >= hmma[-1]]
    if rung == "mma_fa2_lean" and d == 64:      # two loops hold the HMMA, the unmasked one first: none holds all
        assert not around
        first, last = max(((h, b) for h, b in loops if h <= hmma[0] <= b), key=lambda hb: hb[1] - hb[0])
        assert last < hmma[-1]      # the masked loop's HMMA come after it
    else:
        first, last = min(around, key=lambda hb: hb[1] - hb[0])
    barred = {(b, h) for h, b in loops if (h, b) != (first, last)}
    return _shortest_pass(instructions, labels, first, last, lambda i: 1, {}, barred), last - first + 1


@needs_tools
@pytest.mark.parametrize("rung", sass.TENSOR_CORE_RUNGS)
@pytest.mark.parametrize("d", [64, 128])
def test_the_interior_pass_issues_every_hmma_and_copy_of_a_tile(rung, d):
    tile = sass.tensor_tile(rung, d)
    hmma, copies = _hand_counts(rung, d)
    assert (tile.hmma, tile.copies) == (hmma, copies)
    assert tile.counts["HMMA"] == hmma                              # e.g. mma_fa2, d = 128: 16 x 32 x 128 / 1024 = 64
    flag = int(rung == "mma_fa2_lean")                             # its 4-byte read of V's next tile flag
    assert tile.counts.get("LDGSTS", 0) + tile.counts.get("LDG", 0) == copies + flag
    shortest, body = _unconstrained(rung, d)
    print(f"\n{rung} d={d}: interior {tile.instructions}, unconstrained {shortest}, body {body}")
    assert shortest <= tile.instructions <= body == tile.body
    classes = tile.classes
    assert sum(classes.values()) == tile.instructions == sum(tile.counts.values())
    assert classes["tensor"] == hmma and classes["other"] <= 0.01 * tile.instructions
    assert tile.per_hmma == pytest.approx(tile.instructions / hmma)
    assert tile.peak_share == pytest.approx(min(1, 4 * hmma / tile.instructions)) and tile.peak_share < 1


def _interior(rung, d, arch="sm_90"):
    """The instructions of rung's interior pass (sass.tensor_tile's), in order."""
    tile = sass.tensor_tile(rung, d, arch)
    instructions, labels = sass.parse_sass(sass.disassemble(ladder.rung_build(rung, d), arch, ladder.rung_entry(rung, d)))
    first, last = sass._key_tile_loop(instructions, labels)
    path = [instructions[i] for i in sass.interior_pass(instructions, labels, first, last, tile.copies)]
    assert len(path) == tile.instructions
    return tile, path


def _masks(path):
    """What of a mask and of V's inf/NaN test a pass holds: scores set to -inf (FSEL ..., -INF), 16-bit exponent
    compares against inf's (0x7c00 for float16, 0x7f80 for bfloat16, alone or in a packed pair) and block-wide
    votes (BAR.RED)."""
    return dict(minus_inf=sum(x.base == "FSEL" and "-INF" in x.text for x in path),
                exponent=sum(x.base == "ISETP" and any(c in x.text for c in ("0x7c00", "0x7f80")) for x in path),
                bar_red=sum(x.opcode.startswith("BAR.RED") for x in path))


@needs_tools
@pytest.mark.parametrize("d", [64, 128])
def test_the_lean_rungs_interior_tiles_issue_fewer_instructions_and_no_mask(d):
    # the lean rung (tensor_tile reads its first loop, at d = 64 the unmasked one) against the wide rung it is built
    # on: the same HMMA and copies in fewer instructions, and none of the inf/NaN test's exponent compares or its
    # block-wide vote, which the wide rung's interior pass still issues; at d = 64 none of the mask's selects either
    # (at d = 128 one loop serves every tile, and ptxas predicates the selects there as in the wide rung)
    wide, wide_path = _interior("mma_fa2_wide", d)
    lean, lean_path = _interior("mma_fa2_lean", d)
    assert (lean.hmma, lean.copies, lean.block_q, lean.block_k) == (wide.hmma, wide.copies, wide.block_q, wide.block_k)
    assert lean.instructions < wide.instructions and lean.peak_share > wide.peak_share
    print(f"\nd={d}: wide {wide.instructions} ({wide.per_hmma:.2f} per HMMA, {wide.peak_share:.0%}), "
          f"lean {lean.instructions} ({lean.per_hmma:.2f}, {lean.peak_share:.0%})")
    seen = _masks(wide_path)
    assert seen["minus_inf"] > 0 and seen["exponent"] > 0 and seen["bar_red"] == 1, seen    # the patterns are found
    lean_seen = _masks(lean_path)
    assert lean_seen["exponent"] == 0 and lean_seen["bar_red"] == 0, lean_seen
    assert (lean_seen["minus_inf"] == 0) == (d == 64), lean_seen
    assert [x.opcode for x in lean_path if x.base == "BAR"] == ["BAR.SYNC.DEFER_BLOCKING"] * 2
    assert sum(x.base == "STS" for x in lean_path) == 0 < sum(x.base == "STS" for x in wide_path)   # no zero-fill


@needs_tools
def test_the_ceilings_are_above_what_the_h200_recorded():
    table = sass.tensor_tile_table()
    assert [(row["rung"], row["d"]) for row in table] == [(r, d) for r in sass.TENSOR_CORE_RUNGS for d in (64, 128)]
    ceiling = {(row["rung"], row["d"]): row["ceiling"] for row in table}
    for row in table:
        assert row["ceiling"] == pytest.approx(row["peak_share"] * H200.peak_flops["bf16"])
    checked = 0
    for r in sass.TENSOR_CORE_RUNGS:
        for rec in ladder.recorded_rows():
            if rec["impl"] == ladder.rung(r).impl and rec["tflops"] is not None and not rec["causal"]:
                assert rec["tflops"] < ceiling[r, rec["d"]] / 1e12, (r, rec)
                checked += 1
    assert checked >= 6                                             # mma, mma_async, mma_fa2 at d = 64 and 128
    markdown = sass.tensor_tile_markdown(table)
    assert markdown.count("\n") == len(table) + 1 and "| mma_fa2 | 128 | 64 x 32 (4) | 64 |" in markdown


def test_the_markdown_refuses_a_table_of_another_kind():
    for table in ([], "mma", {"rung": "mma"}, 3, [{"rung": "mma", "d": 64}],
                  [dict(rung="mma", d=64, block_q=64, block_k=64, warps=4, hmma=64, instructions=9, per_hmma=0.1,
                        classes=[1], peak_share=1.0, ceiling=1.0)]):
        with pytest.raises(TypeError, match="table must be a non-empty list of rows from tensor_tile_table"):
            sass.tensor_tile_markdown(table)


@needs_tools
def test_the_table_takes_a_rung_object_and_a_peak():
    (row,) = sass.tensor_tile_table(ladder.rung("mma_fa2"), (64,), peak_flops=2.0)
    assert row["rung"] == "mma_fa2" and row["ceiling"] == pytest.approx(2 * row["peak_share"])
    (a100,) = sass.tensor_tile_table("mma_fa2", (64,), arch="sm_80", peak_flops=312e12)
    assert a100["clocks"] == 8


def test_tensor_tile_refuses_what_it_cannot_count():
    with pytest.raises(ValueError, match="tensor-core \\(mma.sync\\) rung"):
        sass.tensor_tile("regtile", 64)
    with pytest.raises(ValueError, match="tensor-core \\(mma.sync\\) rung"):
        sass.tensor_tile("wgmma", 64)
    with pytest.raises(ValueError, match="rung must be one of"):
        sass.tensor_tile("nope", 64)
    with pytest.raises(ValueError, match="arch must be one of"):
        sass.tensor_tile("mma", 64, "sm_75")
    with pytest.raises(ValueError, match="arch must be one of"):
        sass.tensor_tile_table(arch="sm_90a")
    for arch in (["sm_90"], {"sm_90": 4}):
        with pytest.raises(ValueError, match="arch must be one of"):
            sass.tensor_tile("mma", 64, arch)
    with pytest.raises(ValueError, match="peak_flops must be given for arch 'sm_80'"):
        sass.tensor_tile_table(arch="sm_80")
    for peak in (0, math.inf, True):
        with pytest.raises(ValueError, match="peak_flops must be a positive finite number"):
            sass.tensor_tile_table(peak_flops=peak)
    with pytest.raises(ValueError, match="rungs must hold at least one rung"):
        sass.tensor_tile_table(())
    with pytest.raises(TypeError, match="rungs must be a rung"):
        sass.tensor_tile_table(None)
    with pytest.raises(TypeError, match="ds must be a sequence of ints"):
        sass.tensor_tile_table("mma", 64)


@pytest.mark.skipif(not gpu.nvrtc_available(), reason="CuPy/NVRTC not installed")
@pytest.mark.parametrize("d", [65, 8])
def test_tensor_tile_refuses_a_head_dim_the_kernel_cannot_take(d):
    with pytest.raises(ValueError, match="head_dim must be"):
        sass.tensor_tile("mma_fa2", d)


def _row(rung, d, hmma, classes, peak_share):
    return dict(rung=rung, d=d, hmma=hmma, instructions=sum(classes.values()), classes=classes, clocks=4,
                peak_share=peak_share, ceiling=peak_share * 989e12)


def test_hmma_slots_figure_stacks_the_classes_per_hmma_and_marks_the_peak():
    from matplotlib.text import Text

    from lessons.views.register_tiles import hmma_slots_figure

    table = [_row("mma", 64, 64, {"tensor": 64, "shared loads": 192, "other float": 320, "other": 0}, 0.44),
             _row("mma_fa2", 64, 64, {"tensor": 64, "shared loads": 46, "other float": 200, "other": 0}, 0.83),
             _row("mma_fa2", 128, 64, {"tensor": 64, "exponentials": 18, "integer and address": 150, "other": 2}, 1.0)]
    fig = hmma_slots_figure(table)
    ax = fig.axes[0]
    widths = sorted(round(p.get_width(), 6) for p in ax.patches)
    assert widths == sorted(round(v / 64, 6) for r in table for v in r["classes"].values() if v)
    ends = {}
    for p in ax.patches:
        y = round(p.get_y() + p.get_height() / 2, 6)
        ends[y] = max(ends.get(y, 0), p.get_x() + p.get_width())
    assert sorted(round(e, 6) for e in ends.values()) == sorted(round(r["instructions"] / 64, 6) for r in table)
    assert [line.get_xdata()[0] for line in ax.lines] == [4]                       # the tensor peak's line
    texts = [t.get_text() for t in ax.findobj(Text)]
    assert "at most 435 TFLOP/s (44%)" in texts and "at most 989 TFLOP/s (100%)" in texts
    assert [t.get_text() for t in ax.get_yticklabels()] == ["mma, d = 64", "mma_fa2, d = 64", "mma_fa2, d = 128"]
    assert "other" in [t.get_text() for t in ax.get_legend().get_texts()]            # drawn only where there is some
    with pytest.raises(TypeError, match="table must be a non-empty list"):
        hmma_slots_figure([])
    with pytest.raises(TypeError, match="each with rung, d, hmma"):
        hmma_slots_figure([{k: v for k, v in table[0].items() if k != "classes"}])
    with pytest.raises(ValueError, match="the classes of mma at d=64 must be a dict that sums"):
        hmma_slots_figure([dict(table[0], instructions=1)])
    with pytest.raises(ValueError, match="hmma of mma at d=64 must be an int above 0"):
        hmma_slots_figure([dict(table[0], hmma=0)])
    with pytest.raises(ValueError, match="same clocks per HMMA"):
        hmma_slots_figure([table[0], dict(table[1], clocks=8)])


@needs_tools
def test_the_quiz_quotes_the_lean_and_wide_counts():
    from lessons.course.quiz import QUIZZES
    from lessons.gpu.compile import nvrtc_version

    if nvrtc_version()[:2] != (12, 9):
        pytest.skip("the quiz quotes NVRTC 12.9's SASS")
    question = next(q for q in QUIZZES["06_kernel_ladder"] if q.question.startswith("On an interior key tile"))
    wide, lean = (sass.tensor_tile(r, 64) for r in ("mma_fa2_wide", "mma_fa2_lean"))
    assert wide.hmma == lean.hmma == 128 and wide.clocks == 4
    assert (f"the wide rung issues {wide.instructions} instructions for its {wide.hmma} HMMA; the lean build issues "
            f"{lean.instructions} for the same {lean.hmma}") in question.question.replace("a warp of the wide", "the wide")
    right = question.choices[question.answer]
    assert (f"4 x 128 / {wide.instructions} = {wide.peak_share:.0%} to 4 x 128 / {lean.instructions} = "
            f"{lean.peak_share:.0%}") in right
    assert f"{wide.instructions} / {lean.instructions} = {wide.instructions / lean.instructions:.2f}x" in \
        question.choices[0]
    blocks = 8192 // ladder.rung_tiles("mma_fa2_lean", 64)[0]
    assert f"the {blocks} reads of K and V" in question.explanation and 1 / (2 * blocks) < 0.01


def test_hmma_slots_figure_keeps_the_peaks_line_in_view_below_it():
    # a table whose rungs all issue fewer instructions per HMMA than the peak's clocks (the lean rung at d = 64 on
    # sm_80: 709 per 128 HMMA against 8 clocks): the dashed line at the clocks is still inside the axes
    from lessons.views.register_tiles import hmma_slots_figure

    rows = [dict(_row("mma_fa2_lean", 64, 128, {"tensor": 128, "other float": 300, "other": 0}, 1.0), clocks=8),
            dict(_row("mma_fa2_wide", 64, 128, {"tensor": 128, "other float": 500, "other": 0}, 1.0), clocks=8)]
    ax = hmma_slots_figure(rows).axes[0]
    assert [line.get_xdata()[0] for line in ax.lines] == [8]
    assert ax.get_xlim()[1] > 8
