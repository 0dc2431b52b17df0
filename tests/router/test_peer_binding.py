"""Registration is bound to the connection that registered: another peer can neither deregister an
engine nor rewrite its entry, while the engine itself still can. Decode engines hear the prefill KV
addresses they may pull from (KVPeers) on their registration link, as prefill engines come and go.
The router app runs in this process over real ZeroMQ, against scripted engines (fake_engine.py)."""

from __future__ import annotations

import asyncio

from pdserve.control.messages import Deregister, KVPeers, Register
from pdserve.control.sockets import ClientSocket
from tests.router.conftest import router_app, wait_until
from tests.router.fake_engine import FakeEngine
from tests.router.test_router_limits import completion, serving


def run(coro):
    return asyncio.run(coro)


def test_a_spoofed_deregister_or_register_is_refused(tiny_model, tokenization):
    async def scenario():
        async with router_app(tiny_model, tokenization) as (gateway, client):
            async with serving(gateway, engine_id="d0") as engine:
                spoofer = ClientSocket(gateway.registry.registration_address)
                try:
                    spoofer.send(Deregister(engine_id="d0", control_address=engine.control_address))
                    forged = engine.register_msg().model_copy(update={"max_model_len": 8, "engine_id": "forged"})
                    spoofer.send(forged)
                    await asyncio.sleep(0.5)  # five of the engine's heartbeats
                    link = gateway.registry.links[engine.control_address]
                    assert link.up, "a Deregister from another connection left the engine in routing"
                    assert link.info == engine.register_msg(), "another connection cannot rewrite the entry"
                    response = await client.post("/v1/completions", json=completion())
                    assert response.status_code == 200
                finally:
                    spoofer.close()
                engine.beating.clear()
                await asyncio.sleep(0.2)  # its thread no longer uses the registration socket
                engine._registration.send(Deregister(engine_id="d0", control_address=engine.control_address))
                await wait_until(lambda: engine.control_address not in gateway.registry.links,
                                 what="the engine's own Deregister to take it out")
    run(scenario())


def test_a_silent_owner_hands_the_entry_to_a_new_connection(tiny_model, tokenization):
    """A restarted engine registers from a new socket: once the old one is silent for the heartbeat
    timeout, the entry is the new connection's."""
    async def scenario():
        async with router_app(tiny_model, tokenization, heartbeat_timeout_s=1.0) as (gateway, _):
            async with serving(gateway, engine_id="d0", heartbeat_interval_s=0.1) as engine:
                engine.beating.clear()  # the old registration connection goes quiet
                successor = ClientSocket(gateway.registry.registration_address)
                try:
                    renamed = engine.register_msg().model_copy(update={"engine_id": "d0-restarted"})
                    successor.send(renamed)
                    await asyncio.sleep(0.3)
                    assert gateway.registry.links[engine.control_address].engine_id == "d0", "owner still beating"
                    await asyncio.sleep(1.2)
                    successor.send(renamed)
                    await wait_until(lambda: engine.control_address in gateway.registry.links and
                                     gateway.registry.links[engine.control_address].engine_id == "d0-restarted",
                                     what="the new connection to own the entry")
                finally:
                    successor.close()
    run(scenario())


async def next_kv_peers(socket: ClientSocket, timeout_s: float = 5.0) -> tuple[str, ...]:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        received = socket.recv(timeout=0)
        if received is not None and isinstance(received.msg, KVPeers):
            return received.msg.kv_addresses
        await asyncio.sleep(0.02)
    raise TimeoutError("no KVPeers on the registration link")


def test_decode_engines_hear_which_prefill_engines_they_may_pull_from(tiny_model, tokenization):
    async def scenario():
        async with router_app(tiny_model, tokenization) as (gateway, _):
            decode = ClientSocket(gateway.registry.registration_address)
            register = Register(engine_id="d9", role="decode", control_address="tcp://127.0.0.1:19",
                                block_size=4, max_model_len=512, vocab_size=1024)
            try:
                decode.send(register)
                assert await next_kv_peers(decode) == ()
                prefill = FakeEngine(router_address=gateway.registry.registration_address, role="prefill",
                                     engine_id="p0")
                try:
                    assert await next_kv_peers(decode) == (prefill.kv_address,)
                finally:
                    prefill.close()
                decode.send(register)  # every heartbeat is answered with the current list
                kv_peers = await next_kv_peers(decode)
                while kv_peers:  # the fake prefill engine's Deregister-less exit: until its link breaks
                    kv_peers = await next_kv_peers(decode)
                assert kv_peers == ()
            finally:
                decode.close()
    run(scenario())
