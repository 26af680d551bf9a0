"""The message types of wire protocol v1, both directions in one table: the protocol's constants, the
``ClientMessage`` / ``ServerMessage`` unions and ``CLIENT_MESSAGES`` / ``SERVER_MESSAGES``, the declared classes
``codec`` parses by their ``TYPE``. Each message is declared once (``declare.py``): in ``client_messages.py``,
``server_messages.py`` and ``server_welcome.py`` (split by direction), the CUDA IPC region messages in ``ipc.py``.

Rules: sans-IO; stdlib only; never imports zmq, torch or numpy; imports nothing
outside ``proto``. Framing and size limits live in ``codec.py``.

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
from .constants import DEFAULT_LEFT_CONTEXT_FRAMES, PROTOCOL_VERSION, STREAM_MODES
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
    "CLIENT_MESSAGES",
    "SERVER_MESSAGES",
]

ClientMessage = Union[Hello, OpenStream, Decode, Finish, Abort, Ping, Bye, RegisterRegion, UnregisterRegion]
ServerMessage = Union[Welcome, Opened, DecodeResult, Finished, Aborted, Pong, Error, RegionRegistered,
                      RegionUnregistered]
CLIENT_MESSAGES: tuple[type, ...] = ClientMessage.__args__  # type: ignore[attr-defined]
"""What a client sends, each with its ``TYPE`` (its wire ``type``) and ``WIRE`` (its declaration)."""
SERVER_MESSAGES: tuple[type, ...] = ServerMessage.__args__  # type: ignore[attr-defined]
"""What a server sends."""
