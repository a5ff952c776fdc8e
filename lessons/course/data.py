"""The inputs the lessons run on: real q, k, v from a pretrained model, and two made-up cases.

* ``"real"`` - q, k, v captured from all-MiniLM-L6-v2 (a 6-layer BERT encoder, 12 heads of
  dimension 32; Apache-2.0): a bidirectional sentence encoder, not a generative language
  model, so its own attention has no causal mask; the causal lessons apply one to these
  q, k, v for teaching. Reading the opening of *Alice's Adventures in Wonderland*
  (Lewis Carroll, 1865; public domain). Shipped with the package in ``lessons/course/sample_data/``
  (float16, under 2 MB) together with the model's own attention output for layers 0 and 5,
  so the lessons can check their attention against what the real model computed.
  ``scripts/capture_sample.py`` made the files and says how to redo it.
* ``"random"`` - Gaussian q, k, v: the usual unit-test input.
* ``"late-max"`` - a hand-made case whose first query row meets its largest score only in
  the last key tile, so the running max moves late and the correction factor alpha < 1
  shows up at the end.

Sources: Vaswani et al. 2017, Eq. 1 (the attention being fed); Wang et al. 2020 (MiniLM);
Reimers & Gurevych 2019 (Sentence-BERT, the all-MiniLM-L6-v2 training recipe).
"""
from __future__ import annotations

import functools
import json
import types
from dataclasses import dataclass, field
from importlib import resources

import numpy as np

from lessons.core.checks import check_int, check_positive_int

__all__ = ["Sample", "load_sample", "random_case", "late_max_case", "late_max_keys", "make_case", "CASE_KINDS",
           "softmax_demo_rows", "paged_case", "decode_query_case", "gqa_batch_case"]

CASE_KINDS = ("real", "random", "late-max")
_NPZ = "minilm_sample.npz"
_JSON = "minilm_sample.json"


