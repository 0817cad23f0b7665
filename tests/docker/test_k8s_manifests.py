"""Kubernetes manifests (docker/k8s): every rendered object valid against the Kubernetes schemas, and each
one agreeing with the server it runs: container args parsed by `neuronmm serve`'s own parser, the config
from the ConfigMap loaded by the server's loader, probe paths and ports, the grace period against
server.shutdown_grace_s, the autoscaling metric against what /metrics exports.

CI has no kubectl: it checks the committed renders (docker/k8s/rendered/*.yaml) and the base files. Where
kubectl exists, `kubectl kustomize` re-renders each overlay and must equal the committed file.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from server.api.app import create_app
from server.api.metrics import ServerMetrics
from server.api.shutdown import _FINAL_TIMEOUT_S
from server.cli import build_parser, serve_overrides
from server.config import load_config
from server.runtime import kv_pool_blocks

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "docker" / "k8s"
OVERLAYS = ("cpu", "trn1")
KUBECTL = shutil.which("kubectl")
# The oldest Kubernetes these manifests claim (PDB unhealthyPodEvictionPolicy is on by default from 1.27)
# and the newest schema kubernetes-validate ships.
VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
API_KEY = "sk-k8s-test-" + "5e" * 12


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _render(overlay: str) -> list[dict]:
    return _docs(K8S / "rendered" / f"{overlay}.yaml")


def _one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} objects"
    return found[0]


def _container(docs: list[dict]) -> dict:
    (container,) = _one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def _key(doc: dict) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


@pytest.fixture(params=OVERLAYS)
def overlay(request) -> str:
    return request.param


def _served(overlay: str, tmp_path: Path, monkeypatch) -> tuple[list[dict], dict, object, object]:
    """(rendered docs, container, parsed serve args, the Config the server would run) for one overlay."""
    docs = _render(overlay)
    container = _container(docs)
    env = {e["name"]: e for e in container["env"]}
    assert env["NEURONMM_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "neuronmm-api-key"
    monkeypatch.setenv("NEURONMM_API_KEY", API_KEY)  # what the kubelet sets from the Secret
    args = build_parser().parse_args(["serve", *container["args"]])
    # The config file the args name is the ConfigMap's key, mounted at the volume's mountPath.
    spec = _one(docs, "Deployment")["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    (config_volume,) = [v for v in spec["volumes"] if "configMap" in v]
    configmap = _one(docs, "ConfigMap")
    assert config_volume["configMap"]["name"] == configmap["metadata"]["name"]
    mount_dir, _, key = args.config.rpartition("/")
    assert mount_dir == mounts[config_volume["name"]] and key in configmap["data"]
    config_file = tmp_path / key
    config_file.write_text(configmap["data"][key])
    path, overrides = serve_overrides(args)
    assert path == args.config
    return docs, container, args, load_config(config_file, overrides)


@pytest.fixture
def served(overlay, tmp_path, monkeypatch):
    return _served(overlay, tmp_path, monkeypatch)


# ---- rendering and schemas ----------------------------------------------------------------------

def _kustomize_major() -> int | None:
    """The major version of the kustomize inside kubectl (printed by kubectl >= 1.24), None without kubectl."""
    if KUBECTL is None:
        return None
    out = subprocess.run([KUBECTL, "version", "--client"], capture_output=True, text=True, timeout=60).stdout
    found = re.search(r"Kustomize Version: v(\d+)", out)
    return int(found.group(1)) if found else 2  # kubectl <= 1.20 embeds kustomize v2.0.3, and says nothing


def test_committed_render_is_what_kustomize_builds(overlay):
    major = _kustomize_major()
    if major is None:
        pytest.skip("kubectl not installed; CI checks the committed renders instead")
    if major < 4:  # e.g. Debian bookworm's kubernetes-client 1.20: `labels:` and `patches:` are unknown to it
        pytest.skip(f"kubectl's kustomize is v{major}; the overlays need v4+ (kubectl >= 1.21)")
    proc = subprocess.run([KUBECTL, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    fresh = sorted((d for d in yaml.safe_load_all(proc.stdout) if d), key=_key)
    assert fresh == sorted(_render(overlay), key=_key), (
        f"docker/k8s/rendered/{overlay}.yaml is stale: kubectl kustomize docker/k8s/overlays/{overlay}")


@pytest.mark.parametrize("version", VERSIONS)
def test_every_rendered_object_validates(overlay, version):
    docs = _render(overlay)
    kinds = sorted(d["kind"] for d in docs)
    shared = ["PersistentVolumeClaim"] if overlay == "trn1" else []  # CPU replicas need no shared volume
    assert kinds == sorted(["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "Ingress",
                            "PodDisruptionBudget", "Service", *shared])
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("name", ["base/deployment", "base/service", "base/ingress", "base/pdb", "base/hpa",
                                  "base/secret.example", "overlays/trn1/pvc"])
def test_base_files_validate_alone(name):
    (doc,) = _docs(K8S / f"{name}.yaml")
    kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)


@pytest.mark.parametrize("mutate", [
    lambda d: d["spec"].__setitem__("replicas", "two"),
    lambda d: d["spec"]["template"]["spec"].__setitem__("terminationGracePeriod", 30),  # misspelt field
    lambda d: d["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["httpGet"].pop("port"),
])
def test_the_validator_rejects_a_broken_deployment(mutate):
    deployment = copy.deepcopy(_one(_render("cpu"), "Deployment"))
    mutate(deployment)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[-1], strict=True)


# ---- agreement with the server -----------------------------------------------------------------

def test_args_and_config_are_what_the_server_accepts(overlay, served):
    docs, container, args, cfg = served
    assert args.command == "serve" and cfg.server.host == "0.0.0.0"
    assert cfg.server.api_key == API_KEY  # from the Secret's env var, not the config file
    assert cfg.backend == {"cpu": "torch", "trn1": "neuron"}[overlay]
    (port,) = container["ports"]
    assert port["name"] == "http" and cfg.server.port == port["containerPort"]
    pod = _one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert pod["prometheus.io/port"] == str(cfg.server.port) and pod["prometheus.io/path"] == "/metrics"


def test_probes_hit_health_on_the_server_port_without_the_key(served):
    _, container, _, cfg = served
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    # The app as configured (API key set), before its model loads: /health answers 503 "loading" rather
    # than 401, so the kubelet's key-less probes see the truth; /metrics is open to Prometheus' scrape.
    client = TestClient(create_app(cfg))  # no `with`: the lifespan (model load) never starts
    health = client.get("/health")
    assert health.status_code == 503 and health.json() == {"status": "loading"}
    assert client.get("/metrics").status_code == 200
    assert client.post("/v1/completions", json={}).status_code == 401


def test_grace_period_covers_prestop_and_the_drain(served):
    docs, container, _, cfg = served
    spec = _one(docs, "Deployment")["spec"]["template"]["spec"]
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop_s = float(command[1])
    grace = cfg.server.shutdown_grace_s
    # The kubelet's countdown starts before preStop; SIGKILL must not land inside the server's drain.
    assert spec["terminationGracePeriodSeconds"] > pre_stop_s + grace + _FINAL_TIMEOUT_S
    # Liveness never cuts a drain short (/health is 503 while draining), even if it were probed then.
    live = container["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > grace
    # Readiness drops a draining replica within seconds.
    ready = container["readinessProbe"]
    assert ready["periodSeconds"] * ready["failureThreshold"] <= 15


# SmolLM2-135M-Instruct's cache per token in fp32 (K and V, 30 layers, 3 KV heads of 64), the widest `dtype: auto`
# picks on a CPU (one without native bf16); and what a CPU replica holds beside its pool: an fp32 model served with a
# 1.5 GiB pool measured 3,349 MiB resident (API process 400, engine core 2,935, its pool 1,536 included), 11-27.
_FP32_KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4
_FP32_REPLICA_BESIDE_POOL = 1813 << 20


def test_the_cpu_replicas_kv_pool_fits_its_memory_limit(tmp_path, monkeypatch):
    """The pool is committed at start-up, so the limit must hold all of it beside the fp32 model from the start."""
    docs, container, _, cfg = _served("cpu", tmp_path, monkeypatch)
    limit = container["resources"]["limits"]["memory"]
    assert limit.endswith("Gi")
    e = cfg.engine
    pool = kv_pool_blocks(e, _FP32_KV_BYTES_PER_TOKEN) * e.block_size * _FP32_KV_BYTES_PER_TOKEN
    assert pool + _FP32_REPLICA_BESIDE_POOL <= float(limit[:-2]) * 2**30
    # the pool still holds max_num_seqs sequences of a quarter of max_model_len each, in fp32
    assert pool >= e.max_num_seqs * e.max_model_len // 4 * _FP32_KV_BYTES_PER_TOKEN


def test_startup_budget_covers_the_image_start_period(overlay, served):
    """The startup probe allows at least the start period the Dockerfile's HEALTHCHECK allows."""
    _, container, _, _ = served
    dockerfile = ROOT / "docker" / {"cpu": "Dockerfile.cpu", "trn1": "Dockerfile.neuron"}[overlay]
    start_period = int(re.search(r"--start-period=(\d+)s", dockerfile.read_text()).group(1))
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= max(start_period, 300)


