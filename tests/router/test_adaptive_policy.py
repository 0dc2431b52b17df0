"""`--routing adaptive` in the router: the policy over the router's ledger (EngineLink-like objects), and through
the real router app over real ZeroMQ against scripted engines: the path it takes, its /metrics, a ledger back
at zero; dual-role engines in both pools and their KV peers."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.control.messages import EngineStats, Register
from pdserve.control.schema import ROLES
from pdserve.router.adaptive_policy import DEFAULT_HORIZON_TOKENS, AdaptivePolicy, make_policy
from pdserve.router.config import RouterConfig
from pdserve.router.errors import NoEngineAvailable
from pdserve.router.policies import PromptHashes, RoutingPolicy
from tests.router.conftest import router_app, wait_until
from tests.router.fake_engine import FakeEngine

BLOCK = 4


@dataclass
class Link:
    """The parts of router.link.EngineLink that the adaptive policy reads: the ledger's figures."""

    control_address: str
    role: str = "dual"
    num_decoding: int = 0
    decode_tokens: int = 0
    queued_prefill_tokens: int = 0
    queued_prefill_squares: int = 0
    prefilling: dict = field(default_factory=dict)
    open_tokens: int = 0
    up: bool = True
    label: str = ""
    info: Register = field(init=False)
    stats: EngineStats = field(init=False)

    def __post_init__(self) -> None:
        self.label = self.control_address
        self.info = Register.model_construct(engine_id=self.control_address, role=self.role,
                                             control_address=self.control_address, kv_address="tcp://127.0.0.1:9",
                                             block_size=BLOCK, max_model_len=4096, vocab_size=1024)
        self.stats = EngineStats.model_construct(engine_id=self.control_address, role=self.role, num_waiting=0,
                                                 num_running=0, kv_blocks_used=0, kv_blocks_total=10_000,
                                                 queued_prefill_tokens=0)


def adaptive(**overrides) -> AdaptivePolicy:
    settings = {"routing": "adaptive", "slo_ttft_ms": 8000, "slo_tpot_ms": 300, "adaptive_lean_interval_s": 0.0,
                **overrides}
    return make_policy(RouterConfig(model="m", served_model_name="m", **settings))


def test_the_routing_option_picks_the_policy_and_refuses_unknown_ones():
    assert type(make_policy(RouterConfig(model="m", served_model_name="m"))) is RoutingPolicy
    assert isinstance(adaptive(), AdaptivePolicy)
    with pytest.raises(ValueError, match="routing 'smart' is unknown"):
        RouterConfig(model="m", served_model_name="m", routing="smart")
    with pytest.raises(ValueError, match="SLOs"):
        RouterConfig(model="m", served_model_name="m", slo_tpot_ms=0)


def test_a_long_prompt_prefills_on_the_engine_with_fewest_decodes_and_is_counted():
    policy = adaptive()
    busy = Link("a", num_decoding=8, decode_tokens=8 * 300)
    light = Link("b", num_decoding=1, decode_tokens=300)
    route = policy.route(list(range(1000)), [busy, light], [busy, light])
    assert (route.prefill or route.decode) is light
    assert route.num_uncached_tokens == 1000
    assert sum(policy.decisions.values()) == 1


def test_the_same_engine_on_both_sides_is_one_local_route():
    policy = adaptive()
    a, b = Link("a"), Link("b", num_decoding=3, decode_tokens=600)
    route = policy.route(list(range(20)), [a, b], [a, b])
    assert route.decode is a and route.prefill is None, "idle a prefills and decodes its own request"
    assert policy.decisions == {"local": 1, "disaggregated": 0}


def test_fixed_role_engines_and_force_local():
    policy = adaptive()
    prefill = Link("p", role="prefill")
    decode = Link("d", role="decode", num_decoding=6, decode_tokens=1200)
    route = policy.route(list(range(1000)), [prefill], [decode])
    assert (route.prefill, route.decode) == (prefill, decode)
    assert policy.route(list(range(1000)), [prefill], [decode], force_local=True).prefill is None
    assert policy.decisions == {"local": 1, "disaggregated": 1}
    threshold = adaptive(local_prefill_threshold=1000)
    assert threshold.route(list(range(1000)), [prefill], [decode]).prefill is None, "--local-prefill-threshold holds"
    assert threshold.route(list(range(5000, 6001)), [prefill], [decode]).prefill is prefill
    with pytest.raises(NoEngineAvailable):
        policy.route([1, 2, 3], [prefill], [])


def test_a_prefix_hit_counts_against_the_uncached_part_only():
    policy = adaptive()
    a, b = Link("a"), Link("b")
    prompt = list(range(400))
    first = policy.route(prompt, [a, b], [a, b])
    again = policy.route(prompt + [1, 2, 3, 4], [a, b], [a, b])
    assert again.decode is first.decode and again.num_uncached_tokens == 4 + 0  # 400 cached, in 100 blocks


