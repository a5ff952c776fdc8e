"""environment.yml (conda) and pyproject.toml must list the same packages and bounds."""
import re
import sys
from pathlib import Path

import pytest
import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
CONDA_TO_PYPI = {"matplotlib-base": "matplotlib"}
NOT_PACKAGES = {"python", "pip"}


def _split(req: str) -> tuple[str, str]:
    """'numpy>=1.24' -> ('numpy', '>=1.24'); conda 'pkg=1.2' -> ('pkg', '==1.2.*')."""
    req = req.split(";")[0].strip()
    m = re.match(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?\s*(.*)$", req)
    name, spec = m.group(1).lower().replace("_", "-"), m.group(2).replace(" ", "")
    if re.fullmatch(r"=[^=].*", spec):
        spec = "=" + spec + ("" if spec.endswith("*") else ".*")
    return name, spec


def pyproject_requirements() -> dict:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    proj = data["project"]
    reqs = list(proj["dependencies"])
    for extra in proj.get("optional-dependencies", {}).values():
        reqs += extra
    return dict(_split(r) for r in reqs)


def conda_requirements() -> dict:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    out = {}
    for dep in env["dependencies"]:
        items = dep["pip"] if isinstance(dep, dict) else [dep]
        for item in items:
            name, spec = _split(item)
            name = CONDA_TO_PYPI.get(name, name)
            if name not in NOT_PACKAGES:
                out[name] = spec
    return out


def test_split_handles_conda_and_pip_forms():
    assert _split("matplotlib-base>=3.7") == ("matplotlib-base", ">=3.7")
    assert _split("pkg=1.2") == ("pkg", "==1.2.*")
    assert _split("Some_Pkg[extra] >= 2") == ("some-pkg", ">=2")


def test_environment_yml_matches_pyproject():
    py, conda = pyproject_requirements(), conda_requirements()
    assert set(py) == set(conda), (
        f"only in pyproject: {sorted(set(py) - set(conda))}; only in environment.yml: {sorted(set(conda) - set(py))}")
    assert py == conda


def test_environment_yml_uses_conda_forge():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert env["channels"] == ["conda-forge"]


def test_test_extra_holds_the_gpu_extra():
    """README: `make test` installs the GPU packages whatever LAB_EXTRAS says, because [test] lists them too."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    gpu, test = dict(map(_split, extras["gpu"])), dict(map(_split, extras["test"]))
    assert gpu.items() <= test.items(), f"[gpu] {gpu} is not all in [test] {test}"
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "the same GPU packages, which the kernel tests need, whatever `LAB_EXTRAS` says" in readme
