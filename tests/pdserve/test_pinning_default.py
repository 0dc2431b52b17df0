"""One pinning default for `pdserve up` and `pdserve sweep`: both take --pin-cpus / --no-pin-cpus with the same
default, and both resolve it alike (engines pinned to cores of their own where they fit the cores), so a bench
against `up` sees engines placed as a sweep's runs do. The plans only; no process starts."""

from __future__ import annotations

import argparse

import pytest

from pdserve.bench.sweep_cluster import ClusterSpec, engine_cores, up_command
from pdserve.bench.sweep_layouts import parse_layout
from pdserve.cli import build_parser
from pdserve.cli_help import pins_cpus
from pdserve.up import engine_components

LAYOUTS = {"1P1D": ("--num-prefill", "1", "--num-decode", "1"), "0P2D": ("--num-prefill", "0", "--num-decode", "2"),
           "1P2D": ("--num-prefill", "1", "--num-decode", "2")}


def parse(command: str, *argv: str):
    required = ["--model", "/m"] + (["--request-rates", "1"] if command == "sweep" else [])
    return build_parser().parse_args([command, *required, *argv])


@pytest.mark.parametrize("flags, given", [((), None), (("--pin-cpus",), True), (("--no-pin-cpus",), False)])
def test_up_and_sweep_parse_the_same_flag_to_the_same_value(flags, given):
    assert parse("up", *flags).pin_cpus is given and parse("sweep", *flags).pin_cpus is given


def test_both_show_the_flag_and_its_default_in_help():
    for command in ("up", "sweep"):
        commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
        text = " ".join(commands.choices[command].format_help().split())
        assert "--pin-cpus, --no-pin-cpus" in text
        assert "(default: pinned when every engine gets cores of its own, else not)" in text


@pytest.mark.parametrize("layout, cores, pinned", [("1P1D", {0, 1}, True), ("0P2D", {0, 1, 2, 3}, True),
                                                   ("1P2D", {0, 1}, False)])
@pytest.mark.parametrize("flags", [(), ("--pin-cpus",), ("--no-pin-cpus",)])
def test_up_and_sweep_resolve_the_default_alike(monkeypatch, layout, cores, pinned, flags):
    """The default pins where the engines fit the cores; a flag given wins, in both commands."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: cores)
    expected = {(): pinned, ("--pin-cpus",): True, ("--no-pin-cpus",): False}[flags]
    components = engine_components(parse("up", *LAYOUTS[layout], *flags), "/m", "tcp://r:1")
    assert all((c.cpus is not None) == expected for c in components)
    if expected:
        assert all(c.env["OMP_NUM_THREADS"] == str(len(c.cpus)) for c in components)
    args = parse("sweep", *flags)
    spec = ClusterSpec(model="/m", pin_cpus=args.pin_cpus, cores_per_engine=args.cores_per_engine)
    assert (engine_cores(spec, parse_layout(layout)) is not None) == expected
    command = up_command(spec, parse_layout(layout), log_dir="/tmp/logs")
    assert ("--pin-cpus" if expected else "--no-pin-cpus") in command
    assert pins_cpus(args.pin_cpus, len(components), len(cores)) == expected
