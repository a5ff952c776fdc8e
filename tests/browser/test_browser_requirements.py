"""Without Chromium or Playwright the browser tests skip, with the reason, except under CI: there they fail."""
from __future__ import annotations

import builtins
from pathlib import Path

import pytest

import jlab


@pytest.fixture
def no_chromium(monkeypatch, tmp_path):
    monkeypatch.setattr(jlab, "CHROMIUM", tmp_path / "no-such-chromium")


@pytest.fixture
def no_playwright(monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "playwright" or name.startswith("playwright."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(jlab, "CHROMIUM", Path("/bin/sh"))          # present, so only playwright is missing
    monkeypatch.setattr(builtins, "__import__", fake_import)


@pytest.mark.parametrize("ci", [None, "", "0", "false"])
def test_missing_chromium_skips_outside_ci(no_chromium, monkeypatch, ci):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    action, reason = jlab.requirement_outcome()
    assert action == "skip"
    assert "no-such-chromium not found" in reason and "apt-get install" in reason


@pytest.mark.parametrize("ci", ["true", "1", "yes"])
def test_missing_chromium_fails_under_ci(no_chromium, monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    action, reason = jlab.requirement_outcome()
    assert action == "fail"
    assert reason.startswith("browser tests cannot run under CI") and "no-such-chromium" in reason


def test_missing_playwright_is_named(no_playwright, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    assert jlab.requirement_outcome() == ("skip", jlab.missing_requirements())
    assert "playwright" in jlab.missing_requirements()
    monkeypatch.setenv("CI", "true")
    assert jlab.requirement_outcome()[0] == "fail"


def test_a_kernel_that_lost_its_port_at_launch_is_no_notebook_error(tmp_path):
    """The server log's tracebacks count against a notebook, except a kernel's failed bind at launch (the
    restarter starts it again on fresh ports); any other traceback in the same log still counts."""
    lost = ("Traceback (most recent call last):\n"
            "  File \"/x/ipykernel/kernelapp.py\", line 280, in _bind_socket\n"
            "    return self._try_bind_socket(s, port)\n"
            "zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:43725')\n")
    real = ("Traceback (most recent call last):\n"
            "  File \"/x/lessons/views/flash.py\", line 3, in on_change\n"
            "ValueError: boom\n")
    server = jlab.LabServer.__new__(jlab.LabServer)
    server.log_path = tmp_path / "jupyterlab.log"
    server.log_path.write_text("started\n" + lost + "more\n" + real)
    assert server.log_errors() == [real.rstrip("\n")]
    server.log_path.write_text(lost)
    assert server.log_errors() == []
