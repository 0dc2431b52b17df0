"""compose files and Dockerfile checked without Docker (every command must be a real `pdserve`
command line), `pdserve up`'s process plan, and `up` failing loudly when a component dies at start."""

from __future__ import annotations

import re
import subprocess
import sys
from argparse import Namespace

import pytest
import tomllib
import yaml

from pdserve.cli import build_parser
from pdserve.up import engine_components, split_cpus
from tests.router.conftest import REPO

HF_HOME = "/home/pdserve/.cache/huggingface"
VARIABLE = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(value: str) -> str:
    """Compose's ${VAR:-default} with no variables set."""
    return VARIABLE.sub(lambda m: m.group(2) or "", value)


def load_compose(name: str) -> dict:
    return yaml.safe_load((REPO / name).read_text())


def pdserve_services(name: str) -> dict:
    """The services that run the pdserve image (not the monitoring profile's Prometheus and Grafana)."""
    return {service: spec for service, spec in load_compose(name)["services"].items()
            if str(spec.get("image", "")).startswith("pdserve:")}


def parse_command(command: list[str]) -> Namespace:
    return build_parser().parse_args([interpolate(part) for part in command])


def option(command: list[str], flag: str) -> str:
    return interpolate(command[command.index(flag) + 1])


def port_of(address: str) -> str:
    return address.rsplit(":", 1)[1]


@pytest.mark.parametrize("name", ["compose.yaml", "compose.cpu.yaml"])
def test_compose_services_use_real_cli_flags_and_find_each_other(name):
    services = pdserve_services(name)
    assert {"router", "prefill", "decode"} <= set(services)
    parsed = {service: parse_command(spec["command"]) for service, spec in services.items()}
    assert parsed["router"].command == "router" and parsed["router"].host == "0.0.0.0"
    assert parsed["prefill"].command == "prefill" and parsed["decode"].command == "decode"
    registration_port = port_of(parsed["router"].registration_address)
    for role in ("prefill", "decode"):
        engine = parsed[role]
        # engines find the router by service name, so `--scale` replicas register themselves
        assert engine.router_address == [f"tcp://router:{registration_port}"]
        assert engine.control_address.startswith("tcp://0.0.0.0:"), "bind every interface of the container"
        assert engine.model == parsed["router"].model, "router tokenizer and engine weights come from one model"
    assert parsed["prefill"].kv_address.startswith("tcp://0.0.0.0:")
    published = [interpolate(p) for p in services["router"]["ports"]]
    assert published == [f"127.0.0.1:8000:{parsed['router'].port}"], "loopback unless PDSERVE_PUBLISH_IP widens it"
    for spec in services.values():
        assert f"hf-cache:{HF_HOME}" in spec["volumes"]


@pytest.mark.parametrize("name", ["compose.yaml", "compose.cpu.yaml"])
def test_compose_publishes_every_port_on_loopback_by_default(name):
    ports = {service: [interpolate(port) for port in spec.get("ports", [])]
             for service, spec in load_compose(name)["services"].items()}
    assert {service for service, published in ports.items() if published} == {"router", "prometheus", "grafana"}
    for service, published in ports.items():
        assert all(port.startswith("127.0.0.1:") for port in published), (service, published)


@pytest.mark.parametrize("name", ["compose.yaml", "compose.cpu.yaml"])
def test_compose_healthchecks_probe_what_each_service_serves(name):
    services = load_compose(name)["services"]
    for service in ("router", "prefill", "decode"):
        test = services[service]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "pdserve.router.probe"], test
        command = services[service]["command"]
        if service == "router":
            assert test[4] == f"http://127.0.0.1:{option(command, '--port')}/health"
        else:
            assert test[4] == f"tcp://127.0.0.1:{port_of(option(command, '--control-address'))}"
    assert subprocess.run([sys.executable, "-m", "pdserve.router.probe", "--help"], cwd=REPO,
                          capture_output=True).returncode == 0


def test_gpu_compose_puts_prefill_on_gpu0_and_decode_on_gpu1():
    services = load_compose("compose.yaml")["services"]
    for service, gpu in (("prefill", "0"), ("decode", "1")):
        devices = services[service]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "device_ids": [gpu], "capabilities": ["gpu"]}]
        assert parse_command(services[service]["command"]).device == "cuda"
    assert "deploy" not in services["router"]


def test_cpu_compose_has_no_gpu_and_builds_its_own_demo_model():
    services = pdserve_services("compose.cpu.yaml")
    assert all("deploy" not in spec for spec in services.values())
    assert all(parse_command(services[role]["command"]).device == "cpu" for role in ("prefill", "decode"))
    demo = parse_command(services["demo-model"]["command"])
    assert demo.command == "demo-model" and demo.dir == parse_command(services["router"]["command"]).model
    for service in ("router", "prefill", "decode"):
        assert services[service]["depends_on"]["demo-model"]["condition"] == "service_completed_successfully"


