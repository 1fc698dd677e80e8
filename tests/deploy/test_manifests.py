"""Invariants of every rendered overlay (issue 8), checked on the real kustomize output.

Schema validity is tests/deploy/test_render.py's job; these are the properties a schema cannot
see: probes on the ports that exist, a grace period longer than preStop + drain, the GPU
placement of the worker and its node-local governor, who may reach the cache.
"""
from __future__ import annotations

import importlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy import render as deploy_render
from services.common.config import parse_bytes
from services.common.server import DEFAULT_GRACE_SECONDS

OVERLAYS = deploy_render.overlays()
ROOT = Path(__file__).resolve().parents[2]
DRAIN_SECONDS = DEFAULT_GRACE_SECONDS  # the servers' drain after SIGTERM
WORKLOADS = {
    "worker": ("Deployment", "gpuplane-worker", 50071),
    "cache": ("StatefulSet", "gpuplane-cache", 50051),
    "governor": ("DaemonSet", "gpuplane-governor", 50061),
}
GPU = "nvidia.com/gpu"
Doc = dict[str, Any]


@pytest.fixture(params=OVERLAYS)
def docs(request, rendered) -> list[Doc]:
    return rendered[request.param]


def find(docs: list[Doc], kind: str, name: str | None = None) -> list[Doc]:
    """Objects of `kind` (and `name`, when given) in a rendered overlay."""
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[Doc], kind: str, name: str) -> Doc:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected exactly one {kind}/{name}, found {len(found)}"
    return found[0]


def workload(docs: list[Doc], component: str) -> Doc:
    kind, name, _ = WORKLOADS[component]
    return one(docs, kind, name)


def pod(docs: list[Doc], component: str) -> dict[str, Any]:
    return workload(docs, component)["spec"]["template"]


def container(docs: list[Doc], component: str) -> dict[str, Any]:
    (c,) = pod(docs, component)["spec"]["containers"]
    return c


def env(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c.get("env", [])}


