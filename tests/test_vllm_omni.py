"""The vLLM-Omni delegate stage (client/vllm_omni) driven the way vLLM-Omni 0.30's two runners drive a Code2Wav
stage model, against a real sidecar on CPU (tiny golden model), checked against decoding the same frames directly.

These tests need no vLLM: the runner calls are reproduced from vLLM-Omni 0.30's source (the v1
``GPUGenerationModelRunner`` and the default v2 ``OmniGenerationModelRunner``). When vLLM-Omni is not importable,
the model's ``OmniOutput`` is replaced by a minimal local NamedTuple of the same fields (``LocalOmniOutput``)
-- in these tests only; with vLLM-Omni installed the real one is used. ``test_vllm_omni_real.py`` runs the
parts that need the real packages (entry points, OmniModelRegistry, the deploy loader, the parity oracle).
"""

from __future__ import annotations

import os

import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest
import torch

from code2wav.client.vllm_omni import model as model_module
from code2wav.client.vllm_omni import delegate as delegate_module
from code2wav.client.vllm_omni.delegate import SidecarUnavailableError
from code2wav.client.vllm_omni.model import Qwen3TTSCode2WavSidecar
from code2wav.proto.address import default_address
from code2wav.client.vllm_omni.settings import DelegateSettings, connector_extra
from code2wav.client.vllm_omni.step import DUMMY_REQUEST_PREFIX, parse_step
from conftest import TINY
from code2wav.loadgen.server_metrics import metric_value

Q, U = 4, 48  # the tiny golden model: 4 quantizers, codebook 64, 48 samples per frame
HAVE_VLLM_OMNI = importlib.util.find_spec("vllm_omni") is not None


class LocalOmniOutput(NamedTuple):
    """Stand-in for vllm_omni's OmniOutput (same fields), used ONLY when vLLM-Omni is not installed."""

    text_hidden_states: Any
    multimodal_outputs: Any = None
    intermediate_tensors: Any = None
    next_token_id: Any = None


@pytest.fixture(autouse=True)
def _omni_output(monkeypatch):
    if not HAVE_VLLM_OMNI:
        monkeypatch.setattr(model_module, "omni_output_type", lambda: LocalOmniOutput)
    yield


def sched_id(ext: str) -> str:
    """vLLM's internal request id for an external one (``f"{external}-{random_uuid():.8}"``)."""
    return f"{ext}-{abs(hash(ext)) % 16**8:08x}"


def make_checkpoint(tmp_path: Path) -> Path:
    """A model folder as vLLM sees it: ``<model>/speech_tokenizer/`` (the tiny golden decoder)."""
    root = tmp_path / "ckpt"
    root.mkdir(exist_ok=True)
    link = root / "speech_tokenizer"
    if not link.exists():
        link.symlink_to(TINY, target_is_directory=True)
    return root


def make_model(tmp_path: Path, address: str, **extra: Any) -> Qwen3TTSCode2WavSidecar:
    """Build the stage model as vLLM-Omni does: ``model_class(vllm_config=...)`` with the connector extra."""
    connector = {"name": "SharedMemoryConnector",
                 "extra": {"codec_chunk_frames": 5, "initial_codec_chunk_frames": 1, "sidecar_address": address,
                           "sidecar_connect_timeout_s": 5, **extra, "stage_id": 1}}
    model_config = SimpleNamespace(model=str(make_checkpoint(tmp_path)), stage_connector_config=connector,
                                   async_chunk=True)
    return Qwen3TTSCode2WavSidecar(vllm_config=SimpleNamespace(model_config=model_config))


def payload(ext: str | None, codes: torch.Tensor, *, left_context: int = 0, finished: bool = False,
            ref: int = 0) -> dict[str, Any]:
    """What vLLM-Omni 0.30's ``talker2code2wav_async_chunk`` emits for one chunk (codebook-major ``[Q*F]``)."""
    meta: dict[str, Any] = {"left_context_size": left_context, "finished": torch.tensor(finished)}
    if ext is not None:
        meta["request_id"] = ext
    if ref:
        meta.update(ref_context_size=ref, ref_context_request_id=ext, ref_context_included=True)
    return {"codes": {"audio": codes.reshape(-1).clone()}, "meta": meta}


