"""Structure rules, checked from the source (ast, no imports of the code under test):

- no import cycles among ``code2wav.*`` modules (every import that runs, at module level or inside a function;
  ``if TYPE_CHECKING:`` blocks excluded);
- no module over 400 lines, and no module excusing its length (a docstring line starting "Over 300 lines:");
- one class per name across the package (two classes of one name are two things readers mix up);
- stream modes are objects: outside ``sidecar/modes/`` no sidecar code compares against a mode's name;
- decoder families stay in their folder: outside ``sidecar/models/`` no sidecar code names a family;
- ``proto`` stays sans-IO (no torch, zmq, numpy) and ``client`` never imports ``sidecar``.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400


def _package_dirs() -> dict[str, Path]:
    """``code2wav.<x>`` -> folder, from pyproject's setuptools package-dir."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dir = pyproject["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in package_dir.items() if name.startswith("code2wav.")}


def _modules() -> dict[str, Path]:
    """Every ``code2wav.*`` module name -> its file."""
    out: dict[str, Path] = {}
    for package, folder in _package_dirs().items():
        if package.count(".") != 1 or not folder.is_dir():  # subpackages are found under their top package
            continue
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The ``code2wav`` modules ``name`` imports (the package itself counts for ``from pkg import x``)."""
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def resolve(module: str | None, level: int) -> str:
        if level == 0:
            return module or ""
        base = name.split(".")
        base = base if is_package else base[:-1]
        base = base[: len(base) - (level - 1)]
        return ".".join(base + ([module] if module else []))

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for orelse in child.orelse:
                    visit(orelse)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    found.add(alias.name)
            elif isinstance(child, ast.ImportFrom):
                target = resolve(child.module, child.level)
                submodules = {f"{target}.{alias.name}" for alias in child.names} & known
                found.update(submodules)  # ``from pkg import submodule``: the submodule, not the package
                if len(submodules) < len(child.names):
                    found.add(target)
            visit(child)

    visit(tree)
    # a module's own ancestor packages are initialised before it: importing them closes no cycle
    return {m for m in found if m in known and m != name and not name.startswith(m + ".")}


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (as a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = dfs(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = dfs(node)
            if found:
                return found
    return None


def test_import_graph_is_built_from_the_real_packages():
    graph = _import_graph()
    assert {"code2wav.sidecar.server", "code2wav.client.client", "code2wav.proto.messages"} <= set(graph)
    assert "code2wav.sidecar.stepper" in graph["code2wav.sidecar.server"]  # the graph sees relative imports


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = _cycle(_import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_module_is_over_the_line_limit_or_excuses_its_length():
    too_long, excused = [], []
    for name, path in sorted(_modules().items()):
        text = path.read_text()
        if len(text.splitlines()) > MAX_LINES:
            too_long.append(f"{path.relative_to(ROOT)} ({len(text.splitlines())} lines)")
        if any(line.startswith("Over 300 lines:") for line in (ast.get_docstring(ast.parse(text)) or "").splitlines()):
            excused.append(str(path.relative_to(ROOT)))
    assert not too_long, f"modules over {MAX_LINES} lines (split them by responsibility): {too_long}"
    assert not excused, f"modules with a length waiver in their docstring: {excused}"


def _class_names() -> dict[str, list[str]]:
    """Every class defined anywhere in a ``code2wav`` module (nested ones too) -> where."""
    found: dict[str, list[str]] = {}
    for name, path in sorted(_modules().items()):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_one_class_per_name_across_the_package():
    duplicated = {name: where for name, where in _class_names().items() if len(where) > 1}
    assert not duplicated, f"class names defined more than once: {duplicated}"


def _sidecar_sources(excluded: str) -> list[tuple[Path, str]]:
    folder = _package_dirs()["code2wav.sidecar"]
    return [(p, p.read_text()) for p in sorted(folder.rglob("*.py")) if excluded not in p.relative_to(folder).parts]


MODE_BRANCH = re.compile(r"""(mode\s*[!=]=\s*["'](exact|window)["'])|(["'](exact|window)["']\s*[!=]=)""")


def test_the_served_modes_are_the_wires():
    from code2wav.proto import STREAM_MODES
    from code2wav.sidecar.modes import MODES

    assert tuple(MODES) == STREAM_MODES  # the objects here, their names on the wire (proto)


def test_no_branching_on_a_stream_mode_outside_the_modes():
    assert MODE_BRANCH.search('if stream.mode == "window":') and MODE_BRANCH.search("'exact' != m")
    offenders = [f"{p.name}:{i}" for p, text in _sidecar_sources("modes")
                 for i, line in enumerate(text.splitlines(), 1) if MODE_BRANCH.search(line)]
    assert not offenders, f"branches on a stream mode's name outside sidecar/modes/: {offenders}"


def test_no_family_named_outside_its_folder():
    names = ("qwen3", "Qwen3", "voxcpm", "VoxCPM")
    offenders = [f"{p.name}:{i}" for p, text in _sidecar_sources("models")
                 for i, line in enumerate(text.splitlines(), 1)
                 if any(n in line for n in names) and "qwen3-tts-12hz" not in line]
    assert not offenders, f"a decoder family named outside sidecar/models/: {offenders}"


def test_layering():
    graph = _import_graph()
    for name, deps in graph.items():
        if name.startswith("code2wav.client"):
            assert not any(d.startswith("code2wav.sidecar") for d in deps), name
    for name, path in _modules().items():
        if name.startswith("code2wav.proto"):
            tree = ast.parse(path.read_text())
            imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree)
                         if isinstance(n, ast.ImportFrom) and n.level == 0}
            assert not imported & {"torch", "zmq", "numpy"}, name
