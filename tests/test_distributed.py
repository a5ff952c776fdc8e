"""Ring attention across real MPI processes against the textbook reference and the simulation.

Each test starts ``mpiexec`` through :func:`lessons.distributed.launch.run_ring` (its own
process group, killed at the time limit) and writes into its own ``tmp_path``, so the
tests are safe under ``pytest -n 4``. Without mpi4py/mpiexec they are skipped with the
install hint, except in CI (``CI`` set), where missing MPI is a failure.
"""
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from lessons import attention
from lessons.distributed.launch import (RingRunError, compare_with_simulation, find_mpiexec, load_run, mpi_status,
                                        rank_rows, run_ring, run_with_timeout)
from lessons.distributed.ring import make_inputs
from lessons.schedules.ring import ring_message_bytes

ATOL = 1e-12
LIMIT = 120          # seconds for one small job on a busy 2-core machine; a hang is killed at this limit


@pytest.fixture(scope="module")
def mpi():
    ok, why = mpi_status()
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"MPI is required in CI: {why}")
        pytest.skip(why)
    return find_mpiexec()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("schedule", ["kv", "q"])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_over_mpi_gives_the_textbook_answer(mpi, tmp_path, world_size, schedule, causal):
    n, d = 37, 8                                    # 37 is not a multiple of 2, 3 or 4
    run = run_ring(world_size, tmp_path / "run", n=n, d=d, causal=causal, schedule=schedule, block_k=5,
                   timeout=LIMIT)
    q, k, v = make_inputs(n, d)
    ref, ref_lse = attention(q, k, v, causal=causal, return_lse=True)
    np.testing.assert_allclose(run.out, ref, rtol=0, atol=ATOL)
    np.testing.assert_allclose(run.lse, ref_lse, rtol=0, atol=ATOL)
    check = compare_with_simulation(run, q, k, v)
    assert check["same_blocks"]
    assert check["steps_compared"] == world_size ** 2
    assert check["worst_state"] < ATOL and check["worst_output"] < ATOL
    # what crossed the links: each step's message, computed from the block's rows by hand
    moving = "kv_block" if schedule == "kv" else "q_block"
    for ev in run.steps:
        rows = len(rank_rows(run, ev["q_block"]))
        if schedule == "kv":
            want = 0 if ev["step"] == world_size - 1 else len(rank_rows(run, ev["kv_block"])) * 2 * d * 8
        else:
            want = rows * ((d + 2 + d) if ev["step"] < world_size - 1 else (2 + d)) * 8
        assert ev["bytes_sent"] == want
        # the order of events on the rank: kv posts the transfer, folds, then waits; q folds, then sends
        last = ev["step"] == world_size - 1
        if schedule == "kv" and not last:
            assert ev["post"][0] <= ev["compute"][0] <= ev["compute"][1] <= ev["wait"][0]
            assert ev["wait"][0] <= min(ev["send"][1], ev["recv"][1]) <= ev["wait"][1]
        elif schedule == "kv":
            assert ev["send"] is None and ev["recv"] is None and ev["bytes_recv"] == 0
        else:
            assert ev["compute"][1] <= ev["send"][0] <= ev["send"][1] == ev["recv"][1]
        sent = ring_message_bytes(schedule, len(rank_rows(run, ev[moving])), d, d)
        assert want == (sent["last_step"] if ev["step"] == world_size - 1 else sent["per_step"])


def test_zigzag_split_evens_out_causal_work(mpi, tmp_path):
    # N = 64, 4 ranks. Contiguous blocks of 16 keys, tiles of 16: rank r folds r + 1 tiles of 16 x 16.
    # Zigzag: chunks of 8, rank r owns chunks r and 7 - r; with tiles of 8 chunk r sees r + 1 tiles and
    # chunk 7 - r sees 8 - r: 9 tiles of 8 x 8 on every rank.
    contiguous = run_ring(4, tmp_path / "contiguous", n=64, d=4, causal=True, block_k=16, timeout=LIMIT)
    zigzag = run_ring(4, tmp_path / "zigzag", n=64, d=4, causal=True, split="zigzag", block_k=8, timeout=LIMIT)
    assert [r["work"] for r in contiguous.ranks] == [256, 512, 768, 1024]
    assert [r["work"] for r in zigzag.ranks] == [9 * 64] * 4
    assert zigzag.ranks[1]["chunks"] == [[8, 16], [48, 56]]
    q, k, v = make_inputs(64, 4)
    for run in (contiguous, zigzag):
        np.testing.assert_allclose(run.out, attention(q, k, v, causal=True), rtol=0, atol=ATOL)
        assert compare_with_simulation(run, q, k, v)["same_blocks"]
        for r in run.ranks:                       # idle = the ring's wall time on that rank minus its compute
            assert r["idle_s"] == pytest.approx(r["end_s"] - r["compute_s"])
            assert r["peak_traced_bytes"] > 0


