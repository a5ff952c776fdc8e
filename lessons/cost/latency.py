"""Loads in flight: why the decode kernel's prefetch build should read the cache faster.

A decode kernel does a few FLOPs per byte it reads (4 at 4 query heads per KV head in fp16), so what
matters is how many bytes are on their way from HBM at any moment (Little's law: rate = bytes in flight /
latency). In ``paged_decode_split.cu``
each lane group works in steps of 4 keys: it issues the loads of their K and V rows, waits for them to
land (the latency ``L``), then absorbs them (dots, softmax, ``o += p v``: ``C``). Without prefetch the
group has nothing in flight while it computes, and a step costs ``L + C``. With prefetch
(``PREFETCH=1``) it issues the next step's loads before it absorbs this step's, so two steps' loads
overlap and, while ``L >= C``, a step costs about ``(L + C) / 2``: twice the bytes in flight per group.
The cp.async build (``ASYNC_STAGES=3``) copies the rows into a ring of 3 steps in shared memory, two steps
ahead: three steps' rows overlap, a step costs about ``(L + C) / 3`` while ``L >= 2 C``, and the rows in flight
hold no registers.

:func:`load_schedule` lays one lane group's steps out in time in that model, as
:class:`lessons.gpu.hopper.PipelineEvent` bars (``"producer"``: a step's loads, from issue to landing;
``"consumers"``: its absorb; ``stage``: the register set the rows sit in), for
:func:`lessons.views.pipeline.pipeline_figure` to draw. A model, not a measurement: one group alone,
a fixed latency, no other warps sharing the memory system.
"""
from __future__ import annotations

from lessons.core.checks import check_flag, check_int
from lessons.gpu.hopper import MAX_MODEL_TILES, PipelineEvent, _check_time

__all__ = ["load_schedule"]


def load_schedule(n_steps: int, *, latency: float = 3.0, compute: float = 1.0,
                  prefetch: bool = False, stages: int | None = None) -> list[PipelineEvent]:
    """One lane group's loads and work over ``n_steps`` steps of the decode loop, in model time units.

    Step j's loads are issued when the loop reaches them and land ``latency`` later; its absorb starts when
    they have landed and the absorb of step j - 1 is done, and takes ``compute``. Without ``prefetch`` the
    loop issues step j's loads at the top of iteration j, when step j - 1's absorb has ended: nothing
    overlaps, ``n_steps * (latency + compute)`` in all. With ``prefetch`` step 0's loads are issued before
    the loop and step j + 1's at the top of iteration j (when step j - 1's absorb has ended), before it
    waits for step j's: two steps of loads are in flight, and when ``latency >= compute`` the steps end
    in pairs every ``latency + compute``. E.g. 4 steps, latency 3, compute 1: 16 without, 9 with.
    ``stages`` = S (an int in 1..8; the cp.async rung: 3) generalises both: a ring of S slots, step j's loads
    issued when step j - S's absorb has ended (steps 0 .. S - 1 at once, before the first absorb), so S steps of
    loads are in flight; ``stages=1`` is the plain loop and ``stages=2`` is ``prefetch``. E.g. 4 steps, latency 3,
    compute 1, ``stages=3``: 7.

    Returns ``2 * n_steps`` :class:`lessons.gpu.hopper.PipelineEvent`: for each step its loads
    (``who="producer"``, issue to landing) and its absorb (``who="consumers"``); ``stage`` is the register
    set the rows occupy (always 0 without prefetch, ``j % 2`` with; the ring slot ``j % stages``). TypeError/ValueError
    naming the argument for a non-int or negative ``n_steps`` (at most :data:`lessons.gpu.hopper.MAX_MODEL_TILES`), a
    time that is not a positive finite number, a ``prefetch`` that is not a bool, ``stages`` that is not an int in
    1..8, or ``prefetch=True`` with ``stages`` given.
    Source: software pipelining of global loads (the register double buffering of CUTLASS's mainloops,
    and of the decode kernels of FlashInfer); Little's law for the bytes in flight."""
    n_steps = check_int(n_steps, "n_steps", min=0, max=MAX_MODEL_TILES)
    latency, compute = _check_time(latency, "latency"), _check_time(compute, "compute")
    prefetch = check_flag(prefetch, "prefetch")
    if stages is not None:
        if prefetch:
            raise ValueError("give prefetch=True or stages, not both (prefetch is stages=2)")
        stages = check_int(stages, "stages", min=1, max=8)
    else:
        stages = 2 if prefetch else 1
    work_end, events = [], []
    for j in range(n_steps):
        # the top of iteration j - (stages - 1), when step j - stages's absorb has ended (the prologue: 0)
        issue = work_end[j - stages] if j >= stages else 0.0
        land = issue + latency
        begin = max(land, work_end[j - 1] if j else 0.0)
        work_end.append(begin + compute)
        stage = j % stages
        events += [PipelineEvent("producer", j, stage, issue, land), PipelineEvent("consumers", j, stage, begin, work_end[j])]
    return events
