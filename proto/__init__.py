"""Wire protocol v1 of code2wav-sidecar (sans-IO).

Rules: no I/O; imports only the standard library and msgpack; never imports
zmq, torch or numpy; imports nothing else of this project. ``client`` and
``sidecar`` both import ``proto`` and meet only on the wire. The protocol is
documented in ``proto/README.md``; each message is declared once (``declare.py``), and its parser, encoder
and the README's field table come from that declaration.
"""

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
from .load import LOAD_VERSION, Load
from .messages import (
    CLIENT_MESSAGES,
    DEFAULT_LEFT_CONTEXT_FRAMES,
    SERVER_MESSAGES,
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
from .dtypes import FLOAT_DTYPES, INTEGER_DTYPES, WIRE_DTYPE_ITEMSIZES, WIRE_DTYPES, WireDtype
from .tensors import (
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
    "WireDtype",
    "WIRE_DTYPES",
    "WIRE_DTYPE_ITEMSIZES",
    "INTEGER_DTYPES",
    "FLOAT_DTYPES",
    "InlineLoc",
    "CudaIpcLoc",
    "TensorLoc",
    "TensorDesc",
    "inline_view",
    "ClientMessage",
    "ServerMessage",
    "CLIENT_MESSAGES",
    "SERVER_MESSAGES",
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
    "Load",
    "LOAD_VERSION",
    "Error",
    "IPC_HANDLE_NBYTES",
    "MAX_REGION_EVENTS",
    "REGION_ACCESS",
    "RegisterRegion",
    "RegionRegistered",
    "UnregisterRegion",
    "RegionUnregistered",
]
