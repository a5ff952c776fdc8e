"""The backward kernels' own trace, replayed step by step beside NumPy's (notebook 04, "On the GPU").

References: :func:`lessons.flash_attention_backward` with ``return_trace=True``, in float64 on the very
float32 values the kernels read, is the truth; the same NumPy schedule in float32 sets the bar through
FlashAttention's rule (``tests/kernel_tolerance.py``: the kernel's largest error at most twice the
float32 baseline's, plus float32's floor for sums of that many terms), applied to each running
gradient over the whole trace.
Every numerical test runs on the CPU emulator (the same CUDA C on the CPU) and, where there is
one, on a CUDA device.
"""
import dataclasses
import time

import numpy as np
import pytest
from kernel_tolerance import assert_within_baseline

import lessons
import lessons.gpu as gpu
from lessons.gpu.backward import (EMULATED, BackwardDivergence, backward_demo_inputs, backward_on_gpu,
                                  backward_trace_differences, first_backward_divergence, flash_attention_backward_gpu,
                                  kernel_backward_trace)
from lessons.schedules.causal import count_tiles
try:                            # the views need ipywidgets, which a GPU machine may lack
    from lessons.views.backward import NUMPY_SOURCE, BackwardStepper, backward_figure, backward_kernel_figure
    from lessons.views.softmax import figure_png
except ImportError as err:
    VIEWS_MISSING = str(err)
else:
    VIEWS_MISSING = None
needs_views = pytest.mark.skipif(VIEWS_MISSING is not None, reason=f"the views cannot be imported: {VIEWS_MISSING}")

NO_DEVICE = "no CUDA device: the same cases run on the CPU under the emulator"
BACKENDS = [
    pytest.param("emulator", marks=pytest.mark.skipif(not gpu.emulator_available(),
                                                      reason="no C++ compiler (g++) for the CPU emulation")),
    pytest.param("cupy", marks=pytest.mark.skipif(not gpu.device_available(), reason=NO_DEVICE)),
]
needs_emulator = pytest.mark.skipif(not gpu.emulator_available(), reason="no C++ compiler (g++) for the CPU emulation")


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def use_device(backend):
    return False if backend == "emulator" else None


def numpy_traces(inputs, causal, block_q, block_k, scale=None):
    """(float64 trace on the stored inputs, float32 trace: the same schedule in the kernels' precision)."""
    as64 = [x.astype(np.float64) for x in inputs]
    *_, exact_trace = lessons.flash_attention_backward(*as64, block_q=block_q, block_k=block_k, causal=causal,
                                                       scale=scale, return_trace=True)
    *_, float32_trace = lessons.flash_attention_backward(*inputs, block_q=block_q, block_k=block_k, causal=causal,
                                                         scale=scale, return_trace=True)
    return exact_trace, float32_trace


TRACE_CASES = [
    # Nq, Nk, d, causal, block_q, block_k               what it covers
    pytest.param(64, 64, 16, True, 16, 16, id="causal-square-4x4-blocks"),
    pytest.param(45, 40, 16, False, 16, 16, id="N-not-a-multiple-short-last-blocks"),
    pytest.param(50, 37, 32, True, 8, 16, id="causal-Nq>Nk-rows-that-see-nothing"),
    pytest.param(20, 70, 16, True, 16, 8, id="causal-Nq<Nk"),
]


