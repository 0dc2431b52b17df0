"""KVPeerTrust with several routers: each router's KVPeers list replaces only that router's earlier one,
and an address is trusted while any router (or --kv-peer) lists it."""

from __future__ import annotations

from pdserve.decode.kv_peers import KVPeerTrust


def test_each_router_replaces_only_its_own_list():
    trust = KVPeerTrust(configured=("tcp://10.0.0.9:5700",))
    trust.update_from_router(("tcp://10.0.0.3:5700",), router="tcp://10.0.0.11:7000")
    trust.update_from_router(("tcp://10.0.0.4:5700",), router="tcp://10.0.0.12:7000")
    assert trust.checked("tcp://10.0.0.3:5700") == "tcp://10.0.0.3:5700"
    assert trust.checked("tcp://10.0.0.4:5700") == "tcp://10.0.0.4:5700"
    trust.update_from_router((), router="tcp://10.0.0.11:7000")  # the first router no longer lists it
    assert trust.checked("tcp://10.0.0.3:5700") is None
    assert trust.checked("tcp://10.0.0.4:5700") == "tcp://10.0.0.4:5700", "the second router's list stands"
    assert trust.checked("tcp://10.0.0.9:5700") == "tcp://10.0.0.9:5700", "--kv-peer stays trusted"
    assert trust.checked("tcp://10.6.6.6:5700") is None and trust.num_refused == 2
