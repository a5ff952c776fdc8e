"""Start JupyterLab on the learner's own copies of the notebooks (what `make lab` runs).

    python scripts/lab.py [JUPYTERLAB ARGUMENTS...]
    make lab LAB_ARGS="--no-browser --port 8890"

The committed notebooks in ``notebooks/`` stay clean (stored without outputs, as
``tests/test_notebooks_clean.py`` requires). JupyterLab autosaves outputs into
whatever it opens, so the lab opens ``my_notebooks/`` instead: a copy of each
notebook, made the first time and never overwritten, ignored by git. A learner's
outputs and edits live there; ``git status`` and ``make test`` never see them.
When a committed notebook changes after the copy was made, the copy is kept and
a note says how to get the new version (delete the copy, run ``make lab`` again).

Also: JupyterLab's news pop-up is turned off in this environment's lab
(``<prefix>/share/jupyter/lab/settings/overrides.json``), and ``--allow-root``
is added when running as root (containers, CI images), where JupyterLab
otherwise refuses to start.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIR = "notebooks"
LEARNER_DIR = "my_notebooks"
#: Which committed notebook each learner copy was made from (name -> sha256 of its bytes).
SOURCES_FILE = ".copied_from.json"
#: JupyterLab settings for the lab this project starts: no news or update pop-ups.
LAB_OVERRIDES = {
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False},
}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def prepare_learner_copies(root: Path = ROOT) -> dict[str, str]:
    """Copy each ``notebooks/NN_*.ipynb`` to ``my_notebooks/`` unless a copy is there already.

    Returns {notebook name: what happened}: ``"created"``, ``"kept"``, or
    ``"kept (notebooks/NAME has changed since)"``. An existing copy is never
    written to, whatever it holds; a new one is created with exclusive create, so
    a file that appears meanwhile is not overwritten either. Raises
    FileNotFoundError when ``notebooks/`` holds no notebook.
    """
    root = Path(root)
    sources = sorted((root / SOURCE_DIR).glob("[0-9][0-9]_*.ipynb"))
    if not sources:
        raise FileNotFoundError(f"no notebooks found under {root / SOURCE_DIR}")
    dest_dir = root / LEARNER_DIR
    dest_dir.mkdir(exist_ok=True)
    record_path = dest_dir / SOURCES_FILE
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError):
        record = {}
    status = {}
    for src in sources:
        dest = dest_dir / src.name
        digest = _sha256(src)
        try:
            with open(dest, "xb") as f:
                f.write(src.read_bytes())
        except FileExistsError:
            changed = src.name in record and record[src.name] != digest
            status[src.name] = f"kept ({SOURCE_DIR}/{src.name} has changed since)" if changed else "kept"
            continue
        record[src.name] = digest
        status[src.name] = "created"
    record_path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return status


def write_lab_overrides(prefix: Path | str = sys.prefix) -> Path:
    """Merge :data:`LAB_OVERRIDES` into ``PREFIX/share/jupyter/lab/settings/overrides.json``.

    Settings already in the file are kept unless they are the ones set here.
    Returns the file's path. Raises ValueError when the existing file is not a
    JSON object (it is left as it was).
    """
    path = Path(prefix) / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    current = {}
    if path.exists():
        try:
            current = json.loads(path.read_text() or "{}")
        except ValueError as err:
            raise ValueError(f"{path} is not valid JSON ({err}); fix or remove it") from err
        if not isinstance(current, dict):
            raise ValueError(f"{path} must hold a JSON object, it holds {type(current).__name__}")
    for plugin, values in LAB_OVERRIDES.items():
        current[plugin] = {**current.get(plugin, {}), **values}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".overrides.json.{os.getpid()}")
    tmp.write_text(json.dumps(current, indent=2) + "\n")
    os.replace(tmp, path)                       # two labs starting at once never see half a file
    return path


def lab_command(extra_args: list[str], root: Path = ROOT, uid: int | None = None) -> list[str]:
    """The JupyterLab command line: served from ``my_notebooks/``, ``--allow-root`` for uid 0, then EXTRA_ARGS.

    EXTRA_ARGS come last so that they win over the defaults (JupyterLab takes
    the last value of an option).
    """
    if not isinstance(extra_args, (list, tuple)) or not all(isinstance(a, str) for a in extra_args):
        raise TypeError(f"extra_args must be a list of strings, got {extra_args!r}")
    uid = os.getuid() if uid is None else uid
    cmd = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={Path(root) / LEARNER_DIR}"]
    if uid == 0 and "--allow-root" not in extra_args:
        cmd.append("--allow-root")
    return cmd + list(extra_args)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    status = prepare_learner_copies()
    created = [name for name, s in status.items() if s == "created"]
    changed = [name for name, s in status.items() if s.startswith("kept (")]
    print(f"Your notebooks: {LEARNER_DIR}/ (ignored by git; your outputs stay there, "
          f"{SOURCE_DIR}/ stays clean).")
    if created:
        print(f"  new copies: {', '.join(created)}")
    for name in changed:
        print(f"  {SOURCE_DIR}/{name} has changed since your copy was made; yours is kept. For the new "
              f"version, move {LEARNER_DIR}/{name} aside and run `make lab` again.")
    write_lab_overrides()
    cmd = lab_command(argv)
    sys.stdout.flush()
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
