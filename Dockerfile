# code2wav-sidecar image: one GPU process that owns the Qwen3-TTS Code2Wav decoder (weights, CUDA graphs,
# per-stream state) and serves it over ZeroMQ.
#
#   docker build -t code2wav-sidecar:0.1.0 .                                   # the sidecar (default target)
#   docker run --rm --gpus '"device=0"' -p 9464:9464 code2wav-sidecar:0.1.0   # embedded model, random weights
#   docker run ... code2wav-sidecar:0.1.0 --model /models/Qwen3-TTS-12Hz-1.7B-Base/speech_tokenizer --dtype bfloat16
#   docker build --target vllm-omni -t code2wav-vllm-omni:0.1.0 .             # vLLM-Omni + the sidecar plugin
#
# Build with BuildKit (the default since Docker 23): it builds only the stages the target needs, so the
# default target never pulls the vLLM-Omni image.
#
# Reproducibility: base images are pinned by version (pin by digest too, `image:tag@sha256:...`, where your
# registry policy asks for it), the runtime Python dependencies are pinned below, and the package itself is
# built from this checkout as a wheel.

# PyTorch runtime image: torch 2.13.0 (the version the project installs and tests with) on CUDA 13.0, the CUDA
# of torch 2.13.0's default wheels, with cuDNN 9. The H200 bench figures in deploy/k8s/SCALING.md were measured
# with torch 2.11 + CUDA 13. Change torch and CUDA together; the host driver must support the image's CUDA.
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime
# vLLM-Omni must be the 0.30 release: the plugin (`code2wav-sidecar[vllm]`) pins vllm==0.30.0 and
# vllm-omni==0.30.0 and the install below fails on any other version instead of silently replacing it.
ARG VLLM_OMNI_IMAGE=vllm/vllm-omni:v0.30.0
# The sidecar and the vLLM process must run with the same uid: the socket directory is 0700 and the socket 0600.
ARG APP_UID=10001
ARG APP_GID=10001

