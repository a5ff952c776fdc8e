"""lessons.gpu.sass: SASS read from the rungs' cubins, innermost loops, and the issue-slot ceiling."""
import math
import re

import numpy as np
import pytest

import lessons.gpu as gpu
from lessons.gpu import sass, source
from lessons.cost.register_tiles import register_tile
from lessons.cost.traffic import H200

needs_tools = pytest.mark.skipif(not (gpu.nvrtc_available() and sass.nvdisasm_available()),
                                 reason="CuPy/NVRTC or nvdisasm not installed")

# two nested loops: the inner one (.L_x_1) is 5 instructions, 2 of them FFMA; the outer one holds it
NESTED = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDS.128 R4, [R2] ;
.L_x_1:
        /*0020*/                   LDS R8, [R3] ;
        /*0030*/                   FFMA R9, R4, R8, R9 ;
        /*0040*/                   FFMA R10, R5, R8, R10 ;
        /*0050*/                   ISETP.NE.AND P0, PT, R3, R11, PT ;
        /*0060*/               @P0 BRA `(.L_x_1) ;
        /*0070*/                   MUFU.EX2 R12, R9 ;
        /*0080*/              @!P1 BRA `(.L_x_0) ;
        /*0090*/                   BRA `(.L_x_2) ;
.L_x_2:
        /*00a0*/                   EXIT ;
"""


def test_parse_sass_reads_offsets_opcodes_predicates_and_labels():
    instructions, labels = sass.parse_sass(NESTED)
    assert [i.offset for i in instructions] == list(range(0, 0xb0, 0x10))
    assert instructions[1].opcode == "LDS.128" and instructions[1].base == "LDS"
    assert instructions[6].predicate == "@P0" and instructions[8].predicate == "@!P1"
    assert instructions[7].opcode == "MUFU.EX2" and instructions[0].predicate is None
    assert labels == {".L_x_0": 1, ".L_x_1": 2, ".L_x_2": 10}


def test_inner_loops_keep_the_innermost_and_skip_forward_branches():
    (loop,) = sass.inner_loops(NESTED)
    assert [i.offset for i in loop.instructions] == [0x20, 0x30, 0x40, 0x50, 0x60]
    assert loop.size == 5 and loop.ffma == 2 and loop.ffma_share == 2 / 5
    assert loop.loads == {"LDS": 1} and loop.shared_loads == 1


def test_tile_share_combines_the_two_products_by_their_equal_fma_counts():
    # S at share 1/2 and P V at 1/4: F FMAs take 2F and 4F slots, so 2F FMAs in 6F slots
    half = sass.Loop(sass.parse_sass("/*00*/ FFMA R1, R2, R3, R1 ;\n/*10*/ LDS R2, [R4] ;")[0])
    quarter = sass.Loop(sass.parse_sass("/*00*/ FFMA R1, R2, R3, R1 ;\n/*10*/ LDS R2, [R4] ;\n"
                                        "/*20*/ IADD3 R4, R4, 0x4, RZ ;\n/*30*/ BRA `(.L_x_0) ;")[0])
    assert sass.tile_share(half, quarter) == pytest.approx(1 / 3)
    with pytest.raises(TypeError, match="pv_loop must be a Loop"):
        sass.tile_share(half, 0.25)
    no_fma = sass.Loop(sass.parse_sass("/*00*/ LDS R2, [R4] ;")[0])
    with pytest.raises(ValueError, match="s_loop holds no FFMA"):
        sass.tile_share(no_fma, half)


def test_parse_sass_refuses_what_is_not_sass():
    with pytest.raises(TypeError, match="text must be SASS text"):
        sass.parse_sass(b"FFMA")
    with pytest.raises(ValueError, match="holds no SASS instruction"):
        sass.parse_sass("// only a comment\n")


def test_find_nvdisasm_is_none_and_disassemble_says_how_to_install_without_one(monkeypatch, tmp_path):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv("PATH", str(tmp_path))
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(sass.Path, "is_file", lambda self: False)
    assert sass.find_nvdisasm() is None and not sass.nvdisasm_available()
    with pytest.raises(FileNotFoundError, match="pip install nvidia-cuda-nvdisasm"):
        sass.disassemble(source.flash_attention_build(64, "float32"))


@needs_tools
def test_disassemble_names_the_entry_points_a_build_has():
    build = source.flash_attention_build(64, "float32")
    text = sass.disassemble(build)
    instructions, _ = sass.parse_sass(text)
    assert instructions[-1].base in ("BRA", "EXIT", "NOP") and any(i.base == "FFMA" for i in instructions)
    with pytest.raises(ValueError, match="entry must be one of"):
        sass.disassemble(build, entry="no_such_kernel")