def test_cpu_runs_as_the_image_user():
    docs = _render("cpu")
    security = _one(docs, "Deployment")["spec"]["template"]["spec"]["securityContext"]
    user = int(re.search(r"^USER (\d+)$", (ROOT / "docker" / "Dockerfile.cpu").read_text(), re.M).group(1))
    assert security["runAsNonRoot"] is True and security["runAsUser"] == user
    container = _container(docs)
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    assert "aws.amazon.com/neuron" not in container["resources"]["limits"]


def test_trn1_gets_one_whole_device_for_tp_degree_2(tmp_path, monkeypatch):
    docs, container, _, cfg = _served("trn1", tmp_path, monkeypatch)
    resources = container["resources"]
    # aws.amazon.com/neuron = whole devices; trn1 has 2 NeuronCores per device = the config's tp_degree.
    assert resources["limits"]["aws.amazon.com/neuron"] == resources["requests"]["aws.amazon.com/neuron"] == 1
    assert cfg.neuron.tp_degree == 2 and not any("neuroncore" in k for k in resources["limits"])
    spec = _one(docs, "Deployment")["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"node.kubernetes.io/instance-type": "trn1.2xlarge"}
    assert {"key": "aws.amazon.com/neuron", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert "privileged" not in container["securityContext"]
    # What is expensive to rebuild lives on the shared claim mounted at /data.
    data = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["data"]
    for path in (cfg.neuron.compile_cache, cfg.model.compressed, cfg.cache_dir):
        assert path.startswith(data + "/"), path
    pvc = _one(docs, "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"] and pvc["spec"]["storageClassName"] == "efs-sc"


def test_selectors_and_references_line_up(overlay):
    docs = _render(overlay)
    deployment = _one(docs, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    service = _one(docs, "Service")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert _one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    backend = _one(docs, "Ingress")["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == service["metadata"]["name"]
    assert backend["port"]["name"] in {p["name"] for p in service["spec"]["ports"]}
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    target = _one(docs, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    if overlay == "trn1":  # exactly one source a volume: the patch must have replaced the base's scratch folder
        assert volumes["data"] == {"name": "data", "persistentVolumeClaim": {
            "claimName": _one(docs, "PersistentVolumeClaim")["metadata"]["name"]}}
    else:  # any cluster: nothing that waits on a storage class
        assert volumes["data"] == {"name": "data", "emptyDir": {}}
        assert not any(d["kind"] == "PersistentVolumeClaim" for d in docs)
    secret = _docs(K8S / "base" / "secret.example.yaml")[0]
    ref = {e["name"]: e for e in _container(docs)["env"]}["NEURONMM_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
    assert not any(d["kind"] == "Secret" for d in docs), "a Secret with a committed key in the render"


# ---- autoscaling and routing ---------------------------------------------------------------------

def _adapter_rule() -> dict:
    (rule,) = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())["rules"]["custom"]
    return rule


def test_autoscaling_metric_is_a_gauge_the_server_exports(overlay):
    rule = _adapter_rule()
    series = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)\{", rule["seriesQuery"]).group(1)
    assert re.fullmatch(rule["name"]["matches"], series)
    exported = {f.name: f.type for f in text_string_to_metric_families(ServerMetrics("m").render().decode())}
    assert exported.get(series) == "gauge", f"{series} is not a gauge on /metrics: {sorted(exported)}"
    assert "waiting" in series  # queue depth, not CPU
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    assert "<<.Series>>{<<.LabelMatchers>>}" in rule["metricsQuery"]
    hpa = _one(_render(overlay), "HorizontalPodAutoscaler")["spec"]
    (metric,) = hpa["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == rule["name"]["as"]
    assert hpa["minReplicas"] >= 2  # a rolling restart or a node drain keeps a replica serving


def test_ingress_retries_what_the_loopback_nginx_retries():
    """The Ingress annotations and the nginx config the rolling-restart test runs carry the same retry rules."""
    annotations = _one(_render("cpu"), "Ingress")["metadata"]["annotations"]
    conf = (K8S / "loopback" / "nginx.conf").read_text()

    def directive(name: str) -> str:
        return re.search(rf"^\s*{name} ([^;]+);", conf, re.M).group(1)

    prefix = "nginx.ingress.kubernetes.io/"
    assert annotations[prefix + "proxy-next-upstream"] == directive("proxy_next_upstream")
    assert {"http_503", "non_idempotent", "error"} <= set(directive("proxy_next_upstream").split())
    assert annotations[prefix + "proxy-next-upstream-tries"] == directive("proxy_next_upstream_tries")
    assert annotations[prefix + "proxy-next-upstream-timeout"] + "s" == directive("proxy_next_upstream_timeout")
    assert annotations[prefix + "proxy-buffering"] == directive("proxy_buffering") == "off"
