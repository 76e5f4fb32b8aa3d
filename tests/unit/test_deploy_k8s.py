"""deploy/k8s: every manifest passes Kubernetes' own schemas (kubernetes-validate, strict), KEDA's objects have
the shape KEDA's CRDs and scalers require, references between objects resolve, and every ``async-rl`` command in
them is accepted by the CLI (its config parsed and validated with the values the pod would see)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from async_rl.process.lifecycle import redact_url
from async_rl.run.names import Names

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30.0"
"""The oldest Kubernetes minor still commonly run (EKS/GKE extended support); newer ones accept these objects too."""

KEDA_KINDS = ("ScaledObject", "TriggerAuthentication")
# From KEDA's CRD (keda.sh_scaledobjects.yaml, v1alpha1) and its scalers' metadata tags (redis_streams_scaler.go,
# redis_scaler.go, prometheus_scaler.go): the fields a ScaledObject spec may have, and each trigger's metadata keys.
SCALED_OBJECT_SPEC = {"advanced", "cooldownPeriod", "fallback", "idleReplicaCount", "initialCooldownPeriod",
                      "maxReplicaCount", "minReplicaCount", "pollingInterval", "scaleTargetRef", "triggers"}  # fmt: skip
TRIGGER_FIELDS = {"authenticationRef", "metadata", "metricType", "name", "type", "useCachedMetrics"}
TRIGGER_METADATA = {
    "redis-streams": ({"stream"}, {"address", "addresses", "host", "hosts", "port", "ports", "username", "password",
                                   "stream", "consumerGroup", "pendingEntriesCount", "streamLength", "lagCount",
                                   "activationLagCount", "databaseIndex", "enableTLS", "unsafeSsl"}),
    "prometheus": ({"serverAddress", "query", "threshold"}, {"serverAddress", "query", "queryParameters", "threshold",
                                                             "activationThreshold", "namespace", "customHeaders",
                                                             "ignoreNullValues", "unsafeSsl"}),
}  # fmt: skip


def _load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kustomization() -> dict[str, Any]:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def applied() -> list[dict[str, Any]]:
    """The objects ``kubectl apply -k deploy/k8s`` creates."""
    return [d for f in _kustomization()["resources"] for d in _load(K8S / f)]


def optional() -> list[dict[str, Any]]:
    return [d for f in sorted((K8S / "optional").glob("*.yaml")) for d in _load(f)]


def _by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _pod_specs(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    kinds = ("Deployment", "StatefulSet", "Job")
    return [(d["metadata"]["name"], d["spec"]["template"]) for d in docs if d["kind"] in kinds]


def test_every_manifest_is_applied_by_the_kustomization() -> None:
    listed = set(_kustomization()["resources"])
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present, f"not listed: {present - listed}; listed but missing: {listed - present}"
    namespace = _kustomization()["namespace"]
    for d in applied() + optional():
        if d["kind"] != "Namespace":
            assert d["metadata"].get("namespace") == namespace, d["metadata"]


@pytest.mark.parametrize("doc", [d for d in applied() + optional() if d["kind"] not in KEDA_KINDS],
                         ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")  # fmt: skip
def test_kubernetes_objects_pass_the_strict_schema(doc: dict[str, Any]) -> None:
    """Every built-in object (KEDA's custom resources are checked against KEDA's CRD below)."""
    import kubernetes_validate

    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validator_catches_a_mistake() -> None:
    import kubernetes_validate

    job = _by_kind(applied(), "Job")["async-rl-learner"]
    job["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []  # the typo of volumeMounts
    with pytest.raises(kubernetes_validate.ValidationError, match="volumeMount"):
        kubernetes_validate.validate(job, KUBERNETES_VERSION, strict=True)


def test_keda_objects_have_the_shape_keda_requires() -> None:
    docs = applied() + optional()
    auths = _by_kind(docs, "TriggerAuthentication")
    secrets = _by_kind(applied(), "Secret")
    deployments = _by_kind(applied(), "Deployment")
    for auth in auths.values():
        for ref in auth["spec"]["secretTargetRef"]:
            assert set(ref) == {"parameter", "name", "key"}
            assert ref["key"] in secrets[ref["name"]]["stringData"], ref
    scaled = [d for d in docs if d["kind"] == "ScaledObject"]
    assert len(scaled) == 2  # keda.yaml and its optional variant
    for so in scaled:
        assert so["apiVersion"] == "keda.sh/v1alpha1"
        spec = so["spec"]
        assert set(spec) <= SCALED_OBJECT_SPEC, set(spec) - SCALED_OBJECT_SPEC
        assert spec["scaleTargetRef"]["name"] in deployments
        assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
        assert spec["triggers"]
        for trig in spec["triggers"]:
            assert set(trig) <= TRIGGER_FIELDS and {"type", "metadata"} <= set(trig), trig
            required, allowed = TRIGGER_METADATA[trig["type"]]
            meta = trig["metadata"]
            assert all(isinstance(v, str) for v in meta.values()), f"KEDA metadata values are strings: {meta}"
            assert required <= set(meta) <= allowed, (trig["type"], set(meta) - allowed, required - set(meta))
            if "authenticationRef" in trig:
                assert trig["authenticationRef"]["name"] in auths
            if trig["type"] == "redis-streams":
                # The trigger watches the run's prompt stream and the generators' group, as names.py spells them.
                names = Names(prefix=_arg(_container(docs, "async-rl-generator"), "run.prefix"))
                assert meta["stream"] == names.prompts_stream and meta["consumerGroup"] == names.prompts_group
                assert "lagCount" in meta, "lagCount: prompts nobody has taken (pendingEntriesCount counts held ones)"
                host, port = meta["address"].rsplit(":", 1)
                assert host.split(".")[0] in _by_kind(applied(), "Service") and port == "6379"
            if trig["type"] == "prometheus":
                assert "async_rl_learner_suggested_generators" in meta["query"]


def _container(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return dict(_pod_specs(docs))[name]["spec"]["containers"][0]


def _arg(container: dict[str, Any], key: str) -> str:
    [value] = [a.split("=", 1)[1] for a in container["args"] if a.startswith(key + "=")]
    return value


def test_references_between_objects_resolve() -> None:
    docs = applied()
    secrets, claims = _by_kind(docs, "Secret"), _by_kind(docs, "PersistentVolumeClaim")
    pods = _pod_specs(docs)
    for svc in _by_kind(docs, "Service").values():
        selected = [n for n, t in pods if all(t["metadata"]["labels"].get(k) == v
                                              for k, v in svc["spec"]["selector"].items())]  # fmt: skip
        assert len(selected) == 1, (svc["metadata"]["name"], selected)
        ports = {p["name"] for c in dict(pods)[selected[0]]["spec"]["containers"] for p in c.get("ports", [])}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports
    claim_templates = {d["metadata"]["name"]: {t["metadata"]["name"] for t in d["spec"].get("volumeClaimTemplates", [])}
                       for d in docs if d["kind"] == "StatefulSet"}  # fmt: skip
    for name, template in pods:
        spec = template["spec"]
        assert template["metadata"]["labels"]  # selected by their Service / ScaledObject
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        volumes.update({t: {} for t in claim_templates.get(name, ())})  # a StatefulSet's own volume per pod
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, (name, v)
        for c in spec["containers"]:
            assert {m["name"] for m in c.get("volumeMounts", [])} <= set(volumes), name
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref and not ref.get("optional"):
                    assert ref["key"] in secrets[ref["name"]]["stringData"], (name, ref)
    # The URLs in the Secret name the Services, with the password beside them.
    data = secrets["async-rl-credentials"]["stringData"]
    assert data["redis-url"] == f"redis://:{data['redis-password']}@async-rl-valkey:6379/0"
    assert data["nats-url"] == f"nats://{data['nats-user']}:{data['nats-password']}@async-rl-nats:4222"


def _resolve(container: dict[str, Any], secrets: dict[str, dict[str, Any]], mounts: dict[str, Path]) -> tuple[
        list[str], dict[str, str]]:  # fmt: skip
    """The container's argv and environment as the kubelet hands them over ($(VAR) expanded), with its volume
    mount paths mapped to local directories."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        ref = e.get("valueFrom", {})
        if "secretKeyRef" in ref:
            data = secrets[ref["secretKeyRef"]["name"]]["stringData"] if ref["secretKeyRef"]["name"] in secrets else {}
            if ref["secretKeyRef"]["key"] in data:
                env[e["name"]] = data[ref["secretKeyRef"]["key"]]
        elif "fieldRef" in ref:
            env[e["name"]] = "async-rl-generator-7d9f8-x2x4k"
        else:
            env[e["name"]] = e["value"]

    def expand(s: str) -> str:
        s = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], s)
        for mount, local in mounts.items():
            s = s.replace(mount, str(local))
        return s

    return [expand(a) for a in container["command"] + container.get("args", [])], env


