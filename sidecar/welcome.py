"""The welcome's model entry: the served model's input contract, so a client can check its inputs before
sending (``proto.ModelInfo``, built once from the loaded model and sent in every welcome)."""

from __future__ import annotations

from code2wav import proto

from .models import LoadedModel


def model_entry(model: LoadedModel) -> proto.ModelInfo:
    """The welcome message's entry for ``model``: its contract, so a client can check inputs before sending."""
    spec = model.input
    valid_range = spec.valid_range
    return proto.ModelInfo(
        name=model.name, num_quantizers=spec.channels, codebook_size=spec.high,
        samples_per_frame=model.samples_per_frame, sample_rate=model.sample_rate_hz, modes=proto.STREAM_MODES,
        dtype=str(model.dtype).removeprefix("torch."), device=str(model.device), family=model.family_name,
        input_kind=spec.kind, input_dtypes=spec.wire_dtypes, input_channels=spec.channels,
        input_range=None if valid_range is None else tuple(valid_range),
        stream_options=tuple(proto.StreamOptionInfo(o.name, o.low, o.high, o.default)
                             for o in model.contract.stream_options),
        history_frames=model.contract.history_frames)
