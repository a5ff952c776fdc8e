"""Ring attention across real processes: each MPI rank is one device of the ring.

Run it with ``mpiexec -n W python -m lessons.distributed.ring --n 4096 --d 64``
(options: ``--causal``, ``--schedule kv|q``, ``--split contiguous|zigzag``,
``--out DIR``, ``--block-k``, ``--seed``, ``--device cpu|gpu|emulator``; ``--help`` lists them).

``--device cpu`` (default): the ranks fold with the NumPy fold of :mod:`lessons.core`, in
float64. ``--device gpu``: every rank folds with the course's CUDA forward kernel
:func:`lessons.gpu.flash_attention_gpu` (``backend="cupy"``, float32; one GPU per rank, so
``W`` ranks want ``W`` devices, rank ``r`` taking device ``r mod count``). ``--device
emulator``: the same CUDA C on the course's CPU emulator (``backend="emulator"``), so the
multi-GPU pattern runs, and is tested, on a machine without a GPU. On both, for each pair
(query chunk, KV chunk) the causal rule (:func:`lessons.core.causal_rule.tile_kind` on the
chunks' global positions) says *full* (the kernel without mask), *skipped* (nothing to do)
or *diagonal* (``causal=True``; the chunks are then the same rows, so the kernel's
bottom-right mask on equal lengths is the global one; unequal ranges raise ValueError).
The kernel returns the pair's normalised partial ``(out, lse)``; the rank merges it into its
running state as flash-decoding merges its partials
(:func:`lessons.schedules.split_kv._as_state`, ``m = lse``, ``l = 1``, then
:func:`lessons.core.state.merge`). So on a device the state kept (and recorded per step) is
in this merged form: its ``m`` and ``l`` differ from the NumPy fold's, while ``m + log l``
(the lse so far) and the finished ``out``/``lse`` are the same up to float32 rounding.
Inputs become float32, and so are the messages. The transfers are staged through host
memory: the kernel copies its inputs to the device and its partial back (CuPy arrays to
NumPy) before the state or the block is sent with MPI; a CUDA-aware MPI could send the
device buffers directly and skip the copies. ``--block-k`` is ignored there (the kernel
uses its own tiles).

Rank ``r`` generates only its own rows of the problem (:func:`make_inputs`, the same
numbers whatever ``W`` is), so no rank ever holds the whole sequence:

* ``--schedule kv`` (Liu et al. 2023, Ring Attention, Alg. 1): the rank keeps its query
  block and state ``(m, l, o)``; at every step it posts ``Irecv`` of the next KV block
  from rank ``r - 1`` and ``Isend`` of the one it holds to rank ``r + 1``, folds the held
  block while the transfer runs, then waits. Communication overlaps compute.
* ``--schedule q``: the KV block stays; the query block travels with its running state.
  The state can only be sent once it is folded, so the transfer (``Sendrecv``) sits on the
  critical path; after the last step one more send returns each finished state to its owner.

On ``--device cpu`` both call :func:`lessons.schedules.ring.fold_block`, the same fold as
the one-process simulation :func:`lessons.ring_attention`, which can therefore be compared
with the real run step by step (on a device, :func:`fold_block_kernel` folds the same
blocks at the same steps; :func:`lessons.distributed.launch.compare_with_simulation` then
compares the lse so far). Rank 0 gathers the output rows and every rank's timeline and
writes them to ``--out``: ``result.npz`` (``out``, ``lse``, the state ``m``/``l`` after
every step on every rank; float32 and in the merged form on a device) and
``timeline.json`` (its ``meta`` names the ``device``, ``dtype`` and ``state_form``). Per
rank and step the timeline holds, in
seconds from a common start (a barrier): ``compute`` (the fold), ``send`` and ``recv``
(from posting the transfer to the moment the rank saw it complete: completion is only
observed when the rank waits, so these are upper bounds; for ``q`` both are the
``Sendrecv``), ``wait`` (time blocked on the transfers), ``comm`` (first post to last
completion), the blocks held, the bytes sent and received, and ``work`` (scores
computed); per rank its work, compute, wait and idle seconds and its peak memory.

Bad arguments (``W`` > ``N``, ``d`` < 1, an unknown schedule, a results folder that is
not empty, ``--device gpu`` without a CUDA device, ``--device emulator`` without a C++
compiler, ``d`` > 256 on a device) are reported once, by rank 0, and every rank exits with
status 2. An error inside a rank aborts the whole job (``MPI.Abort``), so no rank waits
forever for it.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import resource
import sys
import time
import tracemalloc
import traceback
from pathlib import Path

import numpy as np

from lessons.core.causal_rule import DIAGONAL, SKIPPED, tile_kind
from lessons.core.state import State, finalize, merge
from lessons.schedules.ring import (SCHEDULES, SPLITS, fold_block, layout_index, ring_blocks, ring_layout,
                                    ring_message_bytes)
from lessons.schedules.split_kv import _as_state

#: The devices a rank can fold on: NumPy (float64), the CUDA kernel, the kernel on the CPU emulator.
DEVICES = ("cpu", "gpu", "emulator")

__all__ = ["make_inputs", "build_parser", "main", "INPUT_GROUP", "DEVICES", "fold_block_kernel"]

#: Rows are generated in groups of this many, each from its own seed, so any rank can make any rows.
INPUT_GROUP = 256


def make_inputs(n: int, d: int, rows=None, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows ``rows`` of the standard-normal problem ``q, k, v`` of shape (n, d), float64.

    The numbers depend only on ``(seed, row)``, not on which process asks or how many
    there are: row ``i`` comes from group ``i // INPUT_GROUP``, drawn by
    ``np.random.default_rng([seed, group])``. ``rows``: int array of row indices in
    ``0..n-1`` (default all). Returns three arrays of shape (len(rows), d).
    Raises ValueError for n < 1, d < 1 or rows out of range.
    """
    if n < 1 or d < 1:
        raise ValueError(f"n and d must be at least 1, got n={n}, d={d}")
    rows = np.arange(n) if rows is None else np.asarray(rows, dtype=np.int64)
    if rows.size and (rows.min() < 0 or rows.max() >= n):
        raise ValueError(f"rows must lie in 0..{n - 1}, got {rows.min()}..{rows.max()}")
    q, k, v = (np.empty((rows.size, d)) for _ in range(3))
    groups = rows // INPUT_GROUP
    for g in np.unique(groups):
        sel = groups == g
        block = np.random.default_rng([seed, int(g)]).standard_normal((3, INPUT_GROUP, d))
        at = rows[sel] % INPUT_GROUP
        q[sel], k[sel], v[sel] = block[0, at], block[1, at], block[2, at]
    return q, k, v


