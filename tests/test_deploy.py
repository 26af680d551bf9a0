"""Deployment files (Dockerfile, deploy/compose.yaml, deploy/k8s, Prometheus, Grafana) checked without a Docker
engine or a cluster:

- compose files validate against the Compose Specification schema (``tests/data/schemas/compose-spec.json``), raw
  and after interpolation with ``deploy/.env.example``; their wiring (shared socket, namespaces, GPUs,
  healthchecks, ``depends_on``) is checked too;
- the Dockerfile passes ``hadolint`` and keeps its contract (non-root, entrypoint, healthcheck, volume, port);
- Kubernetes manifests pass ``kubernetes-validate --strict`` against a pinned Kubernetes version (its schemas
  ship in the package: no network), and the native-sidecar wiring is checked;
- the Prometheus config and alert rules pass ``promtool check config``; every dashboard query parses
  (``promtool check rules`` on the queries as recording rules) and every metric the dashboard and the alerts
  query exists in a live sidecar's ``/metrics`` (a real one, tiny model, CPU); a real Prometheus then scrapes
  that sidecar and every dashboard query runs against it.

The tools come from ``.ci/install-deploy-tools``; a missing one fails with that hint. Only promtool/prometheus
(Debian's ``prometheus`` package) may be missing: then the Prometheus files get a structural parse check instead
(YAML structure, rule fields, balanced PromQL brackets) and the live Prometheus step is skipped with a reason.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import warnings
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
COMPOSE_SCHEMA = ROOT / "tests" / "data" / "schemas" / "compose-spec.json"
DOCKERFILE = ROOT / "Dockerfile"
ENV_EXAMPLE = DEPLOY / ".env.example"
K8S = DEPLOY / "k8s"
K8S_VERSION = "1.34.0"  # native sidecars (GA 1.33) and resource.k8s.io/v1 (DRA, GA 1.34)
PROMETHEUS_DIR = DEPLOY / "prometheus"
DASHBOARDS = DEPLOY / "grafana" / "dashboards"
SOCKET_DIR = "/run/code2wav"
SOCKET_ADDRESS = f"ipc://{SOCKET_DIR}/sidecar.sock"
OVERLAY = DEPLOY / "vllm-omni" / "qwen3_tts_sidecar.yaml"
METRIC_PREFIX = "code2wav_sidecar_"
INSTALL_HINT = "run .ci/install-deploy-tools (with the test environment active) to install it"


# ------------------------------------------------------------------------------------------------ helpers
def _tool(name: str, *, required: bool = True) -> str | None:
    """A tool from PATH or from the test interpreter's bin folder (where the install script puts them)."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None and required:
        pytest.fail(f"{name} not found; {INSTALL_HINT}")
    return found


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


def _jsonschema():
    try:
        import jsonschema
    except ImportError:
        pytest.fail(f"the jsonschema package is missing; {INSTALL_HINT}")
    return jsonschema


def _load_yaml(path: Path):
    return yaml.safe_load(path.read_text())


def _compose_files() -> list[Path]:
    files = sorted({*DEPLOY.rglob("compose*.y*ml"), *DEPLOY.rglob("docker-compose*.y*ml"),
                    *ROOT.glob("compose*.y*ml"), *ROOT.glob("docker-compose*.y*ml")})
    assert files, "no compose file found under deploy/"
    return files


def _env_example() -> dict[str, str]:
    env = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f".env.example: not KEY=VALUE: {line!r}"
        env[key.strip()] = value.strip()
    return env


_VAR = re.compile(r"\$(?:\$|\{(?P<braced>[^}]*)\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")
_BRACED = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:-|-|:\?|\?|:\+|\+)(?P<arg>.*))?$", re.S)


def _interpolate(value, env: dict[str, str]):
    """Compose-spec interpolation: $VAR, ${VAR}, ${VAR:-d}, ${VAR-d}, ${VAR:?e}, ${VAR?e}, ${VAR:+a}, $$."""
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        if m.group("plain"):
            return env.get(m.group("plain"), "")
        b = _BRACED.match(m.group("braced"))
        assert b, f"bad interpolation {m.group(0)!r}"
        name, op, arg = b.group("name"), b.group("op"), b.group("arg")
        val = env.get(name)
        if op == ":-":
            return val if val else _interpolate(arg, env)
        if op == "-":
            return val if val is not None else _interpolate(arg, env)
        if op in (":?", "?"):
            if val is None or (op == ":?" and not val):
                raise KeyError(f"required variable {name} is not set: {arg}")
            return val
        if op == ":+":
            return _interpolate(arg, env) if val else ""
        if op == "+":
            return _interpolate(arg, env) if val is not None else ""
        return val or ""

    return _VAR.sub(one, value)


