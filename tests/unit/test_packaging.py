"""pyproject.toml ships every package and every config; checked without building a wheel.

The packages are listed by hand (conf/ and recipes/ are mapped into lightning_stale), so a new
subpackage or a config in a new folder would silently be left out of the wheel. `.ci/run`
builds the wheel and checks it for real.
"""

from __future__ import annotations

import glob
import re
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


def test_every_config_and_the_method_are_package_data():
    for package, folder, kind in (("lightning_stale.conf", "conf", "*.yaml"),
                                  ("lightning_stale.recipes", "recipes", "*.yaml"),
                                  ("lightning_stale.docs", "docs", "*.md")):
        assert source_dir(package) == ROOT / folder
        patterns = SETUPTOOLS["package-data"][package]
        shipped = {Path(match) for pattern in patterns
                   for match in glob.glob(pattern, root_dir=ROOT / folder)}
        present = {path.relative_to(ROOT / folder) for path in (ROOT / folder).rglob(kind)}
        assert present, f"no {kind} found under {folder}/"
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


# ------------------------------------------------------------------ the method ships and resolves
SOURCES = [path for folder in ("lightning_stale", "conf", "recipes", "tests", "benchmarks")
           for path in (ROOT / folder).rglob("*")
           if path.suffix in (".py", ".yaml") and path != Path(__file__).resolve()]


def collapse(text: str) -> str:
    return " ".join(text.split())


def test_the_method_is_an_importable_resource():
    method = files("lightning_stale.docs").joinpath("method.md")
    assert method.is_file() and method.read_text() == (ROOT / "docs" / "method.md").read_text()


def test_every_citation_of_the_method_names_a_part_of_it():
    """Docstrings cite sections as docs/method.md, "Section" (a heading or a table column)."""
    method = collapse((ROOT / "docs" / "method.md").read_text())
    cited = {}
    for path in SOURCES:
        text = collapse(path.read_text(errors="replace"))
        for name in re.findall(r'docs/method\.md[^"]{0,20}"([^"]+)"', text):
            cited.setdefault(name, path.relative_to(ROOT))
    assert {"The six variants", "Error after J iterations", "Gradually increasing synchrony"} <= \
        set(cited)
    missing = {name: str(path) for name, path in cited.items() if name not in method}
    assert not missing, f"cited but not in docs/method.md: {missing}"
    for heading in ("Setting", "The six variants", "Expected time per iteration E[T]",
                    "Error after J iterations", "Beyond the base method",
                    "Gradually increasing synchrony", "Staleness compensation",
                    "Experiments in the paper", "Sources"):
        assert re.search(rf"^#+ {re.escape(heading)}$", (ROOT / "docs" / "method.md").read_text(),
                         re.MULTILINE), heading


def test_nothing_cites_a_file_outside_the_repository():
    outside = "PAPER" + ".md"  # spelled apart so that this file does not match itself
    offenders = [str(path.relative_to(ROOT)) for path in SOURCES + [ROOT / "README.md"]
                 if outside in path.read_text(errors="replace")]
    assert not offenders
    assert "docs/method.md" in (ROOT / "README.md").read_text()
