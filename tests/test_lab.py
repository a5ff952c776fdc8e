"""`make lab`: the learner's copies of the notebooks, root handling, extra arguments, no news pop-up.

The learner's path is checked the way a learner meets it: a git clone of the
course, `make lab`'s preparation, a notebook saved with outputs (as JupyterLab's
autosave does), then `git status` and the clean-notebook test. The browser test
``tests/browser/test_lab_as_learner.py`` does the same through the real
`make lab` and JupyterLab.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("lab_script", ROOT / "scripts" / "lab.py")
lab = importlib.util.module_from_spec(_spec)          # a script, not part of the package
_spec.loader.exec_module(lab)
_spec = importlib.util.spec_from_file_location("jlab_for_lab_tests", ROOT / "tests" / "browser" / "jlab.py")
jlab = importlib.util.module_from_spec(_spec)         # the browser tests' helpers (importing needs no browser)
_spec.loader.exec_module(jlab)
make_course_clone, _git = jlab.make_course_clone, jlab.git

NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def save_with_outputs(path: Path) -> None:
    """Give every code cell an output and an execution count, as JupyterLab saves a notebook after Run All."""
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        cell.execution_count = i + 1
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"output of cell {i + 1}\n")]
    nbformat.write(nb, path)


def test_copies_are_made_once_and_never_overwritten(tmp_path):
    repo = make_course_clone(tmp_path / "course")
    first = lab.prepare_learner_copies(repo)
    assert first == {name: "created" for name in NOTEBOOKS}
    for name in NOTEBOOKS:
        assert (repo / "my_notebooks" / name).read_bytes() == (repo / "notebooks" / name).read_bytes()

    mine = repo / "my_notebooks" / NOTEBOOKS[0]
    save_with_outputs(mine)
    mine_bytes = mine.read_bytes()
    (repo / "my_notebooks" / NOTEBOOKS[1]).unlink()              # a learner may delete a copy to start again
    second = lab.prepare_learner_copies(repo)
    assert mine.read_bytes() == mine_bytes, "a learner's notebook was overwritten"
    assert second[NOTEBOOKS[0]] == "kept" and second[NOTEBOOKS[1]] == "created"
    assert (repo / "my_notebooks" / NOTEBOOKS[1]).read_bytes() == (repo / "notebooks" / NOTEBOOKS[1]).read_bytes()


def test_a_changed_course_notebook_is_reported_and_the_copy_kept(tmp_path):
    repo = make_course_clone(tmp_path / "course")
    lab.prepare_learner_copies(repo)
    mine = repo / "my_notebooks" / NOTEBOOKS[0]
    save_with_outputs(mine)
    before = mine.read_bytes()
    src = repo / "notebooks" / NOTEBOOKS[0]
    nb = nbformat.read(src, as_version=4)
    nb.cells.append(nbformat.v4.new_markdown_cell("A new paragraph in the course."))
    nbformat.write(nb, src)
    status = lab.prepare_learner_copies(repo)
    assert status[NOTEBOOKS[0]] == f"kept (notebooks/{NOTEBOOKS[0]} has changed since)"
    assert all(status[name] == "kept" for name in NOTEBOOKS[1:])
    assert mine.read_bytes() == before


def test_no_notebooks_is_a_clear_error(tmp_path):
    (tmp_path / "notebooks").mkdir()
    with pytest.raises(FileNotFoundError, match="no notebooks found under"):
        lab.prepare_learner_copies(tmp_path)


def test_learner_outputs_leave_git_status_and_the_clean_test_alone(tmp_path):
    """Run a notebook in the lab (outputs saved in the learner's copy), then git status and make test's check."""
    repo = make_course_clone(tmp_path / "course")
    lab.prepare_learner_copies(repo)
    for name in NOTEBOOKS:
        save_with_outputs(repo / "my_notebooks" / name)
    assert _git(repo, "status", "--porcelain", "--untracked-files=all") == ""
    clean = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                            "tests/test_notebooks_clean.py"], cwd=repo, capture_output=True, text=True)
    assert clean.returncode == 0, clean.stdout[-3000:]
    # ...and the check still bites: the same outputs in a committed notebook fail it.
    save_with_outputs(repo / "notebooks" / NOTEBOOKS[0])
    dirty = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                            "tests/test_notebooks_clean.py"], cwd=repo, capture_output=True, text=True)
    assert dirty.returncode == 1 and "a code cell holds outputs" in dirty.stdout
    # the failure says how to keep the run and get the committed notebook back
    assert f"git checkout -- notebooks/{NOTEBOOKS[0]}" in dirty.stdout and "my_notebooks/" in dirty.stdout
    assert _git(repo, "status", "--porcelain") == f" M notebooks/{NOTEBOOKS[0]}\n"


@pytest.mark.parametrize("uid, allow_root", [(0, True), (1000, False)])
def test_root_gets_allow_root_and_extra_arguments_come_last(uid, allow_root):
    cmd = lab.lab_command(["--no-browser", "--port", "8890"], root=Path("/course"), uid=uid)
    assert cmd[:4] == [sys.executable, "-m", "jupyterlab", "--ServerApp.root_dir=/course/my_notebooks"]
    assert ("--allow-root" in cmd) is allow_root
    assert cmd[-3:] == ["--no-browser", "--port", "8890"]
    assert lab.lab_command(["--allow-root"], uid=0).count("--allow-root") == 1


def test_lab_command_rejects_a_string():
    with pytest.raises(TypeError, match="extra_args must be a list of strings"):
        lab.lab_command("--no-browser")


def test_make_lab_passes_lab_args():
    """`make -n lab LAB_ARGS=...` (what make would run): the script gets the arguments, unsplit by quoting."""
    out = subprocess.run(["make", "-n", "-C", str(ROOT), "lab", "-o", ".venv/.installed-lab",
                          "LAB_ARGS=--no-browser --port 8890"], capture_output=True, text=True, check=True).stdout
    assert "scripts/lab.py --no-browser --port 8890" in out


def test_overrides_turn_news_off_and_keep_other_settings(tmp_path):
    settings = tmp_path / "share" / "jupyter" / "lab" / "settings"
    settings.mkdir(parents=True)
    (settings / "overrides.json").write_text(json.dumps({
        "@jupyterlab/apputils-extension:themes": {"theme": "JupyterLab Dark"},
        "@jupyterlab/apputils-extension:notification": {"doNotDisturbMode": True, "fetchNews": "true"}}))
    path = lab.write_lab_overrides(tmp_path)
    data = json.loads(path.read_text())
    assert data["@jupyterlab/apputils-extension:themes"] == {"theme": "JupyterLab Dark"}
    assert data["@jupyterlab/apputils-extension:notification"] == {
        "doNotDisturbMode": True, "fetchNews": "false", "checkForUpdates": False}
    assert lab.write_lab_overrides(tmp_path) == path and json.loads(path.read_text()) == data
    assert sorted(p.name for p in settings.iterdir()) == ["overrides.json"]


def test_overrides_that_are_not_json_are_left_alone(tmp_path):
    settings = tmp_path / "share" / "jupyter" / "lab" / "settings"
    settings.mkdir(parents=True)
    (settings / "overrides.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        lab.write_lab_overrides(tmp_path)
    assert (settings / "overrides.json").read_text() == "{not json"


def test_my_notebooks_is_ignored_by_git():
    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", "my_notebooks/01_x.ipynb"])
    assert ignored.returncode == 0