def quantity(text: str) -> int:
    """A Kubernetes byte quantity ('4Gi', '500M') in bytes."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
             "k": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4}
    m = re.fullmatch(r"(\d+)([A-Za-z]*)", str(text))
    assert m and (m.group(2) in units or not m.group(2)), f"unparsable quantity {text!r}"
    return int(m.group(1)) * units.get(m.group(2), 1)


def config_map(docs: list[Doc], c: dict[str, Any]) -> dict[str, str]:
    """The data of the ConfigMap the container takes its environment from."""
    (ref,) = [s["configMapRef"]["name"] for s in c["envFrom"] if "configMapRef" in s]
    return one(docs, "ConfigMap", ref)["data"]


# --- placement -------------------------------------------------------------------------------


def test_the_worker_takes_a_whole_gpu_and_lands_only_on_gpu_nodes(docs):
    spec = pod(docs, "worker")["spec"]
    limits = container(docs, "worker")["resources"]["limits"]
    assert int(limits.get(GPU, 0)) == 1, "the worker drives exactly one GPU: nvidia.com/gpu: 1"
    assert spec["nodeSelector"].get("nvidia.com/gpu.present") == "true", "worker off GPU nodes"
    assert any(t["key"] == GPU and t["effect"] == "NoSchedule" for t in spec["tolerations"]), (
        "GPU nodes are tainted nvidia.com/gpu:NoSchedule; the worker must tolerate it"
    )


def test_every_worker_node_runs_a_governor_that_the_worker_reaches_on_its_own_node(docs):
    worker, governor = pod(docs, "worker")["spec"], pod(docs, "governor")["spec"]
    assert governor["nodeSelector"].items() <= worker["nodeSelector"].items(), (
        "the governor DaemonSet must select every node a worker can land on"
    )
    for t in worker["tolerations"]:
        assert t in governor["tolerations"], f"governor lacks the worker's toleration {t}"
    service = one(docs, "Service", "gpuplane-governor")
    assert service["spec"]["internalTrafficPolicy"] == "Local", (
        "a worker must talk to its own node's governor, never another node's ledger"
    )
    address = config_map(docs, container(docs, "worker"))["GPUPLANE_WORKER_GOVERNOR"]
    assert address == f"gpuplane-governor:{WORKLOADS['governor'][2]}", address


def test_only_the_worker_requests_gpus(docs):
    for component in ("cache", "governor"):
        resources = container(docs, component)["resources"]
        assert GPU not in resources.get("limits", {}) and GPU not in resources.get("requests", {}), (
            f"{component} would hold a GPU that no worker could then use"
        )


def test_the_worker_rollout_never_needs_a_spare_gpu(docs):
    rolling = workload(docs, "worker")["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxSurge"] == 0, "a surge pod waits forever for a GPU on a full cluster"


# --- the kernel cache's storage ---------------------------------------------------------------


def test_the_cache_is_one_writer_on_a_read_write_once_pod_volume(docs):
    sts = workload(docs, "cache")
    assert sts["spec"]["replicas"] == 1, "SQLite has one writer: the cache runs one replica"
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOncePod"], "a second pod could open the db"
    storage_class = claim["spec"].get("storageClassName") or ""
    assert not re.search(r"nfs|efs|filestore|azurefile|cephfs", storage_class), (
        f"SQLite must never sit on a network filesystem ({storage_class})"
    )
    mounts = {m["name"]: m["mountPath"] for m in container(docs, "cache")["volumeMounts"]}
    db = next(a for a in container(docs, "cache")["args"] if a.startswith("--db="))
    assert db.removeprefix("--db=").startswith(mounts[claim["metadata"]["name"]] + "/"), (
        "the SQLite file must live on the claimed volume"
    )


def test_the_cache_byte_budget_fits_twice_in_its_volume(docs):
    budget = parse_bytes(config_map(docs, container(docs, "cache"))["GPUPLANE_CACHE_BUDGET_BYTES"])
    (claim,) = workload(docs, "cache")["spec"]["volumeClaimTemplates"]
    size = quantity(claim["spec"]["resources"]["requests"]["storage"])
    assert 0 < budget and 2 * budget <= size, (
        f"budget {budget} needs room for WAL and vacuum in a {size}-byte volume"
    )


# --- every container --------------------------------------------------------------------------


ENV_PREFIX = {"worker": "WORKER", "cache": "CACHE", "governor": "GOVERNOR"}
TLS_MOUNT = "/etc/gpuplane/tls"


def security_env(docs: list[Doc], component: str) -> dict[str, str]:
    """The component's own security settings (GPUPLANE_<SERVICE>_TLS_*, _ROLES, _HEALTH_LISTEN)."""
    environment = container_environment(docs, container(docs, component))
    prefix = f"GPUPLANE_{ENV_PREFIX[component]}_"
    return {k[len(prefix):]: v for k, v in environment.items() if k.startswith(prefix) and
            k[len(prefix):].split("_")[0] in {"TLS", "ROLES", "HEALTH"}}


def probed_port(docs: list[Doc], component: str) -> int:
    """Where the kubelet can probe: the serving port in plaintext, else the health-only port."""
    listen = security_env(docs, component).get("HEALTH_LISTEN")
    return int(listen.rsplit(":", 1)[1]) if listen else WORKLOADS[component][2]


@pytest.mark.parametrize("component", sorted(WORKLOADS))
def test_every_container_has_grpc_health_probes_on_a_port_the_kubelet_can_probe(docs, component):
    c = container(docs, component)
    port, probed = WORKLOADS[component][2], probed_port(docs, component)
    assert {p["containerPort"] for p in c["ports"]} >= {port, probed, 9090}, \
        "grpc, health and metrics ports"
    assert any(a == f"--listen=0.0.0.0:{port}" for a in c["args"]), "serves on its grpc port"
    if "TLS_CERT" in security_env(docs, component):
        # The kubelet's native gRPC probe speaks plaintext only.
        assert probed != port, f"{component} serves TLS but has no plaintext health-only port"
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert c[probe]["grpc"]["port"] == probed, \
            f"{component} {probe} must be a native gRPC probe on port {probed}"