def wavs_of(output: Any) -> list[torch.Tensor]:
    mm = output.multimodal_outputs
    assert set(mm) == {"model_outputs", "sr"}
    assert len(mm["sr"]) == len(mm["model_outputs"])
    for wav, sr in zip(mm["model_outputs"], mm["sr"]):
        assert wav.dtype == torch.float32 and wav.dim() == 1
        assert int(sr) == 24000
    return list(mm["model_outputs"])


class _Runner:
    """What both runners share: ``on_requests_finished`` before the forward, nothing to do for an empty step."""

    name = ""

    def __init__(self, model: Qwen3TTSCode2WavSidecar) -> None:
        self.model = model

    def step(self, batch: list[tuple[str, dict[str, Any]]], finished: set[str] = frozenset(),
             native: bool = True) -> list[torch.Tensor]:
        if finished:
            self.model.on_requests_finished(set(finished))
        if not batch:
            return []
        return self._forward(batch, native)

    def _forward(self, batch: list[tuple[str, dict[str, Any]]], native: bool) -> list[torch.Tensor]:
        raise NotImplementedError


class V1Runner(_Runner):
    """vLLM-Omni 0.30 ``GPUGenerationModelRunner``: ``on_requests_finished`` before the forward; token ids carry
    the codes; ``request_ids`` = scheduler ids (the model sets ``requires_request_ids``); dummy runs use
    ``get_dummy_runtime_additional_information`` and one synthetic segment."""

    name = "v1"

    def _forward(self, batch: list[tuple[str, dict[str, Any]]], native: bool) -> list[torch.Tensor]:
        flats = [p["codes"]["audio"] for _, p in batch]
        infos = [p if native else {"meta": p["meta"]} for _, p in batch]
        ids = torch.cat(flats) if flats else torch.zeros(0, dtype=torch.long)
        out = self.model(input_ids=ids, positions=torch.arange(ids.numel()), intermediate_tensors=None,
                         inputs_embeds=None, runtime_additional_information=infos,
                         seq_token_counts=[int(f.numel()) for f in flats], request_ids=[s for s, _ in batch],
                         sampling_metadata=None, logits_index=None, sampler=None)
        return wavs_of(out)

    def dummy_run(self, num_reqs: int, num_tokens: int) -> list[torch.Tensor]:
        infos = self.model.get_dummy_runtime_additional_information(num_reqs)
        out = self.model(input_ids=torch.zeros(num_tokens, dtype=torch.long), positions=torch.arange(num_tokens),
                         intermediate_tensors=None, inputs_embeds=None, runtime_additional_information=infos,
                         seq_token_counts=[num_tokens])
        return wavs_of(out)


