"""The README's one table of current figures: every row names a result file under ``docs/results/`` and the entry
in it (``baselines[exact-graph-b64].audio_s_per_s``), and the value quoted is that entry, rounded as quoted.

An entry path is dotted keys; ``[NAME]`` picks the list item whose ``name`` is NAME, ``[k=v,k2=v2]`` the one item
whose keys have those values, ``[3]`` the fourth. Nothing else in the README quotes a measured figure outside
this table (numbers with a unit, outside the table and the code blocks)."""

from __future__ import annotations

import json
import re
from typing import Any

from conftest import ROOT

README = ROOT / "README.md"
ROW = re.compile(r"^\| (?P<figure>[^|]+) \| (?P<value>[^|]+) \| \[[\w.-]+\]\((?P<file>docs/results/[\w.-]+\.json)\): "
                 r"`(?P<entry>[^`]+)` \|$")
_STEP = re.compile(r"\.?([^.\[\]]+)|\[([^\]]+)\]")


def _item(items: list[Any], selector: str) -> Any:
    if selector.isdigit():
        return items[int(selector)]
    wanted = dict(part.split("=", 1) for part in selector.split(",")) if "=" in selector else {"name": selector}
    found = [item for item in items if all(str(item.get(k)) == v for k, v in wanted.items())]
    assert len(found) == 1, f"[{selector}] matches {len(found)} items"
    return found[0]


def entry(data: Any, path: str) -> Any:
    """The value at ``path`` (syntax in the module docstring)."""
    node = data
    for key, selector in _STEP.findall(path):
        node = node[key] if key else _item(node, selector)
    return node


def quoted_matches(quoted: str, value: float) -> bool:
    """``quoted`` is ``value`` as written: same decimals, or the same mantissa digits in e-notation."""
    if "e" in quoted:
        mantissa = quoted.split("e")[0]
        digits = len(mantissa.split(".")[1]) if "." in mantissa else 0
        return f"{value:.{digits}e}".replace("e-0", "e-").replace("e+0", "e") == quoted
    digits = len(quoted.split(".")[1]) if "." in quoted else 0
    return f"{value:.{digits}f}" == quoted


def readme_rows() -> list[dict[str, str]]:
    text = README.read_text()
    section = text.split("\n## Performance\n", 1)[1].split("\n## ", 1)[0]
    return [m.groupdict() for line in section.splitlines() if (m := ROW.match(line))]


def test_every_readme_figure_is_its_result_files_entry():
    rows = readme_rows()
    assert len(rows) >= 12
    wrong = []
    for row in rows:
        data = json.loads((ROOT / row["file"]).read_text())
        quoted = re.match(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?", row["value"]).group(0)
        value = entry(data, row["entry"])
        if not quoted_matches(quoted, float(value)):
            wrong.append(f"{row['figure']}: README {quoted}, {row['file']} {row['entry']} = {value}")
    assert wrong == []


def test_the_table_is_the_readmes_only_figures():
    """Every table row of the Performance section parses as a sourced row; no figure with a unit elsewhere."""
    text = README.read_text()
    section = text.split("\n## Performance\n", 1)[1].split("\n## ", 1)[0]
    table_lines = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(table_lines) - 1 == len(readme_rows())  # the header, then only sourced rows
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    prose = "\n".join(line for line in prose.splitlines() if not line.startswith("|"))
    assert re.findall(r"\d+(?:\.\d+)? ?(?:ms|us|audio-s/s)\b", prose) == []


def test_entry_paths_and_rounding():
    data = {"runs": [{"name": "a", "x": 1.2345}, {"name": "b", "k": 2, "x": 0.012019}], "top": {"y": 209.35}}
    assert entry(data, "runs[a].x") == 1.2345 and entry(data, "runs[k=2].x") == 0.012019
    assert entry(data, "runs[1].name") == "b" and entry(data, "top.y") == 209.35
    assert quoted_matches("1.23", 1.2345) and not quoted_matches("1.24", 1.2345)
    assert quoted_matches("1.20e-2", 0.012019) and not quoted_matches("1.21e-2", 0.012019)
    assert quoted_matches("4223", 4223.0) and not quoted_matches("4224", 4223.0)