class _RankParser(argparse.ArgumentParser):
    """argparse that prints only on rank 0 (every rank parses the same argv) and exits 2 on every rank."""

    rank = 0

    def _print_message(self, message, file=None):
        if self.rank == 0:
            super()._print_message(message, file)


def build_parser(rank: int = 0) -> argparse.ArgumentParser:
    """The command line of the ring program (messages printed by ``rank`` 0 only)."""
    p = _RankParser(prog="mpiexec -n W python -m lessons.distributed.ring",
                    description="Ring attention across MPI ranks: every rank owns one block of the sequence.")
    p.rank = rank
    p.add_argument("--n", type=int, default=4096, help="sequence length N (queries = keys), default 4096")
    p.add_argument("--d", type=int, default=64, help="head dimension d (= dv), default 64")
    p.add_argument("--causal", action="store_true", help="bottom-right causal mask")
    p.add_argument("--schedule", choices=SCHEDULES, default="kv",
                   help="kv: KV blocks travel (Liu et al.); q: the query block and its state (m, l, o) travel")
    p.add_argument("--split", choices=SPLITS, default="contiguous",
                   help="contiguous blocks, or zigzag (rank r owns chunks r and 2W-1-r: even causal work when N is a multiple of 2W)")
    p.add_argument("--block-k", type=int, default=512,
                   help="keys per absorbed tile inside a block, default 512 (cpu only: the kernel has its own tiles)")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs (make_inputs), default 0")
    p.add_argument("--out", type=Path, default=None,
                   help="results folder (created; must be empty); default: write nothing")
    p.add_argument("--device", choices=DEVICES, default="cpu",
                   help="cpu (default): the NumPy fold, float64; gpu: each rank folds with the CUDA kernel "
                        "lessons.gpu.flash_attention_gpu in float32, staging through host memory; emulator: "
                        "the same kernel on the CPU emulator (no GPU needed)")
    p.add_argument("--fault", default=None, help=argparse.SUPPRESS)   # "RANK:raise" or "RANK:hang", for tests
    return p