def test_finished_outputs_teach_the_horizon():
    policy = adaptive()
    link = Link("a")
    prompt = PromptHashes(list(range(10)))
    for _ in range(200):
        policy.record_output(link, list(range(10)) + [0] * 300, prompt)
    assert policy.horizon_tokens > DEFAULT_HORIZON_TOKENS * 4


def test_the_lean_loop_runs_on_the_routing_path_and_counts_its_changes():
    """Long prompts while both engines decode: the step model predicts a dedicated prefill engine better (no
    decode is stalled by a prefill), so the engine decoding least leans to prefill; short prompts and long answers
    after: both engines decoding is better, and it leans back."""
    policy = adaptive(adaptive_lean_interval_s=10.0, slo_ttft_ms=15000, slo_tpot_ms=90)
    policy.horizon_tokens = 48
    now = [0.0]
    policy.clock = lambda: now[0]
    engines = [Link("a", num_decoding=4, decode_tokens=4000), Link("b", num_decoding=3, decode_tokens=3000)]
    for step in range(8):  # a 1,000-token prompt every 6 s
        now[0] = step * 6.0
        policy.route(list(range(step * 1000, step * 1000 + 1000)), engines, engines)
    assert policy.lean_changes == {"prefill": 1, "decode": 0, "none": 0}
    assert (policy.lean_of("b"), policy.lean_of("a")) == (1, 0)  # b decoded least
    policy.horizon_tokens = 256
    engines[0].num_decoding, engines[0].decode_tokens = 16, 16 * 300
    engines[1].num_decoding, engines[1].decode_tokens = 0, 0
    for step in range(8, 40):  # a 128-token prompt every 2 s, long answers
        now[0] = 48.0 + (step - 8) * 2.0
        policy.route(list(range(step * 1000, step * 1000 + 128)), engines, engines)
    assert policy.lean_changes == {"prefill": 1, "decode": 0, "none": 1} and policy.lean_of("b") == 0
    engines[1].up = False
    policy.forget(engines[1])  # the registry's on_change: b left routing
    assert policy.lean_of("b") == 0


# ---- through the router, on real sockets ----

def _metrics(text: str) -> dict:
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_adaptive_router_sends_a_long_prompt_to_the_idle_prefill_engine(tiny_model, tokenization):
    """A short prompt on idle engines colocates; while the decode engine streams three answers, a 400-token prompt
    is prefilled on the prefill engine (the model predicts a local prefill stalls those decodes); /metrics counts
    every decision by path, and the ledger is back at zero after."""
    async def scenario():
        async with router_app(tiny_model, tokenization, routing="adaptive", slo_ttft_ms=8000,
                              slo_tpot_ms=60) as (gateway, client):
            registration = gateway.registry.registration_address
            prefill = FakeEngine(role="prefill", engine_id="p", router_address=registration, first_token=True,
                                 heartbeat_interval_s=0.05)
            decode = FakeEngine(engine_id="d", router_address=registration, heartbeat_interval_s=0.05,
                                token_delay_s=0.05)
            try:
                await wait_until(lambda: sum(link.up for link in gateway.registry.links.values()) == 2,
                                 what="engines in routing")
                short = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3})
                assert short.status_code == 200 and not prefill.received, "an idle engine colocates a short prompt"
                streams = [asyncio.create_task(client.post("/v1/completions", json={
                    "prompt": [9, 10, 11, i], "max_tokens": 60})) for i in range(3)]
                await wait_until(lambda: len(decode.active) == 3, what="three answers streaming")
                long = await client.post("/v1/completions", json={"prompt": list(range(1, 401)), "max_tokens": 3})
                assert long.status_code == 200, long.text
                long_prefill = [msg for msg in prefill.received if len(msg.prompt_token_ids) == 400]
                assert len(long_prefill) == 1, "the long prompt went to the prefill engine"
                assert [response.status_code for response in await asyncio.gather(*streams)] == [200] * 3
                metrics = _metrics((await client.get("/metrics")).text)
                decisions = {path: metrics[("pdserve_router_routing_decisions_total", (("path", path),))]
                             for path in ("local", "disaggregated")}
                assert decisions["local"] >= 1 and decisions["disaggregated"] == len(prefill.received) >= 1
                assert sum(decisions.values()) == 5
                links = gateway.registry.links.values()
                assert all(link.open_tokens == 0 and not link.prefilling and link.queued_prefill_tokens == 0
                           for link in links)
            finally:
                prefill.close()
                decode.close()
    asyncio.run(scenario())