@needs_tools
@pytest.mark.parametrize("d", [64, 128])
def test_the_scalar_rung_issues_a_shared_load_for_every_fma(d):
    # the model of the rung: each FMA of S = Q K^T reads k_s[j][c] from shared memory, 4 bytes at a time
    loops = sass.fma_loops("scalar", d)
    assert len(loops) == 2
    s_loop = loops[0]
    assert set(s_loop.loads) == {"LDS"} and s_loop.shared_loads >= s_loop.ffma
    assert s_loop.ffma_share < 0.5                      # so the FP32 lanes idle at least half the time


@needs_tools
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_register_tiled_s_loop_loads_what_the_register_tile_model_counts(d, wide):
    config = source.flash_attention_regtile_wide_config if wide else source.flash_attention_regtile_config
    model = register_tile(d, *config(d), wide=wide)
    loops = sass.fma_loops("regtile_wide" if wide else "regtile", d)
    assert len(loops) == 3                              # S, P V guarding inf/NaN in V, P V
    s_loop, guarded, pv_loop = loops
    assert sass.product_loops("regtile_wide" if wide else "regtile", d) == (s_loop, pv_loop)
    # every load of S is 16 bytes wide, as many as the model counts (NVRTC 12.9 now and then splits one
    # 4-byte load off a 16-byte one in the wide build, so only the 16-byte ones are held to the model)
    assert s_loop.loads.get("LDS.128", 0) / s_loop.ffma == pytest.approx(model.s_loads_per_fma)
    assert s_loop.shared_loads <= s_loop.loads["LDS.128"] + 1
    # the guard compares each probability before it multiplies (FSETP); the two other loops never do
    assert guarded.counts["FSETP"] > 0 and s_loop.counts["FSETP"] == 0 and pv_loop.counts["FSETP"] == 0
    # P V: ptxas may merge the plain build's 4-byte P loads into wider ones, never split the model's
    if wide:
        assert pv_loop.loads.get("LDS.128", 0) / pv_loop.ffma == pytest.approx(model.pv_loads_per_fma)
        assert pv_loop.shared_loads <= pv_loop.loads["LDS.128"] + 1
    else:
        assert pv_loop.shared_loads / pv_loop.ffma <= model.pv_loads_per_fma


@needs_tools
def test_the_ceiling_rises_rung_by_rung_and_is_share_times_the_fp32_peak():
    table = sass.fma_loop_table()
    assert [(row["rung"], row["d"]) for row in table] == [(r, d) for r in sass.CUDA_CORE_RUNGS for d in (64, 128)]
    for row in table:
        share = 2 / (row["s_instructions"] / row["s_ffma"] + row["pv_instructions"] / row["pv_ffma"])
        assert row["share"] == pytest.approx(share)
        assert row["ceiling"] == pytest.approx(share * H200.peak_flops["fp32"])
    for d in (64, 128):
        ceilings = [row["ceiling"] for row in table if row["d"] == d]
        assert ceilings == sorted(ceilings) and ceilings[0] < 0.5 * 67e12 < ceilings[1]
    assert sass.fma_loop_table("scalar", (64,), peak_flops=1.0)[0]["ceiling"] == table[0]["share"]


@needs_tools
@pytest.mark.parametrize("rung", ["scalar", "regtile"])
def test_the_table_refuses_a_head_dim_whose_s_loop_ptxas_unrolled(rung):
    # at d = 4 the S loop runs 4 times (scalar: one key column a time) or once (regtile: 16 bytes a time), and
    # ptxas unrolls it whole: the first FFMA loop left compares p (FSETP), so it is a P V, not S = Q K^T
    loops = sass.fma_loops(rung, 4)
    assert loops and loops[0].counts["FSETP"] > 0
    with pytest.raises(ValueError, match=f"FFMA loops of {rung} at d=4 \\(sm_90\\) are not S = Q K"):
        sass.product_loops(rung, 4)
    with pytest.raises(ValueError, match="take a larger d"):
        sass.fma_loop_table(rung, (4,))


