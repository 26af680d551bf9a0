"""How ``code2wav-sidecar --help`` reads: every option with its default, the command's description reflowed, its
example and exit codes as written."""

from __future__ import annotations

import argparse
import copy

DTYPE_CHOICES = ("float32", "bfloat16", "float16")
DTYPE_HELP = ("float32 (exact to the golden vectors), bfloat16 (about 2-3x the throughput on a GPU, half the state "
              "memory; on a CPU without native bfloat16 many times slower: a warning says so at start) or float16")
EXIT_CODES = "Exit codes: 0 done, 1 internal failure (a log file is named), 2 a bad option or input, 130 interrupted."


def command_epilog(*examples: str) -> str:
    """The text after a command's options: its example(s) and the exit codes."""
    lines = ["Example:" if len(examples) == 1 else "Examples:", *(f"  {e}" for e in examples), "", EXIT_CODES]
    return "\n".join(lines)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every option's default (options without a help text too): argparse's own, or
    ``unset``/``off`` for None/False, unless the help text already states it. The description is reflowed; the
    epilog (example, exit codes) is printed as written."""

    @staticmethod
    def _default_suffix(action: argparse.Action) -> str | None:
        if action.default is argparse.SUPPRESS or not action.option_strings or action.required:
            return None
        if action.default is None:
            return "(default: unset)"
        if action.default is False and action.nargs == 0:
            return "(default: off)"
        return "(default: %(default)s)"

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        suffix = self._default_suffix(action)
        if "default:" in text or suffix is None:
            return text
        return f"{text} {suffix}".strip()

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and self._default_suffix(action):  # argparse prints nothing for an empty help
            action = copy.copy(action)
            action.help = self._default_suffix(action)
        return super()._format_action(action)

    def add_text(self, text: str | None) -> None:
        if text and text.startswith(("Example:", "Examples:", "Scenarios")):  # the epilog: as written
            self._add_item(lambda t: t + "\n", [text])
        else:
            super().add_text(text)