def test_dockerfile_installs_every_package_and_runs_pdserve():
    dockerfile = (REPO / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["pdserve-entrypoint"]' in dockerfile
    assert "COPY docker/entrypoint.sh /usr/local/bin/pdserve-entrypoint" in dockerfile
    assert f"HF_HOME={HF_HOME}" in dockerfile, "the compose hf-cache volume is HF_HOME"
    torch_step, code_step = dockerfile.index('"torch==${TORCH_VERSION}"'), dockerfile.index("COPY engine ./engine")
    assert torch_step < dockerfile.index("pip install -r /tmp/requirements.txt") < code_step, \
        "torch and the dependencies are layers below the code: a code change reinstalls neither"
    package_dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for folder in package_dirs.values():
        assert f"COPY {folder} ./{folder}" in dockerfile, f"the image lacks the {folder} folder"
    cmd = re.search(r"^CMD (\[.*\])$", dockerfile, re.M).group(1)
    assert build_parser().parse_args(yaml.safe_load(cmd)).command == "up"


def up_args(*argv: str) -> Namespace:
    return build_parser().parse_args(["up", *argv])


def test_up_plans_pinned_cpu_engines_on_disjoint_cores(monkeypatch):
    assert split_cpus([0, 1, 2, 3, 4], 2) == [[0, 1], [2, 3]]
    assert split_cpus([0, 1], 3) == [[0], [1], [0]], "more engines than cores: shared, with a warning"
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6})
    components = engine_components(up_args("--num-prefill", "1", "--num-decode", "2", "--pin-cpus"), "/m", "tcp://r:1")
    assert [c.cpus for c in components] == [[0, 1], [2, 3], [4, 5]]
    for component in components:
        parsed = build_parser().parse_args(component.command[3:])  # after `python -m pdserve`
        assert parsed.router_address == ["tcp://r:1"] and parsed.model == "/m"
        assert component.env["OMP_NUM_THREADS"] == str(len(component.cpus))
    assert [c.name for c in components] == ["prefill-0", "decode-0", "decode-1"]


def test_up_shares_the_cores_out_as_threads_among_three_engines_or_more(monkeypatch):
    """Engines compute at the same time: three or more, each with a thread per core, fought for the cores."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    components = engine_components(up_args("--num-prefill", "1", "--num-decode", "2"), "/m", "tcp://r:1")
    assert [c.env["OMP_NUM_THREADS"] for c in components] == ["1", "1", "1"] and all(c.cpus is None for c in components)
    unpinned = engine_components(up_args("--no-pin-cpus"), "/m", "tcp://r:1")
    assert all("OMP_NUM_THREADS" not in c.env for c in unpinned), "1P1D"
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    components = engine_components(up_args("--num-prefill", "2", "--num-decode", "2", "--no-pin-cpus"), "/m",
                                   "tcp://r:1")
    assert [c.env["OMP_NUM_THREADS"] for c in components] == ["2"] * 4
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the operator's own choice stands
    components = engine_components(up_args("--num-prefill", "2", "--num-decode", "2"), "/m", "tcp://r:1")
    assert all("OMP_NUM_THREADS" not in c.env for c in components)


def test_up_plans_one_gpu_per_engine():
    components = engine_components(up_args("--device", "cuda", "--num-prefill", "1", "--num-decode", "2"), "/m",
                                   "tcp://r:1")
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in components] == ["0", "1", "2"]
    pinned = engine_components(up_args("--device", "cuda", "--prefill-devices", "3", "--decode-devices", "5,6"),
                               "/m", "tcp://r:1")
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in pinned] == ["3", "5"]
    assert all(build_parser().parse_args(c.command[3:]).device == "cuda" for c in pinned)


def test_up_exits_nonzero_with_the_log_of_a_component_that_dies_at_start(tmp_path):
    result = subprocess.run([sys.executable, "-m", "pdserve", "up", "--model", str(tmp_path / "no-model"),
                             "--port", "0", "--log-dir", str(tmp_path / "logs")],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "router exited with code" in result.stderr
    assert "tokenizer" in result.stderr, "the router's own words are shown"
    assert "[pdserve up] stopped" in result.stdout


def test_up_refuses_a_plan_without_decode_engines():
    result = subprocess.run([sys.executable, "-m", "pdserve", "up", "--num-decode", "0"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "at least one decode engine" in result.stderr


def test_up_pins_the_engines_ports_from_a_base():
    from pdserve.up import check_ports

    args = up_args("--num-prefill", "2", "--num-decode", "1", "--engine-port-base", "7100", "--engine-host", "0.0.0.0")
    commands = [component.command for component in engine_components(args, "/m", "tcp://r:7000")]
    addresses = [[c[c.index(flag) + 1] for flag in ("--control-address", "--kv-address") if flag in c] for c in commands]
    assert addresses == [["tcp://0.0.0.0:7100", "tcp://0.0.0.0:7101"], ["tcp://0.0.0.0:7102", "tcp://0.0.0.0:7103"],
                         ["tcp://0.0.0.0:7104"]]
    free = engine_components(up_args(), "/m", "tcp://r:7000")
    assert [c.command[c.command.index("--control-address") + 1] for c in free] == ["tcp://127.0.0.1:0"] * 2
    with pytest.raises(ValueError, match="need ports 65531..65536"):
        check_ports(up_args("--engine-port-base", "65531", "--num-prefill", "2", "--num-decode", "1"))


def test_up_refuses_insecure_planes_beyond_loopback():
    result = subprocess.run([sys.executable, "-m", "pdserve", "up", "--insecure", "--registration-address",
                             "tcp://0.0.0.0:7000"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--insecure would speak plaintext on tcp://0.0.0.0:7000" in result.stderr