def test_fma_loops_and_the_table_refuse_what_they_cannot_read():
    with pytest.raises(ValueError, match="CUDA-core rung"):
        sass.fma_loops("mma_fa2", 64)
    with pytest.raises(ValueError, match="rung must be one of"):
        sass.fma_loops("nope", 64)
    with pytest.raises(ValueError, match="peak_flops must be a positive finite number"):
        sass.fma_loop_table(peak_flops=0)
    with pytest.raises(ValueError, match="peak_flops must be a positive finite number"):
        sass.fma_loop_table(peak_flops=True)
    for peak in (math.inf, math.nan, -np.float32(1)):
        with pytest.raises(ValueError, match="peak_flops must be a positive finite number"):
            sass.fma_loop_table(peak_flops=peak)
    with pytest.raises(TypeError, match="ds must be a sequence of ints"):
        sass.fma_loop_table("scalar", 64)
    with pytest.raises(ValueError, match="ds must hold at least one int"):
        sass.fma_loop_table("scalar", ())
    with pytest.raises(ValueError, match="rungs must hold at least one rung"):
        sass.fma_loop_table(())
    with pytest.raises(TypeError, match="rungs must be a rung, its name or a sequence"):
        sass.fma_loop_table(None)


@needs_tools
def test_the_table_takes_a_rung_object_numpy_head_dims_and_a_numpy_peak():
    from lessons.gpu import ladder

    (by_name,) = sass.fma_loop_table("scalar", (64,))
    (row,) = sass.fma_loop_table(ladder.rung("scalar"), np.array([64]), peak_flops=np.float32(2.0))
    assert row["rung"] == "scalar" and row["d"] == 64 and type(row["d"]) is int
    assert row["share"] == by_name["share"] and row["ceiling"] == pytest.approx(2 * by_name["share"])


def test_issue_ceiling_figure_draws_each_ceiling_the_targets_and_the_measured_points():
    import matplotlib.pyplot as plt
    from matplotlib.collections import LineCollection

    from lessons.views.register_tiles import issue_ceiling_figure

    table = [dict(rung=r, d=d, share=s, ceiling=s * 67e12)
             for d in (64, 128) for r, s in (("scalar", 0.4), ("regtile", 0.7))]
    fig = issue_ceiling_figure(table, peak_flops=67e12, needs={64: 27.5, 128: 47.9},
                               measured={"scalar": {64: 12.7, 128: None}}, needs_label="3x naive")
    ax = fig.axes[0]
    heights = sorted(round(p.get_height(), 6) for p in ax.patches)
    assert heights == sorted(round(r["ceiling"] / 1e12, 6) for r in table)
    plt.close(fig)
    # rows with a whole tile's ceiling: a solid bar to it and a pale one to the loops' ceiling
    tiles = [dict(row, tile_share=row["share"] / 2, tile_ceiling=row["ceiling"] / 2) for row in table]
    fig = issue_ceiling_figure(tiles, peak_flops=67e12)
    pale = sorted(round(p.get_height(), 6) for p in fig.axes[0].patches if p.get_alpha() == 0.3)
    solid = sorted(round(p.get_height(), 6) for p in fig.axes[0].patches if p.get_alpha() is None)
    assert pale == sorted(round(r["ceiling"] / 1e12, 6) for r in table)
    assert solid == sorted(round(r["ceiling"] / 2e12, 6) for r in table)
    assert "pale: the product loops alone" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    with pytest.raises(ValueError, match="tile_ceiling of scalar at d=64 is above its ceiling"):
        issue_ceiling_figure([dict(table[0], tile_share=0.5, tile_ceiling=table[0]["ceiling"] * 1.5)], peak_flops=67e12)
    plt.close(fig)
    fig = issue_ceiling_figure(table, peak_flops=67e12, needs={64: 27.5, 128: 47.9},
                               measured={"scalar": {64: 12.7, 128: None}}, needs_label="3x naive")
    ax = fig.axes[0]
    diamonds = [line for line in ax.lines if line.get_marker() == "D"]
    assert [tuple(line.get_ydata()) for line in diamonds] == [(12.7,)]            # None is not drawn
    targets = [c for c in ax.collections if isinstance(c, LineCollection)]
    assert sorted(seg[0][1] for c in targets for seg in c.get_segments()) == [27.5, 47.9]
    labels = ax.get_legend_handles_labels()[1]
    assert labels.count("3x naive") == 1 and labels.count("measured") == 1 and "scalar" in labels
    plt.close(fig)
    with pytest.raises(TypeError, match="table must be a non-empty list"):
        issue_ceiling_figure([], peak_flops=67e12)
    with pytest.raises(ValueError, match="peak_flops must be a positive finite number"):
        issue_ceiling_figure(table, peak_flops=-1)
    with pytest.raises(ValueError, match="peak_flops must be a positive finite number"):
        issue_ceiling_figure(table, peak_flops=math.inf)
    plt.close(issue_ceiling_figure(table, peak_flops=np.float32(67e12)))
    # a ceiling above the peak would be cut off at the axis' top (1.12 x peak): a table made for another peak
    top = max(r["ceiling"] for r in table)
    with pytest.raises(ValueError, match="the ceiling of regtile at d=64 must be a number of FLOP/s in 0..peak"):
        issue_ceiling_figure(table, peak_flops=0.9 * top)
    for key in ("rung", "d", "share"):
        with pytest.raises(TypeError, match="each with rung, d, share, ceiling"):
            issue_ceiling_figure([{k: v for k, v in row.items() if k != key} for row in table], peak_flops=67e12)
    with pytest.raises(TypeError, match="needs must be a dict"):
        issue_ceiling_figure(table, peak_flops=67e12, needs=[27.5, 47.9])
    with pytest.raises(TypeError, match="measured must map each rung to a dict"):
        issue_ceiling_figure(table, peak_flops=67e12, measured={"scalar": 12.7})


