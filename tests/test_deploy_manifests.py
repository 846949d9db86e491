"""The Kubernetes manifests in deploy/: every resource is valid against the Kubernetes API's
own schemas (kubernetes-validate, offline, strict: an unknown field is an error), and the
kustomization lists exactly the manifests beside it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
KUBERNETES = "1.31"  # the oldest release still supported upstream when these were written
KUSTOMIZATIONS = sorted(DEPLOY.rglob("kustomization.yaml"))
MANIFESTS = sorted(
    p for p in DEPLOY.rglob("*.yaml") if "kubernetes" in p.parts and p.name != "kustomization.yaml"
)


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_there_are_manifests_to_check() -> None:
    assert MANIFESTS and KUSTOMIZATIONS


def _problems(document: dict[str, Any]) -> list[str]:
    """What the API's schema refuses in ``document`` (strict), as messages. kubernetes-validate
    (its schemas: 17,000 files) comes with the dev extra (make test), not the test extra."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    try:
        kubernetes_validate.validate(document, KUBERNETES, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [exc.message]
    return []


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_resource_is_valid_for_the_api(path: Path) -> None:
    documents = _documents(path)
    assert documents, f"{path} holds no resource"
    assert [problem for doc in documents for problem in _problems(doc)] == []


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_the_kustomization_lists_the_manifests_beside_it(path: Path) -> None:
    (kustomization,) = _documents(path)
    listed = {path.parent / name for name in kustomization["resources"]}
    assert listed == {p for p in MANIFESTS if p.parent == path.parent}


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_config_map_a_pod_mounts_is_made_beside_it(path: Path) -> None:
    """A pod's ConfigMap volumes name ConfigMaps that the kustomization generates (from files
    that exist) or that a manifest beside it defines; generated Python settings compile."""
    (kustomization,) = _documents(path)
    generated = {}
    for generator in kustomization.get("configMapGenerator", []):
        files = [path.parent / name for name in generator["files"]]
        assert all(f.is_file() for f in files), files
        for f in files:
            if f.suffix == ".py":
                compile(f.read_text(), str(f), "exec")
        generated[generator["name"]] = files
    documents = [d for p in MANIFESTS if p.parent == path.parent for d in _documents(p)]
    defined = {d["metadata"]["name"] for d in documents if d["kind"] == "ConfigMap"}
    mounted = {
        volume["configMap"]["name"]
        for d in documents
        if d["kind"] == "Deployment"
        for volume in d["spec"]["template"]["spec"].get("volumes", [])
        if "configMap" in volume
    }
    assert mounted <= set(generated) | defined, mounted - set(generated) - defined


def test_the_check_sees_a_broken_resource() -> None:
    """A misspelt field and a wrong type are both refused."""
    deployment = next(
        doc for p in MANIFESTS for doc in _documents(p) if doc["kind"] == "Deployment"
    )
    assert _problems(deployment) == []
    misspelt = {**deployment, "spec": {**deployment["spec"], "replica": 1}}
    assert _problems(misspelt)
    wrong_type = {**deployment, "spec": {**deployment["spec"], "replicas": "two"}}
    assert _problems(wrong_type)