def test_every_async_rl_command_is_accepted_by_the_cli(tmp_path: Path) -> None:
    docs = applied()
    secrets = _by_kind(docs, "Secret")
    checked = []
    for name, template in _pod_specs(docs):
        for c in template["spec"]["containers"]:
            if c.get("command", [""])[0] != "async-rl":
                continue
            mounts = {m["mountPath"]: tmp_path / m["name"] for m in c.get("volumeMounts", [])}
            for local in mounts.values():
                (local / "my-moe").mkdir(parents=True, exist_ok=True)
                (local / "prompts.jsonl").write_text('{"prompt": "hello"}\n')
            argv, env = _resolve(c, secrets, mounts)
            full_env = {**os.environ, **env}
            out = subprocess.run([sys.executable, "-m", "actors.commands.cli", *argv[1:], "--print-config"],
                                 capture_output=True, text=True, env=full_env, timeout=120)  # fmt: skip
            assert out.returncode == 0, f"{name}: {' '.join(argv)}\n{out.stderr}"
            cfg = json.loads(out.stdout)
            # The URLs reach the config from the Secret (printed without their password).
            assert cfg["run"]["redis_url"] == redact_url(env["ASYNC_RL_REDIS_URL"]) == "redis://***@async-rl-valkey:6379/0"
            assert cfg["run"]["nats_url"] == redact_url(env["ASYNC_RL_NATS_URL"])
            checked.append(argv[1])
    assert sorted(checked) == ["generator", "learner"]


def test_a_wrong_flag_in_a_manifest_would_be_caught(tmp_path: Path) -> None:
    c = _container(applied(), "async-rl-generator")
    c["args"] = [*c["args"], "on_run_end=linger"]
    argv, env = _resolve(c, _by_kind(applied(), "Secret"), {"/models": tmp_path})
    (tmp_path / "my-moe").mkdir()
    out = subprocess.run([sys.executable, "-m", "actors.commands.cli", *argv[1:], "--print-config"],
                         capture_output=True, text=True, env={**os.environ, **env}, timeout=120)  # fmt: skip
    assert out.returncode == 2 and "on_run_end" in out.stderr
