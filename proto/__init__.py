"""Wire protocol v1 of code2wav-sidecar (sans-IO).

Rules: no I/O; imports only the standard library and msgpack; never imports
zmq, torch or numpy; imports nothing else of this project. ``client`` and
``sidecar`` both import ``proto`` and meet only on the wire. The protocol is
documented in ``proto/README.md``.
"""

from __future__ import annotations

from .audio import audio_num_frames, audio_num_samples
from .codec import Buffer, decode_client_message, decode_server_message, encode, read_header
from .errors import ErrorCode, ProtocolError
from .ipc import (
    IPC_HANDLE_NBYTES,
    MAX_REGION_EVENTS,
    REGION_ACCESS,
    RegionRegistered,
    RegionUnregistered,
    RegisterRegion,
    UnregisterRegion,
)
from .limits import DEFAULT_LIMITS, Limits, MiB, exceeded_limit
from .messages import (
    DEFAULT_LEFT_CONTEXT_FRAMES,
    PROTOCOL_VERSION,
    STREAM_MODES,
    Abort,
    Aborted,
    Bye,
    Chunk,
    ChunkResult,
    ClientMessage,
    Decode,
    DecodeResult,
    Error,
    ErrorInfo,
    Finish,
    Finished,
    Hello,
    ModelInfo,
    StreamOptionInfo,
    Opened,
    OpenStream,
    Ping,
    Pong,
    ServerMessage,
    Welcome,
)
from .tensors import (
    INTEGER_DTYPES,
    WIRE_DTYPE_ITEMSIZES,
    CudaIpcLoc,
    InlineLoc,
    TensorDesc,
    TensorLoc,
    inline_view,
)

__all__ = [
    "PROTOCOL_VERSION",
    "audio_num_frames",
    "audio_num_samples",
    "STREAM_MODES",
    "DEFAULT_LEFT_CONTEXT_FRAMES",
    "DEFAULT_LIMITS",
    "MiB",
    "Limits",
    "exceeded_limit",
    "ErrorCode",
    "ProtocolError",
    "Buffer",
    "encode",
    "decode_client_message",
    "decode_server_message",
    "read_header",
    "WIRE_DTYPE_ITEMSIZES",
    "INTEGER_DTYPES",
    "InlineLoc",
    "CudaIpcLoc",
    "TensorLoc",
    "TensorDesc",
    "inline_view",
    "ClientMessage",
    "ServerMessage",
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
    "IPC_HANDLE_NBYTES",
    "MAX_REGION_EVENTS",
    "REGION_ACCESS",
    "RegisterRegion",
    "RegionRegistered",
    "UnregisterRegion",
    "RegionUnregistered",
]
