"""The installed distribution's version (``importlib.metadata``); in a source tree that is on ``sys.path`` but
not installed, the version in the ``pyproject.toml`` beside the ``code2wav`` folder; else ``0+unknown``."""

import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

__all__ = ["__version__", "DISTRIBUTION"]

DISTRIBUTION = "code2wav-sidecar"


def _source_tree_version() -> str:
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if pyproject.is_file():
        found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M)
        if found:
            return found.group(1)
    return "0+unknown"


try:
    __version__ = version(DISTRIBUTION)
except PackageNotFoundError:
    __version__ = _source_tree_version()
