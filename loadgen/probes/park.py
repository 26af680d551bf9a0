"""Probe (run once on an H100 on 2026-12-07, then retired): which host calls block while the current (legacy
default) stream is parked on a host-memory doorbell wait (``cuStreamWaitValue32``), released by a timer thread
after 1 s. Each call is timed on the parking thread; about 1000 ms means it waited for the release. Run it twice,
with the default (lazy) module loading and with ``CUDA_MODULE_LOADING=EAGER``.

    PYTHONPATH=. python3 loadgen/probes/park.py
"""

import json
import os
import threading
import time

import torch

from code2wav.cudart import runtime
from code2wav.cudart.doorbell_words import DoorbellWords

rt = runtime()
dev = torch.device("cuda", 0)
torch.cuda.init()
words = DoorbellWords.create(4)
pointer = rt.host_register(words.address, words.nbytes)
x = torch.zeros(4096, device=dev)
x.zero_()
pos = torch.zeros(65, dtype=torch.long, device=dev)
pos[1] = 0
torch.cuda.synchronize()
token = [0]
results = {}


def park() -> None:
    token[0] += 2
    rt.wait_value32(pointer, token[0], torch.cuda.current_stream().cuda_stream)
    threading.Timer(1.0, lambda tok=token[0]: words.raise_behind(0, tok)).start()


def probe(name, fn) -> None:
    park()
    start = time.monotonic()
    fn()
    results[name] = round((time.monotonic() - start) * 1000, 1)
    torch.cuda.synchronize()
    print(name, results[name], "ms", flush=True)


side = torch.cuda.Stream()


def on_other_stream() -> None:
    with torch.cuda.stream(side):
        torch.ones(5, dtype=torch.float64, device=dev).exp_()


probe("used kernel zero_ on parked legacy stream", lambda: x.zero_())
probe("used index fill pos[1]=0", lambda: pos.__setitem__(1, 0))
probe("fresh kernel (int16 cumsum) on parked stream", lambda: torch.arange(7, dtype=torch.int16, device=dev).cumsum(0))
probe("fresh kernel (f64 exp) on another stream", on_other_stream)
probe("event record+query", lambda: torch.cuda.Event().record() or None)
probe("alloc 256 MiB", lambda: torch.empty(256 << 20, dtype=torch.uint8, device=dev))
probe("pinned host alloc", lambda: torch.empty(1 << 20, pin_memory=True))
probe("fresh kernel (bf16 sin) on parked stream", lambda: torch.ones(3, dtype=torch.bfloat16, device=dev).sin())
print(json.dumps({"CUDA_MODULE_LOADING": os.environ.get("CUDA_MODULE_LOADING", "(default)"), **results}))
rt.host_unregister(words.address)
words.close()
