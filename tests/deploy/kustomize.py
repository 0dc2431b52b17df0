"""The subset of kustomize that deploy/k8s uses (resources, JSON 6902 `patches` with a target, `replicas`),
in Python, so CI renders the overlays without kubectl; where kubectl is installed, the tests check that
it renders the same objects. Any other kustomization field is refused, so the two cannot drift apart."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import jsonpatch
import yaml

SUPPORTED = {"apiVersion", "kind", "resources", "patches", "replicas"}


def _group_version(obj: dict) -> tuple[str, str]:
    group, _, version = obj["apiVersion"].rpartition("/")
    return group, version


def _matches(obj: dict, target: dict) -> bool:
    group, version = _group_version(obj)
    wanted = {"group": group, "version": version, "kind": obj["kind"], "name": obj["metadata"]["name"]}
    unknown = set(target) - set(wanted)
    if unknown:
        raise ValueError(f"patch target fields {sorted(unknown)} are not supported by this renderer")
    return all(wanted[key] == value for key, value in target.items())


def render(directory: str | Path) -> list[dict]:
    directory = Path(directory)
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unsupported = set(kustomization) - SUPPORTED
    if unsupported:
        raise ValueError(f"{directory}: kustomization fields {sorted(unsupported)} are not supported here")
    objects: list[dict] = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        objects += render(path) if path.is_dir() else [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for patch in kustomization.get("patches", []):
        matched = [obj for obj in objects if _matches(obj, patch["target"])]
        if not matched:
            raise ValueError(f"{directory}: patch target {patch['target']} matches nothing")
        for obj in matched:
            jsonpatch.apply_patch(obj, yaml.safe_load(patch["patch"]), in_place=True)
    for replica in kustomization.get("replicas", []):
        workloads = [obj for obj in objects if obj["metadata"]["name"] == replica["name"] and "replicas" in obj["spec"]]
        if not workloads:
            raise ValueError(f"{directory}: replicas for {replica['name']}, which is no workload here")
        for obj in workloads:
            obj["spec"]["replicas"] = replica["count"]
    return objects


def kubectl_render(directory: str | Path) -> list[dict] | None:
    """`kubectl kustomize DIR` parsed, or None where kubectl is not installed."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    out = subprocess.run([kubectl, "kustomize", str(directory)], check=True, capture_output=True, text=True, timeout=60)
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]
