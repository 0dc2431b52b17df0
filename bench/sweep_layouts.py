"""xPyD layouts for `pdserve sweep`: parsing "1P2D", and where each layout's engines run (CPU cores or
GPUs). Also the `--base-url NAME=URL` rows of external servers."""

from __future__ import annotations

import re
from dataclasses import dataclass

LAYOUT_PATTERN = re.compile(r"(\d+)P(\d+)D", re.IGNORECASE)


@dataclass(frozen=True)
class Layout:
    num_prefill: int  # 0 = colocated: the decode engines prefill themselves
    num_decode: int

    @property
    def name(self) -> str:
        return f"{self.num_prefill}P{self.num_decode}D"

    @property
    def num_engines(self) -> int:
        return self.num_prefill + self.num_decode


@dataclass(frozen=True)
class ExternalServer:
    """An OpenAI-compatible server someone else started; one row of the sweep, counted as one engine."""
    name: str
    url: str
    num_engines: int = 1


def parse_layout(text: str) -> Layout:
    match = LAYOUT_PATTERN.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"config {text!r} is not xPyD: write prefill and decode engine counts, e.g. 1P1D, "
                         f"2P1D, or 0P2D (colocated)")
    layout = Layout(int(match.group(1)), int(match.group(2)))
    if layout.num_decode < 1:
        raise ValueError(f"config {text!r} has no decode engine: every layout needs at least one (e.g. 1P1D)")
    return layout


def parse_layouts(texts: list[str]) -> list[Layout]:
    layouts = [parse_layout(text) for text in texts]
    names = [layout.name for layout in layouts]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"config {', '.join(repeated)} given twice: list each layout once")
    return layouts


def parse_external(text: str) -> ExternalServer:
    name, sep, url = text.partition("=")
    if not sep or not name.strip() or not url.strip().startswith(("http://", "https://")):
        raise ValueError(f"--base-url {text!r}: give NAME=URL, e.g. hf=http://127.0.0.1:8000")
    if LAYOUT_PATTERN.fullmatch(name.strip()):
        raise ValueError(f"--base-url {text!r}: the name {name!r} looks like a layout; choose another name")
    url = url.strip().rstrip("/")
    return ExternalServer(name.strip(), url.removesuffix("/v1"))  # its root, as bench takes it


def cpu_plan(layout: Layout, available: list[int], cores_per_engine: int = 1) -> list[int]:
    """The cores `pdserve up --pin-cpus` gets for this layout (it splits them among the engines): one core
    per engine (or `cores_per_engine`) as far as the machine has them, else all of them (engines share)."""
    if cores_per_engine < 1:
        raise ValueError(f"--cores-per-engine {cores_per_engine}: give 1 or more")
    if not available:
        raise ValueError("no CPU cores available to this process")
    wanted = layout.num_engines * cores_per_engine
    return sorted(available)[:wanted]


def parse_devices(spec: str | None) -> list[str] | None:
    if spec is None:
        return None
    devices = [d.strip() for d in spec.split(",") if d.strip()]
    if not devices:
        raise ValueError(f"--devices {spec!r} is empty: give comma-separated GPU indices, e.g. 0,1,2,3")
    return devices


def device_plan(layout: Layout, devices: list[str] | None) -> tuple[list[str], list[str]]:
    """(prefill GPUs, decode GPUs): one GPU per engine, the first ones to the prefill engines."""
    devices = devices if devices is not None else [str(i) for i in range(layout.num_engines)]
    if len(devices) < layout.num_engines:
        raise ValueError(f"config {layout.name} needs {layout.num_engines} GPUs (one per engine) but --devices gives "
                         f"{len(devices)} ({','.join(devices)}): list more, or drop the layout")
    return devices[:layout.num_prefill], devices[layout.num_prefill:layout.num_engines]
