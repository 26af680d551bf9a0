"""``SidecarClient``: connect to a code2wav sidecar, open streams, decode chunks.

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``.

One API for threads and asyncio: every operation has a ``submit...`` form that
returns a ``concurrent.futures.Future`` (asyncio: ``await
asyncio.wrap_future(fut)``) and a blocking form that is ``submit(...).result()``.
A background I/O thread owns the socket (see ``_io.py``).

    with SidecarClient("ipc:///run/code2wav/sidecar.sock", timeout_s=30) as c:
        s = c.open_stream("req-1", mode="window", left_context_frames=25)
        wav = s.decode(codes)                      # float32 [(n - context) * U], on the codes' device
        wav = s.decode(last, final=True)           # frees the stream after replying
        outs = c.decode_batch([(s1, codes1), (s2, codes2, {"final": True})])
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
import time
import uuid
import weakref
from concurrent.futures import Future
from typing import Any, Sequence, Union

import zmq.auth

from code2wav.proto import (
    DEFAULT_LEFT_CONTEXT_FRAMES,
    STREAM_MODES,
    Limits,
    Load,
    ModelInfo,
    Opened,
    OpenStream,
    Ping,
    Pong,
    ServerMessage,
    Welcome,
    encode,
)

from code2wav.proto.address import address_problem, default_address
from code2wav.proto.socket_dir import default_socket_problem

from ._io import Connection
from .call_trace import CallTrace
from .cuda_ipc.link import IpcLink
from .errors import AlreadyExists, DeadlineExceeded, Internal, InvalidArgument, Unavailable, not_running
from .keys import server_public_key
from .sender import WAIT_GRACE_S, Sender, set_exception, set_result
from .stream import Stream
from .wire_tensors import CodesLike, InlineTransport, host_id

__all__ = ["SidecarClient", "DEFAULT_ADDRESS", "BatchItem"]

DEFAULT_ADDRESS = default_address(os.environ, os.getuid())
"""Where ``serve`` binds by default (``code2wav.proto.address``); ``SidecarClient()`` re-reads the environment."""

BatchItem = Union[tuple[Stream, CodesLike], tuple[Stream, CodesLike, dict[str, Any]]]


class SidecarClient:
    """A connection to one sidecar. Thread-safe; use as a context manager or call ``close()``."""

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        client_id: str | None = None,
        curve_server_key: bytes | str | None = None,
        curve_client_key_file: str | None = None,
        cuda_ipc: bool = True,
        ipc_armed: bool = False,
        ipc_codes_nbytes: int = 4 << 20,
        ipc_audio_nbytes: int = 64 << 20,
        streams_lost_when_dead: bool = False,
        trace: CallTrace | None = None,
    ) -> None:
        """``address``: default ``code2wav.proto.address.default_address`` (the address ``serve`` binds by default).

        ``curve_server_key``: the sidecar's CurveZMQ public key when it listens on a non-loopback TCP address with
        CurveZMQ (a certificate file path or the 40-character Z85 key: ``client.keys``); the client then
        encrypts with a fresh keypair of its own. With a client allow-list on the sidecar, ``curve_client_key_file`` (a ``.key_secret``
        file) is the keypair the client presents instead of a fresh one.

        ``cuda_ipc``: send CUDA codes by CUDA IPC when the sidecar shares this host and GPU. Two device regions
        are allocated on the codes' GPU on first use (``ipc_codes_nbytes`` for codes in flight,
        ``ipc_audio_nbytes`` for audio views alive at once; 64 MiB holds about 350 s of 24 kHz audio).
        ``ipc_armed``: where the sidecar offers doorbells, arm each message of exact streams (proto/README.md,
        section 3): the sidecar queues its step behind a GPU wait for the codes, so the decode starts when they land
        on the GPU; arm only codes already queued on the caller's stream (the sidecar releases a wait after its
        ``armed_wait_s``, 0.25 s by default, and the chunk fails with ``DeadlineExceeded``). False (the default
        until the hand-off has run on a GPU, docs/design-notes.md): codes events, which the sidecar polls.

        ``streams_lost_when_dead``: a sidecar that stops answering heartbeats loses this client's streams at once
        (they fail with ``StreamLost``), as a ``SidecarPool`` wants of its members; by default they wait for it
        to answer again (its streams survive a reconnect to the same server).

        ``trace``: a ``call_trace.CallTrace`` that records when each decode call was sent and its reply received
        (``code2wav-sidecar bench --stages``); None (the default): nothing is recorded.

        Refused at once, before any wait: an address of another form than ``ipc://PATH`` or ``tcp://HOST:PORT``
        (``InvalidArgument``, saying which forms), the default address when a folder of its path is not this
        user's alone (``InvalidArgument`` naming the folder and the fix, ``proto.socket_dir``), an ``ipc://``
        socket file that does not exist (``SidecarNotRunning``: no sidecar listens there); otherwise a handshake
        not answered within ``connect_timeout_s`` is ``SidecarNotRunning``."""
        self.address = address or default_address(os.environ, os.getuid())
        problem = address_problem(self.address) or default_socket_problem(self.address, os.environ, os.getuid(),
                                                                          os.stat)
        if problem is not None:
            raise InvalidArgument(problem)
        if self.address.startswith("ipc://") and not os.path.exists(self.address[len("ipc://"):]):
            raise not_running(self.address, connect_timeout_s, socket_exists=False)
        self.timeout_s = float(timeout_s)
        self.client_id = client_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        capabilities = {"cuda_ipc": bool(cuda_ipc), "gpu_uuid": None, "host_id": host_id()}
        routing_id = b"c2w-" + uuid.uuid4().bytes
        curve_key = None if curve_server_key is None else server_public_key(curve_server_key)
        client_keys = zmq.auth.load_certificate(curve_client_key_file) if curve_client_key_file else None
        self._conn = Connection(self.address, self.client_id, routing_id, capabilities, curve_key, client_keys,
                                streams_lost_when_dead)
        self._ipc = IpcLink(self._conn, bool(cuda_ipc), capabilities["host_id"], ipc_codes_nbytes, ipc_audio_nbytes,
                            bool(ipc_armed))
        self._sender = Sender(self._conn, self._ipc, InlineTransport(), address, self.timeout_s, lambda: self.limits,
                              trace)
        # this client's Stream objects by id (the I/O thread's): the server answers a repeated open of a stream
        # that has taken no chunk yet, so a second live Stream for one id is refused here (two seq counters on
        # one server stream would take each other's chunks for resends)
        self._streams_by_id: weakref.WeakValueDictionary[str, Stream] = weakref.WeakValueDictionary()
        try:
            self._handshake(connect_timeout_s)
        except BaseException:
            self._conn.close()
            raise

    def _handshake(self, connect_timeout_s: float) -> None:
        future: Future[Welcome] = Future()
        call = self._conn.hello_call(
            connect_timeout_s,
            lambda welcome: set_result(future, welcome),
            lambda error, _outcome: set_exception(future, error),
        )
        self._conn.submit(call)
        try:
            future.result(connect_timeout_s + WAIT_GRACE_S)
        except (DeadlineExceeded, Unavailable, concurrent.futures.TimeoutError) as exc:
            ipc = self.address.startswith("ipc://")
            exists = os.path.exists(self.address[len("ipc://"):]) if ipc else None
            raise not_running(self.address, connect_timeout_s, exists) from exc

    # ------------------------------------------------------------------ info

    @property
    def server_info(self) -> Welcome:
        """The latest ``welcome`` (refreshed after a server restart)."""
        welcome = self._conn.welcome
        assert welcome is not None  # the constructor's handshake succeeded
        return welcome

    @property
    def models(self) -> tuple[ModelInfo, ...]:
        return self.server_info.models

    @property
    def limits(self) -> Limits:
        return self.server_info.limits

    @property
    def boot_epoch(self) -> str:
        return self.server_info.boot_epoch

    @property
    def load(self) -> Load | None:
        """The sidecar's load as its latest ``pong`` or ``welcome`` reported it (None: it does not report one)."""
        return self._conn.load

    @property
    def answering(self) -> bool:
        """False while the sidecar does not answer heartbeats (or speaks another protocol version)."""
        return not self._conn.dead

    # ------------------------------------------------------------------ lifecycle

    @property
    def ipc_stats(self) -> dict[str, int]:
        """Chunks sent by CUDA IPC (``ipc_chunks``) and inline fallbacks by reason (``inline_fallback:*``)."""
        return dict(self._ipc.stats)

    def close(self) -> None:
        """Unregister CUDA IPC regions, say ``bye`` (the server frees this client's streams), stop the I/O
        thread, close the socket. CUDA audio views still alive keep their memory (see ``Stream.submit``)."""
        self._ipc.close()
        self._conn.close()

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ streams

    def _is_live(self, stream_id: str) -> bool:
        """A Stream of ``stream_id`` is alive in this client and neither closed nor lost."""
        live = self._streams_by_id.get(stream_id)
        return live is not None and not live.closed and not live.lost

    def submit_open_stream(
        self,
        stream_id: str,
        *,
        mode: str = "exact",
        left_context_frames: int = DEFAULT_LEFT_CONTEXT_FRAMES,
        model: str | None = None,
        timeout_s: float | None = None,
        options: dict[str, int] | None = None,
        start_frame: int = 0,
        early_audio: bool = False,
    ) -> Future[Stream]:
        """Open a stream. ``left_context_frames`` applies to ``window`` mode only; ``options``: the model's
        ``stream_options`` (welcome), checked by the server; ``start_frame`` (``exact``): the index of the stream's
        first frame in its utterance (a pool's failover replay resumes there; proto/README.md, section 11).

        ``early_audio`` (proto/README.md section 5): the sidecar answers a chunk whose audio comes back by CUDA IPC
        as soon as its step is launched, not once its outcome is read (one stream: about the reply's trip less per
        chunk). The audio is then ready on your stream as always, but in the rare case the step refuses the chunk
        afterwards (inputs the GPU check refused, non-finite audio, an armed chunk whose codes never came) it holds
        zeros and you learn it from the stream's next call: ``decode``/``finish`` raise the chunk's error with
        ``error.failed_seq`` set to its seq, and the stream goes on from that seq (send it again)."""
        if mode not in STREAM_MODES:
            raise InvalidArgument(f"mode must be one of {', '.join(STREAM_MODES)}; got {mode!r}")
        limits = self.limits
        if not 0 <= left_context_frames <= limits.max_left_context_frames:
            raise InvalidArgument(
                f"left_context_frames must be in [0, {limits.max_left_context_frames}], got {left_context_frames}"
            )
        if not stream_id or len(stream_id.encode()) > limits.max_id_len:
            raise InvalidArgument(f"stream_id must be 1..{limits.max_id_len} UTF-8 bytes, got {stream_id!r}")
        request_id = self._conn.next_request_id()
        context = left_context_frames if mode == "window" else 0
        if start_frame < 0:
            raise InvalidArgument(f"start_frame must be >= 0, got {start_frame}")
        if early_audio and self.server_info.capabilities.get("early_audio") is not True:
            raise InvalidArgument("this sidecar does not offer early audio (welcome.capabilities.early_audio); "
                                  "open the stream without early_audio")
        frames = encode(OpenStream(request_id, stream_id, model, mode, context, dict(options or {}),
                                   start_frame if mode == "exact" else 0, early_audio))
        future: Future[Stream] = Future()

        def on_reply(msg: ServerMessage, _frames: list[memoryview]) -> Stream:
            if not isinstance(msg, Opened) or msg.stream_id != stream_id:
                raise Internal(f"expected opened for {stream_id!r}, got {msg!r}")
            if self._is_live(stream_id):  # (no reference to that Stream in this frame: the error's traceback
                # would keep it alive for as long as the caller keeps the error)
                raise AlreadyExists(f"stream {stream_id!r} is already open in this client (finish, abort or drop "
                                    "that Stream first)")
            info = self.server_info.model(msg.model)
            if info is None:
                stream = Stream(self._sender, msg, self._conn.generation, early_audio=early_audio)
            else:
                stream = Stream(self._sender, msg, self._conn.generation, info.input_kind, info.input_dtypes,
                                early_audio)
            self._streams_by_id[stream_id] = stream
            return stream

        self._sender.call(frames, request_id, timeout_s, on_reply, future)
        return future

    def open_stream(
        self,
        stream_id: str,
        *,
        mode: str = "exact",
        left_context_frames: int = DEFAULT_LEFT_CONTEXT_FRAMES,
        model: str | None = None,
        timeout_s: float | None = None,
        options: dict[str, int] | None = None,
        early_audio: bool = False,
    ) -> Stream:
        future = self.submit_open_stream(
            stream_id, mode=mode, left_context_frames=left_context_frames, model=model, timeout_s=timeout_s,
            options=options, early_audio=early_audio,
        )
        return self._sender.wait(future, timeout_s)

    def ping(self, *, timeout_s: float | None = None) -> float:
        """Round trip to the server; returns seconds."""
        return self._sender.wait(self.submit_ping(timeout_s=timeout_s), timeout_s)

    def submit_ping(self, *, timeout_s: float | None = None) -> Future[float]:
        """Non-blocking ``ping``: the future gives the round trip in seconds; ``load`` is the pong's by then."""
        request_id = self._conn.next_request_id()
        future: Future[float] = Future()
        start = time.perf_counter()

        def on_reply(msg: ServerMessage, _frames: list[memoryview]) -> float:
            if not isinstance(msg, Pong):
                raise Internal(f"expected pong, got {msg.TYPE}")
            return time.perf_counter() - start

        self._sender.call(encode(Ping(request_id)), request_id, timeout_s, on_reply, future)
        return future

    # ------------------------------------------------------------------ decode

    def submit_batch(
        self, items: Sequence[BatchItem], *, return_exceptions: bool = False, timeout_s: float | None = None
    ) -> Future[list[Any]]:
        """Send chunks of many streams in ONE ``decode`` message; the future gives audio tensors in order.

        Each item is ``(stream, codes)`` or ``(stream, codes, {"final": bool, "context_frames": int})``.
        If a chunk fails, the future raises the first error once all results are in (the other
        chunks' streams advance normally); with ``return_exceptions=True`` it gives a list where
        failed entries are ``SidecarError`` instances.
        """
        entries: list[tuple[Stream, CodesLike, bool, int]] = []
        for item in items:
            options: dict[str, Any] = item[2] if len(item) == 3 else {}  # type: ignore[misc]
            unknown = set(options) - {"final", "context_frames"}
            if unknown:
                raise InvalidArgument(f"unknown chunk options {sorted(unknown)} (allowed: final, context_frames)")
            entries.append((item[0], item[1], bool(options.get("final", False)), int(options.get("context_frames", 0))))
        return self._sender.submit_new(entries, timeout_s, "list_with_exceptions" if return_exceptions else "list")

    def decode_batch(
        self, items: Sequence[BatchItem], *, return_exceptions: bool = False, timeout_s: float | None = None
    ) -> list[Any]:
        return self._sender.wait(self.submit_batch(items, return_exceptions=return_exceptions, timeout_s=timeout_s),
                                 timeout_s)
