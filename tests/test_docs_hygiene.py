"""What a reader outside the project must not find in the docs (README.md, everything under docs/, the Markdown
under deploy/, proto/README.md, tests/data/README.md), result files included:

- a path of the machine a run happened on (``/work/...``, ``/home/...``, ``/root/...``, a virtualenv);
- an internal tracker number ("issue 21", "#21", "PR 3"): the docs say what changed instead;
- a relative Markdown link that leads nowhere (or to a missing ``#heading``), or a quoted repository path
  (`` `sidecar/...` ``, `` `tests/...` ``, ...) that does not exist, unless the doc names it at the commit that has
  it (a retired probe: `` `loadgen/probes/x.py` at `abc1234` ``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import ROOT
from test_docs import _anchors, _without_fences

MARKDOWN = sorted({ROOT / "README.md", ROOT / "proto" / "README.md", ROOT / "tests" / "data" / "README.md",
                   *(ROOT / "docs").rglob("*.md"), *(ROOT / "deploy").rglob("*.md")})
RESULTS = sorted(p for p in (ROOT / "docs").rglob("*") if p.is_file() and p.suffix != ".md")

MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|home|root|Users|mnt/data|opt/conda)/|\.venv[\w-]*/|/site-packages/")
TRACKER_NUMBER = re.compile(r"\b(?:issues?|PRs?|pull requests?) ?#?\d+\b|(?<![\w&/#\[`-])(?<!\]\()#\d+\b", re.I)
REPO_PATH = re.compile(r"`((?:sidecar|client|proto|loadgen|cudart|code2wav|tests|docs|deploy|\.ci)/[\w./-]*)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _found(pattern: re.Pattern, text: str) -> list[str]:
    return [f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}" for m in pattern.finditer(text)]


@pytest.mark.parametrize("path", MARKDOWN + RESULTS, ids=_rel)
def test_no_machine_paths_and_no_tracker_numbers(path):
    text = path.read_text(errors="replace")
    assert _found(MACHINE_PATH, text) == []
    assert _found(TRACKER_NUMBER, text) == []


@pytest.mark.parametrize("doc", MARKDOWN, ids=_rel)
def test_links_and_quoted_paths_resolve(doc):
    text = doc.read_text()
    broken = []
    for target in LINK.findall(_without_fences(text)):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        part, _, anchor = target.partition("#")
        resolved = (doc.parent / part).resolve() if part else doc
        if not resolved.exists():
            broken.append(f"link {target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"link {target}: no heading #{anchor}")
    for quoted in REPO_PATH.findall(text):
        path = quoted.rstrip("/.")
        if any(c in path for c in "*<>") or (ROOT / path).exists():
            continue
        if re.search(rf"`{re.escape(quoted)}` at `[0-9a-f]{{7,40}}`", text):
            continue  # named at the commit that has it
        broken.append(f"`{quoted}`: not in the repository")
    assert broken == []


def test_the_checks_catch_what_they_look_for(tmp_path):
    assert _found(MACHINE_PATH, "see /work/x/y and ~/out/log, /tmp/a, .venv-ci/lib") == [
        "line 1: '/work/'", "line 1: '.venv-ci/'"]
    assert _found(TRACKER_NUMBER, "fixed in issue 21 (#21); see #faults and [a](#b), [c](#4) and &#39;") == [
        "line 1: 'issue 21'", "line 1: '#21'"]
    assert REPO_PATH.findall("`sidecar/config.py` and `vllm_omni/deploy/x.yaml`") == ["sidecar/config.py"]
