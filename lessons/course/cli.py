"""The series' command line: ``python -m lessons COMMAND``.

Commands
--------
trace
    Print, tile by tile, what flash attention does for one query row: the key
    range of each tile, the running max ``m``, the correction factor ``alpha``,
    the running sum ``l`` and how far ``o / l`` still is from the exact output.

The numbers come from :func:`lessons.flash_attention` (``return_trace=True``) and
:func:`lessons.attention`; this module only parses options and prints tables
(argparse, rich). A new command is one ``_add_<name>(subparsers)`` function that
registers a subparser whose ``handler`` default takes ``(args, parser)``.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

__all__ = ["build_parser", "main", "trace_rows"]

PROG = "python -m lessons"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


MAX_TILE = 2048    # late-max builds N = 2 * tile keys; the exact reference holds an N x N matrix


def _tile(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_TILE:
        raise argparse.ArgumentTypeError(
            f"must be at most {MAX_TILE}, got {value} (the exact reference the table compares with "
            f"materialises S, which grows as the square of N)")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m lessons`` parser with one subparser per command."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Flash Attention, tile by tile: command-line views of the lessons.",
        epilog=f"example: {PROG} trace --row 5\nrun '{PROG} COMMAND --help' for a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    _add_trace(sub)
    return parser


def _add_trace(sub) -> None:
    p = sub.add_parser(
        "trace",
        help="print the running state (m, alpha, l) of one query row, one key tile at a time",
        description=(
            "Run flash attention on one head and print, for one query row, a line per absorbed key\n"
            "tile: the keys it held, the running max m, the correction factor alpha = exp(m_old - m),\n"
            "the running sum l, and max |o/l - exact| so far, where exact is the textbook output.\n"
            "The last line's error is float rounding: the tiled result is exact."
        ),
        epilog=(
            "examples:\n"
            f"  {PROG} trace                         # real data, layer 0, head 0, row 0, tiles of 16\n"
            f"  {PROG} trace --row 5 --tile 32 --layer 3 --head 7\n"
            f"  {PROG} trace --data late-max          # the max arrives in the last tile: alpha < 1\n"
            f"  {PROG} trace --causal --dtype float32"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--data", choices=("real", "random", "late-max"), default="real",
                   help="real: q, k, v of all-MiniLM-L6-v2 reading a sentence (N = 128, d = 32); "
                        "random: Gaussian (N = 128, d = 32); late-max: a made-up case whose row 0 "
                        "meets its largest score in the last tile (N = max(64, 2 * tile), d = 8: "
                        "at least two tiles for any --tile). Default: real")
    p.add_argument("--layer", type=int, default=None, help="model layer, 0-based (--data real only; default 0)")
    p.add_argument("--head", type=int, default=None, help="attention head, 0-based (--data real only; default 0)")
    p.add_argument("--row", type=int, default=None,
                   help="query row to follow, 0..N-1 (default 0, or N-1 with --causal so it sees every key)")
    p.add_argument("--tile", type=_tile, default=16, help=f"keys per tile, block_k (1 to {MAX_TILE}; default 16)")
    p.add_argument("--block-q", type=_positive_int, default=64,
                   help="query rows per block, block_q (default 64); under --causal a block absorbs a tile "
                        "if any of its rows sees a key in it")
    p.add_argument("--causal", action="store_true",
                   help="causal mask (query i sees keys j <= i); tiles wholly in the future are skipped")
    p.add_argument("--dtype", choices=("float64", "float32"), default="float64",
                   help="precision of the flash run (the exact output is always float64; default float64)")
    p.add_argument("--seed", type=_non_negative_int, default=0, help="seed for --data random / late-max (default 0)")
    p.set_defaults(handler=_run_trace, subparser=p)


def trace_rows(q, k, v, row: int, *, tile: int, block_q: int = 64, causal: bool = False) -> list[dict]:
    """The per-tile rows that ``python -m lessons trace`` prints, as dicts.

    Parameters
    ----------
    q : float array (N, d); k : (Nk, d); v : (Nk, dv) - one head, in the dtype to run.
    row : query row, ``0 <= row < N``.
    tile : keys per tile (int >= 1); block_q : query rows per block (int >= 1).
    causal : bottom-right aligned causal mask, as in :func:`lessons.flash_attention`.

    Returns one dict per absorbed tile with keys ``tile`` (int, the key tile's number
    counted from 1, as the tile stepper counts: keys ``[(tile-1)*T, tile*T)``), ``key_start``,
    ``key_stop`` (ints, keys ``[key_start, key_stop)``), ``visible`` (int, how many of
    those keys this row may see: fewer under a causal mask), ``m``, ``alpha``, ``l`` and
    ``error`` (floats; ``error`` = max |o/l - exact| after that tile, exact being
    :func:`lessons.attention` in float64 on the same values) and ``rescaled`` (bool).

    Raises IndexError for a row out of range, and the errors of the attention functions.
    """
    from lessons.schedules.flash import flash_attention
    from lessons.core.reference import attention

    _, trace = flash_attention(q, k, v, tile, block_q=block_q, causal=causal, return_trace=True)
    rt = trace.row(row)
    exact = attention(*(np.asarray(x, dtype=np.float64) for x in (q, k, v)), causal=causal)[rt.row]
    errors = rt.errors(exact)
    return [dict(tile=int(rt.tile[i]) + 1, key_start=int(rt.key_start[i]), key_stop=int(rt.key_stop[i]),
                 visible=int(np.isfinite(rt.scores[i]).sum()),
                 m=float(rt.m[i]), alpha=float(rt.alpha[i]), l=float(rt.l[i]), error=float(errors[i]),
                 rescaled=bool(rt.rescaled[i]))
            for i in range(len(rt))]


def _load(args, parser):
    """q, k, v (float64) and a header describing them; parser.error on bad options."""
    from lessons.course.data import load_sample, make_case

    if args.data == "real":
        sample = load_sample()
        layer = 0 if args.layer is None else args.layer
        head = 0 if args.head is None else args.head
        model = sample.model.split("/")[-1]
        if not 0 <= layer < sample.layers:
            parser.error(f"argument --layer: must be in 0..{sample.layers - 1} "
                         f"({model} has {sample.layers} layers), got {layer}")
        if not 0 <= head < sample.heads:
            parser.error(f"argument --head: must be in 0..{sample.heads - 1} "
                         f"({model} has {sample.heads} heads per layer), got {head}")
        q, k, v = make_case("real", layer=layer, head=head)
        about = (f"{model}, layer {layer}, head {head}\n"
                 f"text: \"{sample.text[:60]}...\"")
        return q, k, v, about, sample.tokens
    for name in ("layer", "head"):
        if getattr(args, name) is not None:
            parser.error(f"argument --{name}: only applies to --data real (got --data {args.data})")
    try:
        q, k, v = make_case(args.data, tile=args.tile, seed=args.seed)
    except ValueError as e:
        option = "--tile" if args.data == "late-max" else "--data"
        parser.error(f"argument {option}: {e}")
    about = {"random": f"Gaussian random q, k, v (seed {args.seed})",
             "late-max": f"late-max case built for tiles of {args.tile} (seed {args.seed}): "
                         "row 0 meets its largest score in the last tile"}[args.data]
    return q, k, v, about, None


def _token_context(tokens, row: int, width: int = 3) -> str:
    lo, hi = max(0, row - width), min(len(tokens), row + width + 1)
    words = [f"<<{t}>>" if i == row else t for i, t in enumerate(tokens[lo:hi], start=lo)]
    return ("... " if lo > 0 else "") + " ".join(words) + (" ..." if hi < len(tokens) else "")


def _run_trace(args, parser) -> int:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    q, k, v, about, tokens = _load(args, parser)
    n = q.shape[0]
    row = args.row if args.row is not None else (n - 1 if args.causal else 0)
    if not 0 <= row < n:
        parser.error(f"argument --row: must be in 0..{n - 1} (N = {n} query rows), got {row}")
    dtype = np.dtype(args.dtype)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    rows = trace_rows(q, k, v, row, tile=args.tile, block_q=args.block_q, causal=args.causal)

    console = Console(highlight=False)
    console.print(Text(about))
    console.print(Text(f"N = {n} keys, d = {q.shape[1]}, {dtype.name}, tile = {args.tile} keys, "
                       f"block_q = {args.block_q}"
                       + (", causal" if args.causal else "")))
    what = f"query row {row}"
    if tokens is not None:
        what += f": token {tokens[row]!r}   {_token_context(tokens, row)}"
    console.print(Text(what, style="bold"))

    table = Table("tile", "keys", *(["visible"] if args.causal else []), "m", "alpha", "l", "max |o/l - exact|",
                  caption="exact = lessons.attention in float64. alpha = 0 on the first tile: nothing to "
                          "rescale yet; alpha < 1 later (marked *): the max rose, so l and o were rescaled."
                          + (" visible 0: the tile was absorbed for later rows of the query block "
                             "(try --block-q 1)." if args.causal and any(r["visible"] == 0 for r in rows) else ""),
                  caption_justify="left")
    for col in table.columns[2:]:                 # numbers right-aligned
        col.justify = "right"
    for r in rows:
        alpha = f"{r['alpha']:.6g}" + ("*" if r["rescaled"] else " ")
        visible = [Text(str(r["visible"]))] if args.causal else []
        table.add_row(Text(str(r["tile"])), Text(f"[{r['key_start']}, {r['key_stop']})"), *visible,
                      Text(f"{r['m']:.6g}"), Text(alpha, style="bold yellow" if r["rescaled"] else ""),
                      Text(f"{r['l']:.6g}"), Text(f"{r['error']:.2e}"))
    console.print(table)
    eps = np.finfo(dtype).eps
    console.print(Text(f"after {len(rows)} tile{'s' * (len(rows) != 1)}: max |o/l - exact| = {rows[-1]['error']:.2e} "
                       f"({dtype.name} eps = {eps:.1e}); rescales: {sum(r['rescaled'] for r in rows)}"))
    return 0


def main(argv=None) -> int:
    """Run ``python -m lessons`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code.

    No command prints the help and returns 0. Bad options exit with code 2 and a
    one-line message naming the option (argparse's ``parser.error``).
    """
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.command is None:
        parser.print_help()
        return 0
    return args.handler(args, args.subparser)