def _variables(node) -> set[str]:
    """Variables a parsed compose document interpolates (comments do not count), defaults included."""
    if isinstance(node, dict):
        return set().union(*(_variables(v) for v in node.values()), *(_variables(k) for k in node))
    if isinstance(node, list):
        return set().union(*(_variables(v) for v in node))
    if not isinstance(node, str):
        return set()
    names = set()
    for m in _VAR.finditer(node):
        if m.group("plain"):
            names.add(m.group("plain"))
        elif m.group("braced") is not None:
            b = _BRACED.match(m.group("braced"))
            names.add(b.group("name"))
            names |= _variables(b.group("arg") or "")
    return names


def _compose() -> dict:
    return _load_yaml(DEPLOY / "compose.yaml")


def _dockerfile_stages() -> list[dict]:
    """Stages of the Dockerfile: {'name', 'from', 'instructions': [(KEYWORD, args)]}; continuation lines joined."""
    logical, buf = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        if not buf and (not raw.strip() or raw.lstrip().startswith("#")):
            continue
        if raw.rstrip().endswith("\\"):
            buf += raw.rstrip()[:-1] + " "
            continue
        logical.append(buf + raw)
        buf = ""
    stages, args = [], {}
    for line in logical:
        keyword, _, rest = line.strip().partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append({"name": name, "from": parts[0], "instructions": []})
        elif not stages:
            if keyword == "ARG" and "=" in rest:
                key, value = rest.split("=", 1)
                args[key.strip()] = value.strip()
        else:
            stages[-1]["instructions"].append((keyword, rest.strip()))
    for stage in stages:
        stage["global_args"] = args
    return stages


def _dockerfile_args() -> dict[str, str]:
    return _dockerfile_stages()[0]["global_args"]