def test_the_worker_liveness_asks_the_health_port_for_liveness_and_readiness_for_the_service(docs):
    from gpu_worker.edge.servicer import LIVENESS_SERVICE

    c = container(docs, "worker")
    health = probed_port(docs, "worker")
    assert health != WORKLOADS["worker"][2], \
        "worker probes on the service port: a worker busy with streams would be restarted"
    for probe in ("livenessProbe", "startupProbe"):
        assert c[probe]["grpc"] == {"port": health, "service": LIVENESS_SERVICE}, \
            f"the worker's {probe} must ask the health port for {LIVENESS_SERVICE!r}"
    assert c["readinessProbe"]["grpc"].get("service", "") == "", \
        "readiness must ask the overall status (NOT_SERVING while the worker cannot take work)"


def test_the_worker_startup_probe_allows_minutes_of_warm_up(docs):
    probe = container(docs, "worker")["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 180, (
        "CUDA init + kernel prefetch must not be killed by liveness during warm-up"
    )


@pytest.mark.parametrize("component", sorted(WORKLOADS))
def test_every_container_has_requests_and_limits(docs, component):
    r = container(docs, component)["resources"]
    for key in ("cpu", "memory"):
        assert key in r["requests"] and key in r["limits"], f"{component} lacks {key} request/limit"
    assert quantity(r["requests"]["memory"]) == quantity(r["limits"]["memory"]), (
        f"{component}: memory request == limit, so node pressure never OOM-kills it first"
    )


@pytest.mark.parametrize("component", sorted(WORKLOADS))
def test_every_pod_runs_non_root_on_a_read_only_root_with_a_writable_tmp(docs, component):
    spec = pod(docs, component)["spec"]
    c = container(docs, component)
    assert spec["securityContext"]["runAsNonRoot"] is True, f"{component} may run as root"
    assert spec["securityContext"]["runAsUser"] > 0, "numeric non-zero uid"
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert spec["automountServiceAccountToken"] is False, "no pod here talks to the API server"
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"], "restricted Pod Security needs drop ALL"
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]], f"{component} needs a writable /tmp (emptyDir)"


@pytest.mark.parametrize("component", sorted(WORKLOADS))
def test_the_grace_period_outlasts_pre_stop_plus_drain(docs, component):
    spec = pod(docs, component)["spec"]
    command = container(docs, component)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep", "preStop is a pause so endpoints drop before SIGTERM"
    pause = int(command[1])
    assert pause > 0 and spec["terminationGracePeriodSeconds"] > pause + DRAIN_SECONDS, (
        f"{component}: SIGKILL would cut the {DRAIN_SECONDS} s drain short"
    )


