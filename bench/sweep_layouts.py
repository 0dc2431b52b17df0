"""xPyD layouts for `pdserve sweep`: parsing "1P2D" and "adaptive" (dual-role engines under the router's
adaptive policy), and where each layout's engines run (CPU cores or GPUs). Also the `--base-url NAME=URL` rows
of external servers."""

from __future__ import annotations

import re
from dataclasses import dataclass

LAYOUT_PATTERN = re.compile(r"(\d+)P(\d+)D", re.IGNORECASE)
ADAPTIVE_PATTERN = re.compile(r"adaptive(?::(\d+))?", re.IGNORECASE)
DEFAULT_ADAPTIVE_ENGINES = 2  # when no static layout is listed beside "adaptive"


@dataclass(frozen=True)
class Layout:
    num_prefill: int  # 0 = colocated: the decode engines prefill themselves
    num_decode: int
    num_dual: int = 0  # dual-role engines (`pdserve up --num-engines N --adaptive`); then no fixed roles

    @property
    def name(self) -> str:
        if self.num_dual:
            return "adaptive" if self.num_dual == DEFAULT_ADAPTIVE_ENGINES else f"adaptive:{self.num_dual}"
        return f"{self.num_prefill}P{self.num_decode}D"

    @property
    def num_engines(self) -> int:
        return self.num_prefill + self.num_decode + self.num_dual


@dataclass(frozen=True)
class ExternalServer:
    """An OpenAI-compatible server someone else started; one row of the sweep, counted as one engine."""
    name: str
    url: str
    num_engines: int = 1


def parse_layout(text: str, adaptive_engines: int = DEFAULT_ADAPTIVE_ENGINES) -> Layout:
    """'1P2D', or 'adaptive' (adaptive_engines dual-role engines) / 'adaptive:N'."""
    adaptive = ADAPTIVE_PATTERN.fullmatch(text.strip())
    if adaptive is not None:
        num_dual = int(adaptive.group(1)) if adaptive.group(1) else adaptive_engines
        if num_dual < 1:
            raise ValueError(f"config {text!r} has no engine: write adaptive:N with N >= 1")
        return Layout(0, 0, num_dual)
    match = LAYOUT_PATTERN.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"config {text!r} is not xPyD or adaptive: write prefill and decode engine counts, e.g. "
                         f"1P1D, 2P1D, or 0P2D (colocated), or adaptive[:N] (N dual-role engines)")
    layout = Layout(int(match.group(1)), int(match.group(2)))
    if layout.num_decode < 1:
        raise ValueError(f"config {text!r} has no decode engine: every layout needs at least one (e.g. 1P1D)")
    return layout


def parse_layouts(texts: list[str]) -> list[Layout]:
    """Every listed layout; a bare 'adaptive' gets as many engines as the largest static layout listed, so the
    comparison is at the same engine count."""
    static = [parse_layout(text) for text in texts if not ADAPTIVE_PATTERN.fullmatch(text.strip())]
    engines = max((layout.num_engines for layout in static), default=DEFAULT_ADAPTIVE_ENGINES)
    layouts = [parse_layout(text, engines) for text in texts]
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
