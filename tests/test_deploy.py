"""The Kubernetes manifests in deploy/ validate offline: the built-in kinds against Kubernetes'
own schemas (``kubernetes-validate``, strict: an unknown field is an error), the InferencePool
against the Gateway API Inference Extension's CRD schema (deploy/schemas, by ``jsonschema``).
The README's Kubernetes commands name these files and the Secret they read."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KUBERNETES = "1.33.0"
CRDS = {("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.json"}


def documents() -> list[tuple[str, dict]]:
    """(file name, object) for every object in deploy/*.yaml."""
    found = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        found += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


def problem(document: dict) -> str | None:
    """Why ``document`` is not a valid object of its kind, or None."""
    crd = CRDS.get((document.get("apiVersion"), document.get("kind")))
    try:
        if crd is None:
            kubernetes_validate.validate(document, KUBERNETES, strict=True)
        else:
            schema = json.loads((DEPLOY / "schemas" / crd).read_text())
            jsonschema.validate({k: v for k, v in document.items()}, schema)
    except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as error:
        return str(error.message).splitlines()[0]
    return None


@pytest.mark.parametrize(
    "name, document",
    documents(),
    ids=[f"{name}:{doc['kind']}/{doc['metadata']['name']}" for name, doc in documents()],
)
def test_each_object_validates(name: str, document: dict) -> None:
    assert problem(document) is None


def test_the_replica_runs_the_three_processes_with_its_probes_gpu_cache_and_key() -> None:
    (deployment,) = [
        d for n, d in documents() if n == "nanoserve.yaml" and d["kind"] == "Deployment"
    ]
    pod = deployment["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    assert set(containers) == {"scheduler", "worker", "frontend"}
    frontend = containers["frontend"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert frontend[probe]["httpGet"]["path"] == "/health"
    assert containers["worker"]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert containers["worker"]["volumeMounts"][0]["mountPath"] == "/cache"
    (key,) = [e for e in frontend["env"] if e["name"] == "NANOSERVE_API_KEY"]
    assert key["valueFrom"]["secretKeyRef"] == {"name": "nanoserve-api-key", "key": "api-key"}


@pytest.mark.parametrize(
    "kind, corrupt, message",
    [
        ("Deployment", lambda d: d["spec"].update(replicas="two"), "is not of type 'integer'"),
        ("Service", lambda d: d["spec"].update(portz=[]), "portz"),
        ("InferencePool", lambda d: d["spec"].pop("targetPorts"), "'targetPorts' is a required"),
    ],
)
def test_the_validation_fires_on_one_corruption(kind: str, corrupt, message: str) -> None:
    (document,) = [copy.deepcopy(d) for n, d in documents() if d["kind"] == kind][:1]
    corrupt(document)
    assert message in str(problem(document))


def test_the_readme_commands_match_the_manifests() -> None:
    readme = (ROOT / "README.md").read_text()
    applied = set(re.findall(r"kubectl apply -f (deploy/[\w.-]+)", readme))
    assert applied == {f"deploy/{p.name}" for p in DEPLOY.glob("*.yaml")}
    assert "kubectl create secret generic nanoserve-api-key --from-literal=api-key=" in readme