@pytest.mark.parametrize("component", sorted(WORKLOADS))
def test_every_container_exports_traces_with_pod_and_node_from_the_downward_api(docs, component):
    c = container(docs, component)
    e = env(c)
    assert e["OTEL_SERVICE_NAME"]["value"] == f"gpuplane-{component}"
    assert e["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert e["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    attrs = dict(kv.split("=", 1) for kv in e["OTEL_RESOURCE_ATTRIBUTES"]["value"].split(","))
    assert attrs["k8s.pod.name"] == "$(POD_NAME)" and attrs["k8s.node.name"] == "$(NODE_NAME)"
    config = config_map(docs, c)
    assert config["OTEL_EXPORTER_OTLP_ENDPOINT"], "the OTLP endpoint comes from the ConfigMap"
    assert config["OTEL_TRACES_EXPORTER"] in {"otlp", "console", "none"}


@pytest.mark.parametrize("component", sorted(WORKLOADS))
def test_every_variable_reference_resolves_to_an_earlier_variable(docs, component):
    # The kubelet leaves an unknown $(VAR) as literal text: a typo becomes a bad flag value.
    c = container(docs, component)
    known = set(config_map(docs, c))
    for e in c.get("env", []):
        for ref in re.findall(r"\$\((\w+)\)", e.get("value", "")):
            assert ref in known, f"{component}: {e['name']} uses $({ref}) before it is defined"
        known.add(e["name"])
    for arg in c["args"]:
        for ref in re.findall(r"\$\((\w+)\)", arg):
            assert ref in known, f"{component}: argument {arg!r} uses undefined $({ref})"


CLI_MODULES = {"worker": "gpu_worker", "cache": "cache_service", "governor": "services.governor"}


def container_environment(docs: list[Doc], c: dict[str, Any]) -> dict[str, str]:
    """The environment the kubelet would give `c`: ConfigMap, then env in order, $(VAR) expanded;
    downward-API and Secret values stand in as placeholders."""
    environment = dict(config_map(docs, c))
    for e in c.get("env", []):
        if "value" in e:
            environment[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: environment[m.group(1)],
                                            e["value"])
        else:
            environment[e["name"]] = f"placeholder-{e['name'].lower()}"
    return environment


@pytest.mark.parametrize("component", sorted(WORKLOADS))
def test_every_container_s_arguments_and_environment_parse_with_its_service_cli(
        docs, component, monkeypatch):
    # The manifests and the services are written apart: a renamed flag or an env value that its
    # flag's type rejects would only show as a crash-looping pod. Parse them with the real CLI.
    c = container(docs, component)
    environment = container_environment(docs, c)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)  # env_flag reads defaults while the parser is built
    module = importlib.import_module(f"{CLI_MODULES[component]}.__main__")
    build = getattr(module, "build_parser", None) or module._parser
    argv = [re.sub(r"\$\((\w+)\)", lambda m: environment[m.group(1)], a) for a in c["args"]]
    try:
        args = build().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{component}: `python -m {CLI_MODULES[component]} {' '.join(argv)}` "
                    "is refused by the service's own CLI")
    assert args.listen == f"0.0.0.0:{WORKLOADS[component][2]}", f"{component} listens elsewhere"
    assert args.metrics_port == 9090, f"{component} serves metrics elsewhere"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=1.0)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _metrics_up(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1.0) as reply:
            return reply.status == 200
    except OSError:
        return False