def test_zigzag_q_schedule_not_divisible(mpi, tmp_path):
    run = run_ring(3, tmp_path / "run", n=29, d=6, causal=True, schedule="q", split="zigzag", block_k=3,
                   timeout=LIMIT)
    q, k, v = make_inputs(29, 6)
    np.testing.assert_allclose(run.out, attention(q, k, v, causal=True), rtol=0, atol=ATOL)
    assert compare_with_simulation(run, q, k, v)["worst_state"] < ATOL


def _left_behind(marker: str) -> list[str]:
    """Command lines of live processes that mention ``marker`` (a unique tmp path)."""
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and p.name != str(os.getpid()):
            try:
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmd:
                found.append(cmd)
    return found


@pytest.fixture(scope="module")
def emulator(mpi):
    from lessons.gpu import emulator_available
    if not emulator_available():
        if os.environ.get("CI"):
            pytest.fail("the CUDA emulator needs a C++20 compiler in CI")
        pytest.skip("the CUDA emulator needs a C++20 compiler ($CXX, g++ or clang++)")
    return mpi


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("schedule", ["kv", "q"])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_on_the_emulated_kernel_is_within_float32_tolerance(emulator, tmp_path, world_size, schedule, causal):
    from kernel_tolerance import assert_within_baseline, baseline_attention
    n, d = 37, 16                                   # 37 is not a multiple of 2 or 3
    split = "zigzag" if world_size == 3 else "contiguous"
    run = run_ring(world_size, tmp_path / "run", n=n, d=d, causal=causal, schedule=schedule, split=split,
                   timeout=LIMIT, device="emulator")
    assert run.meta["device"] == "emulator" and run.meta["dtype"] == "float32" and run.out.dtype == np.float32
    q, k, v = make_inputs(n, d)
    ref, ref_lse = attention(q, k, v, causal=causal, return_lse=True)
    base, base_lse = baseline_attention(*(x.astype(np.float32) for x in (q, k, v)), "float32", causal=causal)
    assert_within_baseline(run.out, ref, base, what="out")
    assert_within_baseline(run.lse, ref_lse, base_lse, what="lse")
    check = compare_with_simulation(run, q, k, v)
    assert check["same_blocks"] and check["state_form"] == "lse"
    assert check["steps_compared"] == world_size ** 2
    assert check["worst_state"] < 1e-5 and check["worst_lse"] < 1e-5      # float32, not 1e-12
    for ev in run.steps:                            # float32 messages: 4 bytes a number
        sent = ring_message_bytes(schedule, len(rank_rows(run, ev["kv_block" if schedule == "kv" else "q_block"])),
                                  d, d, itemsize=4)
        assert ev["bytes_sent"] == (sent["last_step"] if ev["step"] == world_size - 1 else sent["per_step"])


def test_the_kernel_fold_merges_partials_like_the_numpy_fold():
    from lessons.core.state import State, finalize
    from lessons.distributed.ring import fold_block_kernel
    from lessons.schedules.ring import fold_block, layout_index, ring_layout

    def numpy_kernel(q, k, v, *, causal, scale):    # the kernel's contract, in NumPy
        return attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), causal=causal,
                         scale=scale, return_lse=True)

    n, d = 23, 4
    q, k, v = (x.astype(np.float32).astype(np.float64) for x in make_inputs(n, d))   # the kernel's cast is exact
    chunks = ring_layout(n, 2, "zigzag")
    for qc in chunks:
        for kc in chunks:
            qi, ki = layout_index(qc), layout_index(kc)
            args = (q[qi], qc, k[ki], v[ki], kc)
            want, _ = fold_block(State.empty(len(qi), d), *args, nq=n, nk=n, scale=0.5, causal=True)
            got, _ = fold_block_kernel(numpy_kernel, State.empty(len(qi), d), *args, nq=n, nk=n, scale=0.5,
                                       causal=True)
            for x, y in zip(finalize(got), finalize(want)):
                np.testing.assert_allclose(x, y, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="diagonal chunk pair must cover the same rows"):
        fold_block_kernel(numpy_kernel, State.empty(4, d), q[:4], [(0, 4)], k[:6], v[:6], [(0, 6)], nq=n, nk=n,
                          scale=0.5, causal=True)


