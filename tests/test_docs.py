"""The docs stay true to the code and to the runs their figures come from.

- (Every relative link and ``#anchor`` resolves: ``tests/test_docs_hygiene.py``, with this module's ``_anchors``.)
- Import names are the installed ``code2wav.*`` ones: no ``from client``/``import proto``/``python -m sidecar``,
  no shared-folder variable or sibling-folder path; every ``from code2wav.x import y`` in a doc imports.
- Every ``code2wav-sidecar <command> --flag`` quoted exists in that command's ``--help`` (the real CLI, run).
- Every table of figures names its source, in the text since the previous heading or table or in its own cells: a
  result file under ``docs/results/`` (JSON, or a tool's text output), a ``code2wav-sidecar bench``/``profile``
  command, or a retired probe at the commit that has it (``loadgen/probes/NAME.py`` at ``COMMIT``, checked in the
  history). Where it names result files, every quantity in it (a number with a unit: ms, us, s, audio-s/s) equals,
  rounded as quoted, a value in them (a row that names its own files: in those); every command that wrote one
  (``--json``, a ``--scenario`` expanded to its flags) has that run's settings.
- ``docs/results/INDEX.md`` lists exactly the result files, each cited by the docs it names and no other, with the
  GPU its JSON records.
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

RESULTS_DIR = ROOT / "docs" / "results"
INDEX = RESULTS_DIR / "INDEX.md"
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "deploy" / "k8s" / "SCALING.md"])
ALL_MARKDOWN = sorted({*DOCS, ROOT / "proto" / "README.md", ROOT / "tests" / "data" / "README.md", INDEX})
SUBCOMMANDS = ("serve", "decode", "keygen", "demo", "bench", "fidelity", "profile")
SERVE_COMMAND = ("pip install torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu -e . && "
                 "code2wav-sidecar serve --model default")
TEST_COMMAND = ("pip install torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu -e '.[test,bench]' && "
                "bash .ci/install-deploy-tools && python -m pytest -q")
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


# ------------------------------------------------------------------------------------------------ imports
# (relative links and their anchors: tests/test_docs_hygiene.py, over every Markdown file)
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


_RESULT = re.compile(r"results/([\w.-]+\.(?:json|txt))")
_PROBE_AT = re.compile(r"`loadgen/probes/(\w+\.py)` at `([0-9a-f]{7,40})`")


def _result_sources(text: str) -> list[Path]:
    return [RESULTS_DIR / name for name in dict.fromkeys(_RESULT.findall(text))]


def _values(path: Path) -> list[float]:
    """Every number a result file holds: a JSON file's numeric leaves, a text output's numbers."""
    if path.suffix == ".json":
        return _leaves(json.loads(path.read_text()))
    return [float(x) for x in re.findall(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?![\w.])", path.read_text())]


@functools.cache
def _in_history(commit: str, path: str) -> bool | None:
    """Whether ``commit`` has ``path`` (None where there is no git history to ask)."""
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--git-dir"], capture_output=True).returncode != 0:
        return None
    return subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}:{path}"],
                          capture_output=True).returncode == 0


def _figure_tables() -> list[tuple[Path, str, list[list[str]]]]:
    return [(doc, context, rows) for doc in DOCS for context, rows in _tables(doc.read_text())
            if any(_quantities(c) for row in rows for c in row[1:]) or rows[0][-1] == "us"]


def _table_problems(where: str, context: str, rows: list[list[str]]) -> list[str]:
    """What is wrong with one table of figures: no source named, a result file or probe that does not exist, a
    quantity in none of its files."""
    table_text = context + "\n" + "\n".join("|".join(row) for row in rows)
    sources = _result_sources(table_text)
    probes = _PROBE_AT.findall(context)
    if not sources and not probes and not re.search(r"code2wav-sidecar (bench|profile)", table_text):
        return [f"{where}: names no source (a docs/results file, a bench/profile command or a probe at a commit)"]
    problems = [f"{where}: loadgen/probes/{name} is not in the history at {commit}"
                for name, commit in probes if _in_history(commit, f"loadgen/probes/{name}") is False]
    missing = [p.name for p in sources if not p.is_file()]
    if missing:
        return problems + [f"{where}: no such file {missing}"]
    table_values = [v for p in sources for v in _values(p)]
    for row in rows[1:] if sources else []:
        own = _result_sources("|".join(row))
        values = [v for p in own for v in _values(p)] if own else table_values
        for cell in row[1:]:
            problems += [f"{where}: {row[0]!r}: {q} is in none of {[p.name for p in own or sources]}"
                         for q in _quantities(cell) if not _matches(q, values)]
    return problems


def test_every_figure_table_names_its_source_and_quotes_it_exactly():
    tables = _figure_tables()
    assert len(tables) >= 10  # README, performance (figures, soak, profile), design notes, voxcpm2, SCALING
    problems = []
    for doc, context, rows in tables:
        problems += _table_problems(f"{doc.name}: table {rows[0]}", context, rows)
    assert problems == [], "\n".join(problems)


def _bench_tokens(line: str) -> list[str]:
    """A quoted ``bench`` command's flags, with ``--scenario NAME`` expanded to the scenario's (one run)."""
    from code2wav.loadgen.scenarios import expand, split_scenario

    names, rest = split_scenario(line.split()[2:])
    if names is None:
        return rest
    (run,) = expand(names, rest)
    return list(run.argv)


def test_commands_that_wrote_a_bench_json_match_its_settings():
    checked = 0
    for doc in DOCS:
        for subcommand, _flags, line in _commands(doc):
            m = re.search(r"--json (\S+)", line)
            if subcommand != "bench" or m is None or not (ROOT / m.group(1)).is_file():
                continue
            settings = json.loads((ROOT / m.group(1)).read_text())["settings"]
            tokens = _bench_tokens(line)
            given = {tok: tokens[i + 1] if i + 1 < len(tokens) and not tokens[i + 1].startswith("--") else True
                     for i, tok in enumerate(tokens) if tok.startswith("--")}  # the last value of a flag wins
            for tok, value in given.items():
                if tok in ("--json", "--transport"):
                    continue
                key = {"transport_batch": "batch_cap"}.get(tok[2:].replace("-", "_"), tok[2:].replace("-", "_"))
                if key in settings:
                    assert settings[key] == value or str(settings[key]) == value, (doc.name, line, key)
                    checked += 1
    assert checked >= 50  # README, performance.md, voxcpm2.md: their scenarios expanded


def test_table_check_catches_a_figure_that_is_not_in_the_json():
    values = _leaves(json.loads((RESULTS_DIR / "h200-bfloat16.json").read_text()))
    assert _matches("824", values) and _matches("575", values) and _matches("8.3", values)
    assert _matches("0.58", values)  # 575.44 ms quoted in seconds
    assert not _matches("825", values) and not _matches("8.4", values)
    assert _quantities("133.6 ms (+11.0 ms), p95 137.3 ms") == ["133.6", "11.0", "137.3"]
    assert _quantities("7.20-7.24 ms (+2.30 / +2.32 ms), 4 steps at batch 16") == ["7.20", "7.24", "2.30", "2.32"]


def test_table_check_reads_text_outputs_rows_own_files_and_probes_in_the_history():
    """A text output's numbers count (a kernel profile); a row that names its own file is checked against that file
    only; a probe named at a commit must be in that commit; a figure edited by one digit fails."""
    profile = "h200-bfloat16-b64-kernels-state-cols.txt"
    assert _matches("4500.4", _values(RESULTS_DIR / profile)) and not _matches("4500.5", _values(RESULTS_DIR / profile))
    rows = [["kernel", "total"], ["snake", "4500.4 us"]]
    assert _table_problems("t", f"Source: results/{profile}", rows) == []
    assert _table_problems("t", f"Source: results/{profile}", [rows[0], ["snake", "4500.5 us"]]) != []
    both = f"results/{profile} and results/h200-bfloat16.json"
    assert _table_problems("t", both, [rows[0], ["snake", "824 audio-s/s"]]) == []  # the table's files
    own = ["snake [p](results/h200-bfloat16-b64-kernels-state-cols.txt)", "824 audio-s/s"]
    assert _table_problems("t", both, [rows[0], own]) != []  # the row's own file only
    assert _table_problems("t", "no source here", rows) != []
    good, bad = "`loadgen/probes/doorbell.py` at `7287a53`", "`loadgen/probes/doorbell.py` at `10c8450`"
    assert _table_problems("t", good, [["mode", "us"], ["bell", "+297 us"]]) == []
    if _in_history("7287a53", "loadgen/probes/doorbell.py") is not None:  # a checkout with its history
        assert _table_problems("t", bad, [["mode", "us"], ["bell", "+297 us"]]) != []


def test_results_index_lists_every_result_file_and_who_cites_it():
    rows = {}
    for _context, table in _tables(INDEX.read_text()):
        for row in table[1:]:
            name = re.fullmatch(r"\[([\w.-]+)\]\(\1\)", row[0])
            assert name, row
            rows[name.group(1)] = row
    files = {p.name for p in RESULTS_DIR.iterdir() if p != INDEX}
    assert set(rows) == files and len(files) >= 20
    for name, (_file, date, commit, gpu, what, cited) in rows.items():
        assert re.fullmatch(r"20\d\d-\d\d-\d\d", date) and re.search(r"`[0-9a-f]{7}`", commit) and what, name
        named = set(re.findall(r"\]\(([\w./-]+\.md)\)", cited))
        citing = {os.path.relpath(doc, RESULTS_DIR) for doc in DOCS if name in doc.read_text()}
        assert named == citing and citing, (name, named, citing)
        if name.endswith(".json"):
            recorded = {g for g in _gpus(json.loads((RESULTS_DIR / name).read_text())) if g}
            assert recorded <= {f"NVIDIA {gpu}"}, (name, gpu, recorded)


def _gpus(node) -> set:
    if isinstance(node, dict):
        found = {node["environment"].get("gpu")} if isinstance(node.get("environment"), dict) else set()
        return found.union(*(_gpus(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_gpus(v) for v in node))
    return set()


# ------------------------------------------------------------------------------------------------ README
def test_readme_fits_a_screen_and_keeps_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    head = readme.split("\n## ", 1)[0]  # the two commands come first
    assert SERVE_COMMAND in head.splitlines() and TEST_COMMAND in head.splitlines()
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text().splitlines()
    examples = [body for lang, body in _fenced(readme) if lang == "python"]
    assert len(examples) == 2  # codes (Qwen3-TTS) and latents (VoxCPM2): tests/test_client_families.py runs them
    for example in examples:
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
