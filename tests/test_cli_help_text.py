"""``--help`` is user text (issue 43, item 6): for the program and each command, what it does, its options, an
example; no developer notes (no reST markup, no "Over 300 lines" waivers, no internal module names)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
COMMANDS = ("serve", "decode", "keygen", "demo", "bench", "fidelity", "profile")
DEVELOPER_WORDS = ("Over 300", "``", ":func:", ":class:", ".. ", "scenarios.py", "phases.py", "loadgen/", "TODO")


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_is_user_text_with_an_example(command):
    argv = [command, "--help"] if command else ["--help"]
    proc = subprocess.run([sys.executable, "-m", "code2wav.sidecar", *argv], capture_output=True, text=True,
                          env=ENV, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert not [w for w in DEVELOPER_WORDS if w in text], text
    assert "Example" in text and "code2wav-sidecar " + command in text.split("Example", 1)[1]
    assert "Exit codes: 0 done, 1 internal failure" in text
    usage, rest = text.split("\n\n", 1)
    description = rest.split("\n\n", 1)[0]
    assert len(description.split()) >= 12, f"no description of what {command or 'the program'} does: {description!r}"
    if command != "keygen" and command:
        assert "--device" in text and "default:" in text  # the options, each with its default
