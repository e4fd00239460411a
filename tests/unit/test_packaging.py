"""pyproject.toml ships every package and every config; checked without building a wheel.

The packages are listed by hand (conf/ and recipes/ are mapped into lightning_stale), so a new
subpackage or a config in a new folder would silently be left out of the wheel. `.ci/run`
builds the wheel and checks it for real.
"""

from __future__ import annotations

import glob
from importlib import import_module
from importlib.resources import files
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
PACKAGE_DIRS = SETUPTOOLS["package-dir"]


def source_dir(package: str) -> Path:
    """Where setuptools takes ``package`` from, following the package-dir mapping."""
    parts = package.split(".")
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in PACKAGE_DIRS:
            return ROOT / PACKAGE_DIRS[prefix] / Path(*parts[cut:])
    return ROOT / Path(*parts)


def test_every_package_is_listed():
    package_root = ROOT / "lightning_stale"
    on_disk = {".".join(("lightning_stale",) + path.parent.relative_to(package_root).parts)
               for path in package_root.rglob("__init__.py")}
    listed = set(SETUPTOOLS["packages"])
    assert on_disk <= listed, f"not in pyproject's packages: {sorted(on_disk - listed)}"
    for package in listed:
        assert (source_dir(package) / "__init__.py").is_file(), f"{package} has no __init__.py"


def test_every_config_is_package_data():
    for package, folder in (("lightning_stale.conf", "conf"),
                            ("lightning_stale.recipes", "recipes")):
        assert source_dir(package) == ROOT / folder
        patterns = SETUPTOOLS["package-data"][package]
        shipped = {Path(match) for pattern in patterns
                   for match in glob.glob(pattern, root_dir=ROOT / folder)}
        present = {path.relative_to(ROOT / folder) for path in (ROOT / folder).rglob("*.yaml")}
        assert present, f"no configs found under {folder}/"
        assert present <= shipped, f"{package} does not ship {sorted(map(str, present - shipped))}"


def test_configs_are_importable_resources():
    conf = files("lightning_stale.conf")
    assert conf.joinpath("train.yaml").is_file()
    for group in ("data", "model", "variant", "delay", "trainer", "logger", "engine"):
        assert conf.joinpath(group).is_dir(), group
    assert conf.joinpath("variant", "k_async.yaml").is_file()
    assert files("lightning_stale.recipes").joinpath("digits_k_async.yaml").is_file()


def test_console_script_points_at_main():
    module, _, name = PYPROJECT["project"]["scripts"]["lightning-stale"].partition(":")
    assert callable(getattr(import_module(module), name))


def test_test_extra_has_pytest():
    assert any(requirement.startswith("pytest")
               for requirement in PYPROJECT["project"]["optional-dependencies"]["test"])
