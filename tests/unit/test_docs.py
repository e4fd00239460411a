"""The documentation site builds in strict mode, every page of its navigation is there, and
every public class has a reference page that renders its docstring.

Builds the whole site (mkdocs.yml, about 15 to 30 s on two busy cores), hence `slow`. Needs the
`docs` extra (the README's test command installs it).
"""

from __future__ import annotations

import html
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_stale
import lightning_stale.delays as delays
from lightning_stale.method.delayed_nesterov import DelayedNesterov

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def nav_pages(nav) -> list[str]:
    """Every Markdown file named in mkdocs.yml's nav, in order."""
    found: list[str] = []
    for item in nav:
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, dict):
            for value in item.values():
                found += nav_pages(value) if isinstance(value, list) else [value]
    return found


def public_classes() -> list[type]:
    """The classes a user meets: the strategies, the callbacks, every delay model exported, the
    outer optimizer this package adds."""
    models = [getattr(delays, name) for name in delays.__all__
              if inspect.isclass(getattr(delays, name)) and issubclass(getattr(delays, name), delays.DelayModel)]
    return [lightning_stale.StaleStrategy, lightning_stale.SimulatedStaleStrategy,
            lightning_stale.WallClockLogger, lightning_stale.MiniBatchTimer, DelayedNesterov, *models]


def page_text(path: Path) -> str:
    """A built page's visible text: tags dropped, entities resolved, whitespace collapsed."""
    text = re.sub(r"<[^>]+>", " ", path.read_text())
    return " ".join(html.unescape(text).split())


def without_marks(text: str) -> str:
    """Text without Markdown's code and emphasis marks and without whitespace (tags become
    spaces in `page_text`), so that a docstring's source and its rendering compare equal."""
    return "".join(re.sub(r"[`*]", "", text).split())


def summary_line(cls: type) -> str:
    return without_marks(inspect.getdoc(cls).splitlines()[0])


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-4000:]}"
    return out


def test_every_page_in_the_navigation_is_built(site):
    import yaml

    # mkdocs.yml holds a !!python/name tag (the mermaid fence); only the nav is read here.
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.UnsafeLoader)
    pages = nav_pages(config["nav"])
    assert {"index.md", "method.md", "reference/stale-strategy.md", "reference/config.md",
            "benchmarks/scaling.md", "how-to/gpus.md"} <= set(pages)
    missing = [page for page in pages if not (site / Path(page).with_suffix(".html")).is_file()]
    assert not missing, f"in the nav but not built: {missing}"
    for page in pages:
        assert len(page_text(site / Path(page).with_suffix(".html"))) > 500, f"{page} is nearly empty"


def test_every_benchmark_script_has_a_page(site):
    scripts = {path.stem for path in (ROOT / "benchmarks").glob("*.py") if not path.stem.startswith("_")
               and path.stem != "results"}
    missing = [name for name in scripts if not (site / "benchmarks" / f"{name}.html").is_file()]
    assert not missing, f"benchmark scripts without a page: {missing}"


def test_each_public_class_has_a_reference_page_with_its_docstring(site):
    pages = {path: path.read_text() for path in (site / "reference").glob("*.html")}
    for cls in public_classes():
        anchors = {f'id="{cls.__module__}.{cls.__qualname__}"', f'id="lightning_stale.{cls.__name__}"',
                   f'id="lightning_stale.delays.{cls.__name__}"'}
        holding = [path for path, text in pages.items() if any(anchor in text for anchor in anchors)]
        assert holding, f"no reference page documents {cls.__name__}"
        assert any(summary_line(cls) in without_marks(page_text(path)) for path in holding), \
            f"{cls.__name__}'s docstring is not rendered on {[p.name for p in holding]}"


def test_the_config_reference_lists_every_group_and_option(site):
    text = page_text(site / "reference" / "config.html")
    for group in (ROOT / "conf").iterdir():
        if group.is_dir() and not group.name.startswith("_"):
            for option in group.glob("*.yaml"):
                assert f"{group.name}={option.stem}" in text, f"{group.name}={option.stem} missing"
    assert "strategy.delay_mode" in text and "after_compute" in text


def test_the_local_updates_benchmark_page_shows_each_path_beside_ddp(site):
    """benchmarks/local_updates_vs_ddp.py runs both paths side by side; its page's table (drawn
    from the latest results file by docs/hooks/benchmarks.py) names each row's path."""
    import json

    latest = ROOT / "benchmarks" / "results" / "latest" / "local_updates_vs_ddp-cpu.json"
    rows = json.loads(latest.read_text())["figures"]
    assert {row["server"] for row in rows if row["mode"] != "ddp"} == {"central", "collective"}
    assert all(row["server"] == "" for row in rows if row["mode"] == "ddp")
    built = (site / "benchmarks" / "local_updates_vs_ddp.html").read_text()
    table = built[built.index('id="latest-results-cpu"'):]
    header = re.search(r"<thead>(.*?)</thead>", table, re.S)[1]
    assert [html.unescape(c) for c in re.findall(r"<th[^>]*>(.*?)</th>", header)][:4] == \
        ["devices", "mode", "server", "h"]
    cells = [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", table, re.S)]
    cells = [row for row in cells if row]
    assert len(cells) == len(rows)
    assert [(row[1], row[2], row[3]) for row in cells] == \
        [(row["mode"], row["server"], str(row["h"])) for row in rows]
