"""deploy/k8s: every overlay renders (kustomize's way, and kubectl's where installed), validates against
the Kubernetes schemas offline, runs commands that pdserve's own parser accepts, registers every engine
with every router replica, and keeps pods non-root with resource requests and real probes."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest

from pdserve.cli import build_parser
from tests.deploy.kustomize import kubectl_render, render

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OVERLAYS = sorted(path.name for path in (K8S / "overlays").iterdir())
FIELD_VALUES = {"status.podIP": "10.1.2.3", "metadata.name": "pdserve-decode-5d8f-x2x9q"}
WORKLOADS = ("Deployment", "StatefulSet")


def key(obj: dict) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> dict[tuple[str, str], dict]:
    return {key(obj): obj for obj in render(K8S / "overlays" / request.param)}


def workloads(rendered):
    return [obj for obj in rendered.values() if obj["kind"] in WORKLOADS]


def test_there_are_cpu_and_gpu_overlays():
    assert {"cpu", "gpu"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubectl_renders_the_same_objects(overlay):
    by_kubectl = kubectl_render(K8S / "overlays" / overlay)
    if by_kubectl is None:
        pytest.skip("kubectl is not installed: the overlays are rendered by tests/deploy/kustomize.py only")
    assert {key(obj): obj for obj in by_kubectl} == {key(obj): obj for obj in render(K8S / "overlays" / overlay)}


def test_every_object_validates_against_the_kubernetes_schemas(rendered):
    version = kubernetes_validate.latest_version()
    for obj in rendered.values():
        kubernetes_validate.validate(obj, version, strict=True)


def environment(container: dict, rendered) -> dict[str, str]:
    """What $(NAME) expands to in a container: its ConfigMaps, then its env (downward API fields faked)."""
    values: dict[str, str] = {}
    for source in container.get("envFrom", []):
        values.update(rendered[("ConfigMap", source["configMapRef"]["name"])]["data"])
    for entry in container.get("env", []):
        if "value" in entry:
            values[entry["name"]] = entry["value"]
        elif "fieldRef" in entry.get("valueFrom", {}):
            values[entry["name"]] = FIELD_VALUES[entry["valueFrom"]["fieldRef"]["fieldPath"]]
    return values


def parsed_command(container: dict, rendered):
    assert container["command"] == ["pdserve"], container["name"]
    values = environment(container, rendered)
    args = [re.sub(r"\$\((\w+)\)", lambda match: values[match.group(1)], arg) for arg in container["args"]]
    try:
        return build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"container {container['name']}: pdserve rejects its arguments {args}")


def test_every_container_command_parses_with_the_pdserve_cli(rendered):
    for workload in workloads(rendered):
        spec = workload["spec"]["template"]["spec"]
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            parsed_command(container, rendered)


def test_every_engine_registers_with_every_router_replica(rendered):
    router = rendered[("StatefulSet", "pdserve-router")]
    router_args = parsed_command(router["spec"]["template"]["spec"]["containers"][0], rendered)
    port = router_args.registration_address.rsplit(":", 1)[1]
    service = router["spec"]["serviceName"]
    assert rendered[("Service", service)]["spec"]["clusterIP"] == "None", "one DNS name per router pod"
    expected = [f"tcp://pdserve-router-{i}.{service}:{port}" for i in range(router["spec"]["replicas"])]
    for role in ("prefill", "decode"):
        engine = rendered[("Deployment", f"pdserve-{role}")]
        args = parsed_command(engine["spec"]["template"]["spec"]["containers"][0], rendered)
        assert args.command == role
        assert args.router_address == expected, f"{role} engines must register with each router replica"
        assert args.advertise_host == FIELD_VALUES["status.podIP"], "engines advertise their pod IP"
        assert args.curve_dir and not args.insecure, "every plane is CURVE-encrypted"
        assert args.model == router_args.model, "router tokenizer and engine weights come from one model"


def test_pods_run_as_non_root_with_requests_and_probes_on_real_endpoints(rendered):
    for workload in workloads(rendered):
        spec = workload["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] > 0
        for container in spec["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert {"cpu", "memory"} <= set(container["resources"]["requests"])
            args = parsed_command(container, rendered)
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                check = container[probe]
                if "exec" in check:  # the engine's control socket, over CURVE
                    command = check["exec"]["command"]
                    assert command[:3] == ["python", "-m", "pdserve.router.probe"]
                    assert command[3] == f"tcp://127.0.0.1:{args.control_address.rsplit(':', 1)[1]}"
                    assert command[command.index("--curve-dir") + 1] == args.curve_dir
                else:
                    port = (check.get("httpGet") or check["tcpSocket"])["port"]
                    assert port in {p["name"] for p in container["ports"]}
                    assert int(next(p["containerPort"] for p in container["ports"] if p["name"] == port)) == args.port
            if args.command == "router":
                assert container["readinessProbe"]["httpGet"]["path"] == "/health"


def test_gpu_engines_get_one_gpu_each_and_cpu_ones_none():
    for overlay, gpus in (("gpu", "1"), ("cpu", None)):
        rendered = {key(obj): obj for obj in render(K8S / "overlays" / overlay)}
        for role in ("prefill", "decode"):
            engine = rendered[("Deployment", f"pdserve-{role}")]["spec"]["template"]["spec"]
            resources = engine["containers"][0]["resources"]
            assert resources.get("limits", {}).get("nvidia.com/gpu") == gpus
        device = rendered[("ConfigMap", "pdserve-config")]["data"]["PDSERVE_DEVICE"]
        assert device == ("cuda" if gpus else "cpu")


def test_keygen_makes_the_secret_the_pods_mount(tmp_path, capsys):
    import json

    from pdserve.cli import main
    from pdserve.control.keys import load_cluster_keys

    assert main(["keygen", "--secret-manifest", "pdserve-cluster-keys"]) == 0
    secret = json.loads(capsys.readouterr().out)
    kubernetes_validate.validate(secret, kubernetes_validate.latest_version(), strict=True)
    for workload in workloads({key(obj): obj for obj in render(K8S / "base")}):
        volumes = {volume["name"]: volume for volume in workload["spec"]["template"]["spec"]["volumes"]}
        assert volumes["keys"]["secret"]["secretName"] == secret["metadata"]["name"]
    for name, text in secret["stringData"].items():  # the files, as the pods see them under /keys
        (tmp_path / name).write_text(text)
    keys = load_cluster_keys(tmp_path)
    assert keys.server.keypair.public_key != keys.client.keypair.public_key
    assert main(["keygen"]) == 2, "neither DIR nor --secret-manifest: an error naming both"
    assert "--secret-manifest" in capsys.readouterr().err
