"""What the wheel carries, checked without building it (.ci/wheel_check.sh builds and installs
it): the version the package and the command report, the license, and every data file."""

import importlib.metadata
from pathlib import Path

import pytest

import commfuse
from commfuse import cli

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_is_the_installed_metadata(capsys):
    assert commfuse.__version__ == importlib.metadata.version("commfuse")
    assert commfuse.__version__ == PYPROJECT["project"]["version"]
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"commfuse {commfuse.__version__}"


def test_license_file_is_the_declared_license():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
    head = (ROOT / "LICENSE").read_text().split()
    assert head[:5] == ["Apache", "License", "Version", "2.0,", "January"]


def test_package_data_covers_every_data_file():
    """A data file under commfuse/ that no package-data glob names would be missing from the
    wheel (training would then fail on an installed package, not in the source tree)."""
    globs = PYPROJECT["tool"]["setuptools"]["package-data"]
    shipped = {(ROOT / pkg.replace(".", "/")).glob(g) for pkg, gs in globs.items() for g in gs}
    shipped = {p.resolve() for found in shipped for p in found}
    data = {p.resolve() for p in (ROOT / "commfuse").rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts}
    assert data - shipped == set()
