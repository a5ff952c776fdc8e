"""The GPU benchmarks' plot: drawn again from a recorded results.csv (no GPU), with its legend
outside every axes so that it covers no line."""
import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks" / "results" / "gpu_h200_2026-12-01"


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _overlaps(a, b):
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.parametrize("name, sub", [("gpu_attention", "forward"), ("gpu_backward", "backward")])
def test_replot_draws_the_recorded_rows_with_the_legend_outside(tmp_path, monkeypatch, name, sub):
    import csv

    import matplotlib.pyplot as plt

    from benchmarks import _common

    bench = _script(name)
    for f in ("results.csv", "results.md"):
        shutil.copy(RUN / sub / f, tmp_path / f)
    assert bench.main(["--replot", str(tmp_path / "results.csv")]) == 0
    assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    rows = _common.read_results(tmp_path / "results.csv")
    with open(RUN / sub / "results.csv", newline="") as f:
        raw = list(csv.DictReader(f))
    assert len(rows) == len(raw)
    assert [r["seconds"] for r in rows] == [float(r["seconds"]) if r["seconds"] else None for r in raw]

    captured = {}
    orig = _common.plot_results

    def keep(rows, path, **kw):
        captured["fig"] = _common.results_figure(rows, **kw)
        captured["title"] = kw["title"]
        orig(rows, path, **kw)

    monkeypatch.setattr(_common, "plot_results", keep)
    _common.replot(tmp_path / "results.csv", bench.plot_results, f"{name}.png")
    fig = captured["fig"]
    assert "NVIDIA H200 (sm_90)" in captured["title"]          # the device, from results.md
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    assert not any(_overlaps(box, ax.get_window_extent(renderer)) for ax in fig.axes)
    assert box.x1 <= fig.bbox.x1 + 1                            # and inside the image
    # every drawn line is a row of the CSV: the top panels carry the speed of each run row
    done = [r for r in raw if r["seconds"]]
    impls = list(dict.fromkeys(r["impl"] for r in done))
    labels = [t.get_text() for t in legend.get_texts()]
    assert len(labels) == len(impls) + len({r["dtype"] for r in done})
    points = sum(len(line.get_xdata()) for ax in fig.axes[:len(fig.axes) // 2] for line in ax.get_lines())
    assert points == len(done)
    plt.close(fig)


def test_replot_refuses_an_empty_csv(tmp_path):
    from benchmarks import _common

    (tmp_path / "results.csv").write_text("impl,n,d,heads,causal,dtype,seconds,tflops,peak_bytes,note\n")
    with pytest.raises(ValueError, match="no result rows"):
        _common.replot(tmp_path / "results.csv", lambda *a: None, "x.png")
    with pytest.raises(FileNotFoundError):
        _common.replot(tmp_path / "missing.csv", lambda *a: None, "x.png")


def test_the_title_names_only_the_dtypes_that_were_timed():
    from benchmarks import _common

    row = {"dtype": "float16", "seconds": 1.0}
    assert _common.dtype_caption([row, {**row, "dtype": "float32", "seconds": None}]) == "float16"
    assert _common.dtype_caption([{**row, "dtype": "float32"}, row]) == "solid float16, dashed float32"
    # the recorded backward run timed float16 only, the forward run both
    root = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "gpu_h200_2026-12-01"
    assert _common.dtype_caption(_common.read_results(root / "backward" / "results.csv")) == "float16"
    assert _common.dtype_caption(_common.read_results(root / "forward" / "results.csv")) == \
        "solid float16, dashed float32"
