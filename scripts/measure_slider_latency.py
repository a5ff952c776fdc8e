"""Measure how long notebook 02's tile stepper takes to answer a slider move, in a real browser.

Starts a throw-away JupyterLab on a copy of notebooks/, opens notebook 02 in
headless Chromium (Debian's /usr/bin/chromium, driven by Playwright), runs all
cells, then presses ArrowRight/ArrowLeft on the "tiles absorbed" slider MOVES
times (kernel idle before each). Each delay runs from the keydown event to the
moment every readout (tile, m, alpha, l, max error) shows the value computed
here from ``lessons.flash_attention(..., return_trace=True)`` for the new tile,
and to the moment the step picture is replaced. Writes a Markdown table.

    python scripts/measure_slider_latency.py                # 20 moves
    python scripts/measure_slider_latency.py --moves 50 --out benchmarks/results/slider_latency.md
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "browser"))

import jlab  # noqa: E402  (the browser-test helpers)

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "slider_latency.md"


def _versions() -> str:
    from importlib.metadata import version

    import jupyterlab

    try:
        chromium = subprocess.run([str(jlab.CHROMIUM), "--version"], capture_output=True, text=True,
                                  timeout=30).stdout.strip()
    except OSError:
        chromium = "?"
    return (f"{platform.python_implementation()} {platform.python_version()}, JupyterLab {jupyterlab.__version__}, "
            f"Playwright {version('playwright')}, {chromium}; {os.cpu_count()} CPU(s), "
            f"load average {os.getloadavg()[0]:.1f} at the start")


def measure(moves: int = 20) -> tuple[list[dict], dict, str]:
    """Run the measurement; returns (samples, stepper configuration, notebook name)."""
    name = next(iter(sorted(p.name for p in jlab.NOTEBOOKS.glob("02_*.ipynb"))), None)
    if name is None:
        raise FileNotFoundError("notebooks/02_*.ipynb not found")
    with jlab.lab_server() as server, jlab.chromium() as browser:
        context = browser.new_context(viewport=jlab.VIEWPORT)
        context.set_default_timeout(60_000)
        try:
            page = context.new_page()
            jlab.open_notebook(page, server, name)
            jlab.run_all(page)
            errors = jlab.error_outputs(page)
            if errors:
                raise RuntimeError(f"{name} shows errors after Run All:\n" + "\n".join(errors))
            view = jlab.StepperView(page, jlab.stepper_cells(page).first, "s0", server=server)
            view.wait_idle()
            samples = jlab.measure_moves(view, moves=moves)
            return samples, jlab.stepper_config(view), name
        finally:
            context.close()
            server.shutdown_kernels()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--moves", type=int, default=20, help="slider moves to time (default 20)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="Markdown file to write")
    args = parser.parse_args(argv)
    if args.moves < 2:
        parser.error(f"--moves must be at least 2, got {args.moves}")
    reason = jlab.missing_requirements()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    versions = _versions()
    t0 = time.perf_counter()
    samples, cfg, name = measure(args.moves)
    report = jlab.latency_report(
        samples, "Slider move to updated readouts (notebook 02 in JupyterLab, headless Chromium)",
        f"Made by `python scripts/measure_slider_latency.py --moves {args.moves}` on {time.strftime('%Y-%m-%d')}: "
        f"{name}, stepper data {cfg}. Each move is one ArrowRight/ArrowLeft on the \"tiles absorbed\" "
        "slider with the kernel idle before it; the delay runs from the keydown event to the DOM change after "
        "which every readout (tile, m, alpha, l, max error) shows the trace's value for the new tile "
        f"(checked against `lessons.flash_attention(..., return_trace=True)`). Machine: {versions}. "
        f"Whole run {time.perf_counter() - t0:.0f} s.")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    args.out.with_suffix(".json").write_text(json.dumps({"config": cfg, "moves": samples}, indent=2) + "\n")
    print(report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