@pytest.mark.parametrize("nq, nk, d, causal, block_q, block_k", TRACE_CASES)
def test_kernel_trace_equals_numpy_trace_within_the_kernel_tolerance_rule(backend, nq, nk, d, causal, block_q,
                                                                          block_k):
    inputs = backward_demo_inputs(nq, nk, d, causal=causal, seed=nq * 100 + nk)
    where, trace = kernel_backward_trace(*inputs, causal=causal, block_q=block_q, block_k=block_k,
                                         use_device=use_device(backend))
    ref, base = numpy_traces(inputs, causal, block_q, block_k)
    # the same tiles in the same order: one step per computed tile, key blocks outside
    assert [(s.key_block, s.query_block) for s in trace.steps] == [(s.key_block, s.query_block) for s in ref.steps]
    assert len(trace) == count_tiles(nq, nk, block_q, block_k, causal=causal).computed
    assert all(s.p is None and s.ds is None for s in trace.steps)          # the kernels keep them on chip
    assert [(s.row_start, s.row_stop, s.key_start, s.key_stop, s.kind) for s in trace.steps] == \
        [(s.row_start, s.row_stop, s.key_start, s.key_stop, s.kind) for s in ref.steps]
    assert_within_baseline(trace.D, ref.D, base.D, what="D", terms=d)
    # terms: what the kernels sum one after another into an entry (query rows into dK_j, dV_j; keys into dQ_i)
    for f, terms in (("dk", nq), ("dv", nq), ("dq", nk)):
        got, want, baseline = (np.concatenate([getattr(s, f) for s in t.steps]) for t in (trace, ref, base))
        assert_within_baseline(got, want, baseline, what=f"running {f} over all steps", terms=terms)
    assert first_backward_divergence(trace, ref) is None
    assert (where == EMULATED) == (backend == "emulator")


def test_the_trace_ends_at_the_kernels_own_output(backend):
    # the running blocks after the last step are what the kernels write, bit for bit (float32 both)
    inputs = backward_demo_inputs(45, 40, 16, causal=True, seed=1)
    _, trace = kernel_backward_trace(*inputs, causal=True, block_q=16, block_k=16, use_device=use_device(backend))
    out = flash_attention_backward_gpu(*inputs, causal=True, block_q=16, block_k=16,
                                       backend="emulator" if backend == "emulator" else "cupy")
    for got, want in zip(trace.gradients_after(len(trace) - 1), out):
        want = want.get() if hasattr(want, "get") else want
        np.testing.assert_array_equal(got, want.astype(np.float64))