def test_fma_loop_markdown_writes_each_loop_and_its_loads_in_bytes():
    row = dict(rung="regtile", d=64, s_instructions=86, s_ffma=64, s_loads={"LDS.128": 8}, pv_instructions=82,
               pv_ffma=64, pv_loads={"LDS.64": 4, "LDS.128": 4}, share=128 / 168, ceiling=128 / 168 * 67e12,
               tile_overhead=317, tile_instructions=3005, tile_share=2048 / 3005, tile_ceiling=2048 / 3005 * 67e12)
    lines = sass.fma_loop_markdown([row]).splitlines()
    assert len(lines) == 3
    assert lines[2] == ("| regtile | 64 | 64 / 86 | 8 x 16 B | 64 / 82 | 4 x 16 B + 4 x 8 B | 76% | 51.0 | 317 of 3005 | "
                        "68% | 45.7 |")


# the PTX instruction each rung's SASS opcode comes from, one for one (the scalar rung's FFMA.FTZ is left out:
# ptxas adds FFMAs of its own when it expands expf)
PTX_OF_OPCODE = {"regtile": "ld.shared.v4.f32", "regtile_wide": "ld.shared.v4.f32",
                 "mma": "mma.sync.aligned.m16n8k16", "mma_async": "ldmatrix.sync.aligned.m8n8.x2.trans",
                 "mma_fa2": "ldmatrix.sync.aligned.m8n8.x4.trans", "mma_fa2_lazy": "vote.sync.any.pred",
                 "mma_fa2_wide": "mma.sync.aligned.m16n8k16", "mma_fa2_lean": "ld.global.nc.u32",
                 "wgmma": "wgmma.mma_async.sync.aligned",
                 "wgmma_overlap": "wgmma.wait_group.sync.aligned", "wgmma_pingpong": "bar.arrive"}


@needs_tools
@pytest.mark.parametrize("d", [64, 128])
def test_each_rungs_change_is_in_its_sass_as_often_as_in_its_ptx(d):
    from lessons.gpu import ladder
    from lessons.gpu.compile import compile_ptx, entry_ptx

    rows = sass.rung_opcodes(d)
    assert [row["name"] for row in rows] == [r.name for r in ladder.RUNGS if r.kernel is not None]
    for row in rows:
        assert row["count"] > 0, row
        assert row["arch"] == ("sm_90a" if row["name"] in ladder.HOPPER_RUNGS else "sm_90")
        if row["name"] in PTX_OF_OPCODE:
            build = ladder.rung_build(row["name"], d)
            ptx = entry_ptx(compile_ptx(build, row["arch"]), ladder.rung_entry(row["name"], d))
            assert row["count"] == ptx.count(PTX_OF_OPCODE[row["name"]]), row


def test_tools_missing_names_each_missing_tool_and_how_to_install_it(monkeypatch):
    import lessons.gpu.compile as compile_module

    monkeypatch.setattr(compile_module, "nvrtc_available", lambda: False)
    monkeypatch.setattr(sass, "find_nvdisasm", lambda: None)
    both = sass.tools_missing()
    assert "CuPy/NVRTC" in both and "pip install nvidia-cuda-nvdisasm" in both
    monkeypatch.setattr(sass, "find_nvdisasm", lambda: "/usr/bin/nvdisasm")
    only_nvrtc = sass.tools_missing()
    assert "CuPy/NVRTC" in only_nvrtc and "pip install nvidia-cuda-nvdisasm" not in only_nvrtc
    monkeypatch.setattr(compile_module, "nvrtc_available", lambda: True)
    assert sass.tools_missing() is None


@needs_tools
def test_the_wide_rungs_text_quotes_the_ffma_share_of_its_loops():
    import re

    from lessons.gpu import ladder
    from lessons.gpu.compile import nvrtc_version

    if nvrtc_version()[:2] != (12, 9):
        pytest.skip("the rung's text quotes NVRTC 12.9's SASS")
    text = ladder.rung("regtile_wide").predicted
    quoted = re.search(r"loops are (\d+)-(\d+)% FFMA \(lessons\.gpu\.sass; the plain build's (\d+)-(\d+)%\)", text)
    shares = {r: sorted(round(100 * row["share"]) for row in sass.fma_loop_table(r)) for r in ("regtile_wide", "regtile")}
    assert [int(x) for x in quoted.groups()] == shares["regtile_wide"] + shares["regtile"]