def _check_args(args, world_size: int) -> str | None:
    """The first problem with the arguments, as a sentence, or None."""
    if args.n < 1:
        return f"--n must be at least 1, got {args.n}"
    if args.d < 1:
        return f"--d must be at least 1, got {args.d}"
    if args.block_k < 1:
        return f"--block-k must be at least 1, got {args.block_k}"
    if args.seed < 0:
        return f"--seed must be at least 0, got {args.seed}"
    if world_size > args.n:
        return (f"{world_size} ranks for --n {args.n}: the ring needs W <= N (rows are cut in chunks of "
                f"ceil(N/W), so with W close to N the last ranks may still own none)")
    if args.out is not None and args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        return f"--out {args.out} exists and is not an empty folder; results are never written over old ones"
    if args.fault is not None:
        rank, _, mode = args.fault.partition(":")
        if not rank.isdigit() or mode not in ("raise", "hang"):
            return f"--fault must be RANK:raise or RANK:hang, got {args.fault!r}"
    if args.device != "cpu" and args.d > 256:
        return f"--device {args.device}: the kernel takes 1 <= d <= 256, got --d {args.d}"
    if args.device == "gpu":
        from lessons.gpu import device_available, gpu_status
        if not device_available():
            return (f"--device gpu needs a CUDA device and CuPy, and there is none here ({gpu_status()}); "
                    f"use --device emulator (the same kernel on the CPU) or --device cpu")
    if args.device == "emulator":
        from lessons.gpu import emulator_available
        if not emulator_available():
            return ("--device emulator needs a C++20 compiler ($CXX, g++ or clang++) and none was found; "
                    "use --device cpu")
    return None


def _kernel(device: str, rank: int):
    """The forward kernel for ``device`` ("gpu" or "emulator"): ``f(q, k, v, causal, scale) -> (out, lse)``
    as NumPy float32 arrays (on the GPU, rank ``r`` uses device ``r mod count``)."""
    import functools

    from lessons.gpu import flash_attention_gpu
    if device == "gpu":
        import cupy
        cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
        return functools.partial(flash_attention_gpu, backend="cupy")
    return functools.partial(flash_attention_gpu, backend="emulator")


def _host(x) -> np.ndarray:
    """A kernel result in host memory (a CuPy array is copied to NumPy; NumPy is kept)."""
    return x if isinstance(x, np.ndarray) else x.get()


