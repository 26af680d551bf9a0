"""The decoder-pool layouts (``deploy/k8s/pool/``, ``deploy/compose.pool.yaml``), checked without a cluster or a
Docker engine: their schemas are ``test_deploy.py``'s (kubernetes-validate --strict, the Compose Specification);
here, the wiring between the parts: the sidecars' config loads with the server's own loader and binds the port
the headless Service and the NetworkPolicy name, the keys come from Secrets mounted where the config and the
runners' environment point, only runner pods are admitted, the runners' address is the pool's DNS name (or, in
compose, both sidecars), and the readiness probe takes a draining sidecar out of the DNS records."""

from __future__ import annotations

from pathlib import Path

import yaml

from code2wav.client.discovery import parse_pool_address
from test_deploy import DEPLOY, K8S, _env_example, _interpolate, _k8s_docs, _load_yaml

POOL = K8S / "pool"


def _pool_docs() -> dict[tuple[str, str], dict]:
    docs = {(d["kind"], d["metadata"]["name"]): d for path, d in _k8s_docs() if path.parent == POOL}
    assert len(docs) == len([d for path, d in _k8s_docs() if path.parent == POOL]), "one name per kind"
    return docs


def _mount_dir(container: dict, volumes: list[dict], file_path: str) -> dict:
    """The volume (its spec) mounted at the folder holding ``file_path``."""
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(Path(file_path).parent)]
    return next(v for v in volumes if v["name"] == mount["name"])


def test_kubernetes_decoder_pool_wiring(tmp_path):
    from code2wav.sidecar.config import load_config

    docs = _pool_docs()
    decoders = docs[("Deployment", "code2wav-decoders")]
    pod = decoders["spec"]["template"]
    (sidecar,) = pod["spec"]["containers"]
    volumes = pod["spec"]["volumes"]
    assert sidecar["resources"]["limits"]["nvidia.com/gpu"] == 1  # one sidecar per GPU
    # the config the sidecar reads (the image's entrypoint: --config /etc/code2wav/sidecar.yaml) loads
    (config_mount,) = [m for m in sidecar["volumeMounts"] if m["mountPath"] == "/etc/code2wav/sidecar.yaml"]
    config_volume = next(v for v in volumes if v["name"] == config_mount["name"])
    config_map = docs[("ConfigMap", config_volume["configMap"]["name"])]
    (tmp_path / "sidecar.yaml").write_text(config_map["data"][config_mount["subPath"]])
    cfg = load_config(tmp_path / "sidecar.yaml")
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert cfg.address == f"tcp://0.0.0.0:{ports['zmq']}" and cfg.metrics_port == ports["metrics"]
    assert cfg.metrics_host == "0.0.0.0"
    # CurveZMQ keys and the allow-list come from Secrets, mounted where the config looks
    sec = cfg.security
    assert _mount_dir(sidecar, volumes, sec.curve_secret_key_file)["secret"]["secretName"] == "code2wav-curve-server"
    allowed = [m for m in sidecar["volumeMounts"] if m["mountPath"] == sec.curve_allowed_clients_dir]
    assert next(v for v in volumes if v["name"] == allowed[0]["name"])["secret"]["secretName"]
    # a rolling update ends no stream: the drain grace lets the pools move every stream away, and the pod's grace
    # period covers it, the drain and the reply linger, with a margin; SIGTERM starts it (no preStop delays it)
    assert cfg.drain_grace_s >= 10
    assert pod["spec"]["terminationGracePeriodSeconds"] >= cfg.drain_grace_s + cfg.shutdown_timeout_s + 10
    assert "lifecycle" not in sidecar
    # probes: ready = not draining (out of the DNS records), alive = /healthz
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    # the headless Service selects the decoder pods and publishes only ready ones
    labels = pod["metadata"]["labels"]
    service = docs[("Service", "code2wav-decoders")]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is False
    assert service["spec"]["selector"].items() <= labels.items()
    zmq_port = next(p for p in service["spec"]["ports"] if p["targetPort"] == "zmq")
    # the NetworkPolicy: the ZeroMQ port only from pods that carry the runners' label
    policy = docs[("NetworkPolicy", "code2wav-decoders")]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    (zmq_rule,) = [rule for rule in policy["ingress"] if {"port": "zmq", "protocol": "TCP"} in rule["ports"]]
    (peer,) = zmq_rule["from"]
    assert set(peer) == {"podSelector"}
    runners = docs[("Deployment", "qwen3-tts-runners")]["spec"]["template"]
    assert peer["podSelector"]["matchLabels"].items() <= runners["metadata"]["labels"].items()
    assert not any(rule.get("from") in (None, []) for rule in policy["ingress"])  # nobody else
    # the runners: the pool's DNS name, the Curve keys of a mounted Secret
    (vllm,) = runners["spec"]["containers"]
    env = {e["name"]: e["value"] for e in vllm["env"]}
    address = parse_pool_address(env["CODE2WAV_SIDECAR_ADDRESS"])
    assert (address.name, address.port) == (service["metadata"]["name"], zmq_port["port"])
    for key in ("CODE2WAV_SIDECAR_CURVE_SERVER_KEY", "CODE2WAV_SIDECAR_CURVE_CLIENT_KEY_FILE"):
        assert _mount_dir(vllm, runners["spec"]["volumes"], env[key])["secret"]["secretName"] == "code2wav-curve-runner"
    text = (POOL / "decoders.yaml").read_text()
    for secret in ("code2wav-curve-server", "code2wav-curve-allowed", "code2wav-curve-runner"):
        assert f"kubectl create secret generic {secret}" in text, secret  # how to make each one is written down


def test_compose_pool_wiring():
    doc = _interpolate(_load_yaml(DEPLOY / "compose.pool.yaml"), _env_example())
    services = doc["services"]
    sidecars = {name: svc for name, svc in services.items() if name.startswith("code2wav-sidecar")}
    runners = {name: svc for name, svc in services.items() if name.startswith("vllm")}
    assert len(sidecars) == 2 and len(runners) == 2

    def gpu(svc: dict) -> str:
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        (device_id,) = device["device_ids"]
        return device_id

    assert sorted(gpu(svc) for svc in sidecars.values()) == ["0", "1"]  # one sidecar per GPU
    assert sorted(gpu(svc) for svc in runners.values()) == ["0", "1"]
    addresses = {svc["command"][svc["command"].index("--address") + 1]: gpu(svc) for svc in sidecars.values()}
    assert len(addresses) == 2
    for name, svc in runners.items():
        pool = parse_pool_address(svc["environment"]["CODE2WAV_SIDECAR_ADDRESS"])
        assert set(pool.addresses) == set(addresses), name  # given both
        assert set(sidecars) <= set(svc["depends_on"]), name
    for svc in (*sidecars.values(), *runners.values()):  # one socket folder, one uid, one PID/IPC namespace
        assert any(v.startswith("code2wav-socket:/run/code2wav") for v in svc["volumes"])
        assert svc["user"] == "10001:10001" and svc["ipc"] == svc["pid"] == "service:namespaces"
    for address in addresses:
        assert Path(address.removeprefix("ipc://")).parent == Path("/run/code2wav")  # the shared socket folder
    raw = yaml.safe_load((DEPLOY / "compose.pool.yaml").read_text())
    assert "x-sidecar" in raw and raw["services"]["code2wav-sidecar-gpu1"]["healthcheck"]["test"]