@pytest.mark.parametrize("component", sorted(WORKLOADS))
def test_the_pod_command_serves_the_probed_health_and_metrics_then_drains_on_sigterm(
        rendered, component, tmp_path):
    # The prod pod's own args and environment, run here. Only what cannot exist on a CI machine
    # is swapped: loopback ports for the pod's ports, temp dirs for its volumes, the sim backend
    # (the CI test double) for cuda, no trace exporter (no collector here), and closed loopback
    # ports for the cluster's Services: a pod must come up before its peers are reachable.
    docs = rendered["prod"]
    c = container(docs, component)
    environment = container_environment(docs, c)
    environment["OTEL_TRACES_EXPORTER"] = "none"
    for peer in ("GPUPLANE_WORKER_GOVERNOR", "GPUPLANE_WORKER_CACHE"):
        environment[peer] = f"127.0.0.1:{_free_port()}"
    port, metrics, health = _free_port(), _free_port(), _free_port()
    prefix = f"GPUPLANE_{ENV_PREFIX[component]}_"
    if f"{prefix}HEALTH_LISTEN" in environment:
        environment[f"{prefix}HEALTH_LISTEN"] = f"127.0.0.1:{health}"
    else:
        health = port
    if any(v.startswith(TLS_MOUNT) for v in environment.values()):
        # The mounted certificate, made here: a pod whose TLS files do not load never serves.
        from tests.certs import CertificateAuthority

        ca = CertificateAuthority(tmp_path / "tls", "deploy")
        ca.issue("pod", uris=(f"spiffe://gpuplane/{component}",), cert_path=tmp_path / "tls" /
                 "tls.crt", key_path=tmp_path / "tls" / "tls.key")
        (tmp_path / "tls" / "ca.crt").write_bytes(ca.ca_file.read_bytes())
        environment = {k: v.replace(TLS_MOUNT, str(tmp_path / "tls"))
                       for k, v in environment.items()}
    argv = []
    for arg in c["args"]:
        arg = re.sub(r"\$\((\w+)\)", lambda m: environment[m.group(1)], arg)
        arg = arg.replace(f"0.0.0.0:{WORKLOADS[component][2]}", f"127.0.0.1:{port}")
        arg = arg.replace("--metrics-port=9090", f"--metrics-port={metrics}")
        arg = arg.replace("--backend=cuda", "--backend=sim")
        for mount in ("/data", "/cache"):
            arg = arg.replace(f"={mount}", f"={tmp_path}{mount}")
        argv.append(arg)
    (tmp_path / "data").mkdir()
    process = subprocess.Popen([sys.executable, "-m", CLI_MODULES[component], *argv],
                               env={**os.environ, **environment}, cwd=tmp_path,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (_serving(health) and _metrics_up(metrics)):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{component} never served health+metrics: {process.stderr.read()}")
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        grace = pod(docs, component)["spec"]["terminationGracePeriodSeconds"]
        assert process.wait(timeout=grace) == 0, f"{component} did not drain cleanly on SIGTERM"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("component", sorted(WORKLOADS))
def test_every_pod_is_scraped_by_prometheus_on_its_metrics_port(docs, component):
    annotations = pod(docs, component)["metadata"]["annotations"]
    ports = {p["name"]: p["containerPort"] for p in container(docs, component)["ports"]}
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == ports["metrics"]
    assert any(a == f"--metrics-port={ports['metrics']}" for a in container(docs, component)["args"])


# --- the write token ----------------------------------------------------------------------------


def test_the_write_token_reaches_only_the_cache_and_the_workers_from_one_secret(docs):
    refs: dict[str, set[tuple[str, str]]] = {}
    for component in WORKLOADS:
        for name, var in env(container(docs, component)).items():
            if name.endswith("CACHE_WRITE_TOKEN"):
                assert "value" not in var, f"{component}: {name} must come from a Secret"
                ref = var["valueFrom"]["secretKeyRef"]
                refs.setdefault(component, set()).add((ref["name"], ref["key"]))
    assert set(refs) == {"cache", "worker"}, f"token holders {sorted(refs)}: least privilege"
    assert len(refs["cache"] | refs["worker"]) == 1, "workers must hold the token the cache checks"
    worker_vars = {n for n in env(container(docs, "worker")) if n.endswith("CACHE_WRITE_TOKEN")}
    assert "GPUPLANE_WORKER_CACHE_WRITE_TOKEN" in worker_vars, "the worker CLI reads this one"
    assert "GPUPLANE_CACHE_WRITE_TOKEN" in env(container(docs, "cache")), "the cache reads this one"
    ((name, _),) = refs["cache"]
    if not find(docs, "Secret", name):
        docs_text = (ROOT / "docs" / "deploy.md").read_text()
        assert name == "gpuplane-cache-write-token" and name in docs_text, (
            "a Secret the overlay does not render must be documented in docs/deploy.md"
        )


# --- who may reach whom (NetworkPolicy, L4) ---------------------------------------------------


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert not selector.get("matchExpressions"), "extend this evaluator for matchExpressions"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def allowed(docs: list[Doc], src: tuple[str, dict[str, str]], dst: dict[str, str], port: int) -> bool:
    """Whether a pod (namespace, labels) may open `port` on a pod with labels `dst`, per the
    rendered NetworkPolicies (ingress only; the semantics of the networking.k8s.io/v1 API)."""
    namespace = next(d["metadata"]["namespace"] for d in docs if d["kind"] == "Deployment")
    src_ns, src_labels = src
    ns_labels = {"kubernetes.io/metadata.name": src_ns}
    policies = [p for p in find(docs, "NetworkPolicy") if _selects(p["spec"]["podSelector"], dst)
                and "Ingress" in p["spec"]["policyTypes"]]
    if not policies:
        return True
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            if rule.get("ports") and not any(p["port"] == port for p in rule["ports"]):
                continue
            for peer in rule.get("from", [{}]):
                ns_ok = (_selects(peer["namespaceSelector"], ns_labels) if "namespaceSelector" in peer
                         else src_ns == namespace)
                pod_ok = _selects(peer.get("podSelector", {}), src_labels)
                if ns_ok and pod_ok:
                    return True
    return False


def labels_of(docs: list[Doc], component: str) -> dict[str, str]:
    return pod(docs, component)["metadata"]["labels"]


def test_only_workers_can_reach_the_cache_and_the_governor(docs):
    ns = one(docs, "Deployment", "gpuplane-worker")["metadata"]["namespace"]
    worker, cache, governor = (labels_of(docs, c) for c in ("worker", "cache", "governor"))
    assert allowed(docs, (ns, worker), cache, 50051), "workers must reach the cache"
    assert allowed(docs, (ns, worker), governor, 50061), "workers must reach their governor"
    for name, src in {"governor": (ns, governor), "cache": (ns, cache),
                      "another pod": (ns, {"app": "other"}),
                      "another namespace's worker-looking pod": ("default", worker)}.items():
        assert not allowed(docs, src, cache, 50051), f"{name} can reach the cache"
        assert not allowed(docs, src, governor, 50061), f"{name} can reach the governor"
    assert allowed(docs, ("monitoring", {}), cache, 9090), "Prometheus must scrape the cache"
    assert not allowed(docs, ("monitoring", {}), cache, 50051), "monitoring may not use the cache"
    assert allowed(docs, ("frontend", {}), worker, 50071), "clients reach the worker API"


def test_the_policy_evaluator_allows_what_no_policy_selects(docs):
    # Negative control for the test above: without the policies the same traffic is allowed,
    # so its refusals come from the rendered NetworkPolicies, not from the evaluator.
    ns = one(docs, "Deployment", "gpuplane-worker")["metadata"]["namespace"]
    open_docs = [d for d in docs if d["kind"] != "NetworkPolicy"]
    governor, cache = labels_of(docs, "governor"), labels_of(docs, "cache")
    assert allowed(open_docs, (ns, governor), cache, 50051), "the evaluator denies by itself"
    assert not allowed(docs, (ns, governor), cache, 50051), "the policies stopped denying"


# --- disruption, services, names --------------------------------------------------------------


@pytest.mark.parametrize("component", sorted(WORKLOADS))
def test_every_workload_has_a_pdb_that_still_lets_a_node_drain(docs, component):
    labels = labels_of(docs, component)
    pdbs = [p for p in find(docs, "PodDisruptionBudget") if _selects(p["spec"]["selector"], labels)]
    assert len(pdbs) == 1, f"{component} needs exactly one PodDisruptionBudget"
    spec = pdbs[0]["spec"]
    replicas = workload(docs, component)["spec"].get("replicas", 1)
    if "minAvailable" in spec:
        assert int(spec["minAvailable"]) < replicas, f"{component}'s PDB blocks every eviction"
    else:
        assert int(spec["maxUnavailable"]) >= 1, f"{component}'s PDB blocks every eviction"


def test_every_service_selects_a_pod_and_targets_a_named_port(docs):
    for service in find(docs, "Service"):
        matches = [c for c in WORKLOADS if _selects({"matchLabels": service["spec"]["selector"]},
                                                    labels_of(docs, c))]
        assert len(matches) == 1, f"{service['metadata']['name']} selects {matches}"
        names = {p["name"] for p in container(docs, matches[0])["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in names, f"{service['metadata']['name']} -> {port}"


def test_every_object_lives_in_the_overlay_namespace_under_restricted_pod_security(docs):
    (namespace,) = find(docs, "Namespace")
    name = namespace["metadata"]["name"]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for d in docs:
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == name, f"{d['kind']}/{d['metadata']['name']}"


def test_no_overlay_deploys_a_floating_image_tag_and_prod_ships_the_package_version(rendered):
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for overlay, docs in rendered.items():
        for component in WORKLOADS:
            image = container(docs, component)["image"]
            assert ":" in image and not image.endswith(":latest"), f"{overlay}: {image}"
            if overlay == "prod":
                assert image == f"gpuplane/{component}:{version}", (
                    f"prod must ship the release {version}, not {image}"
                )


# --- service identity (issue 17) ----------------------------------------------------------------


def _tls_volume(docs: list[Doc], component: str) -> dict[str, Any]:
    c, spec = container(docs, component), pod(docs, component)["spec"]
    name = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}[TLS_MOUNT]
    return {v["name"]: v for v in spec["volumes"]}[name]


def test_every_tls_server_mounts_a_certificate_its_overlay_issues_for_its_identity(docs):
    issued = {c["spec"]["secretName"]: c for c in find(docs, "Certificate")}
    for component in WORKLOADS:
        sec = security_env(docs, component)
        if "TLS_CERT" not in sec:
            continue
        for key in ("TLS_CERT", "TLS_KEY", "TLS_CLIENT_CA"):
            assert sec[key].startswith(TLS_MOUNT + "/"), f"{component}: {key} is not mounted"
        volume = _tls_volume(docs, component)
        if "secret" in volume:
            cert = issued[volume["secret"]["secretName"]]["spec"]
            assert cert["uris"] == [f"spiffe://gpuplane/{component}"], f"{component} identity"
            assert f"gpuplane-{component}" in cert["dnsNames"], "clients dial the Service name"
            assert {"server auth", "client auth"} <= set(cert["usages"])
            issuer = cert["issuerRef"]["name"]
        else:
            csi = volume["csi"]
            attrs = csi["volumeAttributes"]
            assert csi["driver"] == "csi.cert-manager.io", f"{component}: unknown TLS volume"
            assert attrs["csi.cert-manager.io/uri-sans"] == "spiffe://gpuplane/worker/${POD_NAME}"
            assert env(container(docs, component))["GPUPLANE_WORKER_ID"]["value"] == \
                "$(POD_NAME)", "the worker id must be the name its certificate speaks for"
            issuer = attrs["csi.cert-manager.io/issuer-name"]
        assert one(docs, "Issuer", issuer)["spec"]["ca"]["secretName"], \
            f"{component}: not signed by the overlay's CA Issuer"


def test_the_role_mappings_grant_each_issued_identity_what_its_calls_need(docs):
    from services.common.identity import RoleMap, parse_role

    roles = {c: RoleMap.of(parse_role(r) for r in security_env(docs, c).get("ROLES", "").split())
             for c in WORKLOADS}
    if not any(roles.values()):
        # Without authorization (dev) every caller is allowed, as before; then no TLS either,
        # or a certificate would name callers that no role recognises.
        assert not any("TLS_CERT" in security_env(docs, c) for c in WORKLOADS)
        return
    worker_pod = "spiffe://gpuplane/worker/gpuplane-worker-6d5f-abcde"
    for server in ("governor", "cache"):
        assert "worker" in roles[server].roles_of([worker_pod]), f"workers cannot use the {server}"
    uris = {u for c in find(docs, "Certificate") for u in c["spec"].get("uris", [])}
    assert "admin" in roles["worker"].roles_of([u for u in uris if "/admin/" in u]), \
        "no issued certificate may load models"
    assert "client" in roles["worker"].roles_of([u for u in uris if "/client/" in u]), \
        "no issued certificate may generate"
    assert not roles["worker"].roles_of([worker_pod]), "a worker may not administer another worker"
    assert security_env(docs, "worker").get("TLS_CA"), \
        "the worker's calls to the governor and the cache must verify them"
