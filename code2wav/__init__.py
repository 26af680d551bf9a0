"""code2wav-sidecar: an out-of-process server for the codec/vocoder stage of TTS serving, and its client.

The subpackages live in their own top-level folders and install under this name (``pyproject.toml``,
``[tool.setuptools.package-dir]``): ``code2wav.sidecar`` (the server and its CLI), ``code2wav.client`` (what a
runner imports), ``code2wav.proto`` (the wire protocol), ``code2wav.loadgen`` (demo and bench) and
``code2wav.cudart`` (CUDA IPC calls). This folder holds only the package's version, ``code2wav.__version__``
(``_version.py``).
"""

from pkgutil import extend_path as _extend_path

from ._version import __version__

# A checkout's own code2wav/ (on sys.path first when a command runs from the repo root) holds only the version: the
# subpackages are found in every other code2wav/ on the path too (the installed one), as in a namespace package.
__path__ = _extend_path(__path__, __name__)

__all__ = ["__version__"]
