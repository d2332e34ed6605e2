"""mkdocs hook: the table of yolo-ckpt's keys in "Choose a plan", generated from ``cfg/default.yaml`` at every build.

A page line ``<!-- keys: cfg/default.yaml -->`` becomes one table per group of keys (the file's ``# Group ---`` lines):
each key, its default and the file's own comment (type, values, meaning), so the page cannot drift from the file.
"""

from __future__ import annotations

import re
from pathlib import Path

MARKER = "<!-- keys: cfg/default.yaml -->"
DEFAULTS = Path(__file__).resolve().parents[2] / "cfg" / "default.yaml"


def read_keys(text: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """``[(group, [(key, default, comment), ...]), ...]`` from the text of a ``cfg/default.yaml``."""
    groups: list[tuple[str, list[tuple[str, str, str]]]] = []
    for line in text.splitlines():
        if group := re.match(r"#\s*([A-Z][^-]*?)\s*-{3,}\s*$", line):
            groups.append((group.group(1), []))
        elif key := re.match(r"([a-z_]+):\s*([^#]*?)\s*(?:#\s?(.*))?$", line):
            if not groups:
                groups.append(("Keys", []))
            groups[-1][1].append((key.group(1), key.group(2), key.group(3) or ""))
        elif (more := re.match(r"\s+#\s?(.*)$", line)) and groups and groups[-1][1]:
            name, default, comment = groups[-1][1][-1]
            groups[-1][1][-1] = (name, default, f"{comment} {more.group(1)}".strip())
    return groups


def keys_markdown(text: str) -> str:
    """The tables that replace the marker: one per group, key | default | what it takes and does."""
    out = []
    for group, keys in read_keys(text):
        out += [f"**{group}**", "", "| key | default | what it takes and does |", "|---|---|---|"]
        for name, default, comment in keys:
            kind = re.match(r"\(([^)]*)\)\s*(.*)", comment)
            what = f"*{kind.group(1)}*: {kind.group(2)}" if kind else comment
            shown = f"`{default}`" if default else "empty"
            out.append(f"| `{name}` | {shown} | {what.replace('|', '&#124;')} |")
        out.append("")
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (mkdocs' hook signature)
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, keys_markdown(DEFAULTS.read_text()))