def test_the_dq_trace_holds_every_row_after_every_key_block_it_absorbed(backend):
    nq, nk, bq, bk = 40, 48, 16, 16                   # causal: query block 1 (rows 0-15) sees key blocks 1-2
    inputs = backward_demo_inputs(nq, nk, 16, causal=True, seed=2)
    dq, dk, dv, t = flash_attention_backward_gpu(*inputs, causal=True, block_q=bq, block_k=bk, trace_block=0,
                                                 backend="emulator" if backend == "emulator" else "cupy")
    dq = dq.get() if hasattr(dq, "get") else dq
    assert t.dq.shape == (3, nq, 16) and t.D.shape == (nq,)
    visible_blocks = [min((r + nk - nq) // bk + 1, 3) for r in range(nq)]  # key blocks up to a row's last key
    for r in range(nq):
        last_row_of_block = min((r // bq + 1) * bq, nq) - 1
        n_seen = visible_blocks[last_row_of_block]
        assert not np.isnan(t.dq[:n_seen, r]).any() and np.isnan(t.dq[n_seen:, r]).all()
        np.testing.assert_array_equal(t.dq[n_seen - 1, r], dq[r])          # the last record is the output
    o, do = inputs[3].astype(np.float64), inputs[5].astype(np.float64)
    np.testing.assert_allclose(t.D, (o * do).sum(axis=1), rtol=1e-5, atol=1e-6)


def test_a_kernel_run_with_another_scale_is_caught_at_its_first_step(backend):
    inputs = backward_demo_inputs(32, 32, 16, causal=True, seed=3)
    _, trace = kernel_backward_trace(*inputs, causal=True, block_q=16, block_k=16, scale=0.5,
                                     use_device=use_device(backend))
    ref, _ = numpy_traces(inputs, True, 16, 16)                  # NumPy with the default 1/sqrt(16) = 0.25
    found = first_backward_divergence(trace, ref)
    assert isinstance(found, BackwardDivergence)
    assert (found.step, found.key_block, found.query_block, found.quantity) == (0, 0, 0, "dk")
    assert found.gpu == trace.steps[0].dk[found.row, found.col] and found.numpy == ref.steps[0].dk[found.row, found.col]
    assert "step 1 (key block 1, query block 1): dK differs" in found.message


# ---------------------------------------------------------------------------
# first_backward_divergence on perturbed traces (no kernel needed: the comparison is NumPy's)
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair():
    """(the float32 NumPy trace standing in for a kernel's, the float64 one) of a causal 4 x 4-block run."""
    inputs = backward_demo_inputs(64, 64, 16, causal=True, seed=0)
    ref, base = numpy_traces(inputs, True, 16, 16)
    return base, ref


def textbook(inputs, causal=True):
    q, k, v, _, _, do = (x.astype(np.float64) for x in inputs)
    return lessons.attention_backward(q, k, v, do, causal=causal)


def perturbed(trace, n, field, index, delta):
    steps = list(trace.steps)
    arr = getattr(steps[n], field).astype(np.float64)
    arr[index] += delta
    steps[n] = dataclasses.replace(steps[n], **{field: arr})
    return dataclasses.replace(trace, steps=steps)


def test_an_unperturbed_float32_trace_agrees(pair):
    base, ref = pair
    assert first_backward_divergence(base, ref) is None
    diffs = backward_trace_differences(base, ref)
    assert diffs.shape == (10, 3) and 0 < diffs.max() < 1e-5


@pytest.mark.parametrize("n, field, index", [(0, "dk", (3, 5)), (5, "dv", (15, 0)), (9, "dq", (7, 15)),
                                             (4, "dq", (0, 0))])
def test_a_perturbed_element_is_named_with_its_step_and_place(pair, n, field, index):
    base, ref = pair
    bad = perturbed(base, n, field, index, 1e-3)
    found = first_backward_divergence(bad, ref)
    s = ref.steps[n]
    start = s.row_start if field == "dq" else s.key_start
    assert (found.step, found.key_block, found.query_block, found.quantity) == (n, s.key_block, s.query_block, field)
    assert (found.row, found.col) == (start + index[0], index[1])
    assert found.gpu == getattr(bad.steps[n], field)[index] and found.numpy == getattr(s, field)[index]
    assert found.gpu - float(getattr(base.steps[n], field)[index]) == pytest.approx(1e-3, rel=1e-9)
    col = ("dq", "dk", "dv").index(field)
    clean = backward_trace_differences(base, ref)
    assert backward_trace_differences(bad, ref)[n, col] == pytest.approx(
        np.abs(getattr(bad.steps[n], field) - getattr(s, field)).max(), rel=1e-12)
    assert backward_trace_differences(bad, ref)[n, col] > 100 * clean[n, col]


def test_a_perturbation_within_rounding_is_not_a_divergence(pair):
    base, ref = pair
    assert first_backward_divergence(perturbed(base, 2, "dk", (0, 0), 1e-7), ref) is None
    # the same perturbation is found once the tolerance is tighter than it
    found = first_backward_divergence(perturbed(base, 2, "dk", (0, 0), 1e-4), ref, rtol=0, atol=1e-5)
    assert found is not None and found.step <= 2


def test_D_is_checked_before_the_loop(pair):
    base, ref = pair
    D = base.D.astype(np.float64).copy()
    D[17] += 1e-2
    found = first_backward_divergence(dataclasses.replace(base, D=D), ref)
    assert (found.step, found.quantity, found.row) == (None, "D", 17)
    assert "D of row 17" in found.message


def test_nan_in_the_kernels_trace_is_a_divergence(pair):
    base, ref = pair
    found = first_backward_divergence(perturbed(base, 6, "dv", (2, 2), np.nan), ref)
    assert (found.step, found.quantity) == (6, "dv") and np.isnan(found.gpu)
    assert backward_trace_differences(perturbed(base, 6, "dv", (2, 2), np.nan), ref)[6, 2] == np.inf


def test_a_missing_or_swapped_step_is_named(pair):
    base, ref = pair
    dropped = dataclasses.replace(base, steps=base.steps[:4] + base.steps[5:])      # skips (key block 2, query block 2)
    found = first_backward_divergence(dropped, ref)
    assert (found.step, found.quantity) == (4, "tile")
    assert "step 5: the GPU absorbed key block 2 x query block 3, NumPy key block 2 x query block 2" in found.message
    with pytest.raises(ValueError, match="visited different tiles"):
        backward_trace_differences(dropped, ref)
    short = dataclasses.replace(base, steps=base.steps[:-1])
    found = first_backward_divergence(short, ref)
    assert (found.step, found.quantity, found.gpu, found.numpy) == (9, "length", 9.0, 10.0)


def test_bad_arguments_are_refused(pair):
    base, ref = pair
    with pytest.raises(TypeError, match="gpu_trace must be"):
        first_backward_divergence(object(), ref)
    with pytest.raises(ValueError, match="rtol must be a non-negative number"):
        first_backward_divergence(base, ref, rtol=-1)
    other = dataclasses.replace(base, block_q=8)
    with pytest.raises(ValueError, match="different problems"):
        first_backward_divergence(other, ref)
    q, k, v, o, lse, do = backward_demo_inputs(16, 16, 16)
    with pytest.raises(ValueError, match="q must be 2-D"):
        kernel_backward_trace(q[None], k, v, o, lse, do)
    with pytest.raises(ValueError, match="block_q must be one of"):
        kernel_backward_trace(q, k, v, o, lse, do, block_q=12, block_k=16, use_device=False)


# ---------------------------------------------------------------------------
# the views: the same stepper and figure over the kernels' trace
# ---------------------------------------------------------------------------

@needs_views
def test_the_stepper_toggles_between_the_kernels_trace_and_numpys(pair):
    base, ref = pair
    exact = textbook(backward_demo_inputs(64, 64, 16, causal=True, seed=0))
    st = BackwardStepper(ref, exact, causal=True, step=6, kernel=(EMULATED, base))
    assert st.source.value == "kernel" and st.trace is base
    assert "the CUDA kernels, emulated on the CPU" in st.readouts["source"].value
    diff = backward_trace_differences(base, ref)[5]
    assert "first divergence: <b>none" in st.readouts["kernel"].value
    assert all(f"{x:.6g}" in st.readouts["kernel"].value for x in diff)
    np.testing.assert_array_equal(st.errors, base.errors(exact))
    kernel_png = st.image.value
    st.source.value = "numpy"
    assert st.trace is ref and NUMPY_SOURCE in st.readouts["source"].value and st.slider.value == 6
    np.testing.assert_array_equal(st.errors, ref.errors(exact))
    assert st.image.value != kernel_png                     # redrawn from the other trace, named in its title
    st.slider.value = 10
    assert "step <b>10</b> of 10" in st.readouts["step"].value


@needs_views
def test_the_stepper_shows_where_a_kernel_trace_parts(pair):
    base, ref = pair
    exact = tuple(np.zeros(s) for s in ((64, 16), (64, 16), (64, 16)))
    st = BackwardStepper(ref, exact, causal=True, kernel=("GPU (test)", perturbed(base, 3, "dk", (1, 1), 0.5)))
    assert "step 4 (key block 1, query block 4): dK differs at key 1, column 1" in st.readouts["kernel"].value
    assert st.divergence.step == 3
    short = dataclasses.replace(base, steps=base.steps[:-1])
    st = BackwardStepper(ref, exact, causal=True, step=10, kernel=("GPU (test)", short))
    assert st.slider.max == 9 and st.slider.value == 9 and st.differences is None
    assert "visited different tiles" in st.readouts["kernel"].value
    with pytest.raises(TypeError, match="kernel must be a"):
        BackwardStepper(ref, exact, kernel=base)
    with pytest.raises(ValueError, match="different problems"):
        BackwardStepper(ref, exact, kernel=("GPU", dataclasses.replace(base, block_k=8)))


@needs_views
def test_the_kernel_figure_draws_both_traces_and_marks_a_divergence(pair):
    base, ref = pair
    exact = textbook(backward_demo_inputs(64, 64, 16, causal=True, seed=0))
    fig = backward_kernel_figure(base, ref, exact, where=EMULATED, baseline=base)
    left, right = fig.axes
    assert len(left.lines) >= 6 and "no divergence" in fig.texts[0].get_text()
    kernel_dq = right.lines[0]
    np.testing.assert_allclose(kernel_dq.get_ydata(), np.maximum(backward_trace_differences(base, ref)[:, 0], 1e-17))
    assert len(figure_png(fig)) > 1000
    fig = backward_kernel_figure(perturbed(base, 7, "dv", (0, 0), 1.0), ref, exact, where="GPU (test)")
    assert "first divergence: dv at step 8" in fig.texts[0].get_text()
    assert any("first divergence: step 8" in t.get_text() for t in fig.axes[1].texts)
    fig = backward_figure(base, 6, exact, causal=True, source="the CUDA kernels, emulated on the CPU")
    assert "emulated on the CPU" in fig.axes[1].get_title()


# ---------------------------------------------------------------------------
# the notebook's section
# ---------------------------------------------------------------------------

@needs_emulator
@needs_views
def test_the_section_runs_on_the_emulator_and_says_so():
    r = backward_on_gpu(n_q=32, n_k=48, d=16, use_device=False, emulate=True)
    assert r.ok and len(r.checks_on("emulator")) == 3 and not r.checks_on("GPU")
    assert [c.case.split(": ")[-1] for c in r.checks] == ["dq", "dk", "dv"]
    for c, want in zip(r.checks, r.details["exact"]):
        np.testing.assert_array_equal(c.reference, want)
        assert c.max_error == pytest.approx(np.abs(c.output - want).max()) and c.max_error < 1e-5
    assert r.details["where"] == EMULATED and r.details["divergence"] is None
    assert len(r.details["trace"]) == count_tiles(32, 48, 16, 16, causal=True).computed
    assert "not run" in r.summary and "emulator" in r.summary and "first_backward_divergence: none" in r.summary


@pytest.mark.skipif(not gpu.device_available(), reason=NO_DEVICE)
@needs_views
def test_the_section_runs_on_the_device_and_names_it():
    r = backward_on_gpu(n_q=32, n_k=48, d=16)
    assert r.ok and r.ran_on_device and len(r.checks_on("GPU")) == 6 and not r.checks_on("emulator")
    assert r.details["where"].startswith("GPU (") and r.details["divergence"] is None
    assert r.details["seconds"] > 0 and "median" in r.summary


class StandInDevice(gpu.Runner):
    """The emulator backend standing in for a CUDA device: what it runs is labelled "GPU", timed by a wall clock."""

    def __init__(self):
        super().__init__("emulator")
        self.name = "a stand-in device"

    def median_seconds(self, fn, *, warmup=0, repeats=1):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start


@needs_emulator
@needs_views
def test_the_gpu_branch_checks_times_and_labels_with_a_stand_in_device(monkeypatch):
    from lessons.gpu import harness, launch
    for module in (harness, launch):     # the section, and the stepper's trace
        monkeypatch.setattr(module, "open_device", lambda use_device: (None, "the GPU was not used (use_device="
                                                                       "False)") if use_device is False else
                            (StandInDevice(), None))
    r = backward_on_gpu(n_q=32, n_k=48, d=16)
    assert r.ok and len(r.checks_on("GPU")) == 6 and not r.checks_on("emulator")      # plain and trace builds
    assert r.details["where"] == "GPU (a stand-in device)" and r.details["divergence"] is None
    assert r.details["seconds"] > 0 and "One backward (the three kernels, plain build) on the GPU: median" in r.summary
    where, trace = kernel_backward_trace(*backward_demo_inputs(32, 32, 16), causal=True, block_q=16, block_k=16)
    assert where == "GPU (a stand-in device)" and len(trace) == 3
    where, _ = kernel_backward_trace(*backward_demo_inputs(32, 32, 16), block_q=16, block_k=16, use_device=False)
    assert where == EMULATED


@pytest.mark.parametrize("seed, error, match", [(True, TypeError, "seed must be an int, got bool"),
                                                (-1, ValueError, "seed must be at least 0"),
                                                (1.0, TypeError, "seed must be an int, got float")])
def test_backward_demo_inputs_name_a_bad_seed(seed, error, match):
    from lessons.gpu.backward import backward_demo_inputs

    with pytest.raises(error, match=match):
        backward_demo_inputs(seed=seed)