# a loop (.L_x_0 .. the branch at 0x90) with an if/else inside and an early way out: only the blocks on every
# path from its head to its branch back run on every pass
DIAMOND = """
.L_x_0:
        /*0000*/                   FFMA R1, R2, R3, R1 ;
        /*0010*/               @P0 BRA `(.L_x_1) ;
        /*0020*/                   FADD R4, R4, R5 ;
        /*0030*/                   BRA `(.L_x_2) ;
.L_x_1:
        /*0040*/                   FMUL R4, R4, R5 ;
        /*0050*/                   FMUL R4, R4, R6 ;
.L_x_2:
        /*0060*/                   IADD3 R7, R7, 0x1, RZ ;
        /*0070*/               @P1 BRA.DIV UR4, `(.L_x_3) ;
        /*0080*/                   ISETP.NE.AND P2, PT, R7, R8, PT ;
        /*0090*/               @P2 BRA `(.L_x_0) ;
        /*00a0*/                   EXIT ;
.L_x_3:
        /*00b0*/                   BRA `(.L_x_2) ;
"""


def test_every_pass_keeps_the_blocks_on_every_path_through_the_loop():
    instructions, labels = sass.parse_sass(DIAMOND)
    passes = sass.every_pass(instructions, labels, 0, 9)
    # the head (FFMA, its branch) and the join (IADD3, BRA.DIV, ISETP, the branch back); not the if or the else
    assert [instructions[i].offset for i in passes] == [0x00, 0x10, 0x60, 0x70, 0x80, 0x90]
    with pytest.raises(ValueError, match="first, last must index instructions"):
        sass.every_pass(instructions, labels, 9, 0)


# sm_80's way out of a loop: a predicated CALL.REL.NOINC to the label just past the loop's unconditional branch back
CALL_EXIT = """
.L_x_0:
        /*0000*/                   MOV R7, RZ ;
.L_x_1:
        /*0010*/                   FFMA R1, R2, R3, R1 ;
        /*0020*/                   IADD3 R7, R7, 0x1, RZ ;
        /*0030*/                   ISETP.NE.AND P1, PT, R7, 0x10, PT ;
        /*0040*/              @!P1 CALL.REL.NOINC `(.L_x_2) ;
        /*0050*/                   BRA `(.L_x_1) ;
.L_x_2:
        /*0060*/                   MUFU.EX2 R4, R4 ;
        /*0070*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0080*/               @P2 BRA `(.L_x_0) ;
        /*0090*/                   EXIT ;
"""


def test_every_pass_follows_a_call_that_leaves_an_inner_loop():
    instructions, labels = sass.parse_sass(CALL_EXIT)
    passes = sass.every_pass(instructions, labels, 0, 8)
    # all but the inner loop's branch back, which the pass that leaves it does not issue
    assert [instructions[i].offset for i in passes] == [0x00, 0x10, 0x20, 0x30, 0x40, 0x60, 0x70, 0x80]


@needs_tools
@pytest.mark.parametrize("rung", sass.CUDA_CORE_RUNGS)
@pytest.mark.parametrize("d", [64, 128])
def test_a_key_tile_runs_each_products_fmas_and_never_allows_more_than_its_loops(rung, d):
    config = {"scalar": source.flash_attention_config, "regtile": source.flash_attention_regtile_config,
              "regtile_wide": source.flash_attention_regtile_wide_config}[rung]
    block_q, block_k = config(d)
    tile = sass.key_tile(rung, d)
    fmas = block_q * block_k * d // 128                  # per thread, each product: the kernels run 128 threads
    assert tile.s_trips * tile.s_loop.ffma == fmas == tile.pv_trips * tile.pv_loop.ffma
    assert tile.product_ffma == 2 * fmas
    assert tile.instructions == tile.overhead + tile.s_trips * tile.s_loop.size + tile.pv_trips * tile.pv_loop.size
    assert 0 < tile.overhead and tile.share < sass.tile_share(tile.s_loop, tile.pv_loop)


# ---- an independent check of key_tile: the shortest path through the key-tile loop's own control-flow graph ----

_TARGET_OF = re.compile(r"`\(([^)]+)\)")
_BRANCHES = ("BRA", "BRX", "JMP", "JMX", "CALL")


