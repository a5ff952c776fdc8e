"""Bad input to the public API gets a TypeError/ValueError that names the argument, raised before
any work: flags that are not True/False, sequences that are not sequences of ints, sizes of 0,
non-float arrays that would otherwise be cast silently, and objects of the wrong kind.
Nothing here needs a GPU, NVRTC or the emulator: every call fails in its checks."""
from __future__ import annotations

import numpy as np
import pytest

import lessons
from lessons.core.checks import check_int_sequence
from lessons.course.data import gqa_batch_case
from lessons.gpu import ladder, lesson
from lessons.gpu.backward import kernel_backward_trace
from lessons.gpu.launch import Runner, flash_decoding_gpu, kernel_row_trace, paged_decode_gpu, paged_decode_split_gpu
from lessons.gpu.trace_compare import GpuRowTrace, first_divergence
from lessons.schedules.causal import masked_rows_report
from lessons.schedules.gqa_decode import paged_decode
from lessons.schedules.paged import paged_flash_attention
from lessons.schedules.softmax import online_softmax
from lessons.schedules.split_kv import flash_decoding

RNG = np.random.default_rng(0)
Q, K, V = RNG.standard_normal((4, 8)), RNG.standard_normal((6, 8)), RNG.standard_normal((6, 8))
PAGED = dict(q=np.ones(8), block_table=np.array([0]), k_cache=np.ones((1, 4, 8)), v_cache=np.ones((1, 4, 8)),
             seq_len=3, block_size=4)
GQA_Q, GQA_K, GQA_V, GQA_TABLES, GQA_LENS = gqa_batch_case()


def _paged_batch(block_size: int):
    """A batch of 2 sequences, 4 heads on 2 KV heads, d = 16, in pages of ``block_size`` slots."""
    cache = np.zeros((6, block_size, 2, 16), np.float32)
    return np.zeros((2, 4, 16), np.float32), cache, cache, np.zeros((2, 2), np.int32), np.zeros(2, np.int32)


def _stray_page_batch():
    """Sequence 0 (10 tokens in pages of 4) names page 10**6 of a 6-page cache in its third used block."""
    cache = np.zeros((6, 4, 2, 16), np.float32)
    tables = np.array([[0, 2, 10**6], [5, 1, -1]], np.int32)
    return np.zeros((2, 4, 16), np.float32), cache, cache, tables, np.array([10, 6], np.int32)


