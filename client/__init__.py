"""Python client of code2wav-sidecar: what a generation runner imports.

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``
(the two meet only on the wire, see ``proto/README.md``).

    from code2wav.client import SidecarClient
    with SidecarClient("ipc:///run/code2wav/sidecar.sock", timeout_s=30) as c:
        s = c.open_stream("req-1", mode="window", left_context_frames=25)
        wav = s.decode(codes)            # float32 [(n - context_frames) * U]; CUDA codes: CUDA audio (CUDA IPC)
        wav = await asyncio.wrap_future(s.submit(codes))   # from asyncio

    from code2wav.client import SidecarPool   # several sidecars: a list, or a DNS name (a headless Service)
    with SidecarPool("dns://code2wav-sidecar.tts.svc.cluster.local:5555") as pool:
        s = pool.open_stream("req-1")    # on the least loaded sidecar (its own GPU's first); a PooledStream:
        wav = s.decode(codes)            # it moves to another sidecar (history replay) if its own dies or drains
"""

from .client import DEFAULT_ADDRESS, BatchItem, SidecarClient
from .discovery import Resolver
from .pool import SidecarPool
from .pool_stream import PooledStream
from .errors import (
    AlreadyExists,
    Busy,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    LimitExceeded,
    NotFound,
    OutOfOrder,
    SidecarError,
    StreamLost,
    Unavailable,
    VersionMismatch,
    error_from,
)
from .stream import Stream
from .wire_tensors import CodesLike, InlineTransport, TensorTransport

__all__ = [
    "SidecarClient",
    "SidecarPool",
    "Resolver",
    "Stream",
    "PooledStream",
    "DEFAULT_ADDRESS",
    "BatchItem",
    "CodesLike",
    "TensorTransport",
    "InlineTransport",
    "SidecarError",
    "InvalidArgument",
    "LimitExceeded",
    "NotFound",
    "AlreadyExists",
    "OutOfOrder",
    "Busy",
    "DeadlineExceeded",
    "Unavailable",
    "Internal",
    "VersionMismatch",
    "StreamLost",
    "error_from",
]