def _successors(instructions, labels, i):
    """Where control may go after instruction i: a branch's (or CALL.REL's) label, and the next instruction
    unless the instruction is an unconditional BRA / JMP / EXIT / RET. A branch with a predicate (``@P0``, not
    ``@PT``), a predicate operand (``BRA P1, ...``, ``BRA.U !UP0, ...``) or ``.DIV`` may fall through; CALL
    always may (a call returns; CALL.REL.NOINC to a label is ptxas' predicated loop exit)."""
    x = instructions[i]
    out = set()
    target = _TARGET_OF.search(x.text)
    if x.base in _BRANCHES:
        assert x.base not in ("BRX", "JMX"), f"an indirect branch at {x.offset:#x}: {x.text}"
        if target and target.group(1) in labels:
            out.add(labels[target.group(1)])
    conditional = x.predicate not in (None, "@PT")
    operands = x.text.split(None, 1)[1] if " " in x.text else ""
    if x.base in ("BRA", "JMP"):
        ends = not conditional and ".DIV" not in x.opcode and operands.startswith("`")
    else:
        ends = x.base in ("EXIT", "RET", "KILL") and not conditional
    if not ends and i + 1 < len(instructions):
        out.add(i + 1)
    return out


def _shortest_pass(instructions, labels, first, last, cost, skip_to, barred=()):
    """Fewest instructions from ``first`` to ``last`` (both counted), each instruction i costing cost(i), where
    reaching a product loop's head h jumps to skip_to[h] (the loop costs cost(h)), no edge leads back to
    ``first`` (that is the next pass) and the edges in ``barred`` (inner loops' branches back) are not taken."""
    import heapq

    best = {first: cost(first)}
    heap = [(cost(first), first)]
    while heap:
        dist, i = heapq.heappop(heap)
        if i == last:
            return dist
        if dist > best.get(i, math.inf):
            continue
        nexts = {skip_to[i]} if i in skip_to else _successors(instructions, labels, i)
        for j in nexts:
            if j == first or (i, j) in barred:
                continue
            if dist + cost(j) < best.get(j, math.inf):
                best[j] = dist + cost(j)
                heapq.heappush(heap, (best[j], j))
    return math.inf