# ---------------------------------------------------------------------------------------------------------
# build: the package as a wheel (pure Python). Nothing of this stage but /wheels reaches the final images.
FROM ${BASE_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY LICENSE ./
COPY code2wav ./code2wav
COPY proto ./proto
COPY sidecar ./sidecar
COPY client ./client
COPY loadgen ./loadgen
COPY cudart ./cudart
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------------------------------------------------
# vllm-omni: the vLLM-Omni 0.30 image plus this package with the `vllm` extra, so vLLM-Omni's plugin entry
# point loads the sidecar connector. It runs as the sidecar's uid so it can open the shared socket.
FROM ${VLLM_OMNI_IMAGE} AS vllm-omni
ARG APP_UID
ARG APP_GID
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY --from=build /wheels /tmp/wheels
# `[vllm]` resolves vllm==0.30.0 and vllm-omni==0.30.0 against what the image already has: a no-op on the
# 0.30 image, a resolver error on any other. vLLM images install into the system Python (with uv where present).
# DL3013 (pin pip versions): the requirement is this build's own wheel, and its `vllm` extra pins exact versions.
# hadolint ignore=DL3013
RUN req="code2wav-sidecar[vllm] @ file://$(echo /tmp/wheels/code2wav_sidecar-*.whl)" \
 && if command -v uv >/dev/null 2>&1; then \
        uv pip install --system --no-cache "${req}"; \
    else \
        PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir "${req}"; \
    fi \
 && python3 -c "from importlib.metadata import version as v; print('code2wav-sidecar', v('code2wav-sidecar'), 'on vllm-omni', v('vllm-omni'))" \
 && rm -rf /tmp/wheels \
 && ln -s "$(python3 -c 'import importlib.util as u; print(u.find_spec("vllm_omni").submodule_search_locations[0])')/deploy" /opt/vllm-omni-deploy \
 && test -f /opt/vllm-omni-deploy/qwen3_tts.yaml \
 && groupadd --gid "${APP_GID}" code2wav \
 && useradd --uid "${APP_UID}" --gid "${APP_GID}" --create-home --home-dir /home/code2wav --shell /usr/sbin/nologin code2wav \
 && mkdir -p /run/code2wav /home/code2wav/.cache/huggingface /deploy/vllm-omni \
 && chown "${APP_UID}:${APP_GID}" /run/code2wav /home/code2wav/.cache /home/code2wav/.cache/huggingface \
 && chmod 0700 /run/code2wav
# The deploy overlay (the Code2Wav stage talks to the sidecar); compose mounts the checkout's copy over it.
# It inherits vLLM-Omni's stock Qwen3-TTS deploy file through $VLLM_OMNI_DEPLOY_DIR (linked above) and reads
# the sidecar's address from $CODE2WAV_SIDECAR_ADDRESS.
COPY deploy/vllm-omni/qwen3_tts_sidecar.yaml /deploy/vllm-omni/qwen3_tts_sidecar.yaml
ENV HOME=/home/code2wav \
    HF_HOME=/home/code2wav/.cache/huggingface \
    VLLM_OMNI_DEPLOY_DIR=/opt/vllm-omni-deploy \
    CODE2WAV_SIDECAR_ADDRESS=ipc:///run/code2wav/sidecar.sock \
    PYTHONUNBUFFERED=1
USER ${APP_UID}:${APP_GID}
WORKDIR /home/code2wav
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=900s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["vllm", "serve"]
CMD ["Qwen/Qwen3-TTS-12Hz-1.7B-Base", "--omni", "--deploy-config", "/deploy/vllm-omni/qwen3_tts_sidecar.yaml", "--trust-remote-code", "--host", "0.0.0.0", "--port", "8000"]

# ---------------------------------------------------------------------------------------------------------
# sidecar (default target): the package and its pinned runtime dependencies on the PyTorch runtime; no
# compilers, no git, no test or bench extras. torch comes from the base image (the package needs >=2.4).
FROM ${BASE_IMAGE} AS sidecar
ARG APP_UID
ARG APP_GID
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY --from=build /wheels /tmp/wheels
RUN python -m pip install --no-cache-dir /tmp/wheels/code2wav_sidecar-*.whl \
        "pyzmq==27.3.0" "msgpack==1.2.4" "uvloop==0.23.0" "prometheus-client==0.26.0" "pydantic==2.13.4" \
        "safetensors==0.8.0" "numpy==2.4.6" "PyYAML==6.0.3" \
 && rm -rf /tmp/wheels \
 && python -c "import code2wav.sidecar, code2wav.proto, zmq, torch; print('code2wav-sidecar on torch', torch.__version__)" \
 && groupadd --gid "${APP_GID}" code2wav \
 && useradd --uid "${APP_UID}" --gid "${APP_GID}" --create-home --home-dir /home/code2wav --shell /usr/sbin/nologin code2wav \
 && mkdir -p /run/code2wav /etc/code2wav /var/cache/code2wav \
 && chown "${APP_UID}:${APP_GID}" /run/code2wav /var/cache/code2wav \
 && chmod 0700 /run/code2wav
COPY deploy/sidecar.yaml /etc/code2wav/sidecar.yaml
ENV HOME=/home/code2wav \
    PYTHONUNBUFFERED=1 \
    CODE2WAV_METRICS_PORT=9464
# A named volume mounted here starts as a copy of this directory: owned by APP_UID, mode 0700.
VOLUME ["/run/code2wav"]
# /metrics (Prometheus), /healthz, /readyz.
EXPOSE 9464
USER ${APP_UID}:${APP_GID}
WORKDIR /home/code2wav
# /readyz answers 200 once the model is loaded, the CUDA graphs captured and the socket bound (503 before);
# start-period covers weight loading and graph capture. If you move the metrics port, set CODE2WAV_METRICS_PORT.
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/readyz' % os.environ.get('CODE2WAV_METRICS_PORT', '9464'), timeout=2)"]
ENTRYPOINT ["code2wav-sidecar", "serve", "--config", "/etc/code2wav/sidecar.yaml"]
# Defaults start the embedded model (random weights) on the GPU if there is one; pass flags to override.
CMD []
