"""lessons.gpu.decode_loads: the K/V bytes a decode rung's warp keeps in flight, read from its SASS, and Little's law
on the recorded decode rates. The expected values come from the kernel sources' defines, from SASS written here by
hand, and from the recorded CSV read here with the csv module."""
import csv
import functools
import io
import math
import re
import statistics
from pathlib import Path

import pytest

from lessons.gpu import decode_loads as dl
from lessons.gpu import ladder, sass

from test_gpu_sass import needs_tools

KERNELS = Path(dl.__file__).parent / "kernels"
SMS = 132
#: the SM clock of the H200's tensor peak: 989e12 FLOP/s over 132 SMs x 4096 FLOPs per clock
CLOCK = 989e12 / (SMS * 4096)
D, PAGE, THREADS = 128, 16, 128                         # head dim, BLOCK_SIZE, NUM_THREADS of both kernels
STAGING, SPLIT = ("paged_decode", "flash_decoding"), ("paged_decode_split", "paged_decode_prefetch", "paged_decode_cp_async")


# ---------------------------------------------------------------------------------------------------------------
# what a thread reads: the opcode's width
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("opcode, nbytes", [
    ("LDG.E.128.CONSTANT", 16), ("LDG.E.64", 8), ("LDG.E.U16.CONSTANT", 2), ("LDG.E.S16", 2), ("LDG.E.S8", 1),
    ("LDG.E.U8.CONSTANT", 1), ("LDG.E.CONSTANT", 4), ("LDG.E", 4), ("LDG.E.EL.LTC128B.128", 16),
])
def test_load_bytes_reads_the_width_from_the_opcode(opcode, nbytes):
    assert dl.load_bytes(opcode) == nbytes


def test_load_bytes_refuses_what_is_not_a_global_load():
    for bad in (16, None, b"LDG.E.128", ["LDG.E"]):
        with pytest.raises(TypeError, match="opcode must be a str"):
            dl.load_bytes(bad)
    for bad in ("LDS.128", "STG.E.128", "", "ldg.e.128", "STS.128"):
        with pytest.raises(ValueError, match="opcode must be a global load"):
            dl.load_bytes(bad)
    # a copy from global to shared memory (cp.async) reads as many bytes as the load of the same width
    assert dl.load_bytes("LDGSTS.E.BYPASS.128") == 16 and dl.load_bytes("LDGSTS.E") == 4


# ---------------------------------------------------------------------------------------------------------------
# the wait walk on SASS written by hand
# ---------------------------------------------------------------------------------------------------------------

def _sass(*lines) -> str:
    """SASS text as nvdisasm prints it: a MOV, then a loop .L_x_0 over ``lines`` closed by ``@P1 BRA``, then EXIT."""
    body = list(lines) + ["@P1 BRA `(.L_x_0)"]
    out = ["        /*0000*/                   MOV R1, c[0x0][0x28] ;", ".L_x_0:"]
    out += [f"        /*{16 * k:04x}*/                   {line} ;" for k, line in enumerate(body, start=1)]
    out.append(f"        /*{16 * (len(body) + 1):04x}*/                   EXIT ;")
    return "\n".join(out) + "\n"


def _waits(*lines) -> tuple:
    """The Wait of the straight loop over ``lines``: its pass is every line once (instructions 1 .. the BRA)."""
    instructions, labels = sass.parse_sass(_sass(*lines))
    last = len(instructions) - 2
    loads = sum(dl._is_kv_load(x) for x in instructions)
    path = sass.interior_pass(instructions, labels, 1, last, loads, is_copy=dl._is_kv_load)
    assert path == list(range(1, last + 1))
    return dl._walk(instructions, path)


def _one(text):
    (x,) = sass.parse_sass(f"        /*0000*/                   {text} ;\n")[0]
    return x


@pytest.mark.parametrize("text, reads, writes", [
    ("LDG.E.U16.CONSTANT R6, desc[UR4][R6.64]", {6, 7}, {6}),          # R6.64: the address pair R6, R7
    ("LDG.E R7, desc[UR4][R4.64+0x40]", {4, 5}, {7}),
    ("LDG.E.64 R12, desc[UR4][R4.64]", {4, 5}, {12, 13}),             # 8 bytes land in R12, R13
    ("LDG.E.128.CONSTANT R8, desc[UR10][R2.64+0x100]", {2, 3}, {8, 9, 10, 11}),
    ("STG.E.128 desc[UR4][R2.64], R8", {2, 3, 8, 9, 10, 11}, set()),   # a store writes no register
    ("STS [R10+0x40], R8", {10, 8}, set()),
    ("STS.64 [R10], R8", {10, 8, 9}, set()),
    ("ISETP.GE.AND P0, PT, R4, UR8, PT", {4}, set()),                   # a compare writes a predicate; UR8 no R
    ("FSETP.GT.AND P1, PT, R9, RZ, PT", {9}, set()),
    ("HADD2.F32 R8, -RZ, R6.H0_H0", {6}, {8}),
    ("FFMA.FTZ R9, R8.reuse, R8, R9", {8, 9}, {9}),
    ("IADD3 R101, P6, R123, R100, RZ", {123, 100}, {101}),
    ("S2R R0, SR_TID.X", set(), {0}),
    ("MOV R1, c[0x0][0x28]", set(), {1}),
    ("LDC.64 R4, c[0x0][0x230]", set(), {4, 5}),
    ("BRA `(.L_x_0)", set(), set()),
    ("EXIT", set(), set()),
])
def test_reads_and_writes_of_one_instruction(text, reads, writes):
    assert dl._reads_and_writes(_one(text)) == (reads, writes)


def test_two_loads_then_a_use_of_the_later_is_one_wait_for_both():
    waits = _waits(
        "LDG.E.U16.CONSTANT R4, desc[UR4][R2.64]",                      # 0
        "LDG.E.U16.CONSTANT R6, desc[UR4][R2.64+0x100]",                # 1
        "IADD3 R2, P0, R2, 0x200, RZ",                                   # 2: reads the loads' address, not their data
        "FMUL R3, R3, 0.5",                                              # 3
        "HADD2.F32 R8, -RZ, R6.H0_H0",                                   # 4: waits for R6, so R4 has landed too
        "STS [R10], R8",                                                 # 5
        "HADD2.F32 R9, -RZ, R4.H0_H0",                                   # 6: R4 landed before R6: no wait
    )
    # 2 + 2 bytes asked for and not used at position 4; 4 - 1 instructions since R6's load
    assert waits == (dl.Wait(4, 4, 3, True),)


def test_a_use_of_the_later_load_after_the_earlier_is_no_new_round_trip():
    waits = _waits(
        "LDG.E.U16.CONSTANT R4, desc[UR4][R2.64]",                      # 0
        "LDG.E.U16.CONSTANT R6, desc[UR4][R2.64+0x100]",                # 1
        "IADD3 R2, P0, R2, 0x200, RZ",                                   # 2
        "HADD2.F32 R8, -RZ, R4.H0_H0",                                   # 3: waits for R4 (both in flight): a trip
        "HADD2.F32 R9, -RZ, R6.H0_H0",                                   # 4: R6 was in flight during that stall
        "STS [R10], R8",                                                 # 5
        "STS [R10+0x4], R9",                                             # 6: a second use of R6: landed, no wait
        "LDG.E.U16.CONSTANT R12, desc[UR4][R2.64]",                     # 7: issued after the last stall
        "HADD2.F32 R13, -RZ, R12.H0_H0",                                 # 8: so a new round trip
    )
    assert waits == (dl.Wait(3, 4, 3, True), dl.Wait(4, 2, 3, False), dl.Wait(8, 2, 1, True))
    loop = dl.DecodeLoop("paged_decode", "sm_90", 40, 0, 10, {}, 3, 6, waits, True)
    assert (loop.trips, loop.in_flight, loop.block_in_flight, loop.load_to_use) == (2, 4, 4 * THREADS, 1)