def test_gpu_device_without_a_gpu_stops_every_rank(mpi, tmp_path):
    from lessons.gpu import device_available
    if device_available():
        pytest.skip("a CUDA device is present: --device gpu runs")
    prog = " ".join([sys.executable, "-m", "lessons.distributed.ring", "--n", "20", "--d", "8", "--device", "gpu",
                     "--out", str(tmp_path / "r")])
    code, output = run_with_timeout([mpi, "-n", "2", "sh", "-c", f"{prog}; echo rank-exit-status $?"], LIMIT)
    assert code is not None
    assert output.count("--device gpu needs a CUDA device") == 1, output
    assert output.count("rank-exit-status 2") == 2, output
    assert not (tmp_path / "r").exists()


def test_a_failing_rank_fails_the_job(mpi, tmp_path):
    with pytest.raises(RingRunError, match="exited with status") as err:
        run_ring(3, tmp_path / "run", n=30, d=4, timeout=LIMIT, extra_args=["--fault", "1:raise"])
    assert "injected failure on rank 1" in err.value.output
    assert err.value.returncode != 0
    assert not (tmp_path / "run" / "result.npz").exists()
    assert _left_behind(str(tmp_path)) == []


def test_a_hanging_rank_is_killed_at_the_time_limit(mpi, tmp_path):
    with pytest.raises(RingRunError, match="did not finish within 3 s"):
        run_ring(3, tmp_path / "run", n=30, d=4, timeout=3, extra_args=["--fault", "2:hang"])
    assert _left_behind(str(tmp_path)) == []


@pytest.mark.parametrize("args, words", [
    (["--n", "2"], "3 ranks for --n 2"),                       # W > N
    (["--n", "20", "--d", "0"], "--d must be at least 1"),
    (["--n", "20", "--schedule", "ring"], "invalid choice: 'ring'"),
    (["--n", "20", "--split", "striped"], "invalid choice: 'striped'"),
    (["--n", "20", "--seed", "-1"], "--seed must be at least 0"),
])
def test_bad_arguments_stop_every_rank(mpi, tmp_path, args, words):
    # each rank runs under a shell that prints the rank's own exit status
    prog = " ".join([sys.executable, "-m", "lessons.distributed.ring", *args, "--out", str(tmp_path / "r")])
    code, output = run_with_timeout([mpi, "-n", "3", "sh", "-c", f"{prog}; echo rank-exit-status $?"], LIMIT)
    assert code is not None
    assert output.count(words) == 1, output                   # said once, by rank 0
    assert output.count("rank-exit-status 2") == 3, output    # and every rank exits 2
    assert not (tmp_path / "r").exists()


def test_world_size_is_checked_before_starting(tmp_path):
    with pytest.raises(TypeError, match="world_size must be an int"):
        run_ring(2.0, tmp_path / "run", n=10, d=4)
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        run_ring(0, tmp_path / "run", n=10, d=4)
    assert not (tmp_path / "run").exists()


def test_a_numpy_int_world_size_runs(mpi, tmp_path):
    run = run_ring(np.int64(2), tmp_path / "run", n=10, d=4, timeout=LIMIT)
    assert run.world_size == 2