class V2Runner(_Runner):
    """vLLM-Omni 0.30 ``OmniGenerationModelRunner`` (model runner v2, the Qwen3-TTS default):
    ``finish_requests`` calls ``on_requests_finished`` with scheduler ids; the forward gets placeholder token ids
    (padded), the payloads as both ``model_intermediate_buffer`` and ``runtime_additional_information``,
    ``seq_token_counts`` and no ``request_ids``; dummy runs pass empty dicts."""

    name = "v2"

    def _forward(self, batch: list[tuple[str, dict[str, Any]]], native: bool) -> list[torch.Tensor]:
        counts = [max(1, int(p["codes"]["audio"].numel())) for _, p in batch]
        padded = -(-sum(counts) // 8) * 8
        buffers = [p for _, p in batch]
        out = self.model(input_ids=torch.zeros(padded, dtype=torch.long), positions=torch.arange(padded),
                         intermediate_tensors=None, inputs_embeds=None, model_intermediate_buffer=buffers,
                         runtime_additional_information=buffers, seq_token_counts=counts)
        return wavs_of(out)

    def dummy_run(self, num_reqs: int, num_tokens: int) -> list[torch.Tensor]:
        per, rest = divmod(num_tokens, num_reqs)
        counts = [per] * num_reqs
        counts[-1] += rest
        buffers: list[dict[str, Any]] = [{} for _ in range(num_reqs)]
        out = self.model(input_ids=torch.zeros(num_tokens, dtype=torch.long), positions=torch.arange(num_tokens),
                         intermediate_tensors=None, inputs_embeds=None, model_intermediate_buffer=buffers,
                         runtime_additional_information=buffers, seq_token_counts=counts)
        return wavs_of(out)


RUNNERS = [V1Runner, V2Runner]


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``code2wav_sidecar_<name>`` whose labels include ``labels``."""
    return metric_value(text, f"code2wav_sidecar_{name}", **labels)


def count_batches(model: Qwen3TTSCode2WavSidecar, monkeypatch) -> list[int]:
    """Record the number of chunks of every ``submit_batch`` (= one decode round trip) the delegate makes."""
    calls: list[int] = []
    client = model.delegate.client
    original = client.submit_batch

    def spy(items, **kwargs):
        calls.append(len(items))
        return original(items, **kwargs)

    monkeypatch.setattr(client, "submit_batch", spy)
    return calls


# --------------------------------------------------------------------- expected audio, decoded directly


def one_shot(tiny_model, codes: torch.Tensor) -> torch.Tensor:
    """One forward over all frames ``[Q, T]`` -> ``[T * U]``."""
    with torch.no_grad():
        return tiny_model.module(codes[None])[0, 0]


def window_decode(tiny_model, codes: torch.Tensor, bounds: list[int], left: int, skip: int) -> torch.Tensor:
    """vLLM-Omni's stateless window decode of ``codes [Q, T]`` in chunks ``[bounds[k], bounds[k+1])``: each chunk
    decodes ``codes[s-c:e]``, ``c = min(left, s)``, and drops ``c*U`` samples; then the first ``skip`` frames'
    audio (reference context) is dropped."""
    parts = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        c = min(left, s)
        parts.append(one_shot(tiny_model, codes[:, s - c:e])[c * U:])
    return torch.cat(parts)[skip * U:]


# --------------------------------------------------------------------- scenarios


def schedule(codes: torch.Tensor, sizes: list[int]) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    assert start == codes.shape[1]
    return bounds


def streaming_scenario(seed: int = 0):
    """Three requests as the connector sends them: A with 5 reference frames as left context on its first chunk
    and an empty final chunk, B ending on a chunk with codes, C joining later with an empty final chunk."""
    g = torch.Generator().manual_seed(seed)
    reqs = {
        "req-A": dict(ref=5, codes=torch.randint(0, 64, (Q, 5 + 16), generator=g), sizes=[5 + 1, 5, 5, 5],
                      start=0, empty_final=True),
        "req-B": dict(ref=0, codes=torch.randint(0, 64, (Q, 14), generator=g), sizes=[1, 5, 5, 3],
                      start=0, empty_final=False),
        "req-C": dict(ref=0, codes=torch.randint(0, 64, (Q, 11), generator=g), sizes=[1, 5, 5],
                      start=2, empty_final=True),
    }
    steps: dict[int, list[tuple[str, dict[str, Any]]]] = {}
    for ext, r in reqs.items():
        chunks = schedule(r["codes"], r["sizes"])
        r["bounds"] = [0] + [e for _, e in chunks]
        for k, (s, e) in enumerate(chunks):
            last = k == len(chunks) - 1
            p = payload(ext, r["codes"][:, s:e], left_context=r["ref"] if k == 0 else 0,
                        finished=last and not r["empty_final"], ref=r["ref"] if k == 0 else 0)
            steps.setdefault(r["start"] + k, []).append((ext, p))
        if r["empty_final"]:
            steps.setdefault(r["start"] + len(chunks), []).append(
                (ext, payload(ext, torch.zeros((Q, 0), dtype=torch.long), finished=True)))
    return reqs, [steps[k] for k in sorted(steps)]


def run_streaming(runner, steps, native: bool = True) -> tuple[dict[str, list[torch.Tensor]], list[int]]:
    audio: dict[str, list[torch.Tensor]] = {}
    for batch in steps:
        wavs = runner.step([(sched_id(ext), p) for ext, p in batch], native=native)
        assert len(wavs) == len(batch)
        for (ext, p), wav in zip(batch, wavs):
            new_frames = p["codes"]["audio"].numel() // Q - int(p["meta"]["left_context_size"])
            assert wav.numel() == new_frames * U, (ext, wav.numel(), new_frames)
            audio.setdefault(ext, []).append(wav)
    return audio, [len(b) for b in steps]


@pytest.mark.parametrize("runner_cls", RUNNERS, ids=lambda r: r.name)
def test_streaming_exact_equals_one_decode(tmp_path, sidecar, tiny_model, runner_cls, monkeypatch):
    model = make_model(tmp_path, sidecar.address, sidecar_mode="exact")
    batches = count_batches(model, monkeypatch)
    reqs, steps = streaming_scenario()
    audio, sizes = run_streaming(runner_cls(model), steps, native=True)
    assert batches == sizes  # ONE decode message per runner step, carrying every request of the step
    for ext, r in reqs.items():
        got = torch.cat(audio[ext])
        expected = one_shot(tiny_model, r["codes"])[r["ref"] * U:]  # reference frames: context, no audio
        assert got.shape == expected.shape
        assert torch.allclose(got, expected, atol=1e-4, rtol=0), (ext, (got - expected).abs().max())
    assert model.delegate.open_requests == []
    text = sidecar.scrape()
    assert metric(text, "active_streams") == 0
    assert metric(text, "streams_opened_total") == 3
    model.delegate.close()


def test_v1_codes_in_token_ids_only(tmp_path, sidecar, tiny_model):
    """Under v1 the codes may come only as token ids (no native payload): same audio."""
    model = make_model(tmp_path, sidecar.address)
    reqs, steps = streaming_scenario(seed=1)
    audio, _ = run_streaming(V1Runner(model), steps, native=False)
    for ext, r in reqs.items():
        expected = one_shot(tiny_model, r["codes"])[r["ref"] * U:]
        assert torch.allclose(torch.cat(audio[ext]), expected, atol=1e-4, rtol=0)
    model.delegate.close()


@pytest.mark.parametrize("runner_cls", RUNNERS, ids=lambda r: r.name)
def test_streaming_window_equals_window_decode(tmp_path, sidecar, tiny_model, runner_cls):
    model = make_model(tmp_path, sidecar.address, sidecar_mode="window", sidecar_left_context_frames=5)
    reqs, steps = streaming_scenario(seed=2)
    audio, _ = run_streaming(runner_cls(model), steps)
    for ext, r in reqs.items():
        got = torch.cat(audio[ext])
        expected = window_decode(tiny_model, r["codes"], r["bounds"], left=5, skip=r["ref"])
        assert torch.allclose(got, expected, atol=1e-5, rtol=0), (ext, (got - expected).abs().max())
        exact = one_shot(tiny_model, r["codes"])[r["ref"] * U:]
        if ext != "req-C":  # window mode really is the stateless decode (differs from one forward)
            assert not torch.allclose(got, exact, atol=1e-4, rtol=0)
    model.delegate.close()


def test_full_payload_window_matches_golden_chunked(tmp_path, sidecar, golden_cases):
    """A whole utterance in one payload (vLLM-Omni's non-async deploy, v2: meta has no request_id): window mode
    splits it like upstream ``chunked_decode(chunk_size=12, left_context_size=5)`` -- the golden ``chunked``."""
    model = make_model(tmp_path, sidecar.address, sidecar_mode="window", decode_chunk_frames=12,
                       decode_left_context_frames=5)
    codes = golden_cases["codes"]  # [2, Q, 40]
    runner = V2Runner(model)
    wavs = runner.step([(sched_id(f"full-{b}"), payload(None, codes[b], finished=True)) for b in range(2)])
    got, want = torch.stack(wavs), golden_cases["chunked"][:, 0]
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    assert model.delegate.open_requests == []
    model.delegate.close()


@pytest.mark.parametrize("runner_cls", RUNNERS, ids=lambda r: r.name)
def test_full_payload_with_reference_exact(tmp_path, sidecar, tiny_model, golden_cases, runner_cls):
    """Non-async deploy: one finished payload with the reference codes in front (``left_context_size``)."""
    model = make_model(tmp_path, sidecar.address)
    codes = golden_cases["codes"][0]
    wav, = runner_cls(model).step([(sched_id("one"), payload("one", codes, left_context=7, finished=True))])
    assert torch.allclose(wav, one_shot(tiny_model, codes)[7 * U:], atol=1e-4, rtol=0)
    assert model.delegate.open_requests == []
    model.delegate.close()


@pytest.mark.parametrize("runner_cls", RUNNERS, ids=lambda r: r.name)
def test_abort_via_on_requests_finished(tmp_path, sidecar, tiny_model, runner_cls):
    """An aborted request (scheduler id only, as both runners pass it) frees its sidecar stream at once; the
    other request is unaffected; late chunks of the aborted one get empty audio and open nothing."""
    model = make_model(tmp_path, sidecar.address)
    runner = runner_cls(model)
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, 64, (Q, 11), generator=g), torch.randint(0, 64, (Q, 11), generator=g)
    runner.step([(sched_id("ab-1"), payload("ab-1", a[:, :1])), (sched_id("ab-2"), payload("ab-2", b[:, :1]))])
    runner.step([(sched_id("ab-1"), payload("ab-1", a[:, 1:6])), (sched_id("ab-2"), payload("ab-2", b[:, 1:6]))])
    assert metric(sidecar.scrape(), "active_streams") == 2
    wavs = runner.step([(sched_id("ab-2"), payload("ab-2", b[:, 6:11], finished=True))], finished={sched_id("ab-1")})
    text = sidecar.scrape()
    assert metric(text, "streams_closed_total", reason="abort") == 1
    assert metric(text, "active_streams") == 0
    assert model.delegate.stats["aborted"] == 1
    assert torch.allclose(wavs[0], one_shot(tiny_model, b)[6 * U:], atol=1e-4, rtol=0)
    late = runner.step([(sched_id("ab-1"), payload("ab-1", a[:, 6:11], finished=True))])
    assert late[0].numel() == 0
    assert metric(sidecar.scrape(), "streams_opened_total") == 2
    # a normal finish notification after the final chunk costs nothing
    trips = model.delegate.stats["round_trips"]
    runner.step([], finished={sched_id("ab-2")})
    assert model.delegate.stats["round_trips"] == trips
    assert model.delegate.open_requests == []
    model.delegate.close()


def test_abort_by_meta_request_id(tmp_path, sidecar):
    """``on_requests_finished`` with the external id itself (no suffix) frees the stream too."""
    model = make_model(tmp_path, sidecar.address)
    V2Runner(model).step([(sched_id("m-1"), payload("m-1", torch.ones((Q, 3), dtype=torch.long)))])
    model.on_requests_finished({"m-1"})
    assert metric(sidecar.scrape(), "streams_closed_total", reason="abort") == 1
    model.delegate.close()


@pytest.mark.parametrize("runner_cls", RUNNERS, ids=lambda r: r.name)
def test_dummy_runs_stay_local(tmp_path, sidecar, runner_cls, monkeypatch):
    model = make_model(tmp_path, sidecar.address)
    batches = count_batches(model, monkeypatch)
    runner = runner_cls(model)
    for num_reqs, num_tokens in [(1, 16), (4, 64), (3, 48)]:
        wavs = runner.dummy_run(num_reqs, num_tokens)
        assert sum(w.numel() for w in wavs) == num_tokens // Q * U
        assert all(torch.count_nonzero(w) == 0 for w in wavs)
    assert batches == [] and model.delegate.stats["round_trips"] == 0
    text = sidecar.scrape()
    assert metric(text, "streams_opened_total") == 0 and metric(text, "chunks_total") == 0
    model.delegate.close()


def test_no_call_out_during_cuda_graph_capture(tmp_path, sidecar, monkeypatch):
    """While a CUDA stream capture is active (simulated: no GPU in CI) the stage answers locally and sends
    nothing, neither decode nor abort; ``cuda_stream_capturing`` itself is torch's query."""
    model = make_model(tmp_path, sidecar.address)
    monkeypatch.setattr(delegate_module, "cuda_stream_capturing", lambda: True)
    monkeypatch.setattr(model_module, "cuda_stream_capturing", lambda: True)
    wavs = V2Runner(model).step([(sched_id("cap"), payload("cap", torch.ones((Q, 4), dtype=torch.long)))],
                                finished={sched_id("other")})
    assert wavs[0].numel() == 4 * U and torch.count_nonzero(wavs[0]) == 0
    assert model.delegate.stats["round_trips"] == 0
    assert metric(sidecar.scrape(), "streams_opened_total") == 0
    model.delegate.close()


@pytest.mark.cuda
def test_real_cuda_graph_capture_stays_local(tmp_path, sidecar, tiny_model):
    """On a GPU: inside a real ``torch.cuda.graph`` capture the stage reads no input (no device-to-host copy),
    sends nothing and returns silence, for dummy batches of both runners and for a real payload; afterwards the
    same model decodes normally."""
    model = make_model(tmp_path, sidecar.address)
    ids = torch.zeros(64, dtype=torch.long, device="cuda")
    calls = [
        dict(runtime_additional_information=model.get_dummy_runtime_additional_information(4),
             seq_token_counts=[64]),  # v1 dummy run
        dict(model_intermediate_buffer=[{}] * 4, runtime_additional_information=[{}] * 4,
             seq_token_counts=[16] * 4),  # v2 dummy run
        dict(runtime_additional_information=[payload("cap", torch.ones((Q, 16), dtype=torch.long))],
             seq_token_counts=[64], request_ids=[sched_id("cap")]),  # a real payload
    ]
    x = torch.ones(8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as vLLM does before capturing
        y = x * 2
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    outs, seen = [], []
    with torch.cuda.graph(graph):
        y = x * 2
        seen.append(delegate_module.cuda_stream_capturing())
        for kwargs in calls:
            outs.append(model(input_ids=ids, positions=torch.arange(64, device="cuda"), **kwargs))
        model.on_requests_finished({sched_id("cap")})
    graph.replay()
    torch.cuda.synchronize()
    assert seen == [True] and torch.equal(y, torch.full((8,), 2.0, device="cuda"))
    for out in outs:
        wavs = wavs_of(out)
        assert sum(w.numel() for w in wavs) == 64 // Q * U and all(torch.count_nonzero(w) == 0 for w in wavs)
    assert model.delegate.stats["round_trips"] == 0 and metric(sidecar.scrape(), "streams_opened_total") == 0
    codes = torch.randint(0, 64, (Q, 6), generator=torch.Generator().manual_seed(6))
    wav, = V1Runner(model).step([(sched_id("after"), payload("after", codes, finished=True))])
    assert torch.allclose(wav, one_shot(tiny_model, codes), atol=1e-4, rtol=0)
    model.delegate.close()


def test_segment_finished_restarts_the_stream(tmp_path, sidecar, tiny_model):
    """``is_segment_finished`` ends a segment: the state is freed and the next segment starts afresh."""
    model = make_model(tmp_path, sidecar.address)
    runner = V1Runner(model)
    g = torch.Generator().manual_seed(4)
    s1, s2 = torch.randint(0, 64, (Q, 6), generator=g), torch.randint(0, 64, (Q, 6), generator=g)
    p = payload("seg", s1)
    p["meta"]["is_segment_finished"] = torch.tensor(True)
    w1, = runner.step([(sched_id("seg"), p)])
    w2, = runner.step([(sched_id("seg"), payload("seg", s2, finished=True))])
    assert torch.allclose(w1, one_shot(tiny_model, s1), atol=1e-4, rtol=0)
    assert torch.allclose(w2, one_shot(tiny_model, s2), atol=1e-4, rtol=0)
    assert metric(sidecar.scrape(), "streams_opened_total") == 2
    model.delegate.close()


def test_rejected_chunk_ends_only_that_request(tmp_path, sidecar, tiny_model):
    """A code out of range is rejected by the sidecar: that request's audio stops (logged), the others go on."""
    model = make_model(tmp_path, sidecar.address)
    runner = V2Runner(model)
    good = torch.randint(0, 64, (Q, 6), generator=torch.Generator().manual_seed(5))
    bad = torch.full((Q, 3), 999, dtype=torch.long)
    wavs = runner.step([(sched_id("bad"), payload("bad", bad)), (sched_id("good"), payload("good", good[:, :3]))])
    assert wavs[0].numel() == 0 and wavs[1].numel() == 3 * U
    wavs = runner.step([(sched_id("bad"), payload("bad", bad, finished=True)),
                        (sched_id("good"), payload("good", good[:, 3:], finished=True))])
    assert wavs[0].numel() == 0
    assert torch.allclose(wavs[1], one_shot(tiny_model, good)[3 * U:], atol=1e-4, rtol=0)
    assert model.delegate.open_requests == []
    assert metric(sidecar.scrape(), "active_streams") == 0
    model.delegate.close()


def test_unreachable_sidecar_is_a_clear_startup_error(tmp_path):
    address = f"ipc://{tmp_path}/nobody/sidecar.sock"
    with pytest.raises(SidecarUnavailableError) as info:
        make_model(tmp_path, address, sidecar_connect_timeout_s=0.5)
    message = str(info.value)
    assert address in message and "sidecar_address" in message and "code2wav-sidecar serve" in message


def test_load_weights_drains_and_checks_nothing(tmp_path, sidecar):
    model = make_model(tmp_path, sidecar.address)
    consumed = []
    assert model.load_weights((consumed.append(i) or (f"w{i}", torch.zeros(1)) for i in range(5))) == set()
    assert len(consumed) == 5
    assert model.compute_logits(torch.zeros(1)) is None
    assert model.embed_input_ids(torch.zeros(7, dtype=torch.long)).shape == (7, 1)
    assert model.have_multimodal_outputs and model.requires_raw_input_tokens
    assert Qwen3TTSCode2WavSidecar.requires_request_ids and Qwen3TTSCode2WavSidecar.supports_native_payload_input
    model.delegate.close()


def test_checkpoint_mismatch_is_refused(tmp_path, sidecar):
    root = tmp_path / "other"
    (root / "speech_tokenizer").mkdir(parents=True)
    (root / "speech_tokenizer" / "config.json").write_text(
        '{"output_sample_rate": 24000, "decoder_config": {"num_quantizers": 16}}')
    connector = {"extra": {"sidecar_address": sidecar.address}}
    cfg = SimpleNamespace(model_config=SimpleNamespace(model=str(root), stage_connector_config=connector))
    with pytest.raises(ValueError, match="16 quantizers"):
        Qwen3TTSCode2WavSidecar(vllm_config=cfg)


# --------------------------------------------------------------------- no sidecar needed


def test_settings_precedence_and_validation():
    env = {"CODE2WAV_SIDECAR_ADDRESS": "tcp://10.0.0.1:5555", "CODE2WAV_SIDECAR_MODE": "window"}
    s = DelegateSettings.from_sources({"sidecar_mode": "exact"}, env)
    assert (s.address, s.mode, s.left_context_frames, s.window_chunk_frames) == ("tcp://10.0.0.1:5555", "exact",
                                                                                  25, 300)
    s = DelegateSettings.from_sources({"decode_left_context_frames": 7, "decode_chunk_frames": 50}, {})
    # no sidecar_address and an empty environment: the address `serve` binds by default in that environment
    assert (s.address, s.left_context_frames, s.window_chunk_frames) == (default_address({}, os.getuid()), 7, 50)
    with pytest.raises(ValueError, match="sidecar_mode"):
        DelegateSettings.from_sources({"sidecar_mode": "fast"}, {})
    with pytest.raises(ValueError, match="sidecar_timeout_s"):
        DelegateSettings.from_sources({"sidecar_timeout_s": "soon"}, {})
    assert connector_extra({"name": "x", "extra": {"a": 1}}) == {"a": 1}
    assert connector_extra(SimpleNamespace(extra={"b": 2})) == {"b": 2}
    assert connector_extra(None) == {}


def test_parse_step_layouts():
    codes = torch.arange(Q * 3).reshape(Q, 3)
    meta = {"request_id": ["r"], "left_context_size": torch.tensor([2]), "finished": [torch.tensor(True)]}
    # v2: padded placeholder ids, native payload authoritative, meta values as lists/tensors
    reqs = parse_step(torch.zeros(32, dtype=torch.long), [{"codes": {"audio": codes.reshape(-1)}, "meta": meta},
                                                          {"meta": {"request_id": "s"}}],
                      [12, 8], None, Q)
    assert [r.request_id for r in reqs] == ["r", "s"]
    assert torch.equal(reqs[0].codes, codes) and reqs[0].left_context == 2 and reqs[0].finished
    assert reqs[1].codes.shape == (Q, 2) and not reqs[1].dummy
    # v1: codes in the ids, split by seq_token_counts; a length not divisible by Q is malformed
    ids = torch.cat([codes.reshape(-1), torch.arange(5)])
    reqs = parse_step(ids, [{"meta": {"request_id": "a"}}, {"meta": {"request_id": "b"}}], [12, 5], ["a-1", "b-1"], Q)
    assert torch.equal(reqs[0].codes, codes) and reqs[0].scheduler_id == "a-1"
    assert reqs[1].codes is None and reqs[1].raw_length == 5
    # dummy runs: v1 marker ids, v2 empty dicts
    v1 = parse_step(torch.zeros(16, dtype=torch.long),
                    [{"meta": {"request_id": f"{DUMMY_REQUEST_PREFIX}0", "finished": True}}], [16], None, Q)
    v2 = parse_step(torch.zeros(16, dtype=torch.long), [{}, {}], [8, 8], None, Q)
    assert all(r.dummy for r in v1 + v2)
    # nothing at all: one empty dummy request
    assert [r.num_frames for r in parse_step(None, None, None, None, Q)] == [0]
