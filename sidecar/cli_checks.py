"""What every ``code2wav-sidecar`` command shares at its door: a parser whose mistakes are one ``error:`` line
(exit code 2), argument types that check ranges, files, folders and formats before any work starts, and the
guard that turns an unexpected failure into one line naming a log file with the traceback (exit code 1).

Nothing here imports torch at import time (only ``check_device``, after the parse, asks CUDA): a bad flag is
answered in the time Python starts."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Sequence

EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
ADDRESS_SCHEMES = ("ipc://", "tcp://")
DEVICE_FORM = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
DEVICE_HELP = "auto | cpu | cuda | cuda:N"


class UsageError(ValueError):
    """A value the person has to change; the message is one line that names the option and what is accepted."""


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr (``error: <what>; see <prog> --help``) and
    exit code 2, instead of argparse's usage block. Its sub-commands' parsers are of this class too."""

    def error(self, message: str):  # noqa: D102 - argparse's hook
        self.exit(EXIT_USAGE, f"error: {message} (see `{self.prog} --help`)\n")


def fail(message: str) -> int:
    """Print one ``error:`` line and return the usage exit code."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def int_at_least(low: int, meaning: str = "") -> Callable[[str], int]:
    """argparse type: an integer ``>= low`` (``meaning`` is added to the error, e.g. ``0 = all``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}{meaning}, got {text!r}")
        return value

    return parse


def float_above(low: float, inclusive: bool = False) -> Callable[[str], float]:
    """argparse type: a finite number ``> low`` (``>= low`` when ``inclusive``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        finite = value is not None and math.isfinite(value)
        if not finite or value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(f"expected a number {'>=' if inclusive else '>'} {low:g}, got {text!r}")
        return value

    return parse


def int_list(low: int = 1, allow_empty: bool = False) -> Callable[[str], str]:
    """argparse type: comma-separated integers ``>= low`` (the text is kept: the commands split it themselves)."""

    def parse(text: str) -> str:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts and allow_empty:
            return text
        if not parts or not all(re.fullmatch(r"\d+", p) and int(p) >= low for p in parts):
            raise argparse.ArgumentTypeError(f"expected comma-separated integers >= {low} (e.g. 1,8,64), got {text!r}")
        return text

    return parse


def device_arg(text: str) -> str:
    """argparse type: ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (whether CUDA is there: ``device_problem``)."""
    problem = device_form_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def device_form_problem(text: str) -> str | None:
    if DEVICE_FORM.match(text):
        return None
    return f"{text!r} is not a device; use {DEVICE_HELP}"


def check_device(spec: str) -> str | None:
    """Why ``spec`` (from a flag or a config file) is no device this machine has, in one line, or None. Imports
    torch (to ask CUDA), so it runs after the parse."""
    from .models import resolve_device

    problem = device_form_problem(spec)
    if problem is not None:
        return f"--device: {problem}"
    try:
        device = resolve_device(spec)
    except ValueError as exc:
        return str(exc)
    if device.type == "cuda" and device.index is not None:
        import torch

        if device.index >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            return f"--device {spec}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
    return None


def address_arg(text: str) -> str:
    """argparse type: a ZeroMQ address ``ipc:///path`` or ``tcp://host:port`` (``default`` passes through)."""
    if text == "default" or (text.startswith(ADDRESS_SCHEMES) and len(text) > len("ipc://")):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} has no scheme; use ipc:///path/to/socket or tcp://host:port")


def model_arg(names: Sequence[str]) -> Callable[[str], str]:
    """argparse type: one of ``names`` (random-weights models) or an existing folder (its contents are checked
    where the family is known: ``models.registry.check_model_folder``)."""

    def parse(text: str) -> str:
        if text in names or Path(text).is_dir():
            return text
        what = "is a file, not a folder" if Path(text).exists() else "no such folder"
        raise argparse.ArgumentTypeError(f"{text}: {what}; give a model folder (e.g. a TTS checkpoint's "
                                         f"speech_tokenizer/) or one of {', '.join(names)} (random weights)")

    return parse


def input_file(text: str) -> str:
    """argparse type: an existing, readable file."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text}: not readable (permission denied)")
    return text


def output_file(*suffixes: str) -> Callable[[str], str]:
    """argparse type: a file that can be written (its folder exists and is writable), with one of ``suffixes``
    (none given: any). Nothing is created here."""

    def parse(text: str) -> str:
        path = Path(text)
        if suffixes and path.suffix.lower() not in suffixes:
            raise argparse.ArgumentTypeError(f"{text}: use a file name ending in {' or '.join(suffixes)}")
        folder = path.parent if str(path.parent) else Path(".")
        if not folder.is_dir():
            raise argparse.ArgumentTypeError(f"{text}: the folder {folder} does not exist; create it first")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise argparse.ArgumentTypeError(f"{text}: the folder {folder} is not writable")
        if path.is_dir() or (path.exists() and not os.access(path, os.W_OK)):
            raise argparse.ArgumentTypeError(f"{text}: exists and cannot be overwritten")
        return text

    return parse


def needs_package(module: str, install: str, purpose: str) -> str | None:
    """None when ``module`` imports, else the one line that says what to install."""
    try:
        __import__(module)
    except ImportError:
        return f"{purpose} needs {module}, which is not installed: pip install {install}"
    return None


def crash_log_path(command: str) -> Path:
    return Path(tempfile.gettempdir()) / f"code2wav-sidecar-{command}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"


def run_guarded(command: str, body: Callable[[], int]) -> int:
    """``body()``'s exit code; a ``UsageError`` is one line and exit code 2; Ctrl-C exit code 130; any other
    exception is an internal failure: its traceback goes to a log file and one line names it (exit code 1)."""
    try:
        return body()
    except UsageError as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - the one place an unexpected failure becomes a line and a log
        path = crash_log_path(command)
        try:
            path.write_text(traceback.format_exc())
            where = f"traceback in {path}"
        except OSError:
            where = "no log file could be written"
        first = str(exc).splitlines()[0] if str(exc) else ""
        print(f"error: internal failure in {command}: {type(exc).__name__}: {first} ({where}; please report it)",
              file=sys.stderr, flush=True)
        return EXIT_INTERNAL
