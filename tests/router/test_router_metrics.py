"""The router's per-engine series (unit test of router/metrics.py's EngineCollector over real EngineStats): a
dual-role engine's KV counters appear once per side, labelled with the role it took (so a transfer between two
dual engines is counted once on each side), its other series say "dual", and fixed-role engines' series are
as they were. Also: EngineStats carries the two sides over the wire, and an engine that sends none parses."""

from __future__ import annotations

from types import SimpleNamespace

import msgpack
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.control.messages import EngineStats, KVSideStats
from pdserve.control.protocol import decode, encode
from pdserve.router.metrics import EngineCollector

LOAD = {"num_waiting": 0, "num_running": 1, "kv_blocks_used": 3, "kv_blocks_total": 64, "queued_prefill_tokens": 0}
PREFILL_SIDE = KVSideStats(kv_bytes_sent=4096, num_kv_transfers=2, kv_transfer_seconds=0.25)
DECODE_SIDE = KVSideStats(kv_bytes_received=1024, num_kv_transfers=1, num_kv_transfers_failed=1,
                          kv_transfer_seconds=0.5)


def dual_stats() -> EngineStats:
    """A dual engine that served two prompts' KV, pulled one and gave one pull up: its totals are the sums."""
    return EngineStats(engine_id="engine-0", role="dual", **LOAD, prefix_cache_queries=40, prefix_cache_hits=8,
                       kv_bytes_sent=4096, kv_bytes_received=1024, num_kv_transfers=3, num_kv_transfers_failed=1,
                       kv_transfer_seconds=0.75, kv_prefill_side=PREFILL_SIDE, kv_decode_side=DECODE_SIDE)


def link(label: str, role: str, stats: EngineStats) -> SimpleNamespace:
    return SimpleNamespace(info=object(), label=label, role=role, up=True, num_inflight=1, stats=stats)


def series(*links: SimpleNamespace) -> dict[str, dict[tuple[str, str], float]]:
    """{sample name: {(engine, role): value}} of an EngineCollector over `links`."""
    registry = CollectorRegistry()
    registry.register(EngineCollector({item.label: item for item in links}))
    found: dict[str, dict[tuple[str, str], float]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            found.setdefault(sample.name, {})[(sample.labels["engine"], sample.labels["role"])] = sample.value
    return found


def test_a_dual_engines_kv_counters_are_one_series_per_side():
    found = series(link("engine-0", "dual", dual_stats()))
    assert found["pdserve_kv_transfers_total"] == {("engine-0", "prefill"): 2, ("engine-0", "decode"): 1}
    assert found["pdserve_kv_bytes_sent_total"] == {("engine-0", "prefill"): 4096, ("engine-0", "decode"): 0}
    assert found["pdserve_kv_bytes_received_total"] == {("engine-0", "prefill"): 0, ("engine-0", "decode"): 1024}
    assert found["pdserve_kv_transfers_failed_total"] == {("engine-0", "prefill"): 0, ("engine-0", "decode"): 1}
    assert found["pdserve_kv_transfer_seconds_total"] == {("engine-0", "prefill"): 0.25, ("engine-0", "decode"): 0.5}
    # the engine's other series keep its own role
    assert found["pdserve_prefix_cache_queries_total"] == {("engine-0", "dual"): 40}
    assert found["pdserve_kv_blocks_used"] == {("engine-0", "dual"): 3}
    assert found["pdserve_engine_up"] == {("engine-0", "dual"): 1}


def test_fixed_role_engines_keep_their_series_and_count_a_transfer_once_per_side():
    prefill = EngineStats(engine_id="prefill-0", role="prefill", **LOAD, kv_bytes_sent=512, num_kv_transfers=1,
                          kv_transfer_seconds=0.125)
    decode_ = EngineStats(engine_id="decode-0", role="decode", **LOAD, kv_bytes_received=512, num_kv_transfers=1,
                          kv_transfer_seconds=0.5)
    found = series(link("prefill-0", "prefill", prefill), link("decode-0", "decode", decode_),
                   link("engine-0", "dual", dual_stats()))
    assert found["pdserve_kv_transfers_total"] == {("prefill-0", "prefill"): 1, ("decode-0", "decode"): 1,
                                                   ("engine-0", "prefill"): 2, ("engine-0", "decode"): 1}
    assert found["pdserve_kv_bytes_sent_total"][("prefill-0", "prefill")] == 512
    decode_side = {key: value for key, value in found["pdserve_kv_transfers_total"].items() if key[1] == "decode"}
    assert sum(decode_side.values()) == 2, "each completed transfer once, on the side that pulled it"


def test_engine_stats_carry_both_sides_over_the_wire_and_older_stats_parse():
    stats = dual_stats()
    received, _ = decode(encode(stats))
    assert received == stats
    assert received.kv_prefill_side.num_kv_transfers == 2 and received.kv_decode_side.kv_bytes_received == 1024
    # an engine that predates the split sends no side: both read as zero
    header = msgpack.unpackb(encode(stats)[0])
    for name in ("kv_prefill_side", "kv_decode_side"):
        del header[name]
    older, _ = decode([msgpack.packb(header)])
    assert older.kv_prefill_side == older.kv_decode_side == KVSideStats()
    assert older.num_kv_transfers == 3
