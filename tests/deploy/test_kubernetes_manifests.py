"""configs/kubernetes/ on paper: every object validates against the Kubernetes API schemas of a pinned version
(kubernetes-validate, strict: an unknown or misspelt field fails), and the manifests agree with each other and
with Ember: selectors match the Ember pod labels, probes hit routes the app serves on the port it listens on, the
cache volume sits at the image's compile cache, the HPA scales the Deployment on the name the Prometheus adapter
gives `ember:num_requests_waiting`, smg's discovery flags find the pods, and the endpoint picker reads metric names
Ember exports. Nothing here talks to a cluster: none can run on these machines (docs/design.md §9)."""
from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "configs" / "kubernetes"
K8S_VERSION = "1.33.0"  # kubernetes-validate 1.37.0 ships the schemas of 1.25 to 1.37
# Custom resources: their schemas come with their CRDs (the Gateway API Inference Extension's InferencePool,
# the Gateway API's HTTPRoute), which kubernetes-validate does not have. They are parsed and cross-checked only.
CRDS = {("inference.networking.k8s.io/v1", "InferencePool"), ("gateway.networking.k8s.io/v1", "HTTPRoute")}
NAMESPACE = "ember"
Doc = dict[str, Any]


def load_all() -> list[tuple[str, Doc]]:
    docs = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


DOCS = load_all()


def find(kind: str, name: str) -> Doc:
    found = [d for _, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def embedded(doc: Doc, key: str) -> Doc:
    """A YAML file carried in a ConfigMap's data."""
    out: Doc = yaml.safe_load(doc["data"][key])
    return out


def flag_values(args: list[str], flag: str) -> list[str]:
    """The values after `flag` up to the next flag (`--flag=value` counts too)."""
    for i, a in enumerate(args):
        if a == flag:
            values = []
            for v in args[i + 1:]:
                if v.startswith("--"):
                    break
                values.append(v)
            return values
        if a.startswith(flag + "="):
            return [a.split("=", 1)[1]]
    raise AssertionError(f"{flag} not in {args}")


def ember_pod() -> tuple[Doc, Doc]:
    """(pod template metadata, the ember container) of the Ember Deployment."""
    template = find("Deployment", "ember")["spec"]["template"]
    (container,) = [c for c in template["spec"]["containers"] if c["name"] == "ember"]
    return template["metadata"], container


def port_number(container: Doc, port: int | str) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return int(number)


def exported_metric_names() -> set[str]:
    """The metric names server/api/metrics.py writes (read from its source: collecting needs an engine)."""
    return set(re.findall(r'"((?:ember|vllm):[a-z_]+)"', (ROOT / "server" / "api" / "metrics.py").read_text()))


@pytest.mark.parametrize(("filename", "doc"), DOCS, ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in DOCS])
def test_validates_against_the_pinned_kubernetes_schemas(filename: str, doc: Doc) -> None:
    assert {"apiVersion", "kind", "metadata"} <= set(doc) and doc["metadata"]["name"]
    if (doc["apiVersion"], doc["kind"]) in CRDS:
        assert isinstance(doc["spec"], dict)  # parsed; its schema lives in its CRD, not in kubernetes-validate
        return
    assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    if doc["kind"] != "Namespace":
        expected = "monitoring" if doc["metadata"]["name"] == "adapter-config" else NAMESPACE
        assert doc["metadata"].get("namespace") == expected, filename