def test_results_are_never_written_over(mpi, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    with pytest.raises(RingRunError, match="not an empty folder"):
        run_ring(2, out, n=10, d=4, timeout=LIMIT)
    assert (out / "notes.txt").read_text() == "my notes"
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_the_recorded_run_is_exact_and_matches_the_simulation():
    from lessons.distributed.launch import RECORDED_RUN
    run = load_run(RECORDED_RUN, recorded=True)
    assert "RECORDED" in run.label()
    q, k, v = run.inputs()
    ref = attention(q, k, v, causal=run.meta["causal"])
    np.testing.assert_allclose(run.out, ref, rtol=0, atol=ATOL)
    check = compare_with_simulation(run, q, k, v)
    assert check["same_blocks"] and check["worst_state"] < ATOL
    assert check["steps_compared"] == run.world_size ** 2


def test_inputs_do_not_depend_on_who_asks():
    q, k, v = make_inputs(600, 5, seed=3)
    rows = np.array([599, 0, 256, 255, 300])
    for full, part in zip((q, k, v), make_inputs(600, 5, rows, seed=3)):
        np.testing.assert_array_equal(part, full[rows])
    assert not np.array_equal(q, make_inputs(600, 5, seed=4)[0])
    with pytest.raises(ValueError, match="rows"):
        make_inputs(10, 5, np.array([10]))


def test_launcher_refuses_bad_settings_before_starting(tmp_path):
    with pytest.raises(ValueError, match="schedule"):
        run_ring(2, tmp_path / "a", schedule="ring")
    with pytest.raises(ValueError, match="split"):
        run_ring(2, tmp_path / "a", split="striped")
    with pytest.raises(ValueError, match="world_size"):
        run_ring(0, tmp_path / "a")
    with pytest.raises(ValueError, match="device"):
        run_ring(2, tmp_path / "a", device="tpu")
    assert not (tmp_path / "a").exists()


def test_mpi_status_says_how_to_install(monkeypatch):
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    ok, why = mpi_status()
    assert not ok and "mpi4py" in why and "pip install" in why


def test_without_mpi_the_lesson_shows_the_recorded_run(monkeypatch, capsys):
    import lessons.distributed.launch as launch
    monkeypatch.setattr(launch, "mpi_status", lambda: (False, "mpi4py is not installed"))
    monkeypatch.setattr(launch, "_TOLD", set())
    run = launch.lesson_run("q_zigzag")
    said = capsys.readouterr().out
    assert "not available" in said and "recorded" in said
    assert launch.lesson_run("kv_contiguous").recorded and capsys.readouterr().out == ""    # said once
    assert run.recorded and run.label().startswith("RECORDED run")
    assert run.meta["schedule"] == "q" and run.meta["split"] == "zigzag"
    with pytest.raises(ValueError, match="name"):
        launch.lesson_run("ring")


def test_recorded_runs_agree_with_each_other_and_show_the_balance():
    from lessons.distributed.launch import LESSON_RUNS, RECORDED_DIR
    runs = {name: load_run(RECORDED_DIR / name, recorded=True) for name in LESSON_RUNS}
    base = runs["kv_zigzag"].out
    for run in runs.values():
        np.testing.assert_allclose(run.out, base, rtol=0, atol=ATOL)
    # N = 2048, 4 ranks, causal, tiles of 256 keys. Contiguous: rank r owns rows [512 r, 512 r + 512),
    # which see keys up to 512 r + 511, that is key tiles 0 .. 2r + 1: 2r + 2 tiles of 512 x 256 scores.
    assert [r["work"] for r in runs["kv_contiguous"].ranks] == [512 * 256 * (2 * r + 2) for r in range(4)]
    # zigzag: chunks of 256; chunk r sees r + 1 tiles, chunk 7 - r sees 8 - r: 9 tiles of 256 x 256 each
    assert [r["work"] for r in runs["kv_zigzag"].ranks] == [9 * 256 * 256] * 4


def test_timeline_figures_draw_what_the_ranks_recorded():
    from matplotlib.patches import Rectangle

    from lessons.distributed.launch import RECORDED_DIR
    from lessons.views.ring import ring_balance_figure, ring_timeline_figure
    run = load_run(RECORDED_DIR / "kv_zigzag", recorded=True)
    fig = ring_timeline_figure(run)
    ax = fig.axes[0]
    assert "recorded run" in ax.get_title() and run.meta["date"] in ax.get_title()
    folds = [p for p in ax.patches if isinstance(p, Rectangle) and abs(p.get_height() - 0.55) < 1e-9
             and p.get_alpha() is None]                  # the waits are drawn translucent
    assert len(folds) == len(run.steps) == 16
    starts = sorted(round(p.get_x(), 9) for p in folds)
    assert starts == sorted(round(ev["compute"][0], 9) for ev in run.steps)
    labels = sorted(t.get_text() for t in ax.texts)
    assert labels == sorted(str(ev["step"] + 1) for ev in run.steps if ev["work"] > 0)   # ring steps from 1
    contiguous = load_run(RECORDED_DIR / "kv_contiguous", recorded=True)
    titles = [a.get_title() for a in ring_balance_figure([contiguous, run]).axes]
    assert "busiest / least work = 4.00" in titles[0] and "= 1.00" in titles[1]


def test_the_distributed_layer_imports_only_core_and_schedules():
    # one exception: the ring program's device folds call the CUDA kernel (lessons.gpu), imported lazily
    import ast
    folder = Path(__file__).resolve().parents[1] / "lessons" / "distributed"
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            for name in names:
                if name.startswith("lessons."):
                    allowed = ("core", "schedules", "distributed") + (("gpu",) if path.name == "ring.py" else ())
                    assert name.split(".")[1] in allowed, f"{path.name} imports {name}"
