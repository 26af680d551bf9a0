"""Packaging: one import namespace (``code2wav.*``) that survives generic names elsewhere on the path.

The folders ``sidecar/``, ``client/``, ``proto/`` and ``loadgen/`` install as ``code2wav.sidecar`` etc. (setuptools
``package-dir`` in pyproject.toml). The test environment has ``proto-plus`` installed (the ``test`` extra pulls it in on
purpose: it owns the top-level name ``proto``), and the subprocess runs in a folder holding a stray ``client.py`` and
``proto.py``, as a user's working directory might.
"""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP_FOLDERS = ("sidecar", "client", "proto", "loadgen", "cudart")

PROBE = textwrap.dedent("""
    import importlib.metadata as md, importlib.util, json, sys
    import proto                                   # proto-plus (or the stray proto.py): not ours
    import client                                  # the stray client.py in the working directory
    from code2wav import proto as ours
    from code2wav.client import SidecarClient      # noqa: F401
    import code2wav.sidecar.cli                    # noqa: F401
    [ep] = [e for e in md.entry_points(group="vllm_omni.general_plugins") if e.name == "code2wav_sidecar"]
    register = ep.load()
    register()
    registered = None
    if importlib.util.find_spec("vllm_omni") is not None:
        from vllm_omni.model_executor.models.registry import OmniModelRegistry
        registered = "Qwen3TTSCode2WavSidecar" in OmniModelRegistry.get_supported_archs()
    print(json.dumps({"proto": proto.__file__, "client": client.__file__, "ours": ours.__file__,
                      "ep": ep.value, "register": register.__module__, "registered": registered}))
""")


def test_proto_plus_and_a_stray_client_py_do_not_shadow_our_packages(tmp_path):
    assert md.version("proto-plus"), "the test extra installs proto-plus, which owns the top-level name `proto`"
    (tmp_path / "client.py").write_text("STRAY = True\n")
    (tmp_path / "proto.py").write_text("STRAY = True\n")
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["client"] == str(tmp_path / "client.py")          # the stray file is what `import client` gets
    assert Path(seen["ours"]).resolve() == ROOT / "proto" / "__init__.py"
    assert seen["ep"] == "code2wav.client.vllm_omni:register" and seen["register"] == "code2wav.client.vllm_omni"
    if seen["registered"] is not None:                               # vLLM-Omni installed: the plugin really registered
        assert seen["registered"] is True


def test_every_package_folder_is_listed_in_pyproject():
    import pytest
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    mapped = cfg["package-dir"]
    assert mapped == {"code2wav": "code2wav", **{f"code2wav.{name}": name for name in TOP_FOLDERS}}
    on_disk = {"code2wav." + ".".join(init.parent.relative_to(ROOT).parts)
               for name in TOP_FOLDERS for init in (ROOT / name).rglob("__init__.py")} | {"code2wav"}
    assert on_disk - listed == set(), f"add these to [tool.setuptools] packages in pyproject.toml: {sorted(on_disk - listed)}"
    assert listed - on_disk == set(), f"listed but not on disk: {sorted(listed - on_disk)}"


def test_no_bare_imports_of_our_folders():
    """Every import of our code goes through ``code2wav.``; a bare ``import proto`` would find proto-plus."""
    import re
    bare = re.compile(r"^\s*(from|import)\s+(sidecar|client|proto|loadgen|cudart)(\s|\.|$)", re.M)
    offenders = [str(p.relative_to(ROOT)) for folder in (*TOP_FOLDERS, "tests") for p in (ROOT / folder).rglob("*.py")
                 if p.name != "test_packaging.py" and bare.search(p.read_text())]
    assert offenders == []


PUBLIC_PACKAGES = ("code2wav", "code2wav.client", "code2wav.proto", "code2wav.client.vllm_omni",
                   "code2wav.client.vllm_omni_voxcpm2", "code2wav.client.cuda_ipc")


def test_public_packages_export_exactly_their_all_and_a_version():
    """``dir()`` of a public package shows its ``__all__`` and its submodules, nothing else (no ``annotations`` left
    by ``from __future__ import annotations``, no helper imports); ``code2wav.__version__`` is the installed one."""
    import importlib
    import types

    import code2wav

    stray = {}
    for name in PUBLIC_PACKAGES:
        module = importlib.import_module(name)
        public = {n for n in dir(module)
                  if not n.startswith("_") and not isinstance(getattr(module, n), types.ModuleType)}
        missing = [n for n in module.__all__ if not hasattr(module, n)]
        assert missing == [], (name, missing)
        if public - set(module.__all__):
            stray[name] = sorted(public - set(module.__all__))
    assert stray == {}
    assert code2wav.__all__ == ["__version__"] and code2wav.__version__ == md.version("code2wav-sidecar")


def test_version_falls_back_to_the_source_trees_pyproject(tmp_path):
    """Not installed (only the folder on ``sys.path``): the version is pyproject's; without one, ``0+unknown``."""
    import re
    import shutil

    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "code2wav", tree / "code2wav")
    probe = [sys.executable, "-S", "-c", "import sys; sys.path.insert(0, sys.argv[1]); import code2wav; "
             "print(code2wav.__version__)", str(tree)]  # -S: no site-packages, so no installed distribution
    (tree / "pyproject.toml").write_text('[project]\nname = "x"\nversion = "9.8.7"\n')
    assert subprocess.run(probe, capture_output=True, text=True, check=True, cwd=tmp_path).stdout.strip() == "9.8.7"
    (tree / "pyproject.toml").unlink()
    assert subprocess.run(probe, capture_output=True, text=True, check=True, cwd=tmp_path).stdout.strip() == "0+unknown"
    ours = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert md.version("code2wav-sidecar") == ours