def _k8s_docs() -> list[tuple[Path, dict]]:
    docs = []
    for path in sorted([*K8S.rglob("*.yaml"), *K8S.rglob("*.yml")]):
        docs += [(path, d) for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs, "no manifests under deploy/k8s"
    return docs


def _deployment() -> dict:
    """The Deployment of ``deploy/k8s/deployment.yaml`` (vLLM with its own sidecar; ``k8s/pool/`` has the pool's)."""
    found = [d for path, d in _k8s_docs() if d.get("kind") == "Deployment" and path == K8S / "deployment.yaml"]
    assert len(found) == 1, "expected one Deployment in deploy/k8s/deployment.yaml"
    return found[0]


def _dashboards() -> list[tuple[Path, dict]]:
    boards = [(p, json.loads(p.read_text())) for p in sorted(DASHBOARDS.glob("*.json"))]
    assert boards, "no Grafana dashboard JSON in deploy/grafana/dashboards"
    return boards


def _panels(board: dict) -> list[dict]:
    out = []
    for panel in board.get("panels", []):
        out.append(panel)
        out += panel.get("panels", [])  # panels inside collapsed rows
    return out


def _dashboard_exprs() -> list[tuple[str, str]]:
    """(where, expr) of every Prometheus query in every dashboard, panel targets and template variables."""
    exprs = []
    for path, board in _dashboards():
        for panel in _panels(board):
            for t in panel.get("targets", []):
                if t.get("expr"):
                    exprs.append((f"{path.name}: {panel.get('title')!r} {t.get('refId')}", t["expr"]))
        for var in board.get("templating", {}).get("list", []):
            if var.get("type") == "query":
                q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
                exprs.append((f"{path.name}: variable {var['name']}", q))
    assert exprs
    return exprs


def _alert_exprs() -> list[tuple[str, str]]:
    exprs = []
    for path in sorted(PROMETHEUS_DIR.glob("*.y*ml")):
        doc = _load_yaml(path)
        for group in (doc or {}).get("groups", []):
            for rule in group["rules"]:
                exprs.append((f"{path.name}: {rule.get('alert') or rule.get('record')}", rule["expr"]))
    return exprs


_GRAFANA_VARS = [("$__rate_interval", "1m"), ("$__interval", "15s"), ("$__range", "1h"),
                 ('"$instance"', '".*"'), ("$instance", ".*")]
_LABEL_VALUES = re.compile(r"^label_values\((?P<metric>[^,]+),\s*(?P<label>\w+)\)$")


def _as_promql(expr: str, rate_interval: str = "1m") -> str:
    """A Grafana query as plain PromQL: template variables replaced, label_values(m, l) -> m."""
    m = _LABEL_VALUES.match(expr.strip())
    if m:
        return m.group("metric").strip()
    for var, value in _GRAFANA_VARS:
        expr = expr.replace(var, rate_interval if var == "$__rate_interval" else value)
    assert "$" not in expr, f"unhandled Grafana variable in {expr!r}"
    return expr


_SUFFIXES = ("_bucket", "_count", "_sum", "_created")
_IDENT = re.compile(r"\b" + METRIC_PREFIX + r"[a-zA-Z0-9_]+")


def _exposed_names(exposition: str) -> set[str]:
    """Every series name a scrape can contain, from # TYPE lines (present even for labelled metrics without
    samples yet): counters as written (``_total``), histograms with ``_bucket``/``_sum``/``_count``."""
    names = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            names.add(name)
            if kind.strip() == "histogram":
                names.update(name + s for s in ("_bucket", "_sum", "_count"))
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def _balanced(expr: str) -> bool:
    pairs, stack, quote = {")": "(", "]": "[", "}": "{"}, [], None
    for ch in expr:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'`":
            quote = ch
        elif ch in "([{":
            stack.append(ch)
        elif ch in pairs:
            if not stack or stack.pop() != pairs[ch]:
                return False
    return not stack and quote is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------ compose
@pytest.mark.parametrize("path", _compose_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_compose_validates_against_compose_spec(path):
    jsonschema = _jsonschema()
    validator = jsonschema.Draft7Validator(json.loads(COMPOSE_SCHEMA.read_text()))
    raw = _load_yaml(path)

    def errors(doc) -> list[str]:
        return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]

    assert errors(raw) == [], "as written"
    assert errors(_interpolate(raw, _env_example())) == [], "interpolated with deploy/.env.example"
    # the validator does reject what compose would reject
    broken = copy.deepcopy(raw)
    first = next(iter(broken["services"].values()))
    first["depend_on"] = ["x"]
    first.setdefault("healthcheck", {})["interval"] = 10
    assert len(errors(broken)) >= 2


def test_compose_variables_match_env_example():
    used = _variables(_compose())
    documented = set(_env_example())
    assert used - documented == set(), "variables compose.yaml reads but deploy/.env.example does not set"
    assert documented - used == set(), "variables in deploy/.env.example that compose.yaml never reads"
    with pytest.raises(KeyError, match="GRAFANA_ADMIN_PASSWORD"):
        _interpolate(_compose(), {})  # no default admin password


def test_compose_wiring():
    doc = _interpolate(_compose(), _env_example())
    services = doc["services"]
    assert {"vllm", "code2wav-sidecar", "prometheus", "grafana"} <= set(services)
    sidecar, vllm = services["code2wav-sidecar"], services["vllm"]

    # one uid (the image's) on both ends of the 0700 socket directory
    uid = _dockerfile_args()["APP_UID"]
    assert sidecar["user"] == vllm["user"] == f"{uid}:{_dockerfile_args()['APP_GID']}"
    # the socket volume is shared, at the address both sides use
    for svc in (sidecar, vllm):
        assert any(v.split(":")[:2] == ["code2wav-socket", SOCKET_DIR] for v in svc["volumes"])
    assert "code2wav-socket" in doc["volumes"]
    # CUDA IPC: one PID and one IPC namespace, held by a container that never restarts on its own
    holder = sidecar["ipc"].split(":", 1)[1]
    assert sidecar["ipc"] == sidecar["pid"] == vllm["ipc"] == vllm["pid"] == f"service:{holder}"
    assert services[holder]["ipc"] == "shareable" and services[holder].get("init") is True
    # GPUs
    for svc in (sidecar, vllm):
        (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"] and dev["device_ids"]
    # the sidecar: built from the repo's Dockerfile, its config mounted where the entrypoint reads it
    assert sidecar["build"]["target"] == "sidecar"
    assert (DEPLOY / sidecar["build"]["context"] / sidecar["build"]["dockerfile"]).resolve() == DOCKERFILE
    assert vllm["build"]["context"] == sidecar["build"]["context"]
    assert "./sidecar.yaml:/etc/code2wav/sidecar.yaml:ro" in sidecar["volumes"]
    assert "/readyz" in " ".join(sidecar["healthcheck"]["test"])
    assert ":9464" in " ".join(sidecar["healthcheck"]["test"])
    # vLLM: the sidecar overlay, started only once the sidecar is healthy
    assert vllm["build"]["target"] == "vllm-omni"
    cmd = vllm["command"]
    assert "--omni" in cmd and cmd[cmd.index("--deploy-config") + 1] == "/deploy/vllm-omni/qwen3_tts_sidecar.yaml"
    assert "./vllm-omni:/deploy/vllm-omni:ro" in vllm["volumes"]
    assert vllm["depends_on"]["code2wav-sidecar"]["condition"] == "service_healthy"
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"
    for name, svc in services.items():
        assert svc.get("restart") in ("unless-stopped", "always", "on-failure"), name
        assert "healthcheck" in svc, name
    # bind mounts exist (but the user's models folder)
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith(".") and not src.startswith("./models"):
                assert (DEPLOY / src).exists(), f"{name}: bind mount source {src} missing"
    assert (DEPLOY / "vllm-omni" / OVERLAY.name).is_file()
    # Prometheus scrapes the sidecar by its compose service name and metrics port
    prom = _load_yaml(PROMETHEUS_DIR / "prometheus.yml")
    targets = [t for job in prom["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]]
    assert "code2wav-sidecar:9464" in targets and "vllm:8000" in targets
    # Grafana: provisioning and dashboards mounted where the provider and the home-dashboard setting look
    grafana = services["grafana"]
    provider = _load_yaml(DEPLOY / "grafana/provisioning/dashboards/code2wav.yaml")["providers"][0]
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in grafana["volumes"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(provider["options"]["path"] + "/")
    assert (DASHBOARDS / Path(home).name).is_file()
    datasource = _load_yaml(DEPLOY / "grafana/provisioning/datasources/prometheus.yaml")["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090"


_OC_ENV = re.compile(r"\$\{oc\.env:(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?P<default>,[^}]*)?\}")


def test_vllm_overlay_gets_the_shared_socket_and_its_environment():
    """The overlay (from the vLLM-Omni integration) reads the sidecar address from the environment; the image,
    compose and the manifest set it to the shared socket, and set every variable the overlay needs that has
    no default (the stock deploy folder)."""
    assert OVERLAY.is_file(), f"{OVERLAY.relative_to(ROOT)} (vLLM-Omni integration) is missing"

    def find(node, key):
        if isinstance(node, dict):
            for k, value in node.items():
                if k == key:
                    yield value
                yield from find(value, key)
        elif isinstance(node, list):
            for item in node:
                yield from find(item, key)

    overlay = _load_yaml(OVERLAY)
    (address,) = set(find(overlay, "sidecar_address"))
    m = _OC_ENV.fullmatch(address)
    assert m, f"the overlay's sidecar_address should come from the environment, got {address!r}"
    address_var = m.group("name")
    required = {mm.group("name") for mm in _OC_ENV.finditer(OVERLAY.read_text()) if not mm.group("default")}

    vllm_stage = next(st for st in _dockerfile_stages() if st["name"] == "vllm-omni")
    image_env = dict(re.findall(r"(\w+)=(\S+)", " ".join(a for k, a in vllm_stage["instructions"] if k == "ENV")))
    assert image_env[address_var] == SOCKET_ADDRESS
    assert required <= set(image_env), f"the vllm-omni image must set {required - set(image_env)}"
    compose_env = _compose()["services"]["vllm"]["environment"]
    assert compose_env[address_var] == SOCKET_ADDRESS
    (vllm,) = [c for c in _deployment()["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm"]
    assert address_var in {e["name"] for e in vllm["env"]}


def test_sidecar_config_example_loads_with_the_servers_own_loader():
    from code2wav.sidecar.config import load_config

    cfg = load_config(DEPLOY / "sidecar.yaml")
    assert cfg.address == SOCKET_ADDRESS
    assert cfg.metrics_host == "0.0.0.0" and cfg.metrics_port == 9464
    assert cfg.model == "default"


# ------------------------------------------------------------------------------------------------ Dockerfile
def test_dockerfile_passes_hadolint():
    hadolint = _tool("hadolint")
    result = _run([hadolint, "--no-color", "--failure-threshold", "info", str(DOCKERFILE)], cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_contract():
    stages = _dockerfile_stages()
    args = _dockerfile_args()
    final = stages[-1]
    assert final["name"] == "sidecar", "the sidecar must be the default (last) stage"
    assert final["from"] == "${BASE_IMAGE}"
    base = args["BASE_IMAGE"]
    assert re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda\d+\.\d+-cudnn\d+-runtime(@sha256:[0-9a-f]{64})?", base), \
        f"base image must be a versioned PyTorch CUDA runtime, got {base}"
    assert re.search(r":v?\d+\.\d+\.\d+", args["VLLM_OMNI_IMAGE"]) and "0.30" in args["VLLM_OMNI_IMAGE"]
    ins = final["instructions"]
    kinds = [k for k, _ in ins]
    text = {k: [a for kk, a in ins if kk == k] for k in kinds}
    # non-root, as the uid the compose file and the manifests use
    assert text["USER"] == ["${APP_UID}:${APP_GID}"] and int(args["APP_UID"]) > 0
    assert kinds.index("USER") > max(i for i, k in enumerate(kinds) if k == "RUN")
    # the package, no dev tools: no test/bench extras, no compilers
    run = " ".join(text["RUN"])
    assert "code2wav_sidecar-" in run and not re.search(r"\[(test|bench)", run)
    assert not re.search(r"\b(gcc|g\+\+|build-essential|git)\b", run)
    assert json.loads(text["ENTRYPOINT"][0])[:2] == ["code2wav-sidecar", "serve"]
    assert "/etc/code2wav/sidecar.yaml" in text["ENTRYPOINT"][0]
    assert any("COPY deploy/sidecar.yaml /etc/code2wav/sidecar.yaml" == f"COPY {a}" for a in text["COPY"])
    assert "/readyz" in text["HEALTHCHECK"][0]
    assert json.loads(text["VOLUME"][0]) == [SOCKET_DIR]
    assert text["EXPOSE"] == ["9464"]
    # the console script the entrypoint runs exists
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^code2wav-sidecar = "code2wav\.sidecar\.cli:main"$', pyproject, re.M)
    # what the stages COPY from the context exists and is not excluded by .dockerignore
    allowed = [line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")]
    for stage in stages:
        for keyword, arg in stage["instructions"]:
            if keyword != "COPY" or arg.startswith("--from"):
                continue
            for src in arg.split()[:-1]:
                assert src in allowed, f"COPY {src}: not in the .dockerignore allow-list"
                assert (ROOT / src).exists(), src


# ------------------------------------------------------------------------------------------------ Kubernetes
def test_kubernetes_manifests_validate():
    kv = _tool("kubernetes-validate")
    files = sorted({str(p) for p, _ in _k8s_docs()})
    result = _run([kv, "--strict", "--kubernetes-version", K8S_VERSION, *files], cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "passed" in result.stdout + result.stderr


def test_kubernetes_native_sidecar_wiring():
    dep = _deployment()
    pod = dep["spec"]["template"]
    spec = pod["spec"]
    (sidecar,) = [c for c in spec["initContainers"] if c["name"] == "code2wav-sidecar"]
    (vllm,) = [c for c in spec["containers"] if c["name"] == "vllm"]
    assert sidecar["restartPolicy"] == "Always"  # native sidecar
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert ports == {"metrics": 9464}
    for probe, path in (("startupProbe", "/readyz"), ("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = sidecar[probe]["httpGet"]
        assert get["path"] == path and ports.get(get["port"], get["port"]) == 9464, probe
    # the socket: an emptyDir mounted in both; the sidecar binds one folder down (it refuses the emptyDir's
    # 0777 root as a socket directory) and vLLM's overlay gets that address from CODE2WAV_SIDECAR_ADDRESS
    args = sidecar["args"]
    address = args[args.index("--address") + 1]
    (sock_mount,) = [m for m in sidecar["volumeMounts"] if address.startswith(f"ipc://{m['mountPath']}/")]
    sub = address[len(f"ipc://{sock_mount['mountPath']}/"):].split("/")
    assert len(sub) == 2 and sub[1] == "sidecar.sock"
    (vmount,) = [m for m in vllm["volumeMounts"] if m["name"] == sock_mount["name"]]
    assert vmount["mountPath"] == sock_mount["mountPath"] and "subPath" not in vmount
    assert "emptyDir" in next(v for v in spec["volumes"] if v["name"] == sock_mount["name"])
    env = {e["name"]: e.get("value") for e in vllm["env"]}
    assert env["CODE2WAV_SIDECAR_ADDRESS"] == address
    # one uid, one PID namespace, one /dev/shm, one GPU claim
    assert spec["securityContext"]["runAsUser"] == int(_dockerfile_args()["APP_UID"])
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["shareProcessNamespace"] is True
    for c in (sidecar, vllm):
        assert any(m["mountPath"] == "/dev/shm" for m in c["volumeMounts"]), c["name"]
        assert c["resources"]["claims"] == [{"name": spec["resourceClaims"][0]["name"]}], c["name"]
    template = spec["resourceClaims"][0]["resourceClaimTemplateName"]
    assert any(d.get("kind") == "ResourceClaimTemplate" and d["metadata"]["name"] == template for _, d in _k8s_docs())
    # vLLM: the overlay and probes
    assert "--omni" in vllm["args"] and "/deploy/vllm-omni/qwen3_tts_sidecar.yaml" in vllm["args"]
    assert vllm["readinessProbe"]["httpGet"]["path"] == "/health"
    # scrape annotation on the pod, matching the metrics port
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "9464"
    assert ann["prometheus.io/path"] == "/metrics"


def test_scaling_page_quotes_the_committed_bench_results():
    """The capacity figures on the scaling page are those of the bench JSON files it names in the results folder
    (``docs/results/``): the in-process graph steps of the current kernels, the closed-loop levels (64 and 256
    streams) and the open-loop real-time levels of the same session, one stream through the sidecar (inline bytes,
    CUDA IPC), and the older float32 and bf16 runs it compares float32 with. deploy/ holds deployment files only."""
    page = (K8S / "SCALING.md").read_text()
    bench = ROOT / "docs" / "results"
    named = set(re.findall(r"docs/results/([\w.-]+\.json)", page))
    assert {"h200-bfloat16-state-cols-2.json", "h200-bfloat16-buckets16.json", "h200-bfloat16-buckets16-realtime.json",
            "h200-bfloat16-glue.json", "h200-c1-inputs.json", "h200-float32.json", "h200-bfloat16.json"} <= named
    assert all((bench / name).is_file() for name in named)
    stray = [str(p.relative_to(ROOT)) for p in DEPLOY.rglob("*") if p.is_file()
             and not (p.suffix in (".yaml", ".yml") or p.name in (".env.example", "SCALING.md")
                      or (p.suffix == ".json" and p.parent == DASHBOARDS))]
    assert stray == [], "not deployment files"

    def report(name: str, dtype: str) -> dict:
        data = json.loads((bench / name).read_text())
        assert data["environment"]["gpu"] == "NVIDIA H200" and data["environment"]["dtype"] == dtype, name
        return data

    def rows(name: str, dtype: str) -> dict:
        by_level = {r["concurrency"]: r for r in report(name, dtype)["results"]}
        assert all(r["errors"] == 0 and not r.get("refused_streams") for r in by_level.values()), name
        return by_level

    steps = {b["name"]: b for b in report("h200-bfloat16-state-cols-2.json", "bfloat16")["baselines"]}
    assert f"| {steps['exact-graph-b1']['latency_ms_p50']:.3f} ms |" in page
    b16, b64 = (round(steps[f"exact-graph-b{n}"]["audio_s_per_s"]) for n in (16, 64))
    assert f"| {b16} / {b64} audio-s/s |" in page
    closed = rows("h200-bfloat16-buckets16.json", "bfloat16")
    for level in (64, 256):
        assert f"{round(closed[level]['audio_s_per_s'])} audio-s/s (p99 {closed[level]['chunk_latency_ms_p99']:g} ms)" \
            in page, level
    realtime = rows("h200-bfloat16-buckets16-realtime.json", "bfloat16")
    low, high = sorted(realtime)
    assert all(r["chunk_latency_ms_p99"] <= 250 for r in realtime.values())
    assert f"{low} / {high} real-time streams" in page
    assert (f"p99 chunk latency {realtime[low]['chunk_latency_ms_p99']:.2f} / "
            f"{realtime[high]['chunk_latency_ms_p99']:.2f} ms, no errors") in page
    one_stream = rows("h200-bfloat16-glue.json", "bfloat16")[1]["chunk_latency_ms_p50"]
    device = json.loads((bench / "h200-c1-inputs.json").read_text())["run8"]["default-bfloat16-device"]
    assert f"{one_stream:.2f} ms / {device['results'][0]['chunk_latency_ms_p50']:.2f} ms" in page
    for dtype in ("float32", "bfloat16"):
        assert f"{round(rows(f'h200-{dtype}.json', dtype)[256]['audio_s_per_s'])} audio-s/s" in page, dtype
    for needle in ("5.2 MB", "2.6 MB", "CurveZMQ", "tcp://"):
        assert needle in page, needle


# ------------------------------------------------------------------------------------------------ Prometheus
def _fallback_prometheus_check() -> None:
    """Without promtool: the config and rules parse, have the fields Prometheus requires, and every
    expression has balanced brackets and quotes."""
    warnings.warn("promtool not found: ran the structural parse check of deploy/prometheus instead "
                  f"({INSTALL_HINT})", stacklevel=2)
    cfg = _load_yaml(PROMETHEUS_DIR / "prometheus.yml")
    assert set(cfg) <= {"global", "rule_files", "scrape_configs", "alerting", "remote_write", "remote_read"}
    jobs = [job["job_name"] for job in cfg["scrape_configs"]]
    assert len(jobs) == len(set(jobs))
    for job in cfg["scrape_configs"]:
        for sc in job.get("static_configs", []):
            assert all(re.fullmatch(r"[\w.-]+:\d+", t) for t in sc["targets"]), job
    for rule_file in cfg.get("rule_files", []):
        doc = _load_yaml(PROMETHEUS_DIR / rule_file)
        for group in doc["groups"]:
            for rule in group["rules"]:
                assert ("alert" in rule) != ("record" in rule) and rule["expr"], rule
    for where, expr in _alert_exprs():
        assert _balanced(expr), where


def test_prometheus_config_passes_promtool():
    promtool = _tool("promtool", required=False)
    if promtool is None:
        _fallback_prometheus_check()
        return
    result = _run([promtool, "check", "config", str(PROMETHEUS_DIR / "prometheus.yml")])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rules found" in result.stdout + result.stderr  # the alert rules were checked too


def test_dashboard_queries_are_valid_promql(tmp_path):
    exprs = _dashboard_exprs()
    promtool = _tool("promtool", required=False)
    if promtool is None:
        warnings.warn(f"promtool not found: dashboard queries only checked for balanced brackets ({INSTALL_HINT})",
                      stacklevel=1)
        for where, expr in exprs:
            assert _balanced(expr), where
        return
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": _as_promql(expr)} for i, (_, expr) in enumerate(exprs)]}]}
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = _run([promtool, "check", "rules", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr + "\n" + "\n".join(
        f"query_{i}: {w}" for i, (w, _) in enumerate(exprs))


def test_dashboard_structure():
    required = {  # what the dashboard must show -> a metric that shows it
        "graph hit rate by bucket": "graph_replays_total",
        "chunk latency quantiles": "chunk_latency_seconds_bucket",
        "throughput in audio seconds": "audio_seconds_total",
        "active streams": "active_streams",
        "batch size": "batch_size_bucket",
        "queue depth": "queue_depth",
        "errors by code": "errors_total",
        "graph memory": "graph_pool_bytes",
    }
    for path, board in _dashboards():
        ids = [p["id"] for p in _panels(board)]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
        assert board["uid"] and board["title"]
    used = " ".join(expr for _, expr in _dashboard_exprs())
    for topic, metric in required.items():
        assert METRIC_PREFIX + metric in used, topic
    assert re.search(r"sum by \(code\) \(rate\(" + METRIC_PREFIX + r"errors_total", used)
    assert re.search(r"sum by \(component, bucket\) \(rate\(" + METRIC_PREFIX + "graph_replays_total", used)


# ------------------------------------------------------------------------------------------------ live sidecar
@pytest.fixture(scope="module")
def live_sidecar():
    """A real sidecar (tiny golden model, CPU) that has decoded some audio and returned one typed error."""
    from safetensors.torch import load_file

    from code2wav.client import SidecarClient
    from code2wav.client import errors as cerr
    from conftest import TINY, start_sidecar

    codes = load_file(str(TINY / "cases.safetensors"))["codes"]
    workdir = Path(tempfile.mkdtemp(prefix="code2wav-deploy-"))
    # the image's config file (flags override it, as in the container; metrics stay on loopback here)
    running = start_sidecar(workdir, "--config", str(DEPLOY / "sidecar.yaml"), "--metrics-host", "127.0.0.1")

    def traffic() -> None:
        with SidecarClient(running.address, timeout_s=30) as client:
            a = client.open_stream("deploy-a")
            w = client.open_stream("deploy-w", mode="window", left_context_frames=5)
            client.decode_batch([(a, codes[0, :, :1]), (w, codes[1, :, :12])])
            client.decode_batch([(a, codes[0, :, 1:26], {"final": True}), (w, codes[1, :, 12:24], {"final": True})])
            bad = client.open_stream("deploy-bad")
            with pytest.raises(cerr.InvalidArgument):
                bad.decode(codes[0, :, :3] + 1000)  # out of the codebook: a typed error, counted by code
            bad.abort()

    running.traffic = traffic
    traffic()
    yield running
    running.stop()
    shutil.rmtree(workdir, ignore_errors=True)


def test_dashboard_and_alert_metrics_exist_on_a_live_sidecar(live_sidecar):
    assert live_sidecar.http_status("/healthz") == 200  # the liveness probe
    assert live_sidecar.http_status("/readyz") == 200  # the image HEALTHCHECK, compose and k8s readiness
    exposition = live_sidecar.scrape()
    exposed = _exposed_names(exposition)
    assert len([n for n in exposed if n.startswith(METRIC_PREFIX)]) >= 20
    missing = {}
    for where, expr in _dashboard_exprs() + _alert_exprs():
        for name in _IDENT.findall(expr):
            if name not in exposed:
                missing.setdefault(name, []).append(where)
    assert missing == {}, "queried but not exposed by the sidecar: " + json.dumps(missing, indent=1)
    promtool = _tool("promtool", required=False)
    if promtool is not None:  # the exposition itself follows Prometheus' conventions
        result = _run([promtool, "check", "metrics"], input=exposition)
        assert result.returncode == 0, result.stdout + result.stderr


def test_image_and_compose_healthchecks_work_against_a_live_sidecar(live_sidecar):
    """The Dockerfile HEALTHCHECK and compose's sidecar healthcheck, run as written against a real sidecar:
    exit 0 when /readyz is 200, non-zero when nothing answers."""
    port = urllib.parse.urlsplit(live_sidecar.metrics_url).port
    (health,) = [a for k, a in _dockerfile_stages()[-1]["instructions"] if k == "HEALTHCHECK"]
    image_cmd = json.loads(health.split(" CMD ", 1)[1])
    compose_cmd = _compose()["services"]["code2wav-sidecar"]["healthcheck"]["test"][1:]  # after "CMD"
    for cmd in (image_cmd, compose_cmd):
        assert cmd[0] == "python"
        cmd = [sys.executable, *cmd[1:]]
        for answering, expect_ok in ((port, True), (_free_port(), False)):
            env = {**os.environ, "CODE2WAV_METRICS_PORT": str(answering)}
            argv = [a.replace(":9464/", f":{answering}/") for a in cmd]
            result = _run(argv, env=env)
            assert (result.returncode == 0) == expect_ok, (argv, result.stderr)


def test_prometheus_scrapes_a_live_sidecar_and_every_dashboard_query_runs(live_sidecar, tmp_path):
    """The compose stack in miniature: the real Prometheus (Debian's build) scrapes a real sidecar and each
    dashboard query runs against it; the panels that traffic must fill are not empty."""
    prometheus = _tool("prometheus", required=False)
    if prometheus is None:
        pytest.skip(f"prometheus binary not found (Debian's prometheus package): {INSTALL_HINT}")
    target = urllib.parse.urlsplit(live_sidecar.metrics_url).netloc
    cfg = _load_yaml(PROMETHEUS_DIR / "prometheus.yml")
    cfg["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    cfg["rule_files"] = [str(PROMETHEUS_DIR / f) for f in cfg.get("rule_files", [])]
    cfg["scrape_configs"] = [{"job_name": "code2wav-sidecar", "static_configs": [{"targets": [target]}]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "prometheus.log", "w")
    proc = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)

    def api(path: str, **params) -> dict:
        url = f"{base}{path}?{urllib.parse.urlencode(params)}" if params else f"{base}{path}"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.loads(resp.read())

    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if api("/api/v1/query", query='up{job="code2wav-sidecar"}')["data"]["result"]:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "prometheus.log").read_text()
            time.sleep(0.3)
        live_sidecar.traffic()  # between scrapes, so rate() sees it
        moved = (f"sum(rate({METRIC_PREFIX}audio_seconds_total[1m])) > 0 "
                 f"and sum(rate({METRIC_PREFIX}errors_total[1m])) > 0")
        deadline = time.monotonic() + 30
        while not (api("/api/v1/query", query=moved)["data"]["result"]
                   and all(r["health"] != "unknown" for g in api("/api/v1/rules")["data"]["groups"]
                           for r in g["rules"])):
            assert time.monotonic() < deadline, "Prometheus never saw the traffic"
            time.sleep(0.3)
        results = {}
        for where, expr in _dashboard_exprs():
            reply = api("/api/v1/query", query=_as_promql(expr, rate_interval="1m"))
            assert reply["status"] == "success", (where, reply)
            results[where] = reply["data"]["result"]
        rules = api("/api/v1/rules")["data"]["groups"]
        assert sum(len(g["rules"]) for g in rules) == len(_alert_exprs())
        assert all(r["health"] == "ok" for g in rules for r in g["rules"]), rules
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        log.close()

    def values(title_part: str) -> list[float]:
        out = []
        for where, result in results.items():
            if title_part in where:
                out += [float(r["value"][1]) for r in result]
        return out

    assert values("'Ready'") == [1.0]
    assert any(v > 0 for v in values("'Throughput (audio seconds per second)'"))
    assert any(v > 0 for v in values("'Chunk latency quantiles'"))
    assert any(v >= 1 for v in values("'Batch size'"))
    assert any(v > 0 for v in values("'Errors by code'"))
    # (the CUDA graph panels stay empty on CPU: no graphs, no misses counted)
    assert values("'Active streams and clients'")
    assert any(v > 0 for v in values("'Graph memory'"))  # the state arena
    assert [r["metric"]["code"] for where, res in results.items() if "'Errors by code'" in where
            for r in res if float(r["value"][1]) > 0] == ["invalid_argument"]  # every code exists, at 0