@dataclass(frozen=True, eq=False)
class Sample:
    """q, k, v of every layer and head of all-MiniLM-L6-v2 on one English text.

    Attributes
    ----------
    q, k, v : read-only float16 ndarrays, shape (layers, heads, N, d) = (6, 12, N, 32)
        The outputs of each layer's query/key/value projections, split into heads as the
        model does. The model attends with ``softmax(q k^T / sqrt(d)) v`` and no mask
        (one unpadded sentence), so the default ``scale`` of :func:`lessons.attention` fits.
    tokens : tuple of N str
        The WordPiece tokens, ``[CLS]`` first and ``[SEP]`` last (all attended to).
    text : str
        The text those N tokens cover.
    model : str
        The model's name, ``"sentence-transformers/all-MiniLM-L6-v2"``.
    licence : str
        The model's licence (Apache-2.0).
    source : str
        Where the text comes from.
    text_licence : str
        The text's licence (public domain).
    context : mapping ``layer -> read-only ndarray (heads, N, d)``
        The model's own attention output (before its output projection) for the stored
        layers: layer 0 in float32, the last layer in float16. A check value computed
        by PyTorch in float32, not by this package.
    metadata : mapping
        Everything in ``minilm_sample.json`` (capture command, versions, shapes).

    Source: Wang et al. 2020 (MiniLM); Vaswani et al. 2017, Eq. 1 (the attention fed).
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    tokens: tuple
    text: str
    model: str
    licence: str
    source: str
    text_licence: str
    context: types.MappingProxyType = field(repr=False)
    metadata: types.MappingProxyType = field(repr=False)

    def __repr__(self) -> str:
        return (f"Sample(model={self.model!r}, layers={self.layers}, heads={self.heads}, "
                f"n={self.n}, d={self.d}, dtype={self.q.dtype}, text={self.text[:40]!r}...)")

    @property
    def layers(self) -> int:
        """Number of layers (6)."""
        return self.q.shape[0]

    @property
    def heads(self) -> int:
        """Number of attention heads per layer (12)."""
        return self.q.shape[1]

    @property
    def n(self) -> int:
        """Number of tokens N (sequence length, [CLS] and [SEP] included)."""
        return self.q.shape[2]

    @property
    def d(self) -> int:
        """Head dimension d (32)."""
        return self.q.shape[3]

    def qkv(self, layer: int, head: int, dtype=np.float64):
        """q, k, v of one head of one layer, as new (writable) arrays.

        Parameters
        ----------
        layer : int in ``0 .. layers-1``
        head : int in ``0 .. heads-1``
        dtype : a NumPy float dtype, default float64 (the stored values are float16,
            so any float dtype represents them exactly).

        Returns
        -------
        (q, k, v) : three ndarrays of shape (N, d) in ``dtype``.

        Raises TypeError for a non-int layer/head or a non-float dtype, ValueError for a
        layer or head out of range (the message names the argument and the valid range).
        """
        layer = self._index(layer, "layer", self.layers)
        head = self._index(head, "head", self.heads)
        dt = _float_dtype(dtype)
        return tuple(a[layer, head].astype(dt) for a in (self.q, self.k, self.v))

    def model_output(self, layer: int, head: int, dtype=np.float64) -> np.ndarray:
        """The model's own attention output for one head, shape (N, d), in ``dtype``.

        Only the stored layers have one (``sorted(sample.context)``: 0 and the last).
        Raises TypeError / ValueError as :meth:`qkv` does, and ValueError naming the
        stored layers for any other layer.
        """
        layer = self._index(layer, "layer", self.layers)
        head = self._index(head, "head", self.heads)
        if layer not in self.context:
            raise ValueError(
                f"layer {layer} has no stored model output; stored layers: {sorted(self.context)}"
            )
        return self.context[layer][head].astype(_float_dtype(dtype))

    @staticmethod
    def _index(value, name: str, size: int) -> int:
        value = check_int(value, name)
        if not 0 <= value < size:
            raise ValueError(f"{name} must be in 0..{size - 1}, got {value}")
        return int(value)


def _float_dtype(dtype) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be a NumPy float dtype, got {dtype!r}") from None
    if not np.issubdtype(dt, np.floating):
        raise TypeError(f"dtype must be a float dtype (float16/32/64), got {dt}")
    return dt


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@functools.lru_cache(maxsize=1)
def load_sample() -> Sample:
    """Load the shipped all-MiniLM-L6-v2 sample (cached: later calls return the same object).

    Returns
    -------
    Sample with q, k, v of shape (6, 12, N, 32) float16 (N = 128), read-only.

    Raises FileNotFoundError if ``lessons/course/sample_data/minilm_sample.npz`` or ``.json`` is missing
    (a broken install; reinstall the package, or rerun ``scripts/capture_sample.py``).

    Source: all-MiniLM-L6-v2 (Wang et al. 2020; Reimers & Gurevych 2019), captured by
    ``scripts/capture_sample.py``.
    """
    folder = resources.files("lessons.course") / "sample_data"
    npz, meta_file = folder / _NPZ, folder / _JSON
    for f in (npz, meta_file):
        if not f.is_file():
            raise FileNotFoundError(f"the sample file {f} is missing; rerun scripts/capture_sample.py")
    meta = json.loads(meta_file.read_text(encoding="utf-8"))
    with resources.as_file(npz) as path, np.load(path, allow_pickle=False) as z:
        arrays = {name: z[name] for name in z.files}
    context = {int(name.removeprefix("context_layer")): _read_only(a)
               for name, a in arrays.items() if name.startswith("context_layer")}
    return Sample(
        q=_read_only(arrays["q"]), k=_read_only(arrays["k"]), v=_read_only(arrays["v"]),
        tokens=tuple(str(t) for t in arrays["tokens"]),
        text=meta["text"], model=meta["model"], licence=meta["model_licence"],
        source=meta["text_source"], text_licence=meta["text_licence"],
        context=types.MappingProxyType(dict(sorted(context.items()))),
        metadata=types.MappingProxyType(meta),
    )


def random_case(n: int = 128, d: int = 32, *, seed: int = 0):
    """Gaussian q, k, v: every entry drawn from N(0, 1).

    Parameters
    ----------
    n : int >= 1, number of queries and of keys (Nq = Nk = n).
    d : int >= 1, head dimension (also dv).
    seed : int, for ``numpy.random.default_rng``; the same seed gives the same arrays.

    Returns
    -------
    (q, k, v) : float64 ndarrays of shape (n, d).

    Raises TypeError / ValueError (naming the argument) for a non-int or a value < 1.
    """
    n = check_positive_int(n, "n")
    d = check_positive_int(d, "d")
    rng = np.random.default_rng(_seed(seed))
    q, k, v = (rng.standard_normal((n, d)) for _ in range(3))
    return q, k, v


def late_max_case(n: int = 64, d: int = 8, *, tile: int = 16, seed: int = 0):
    """A hand-made case where query row 0 meets its largest score in the LAST key tile.

    How it is made (with the default scale ``1/sqrt(d)``):

    * ``q[0] = sqrt(d) * e_0``, so row 0's score for key j is exactly ``s[0, j] = k[j, 0]``;
    * column ``k[:, 0]`` is set by hand: every key gets a background score drawn uniformly
      from [-1, 0.5]; key ``tile // 2`` (in the first tile) gets 1.0; the last key
      ``n - 1`` (in the last tile) gets 4.0;
    * everything else (the other rows of q, the other columns of k, and v) is N(0, 1).

    So when the keys stream through in tiles of ``tile``, row 0's running max is 1.0 after
    the first tile and stays there (``alpha = 1``) through every middle tile, then jumps to
    4.0 in the last tile, where ``alpha = exp(1 - 4) ~= 0.050`` rescales everything summed
    so far. Key n-1 then carries about half of row 0's softmax weight.

    Parameters
    ----------
    n : int, number of queries and keys; must be more than ``tile`` (at least two tiles).
    d : int >= 1, head dimension (also dv).
    tile : int >= 1, the key-tile size the case is built for (block_k).
    seed : int, for the random parts.

    Returns
    -------
    (q, k, v) : float64 ndarrays of shape (n, d).

    Raises TypeError for non-ints, ValueError (naming the argument) for ``n <= tile`` or
    a value < 1.

    Source: the rescale is Milakov & Gimelshein 2018 (online softmax), Dao et al. 2022, Alg. 1.
    """
    n = check_positive_int(n, "n")
    d = check_positive_int(d, "d")
    tile = check_positive_int(tile, "tile")
    if n <= tile:
        raise ValueError(f"n must be more than tile so that there are at least two tiles, got n={n}, tile={tile}")
    rng = np.random.default_rng(_seed(seed))
    q, k, v = (rng.standard_normal((n, d)) for _ in range(3))
    q[0] = 0.0
    q[0, 0] = np.sqrt(d)
    k[:, 0] = rng.uniform(-1.0, 0.5, size=n)
    k[tile // 2, 0] = 1.0          # the first tile's peak: the running max until the end
    k[n - 1, 0] = 4.0              # the real maximum, in the last tile
    return q, k, v


def make_case(kind: str, *, layer: int = 0, head: int = 0, tile: int = 16, seed: int = 0):
    """q, k, v for one of the lesson's input kinds, as float64 2-D arrays.

    Parameters
    ----------
    kind : ``"real"`` (one head of the all-MiniLM-L6-v2 sample: N = 128, d = 32; uses
        ``layer`` and ``head``), ``"random"`` (:func:`random_case` with n = 128, d = 32;
        uses ``seed``) or ``"late-max"`` (:func:`late_max_case` with
        n = :func:`late_max_keys` ``(tile)`` = max(64, 2 * tile), d = 8; uses ``tile``
        and ``seed``: 64 keys up to tiles of 32, and always at least two tiles, so
        every tile size gets a case). Arguments a kind does not use are ignored.
    tile : int >= 1, keys per tile (only ``"late-max"`` uses it).

    Returns
    -------
    (q, k, v) : float64 ndarrays of shape (N, d).

    Raises ValueError naming ``kind`` and the valid choices for any other kind, and the
    errors of :meth:`Sample.qkv`, :func:`random_case` or :func:`late_max_case`.
    """
    if not isinstance(kind, str) or kind not in CASE_KINDS:
        raise ValueError(f"kind must be one of {', '.join(map(repr, CASE_KINDS))}; got {kind!r}")
    if kind == "real":
        return load_sample().qkv(layer, head, dtype=np.float64)
    if kind == "random":
        return random_case(seed=seed)
    return late_max_case(late_max_keys(tile), tile=tile, seed=seed)


def late_max_keys(tile: int) -> int:
    """The number of keys (and queries) of ``make_case("late-max", tile=tile)``: max(64, 2 * tile).

    64 for the usual tile sizes (up to 32); for larger tiles exactly two tiles, so the
    late maximum always has a first tile to be late after. Raises TypeError/ValueError
    for a ``tile`` that is not an int >= 1.
    """
    return max(64, 2 * check_positive_int(tile, "tile"))


def _seed(seed) -> int:
    seed = check_int(seed, "seed")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    return int(seed)


def softmax_demo_rows(n_cols: int = 700, *, seed: int = 0) -> np.ndarray:
    """The small batch notebook 01's online-softmax kernel is checked on: float32 (3, n_cols).

    Row 0: scores ``3 * N(0, 1)``; row 1: scores drawn the same way, but its first ``n_cols * 3 // 7``
    entries ``-inf`` (with tiles of 256 its whole first tile is masked: the NaN trap of notebook 01,
    section 5); row 2: all ``-inf`` (a row that sees nothing: y = 0, lse = -inf).
    """
    x = (3.0 * np.random.default_rng(seed).standard_normal((3, n_cols))).astype(np.float32)
    x[1, : n_cols * 3 // 7] = -np.inf
    x[2] = -np.inf
    return x


def paged_case():
    """Notebook 07's decode step: one real head (layer 0, head 0), 100 tokens in a shuffled pool of
    16 pages of 16 slots (NaN in the unused slots), the query of token 99.

    Returns ``(q, block_table, k_cache, v_cache, seq_len, block_size)``: float64 ``q`` (d,), int
    ``block_table`` (7,), float64 caches (16, 16, d), ints 100 and 16
    (:func:`lessons.schedules.paged.write_paged_cache`, seed 3).
    """
    from lessons.schedules.paged import write_paged_cache
    q_all, k_all, v_all = load_sample().qkv(0, 0, dtype=np.float64)
    seq_len, block_size = 100, 16
    block_table, k_cache, v_cache = write_paged_cache(k_all[:seq_len], v_all[:seq_len], block_size,
                                                      num_blocks=16, seed=3)
    return q_all[seq_len - 1], block_table, k_cache, v_cache, seq_len, block_size


def decode_query_case():
    """Notebook 08's decode step: the last query of layer 0, head 0 of the real sample against its 128 keys.

    Returns float64 ``(q, k, v)``: ``q`` (32,), ``k``, ``v`` (128, 32).
    """
    q, k, v = load_sample().qkv(0, 0, dtype=np.float64)
    return q[-1], k, v


def gqa_batch_case():
    """Notebook 09's decode batch (the same generator, seeds and order): 4 sequences of 1, 15, 16 and
    37 tokens, 8 query heads on 2 KV heads, d = 64, pages of 16, NaN in the unused slots.

    Returns ``(q, k_cache, v_cache, block_tables, seq_lens)``: float64 ``q`` (4, 8, 64), caches
    (num_blocks, 16, 2, 64), int ``block_tables`` (4, max_blocks_per_seq) with -1 padding, int
    ``seq_lens`` (4,) (:func:`lessons.schedules.gqa_decode.write_paged_batch`, seed 1).
    """
    from lessons.schedules.gqa_decode import write_paged_batch
    rng = np.random.default_rng(0)
    num_heads, num_kv_heads, d, block_size = 8, 2, 64, 16
    lengths = [1, 15, 16, 37]
    keys = [rng.standard_normal((n, num_kv_heads, d)) for n in lengths]
    values = [rng.standard_normal((n, num_kv_heads, d)) for n in lengths]
    k_cache, v_cache, block_tables, seq_lens = write_paged_batch(keys, values, block_size, seed=1)
    return rng.standard_normal((len(lengths), num_heads, d)), k_cache, v_cache, block_tables, seq_lens
