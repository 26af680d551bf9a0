"""The message types of wire protocol v1, both directions in one table: the protocol's constants and the
``ClientMessage`` / ``ServerMessage`` unions. The dataclasses, each with its wire form, are in
``client_messages.py`` and ``server_messages.py`` (split by direction, as the parsers are), the CUDA IPC region
messages in ``ipc.py``.

Rules: sans-IO; stdlib only; never imports zmq, torch or numpy; imports nothing
outside ``proto``. Decoding and validation live in ``codec.py``.

Every message carries ``request_id`` (a uint64 the client chooses; the server
echoes it in the reply). The header key ``"type"`` names the message.

| client -> server | reply |
| --- | --- |
| ``Hello`` | ``Welcome`` |
| ``OpenStream`` | ``Opened`` |
| ``Decode`` (``Chunk`` each) | ``DecodeResult`` (``ChunkResult`` each, ``ErrorInfo`` on failure) |
| ``Finish`` / ``Abort`` | ``Finished`` / ``Aborted`` |
| ``Ping`` | ``Pong`` |
| ``Bye`` | none |
| ``RegisterRegion`` / ``UnregisterRegion`` | ``RegionRegistered`` / ``RegionUnregistered`` |

Any request can instead be answered ``Error`` (message-level).
"""

from __future__ import annotations

from typing import Union

from .client_messages import Abort, Bye, Chunk, Decode, Finish, Hello, OpenStream, Ping
from .ipc import RegionRegistered, RegionUnregistered, RegisterRegion, UnregisterRegion
from .limits import Limits
from .server_messages import (Aborted, ChunkResult, DecodeResult, Error, ErrorInfo, Finished, ModelInfo, Opened,
                              Pong, StreamOptionInfo, Welcome)

__all__ = [
    "PROTOCOL_VERSION",
    "STREAM_MODES",
    "DEFAULT_LEFT_CONTEXT_FRAMES",
    "Limits",
    "Hello",
    "OpenStream",
    "Chunk",
    "Decode",
    "Finish",
    "Abort",
    "Ping",
    "Bye",
    "ModelInfo",
    "StreamOptionInfo",
    "Welcome",
    "Opened",
    "ErrorInfo",
    "ChunkResult",
    "DecodeResult",
    "Finished",
    "Aborted",
    "Pong",
    "Error",
    "ClientMessage",
    "ServerMessage",
]

PROTOCOL_VERSION = 1
STREAM_MODES: tuple[str, ...] = ("exact", "window")
DEFAULT_LEFT_CONTEXT_FRAMES = 25
"""What clients send for ``window`` mode unless told otherwise (vLLM-Omni's default)."""


ClientMessage = Union[Hello, OpenStream, Decode, Finish, Abort, Ping, Bye, RegisterRegion, UnregisterRegion]
ServerMessage = Union[Welcome, Opened, DecodeResult, Finished, Aborted, Pong, Error, RegionRegistered,
                      RegionUnregistered]
