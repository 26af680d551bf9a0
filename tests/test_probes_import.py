"""Every ``code2wav`` import of the probes under loadgen/probes/ resolves against the current code. The probes are
scripts that no other test runs (most do their work at import), so a moved module broke them silently:
compile_profile imported ``sidecar.models.routine`` after the routine moved to ``sidecar/graphs/``. Checked from
their source (AST), without running them."""

from __future__ import annotations

import ast
import importlib
import importlib.util

import pytest

from conftest import ROOT

PROBES = ROOT / "loadgen" / "probes"


def _code2wav_imports(source: str) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of every ``import code2wav...`` / ``from code2wav... import names`` in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("code2wav"):
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.startswith("code2wav")]
    return found


def test_the_check_sees_a_moved_module():
    assert _code2wav_imports("from code2wav.sidecar.models.routine import StreamRoutine\nimport code2wav.client") == [
        ("code2wav.sidecar.models.routine", ["StreamRoutine"]), ("code2wav.client", [])]
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("code2wav.sidecar.models.routine")


@pytest.mark.parametrize("name", sorted(p.stem for p in PROBES.glob("*.py")))
def test_probe_imports_resolve(name):
    imports = _code2wav_imports((PROBES / f"{name}.py").read_text())
    for module_name, names in imports:
        module = importlib.import_module(module_name)
        missing = [n for n in names if not hasattr(module, n)
                   and importlib.util.find_spec(f"{module_name}.{n}") is None]
        assert not missing, f"{name}.py: {module_name} has no {missing}"


def _wrapped_names(source: str) -> list[tuple[str, str, str]]:
    """``(alias, dotted attribute, name)`` of every ``wrap(Alias[.Attr], "name", ...)`` call in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "wrap" and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant):
            target = ast.unparse(node.args[0])
            alias, _, attr = target.partition(".")
            found.append((alias, attr, node.args[1].value))
    return found


@pytest.mark.parametrize("name", sorted(p.stem for p in PROBES.glob("*.py")))
def test_what_a_probe_wraps_exists(name):
    """The probes that time the server wrap its functions by name (``_marks.wrap``); a renamed or moved one made
    ``round_trip_server.py`` fail at start (it wrapped ``Server._engine_step`` after the stepper took it over)."""
    source = (PROBES / f"{name}.py").read_text()
    aliases = {alias.asname: alias.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Import)
               for alias in node.names if alias.asname and alias.name.startswith("code2wav")}
    for alias, attr, wrapped in _wrapped_names(source):
        if alias not in aliases:
            continue
        obj = importlib.import_module(aliases[alias])
        for part in filter(None, attr.split(".")):
            obj = getattr(obj, part)
        assert hasattr(obj, wrapped), f"{name}.py wraps {alias}.{attr}.{wrapped}, which does not exist"
