"""MkDocs hook: the config-groups reference page, generated from conf/**/*.yaml at build time.

Each group (a folder of conf/) gets a section; each option (a YAML file) its leading comment and
a table of its keys: dotted name, default, and the comment written above the key. Nothing is
typed twice: change a config or its comments and the page follows.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
PAGE = "reference/config.md"
KEY = re.compile(r"^(?P<indent>\s*)(?P<dash>- )?(?P<key>[A-Za-z_][\w.@/-]*):(?:\s+(?P<value>.*))?$")


def _clean(comment: list[str]) -> str:
    return _escape(" ".join(line.strip() for line in comment if line.strip()))


def parse(text: str) -> tuple[str, list[tuple[str, str, str]]]:
    """(the file's leading comment, [(dotted key, default, comment above it)])."""
    lines = text.splitlines()
    header: list[str] = []
    i = 0
    while i < len(lines) and (lines[i].startswith("#") or not lines[i].strip()):
        if lines[i].startswith("# @package"):
            pass
        elif lines[i].startswith("#"):
            header.append(lines[i][1:].removeprefix(" ").rstrip())
        elif header:
            header.append("")
        i += 1
    rows: list[tuple[str, str, str]] = []
    stack: list[tuple[int, str]] = []
    comment: list[str] = []
    for line in lines[i:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            comment.append(stripped.lstrip("#").strip())
            continue
        if not stripped:
            continue
        match = KEY.match(line)
        if not match or match["dash"]:
            comment = []  # a list item or a continuation line
            continue
        indent = len(match["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        name = ".".join([k for _, k in stack] + [match["key"]])
        value = (match["value"] or "").split(" #")[0].strip()
        if value:
            rows.append((name, value, _clean(comment)))
        elif name != "defaults":
            rows.append((name, "", _clean(comment)))
            stack.append((indent, match["key"]))
        else:
            rows.append((name, "(see below)", _clean(comment)))
            stack.append((indent, match["key"]))
        comment = []
    return _prose(header), rows


def _prose(lines: list[str]) -> str:
    """A comment block as Markdown: indented lines (commands) become code blocks."""
    out: list[str] = []
    for line in lines:
        if line.startswith("  "):
            if not out or not out[-1].startswith("    "):
                out.append("")
            out.append("    " + line.strip())
        else:
            if out and out[-1].startswith("    "):
                out.append("")
            out.append(_escape(line))
    return "\n".join(out).strip()


def _escape(text: str) -> str:
    """Markdown-safe text; a pointer to a documentation page, ``(docs/<page>.md#anchor)`` in a
    comment of conf/, becomes a link to that page."""
    text = text.replace("<", "&lt;").replace(">", "&gt;")
    return re.sub(r"\(docs/([\w/.-]+\.md)(#[\w-]+)?\)", lambda m: f"([{m[1]}](../{m[1]}{m[2] or ''}))", text)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _defaults(text: str) -> list[str]:
    """The `defaults:` list of train.yaml, as `group: option` strings."""
    items, inside = [], False
    for line in text.splitlines():
        if line.startswith("defaults:"):
            inside = True
            continue
        if inside:
            if line and not line.startswith(" "):
                break
            item = line.strip()
            if item.startswith("- "):
                items.append(item[2:])
    return items


def render() -> str:
    train = (CONF / "train.yaml").read_text()
    chosen = dict(item.split(": ", 1) for item in _defaults(train) if ": " in item)
    out = ["# Config groups", "",
           "Generated at build time from `conf/**/*.yaml` (shipped as `lightning_stale.conf`): every "
           "group of the Hydra app, every option in it, the keys it sets with their defaults, and the "
           "comments written above them. Pick an option with `GROUP=OPTION` and set a key with "
           "`GROUP.KEY=VALUE` on the command line of `python -m lightning_stale.train` "
           "(see [the Hydra app](../how-to/hydra.md)); print the composed config with `--cfg job`.", ""]
    header, rows = parse(train)
    out += ["## The primary config: `train.yaml`", "", header, "",
            "Default option of each group: " + ", ".join(f"`{g}={o}`" for g, o in chosen.items()) + ".", ""]
    out += _table([r for r in rows if not r[0].startswith("defaults")])
    for group in sorted(p for p in CONF.iterdir() if p.is_dir() and not p.name.startswith("_")):
        default = chosen.get(group.name)
        out += [f"## `{group.name}`", "",
                f"Options: " + ", ".join(f"`{f.stem}`" + (" (default)" if f.stem == default else "")
                                          for f in sorted(group.glob("*.yaml"))) + ".", ""]
        for path in sorted(group.glob("*.yaml")):
            header, rows = parse(path.read_text())
            out += [f"### `{group.name}={path.stem}`", ""]
            if header:
                out += [header, ""]
            out += _table(_documented(rows))
    return "\n".join(out) + "\n"


def _arguments(target: str) -> dict[str, str]:
    """The ``Args:`` entries of the docstrings of ``target`` (a class or function path) and of
    its ``__init__``: the fallback description of a key that has no comment of its own."""
    module_name, _, name = target.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError):
        return {}
    found: dict[str, str] = {}
    for doc in (inspect.getdoc(obj), inspect.getdoc(getattr(obj, "__init__", None))):
        current, inside, indent = None, False, 0
        for line in (doc or "").splitlines():
            if line.strip() in ("Args:", "Arguments:", "Parameters:"):
                inside, current = True, None
                continue
            if not inside:
                continue
            if not line.strip():
                continue
            width = len(line) - len(line.lstrip())
            entry = re.match(r"^\s*(\*{0,2}\w+)(?: \([^)]*\))?:\s*(.*)$", line)
            if entry and (current is None or width <= indent):
                current, indent = entry[1].lstrip("*"), width
                found.setdefault(current, entry[2])
            elif current is not None and width > indent:
                found[current] = found[current] + " " + line.strip()
            else:
                inside = False
    return found


def _documented(rows: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """Rows with an empty comment take the docstring of their ``_target_``'s argument."""
    targets = {name.rpartition(".")[0]: value for name, value, _ in rows if name.endswith("_target_")}
    out = []
    for name, value, comment in rows:
        prefix, _, key = name.rpartition(".")
        if not comment and prefix in targets and not targets[prefix].startswith("pytorch_lightning"):
            comment = _escape(_arguments(targets[prefix]).get(key, ""))
        out.append((name, value, comment))
    return out


def _table(rows: list[tuple[str, str, str]]) -> list[str]:
    if not rows:
        return ["(no keys)", ""]
    lines = ["| key | default | what it is for |", "| --- | --- | --- |"]
    lines += [f"| `{name}` | " + (f"`{_cell(value)}`" if value else "") + f" | {_cell(comment)} |"
              for name, value, comment in rows]
    return lines + [""]


def on_files(files, config):
    files.append(File.generated(config, PAGE, content=render()))
    return files