def fold_block_kernel(kernel, state: State, q_blk, q_chunks, k_blk, v_blk, kv_chunks, *, nq: int, nk: int, scale,
                      causal: bool = False) -> tuple[State, int]:
    """Fold one KV block into a query block's state with a forward kernel, one chunk pair at a time.

    The device counterpart of :func:`lessons.schedules.ring.fold_block` (same arguments,
    minus ``block_k``). For each (query chunk, KV chunk) the causal rule
    (:func:`lessons.core.causal_rule.tile_kind` on global positions) decides: skipped
    pairs cost nothing; full pairs run ``kernel(q, k, v, causal=False, scale=scale)``;
    diagonal pairs run it with ``causal=True``, which is right only when both chunks are
    the same rows (the kernel's bottom-right mask on equal lengths), so a diagonal pair
    with unequal ranges raises ValueError. The kernel's normalised partial ``(out, lse)``
    is copied to host memory and merged into the state as a flash-decoding partial
    (``m = lse``, ``l = 1``: :func:`lessons.schedules.split_kv._as_state`, then
    :func:`lessons.core.state.merge`).

    ``kernel`` takes float32 C-contiguous ``(rows, d)`` arrays (``dv == d``). Returns
    ``(new_state, work)``, ``work`` the scores of the pairs given to the kernel (rows x keys).
    """
    dtype = state.o.dtype
    m, l, o = state.m.copy(), state.l.copy(), state.o.copy()
    work, q_off = 0, 0
    for r0, r1 in q_chunks:
        nr = r1 - r0
        sub = State(m=m[q_off:q_off + nr], l=l[q_off:q_off + nr], o=o[q_off:q_off + nr])
        k_off = 0
        for c0, c1 in kv_chunks:
            kind = tile_kind(r0, r1, c0, c1, nq, nk, causal) if nr and c1 > c0 else SKIPPED
            if kind == DIAGONAL and (r0, r1) != (c0, c1):
                raise ValueError(f"a diagonal chunk pair must cover the same rows for the kernel's causal mask: "
                                 f"queries [{r0}, {r1}), keys [{c0}, {c1})")
            if kind != SKIPPED:
                qs, ks, vs = (np.ascontiguousarray(x, dtype=np.float32) for x in
                              (q_blk[q_off:q_off + nr], k_blk[k_off:k_off + c1 - c0], v_blk[k_off:k_off + c1 - c0]))
                out, lse = kernel(qs, ks, vs, causal=kind == DIAGONAL, scale=float(scale))
                part = _as_state(_host(out).astype(dtype), _host(lse).astype(dtype))
                sub = merge(sub, part)
                work += nr * (c1 - c0)
            k_off += c1 - c0
        m[q_off:q_off + nr], l[q_off:q_off + nr], o[q_off:q_off + nr] = sub.m, sub.l, sub.o
        q_off += nr
    return State(m=m, l=l, o=o), work


def _fault(args, rank: int, step: int) -> None:
    """Test hook (``--fault RANK:raise|hang``): that rank fails or hangs in its first ring step."""
    if args.fault is None:
        return
    who, _, mode = args.fault.partition(":")
    if int(who) == rank and step == 0:
        if mode == "raise":
            raise RuntimeError(f"injected failure on rank {rank}")
        while True:                  # hang: never reach the next communication
            time.sleep(0.5)


