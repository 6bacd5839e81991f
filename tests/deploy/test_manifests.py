"""The Kubernetes manifests: every overlay renders with kustomize, every resource is valid against
the Kubernetes schemas, checkov finds nothing (each exception is justified inline), and the parts
that must agree with each other and with the server do."""

from __future__ import annotations

import json
import re
import subprocess

import kubernetes_validate
import pytest
import yaml
from deploy_helpers import KUBERNETES_DIR, OVERLAYS, REPO_ROOT, checkov_binary, documents, find, render

# Custom resources whose schemas ship with their operators, not with Kubernetes: checked by hand below
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("keda.sh/v1alpha1", "ScaledObject")}
KUBERNETES_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {overlay: documents(render(overlay)) for overlay in OVERLAYS}


def test_the_overlays_are_cpu_gpu_and_keda():
    assert OVERLAYS == ["cpu", "cpu-keda", "gpu"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_resource_of_every_overlay_is_valid(rendered, version):
    for overlay, docs in rendered.items():
        kinds = {d["kind"] for d in docs}
        assert {
            "Deployment",
            "Service",
            "PersistentVolumeClaim",
            "PodDisruptionBudget",
            "ServiceMonitor",
            "NetworkPolicy",
            "ConfigMap",
        } <= kinds, overlay
        for doc in docs:
            if (doc["apiVersion"], doc["kind"]) in CUSTOM_KINDS:
                continue
            kubernetes_validate.validate(doc, version, strict=True)  # raises on any schema error


def test_custom_resources_have_the_fields_their_operators_need(rendered):
    monitor = find(rendered["cpu"], "ServiceMonitor", "llmctl")
    assert monitor["spec"]["endpoints"] == [
        {"port": "http", "path": "/metrics", "interval": "15s", "scrapeTimeout": "10s"}
    ]
    scaled = find(rendered["cpu-keda"], "ScaledObject", "llmctl")
    assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llmctl"}
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert set(trigger["metadata"]) == {"serverAddress", "query", "threshold"}


def test_checkov_finds_no_failed_check_and_every_skip_says_why(rendered, tmp_path):
    targets = []
    for overlay in OVERLAYS:
        target = tmp_path / f"{overlay}.yaml"
        target.write_text(render(overlay))
        targets += ["-f", str(target)]
    result = subprocess.run(
        [
            str(checkov_binary()),
            *targets,
            "-f",
            str(REPO_ROOT / "Dockerfile"),
            "--framework",
            "kubernetes",
            "dockerfile",
            "--skip-download",
            "--output",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    reports = json.loads(result.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    assert {r["check_type"] for r in reports} == {"kubernetes", "dockerfile"}
    for report in reports:
        failed = [(c["check_id"], c["resource"], c["file_path"]) for c in report["results"]["failed_checks"]]
        assert not failed, failed
        assert report["summary"]["passed"] > 20
        for skipped in report["results"]["skipped_checks"]:
            result = skipped["check_result"]
            reason = (skipped.get("suppress_comment") or result.get("suppress_comment") or "").strip()
            assert len(reason) > 30, f"{skipped['check_id']} skipped without a reason"


def _server(docs: list[dict]) -> dict:
    return find(docs, "Deployment", "llmctl")["spec"]["template"]["spec"]


def test_grace_period_covers_prestop_then_the_servers_drain(rendered):
    """Kubernetes counts the preStop hook inside the grace period; SIGTERM comes after it, and the
    server then takes up to --drain-timeout for requests in flight, plus a moment to stop."""
    for overlay, docs in rendered.items():
        pod = _server(docs)
        (container,) = pod["containers"]
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep", overlay
        config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("llmctl-config"))
        drain = float(config["data"]["LLMCTL_DRAIN_TIMEOUT"])
        assert pod["terminationGracePeriodSeconds"] >= float(command[1]) + drain + 10, overlay
        assert {"configMapRef": {"name": config["metadata"]["name"]}} in container["envFrom"]


def test_probes_use_health_and_the_startup_probe_allows_for_model_loading(rendered):
    pod = _server(rendered["cpu"])
    (container,) = pod["containers"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    assert container["resources"]["requests"] == container["resources"]["limits"]  # Guaranteed QoS


def test_hpa_asks_for_the_metric_the_adapter_rule_serves_and_keda_matches_it(rendered):
    hpa = find(rendered["cpu"], "HorizontalPodAutoscaler", "llmctl")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    values = yaml.safe_load((KUBERNETES_DIR / "prometheus-adapter" / "values.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    series = re.match(r"([a-z_:]+)\{", rule["seriesQuery"]).group(1)
    assert series == "llmctl:num_requests_waiting"
    assert "num_requests_waiting" in (REPO_ROOT / "llmctl" / "server" / "metrics.py").read_text()
    served = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
    assert served == metric["pods"]["metric"]["name"]
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}

    keda = rendered["cpu-keda"]
    assert not [d for d in keda if d["kind"] == "HorizontalPodAutoscaler"]  # KEDA brings its own
    scaled = find(keda, "ScaledObject", "llmctl")
    assert scaled["spec"]["triggers"][0]["metadata"]["threshold"] == metric["pods"]["target"]["averageValue"]
    assert "llmctl:num_requests_waiting" in scaled["spec"]["triggers"][0]["metadata"]["query"]
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (
        hpa["spec"]["minReplicas"],
        hpa["spec"]["maxReplicas"],
    )


def test_router_discovers_the_headless_service_of_the_server_pods(rendered):
    docs = rendered["cpu"]
    headless = find(docs, "Service", "llmctl-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"] == find(docs, "Deployment", "llmctl")["spec"]["template"]["metadata"]["labels"]
    router = find(docs, "Deployment", "llmctl-router")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in router["env"]}
    host, port = env["LLMCTL_ROUTER_DISCOVER"].split(":")
    assert host == "llmctl-headless" and int(port) == headless["spec"]["ports"][0]["port"]
    assert router["args"] == ["router"] and router["readinessProbe"]["httpGet"]["path"] == "/health"


def test_api_key_comes_from_a_secret_file_that_is_not_committed(rendered):
    for overlay, docs in rendered.items():
        assert not [d for d in docs if d["kind"] == "Secret"], overlay
        for name in ("llmctl", "llmctl-router"):
            pod = find(docs, "Deployment", name)["spec"]["template"]["spec"]
            volumes = {v["name"]: v for v in pod["volumes"]}
            assert volumes["api-key"]["secret"]["secretName"] == "llmctl-api-key"
            env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
            mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "api-key")
            assert env["LLMCTL_API_KEY_FILE"] == f"{mount['mountPath']}/api-key"


def test_gpu_overlay_asks_for_a_gpu_and_the_cuda_image(rendered):
    pod = _server(rendered["gpu"])
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["image"].endswith("-cuda")
    config = next(d for d in rendered["gpu"] if d["kind"] == "ConfigMap")
    assert config["data"]["LLMCTL_DEVICE"] == "cuda"
    assert _server(rendered["cpu"])["containers"][0]["image"].endswith("-cpu")


def test_model_cache_is_a_shared_volume_mounted_where_the_image_keeps_it(rendered):
    docs = rendered["cpu"]
    claim = find(docs, "PersistentVolumeClaim", "llmctl-cache")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    pod = _server(docs)
    assert {"name": "cache", "persistentVolumeClaim": {"claimName": "llmctl-cache"}} in pod["volumes"]
    for container in pod["containers"] + pod["initContainers"]:
        assert {"name": "cache", "mountPath": "/cache"} in container["volumeMounts"]
    assert "HF_HOME=/cache/huggingface" in (REPO_ROOT / "Dockerfile").read_text()