@pytest.mark.skipif("dual" not in ROLES, reason="the dual role is not in the control protocol yet (helper A)")
def test_dual_engines_are_in_both_pools_and_hear_every_kv_address(tiny_model, tokenization):
    async def scenario():
        async with router_app(tiny_model, tokenization, routing="adaptive") as (gateway, client):
            registration = gateway.registry.registration_address
            engines = [FakeEngine(role="dual", engine_id=f"e{i}", router_address=registration,
                                  heartbeat_interval_s=0.05) for i in range(2)]
            for index, engine in enumerate(engines):
                engine.kv_address = f"tcp://127.0.0.1:{19000 + index}"
            try:
                await wait_until(lambda: len(gateway.registry.engines("prefill")) == 2
                                 and len(gateway.registry.engines("decode")) == 2, what="dual engines in both pools")
                assert sorted(gateway.registry._current_kv_peers()) == ["tcp://127.0.0.1:19000",
                                                                        "tcp://127.0.0.1:19001"]
                health = (await client.get("/health")).json()
                assert health["engines"] == {"prefill": 2, "decode": 2}
                answer = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3})
                assert answer.status_code == 200
                assert sum(len(engine.generate_requests()) for engine in engines) == 1
                assert not any(msg.prefill_kv_address for engine in engines for msg in engine.generate_requests())
            finally:
                for engine in engines:
                    engine.close()
    asyncio.run(scenario())


# ---- the command line ----

@pytest.mark.parametrize(("argv", "words"), [
    (["up", "--num-engines", "2"], ["--num-engines 2", "add --adaptive"]),
    (["up", "--adaptive", "--num-engines", "0"], ["--num-engines 0", "at least one"]),
    (["up", "--adaptive", "--slo", "ttft:fast"], ["--slo 'ttft:fast'", "METRIC:MILLISECONDS"]),
    (["router", "--routing", "adaptive", "--slo", "e2el:100"], ["--slo 'e2el:100'", "ttft or tpot"]),
    (["router", "--routing", "adaptive", "--step-profile", "/nonexistent.json"], ["cannot read it"]),
    (["up", "--adaptive", "--adaptive-lean-interval", "-1"], ["--adaptive-lean-interval", ">= 0"]),
])
def test_refused_flags_name_the_problem_before_anything_starts(argv, words, capsys):
    from pdserve.cli import main

    assert main(argv) != 0
    error = capsys.readouterr().err
    assert all(word in error for word in words), error


def test_router_flags_become_the_routing_settings():
    from pdserve.cli import build_parser
    from pdserve.router_cli import router_config

    args = build_parser().parse_args(["router", "--routing", "adaptive", "--slo", "ttft:900", "tpot:80",
                                      "--adaptive-lean-interval", "2", "--registration-address", "none",
                                      "--decode-address", "tcp://127.0.0.1:5", "--insecure"])
    config = router_config(args)
    assert (config.routing, config.slo_ttft_ms, config.slo_tpot_ms, config.adaptive_lean_interval_s) == (
        "adaptive", 900.0, 80.0, 2.0)


def test_up_adaptive_starts_dual_role_engines_and_the_adaptive_router(tmp_path):
    from pdserve.cli import build_parser
    from pdserve.up import _check_engines, engine_components, router_component

    args = build_parser().parse_args(["up", "--adaptive", "--num-engines", "3", "--slo", "ttft:900",
                                      "--insecure", "--engine-port-base", "6000"])
    _check_engines(args)
    engines = engine_components(args, "m", "tcp://127.0.0.1:7000")
    assert [engine.name for engine in engines] == ["engine-0", "engine-1", "engine-2"]
    assert all(engine.command[3] == "engine" for engine in engines)
    assert engines[1].command[engines[1].command.index("--kv-address") + 1] == "tcp://127.0.0.1:6003"
    router = router_component(args, "m", "m").command
    assert router[router.index("--routing") + 1] == "adaptive"
    assert router[router.index("--slo") + 1:router.index("--slo") + 2] == ["ttft:900"]


def test_a_dual_engine_given_by_static_address_serves_both_pools(tiny_model, tokenization):
    engine = FakeEngine(role="dual", engine_id="static-dual")
    engine.kv_address = "tcp://127.0.0.1:19002"

    async def scenario():
        async with router_app(tiny_model, tokenization, routing="adaptive", registration_address=None,
                              decode_addresses=(engine.control_address,)) as (gateway, client):
            await wait_until(lambda: len(gateway.registry.engines("decode")) == 1, what="the static engine routable")
            assert [link.control_address for link in gateway.registry.engines("prefill")] == [engine.control_address]
            answer = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3})
            assert answer.status_code == 200 and len(engine.generate_requests()) == 1
    try:
        asyncio.run(scenario())
    finally:
        engine.close()
