"""The docs stay true to the code and to the runs their figures come from.

- Every relative link (and ``#anchor``) in README.md and the Markdown docs resolves.
- Import names are the installed ``code2wav.*`` ones: no ``from client``/``import proto``/``python -m sidecar``,
  no shared-folder variable or sibling-folder path; every ``from code2wav.x import y`` in a doc imports.
- Every ``code2wav-sidecar <command> --flag`` quoted exists in that command's ``--help`` (the real CLI, run).
- Every table of figures names its source (a JSON file under ``deploy/k8s/bench/``, a ``code2wav-sidecar bench``
  command or a probe under ``loadgen/probes/``) in the text since the previous heading or table; where it names
  JSON files, every quantity in it (a number with a unit: ms, us, s, audio-s/s) equals, rounded as quoted, a
  value in them, and every command there that wrote one of them (``--json``) has that run's settings.
- The README fits on a screen and keeps the two commands that ``.ci/run`` runs; config examples load.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

BENCH_DIR = ROOT / "deploy" / "k8s" / "bench"
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "deploy" / "k8s" / "SCALING.md"])
ALL_MARKDOWN = sorted({*DOCS, ROOT / "proto" / "README.md", ROOT / "tests" / "data" / "README.md",
                       ROOT / "loadgen" / "probes" / "README.md"})
SUBCOMMANDS = ("serve", "decode", "keygen", "demo", "bench", "fidelity")
SERVE_COMMAND = "pip install torch==2.13.0 -e . && code2wav-sidecar serve --model default"
TEST_COMMAND = "pip install torch==2.13.0 -e '.[test,bench]' && bash .ci/install-deploy-tools && python -m pytest -q"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _fenced(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)]


def _without_fences(text: str) -> str:
    return re.sub(r"^```\w*\n.*?^```", "", text, flags=re.M | re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_\[\]()]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", _without_fences(path.read_text()), re.M)}


# ------------------------------------------------------------------------------------------------ links, imports
@pytest.mark.parametrize("doc", ALL_MARKDOWN, ids=_rel)
def test_relative_links_resolve(doc):
    broken = []
    for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", _without_fences(doc.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path_part, _, anchor = target.partition("#")
        resolved = (doc.parent / path_part).resolve() if path_part else doc
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.name}")
    assert broken == []


_OLD_NAMES = re.compile(r"^\s*from (client|proto|sidecar|loadgen)[. ]|^\s*import (client|proto|sidecar|loadgen)\b"
                        r"|python -m (client|proto|sidecar|loadgen)\b|CODE2WAV_[S]HARED|\.\./[s]hared", re.M)  # [x]: no self-match


@pytest.mark.parametrize("doc", ALL_MARKDOWN, ids=_rel)
def test_docs_use_the_installed_import_names(doc):
    text = doc.read_text()
    assert [m.group(0).strip() for m in _OLD_NAMES.finditer(text)] == []
    for module, names in re.findall(r"from (code2wav(?:\.\w+)+) import ([\w, ]+)", text):
        imported = importlib.import_module(module)
        for name in (n.strip() for n in names.split(",")):
            assert hasattr(imported, name), f"{doc.name}: {module} has no {name}"


def test_python_examples_compile():
    for doc in DOCS:
        for lang, body in _fenced(doc.read_text()):
            if lang == "python":
                compile(body, f"{doc.name} example", "exec")


# ------------------------------------------------------------------------------------------------ CLI
@functools.cache
def _options(subcommand: str) -> frozenset[str]:
    proc = subprocess.run([sys.executable, "-m", "code2wav.sidecar", subcommand, "--help"], capture_output=True,
                          text=True, env=ENV, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return frozenset(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", proc.stdout))


def _code_texts(text: str) -> list[str]:
    """Shell commands quoted in a doc: fenced blocks (continuation lines joined) and inline code spans (which
    may wrap across lines)."""
    out = []
    for lang, body in _fenced(text):
        if lang in ("", "bash", "sh", "console", "shell"):
            out += body.replace("\\\n", " ").splitlines()
    out += [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", _without_fences(text))]
    return out


_COMMAND = re.compile(r"code2wav-sidecar ([a-z]+)(?![\w:-])(.*)")


def _commands(doc: Path) -> list[tuple[str, list[str], str]]:
    """(subcommand, its --flags, the command line) for each ``code2wav-sidecar <word>`` quoted in ``doc``."""
    found = []
    for code in _code_texts(doc.read_text()):
        for m in _COMMAND.finditer(code):
            rest = re.split(r"\s(?:&&|\||;|#)\s?|\s#", m.group(2))[0]
            flags = [tok.split("=", 1)[0] for tok in rest.split() if tok.startswith("--")]
            found.append((m.group(1), flags, " ".join(["code2wav-sidecar", m.group(1), *rest.split()])))
    return found


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_quoted_commands_and_flags_exist_in_the_cli(doc):
    wrong = []
    for subcommand, flags, line in _commands(doc):
        if subcommand not in SUBCOMMANDS:
            wrong.append(f"{line}: no command {subcommand!r}")
            continue
        wrong += [f"{line}: {subcommand} has no {flag}" for flag in flags if flag not in _options(subcommand)]
    assert wrong == []


def test_command_parser_reads_flags_and_stops_at_shell_operators(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("Run `code2wav-sidecar serve --model default --max-streams=4 && echo --not-a-flag`, see the\n"
                   "`code2wav-sidecar ready: address=...` line.\n```bash\ncode2wav-sidecar bench --dtype bfloat16 \\\n"
                   "    --json out.json   # --comment\n```\n")
    assert sorted(_commands(doc)) == [
        ("bench", ["--dtype", "--json"], "code2wav-sidecar bench --dtype bfloat16 --json out.json"),
        ("serve", ["--model", "--max-streams"], "code2wav-sidecar serve --model default --max-streams=4")]
    assert "--max-streams" in _options("serve") and "--plot" in _options("bench")


# ------------------------------------------------------------------------------------------------ figures
_QUANTITY = re.compile(r"((?:[+-]?\d+(?:\.\d+)?\s*(?:-|/)\s*)*[+-]?\d+(?:\.\d+)?)\s*(ms|us|s|audio-s/s)(?![\w-])")


def _tables(text: str) -> list[tuple[str, list[list[str]]]]:
    """(context, rows of cells) of every Markdown table; the context is the text since the previous heading or
    table, where a table names its source."""
    lines = text.splitlines()
    tables, context_start, i = [], 0, 0
    while i < len(lines):
        if lines[i].startswith("#"):
            context_start = i
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[\s|:-]+\|$", lines[i + 1]):
            j = i + 2
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in [lines[i], *lines[i + 2:j]]]
            before = "\n".join(lines[context_start:i])
            tables.append((before, rows))
            context_start, i = j, j
            continue
        i += 1
    return tables


def _quantities(cell: str) -> list[str]:
    return [num for group, _unit in _QUANTITY.findall(cell) for num in re.findall(r"\d+(?:\.\d+)?", group)]


def _leaves(node) -> list[float]:
    if isinstance(node, dict):
        return [v for x in node.values() for v in _leaves(x)]
    if isinstance(node, list):
        return [v for x in node for v in _leaves(x)]
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return [float(node)]
    return []


def _matches(quoted: str, values: list[float]) -> bool:
    digits = len(quoted.split(".")[1]) if "." in quoted else 0
    target = float(quoted)
    return any(abs(round(v * scale, digits) - target) < 1e-9 for v in values for scale in (1.0, 1e3, 1e-3))


def _json_sources(context: str) -> list[Path]:
    return [BENCH_DIR / name for name in dict.fromkeys(re.findall(r"bench/([\w.-]+\.json)", context))]


def _figure_tables() -> list[tuple[Path, str, list[list[str]]]]:
    return [(doc, context, rows) for doc in DOCS for context, rows in _tables(doc.read_text())
            if any(_quantities(c) for row in rows for c in row[1:]) or rows[0][-1] == "us"]


def test_every_figure_table_names_its_source_and_quotes_it_exactly():
    tables = _figure_tables()
    assert len(tables) >= 5  # README, performance history, design notes, SCALING
    problems = []
    for doc, context, rows in tables:
        where = f"{doc.name}: table {rows[0]}"
        sources = _json_sources(context)
        if not sources and not re.search(r"code2wav-sidecar bench|loadgen/probes/", context):
            problems.append(f"{where}: names no source (a deploy/k8s/bench JSON, a bench command or a probe)")
            continue
        missing = [p.name for p in sources if not p.is_file()]
        if missing:
            problems.append(f"{where}: no such file {missing}")
            continue
        values = [v for p in sources for v in _leaves(json.loads(p.read_text()))]
        for row in rows[1:] if sources else []:
            for cell in row[1:]:
                problems += [f"{where}: {row[0]!r}: {q} is in none of {[p.name for p in sources]}"
                             for q in _quantities(cell) if not _matches(q, values)]
    assert problems == [], "\n".join(problems)


def test_commands_that_wrote_a_bench_json_match_its_settings():
    checked = 0
    for doc in DOCS:
        for subcommand, _flags, line in _commands(doc):
            m = re.search(r"--json (\S+)", line)
            if subcommand != "bench" or m is None or not (ROOT / m.group(1)).is_file():
                continue
            settings = json.loads((ROOT / m.group(1)).read_text())["settings"]
            tokens = line.split()[2:]
            for i, tok in enumerate(tokens):
                if not tok.startswith("--") or tok in ("--json", "--transport"):
                    continue
                key = {"transport_batch": "batch_cap"}.get(tok[2:].replace("-", "_"), tok[2:].replace("-", "_"))
                value = tokens[i + 1] if i + 1 < len(tokens) and not tokens[i + 1].startswith("--") else True
                if key in settings:
                    assert settings[key] == value or str(settings[key]) == value, (doc.name, line, key)
                    checked += 1
    assert checked >= 10


def test_table_check_catches_a_figure_that_is_not_in_the_json():
    values = _leaves(json.loads((BENCH_DIR / "h200-bfloat16.json").read_text()))
    assert _matches("824", values) and _matches("575", values) and _matches("8.3", values)
    assert _matches("0.58", values)  # 575.44 ms quoted in seconds
    assert not _matches("825", values) and not _matches("8.4", values)
    assert _quantities("133.6 ms (+11.0 ms), p95 137.3 ms") == ["133.6", "11.0", "137.3"]
    assert _quantities("7.20-7.24 ms (+2.30 / +2.32 ms), 4 steps at batch 16") == ["7.20", "7.24", "2.30", "2.32"]


# ------------------------------------------------------------------------------------------------ README
def test_readme_fits_a_screen_and_keeps_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    head = readme.split("\n## ", 1)[0]  # the two commands come first
    assert SERVE_COMMAND in head.splitlines() and TEST_COMMAND in head.splitlines()
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text().splitlines()
    (example,) = [body for lang, body in _fenced(readme) if lang == "python"]
    assert len(example.strip().splitlines()) <= 10 and "from code2wav.client import SidecarClient" in example


def test_config_examples_load_with_the_servers_loader(tmp_path):
    from code2wav.sidecar.config import load_config

    examples = [body for doc in DOCS for lang, body in _fenced(doc.read_text())
                if lang == "yaml" and body.startswith("# sidecar.yaml")]
    assert examples
    for i, body in enumerate(examples):
        path = tmp_path / f"example{i}.yaml"
        path.write_text(body)
        cfg = load_config(path)
        assert "null" not in body and cfg.graphs.max_graph_memory_bytes is not None