def test_a_load_used_in_the_next_pass_counts_the_instructions_across_the_wrap():
    waits = _waits(
        "FADD R20, R5, R20",                                             # 0: the 2nd word of last pass's R4..R7
        "FADD R21, R9, R21",                                             # 1: R8..R11, in flight in that stall
        "IADD3 R2, P0, R2, 0x200, RZ",                                   # 2
        "LDG.E.128.CONSTANT R4, desc[UR4][R2.64]",                      # 3: the next pass's rows
        "LDG.E.128.CONSTANT R8, desc[UR4][R2.64+0x10]",                 # 4
        "ISETP.GE.AND P1, PT, R2, R12, PT",                              # 5: reads R12, no load's
    )                                                                    # 6: the BRA back
    # a pass is 7 instructions: the load at 3 is used at 0 of the next pass, 7 - 3 + 0 = 4 instructions later
    assert waits == (dl.Wait(0, 32, 4, True), dl.Wait(1, 16, 7 - 4 + 1, False))


def test_a_cp_async_group_is_waited_for_at_the_depbar_that_retires_it():
    # a ring of 3 steps by hand: each pass copies one step (two 16-byte pieces), commits it and waits with 2 groups
    # still in flight, then reads the pieces of the step copied two passes before from shared memory
    lines = ("LDGSTS.E.BYPASS.128 [R25], desc[UR12][R28.64]",           # 0: this pass's copies
             "LDGSTS.E.BYPASS.128 [R27], desc[UR12][R30.64]",           # 1
             "LDGDEPBAR",                                                # 2: commit the group
             "DEPBAR.LE SB0, 0x2",                                       # 3: wait for the group of two passes ago
             "LDS.128 R8, [R40]",                                        # 4: its pieces, from shared memory
             "FFMA R9, R8, R8, R9")                                      # 5
    instructions, labels = sass.parse_sass(_sass(*lines))
    assert [dl._is_kv_load(x) for x in instructions[1:4]] == [True, True, False]
    assert dl._depbar_groups(instructions[4]) == 2 and dl._depbar_groups(instructions[5]) is None
    path = list(range(1, len(instructions) - 1)) * 3                     # a pass of three steps: 7 instructions each
    waits = dl._walk(instructions, path)
    # at each wait 3 groups of 32 bytes are in flight (the two before it and this pass's); the group waited for was
    # copied two steps and 2 instructions before (from the second copy of its pass): 2 x 7 + 3 - 1 = 16; the warp
    # stalls on a new round trip once in 3 steps (the other waits' groups were in flight during that stall)
    assert [(w.index, w.bytes, w.distance) for w in waits] == [(3, 96, 16), (10, 96, 16), (17, 96, 16)]
    assert sum(w.trip for w in waits) == 1
    # a wait with nothing left to retire (the first two passes, before the ring is full) is no wait
    assert dl._walk(instructions, path[:7], passes=2) == ()


def test_a_word_load_is_not_a_kv_load_and_is_not_waited_for():
    waits = _waits(
        "LDG.E.CONSTANT R13, desc[UR4][R14.64]",                        # a block-table entry: 4 bytes
        "LDG.E.U16.CONSTANT R4, desc[UR4][R2.64]",
        "IMAD.WIDE R2, R13, 0x2, R2",                                    # uses the table entry: not a K/V wait
        "HADD2.F32 R8, -RZ, R4.H0_H0",
    )
    assert waits == (dl.Wait(3, 2, 2, True),)


def test_the_key_loop_is_the_outer_one_and_stages_when_an_inner_loop_loads():
    text = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDG.E.CONSTANT R13, desc[UR4][R14.64] ;
.L_x_1:
        /*0020*/                   LDG.E.U16.CONSTANT R4, desc[UR4][R2.64] ;
        /*0030*/                   HADD2.F32 R8, -RZ, R4.H0_H0 ;
        /*0040*/                   STS [R10], R8 ;
        /*0050*/               @P0 BRA `(.L_x_1) ;
        /*0060*/                   FADD R9, R9, R8 ;
        /*0070*/               @P1 BRA `(.L_x_0) ;
        /*0080*/                   EXIT ;