def _counter_trips(instructions, head, back):
    """Passes of a counted loop [head, back], read from its induction variable: the compare that sets the
    predicate of its branch back (or of its exit), the counter's step inside the loop and its start, the
    last write before the head. None where the pattern is not this one."""
    body = instructions[head:back + 1]
    compares = [re.match(r"ISETP\.(NE|GE\.U32|GE)\.AND (P\d), PT, (R\d+), (0x[0-9a-f]+|\d+), PT", x.text)
                for x in body if x.base == "ISETP"]
    compares = [m for m in compares if m]
    if len(compares) != 1:
        return None
    _, _, counter, bound = compares[0].groups()
    steps = [re.match(rf"(?:IADD3|VIADD) {counter}, {counter}, (0x[0-9a-f]+|\d+)", x.text) for x in body]
    steps = [int(m.group(1), 0) for m in steps if m]
    start = None
    for x in reversed(instructions[:head]):
        if re.match(rf"\S+ {counter}\b,", x.text):
            zero = re.match(rf"(?:MOV {counter}, RZ|IMAD\.MOV\.U32 {counter}, RZ, RZ, RZ|HFMA2\.MMA {counter}, -RZ, RZ, 0, 0|"
                            rf"CS2R {counter}, SRZ)$", x.text)
            start = 0 if zero else None
            break
    if len(steps) != 1 or start is None:
        return None
    return -(-(int(bound, 0) - start) // steps[0])


def _tile_paths(rung, d, arch):
    """(KeyTile, {"path": the shortest pass with each product loop at trips x size, "skip": the same with each
    product loop at trips x its own shortest pass, "exit": the fewest instructions from the head to leaving the
    loop (the last tile)}, {loop head: (trips, size, shortest pass, counter trips)}) for one build."""
    from lessons.gpu import ladder
    from lessons.gpu.compile import compile_kernel

    tile = sass.key_tile(rung, d, arch)
    build, entry = ladder.rung_build(rung, d), ladder.rung_entry(rung, d)
    instructions, labels = sass.parse_sass(sass.disassemble(build, arch, entry))
    n = len(instructions)
    back_edges = [(i, j) for i in range(n) for j in _successors(instructions, labels, i) if j <= i]
    loops = [(j, i) for i, j in back_edges]                       # (head, branch back)
    innermost = [(h, b) for h, b in loops if not any(h <= h2 and b2 <= b and (h2, b2) != (h, b) for h2, b2 in loops)]
    products = [(h, b) for h, b in innermost if any(x.base == "FFMA" for x in instructions[h:b + 1])]
    first, last = min(((h, b) for h, b in loops if h <= products[0][0] and b >= products[-1][1]
                       and (h, b) not in products), key=lambda hb: hb[1] - hb[0])
    products = [(h, b) for h, b in products if first < h and b < last]
    block_q, block_k = getattr(source, {"scalar": "flash_attention_config", "regtile": "flash_attention_regtile_config",
                                "regtile_wide": "flash_attention_regtile_wide_config"}[rung])(d)
    fmas = block_q * block_k * d // compile_kernel(build, arch).resources[entry].threads_per_block
    info, skip_to = {}, {}
    for h, b in products:
        inside = set(range(h, b + 1))
        # entered only at its head, and left for one place only (after its branch back, or past the other P V)
        for i in range(n):
            for j in _successors(instructions, labels, i):
                assert not (i not in inside and j in inside and j != h), f"{rung} d={d} {arch}: {i} enters loop {h}..{b} at {j}"
        (out,) = {j for i in inside for j in _successors(instructions, labels, i) if j not in inside}
        ffma = sum(1 for x in instructions[h:b + 1] if x.base == "FFMA")
        assert fmas % ffma == 0, (rung, d, arch, h, ffma)
        one = _shortest_pass(instructions, labels, h, b, lambda i: 1, {}, {(b, h)})
        info[h] = (fmas // ffma, b - h + 1, one, _counter_trips(instructions, h, b))
        skip_to[h] = out
    barred = {(b, h) for h, b in loops if (h, b) != (first, last)}
    paths = {}
    for name, per_pass in (("path", 1), ("skip", 2)):
        cost = lambda i, k=per_pass: info[i][0] * info[i][k] if i in info else 1
        paths[name] = _shortest_pass(instructions, labels, first, last, cost, skip_to, barred)
    # the last tile: from the head to the first instruction outside the loop (not counted)
    exits = {j for i in range(first, last + 1) for j in _successors(instructions, labels, i)
             if not first <= j <= last} - {first}
    cost = lambda i: info[i][0] * info[i][1] if i in info else (0 if i in exits else 1)
    paths["exit"] = min(_shortest_pass(instructions, labels, first, e, cost, skip_to, barred) for e in exits)
    return tile, paths, info


@needs_tools
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("rung", sass.CUDA_CORE_RUNGS)
@pytest.mark.parametrize("d", [64, 128])
def test_key_tile_never_counts_more_than_the_shortest_pass_through_its_loop(rung, d, arch):
    tile, paths, info = _tile_paths(rung, d, arch)
    print(f"\n{rung} d={d} {arch}: key_tile {tile.instructions} (overhead {tile.overhead}), shortest pass "
          f"{paths['path']} (slack {paths['path'] - tile.instructions}), last tile {paths['exit']}, "
          f"loops {info}")
    # the product loops: key_tile's two are among them with the same passes, and each loop's counter agrees
    # with the passes its FFMA count gives (no FMAs peeled out of a loop)
    assert {(tile.s_trips, tile.s_loop.size), (tile.pv_trips, tile.pv_loop.size)} <= {v[:2] for v in info.values()}
    assert [v[3] for v in info.values()] == [v[0] for v in info.values()]
    assert tile.instructions <= paths["path"]
    # and it misses little: the shortest pass holds only a few instructions that are not on every pass
    assert paths["path"] - tile.instructions <= 0.01 * tile.instructions
    # the last tile leaves the loop before an unconditional branch back (sm_80) or at the branch (sm_90)
    assert tile.instructions - 1 <= paths["exit"]
    # inside a product loop every instruction issues on every pass, but for the scalar rung's P V, which skips
    # a key whose p is 0 (a masked key): key_tile counts a tile whose p are all nonzero
    shortcuts = [(trips, size, one) for trips, size, one, _ in info.values() if one < size]
    if rung == "scalar":
        assert len(shortcuts) == 1 and shortcuts[0][:2] == (tile.pv_trips, tile.pv_loop.size)
        assert paths["skip"] < tile.instructions
    else:
        assert shortcuts == [] and paths["skip"] == paths["path"]


@needs_tools
def test_the_quiz_quotes_the_sass_counts():
    from lessons.course.quiz import QUIZZES
    from lessons.gpu.compile import nvrtc_version

    if nvrtc_version()[:2] != (12, 9):
        pytest.skip("the quiz quotes NVRTC 12.9's SASS")
    question = next(q for q in QUIZZES["06_kernel_ladder"] if q.question.startswith("In SASS"))
    s_loop = sass.fma_loops("scalar", 64)[0]
    others = s_loop.size - s_loop.ffma - s_loop.shared_loads
    assert (f"{s_loop.size} instructions: {s_loop.ffma} FFMA, {s_loop.shared_loads} shared loads and {others} others"
            in question.question)
    assert f"{s_loop.ffma} / {s_loop.size} = {s_loop.ffma_share:.0%}" in question.choices[question.answer]
    share = {row["rung"]: row["share"] for row in sass.fma_loop_table(("regtile", "regtile_wide"), (64,))}
    assert f"{share['regtile']:.0%} in the plain build at d = 64, {share['regtile_wide']:.0%} in the wide one" in \
        question.explanation


def test_fma_loop_markdown_refuses_a_table_of_another_kind():
    row = dict(rung="regtile", d=64, s_ffma=32, s_instructions=40, s_loads={"LDS.128": 3}, pv_ffma=32, pv_instructions=40,
               pv_loads={"LDS.128": 3}, share=0.8, ceiling=5e13, tile_overhead=100, tile_instructions=1000, tile_share=0.7,
               tile_ceiling=4.7e13)
    assert "| regtile | 64 | 32 / 40 | 3 x 16 B |" in sass.fma_loop_markdown([row])
    for table in ([], "regtile", {"rung": "regtile"}, 3, [{"rung": "regtile", "d": 64}], [dict(row, s_loads=[3])]):
        with pytest.raises(TypeError, match="table must be a non-empty list of rows from fma_loop_table"):
            sass.fma_loop_markdown(table)


# what ncu --metrics prints for one profiled launch (the layout of Nsight Compute's text report)
NCU_REPORT = """==PROF== Connected to process 4242 (/usr/bin/python3.12)
==PROF== Profiling "flash_attention_regtile_wide" - 0: 0%....50%....100% - 3 passes
ran regtile_wide (flash_attention_regtile_wide) twice on cupy; output finite: True
==PROF== Disconnected from process 4242
[4242] python3.12@127.0.0.1
  flash_attention_regtile_wide (128, 8, 1)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: Command line profiler metrics
    ----------------------------------------------------- ----------- -------------
    Metric Name                                           Metric Unit  Metric Value
    ----------------------------------------------------- ----------- -------------
    smsp__inst_executed.sum                                      inst   125,000,000
    smsp__sass_thread_inst_executed_op_ffma_pred_on.sum          Ginst          3.2
    ----------------------------------------------------- ----------- -------------
"""


def test_parse_ncu_metrics_reads_names_values_and_scaled_units():
    assert sass.parse_ncu_metrics(NCU_REPORT) == {"smsp__inst_executed.sum": 125e6,
                                                 "smsp__sass_thread_inst_executed_op_ffma_pred_on.sum": 3.2e9}
    assert sass.parse_ncu_metrics("smsp__inst_executed.sum inst n/a\n") == {}
    with pytest.raises(TypeError, match="text must be Nsight Compute's report"):
        sass.parse_ncu_metrics(None)


def test_measured_mix_turns_thread_ffma_into_warp_ffma_per_warp_instruction(tmp_path):
    (tmp_path / "mix_regtile_wide.txt").write_text(NCU_REPORT)
    mix = sass.measured_mix("regtile_wide", tmp_path)
    # 3.2e9 thread FFMA = 1e8 warp FFMA, over 1.25e8 warp instructions
    assert mix == {"instructions": 125e6, "ffma": 1e8, "share": 0.8}
    assert sass.measured_mix("regtile", tmp_path) is None                # no file: not measured
    (tmp_path / "mix_scalar.txt").write_text(NCU_REPORT.replace("smsp__inst_executed.sum", "smsp__other.sum"))
    with pytest.raises(ValueError, match="mix_scalar.txt holds no value for"):
        sass.measured_mix("scalar", tmp_path)
    with pytest.raises(ValueError, match="CUDA-core rung"):
        sass.measured_mix("mma_fa2", tmp_path)


@needs_tools
@pytest.mark.parametrize("rung", sass.CUDA_CORE_RUNGS)
def test_a_launch_runs_the_attention_fmas_once_each(rung):
    # 2 n^2 d FMAs per head (S and P V), 32 lanes to a warp FFMA: the count of the products over the grid
    n, heads, d = 8192, 8, 128
    launch = sass.launch_at_least(rung, n, heads, d)
    assert launch["product_ffma"] == 2 * n * n * d * heads // 32
    tile = sass.key_tile(rung, d)
    assert launch["instructions"] * tile.product_ffma == launch["product_ffma"] * tile.instructions
    with pytest.raises(ValueError, match="n must be a multiple of"):
        sass.launch_at_least(rung, n + 1, heads, d)