def _run_rank(comm, args):
    """This rank's part of the ring; returns (out rows, lse rows, events, m/l records, memory)."""
    from mpi4py import MPI

    W, r = comm.Get_size(), comm.Get_rank()
    nxt, prv = (r + 1) % W, (r - 1) % W
    n, d = args.n, args.d
    q_chunks, kv_chunks = ring_layout(n, W, args.split), ring_layout(n, W, args.split)
    q_rows = [len(layout_index(c)) for c in q_chunks]
    kv_rows = [len(layout_index(c)) for c in kv_chunks]
    tracemalloc.start()
    q_own, k_own, v_own = make_inputs(n, d, layout_index(q_chunks[r]), args.seed)
    scale = 1.0 / np.sqrt(d)
    if args.device == "cpu":
        dtype = np.float64
        fold = functools.partial(fold_block, nq=n, nk=n, scale=scale, causal=args.causal, block_k=args.block_k)
    else:                                     # the kernel: float32 inputs, state and messages
        dtype = np.float32
        q_own, k_own, v_own = (x.astype(dtype) for x in (q_own, k_own, v_own))
        fold = functools.partial(fold_block_kernel, _kernel(args.device, r), nq=n, nk=n, scale=scale,
                                 causal=args.causal)

    events, records = [], []
    comm.Barrier()
    t00 = time.perf_counter()

    def now():
        return time.perf_counter() - t00

    if args.schedule == "kv":
        state = State.empty(q_rows[r], d, dtype)
        kv = np.ascontiguousarray(np.concatenate([k_own, v_own], axis=1))   # one message: (rows, d + dv)
        for t in range(W):
            qb, b = ring_blocks("kv", W, t, r)
            ev = dict(step=t, rank=r, q_block=qb, kv_block=b, bytes_sent=0, bytes_recv=0)
            reqs, incoming = [], None
            a = now()
            if t < W - 1:                                     # pass the block on while folding it
                incoming = np.empty((kv_rows[(r - t - 1) % W], 2 * d), dtype)
                reqs = [comm.Irecv(incoming, source=prv, tag=t), comm.Isend(kv, dest=nxt, tag=t)]
                ev.update(bytes_sent=kv.nbytes, bytes_recv=incoming.nbytes)
            ev["post"] = [a, now()]
            _fault(args, r, t)
            a = now()
            state, work = fold(state, q_own, q_chunks[r], kv[:, :d], kv[:, d:], kv_chunks[b])
            ev.update(compute=[a, now()], work=int(work))
            a = now()
            seen = {}
            for _ in reqs:                                    # which transfer completed when (as seen here)
                seen[("recv", "send")[MPI.Request.Waitany(reqs)]] = now()
            ev["wait"] = [a, now()]
            ev["comm"] = [ev["post"][0], ev["wait"][1]] if reqs else None
            ev["send"] = [ev["post"][0], seen["send"]] if reqs else None
            ev["recv"] = [ev["post"][0], seen["recv"]] if reqs else None
            records.append((t, qb, state.m.copy(), state.l.copy()))
            events.append(ev)
            if incoming is not None:
                kv = incoming
        mine = state
    else:
        q_hold = q_own
        empty = State.empty(q_rows[r], d, dtype)
        m, l, o = empty.m, empty.l, empty.o
        for t in range(W):
            qb, b = ring_blocks("q", W, t, r)
            ev = dict(step=t, rank=r, q_block=qb, kv_block=b, post=None)
            _fault(args, r, t)
            a = now()
            state, work = fold(State(m=m, l=l, o=o), q_hold, q_chunks[qb], k_own, v_own, kv_chunks[r])
            m, l, o = state.m, state.l, state.o
            ev.update(compute=[a, now()], work=int(work))
            records.append((t, qb, m.copy(), l.copy()))
            come = (r - t - 1) % W                             # the block rank r - 1 sends now
            if t < W - 1:                                      # pass queries + state on
                out_msg = np.ascontiguousarray(np.concatenate([q_hold, m[:, None], l[:, None], o], axis=1))
                in_msg = np.empty((q_rows[come], d + 2 + d), dtype)
            else:                                              # return the finished state to its owner
                out_msg = np.ascontiguousarray(np.concatenate([m[:, None], l[:, None], o], axis=1))
                in_msg = np.empty((q_rows[come], 2 + d), dtype)
            a = now()
            comm.Sendrecv(out_msg, dest=nxt, sendtag=t, recvbuf=in_msg, source=prv, recvtag=t)
            b_ = now()
            ev.update(comm=[a, b_], wait=[a, b_], send=[a, b_], recv=[a, b_], bytes_sent=out_msg.nbytes,
                      bytes_recv=in_msg.nbytes)
            events.append(ev)
            if t < W - 1:
                q_hold, m, l, o = (np.ascontiguousarray(x) for x in (in_msg[:, :d], in_msg[:, d], in_msg[:, d + 1],
                                                                   in_msg[:, d + 2:]))
            else:
                m, l, o = in_msg[:, 0], in_msg[:, 1], in_msg[:, 2:]
        mine = State(m=np.ascontiguousarray(m), l=np.ascontiguousarray(l), o=np.ascontiguousarray(o))
    out, lse = finalize(mine)
    end = now()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    memory = dict(peak_traced_bytes=int(peak), maxrss_kib=int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
    return out, lse, events, records, memory, end


def _write(args, comm_size, gathered, wall):
    """Rank 0: assemble the output in sequence order and write result.npz and timeline.json."""
    n, d, W = args.n, args.d, comm_size
    q_chunks = ring_layout(n, W, args.split)
    dtype = np.float64 if args.device == "cpu" else np.float32
    out, lse = np.zeros((n, d), dtype), np.full(n, -np.inf, dtype)
    arrays, steps, ranks = {}, [], []
    for r, (o_r, lse_r, events, records, memory, end) in enumerate(gathered):
        ix = layout_index(q_chunks[r])
        out[ix], lse[ix] = o_r, lse_r
        for t, qb, m, l in records:
            arrays[f"m_step{t}_rank{r}"], arrays[f"l_step{t}_rank{r}"] = m, l
        steps.extend(events)
        busy = sum(e["compute"][1] - e["compute"][0] for e in events)
        waited = sum(e["wait"][1] - e["wait"][0] for e in events)
        ranks.append(dict(rank=r, rows=int(ix.size), chunks=[list(c) for c in q_chunks[r]],
                          work=int(sum(e["work"] for e in events)), compute_s=busy, wait_s=waited,
                          end_s=end, idle_s=end - busy, **memory))
    msg = ring_message_bytes(args.schedule, -(-n // W), d, d, np.dtype(dtype).itemsize)
    meta = dict(n=n, d=d, world_size=W, schedule=args.schedule, split=args.split, causal=args.causal,
                block_k=args.block_k, seed=args.seed, device=args.device, dtype=np.dtype(dtype).name,
                state_form="m, l" if args.device == "cpu" else "merged", wall_s=wall, cpus=os.cpu_count(),
                message_bytes_full_block=msg, host=platform.node(), python=platform.python_version(),
                numpy=np.__version__, mpi=_mpi_version(), date=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    args.out.mkdir(parents=True, exist_ok=True)
    np.savez(args.out / "result.npz", out=out, lse=lse, **arrays)
    (args.out / "timeline.json").write_text(json.dumps(dict(meta=meta, ranks=ranks, steps=steps), indent=1))


def _mpi_version() -> str:
    from mpi4py import MPI
    return " ".join(MPI.Get_library_version().strip().splitlines()[0].split())


def main(argv=None) -> int:
    """Run one rank of the ring (the whole job when started under ``mpiexec -n W``).

    Returns 0 on success; 2 on every rank for bad arguments (rank 0 prints why).
    A failure inside a rank prints its traceback and aborts every rank (``MPI.Abort``).
    """
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    parser = build_parser(rank)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:        # argparse's error or --help: the same on every rank
        return int(exc.code or 0)
    problem = _check_args(args, size) if rank == 0 else None
    problem = comm.bcast(problem, root=0)
    if problem is not None:
        if rank == 0:
            parser.print_usage(sys.stderr)
            print(f"{parser.prog}: error: {problem}", file=sys.stderr)
        return 2
    try:
        start = time.perf_counter()
        part = _run_rank(comm, args)
        gathered = comm.gather(part, root=0)
        if rank == 0:
            wall = time.perf_counter() - start
            if args.out is not None:
                _write(args, size, gathered, wall)
            print(f"ring attention, {size} ranks, schedule {args.schedule}, split {args.split}, N={args.n}, "
                  f"d={args.d}, causal={args.causal}, device {args.device}: {wall:.3f} s" +
                  (f"; results in {args.out}" if args.out is not None else ""), flush=True)
        return 0
    except Exception:                # noqa: BLE001 - one rank's failure must end every rank
        print(f"rank {rank}: " + traceback.format_exc(), file=sys.stderr, flush=True)
        comm.Abort(1)
        return 1


if __name__ == "__main__":
    sys.exit(main())