"""
    instructions, labels = sass.parse_sass(text)
    assert dl._load_loop(instructions, labels) == (1, 7, True)
    assert dl._load_loop(*sass.parse_sass(_sass("LDG.E.64 R4, desc[UR4][R2.64]", "FADD R6, R4, R5"))) == (1, 3, False)
    with pytest.raises(ValueError, match="no loop of the SASS holds a K/V load"):
        dl._load_loop(*sass.parse_sass(_sass("LDG.E R4, desc[UR4][R2.64]", "FADD R6, R4, R5")))


def test_a_decode_loop_by_hand_gives_its_summaries():
    waits = (dl.Wait(10, 32, 8, True), dl.Wait(12, 16, 9, False))
    loop = dl.DecodeLoop("paged_decode_split", "sm_90", 128, 16640, 40, {"LDG": 2, "FADD": 38}, 2, 32, waits, False)
    assert (loop.in_flight, loop.trips, loop.load_to_use, loop.blocks_per_sm) == (32, 1, 8, 4)
    assert loop.issue_ceiling == pytest.approx(4 * CLOCK * SMS * 32 * 32 / 40)
    assert (loop.classes["copies"], loop.classes["other float"], sum(loop.classes.values())) == (2, 38, 40)
    assert dl.DecodeLoop("paged_decode", "sm_90", 56, 18896, 40, {}, 2, 4, waits, True).issue_ceiling is None
    for kwargs, error, match in ((dict(rung="mma_fa2"), ValueError, "rung must be one of"),
                                 (dict(registers=0), ValueError, "registers must be at least 1"),
                                 (dict(instructions=40.0), TypeError, "instructions must be an int"),
                                 (dict(shared_bytes=-1), ValueError, "shared_bytes must be at least 0"),
                                 (dict(waits=()), ValueError, "waits must be a non-empty tuple of Wait"),
                                 (dict(waits=((10, 32, 8, True),)), ValueError, "waits must be")):
        args = dict(rung="paged_decode_split", arch="sm_90", registers=128, shared_bytes=0, instructions=40,
                    counts={}, kv_loads=2, kv_bytes=32, waits=waits, stages=False)
        with pytest.raises(error, match=match):
            dl.DecodeLoop(**dict(args, **kwargs))


# ---------------------------------------------------------------------------------------------------------------
# occupancy by hand
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, blocks", [
    ((56, 18896), 9),          # 56 x 32 = 1792 = 7 x 256 per warp, x 4 warps: 65536 // 7168 = 9 (shared: 11)
    ((70, 18896), 7),          # 70 x 32 = 2240 -> 2304 per warp, x 4 = 9216: 7
    ((128, 16640), 4),         # 4096 x 4 = 16384: 4 (shared: 233472 // 17664 = 13)
    ((168, 16640), 3),         # 168 x 32 = 5376 = 21 x 256, x 4 = 21504: 3
    ((64, 0, 256), 4),         # 2048 x 8 warps = 16384: 4; threads 2048 // 256 = 8
    ((32, 0, 1024), 2),        # 1024 x 32 = 32768: 2; threads 2
    ((16, 0, 32), 32),         # registers allow 128, threads 64: the 32-block limit
    ((24, 100000), 2),         # shared: 233472 // (100000 + 1024) = 2; registers 21
    ((1, 227 * 1024, 32), 1),  # the largest block of shared memory: 227 KiB + 1 KiB reserved = 228 KiB
    ((64, 0, 1024), 1),        # 65536 registers exactly
    ((65, 0, 1024), 0),        # 65 x 32 = 2080 -> 2304 per warp, x 32 warps = 73728 > 65536: cannot fit
    ((255, 0, 1024), 0),
])
def test_blocks_per_sm_by_hand(args, blocks):
    assert dl.blocks_per_sm(*args) == blocks


def test_blocks_per_sm_refuses_bad_counts_by_name():
    for args, error, match in (((True, 0), TypeError, "registers must be an int"),
                               ((56.0, 0), TypeError, "registers must be an int"),
                               ((56, 1.5), TypeError, "shared_bytes must be an int"),
                               ((56, 0, False), TypeError, "threads must be an int"),
                               ((56, 0, 128.0), TypeError, "threads must be an int"),
                               ((0, 0), ValueError, "registers must be at least 1"),
                               ((256, 0), ValueError, "registers must be at most 255"),
                               ((56, -1), ValueError, "shared_bytes must be at least 0"),
                               ((56, 228 * 1024), ValueError, "shared_bytes must be at most"),
                               ((56, 0, 100), ValueError, "threads must be a multiple of 32"),
                               ((56, 0, 16), ValueError, "threads must be at least 32"),
                               ((56, 0, 2048), ValueError, "threads must be at most 1024")):
        with pytest.raises(error, match=match):
            dl.blocks_per_sm(*args)


# ---------------------------------------------------------------------------------------------------------------
# Little's law on recorded rows
# ---------------------------------------------------------------------------------------------------------------

def _staging_loop(rung, registers):
    """A page-staging loop as the SASS test below finds it: 16 round trips per page, a K and a V value in flight."""
    waits = tuple(w for k in range(16) for w in (dl.Wait(4 * k, 4, 2, True), dl.Wait(4 * k + 1, 2, 2, False)))
    return dl.DecodeLoop(rung, "sm_90", registers, 18896, 700, {"LDG": 33}, 32, 64, waits, True)


def _split_loop(rung, registers, instructions):
    waits = (dl.Wait(150, 128, 115, True), dl.Wait(180, 112, 120, False))
    return dl.DecodeLoop(rung, "sm_90", registers, 16640, instructions, {"LDG": 9}, 8, 128, waits, False)


#: loops given by hand (inputs of the Little's-law functions; the SASS tests check the SASS gives such loops)
HAND = {"paged_decode": _staging_loop("paged_decode", 56), "flash_decoding": _staging_loop("flash_decoding", 70),
        "paged_decode_split": _split_loop("paged_decode_split", 128, 731),
        "paged_decode_prefetch": _split_loop("paged_decode_prefetch", 168, 769)}
#: their blocks per SM (test_blocks_per_sm_by_hand)
HAND_BLOCKS = {"paged_decode": 9, "flash_decoding": 7, "paged_decode_split": 4, "paged_decode_prefetch": 3}


def _row(name, num_seqs, seq_len, splits, ms, variant=""):
    # K and V of 8 KV heads of d = 128 in fp16 for every token of every sequence
    return dict(name=name, variant=variant, num_seqs=num_seqs, seq_len=seq_len, num_splits=splits, ms=ms,
                kv_bytes=2 * num_seqs * seq_len * 8 * D * 2, tb_per_s=1.0, pct=25.0, max_abs_diff=0.0)


def test_round_trips_by_hand_leave_out_rows_over_one_wave():
    rows = [_row("paged_decode", 2, 1000, 1, 0.63),         # 16 blocks; ceil(1000 / 16) = 63 pages of 0.01 ms
            _row("flash_decoding", 1, 1000, 4, 0.16, "s=4"),  # 32 blocks; ceil(63 / 4) = 16 pages per block
            _row("paged_decode", 148, 4096, 1, 3.0),          # 1184 blocks <= 132 x 9 = 1188: one wave
            _row("paged_decode", 149, 4096, 1, 3.0),          # 1192 blocks: two waves, left out
            _row("flash_decoding", 1, 4096, 115, 1.0),        # 920 blocks <= 132 x 7 = 924
            _row("flash_decoding", 1, 4096, 116, 1.0),        # 928: left out
            _row("paged_decode_split", 1, 4096, 8, 0.1),      # a loop that does not stage pages: left out
            _row("paged_decode_prefetch", 1, 4096, 8, 0.1)]
    loops = {k: HAND[k] for k in ("paged_decode", "flash_decoding", "paged_decode_split")}
    got = dl.round_trips(loops, rows)
    assert [(r["rung"], r["num_seqs"], r["num_splits"], r["blocks"]) for r in got] == [
        ("paged_decode", 2, 1, 16), ("flash_decoding", 1, 4, 32), ("paged_decode", 148, 1, 1184),
        ("flash_decoding", 1, 115, 920)]
    assert got[1]["variant"] == "s=4" and all(r["trips_per_page"] == 16 for r in got)
    assert got[0]["page_seconds"] == pytest.approx(1e-5) and got[0]["round_trip_seconds"] == pytest.approx(1e-5 / 16)
    assert got[1]["page_seconds"] == pytest.approx(1e-5) and got[1]["round_trip_seconds"] == pytest.approx(6.25e-7)
    assert got[2]["page_seconds"] == pytest.approx(3e-3 / 256)                # 4096 / 16 = 256 pages
    assert got[3]["page_seconds"] == pytest.approx(1e-3 / 3)                  # ceil(256 / 115) = 3 pages
    for r, row in zip(got, (rows[0], rows[1], rows[2], rows[4])):
        assert r["block_rate"] == pytest.approx(row["kv_bytes"] / (row["ms"] / 1e3) / r["blocks"])
    # two heads per block: twice the blocks, so the 148-sequence row no longer fits in one wave
    two = dl.round_trips(loops, rows, heads_per_block=2)
    assert [(r["rung"], r["blocks"]) for r in two] == [("paged_decode", 32), ("flash_decoding", 64)]
    assert dl.round_trips({}, rows) == []


def _recorded():
    """The recorded decode CSV, read here: (name, variant, num_seqs, seq_len, num_splits, seconds, kv_bytes, tb/s,
    pct) per line."""
    with open(ladder.DECODE_RECORDED, newline="") as f:
        out = []
        for r in csv.DictReader(f):
            name, _, variant = r["kernel"].partition(" ")
            out.append(dict(name=name, variant=variant, num_seqs=int(r["num_seqs"]), seq_len=int(r["seq_len"]),
                            splits=int(r["num_splits"]), seconds=float(r["seconds"]), kv_bytes=int(r["kv_bytes"]),
                            tb_per_s=float(r["tb_per_s"]), pct=float(r["pct_of_copy"])))
    return out


def _one_wave(r):
    return 8 * r["num_seqs"] * r["splits"] <= SMS * HAND_BLOCKS.get(r["name"], 0)


def _csv_round_trips():
    """Per one-wave row of a page-staging rung: its seconds over the pages of a block over 16 round trips a page."""
    return [(r["name"], r["num_seqs"], r["splits"],
             r["seconds"] / math.ceil(math.ceil(r["seq_len"] / PAGE) / r["splits"]) / 16)
            for r in _recorded() if r["name"] in STAGING and _one_wave(r)]


def test_the_recorded_page_staging_rows_give_one_round_trip():
    rows = _recorded()
    for r in rows:                                         # the bytes: K and V, 8 KV heads, d = 128, fp16
        assert r["kv_bytes"] == 2 * r["num_seqs"] * r["seq_len"] * 8 * D * 2
    mine = _csv_round_trips()
    # 512 blocks at most among them, 2048 at least among the others: one wave holds them at 4 to 15 blocks per SM
    assert len(mine) == 6 and {m[0] for m in mine} == set(STAGING)
    trips = [m[3] for m in mine]
    assert max(trips) / min(trips) < 1.05                  # the lesson's claim: one round trip, within 5%
    got = dl.round_trips(HAND)
    assert [(r["rung"], r["num_seqs"], r["num_splits"]) for r in got] == [m[:3] for m in mine]
    assert [r["round_trip_seconds"] for r in got] == pytest.approx(trips, rel=1e-12)
    assert all(5e-7 < t < 1e-6 for t in trips)             # under a microsecond each


def test_little_rate_is_bytes_over_seconds():
    assert dl.little_rate(16384 * 528, 7e-7) == pytest.approx(16384 * 528 / 7e-7)
    assert dl.little_rate(512, 1) == 512.0
    for args, match in (((0, 1e-6), "bytes_in_flight"), ((True, 1e-6), "bytes_in_flight"),
                        ((512, float("nan")), "round_trip_seconds"), ((512, -1e-6), "round_trip_seconds"),
                        ((512, float("inf")), "round_trip_seconds"), (("512", 1e-6), "bytes_in_flight")):
        with pytest.raises(ValueError, match=match):
            dl.little_rate(*args)


def test_little_plot_by_hand_from_the_recorded_csv():
    plot = dl.little_plot(HAND)
    rows = _recorded()
    assert plot["round_trip"] == pytest.approx(statistics.median(m[3] for m in _csv_round_trips()))
    # points: the rows of each rung whose blocks all run at once, (blocks, K/V bytes per second)
    want = {}
    for r in rows:
        if _one_wave(r):
            want.setdefault(r["name"], []).append((8 * r["num_seqs"] * r["splits"], r["kv_bytes"] / r["seconds"]))
    assert set(plot["points"]) == {"paged_decode", "flash_decoding", "paged_decode_split"}   # no prefetch row
    assert len(want["paged_decode_split"]) == 2                     # 512 and 528 blocks; 576 is a second wave
    for name, found in plot["points"].items():
        assert [b for b, _ in found] == sorted(b for b, _ in want[name])
        assert [v for _, v in found] == pytest.approx([v for _, v in sorted(want[name])])
    # lines: Little's law per bytes in flight per block, from 1 block to all the GPU holds
    (small, large) = plot["lines"]
    assert (small["bytes"], small["rungs"]) == (4 * THREADS, ("paged_decode", "flash_decoding"))
    assert (large["bytes"], large["rungs"]) == (128 * THREADS, ("paged_decode_split", "paged_decode_prefetch"))
    for line, most in ((small, SMS * 9), (large, SMS * 4)):
        assert line["blocks"][0] == 1 and line["blocks"][-1] == most
        assert all(b * 2 == c for b, c in zip(line["blocks"][:-2], line["blocks"][1:-1]))
        assert line["rates"] == pytest.approx([b * line["bytes"] / plot["round_trip"] for b in line["blocks"]])
    # roofs: the copy rate every recorded row implies, and the split loops' issue ceilings
    copies = [r["tb_per_s"] * 1e12 * 100 / r["pct"] for r in rows]
    assert max(copies) / min(copies) == pytest.approx(1, abs=1e-9)
    assert plot["roofs"]["device copy rate (recorded)"] == pytest.approx(copies[0])
    for name, instructions in (("paged_decode_split", 731), ("paged_decode_prefetch", 769)):
        assert plot["roofs"][f"issue ceiling of {name}"] == pytest.approx(4 * CLOCK * SMS * 32 * 128 / instructions)
    assert len(plot["roofs"]) == 3
    given = dl.little_plot({"paged_decode": HAND["paged_decode"]}, rows=[], round_trip_seconds=1e-6)
    assert given["round_trip"] == 1e-6 and given["points"] == {} and given["roofs"] == {}
    assert given["lines"][0]["rates"][0] == pytest.approx(512 / 1e-6)


def test_little_plot_and_round_trips_refuse_bad_input_by_name():
    with pytest.raises(TypeError, match="loops must be a non-empty dict"):
        dl.little_plot({})
    with pytest.raises(TypeError, match="loops must be a non-empty dict"):
        dl.little_plot([HAND["paged_decode"]])
    with pytest.raises(ValueError, match="no recorded row of a page-staging rung runs in one wave"):
        dl.little_plot(HAND, rows=[])
    with pytest.raises(ValueError, match="round_trip_seconds"):
        dl.little_plot(HAND, round_trip_seconds=-1.0)
    with pytest.raises(TypeError, match="loops must be a dict"):
        dl.round_trips(["paged_decode"])
    with pytest.raises(TypeError, match="loops must be a dict"):
        dl.round_trips({"paged_decode": "x"})
    with pytest.raises(ValueError, match="num_heads must be at least 1"):
        dl.round_trips(HAND, num_heads=0)
    with pytest.raises(TypeError, match="heads_per_block must be an int"):
        dl.round_trips(HAND, heads_per_block=4.0)
    with pytest.raises(ValueError, match="heads_per_block must divide num_heads"):
        dl.round_trips(HAND, heads_per_block=3)


def test_the_figure_draws_the_plot_and_refuses_another_dict():
    from lessons.views.decode_loads import little_figure

    plot = dl.little_plot(HAND)
    fig = little_figure(plot)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    assert buf.getvalue().startswith(b"\x89PNG")
    (ax,) = fig.axes
    dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    markers = [line for line in ax.get_lines() if line.get_linestyle() == "None"]
    dotted = [line for line in ax.get_lines() if line.get_linestyle() == ":"]
    assert (len(dashed), len(markers), len(dotted)) == (2, 3, 3)
    assert list(dashed[1].get_xdata()) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, SMS * 4]
    assert list(dashed[1].get_ydata()) == pytest.approx([b * 128 * THREADS / plot["round_trip"] / 1e12
                                                         for b in dashed[1].get_xdata()])
    assert sorted(dotted[0].get_ydata()) == pytest.approx([plot["roofs"]["device copy rate (recorded)"] / 1e12] * 2)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "Little's law, 16 KiB in flight per block\n(paged_decode_split, paged_decode_prefetch)" in labels
    assert "Little's law, 512 B in flight per block\n(paged_decode, flash_decoding)" in labels
    for bad in ({}, [], "plot", {k: plot[k] for k in ("round_trip", "points", "lines")}):
        with pytest.raises(TypeError, match="plot must be the dict little_plot returns"):
            little_figure(bad)
    # where the markers were measured goes on a second title line; the roofs' legend keeps its own names
    assert "\n" not in ax.get_title(loc="left")
    labelled = little_figure(plot, label="recorded on one NVIDIA H200, 2026-12-01").axes[0]
    assert labelled.get_title(loc="left").endswith("\nmarkers: recorded on one NVIDIA H200, 2026-12-01")
    assert any(t.get_text().startswith("device copy rate (recorded): ") for t in labelled.get_legend().get_texts())
    for bad in ("", "  ", 3):
        with pytest.raises(TypeError, match="label must be a non-empty string"):
            little_figure(plot, label=bad)


def test_the_every_sm_full_note_sits_at_the_end_of_its_line_clear_of_every_marker():
    from lessons.views.decode_loads import little_figure

    plot = dl.little_plot(HAND)
    fig = little_figure(plot)
    (ax,) = fig.axes
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    first = plot["lines"][0]
    (note,) = [t for t in ax.texts if t.get_text().startswith("every SM full")]
    blocks = SMS * HAND_BLOCKS["paged_decode"]                     # the line ends where every SM is full
    full = blocks * 512 / plot["round_trip"]                        # the 512 bytes per block of the staging rungs
    assert note.get_text() == f"every SM full\n({blocks} blocks):\n{full / 1e12:.2f} TB/s"
    assert note.xy == (blocks, pytest.approx(full / 1e12))
    box = note.get_window_extent(renderer)
    end_x, end_y = ax.transData.transform((first["blocks"][-1], first["rates"][-1] / 1e12))
    # right of the line's end, at its height, and inside the axes (the legend's side is not written on)
    assert box.x0 > end_x and box.y0 < end_y < box.y1 and box.x1 < ax.get_window_extent(renderer).x1
    markers = [line for line in ax.get_lines() if line.get_linestyle() == "None"]
    for line in markers:
        for x, y in ax.transData.transform(list(zip(line.get_xdata(), line.get_ydata()))):
            assert not box.expanded(1.0, 1.0).padded(line.get_markersize()).contains(x, y), line.get_label()


# ---------------------------------------------------------------------------------------------------------------
# the decode rungs' SASS, with hand values from the kernel sources
# ---------------------------------------------------------------------------------------------------------------

SPLIT_FORMULAS = (
    "#define VEC16 (FA_DTYPE == 0 ? 4 : 8)", "#define VEC ((HEAD_DIM % VEC16) == 0 ? VEC16 : 1)",
    "#define N_VEC (HEAD_DIM / VEC)",
    "#define LANES (N_VEC > 16 ? 32 : N_VEC > 8 ? 16 : N_VEC > 4 ? 8 : N_VEC > 2 ? 4 : N_VEC > 1 ? 2 : 1)",
    "#define CHUNKS ((N_VEC + LANES - 1) / LANES)", "#define KEYS_PER_WARP (32 / LANES)",
    "#define NUM_STATES (NUM_WARPS * KEYS_PER_WARP)", "#define WORDS_PER_LOAD (VEC == 1 ? 1 : 4)",
    "#define UNROLL_FIT (32 / (2 * CHUNKS * WORDS_PER_LOAD))", "#define UNROLL_MAX 4",
    "#define UNROLL (UNROLL_FIT > UNROLL_MAX ? UNROLL_MAX : UNROLL_FIT > 0 ? UNROLL_FIT : 1)",
    "#define NUM_THREADS 128", "#define NUM_WARPS (NUM_THREADS / 32)",
)


def _split_defines(head_dim=D, fa_dtype=1):
    """paged_decode_split.cu's #define formulas (checked to be in the source) for fp16 (FA_DTYPE 1) at ``head_dim``."""
    text = (KERNELS / "paged_decode_split.cu").read_text()
    for line in SPLIT_FORMULAS:
        assert line in text, line
    vec16 = 4 if fa_dtype == 0 else 8
    vec = vec16 if head_dim % vec16 == 0 else 1
    n_vec = head_dim // vec
    lanes = 32 if n_vec > 16 else 16 if n_vec > 8 else 8 if n_vec > 4 else 4 if n_vec > 2 else 2 if n_vec > 1 else 1
    chunks = (n_vec + lanes - 1) // lanes
    fit = 32 // (2 * chunks * (1 if vec == 1 else 4))
    unroll = 4 if fit > 4 else fit if fit > 0 else 1
    return dict(VEC=vec, LANES=lanes, CHUNKS=chunks, UNROLL=unroll, NUM_STATES=(128 // 32) * (32 // lanes))


def test_the_split_kernels_defines_give_eight_16_byte_loads_a_step():
    d = _split_defines()
    assert d == dict(VEC=8, LANES=16, CHUNKS=1, UNROLL=4, NUM_STATES=8)
    # each lane group issues K and V of UNROLL keys, CHUNKS loads of VEC halves each
    assert 2 * d["UNROLL"] * d["CHUNKS"] == 8 and d["VEC"] * 2 == 16
    text = (KERNELS / "paged_decode.cu").read_text()
    assert "#define NUM_THREADS 128" in text and "#define D_PAD (HEAD_DIM + 1)" in text


def _shared_by_hand(rung):
    """Static shared memory of the rung's key-loop kernel, from the structs in its source (floats of 4 bytes)."""
    hpb = 32 // 8                                          # the GQA group: 32 query heads on 8 KV heads
    if rung in STAGING:      # DecodeShared: q[HPB][D_PAD], k, v[BLOCK_SIZE][D_PAD], s[HPB][BLOCK_SIZE + 1], m, l, alpha
        text = (KERNELS / "paged_decode.cu").read_text()
        for member in ("float q[HEADS_PER_BLOCK][D_PAD];", "float k[BLOCK_SIZE][D_PAD];", "float v[BLOCK_SIZE][D_PAD];",
                       "float s[HEADS_PER_BLOCK][BLOCK_SIZE + 1];", "float alpha[HEADS_PER_BLOCK];"):
            assert member in text
        return 4 * (hpb * (D + 1) + 2 * PAGE * (D + 1) + hpb * (PAGE + 1) + 3 * hpb)
    text = (KERNELS / "paged_decode_split.cu").read_text()   # SplitShared: m, l[NUM_STATES][HPB], o[..][HEAD_DIM]
    assert "float o[NUM_STATES][HEADS_PER_BLOCK][HEAD_DIM];" in text
    states = _split_defines()["NUM_STATES"]
    return 4 * (2 * states * hpb + states * hpb * D)


@functools.lru_cache(maxsize=None)
def _loop(rung, arch="sm_90"):
    return dl.decode_loop(rung, arch)


def _resources(rung, arch):
    from lessons.gpu.compile import compile_kernel

    return compile_kernel(ladder.decode_rung_build(rung), arch).resources[ladder.decode_rung_entry(rung)]


def _kv_opcodes(rung, arch):
    """The opcodes of the loads of global memory wider or narrower than a word anywhere in the rung's key-loop
    kernel (the 4-byte LDG.E reads the block table and the sequence length)."""
    build, entry = ladder.decode_rung_build(rung), ladder.decode_rung_entry(rung)
    instructions, _ = sass.parse_sass(sass.disassemble(build, arch, entry))
    return {x.opcode for x in instructions if x.base == "LDG"} - {"LDG.E", "LDG.E.CONSTANT"}


@needs_tools
@pytest.mark.parametrize("rung", STAGING)
def test_a_page_staging_rung_reads_a_page_in_16_round_trips_of_two_values(rung):
    t = _loop(rung)
    res = _resources(rung, "sm_90")
    assert (t.rung, t.arch, t.registers) == (rung, "sm_90", res.registers)
    assert t.shared_bytes == res.smem_bytes + res.dynamic_smem_bytes == _shared_by_hand(rung) == 18896
    assert t.blocks_per_sm == dl.blocks_per_sm(res.registers, 18896) >= 4          # __launch_bounds__(128, 4)
    # a pass is a page: K and V, 16 tokens x 128 values of 2 bytes, over 128 threads
    assert t.stages and t.kv_bytes == 2 * PAGE * D * 2 // THREADS == 64
    assert t.kv_loads == 64 // 2 and _kv_opcodes(rung, "sm_90") == {"LDG.E.U16.CONSTANT"}
    # a thread waits for one K and one V value at a time: 4 bytes, 16 times a page (16 x 128 values / 128 threads)
    assert t.in_flight == 4 and all(w.bytes <= 4 for w in t.waits) and t.block_in_flight == 4 * THREADS
    assert t.trips == PAGE * D // THREADS == 16
    assert t.issue_ceiling is None
    assert sum(t.counts.values()) == t.instructions == sum(t.classes.values())


@needs_tools
@pytest.mark.parametrize("rung, arch", [("paged_decode_split", "sm_90"), ("paged_decode_split", "sm_80")])
def test_a_split_rung_has_a_steps_eight_16_byte_loads_in_flight_at_its_first_wait(rung, arch):
    d = _split_defines()
    loads, width = 2 * d["UNROLL"] * d["CHUNKS"], 2 * d["VEC"]
    t = _loop(rung, arch)
    res = _resources(rung, arch)
    assert (t.rung, t.arch, t.registers) == (rung, arch, res.registers)
    assert t.shared_bytes == res.smem_bytes + res.dynamic_smem_bytes == _shared_by_hand(rung) == 16640
    assert t.blocks_per_sm == dl.blocks_per_sm(res.registers, 16640) >= {"paged_decode_split": 4}.get(rung, 3)
    assert not t.stages and (t.kv_loads, t.kv_bytes) == (loads, loads * width) == (8, 128)
    assert _kv_opcodes(rung, arch) == {"LDG.E.128.CONSTANT"}
    # all 8 in flight at the first wait, then they land in order: each wait has fewer, a whole number of loads
    assert t.waits[0].bytes == t.in_flight == 128 and t.block_in_flight == 128 * THREADS
    assert all(a.bytes > b.bytes for a, b in zip(t.waits, t.waits[1:])) and all(w.bytes % 16 == 0 for w in t.waits)
    assert t.trips == 1 and t.waits[0].trip and not any(w.trip for w in t.waits[1:])
    assert t.issue_ceiling == pytest.approx(4 * CLOCK * SMS * 32 * 128 / t.instructions)
    assert t.issue_ceiling == pytest.approx(4 * (989e12 / (132 * 4096)) * 132 * 32 * 128 / t.instructions)
    assert sum(t.counts.values()) == t.instructions and t.counts["LDG"] >= loads
    assert t.steps == 1 and t.step_instructions == t.instructions


@needs_tools
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_prefetch_rungs_pass_is_two_steps_one_per_register_set(arch):
    # the loop body is two steps (the even and the odd register set), each of 2 x UNROLL x CHUNKS 16-byte loads
    d = _split_defines()
    loads, width = 2 * d["UNROLL"] * d["CHUNKS"], 2 * d["VEC"]
    t = _loop("paged_decode_prefetch", arch)
    res = _resources("paged_decode_prefetch", arch)
    assert t.registers == res.registers and t.blocks_per_sm == dl.blocks_per_sm(res.registers, 16640) == 3
    assert not t.stages and (t.steps, t.kv_loads, t.kv_bytes) == (2, 2 * loads, 2 * loads * width) == (2, 16, 256)
    assert _kv_opcodes("paged_decode_prefetch", arch) == {"LDG.E.128.CONSTANT"}
    assert t.step_instructions == t.instructions / 2
    assert t.issue_ceiling == pytest.approx(4 * CLOCK * SMS * 32 * 256 / t.instructions)
    # every wait is for rows asked for about a step before: nearly a step's instructions lie in between
    assert min(w.distance for w in t.waits) == t.load_to_use >= 0.9 * t.step_instructions


@needs_tools
def test_the_prefetch_rung_waits_later_than_the_split_rung():
    split, prefetch = _loop("paged_decode_split"), _loop("paged_decode_prefetch")
    # its loads are asked for a step ahead: the work of a step lies between a load and its first use
    assert prefetch.load_to_use > split.load_to_use
    assert prefetch.load_to_use >= 0.9 * prefetch.step_instructions > 4 * split.load_to_use
    # two register sets taking turns: no copy of a step's rows from one set to the other, so a step issues about as
    # many instructions as the split rung's
    assert abs(prefetch.step_instructions / split.step_instructions - 1) < 0.03
    assert prefetch.registers > split.registers and prefetch.blocks_per_sm < split.blocks_per_sm


@needs_tools
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_cp_async_rung_waits_two_steps_after_its_copies(arch):
    # the ring of 3 steps: a step's 8 pieces (K and V of 4 keys) copied to shared memory, waited for two steps later
    split, ring = _loop("paged_decode_split", arch), _loop("paged_decode_cp_async", arch)
    res = _resources("paged_decode_cp_async", arch)
    assert (ring.registers, ring.shared_bytes) == (res.registers, res.smem_bytes) and res.registers <= 128
    assert ring.shared_bytes == 3 * 16 * 1024 and ring.blocks_per_sm == dl.blocks_per_sm(128, 3 * 16 * 1024) == 4
    assert ring.counts["LDGSTS"] == 24 and ring.counts["LDGDEPBAR"] == ring.counts["DEPBAR"] == 3
    assert not ring.stages and (ring.steps, ring.kv_loads, ring.kv_bytes) == (3, 24, 384)
    # at a wait: the 2 steps ahead and the one waited for, 384 bytes a thread, 48 KiB a block, 192 KiB an SM
    assert ring.in_flight == 384 and ring.block_in_flight * ring.blocks_per_sm == 192 * 1024
    assert ring.trips == 1 and ring.load_to_use >= 1.9 * ring.step_instructions > 10 * split.load_to_use
    # reading the pieces back from shared memory costs about what the register moves it saves (sm_90: 727 against
    # 731, sm_80: 704 against 731)
    assert abs(ring.step_instructions / split.step_instructions - 1) < 0.05
    assert ring.issue_ceiling == pytest.approx(4 * CLOCK * SMS * 32 * 384 / ring.instructions)


def test_each_decode_rungs_entry_is_a_kernel_of_its_build_that_reads_the_queries():
    assert dl.DECODE_LOOP_RUNGS == tuple(r.name for r in ladder.DECODE_RUNGS)
    for r in ladder.DECODE_RUNGS:
        entry = ladder.decode_rung_entry(r)
        assert entry == ladder.decode_rung_entry(r.name) and entry in ladder.decode_rung_build(r).entries
        source = (KERNELS / f"{r.kernel}.cu").read_text()
        assert f"\n{entry}(const scalar_t* __restrict__ q" in source        # not a merge of partial states
    # flash-decoding's key loop is the split kernel of paged_decode.cu, not the one-pass kernel
    assert ladder.decode_rung_entry("flash_decoding") == "paged_decode_split"
    assert ladder.decode_rung_entry("paged_decode") == "paged_decode"
    with pytest.raises(ValueError, match="decode rung must be one of"):
        ladder.decode_rung_entry("mma_fa2")


def _named(text) -> set:
    """The registers an instruction's text names as inputs: every ``R<n>`` operand but a first one it writes."""
    operands = [p.strip() for p in (text.split(None, 1) + [""])[1].split(",")]
    if re.fullmatch(r"R\d+", operands[0]):
        operands = operands[1:]
    return {int(n) for p in operands for n in re.findall(r"(?<![\w.])R(\d+)", p)}


@needs_tools
@pytest.mark.parametrize("rung", ("paged_decode_split", "paged_decode_prefetch"))     # (loads into registers)
def test_load_to_use_is_the_nearest_reader_of_any_word_of_a_16_byte_load(rung):
    """The test's own count on the pass decode_loop walks: for each 16-byte load, the instructions until the first
    one that names any of its four registers (LDG.E.128 R8 fills R8..R11), the pass walked twice."""
    build, entry = ladder.decode_rung_build(rung), ladder.decode_rung_entry(rung)
    instructions, labels = sass.parse_sass(sass.disassemble(build, "sm_90", entry))
    first, last, _ = dl._load_loop(instructions, labels)
    wide = [i for i in range(first, last + 1) if instructions[i].opcode == "LDG.E.128.CONSTANT"]
    assert len(wide) == 8 * _loop(rung).steps                 # a step's 8, one step per register set
    path = sass.interior_pass(instructions, labels, first, last, len(wide),
                              is_copy=lambda x: x.opcode == "LDG.E.128.CONSTANT")
    twice = [instructions[i] for i in path + path]
    distances = []
    for p, x in enumerate(twice[:len(path)]):
        if x.opcode == "LDG.E.128.CONSTANT":
            base = int(re.match(r"LDG\S* R(\d+),", x.text).group(1))
            words = set(range(base, base + 4))
            distances.append(next(q - p for q in range(p + 1, len(twice)) if _named(twice[q].text) & words))
    assert len(distances) == len(wide) and _loop(rung).load_to_use == min(distances)


@needs_tools
def test_decode_loop_takes_a_rung_object():
    assert dl.decode_loop(ladder.decode_rung("paged_decode_split")) == _loop("paged_decode_split")


@needs_tools
def test_the_table_and_its_markdown_hold_one_row_per_rung():
    rows = _recorded()
    copy = rows[0]["tb_per_s"] * 1e12 * 100 / rows[0]["pct"]
    table = dl.decode_loop_table(copy_rate=copy)
    assert [r["rung"] for r in table] == list(dl.DECODE_LOOP_RUNGS) and {r["arch"] for r in table} == {"sm_90"}
    for row in table:
        t = _loop(row["rung"])
        assert (row["registers"], row["blocks_per_sm"], row["instructions"], row["kv_bytes"], row["trips"]) == (
            t.registers, t.blocks_per_sm, t.instructions, t.kv_bytes, t.trips)
        assert (row["waits"], row["in_flight"], row["load_to_use"]) == (len(t.waits), t.in_flight, t.load_to_use)
        assert row["block_in_flight"] == row["in_flight"] * THREADS
        assert row["sm_in_flight"] == row["block_in_flight"] * row["blocks_per_sm"]
        if row["rung"] in STAGING:
            assert row["issue_ceiling"] is None and row["ceiling_x_copy"] is None
        else:
            assert row["ceiling_x_copy"] == pytest.approx(row["issue_ceiling"] / copy)
    assert dl.decode_loop_table("paged_decode")[0]["ceiling_x_copy"] is None
    text = dl.decode_loop_markdown(table)
    lines = text.splitlines()
    assert len(lines) == 2 + len(table) and text.count("none counted") == 2
    for line, row in zip(lines[2:], table):
        assert line.startswith(f"| `{row['rung']}` | {row['registers']} | {row['blocks_per_sm']} | ")
        kib = row["in_flight"] * THREADS * row["blocks_per_sm"] / 1024
        assert f"| {row['in_flight']} B / {row['in_flight'] * THREADS:,} B / {kib:.1f} KiB |" in line
        if row["rung"] in SPLIT:
            assert line.endswith(f"| {row['instructions']} | {row['issue_ceiling'] / 1e12:.2f} TB/s |")
    for bad in ([], "table", [{"rung": "paged_decode"}], [table[0], "row"],
                [{k: v for k, v in table[0].items() if k != "load_to_use"}]):
        with pytest.raises(TypeError, match="table must be a non-empty list of rows from decode_loop_table"):
            dl.decode_loop_markdown(bad)


@needs_tools
def test_round_trips_from_the_sass_agree_with_the_csv():
    loops = {r: _loop(r) for r in dl.DECODE_LOOP_RUNGS}
    got = dl.round_trips(loops)
    mine = _csv_round_trips()
    assert [(r["rung"], r["num_seqs"], r["num_splits"]) for r in got] == [m[:3] for m in mine]
    assert [r["round_trip_seconds"] for r in got] == pytest.approx([m[3] for m in mine])


# ---------------------------------------------------------------------------------------------------------------
# bad input, named
# ---------------------------------------------------------------------------------------------------------------

def test_decode_loop_and_its_table_refuse_bad_input_by_name():
    for rung in ("mma_fa2", "paged_decode ", "merge_splits", ""):
        with pytest.raises(ValueError, match="rung must be one of"):
            dl.decode_loop(rung)
    with pytest.raises(ValueError, match="rung must be one of"):
        dl.decode_loop(ladder.rung("mma_fa2"))                 # a forward rung's Rung
    for rung in (3, None, ("paged_decode",), b"paged_decode"):
        with pytest.raises(TypeError, match="rung must be a decode rung's name or its Rung"):
            dl.decode_loop(rung)
    for arch in ("sm_75", "sm_90a", "SM_90", 90, None):
        with pytest.raises(ValueError, match="arch must be 'sm_80' or 'sm_90'"):
            dl.decode_loop("paged_decode", arch)
    for rungs in ([], (), 5, None, {"paged_decode"}):
        with pytest.raises(TypeError, match="rungs must be a decode rung's name or a non-empty sequence"):
            dl.decode_loop_table(rungs)
    with pytest.raises(ValueError, match="rung must be one of"):
        dl.decode_loop_table(["mma_fa2"])
    with pytest.raises(ValueError, match="arch must be"):
        dl.decode_loop_table("paged_decode", arch="sm_70")
    for copy_rate in (-1.0, 0, float("nan"), "4e12", True):
        with pytest.raises(ValueError, match="copy_rate must be a positive finite number of bytes/s"):
            dl.decode_loop_table("paged_decode", copy_rate=copy_rate)


@needs_tools
def test_the_quiz_quotes_the_first_decode_rungs_bytes_in_flight():
    from lessons.course.quiz import QUIZZES

    q = next(q for q in QUIZZES["10_decode_kernel_ladder"] if "flat rate per block" in q.question)
    loops = {n: _loop(n) for n in STAGING}
    trips = dl.round_trips(loops)
    rates = [t["block_rate"] for t in trips if t["rung"] == "paged_decode"]
    assert f"read {min(rates) / 1e9:.2f} to {max(rates) / 1e9:.2f} GB/s" in q.question
    assert {t["blocks"] for t in trips if t["rung"] == "paged_decode"} >= {8, 512}
    t = loops["paged_decode"]
    right = q.choices[q.answer]
    assert f"only {t.in_flight} bytes per thread in flight" in right
    plot = dl.little_plot(loops)
    L, copy = plot["round_trip"], plot["roofs"]["device copy rate (recorded)"]
    full = SMS * t.blocks_per_sm * t.block_in_flight / L
    text = q.explanation
    assert f"keeps {t.block_in_flight} bytes in flight and a page takes {t.trips} round trips of at most {L * 1e6:.2f}" in text
    assert f"recorded {copy / 1e12:.2f} TB/s copy rate takes about {copy * L / 1e6:.1f} MB in flight, " \
           f"{copy * L / SMS / 1024:.0f} KiB per SM" in text
    assert f"with {t.blocks_per_sm} blocks per SM this rung holds {t.blocks_per_sm * t.block_in_flight / 1024:.1f} KiB, " \
           f"so at most {full / 1e12:.2f} TB/s ({full / copy:.0%})" in text
    assert f"{_loop('paged_decode_split').block_in_flight // 1024} KiB per block" in text


# an Nsight Compute text report as gpu_check.sh writes it (section tables: name, unit where there is one, value)
NCU_REPORT = """==PROF== Connected to process 7 (/usr/bin/python3.12)
  paged_decode_gqa_split (8, 64, 1)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Metric Name             Metric Unit Metric Value
    ----------------------- ----------- ------------
    DRAM Frequency                  Ghz         3.20
    SM Frequency                    Ghz         1.75
    Elapsed Cycles                cycle    1,234,567
    DRAM Throughput                   %        71.25
    Duration                         us       400.00
    ----------------------- ----------- ------------
    Section: Scheduler Statistics
    Issued Warp Per Scheduler                        0.61
    Active Warps Per Scheduler          warp         3.90
    Section: Warp State Statistics
    Warp Cycles Per Issued Instruction             cycle         6.40
    ----- --------------------------------------------------------------------------------------------------------------
    OPT   Est. Speedup: 40.0%
          On average, each warp of this workload spends 2.6 cycles being stalled waiting for a scoreboard dependency on
          a L1TEX (local, global, surface, texture) operation. Find the instruction producing the data being waited
          upon to identify the culprit. This stall type represents about 40.6% of the total average of 6.4 cycles
          between issuing two instructions.
"""


def test_parse_ncu_sections_reads_names_units_and_values():
    found = dl.parse_ncu_sections(NCU_REPORT)
    assert found["Elapsed Cycles"] == ("cycle", 1234567.0)
    assert found["Issued Warp Per Scheduler"] == ("", 0.61)
    assert found["Duration"] == ("us", 400.0) and found["DRAM Throughput"] == ("%", 71.25)
    assert "Metric Name" not in found
    with pytest.raises(TypeError, match="text must be"):
        dl.parse_ncu_sections(b"bytes")


def test_measured_profile_reads_the_report_and_converts_units(tmp_path):
    assert dl.measured_profile("paged_decode_split", tmp_path) is None            # no report: not profiled yet
    (tmp_path / "ncu_paged_decode_split.txt").write_text(NCU_REPORT)
    got = dl.measured_profile("paged_decode_split", tmp_path)
    stall = dict(why="waiting for a scoreboard dependency on a L1TEX (local, global, surface, texture) operation",
                 cycles=2.6, share=0.406, cycles_per_issue=6.4)
    assert got == dict(issued_per_scheduler=0.61, active_warps=3.9, dram_pct=71.25, sm_ghz=1.75, duration_ms=0.4,
                       cycles_per_issue=6.4, top_stall=pytest.approx(stall))
    (tmp_path / "ncu_paged_decode_prefetch.txt").write_text(NCU_REPORT.replace("Issued Warp", "Issued Whatever"))
    with pytest.raises(ValueError, match="ncu_paged_decode_prefetch.txt holds no value for"):
        dl.measured_profile("paged_decode_prefetch", tmp_path)
    with pytest.raises(ValueError, match="rung must be one of"):
        dl.measured_profile("mma_fa2", tmp_path)


def test_profile_markdown_sets_the_profile_beside_the_pass(tmp_path):
    (tmp_path / "ncu_paged_decode_split.txt").write_text(NCU_REPORT)
    prof = dl.measured_profile("paged_decode_split", tmp_path)
    loops = {"paged_decode_split": HAND["paged_decode_split"], "paged_decode_prefetch": HAND["paged_decode_prefetch"]}
    text = dl.profile_markdown(loops, {"paged_decode_split": prof, "paged_decode_prefetch": None})
    rate = 64 * 4096 * 8 * 128 * 2 * 2 / 400e-6                   # 1 GiB of K/V in 400 us
    # 0.61 of the clocks at 1.75 GHz: 4 x 1.75e9 x 132 x 32 x 128 bytes / 731 instructions, times 0.61
    at_issue = 0.61 * 4 * 1.75e9 * 132 * 32 * 128 / 731
    assert f"| `paged_decode_split` | {rate / 1e12:.2f} TB/s | 0.61 | {at_issue / 1e12:.2f} TB/s | 71% | 3.9 | 6.4 | " \
           "41%: stalled waiting for a scoreboard dependency on a L1TEX" in text
    assert "| `paged_decode_prefetch` | not profiled |" in text
    quiet = dict(prof, top_stall=None)
    assert "| 6.4 | none named |" in dl.profile_markdown(loops, {"paged_decode_split": quiet})
    with pytest.raises(ValueError, match="whole step"):
        dl.profile_markdown({"paged_decode": HAND["paged_decode"]}, {"paged_decode": prof})
    with pytest.raises(TypeError, match="must be dicts"):
        dl.profile_markdown([], {})


def test_top_stall_reads_the_rule_text_across_its_wrapped_lines():
    got = dl.top_stall(NCU_REPORT)
    assert got["why"].startswith("waiting for a scoreboard dependency on a L1TEX") and got["why"].endswith("operation")
    assert (got["cycles"], got["cycles_per_issue"]) == (2.6, 6.4) and got["share"] == pytest.approx(0.406)
    # 2.6 of 6.4 cycles: the share the report states agrees with its own numbers
    assert got["cycles"] / got["cycles_per_issue"] == pytest.approx(got["share"], abs=0.01)
    assert dl.top_stall(NCU_REPORT.split("    OPT")[0]) is None            # no rule named a stall
    with pytest.raises(TypeError, match="text must be"):
        dl.top_stall(None)


@needs_tools
def test_step_classes_add_up_to_a_steps_instructions():
    for rung in STAGING + SPLIT:
        t = _loop(rung)
        classes = t.step_classes
        assert list(classes) == [name for name, _ in dl.DECODE_CLASSES]
        assert sum(classes.values()) == pytest.approx(t.step_instructions)
    split = _loop("paged_decode_split").step_classes
    # four multiply-adds per value a lane holds (8 values of K and 8 of V per key, 4 keys, 4 heads): 256, and
    # one 16-bit-to-float32 widening per value (2 x 4 x 8 = 64)
    assert split["multiply-adds"] >= 4 * 2 * 4 * 8 and split["16-bit to float32"] == 2 * 4 * 8


@needs_tools
def test_the_decode_step_figure_draws_one_bar_per_step_rung():
    import io

    from matplotlib.patches import Rectangle

    from lessons.views.decode_loads import decode_step_figure

    table = dl.decode_loop_table()
    fig = decode_step_figure(table)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == list(reversed(SPLIT))
    widths = sum(p.get_width() for p in ax.patches if isinstance(p, Rectangle))
    assert widths == pytest.approx(sum(r["step_instructions"] for r in table if r["rung"] in SPLIT))
    texts = [t.get_text() for t in ax.texts]
    for r in table:
        if r["rung"] in SPLIT:
            assert f"{r['step_instructions']:.0f} per step: at most {r['issue_ceiling'] / 1e12:.2f} TB/s" in texts
    # each class's legend entry gives its instructions per step over the rungs, so that one too thin to see (the
    # one exponential, the K/V loads) still reads
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    step = [r for r in table if r["rung"] in SPLIT]
    for name in {name for r in step for name, count in r["step_classes"].items() if count}:
        counts = [round(r["step_classes"][name]) for r in step if r["step_classes"].get(name)]
        span = str(counts[0]) if min(counts) == max(counts) else f"{min(counts)}-{max(counts)}"
        assert f"{name} ({span})" in legend, legend
    assert len(legend) == len({name for r in step for name, count in r["step_classes"].items() if count})
    fig.savefig(io.BytesIO(), format="png")
    with pytest.raises(ValueError, match="whole step"):
        decode_step_figure([r for r in table if r["rung"] in STAGING])
    with pytest.raises(TypeError, match="table must be"):
        decode_step_figure([{"rung": "x"}])


@needs_tools
def test_the_prefetch_rungs_text_quotes_its_sass():
    from lessons.gpu.compile import nvrtc_version

    if nvrtc_version()[:2] != (12, 9):
        pytest.skip("the rung's text quotes NVRTC 12.9's SASS")
    split, pre = _loop("paged_decode_split"), _loop("paged_decode_prefetch")
    text = ladder.decode_rung("paged_decode_prefetch").predicted
    assert (f"a step's rows asked for {pre.load_to_use} instructions before their first use (the split rung: "
            f"{split.load_to_use}), {pre.step_instructions:g} instructions per step (the split rung: "
            f"{split.step_instructions:g})") in text
