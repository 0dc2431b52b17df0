"""The router's view of a restarted engine: a Register with a new incarnation at a registered control address
replaces the entry at once, from whichever connection sent it (the old process cannot answer any more), and
decode engines hear the new incarnation in KVPeers. The router app runs in this process over real ZeroMQ;
the engines are registration sockets that never answer on a control link."""

from __future__ import annotations

import asyncio

from pdserve.control.messages import KVPeers, Register
from pdserve.control.sockets import ClientSocket
from tests.router.conftest import router_app, tiny_model, tokenization, wait_until  # noqa: F401 (fixtures)

OLD, NEW = "aaaa0000aaaa0000", "bbbb1111bbbb1111"


def prefill_register(incarnation: str) -> Register:
    return Register(engine_id="p0", role="prefill", control_address="tcp://127.0.0.1:21",
                    kv_address="tcp://127.0.0.1:22", block_size=4, max_model_len=512, vocab_size=1024,
                    incarnation=incarnation)


async def kv_peers_until(socket: ClientSocket, condition, timeout_s: float = 5.0) -> KVPeers:
    """The first KVPeers on a decode engine's registration link that meets condition."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        received = socket.recv(timeout=0)
        if received is not None and isinstance(received.msg, KVPeers) and condition(received.msg):
            return received.msg
        await asyncio.sleep(0.02)
    raise TimeoutError("no such KVPeers on the registration link")


def test_a_new_incarnation_replaces_the_entry_at_once_and_decode_engines_hear_it(
        tiny_model, tokenization):  # noqa: F811
    async def scenario():
        async with router_app(tiny_model, tokenization, heartbeat_timeout_s=30.0) as (gateway, _):
            registry = gateway.registry
            old, new, impostor = (ClientSocket(registry.registration_address) for _ in range(3))
            decode = ClientSocket(registry.registration_address)
            try:
                decode.send(Register(engine_id="d0", role="decode", control_address="tcp://127.0.0.1:23",
                                     block_size=4, max_model_len=512, vocab_size=1024, incarnation="dddd"))
                old.send(prefill_register(OLD))
                heard = await kv_peers_until(decode, lambda msg: msg.incarnations)
                assert heard.incarnations == {"tcp://127.0.0.1:22": OLD}
                first = registry.links["tcp://127.0.0.1:21"]

                impostor.send(prefill_register(OLD))  # the same process from another connection: refused
                await asyncio.sleep(0.3)
                assert registry.links["tcp://127.0.0.1:21"] is first

                new.send(prefill_register(NEW))  # the owner was heard just now, and the timeout is 30 s
                await wait_until(lambda: registry.links.get("tcp://127.0.0.1:21") not in (None, first), timeout=2.0,
                                 what="the new incarnation to replace the entry")
                assert registry.links["tcp://127.0.0.1:21"].info.incarnation == NEW
                heard = await kv_peers_until(decode, lambda msg: msg.incarnations.get("tcp://127.0.0.1:22") == NEW)
                assert heard.kv_addresses == ("tcp://127.0.0.1:22",)
            finally:
                for socket in (old, new, impostor, decode):
                    socket.close()
    asyncio.run(scenario())
