"""Compose files and the image, checked without Docker: both compose files valid against the Compose
Specification's JSON schema, the image's user and entry point, the demo model built once and only
when used, unique engine ids for scaled replicas, and the metric names the docs give."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
from importlib.resources import files
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest

from pdserve.cli import build_parser, main
from tests.router.test_launcher_and_compose import interpolate, load_compose, pdserve_services

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILES = ["compose.yaml", "compose.cpu.yaml"]


@pytest.fixture(scope="module")
def compose_validator():
    """The Compose Specification's schema as check-jsonschema ships it (license beside it in the package)."""
    schema = json.loads(files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json").read_text())
    return jsonschema.validators.validator_for(schema)(schema)


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_file_follows_the_compose_specification(name, compose_validator):
    document = load_compose(name)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in compose_validator.iter_errors(document)]
    assert not errors, "\n".join(errors)
    broken = copy.deepcopy(document)
    broken["services"]["router"]["comand"] = ["router"]  # a typo the schema must catch
    assert any("comand" in e.message for e in compose_validator.iter_errors(broken))


def test_scaled_engine_replicas_get_distinct_ids():
    for name in COMPOSE_FILES:
        services = load_compose(name)["services"]
        for role in ("prefill", "decode"):
            command = [interpolate(part) for part in services[role]["command"]]
            assert "--engine-id" not in command, f"{name} {role}: a fixed id is shared by every --scale replica"
            assert build_parser().parse_args(command).engine_id is None  # -> role-hostname (the container id)


def test_demo_model_is_built_once_and_only_when_used(tmp_path, capsys, monkeypatch):
    services = load_compose("compose.cpu.yaml")["services"]
    raw = services["demo-model"]["command"]
    target = tmp_path / "demo" / "pdserve-demo"
    as_run = [str(target) if part == "/demo/pdserve-demo" else part for part in raw]

    def run(model_env: str | None) -> str:
        model = model_env if model_env else str(target)
        argv = [model if part == "${PDSERVE_MODEL:-/demo/pdserve-demo}" else interpolate(part) for part in as_run]
        argv[argv.index("--size") + 1] = "tiny"  # the small model's path, tiny-sized
        assert main(argv) == 0
        return capsys.readouterr().out

    assert "not building the demo model: the services use /models/mine" in run("/models/mine")
    assert not target.exists(), "PDSERVE_MODEL set: nothing built"
    assert "wrote llama-tiny demo model" in run(None)
    weights = target / "model.safetensors"
    built_at = weights.stat().st_mtime_ns
    assert "already in" in run(None) and weights.stat().st_mtime_ns == built_at, "the next start keeps it"
    assert not [p for p in target.parent.iterdir() if p.name.startswith(".")], "no temp dir left behind"


def test_dockerfile_runs_as_an_unprivileged_user_with_writable_volume_mounts():
    dockerfile = (REPO / "Dockerfile").read_text()
    users = re.findall(r"^USER (\S+)$", dockerfile, re.M)
    assert users and users[-1] not in ("root", "0"), "the image must not run as root"
    for mount in ("/keys", "/demo", "${HF_HOME}", "${PDSERVE_CACHE}"):
        assert mount in dockerfile.split("USER")[0].split("useradd")[1], f"{mount} is made and chowned for the user"
    for name in COMPOSE_FILES:
        for spec in pdserve_services(name).values():
            assert not any(v.split(":")[1].startswith("/root") for v in spec["volumes"]), "no volume under /root"
            assert "OMP_NUM_THREADS" not in spec.get("environment", {}) or \
                interpolate(spec["environment"]["OMP_NUM_THREADS"]) == "", "threads derived unless set"


def run_entrypoint(tmp_path: Path, env: dict[str, str], cpu_max: str | None = None) -> str:
    """docker/entrypoint.sh with a stand-in `pdserve` that prints OMP_NUM_THREADS and its arguments."""
    fake = tmp_path / "bin" / "pdserve"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text('#!/bin/sh\necho "$OMP_NUM_THREADS $*"\n')
    fake.chmod(0o755)
    cgroup = tmp_path / "cpu.max"
    cgroup.unlink(missing_ok=True)  # none: as on a machine without cgroup v2
    if cpu_max is not None:
        cgroup.write_text(cpu_max)
    environment = {"PATH": f"{fake.parent}:{os.environ['PATH']}", "PDSERVE_CGROUP_CPU_MAX": str(cgroup), **env}
    result = subprocess.run(["sh", str(REPO / "docker" / "entrypoint.sh"), "up", "--host", "0.0.0.0"],
                            env=environment, capture_output=True, text=True, timeout=30, check=True)
    return result.stdout.strip()


def test_entrypoint_derives_omp_threads_from_the_containers_cores(tmp_path):
    cores = len(os.sched_getaffinity(0))
    assert run_entrypoint(tmp_path, {}) == f"{cores} up --host 0.0.0.0", "no quota: the CPU set"
    assert run_entrypoint(tmp_path, {}, "max 100000\n") == f"{cores} up --host 0.0.0.0"
    assert run_entrypoint(tmp_path, {}, "50000 100000\n").split()[0] == "1", "half a core: one thread"
    assert run_entrypoint(tmp_path, {"OMP_NUM_THREADS": "7"}, "50000 100000\n").split()[0] == "7", "set: kept"
    assert run_entrypoint(tmp_path, {"OMP_NUM_THREADS": ""}).split()[0] == str(cores), "compose's empty default"


def test_kv_link_doc_names_the_metrics_router_metrics_shows():
    from prometheus_client import CollectorRegistry, generate_latest

    from pdserve.router.metrics import ENGINE_COUNTERS, ENGINE_GAUGES, EngineCollector

    stats = SimpleNamespace(**{attribute: 1 for _, _, attribute in ENGINE_GAUGES + ENGINE_COUNTERS})
    link = SimpleNamespace(info=object(), label="decode-0", role="decode", up=True, num_inflight=0, stats=stats)
    registry = CollectorRegistry()
    registry.register(EngineCollector({"decode-0": link}))
    shown = {line.split("{")[0] for line in generate_latest(registry).decode().splitlines()
             if line and not line.startswith("#")}
    documented = set(re.findall(r"`(pdserve_[a-z_]+)`", (REPO / "docs" / "design" / "kv-link.md").read_text()))
    assert len(documented) >= 8
    assert documented <= shown, f"named in docs/design/kv-link.md but not in /metrics: {sorted(documented - shown)}"
