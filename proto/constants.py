"""Constants of wire protocol v1 that the message declarations and their users share.

Rules: sans-IO; stdlib only; imports nothing outside ``proto``.
"""

from __future__ import annotations

__all__ = ["PROTOCOL_VERSION", "STREAM_MODES", "DEFAULT_LEFT_CONTEXT_FRAMES", "MAX_REGION_EVENTS", "MAX_CODES_TOKEN"]

PROTOCOL_VERSION = 1
STREAM_MODES: tuple[str, ...] = ("exact", "window")
DEFAULT_LEFT_CONTEXT_FRAMES = 25
"""What clients send for ``window`` mode unless told otherwise (vLLM-Omni's default)."""
MAX_REGION_EVENTS = 64
"""Events a ``read`` region may register (``codes_event`` and ``audio_event`` index them)."""
MAX_CODES_TOKEN = (1 << 32) - 2
"""The largest ``codes_token``: doorbell words are 32-bit; tokens are even, the server's release is the token + 1."""