def test_strict_validation_catches_a_misspelt_field() -> None:
    """The check above is only worth something if strict mode rejects what the API server would drop."""
    doc = copy.deepcopy(find("Deployment", "ember"))
    container = doc["spec"]["template"]["spec"]["containers"][0]
    container["readinessprobe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_ember_deployment_matches_the_image_and_the_app() -> None:
    from engine.config import EngineConfig
    from server.api.app import create_app
    from server.api.settings import ServerSettings

    routes = create_app(EngineConfig(), ServerSettings()).openapi()["paths"]  # builds no engine
    dockerfile = (ROOT / "Dockerfile").read_text()
    deployment = find("Deployment", "ember")
    meta, container = ember_pod()
    labels = meta["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert container["image"].split(":")[0] == "ember"  # `docker build -t ember .` (Dockerfile, README)
    (port,) = container["ports"]
    assert port["containerPort"] == 8000 and "EXPOSE 8000" in dockerfile
    assert "EMBER_PORT" not in {e["name"] for e in container.get("env", [])}
    assert meta["annotations"]["prometheus.io/port"] == str(port["containerPort"])
    assert meta["annotations"]["prometheus.io/path"] in routes
    probes = {k: container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes["readinessProbe"]["httpGet"]["path"] == "/health"
    for kind, probe in probes.items():
        assert "get" in routes[probe["httpGet"]["path"]], kind
        assert port_number(container, probe["httpGet"]["port"]) == 8000, kind
    cache_dir = re.search(r"EMBER_COMPILE_CACHE_DIR=(\S+)", dockerfile)
    assert cache_dir is not None
    (mount,) = container["volumeMounts"]
    assert mount["mountPath"] == cache_dir.group(1)
    assert mount["name"] in {v["name"] for v in deployment["spec"]["template"]["spec"]["volumes"]}
    env = {e["name"]: e["value"] for e in container["env"]}
    assert int(env["EMBER_NUM_THREADS"]) == int(container["resources"]["requests"]["cpu"])
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert float(env["EMBER_SHUTDOWN_GRACE_SECONDS"]) < grace  # the drain ends before the kubelet's SIGKILL


def test_ember_service_selects_the_pods_on_their_port() -> None:
    meta, container = ember_pod()
    service = find("Service", "ember")
    assert service["spec"]["selector"].items() <= meta["labels"].items()
    (port,) = service["spec"]["ports"]
    assert port_number(container, port["targetPort"]) == 8000


def test_hpa_scales_the_deployment_on_the_adapters_name_for_the_queue() -> None:
    hpa = find("HorizontalPodAutoscaler", "ember")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "Deployment", "ember")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    assert re.fullmatch(r"[a-z0-9][a-z0-9_.-]*", name), name  # a path segment: no ':'
    assert "ember:num_requests_waiting" in exported_metric_names()
    rules = embedded(find("ConfigMap", "adapter-config"), "config.yaml")["rules"]
    renamed = []
    for rule in rules:
        series = re.search(r'__name__=~"([^"]+)"', rule["seriesQuery"])
        assert series is not None
        if re.fullmatch(series.group(1), "ember:num_requests_waiting"):
            assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
            as_ = rule["name"]["as"].replace("${1}", r"\1")
            renamed.append(re.sub(rule["name"]["matches"], as_, "ember:num_requests_waiting"))
    assert renamed == [name]


def test_smg_discovers_the_ember_pods() -> None:
    meta, container = ember_pod()
    deployment = find("Deployment", "smg")
    (smg,) = deployment["spec"]["template"]["spec"]["containers"]
    args = smg["args"]
    assert "--service-discovery" in args
    selector = dict(kv.split("=", 1) for kv in flag_values(args, "--selector"))
    assert selector and selector.items() <= meta["labels"].items()
    assert int(flag_values(args, "--service-discovery-port")[0]) == port_number(container, "http")
    assert flag_values(args, "--service-discovery-namespace") == [NAMESPACE]
    # RBAC: the pod's service account may get/list/watch pods in that namespace
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    find("ServiceAccount", account)
    (binding,) = [d for _, d in DOCS if d["kind"] == "RoleBinding"
                  and {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE} in d["subjects"]]
    role = find("Role", binding["roleRef"]["name"])
    assert binding["roleRef"]["kind"] == "Role" and role["metadata"]["namespace"] == NAMESPACE
    assert any(r["apiGroups"] == [""] and "pods" in r["resources"] and {"get", "list", "watch"} <= set(r["verbs"])
               for r in role["rules"])
    service = find("Service", "smg")
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_smg_accepts_its_arguments() -> None:
    """With smg installed (the multi-replica tests' dependency), its own parser and validation take the args."""
    router_args = pytest.importorskip("smg.router_args")
    import argparse

    (smg,) = find("Deployment", "smg")["spec"]["template"]["spec"]["containers"]
    parser = argparse.ArgumentParser()
    router_args.RouterArgs.add_cli_args(parser, use_router_prefix=False)
    parsed = router_args.RouterArgs.from_cli_args(parser.parse_args(smg["args"]), use_router_prefix=False)
    parsed._validate_router_args()
    assert parsed.selected_discovery_provider() == "kubernetes"
    assert parsed.selector == {"app.kubernetes.io/name": "ember", "app.kubernetes.io/component": "worker"}
    assert parsed.service_discovery_port == 8000 and parsed.policy == "cache_aware"


# EPP v1.5.0's strictly decoded config (apix/config/v1alpha1/endpointpickerconfig_types.go) and the
# core-metrics-extractor's engine entry (pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go).
EPP_CONFIG_KEYS = {"apiVersion", "kind", "featureGates", "plugins", "schedulingProfiles", "saturationDetector",
                   "dataLayer", "flowControl", "parser"}
EPP_ENGINE_KEYS = {"name", "queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec", "cacheInfoSpec",
                   "cacheBlockSizeLabelName", "cacheNumBlocksLabelName", "cacheBlockSizeSpec", "cacheNumBlocksSpec"}
EPP_REJECTED_FLAGS = ("--total-queued-requests-metric", "--total-running-requests-metric",
                      "--kv-cache-usage-percentage-metric", "--lora-info-metric", "--cache-info-metric")


def test_endpoint_picker_reads_embers_metrics_from_the_ember_pods() -> None:
    meta, container = ember_pod()
    pool = find("InferencePool", "ember")
    assert pool["spec"]["selector"]["matchLabels"].items() <= meta["labels"].items()
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [port_number(container, "http")]
    deployment = find("Deployment", "ember-epp")
    (epp,) = deployment["spec"]["template"]["spec"]["containers"]
    args = epp["args"]
    assert flag_values(args, "--pool-name") == [pool["metadata"]["name"]]
    assert flag_values(args, "--pool-namespace") == [pool["metadata"]["namespace"]]
    assert not [a for a in args if a.split("=", 1)[0] in EPP_REJECTED_FLAGS]  # v1.4+ refuses to start with them
    # the picker's Service is the pool's endpointPickerRef, on the ext-proc port
    ref = pool["spec"]["endpointPickerRef"]
    service = find("Service", ref["name"])
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    (ext_proc,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert port_number(epp, ext_proc["targetPort"]) == 9002
    # the config file it is told to read is the ConfigMap's key, mounted where the flag says
    config_path = Path(flag_values(args, "--config-file")[0])
    (mount,) = epp["volumeMounts"]
    assert Path(mount["mountPath"]) == config_path.parent
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    config = embedded(find("ConfigMap", volume["configMap"]["name"]), config_path.name)
    assert set(config) <= EPP_CONFIG_KEYS and config["kind"] == "EndpointPickerConfig"
    plugins = {p["name"]: p for p in config["plugins"]}
    refs = [p["pluginRef"] for prof in config["schedulingProfiles"] for p in prof["plugins"]]
    refs += [ref for s in config["dataLayer"]["sources"] for ref in [s["pluginRef"]]
             + [e["pluginRef"] for e in s["extractors"]]]
    assert set(refs) <= set(plugins)
    (extractor,) = [p for p in plugins.values() if p["type"] == "core-metrics-extractor"]
    params = extractor["parameters"]
    engine_label = params.get("engineLabelKey", "inference.networking.k8s.io/engine-type")
    (engine,) = [e for e in params["engineConfigs"] if e["name"] == meta["labels"][engine_label]]
    assert params["defaultEngine"] == engine["name"] and set(engine) <= EPP_ENGINE_KEYS
    specs = {engine[k] for k in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec")}
    assert specs <= exported_metric_names(), specs - exported_metric_names()
    assert engine["loraSpec"] == engine["cacheInfoSpec"] == ""  # Ember exports neither
    route = find("HTTPRoute", "ember")
    (backend,) = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert (backend["kind"], backend["name"]) == ("InferencePool", pool["metadata"]["name"])