@pytest.mark.parametrize("call, error, match", [
    # every return_* flag is True or False, never "any truthy value"
    (lambda: flash_decoding(Q, K, V, 2, return_lse="no"), TypeError, "return_lse must be True or False"),
    (lambda: flash_decoding(Q, K, V, 2, return_partials=1), TypeError, "return_partials must be True or False"),
    (lambda: paged_decode(GQA_Q, GQA_K, GQA_V, GQA_TABLES, GQA_LENS, return_lse="no"), TypeError,
     "return_lse must be True or False"),
    (lambda: paged_flash_attention(**PAGED, return_lse="yes"), TypeError, "return_lse must be True or False"),
    (lambda: paged_flash_attention(**PAGED, return_trace=1), TypeError, "return_trace must be True or False"),
    (lambda: online_softmax(np.ones(3), 2, return_trace="no"), TypeError, "return_trace must be True or False"),
    (lambda: ladder.sdpa_backends(8192, causal="no"), TypeError, "causal must be True or False"),
    # a page of no slots or a cache of no KV heads, before any launch
    (lambda: paged_decode_gpu(*_paged_batch(0), backend="emulator"), ValueError, "at least one slot per page"),
    (lambda: flash_decoding_gpu(*_paged_batch(0), 2, backend="emulator"), ValueError, "at least one slot per page"),
    (lambda: paged_decode_split_gpu(*_paged_batch(0), backend="emulator"), ValueError, "at least one slot per page"),
    (lambda: paged_decode_gpu(*_paged_batch(4), backend="emulator", trace_rows=[]), ValueError,
     "trace_rows must name 1..64"),
    (lambda: paged_decode_gpu(*_paged_batch(4), backend="emulator", trace_rows=[(0, 1), (0, 1)]), ValueError,
     r"must not repeat a \(seq, head\) pair, got \[\[0, 1\], \[0, 1\]\]"),
    # on the emulator the tables are always checked: check_tables=False would read a stray page in this process
    (lambda: paged_decode_gpu(*_stray_page_batch(), check_tables=False, backend="emulator"), ValueError,
     r"block_tables\[0\] points at pages \[1000000\] outside the cache's 6 blocks"),
    (lambda: flash_decoding_gpu(*_stray_page_batch(), 2, check_tables=False, backend="emulator"), ValueError,
     r"block_tables\[0\] points at pages \[1000000\] outside the cache's 6 blocks"),
    (lambda: paged_decode_split_gpu(*_stray_page_batch(), check_tables=False, backend="emulator"), ValueError,
     r"block_tables\[0\] points at pages \[1000000\] outside the cache's 6 blocks"),
    # non-float data is refused, never cast
    (lambda: kernel_backward_trace(*[np.ones((4, 16), int)] * 4, np.zeros(4), np.ones((4, 16)), use_device=False),
     TypeError, "q must have a float dtype"),
    (lambda: lesson.paged_gqa_on_gpu(GQA_Q.astype(complex), GQA_K, GQA_V, GQA_TABLES, GQA_LENS, use_device=False,
                                     emulate=False), TypeError, "q must have a float dtype"),
    (lambda: lesson.paged_decode_on_gpu(**{**PAGED, "k_cache": np.ones((1, 4, 8), int)}, use_device=False,
                                        emulate=False), TypeError, "k_cache must have a float dtype"),
    # bfloat16 bits (uint16) given to the NumPy reference: the message says how to read them
    (lambda: lessons.attention(lessons.gpu.to_bfloat16_bits(Q.astype(np.float32)), K, V), TypeError,
     r"q must have a float dtype .* got dtype uint16; .*lessons.gpu.from_bfloat16_bits\(q\) gives float32"),
    # objects of the wrong kind
    (lambda: ladder.rung_intensity(5), TypeError, "rung must be a Rung or a rung's name, got int"),
    (lambda: ladder.rung_build(5), TypeError, "rung must be a Rung or a rung's name, got int"),
    (lambda: ladder.decode_recorded(5), TypeError, "must be a decode Rung or its name, got int"),
    (lambda: ladder.ladder_points(ds=[64, 32]), ValueError, "ds: the mma_fa2 rung cannot run at d = 32"),
    (lambda: Runner("emulator", kind="torch"), ValueError, "kind must be 'numpy' or 'cupy'"),
    (lambda: first_divergence(GpuRowTrace((0,), np.zeros(1, int), *np.zeros((3, 1))), None), TypeError,
     "numpy_row must be a trace row with arrays m, alpha and l, got NoneType"),
    # sizes that name the argument the caller gave
    (lambda: kernel_row_trace(np.zeros((0, 16)), np.zeros((8, 16)), np.zeros((8, 16)), 8, 0), ValueError,
     "q must hold at least one query row"),
    (lambda: kernel_row_trace(*[np.zeros((8, 16))] * 3, 8, 0, block_q=-5), ValueError, "block_q must be at least 1"),
    (lambda: masked_rows_report(Q, K, V, 0), ValueError, "tile must be at least 1"),
    (lambda: masked_rows_report(np.zeros((0, 8)), K, V, 2), ValueError, r"with Nq >= 1 here, got shape \(0, 8\)"),
    (lambda: lesson.io_on_gpu(ns=np.array(1024), use_device=False), TypeError, "ns must be a sequence of ints"),
    (lambda: lessons.roofline_points(ds=64), TypeError, "ds must be a sequence of ints, got int 64"),
    (lambda: lessons.roofline_points(ds=[64, 0]), ValueError, "ds must be at least 1, got 0"),
    # the fold's own pieces, public as lessons.State and lessons.correction_factor
    (lambda: lessons.State.empty(-1, 3), ValueError, "rows must be at least 0, got -1"),
    (lambda: lessons.State.empty(2.0, 3), TypeError, "rows must be an int, got float 2.0"),
    (lambda: lessons.State.empty(2, 3, int), TypeError, "dtype must be a NumPy float dtype"),
    (lambda: lessons.correction_factor(np.zeros(2), np.zeros(3)), ValueError,
     r"m_old and m_new must have the same shape \(one max per row\), got \(2,\) and \(3,\)"),
    (lambda: lessons.correction_factor(np.zeros(2, int), np.zeros(2)), TypeError, "m_old must have a float dtype"),
    (lambda: lessons.run_variants(None), TypeError, "case must be a Case"),
    (lambda: lessons.run_variants(lessons.example_case(), ["textbook", "nope"]), ValueError,
     "variants must hold names from .*, got 'nope'"),
    # a choice given as an array (or list) is refused by name, not "truth value of an array is ambiguous"
    (lambda: flash_decoding(Q, K, V, 2, order=np.array(["left", "tree"])), ValueError, "order must be one of"),
    (lambda: lessons.reduce_states(np.zeros((2, 3, 4)), np.zeros((2, 3)), order=np.array(["left"])), ValueError,
     "order must be one of"),
    (lambda: lessons.run_variant(["textbook"], Q, K, V, 2), ValueError, "variant must be one of"),
    # the debugger's options: "no" was a causal mask (any truthy value was), a tolerance a NumPy error
    (lambda: lessons.run_variant("textbook", Q, K, V, 2, causal="no"), TypeError, "causal must be True or False"),
    (lambda: lessons.run_variant("textbook", Q, K, V, 2, causal=1), TypeError, "causal must be True or False"),
    (lambda: lessons.run_variant("textbook", Q, K, V, 2, rtol="a"), ValueError,
     "rtol must be a finite number >= 0, got 'a'"),
    (lambda: lessons.run_variant("textbook", Q, K, V, 2, atol=-1e-12), ValueError,
     "atol must be a finite number >= 0, got -1e-12"),
    (lambda: lessons.run_variant("textbook", Q, K, V, 2, rtol=np.nan), ValueError, "rtol must be a finite number"),
    (lambda: lessons.softmax_traffic(np.array(["safe"]), 8), ValueError, "method must be one of"),
    (lambda: lessons.flash_io(64, 8, m_bytes=1 << 17, order=["fa2"]), ValueError, "order must be 'fa1' or 'fa2'"),
])
def test_bad_input_is_refused_with_a_message_naming_it(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("values", [np.array(3), np.array([[1, 2]]), "12", b"\x01", bytearray(b"\x01"), {1: 2},
                                    {1, 2}, frozenset({1}), 3, None])
def test_check_int_sequence_refuses_what_is_not_an_ordered_sequence(values):
    with pytest.raises(TypeError, match="sizes must be a sequence of ints"):
        check_int_sequence(values, "sizes")


def test_check_int_sequence_takes_lists_tuples_ranges_1d_arrays_and_generators():
    assert check_int_sequence([3, np.int64(4)], "ns") == (3, 4)
    assert check_int_sequence(np.array([5, 6]), "ns", min=5, count=2) == (5, 6)
    assert check_int_sequence(range(2), "ns") == (0, 1)
    assert check_int_sequence((x for x in (7,)), "ns", count=1) == (7,)
    with pytest.raises(ValueError, match=r"ns must hold at least one int, got \(\)"):
        check_int_sequence([], "ns")
    with pytest.raises(ValueError, match=r"shape must hold 2 ints, got \(1,\)"):
        check_int_sequence([1], "shape", count=2)
    with pytest.raises(ValueError, match="ns must be at least 1, got 0"):
        check_int_sequence([1, 0], "ns", min=1)
    with pytest.raises(TypeError, match="ns must be an int, got bool True"):
        check_int_sequence([True], "ns")


def test_repeated_head_dims_are_listed_once():
    once = ladder.ladder_points(ds=[64])
    assert ladder.ladder_points(ds=[64, 64]) == once and {p["d"] for p in once} == {64}
    assert len({(p["name"], p["d"]) for p in once}) == len(once) == len(ladder.RUNGS)


def test_flags_accept_numpy_bools():
    out, lse = flash_decoding(Q, K, V, 2, return_lse=np.True_)
    ref_out, ref_lse = lessons.attention(Q, K, V, return_lse=True)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_check_positive_real_takes_finite_numbers_above_zero_and_names_what_it_refuses():
    import math

    from lessons.core.checks import check_positive_real

    assert check_positive_real(67e12, "peak_flops") == 67e12 and check_positive_real(np.float32(2.5), "x") == 2.5
    assert check_positive_real(3, "x") == 3.0 and isinstance(check_positive_real(np.int64(3), "x"), float)
    for bad in (0, -1.0, math.inf, math.nan, True, np.bool_(True), "1", None):
        with pytest.raises(ValueError, match=r"peak_flops must be a positive finite number of FLOP/s, got"):
            check_positive_real(bad, "peak_flops", "number of FLOP/s")


def test_run_variants_takes_one_name_as_one_variant():
    case = lessons.example_case()
    one = lessons.run_variants(case, "textbook")
    assert list(one) == ["textbook"]
    ref = lessons.attention(case.q, case.k, case.v, scale=case.scale)
    np.testing.assert_allclose(one["textbook"].output[-1], ref, rtol=1e-12, atol=1e-12)


def test_state_empty_and_correction_factor_still_take_what_they_documented():
    s = lessons.State.empty(np.int64(2), 0, np.float32)
    assert s.m.dtype == np.float32 and s.o.shape == (2, 0) and np.isneginf(s.m).all() and not s.l.any()
    alpha = lessons.correction_factor(np.array([-np.inf, 1.0, -np.inf]), np.array([-np.inf, 3.0, 0.5]))
    np.testing.assert_array_equal(alpha, [0.0, np.exp(1.0 - 3.0), 0.0])
