"""Sizes of the score matrix, against hand computations."""
import numpy as np
import pytest

from lessons.cost.sizes import format_bytes, score_matrix_bytes


def test_the_headline_number_n8192_32_heads_fp16_is_4_gib():
    # 8192 * 8192 scores per head, 32 heads, 2 bytes each: 2**13 * 2**13 * 2**5 * 2 = 2**32 bytes.
    assert score_matrix_bytes(8192, 8192, heads=32, dtype="float16") == 8192 * 8192 * 32 * 2
    assert score_matrix_bytes(8192, 8192, heads=32, dtype="float16") == 4 * 1024**3
    assert format_bytes(score_matrix_bytes(8192, 8192, heads=32)) == "4.00 GiB"


@pytest.mark.parametrize("dtype, itemsize", [("float16", 2), ("float32", 4), (np.float64, 8),
                                             (np.dtype("float32"), 4), ("bfloat16", 2), ("bf16", 2),
                                             ("fp8", 1)])
def test_bytes_scale_with_every_factor(dtype, itemsize):
    assert score_matrix_bytes(3, 5, heads=7, batch=2, dtype=dtype) == 3 * 5 * 7 * 2 * itemsize
    assert score_matrix_bytes(1, 1, dtype=dtype) == itemsize


def test_rectangular_matrix_is_nq_times_nk():
    # One decode query against 4096 cached keys: a single row of S.
    assert score_matrix_bytes(1, 4096, dtype="float32") == 4096 * 4
    assert score_matrix_bytes(64, 64) == 64 * 64 * 2   # one block_q x tile slice in fp16


@pytest.mark.parametrize("kwargs, exc, word", [
    (dict(n_queries=0, n_keys=4), ValueError, "n_queries"),
    (dict(n_queries=4, n_keys=-1), ValueError, "n_keys"),
    (dict(n_queries=4, n_keys=4, heads=0), ValueError, "heads"),
    (dict(n_queries=4, n_keys=4, batch=0), ValueError, "batch"),
    (dict(n_queries=4.0, n_keys=4), TypeError, "n_queries"),
    (dict(n_queries=True, n_keys=4), TypeError, "n_queries"),
    (dict(n_queries=4, n_keys="4"), TypeError, "n_keys"),
    (dict(n_queries=4, n_keys=4, dtype="int32"), TypeError, "dtype"),
    (dict(n_queries=4, n_keys=4, dtype="not-a-dtype"), TypeError, "dtype"),
    (dict(n_queries=4, n_keys=4, dtype=None), TypeError, "dtype"),        # NumPy would read None as float64
    (dict(n_queries=4, n_keys=4, dtype=object), TypeError, "dtype"),
    (dict(n_queries=4, n_keys=4, dtype=str), TypeError, "dtype"),
    (dict(n_queries=4, n_keys=4, dtype="V"), TypeError, "dtype"),
    (dict(n_queries=4, n_keys=4, dtype=np.complex128), TypeError, "dtype"),
])
def test_bad_input_names_the_argument(kwargs, exc, word):
    with pytest.raises(exc, match=word):
        score_matrix_bytes(**kwargs)


def test_numpy_integers_are_accepted():
    assert score_matrix_bytes(np.int64(16), np.int32(8)) == 16 * 8 * 2


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"),
                                     (1536, "1.50 KiB"), (3 * 1024**2, "3.00 MiB"),
                                     (5 * 1024**4, "5.00 TiB"), (2048 * 1024**4, "2048.00 TiB"),
                                     # the unit is chosen after rounding: 1023.995 KiB and up print as MiB
                                     (2**20 - 1, "1.00 MiB"), (1023 * 1024 + 1018, "1023.99 KiB"),
                                     (1023 * 1024 + 1019, "1.00 MiB"), (2**30 - 1, "1.00 GiB"),
                                     (2**40 - 1, "1.00 TiB")])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


@pytest.mark.parametrize("n, exc", [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_format_bytes_rejects_bad_input(n, exc):
    with pytest.raises(exc, match="n must"):
        format_bytes(n)
