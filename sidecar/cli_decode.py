"""``code2wav-sidecar decode``: decode a .npy of codes or latents offline (no server), in the model family's
chunking. Everything that needs no model is checked first (the output, the input file, the device, the model
folder, the sizes); a mistake is one ``error:`` line and exit code 2, and nothing is written."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from .cli_checks import DEVICE_HELP, check_device, device_arg, fail, int_at_least
from .cli_help import DTYPE_CHOICES, DTYPE_HELP, DefaultsHelpFormatter, command_epilog
from .cpu_dtype import cpu_dtype_warning

DECODE_DESCRIPTION = ("Decode codes or latents from a .npy file into audio, offline in this process, through the same "
                      "stream modes as the server. exact (default): the state is carried, the audio equals one "
                      "decode of all frames; window: vLLM-Omni's chunked decode, each chunk after its left context. "
                      "Window sizes default to the model family's (the chunks its talker sends through vLLM-Omni: "
                      "25 new frames after 25 for the 12 Hz codes model, 4-frame latent patches after 20 for the "
                      "AudioVAE).")
DECODE_EXAMPLE = "code2wav-sidecar decode --model default --input codes.npy --output out.wav"


def add_decode_parser(sub) -> None:
    from code2wav.proto import STREAM_MODES

    p = sub.add_parser("decode", help="decode a codes/latents .npy offline (no server)",
                       formatter_class=DefaultsHelpFormatter, description=DECODE_DESCRIPTION,
                       epilog=command_epilog(DECODE_EXAMPLE))
    p.add_argument("--model", default="default", help="a decoder model folder (a TTS checkpoint's decoder folder, "
                   "e.g. its speech_tokenizer/), or a random-weights name: 'default', or a family's NAME-default")
    p.add_argument("--input", required=True, help="a .npy file: integer codes [B, Q, T] or [Q, T] (Q = the model's "
                   "quantizers, values in [0, codebook size)), or float32 latents [B, D, T] or [D, T] for a latents "
                   "model (float16 is refused, as by the client)")
    p.add_argument("--output", required=True, help="out.npy (float32 [B, 1, T*U]) or out.wav (one file per row)")
    p.add_argument("--mode", choices=list(STREAM_MODES), default="exact",
                   help="exact: the state is carried (one decode of all frames); window: vLLM-Omni's chunked decode")
    p.add_argument("--chunk-frames", type=int_at_least(1), help="window mode: new frames per chunk, a whole number "
                   "of the family's patches (default: the family's)")
    p.add_argument("--left-context-frames", type=int_at_least(0), help="window mode: frames of left context per "
                   "chunk (default: the family's)")
    p.add_argument("--device", type=device_arg, default="auto", help=DEVICE_HELP)
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32", help=DTYPE_HELP)
    p.add_argument("--time", action="store_true", help="print the decode time")
    p.add_argument("--sr-cond", type=int, help="stream option sr_cond: sample-rate condition in Hz, for "
                   "models that take it (default: the model's)")


def _window_sizes(args: argparse.Namespace, family_name: str) -> tuple[int, int] | str:
    """``(chunk_frames, left_context_frames)`` with the family's defaults, or the error line."""
    from .models.registry import chunking_of
    from .modes import get_mode

    chunking = chunking_of(family_name)
    chunk_frames = chunking.chunk_frames if args.chunk_frames is None else args.chunk_frames
    left = chunking.window_left_context_frames if args.left_context_frames is None else args.left_context_frames
    if not get_mode(args.mode).stateful and chunk_frames % chunking.patch_frames:
        return (f"--chunk-frames {chunk_frames}: this model ({family_name}) takes whole {chunking.patch_frames}-frame "
                f"patches; give a multiple of {chunking.patch_frames}")
    return chunk_frames, left


def cmd_decode(args: argparse.Namespace) -> int:
    from .offline import InputError, check_inputs, check_output_path, load_inputs_npy

    logging.basicConfig(level="WARNING", format="%(levelname)s %(name)s: %(message)s")
    try:  # everything that needs no model first: a wrong path fails in a second, not after the model loads
        output = check_output_path(Path(args.output))
        codes = load_inputs_npy(Path(args.input))
    except InputError as exc:
        return fail(str(exc))
    from .models import FamilyError, load_model, resolve_device
    from .models.registry import family_of_spec, model_error
    from .modes import get_mode
    from .offline import decode_offline, save_audio

    problem = check_device(args.device)
    if problem is not None:
        return fail(problem)
    try:
        family = family_of_spec(args.model)
    except FamilyError as exc:
        return fail(model_error(args.model, exc))
    sizes = _window_sizes(args, family.name)
    if isinstance(sizes, str):
        return fail(sizes)
    device = resolve_device(args.device)
    warning = cpu_dtype_warning(device.type, args.dtype)
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    try:
        model = load_model(args.model, device, args.dtype)
        codes_t = check_inputs(codes, args.input, model.input)  # [B, C, T] int64 codes or float32 latents
        options = model.contract.check_options({} if args.sr_cond is None else {"sr_cond": args.sr_cond})
    except FamilyError as exc:  # a checkpoint that is not the family's, an option the model does not take
        return fail(model_error(args.model, exc))
    except InputError as exc:
        return fail(str(exc))
    chunk_frames, left_context_frames = sizes
    t0 = time.perf_counter()
    wav = decode_offline(model, codes_t, get_mode(args.mode), chunk_frames, left_context_frames,
                         options)  # [B, 1, T * U]
    elapsed_s = time.perf_counter() - t0
    written = save_audio(output, wav, model.sample_rate_hz)
    audio_s = wav.shape[0] * wav.shape[2] / model.sample_rate_hz
    shown = "".join(f", {name}={value}" for name, value in options.items())
    window = "" if get_mode(args.mode).stateful else f", chunks of {chunk_frames} after {left_context_frames}"
    print(f"decoded {tuple(codes_t.shape)} -> {tuple(wav.shape)} ({audio_s:.2f} s of audio, mode={args.mode}{window}"
          f"{shown}) into {', '.join(map(str, written))}")
    if args.time:
        print(f"decode time: {elapsed_s * 1e3:.1f} ms ({audio_s / elapsed_s:.1f}x real time)")
    return 0
