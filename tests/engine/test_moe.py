"""Mixture-of-experts models (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE) from hub-format
checkpoints: greedy output equals transformers' generate() token for token in fp32 (colocated, and
prefill -> decode over the real KV link), within the rounding rule in bf16; no block leaks; the
routing and the grouped expert computation against plain per-token arithmetic."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from pdserve import LLM, SamplingParams
from pdserve.engine.config import ModelConfig
from pdserve.engine.layers.moe import ExpertWeights, SparseMoE, select_experts
from pdserve.engine.loader import ModelLoadError, load_model
from pdserve.engine.models.registry import resolve_model_class
from pdserve.engine.config import ConfigError
from pdserve.engine.models.sparse_moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from pdserve.engine.models.transformers_moe import TransformersMoEForCausalLM
from tests.engine.moe_models import BACKEND_CASES, MOE_CASES, VOCAB_SIZE, make_moe_model_dir, model_dir_cache
from tests.engine.parity import assert_greedy_match, hf_greedy
from tests.engine.test_llm_parity import GREEDY_WITH_LOGPROBS, NEW_TOKENS, make_prompts, run_parity

NUM_KV_BLOCKS = 256  # of 4 tokens: room for every prompt at once
NATIVE_CLASSES = {"mixtral": MixtralForCausalLM, "qwen2-moe": Qwen2MoeForCausalLM, "qwen3-moe": Qwen3MoeForCausalLM}


@pytest.fixture(scope="module")
def moe_model_dir(model_factory, tmp_path_factory):
    """make(case, dtype="float32") -> a tiny MoE model dir in the hub's per-expert format."""
    tokenizer_dir = model_factory("llama")
    return model_dir_cache(tmp_path_factory,
                           lambda out, case, dtype: make_moe_model_dir(out, case, tokenizer_dir, dtype))


# ---------------------------------------------------------------------------------------------
# Greedy parity with transformers' generate()
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_greedy_matches_transformers_fp32(moe_model_dir, case):
    """Batched prompts of many lengths, chunked prefills (16-token steps), prefix-cache hits; every
    block free at the end (run_parity)."""
    llm = run_parity(moe_model_dir(case), make_prompts(VOCAB_SIZE), max_num_batched_tokens=16,
                     num_kv_blocks=NUM_KV_BLOCKS)
    assert type(llm.engine.runner.model) is NATIVE_CLASSES[case]


def test_qwen2_moe_with_renormalised_top_k_matches_transformers(moe_model_dir):
    """Qwen2-MoE with norm_topk_prob true: the top-k weights divided by their sum, as transformers' Qwen2-MoE
    does when the flag is set (the default case leaves them as they are); fp32 greedy parity, colocated."""
    model_dir = moe_model_dir("qwen2-moe-norm-topk")
    llm = run_parity(model_dir, make_prompts(VOCAB_SIZE)[:6], max_num_batched_tokens=16, num_kv_blocks=NUM_KV_BLOCKS)
    model = llm.engine.runner.model
    assert type(model) is Qwen2MoeForCausalLM
    moe_layers = [module for module in model.modules() if isinstance(module, SparseMoE)]
    assert moe_layers and all(layer.renormalize for layer in moe_layers)


# transformers applies rotary in bf16 (cos/sin rounded to bf16), pdserve in fp32. On this Qwen3-MoE
# model the difference moves one token's router logits enough to swap an expert at prompt 4, step 5,
# and the next logits then differ by more than rounding. With transformers' rotary in fp32 the two
# agree (test_bf16_matches_transformers_with_fp32_rotary); the MoE layer alone is bit-equal in bf16.
ROTARY_ROUNDING_SWAPS_AN_EXPERT = pytest.mark.xfail(
    strict=True, reason="transformers rounds rotary to bf16, pdserve does not; one expert choice flips")
BF16_CASES = [pytest.param(c, marks=ROTARY_ROUNDING_SWAPS_AN_EXPERT) if c == "qwen3-moe" else c for c in MOE_CASES]


def _fp32_rotary(apply_rotary):
    def apply(q, k, cos, sin, *args, **kwargs):
        q32, k32 = apply_rotary(q.float(), k.float(), cos.float(), sin.float(), *args, **kwargs)
        return q32.to(q.dtype), k32.to(k.dtype)

    return apply


@pytest.mark.parametrize("case", BF16_CASES)
def test_greedy_matches_transformers_bf16(moe_model_dir, case):
    """bf16 weights, computed in bf16 by both: equal up to a near tie within the rounding rule of
    tests/engine/parity.py, chosen tokens' logprobs within it too."""
    assert_bf16_parity(moe_model_dir(case, "bfloat16"))


def test_bf16_matches_transformers_with_fp32_rotary(moe_model_dir, monkeypatch):
    """The xfailed Qwen3-MoE case again, transformers' rotary computed in fp32 as pdserve's is."""
    import transformers.models.qwen3_moe.modeling_qwen3_moe as qwen3_moe

    monkeypatch.setattr(qwen3_moe, "apply_rotary_pos_emb", _fp32_rotary(qwen3_moe.apply_rotary_pos_emb))
    assert_bf16_parity(moe_model_dir("qwen3-moe", "bfloat16"))


def assert_bf16_parity(model_dir: str) -> None:
    prompts = make_prompts(VOCAB_SIZE, seed=6)
    llm = LLM(model_dir, dtype="bfloat16", block_size=4, max_num_batched_tokens=32, num_kv_blocks=NUM_KV_BLOCKS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY_WITH_LOGPROBS)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        theirs, logits = hf_greedy(reference, prompt, NEW_TOKENS)
        completion = output.outputs[0]
        assert_greedy_match(completion.token_ids, theirs, logits, f"prompt {i} (len {len(prompt)})",
                            completion.logprobs, dtype=torch.bfloat16)
    assert llm.kv_cache_manager.num_used_blocks == 0
    llm.kv_cache_manager.check_invariants()


@pytest.mark.parametrize("case", [*MOE_CASES, *BACKEND_CASES])
def test_disaggregated_matches_transformers(moe_model_dir, case, tmp_path):
    """Prefill and decode in separate processes, KV over the real link: the tokens equal transformers'
    generate(), the KV bytes are the layout's, and neither side leaks a block."""
    from pdserve.local_cluster import Driver
    from tests.decode.test_disaggregated import PROMPTS, assert_no_leaks, start_pair

    model_dir = moe_model_dir(case)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = [hf_greedy(reference, prompt, 8)[0] for prompt in PROMPTS]
    prefill, decode = start_pair(model_dir, tmp_path)
    driver = Driver(decode, prefill)
    try:
        results = driver.generate(PROMPTS, temperature=0.0, max_tokens=8, ignore_eos=True)
        assert [r.token_ids for r in results] == expected
        stats = driver.decode_stats()
        assert stats.num_kv_transfers == len(PROMPTS) and stats.num_kv_transfers_failed == 0
        config = ModelConfig.from_hf(model_dir)
        per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4  # K and V, fp32
        assert stats.kv_bytes_received == driver.prefill_stats().kv_bytes_sent == per_token * sum(map(len, PROMPTS))
        assert_no_leaks(driver)
    finally:
        driver.close()
        prefill.stop()
        decode.stop()


@pytest.mark.parametrize("case, model_impl", [("olmoe", "auto"), ("mixtral", "transformers")])
def test_transformers_backend_moe_matches_transformers(moe_model_dir, case, model_impl):
    """An MoE architecture without native code (OLMoE), and a native one forced onto the backend: the
    hub's per-expert tensors converted by transformers' own conversion mapping, the experts run on
    pdserve's grouped GEMM, greedy-equal to generate()."""
    llm = run_parity(moe_model_dir(case), make_prompts(VOCAB_SIZE, seed=7), max_num_batched_tokens=16,
                     num_kv_blocks=NUM_KV_BLOCKS, model_impl=model_impl)
    model = llm.engine.runner.model
    assert type(model) is TransformersMoEForCausalLM and model.experts_implementation == "pdserve"


# ---------------------------------------------------------------------------------------------
# Routing and the grouped expert computation, against plain per-token arithmetic
# ---------------------------------------------------------------------------------------------


def test_routing_normalisation():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 3.5, 0.0]])
    probs = torch.softmax(logits, dim=-1)
    weights, ids = select_experts(logits, top_k=2, renormalize=False)
    assert ids.tolist() == [[0, 1], [2, 1]]
    torch.testing.assert_close(weights, probs.gather(1, ids))  # Qwen with norm_topk_prob false
    weights, _ = select_experts(logits, top_k=2, renormalize=True)
    torch.testing.assert_close(weights, probs.gather(1, ids) / probs.gather(1, ids).sum(-1, keepdim=True))
    assert weights.dtype == torch.float32


@pytest.mark.parametrize("num_tokens, top_k", [(1, 2), (9, 3), (40, 1)])
def test_experts_equal_per_token_arithmetic(num_tokens, top_k):
    """Each token's output is the weighted sum of its chosen experts' gated MLPs; experts no token
    chose are skipped, and one chosen by many tokens computes them in one group."""
    gen = torch.Generator().manual_seed(num_tokens)
    experts = ExpertWeights(num_experts=5, hidden_size=16, intermediate_size=8)
    experts.gate_up_proj.data.normal_(generator=gen)
    experts.down_proj.data.normal_(generator=gen)
    hidden = torch.randn(num_tokens, 16, generator=gen)
    weights, ids = select_experts(torch.randn(num_tokens, 5, generator=gen), top_k, renormalize=True)
    expected = torch.zeros_like(hidden)
    for t in range(num_tokens):
        for weight, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate, up = (experts.gate_up_proj[e] @ hidden[t]).chunk(2)
            expected[t] += weight * (experts.down_proj[e] @ (F.silu(gate) * up))
    torch.testing.assert_close(experts(hidden, weights, ids), expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Loading and routing to native code
# ---------------------------------------------------------------------------------------------


def test_fused_expert_checkpoint_loads_alike(moe_model_dir, tmp_path):
    """A checkpoint that already holds the experts fused (transformers 5's in-memory names,
    mlp.experts.gate_up_proj [E, 2I, H]) loads into the same weights as the hub's per-expert one."""
    model_dir = moe_model_dir("qwen2-moe")
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    shutil.copy(f"{model_dir}/config.json", fused_dir / "config.json")
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, fused_dir / "model.safetensors")
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in reference.state_dict())
    hub, fused = (load_model(ModelConfig.from_hf(d, dtype="float32")) for d in (model_dir, fused_dir))
    for (name, ours), (_, theirs) in zip(hub.state_dict().items(), fused.state_dict().items()):
        assert torch.equal(ours, theirs), name


def test_moe_architectures_resolve_to_native_code_or_the_moe_backend(moe_model_dir):
    for case, native in NATIVE_CLASSES.items():
        assert resolve_model_class(ModelConfig.from_hf(moe_model_dir(case))) is native
        forced = ModelConfig.from_hf(moe_model_dir(case), model_impl="transformers")
        assert resolve_model_class(forced) is TransformersMoEForCausalLM
    for case in BACKEND_CASES:
        assert resolve_model_class(ModelConfig.from_hf(moe_model_dir(case))) is TransformersMoEForCausalLM


def test_missing_expert_tensor_is_named(moe_model_dir, tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(moe_model_dir("mixtral"), model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    tensors.pop("model.layers.1.block_sparse_moe.experts.2.w3.weight")
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing 1 tensor.*layers\.1\.mlp\.experts\.gate_up_proj\[\(2, 'up'\)\]"):
        load_model(ModelConfig.from_hf(model_dir, dtype="float32"))


def _with_config(model_dir: str, tmp_path, **changes) -> str:
    import json

    target = tmp_path / "model"
    shutil.copytree(model_dir, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **changes}))
    return str(target)


def test_qwen_sparse_layers_follow_transformers_rule(moe_model_dir, tmp_path):
    """decoder_sparse_step 2 makes layers 1, 3, ... sparse; mlp_only_layers turns listed ones dense."""
    model_dir = _with_config(moe_model_dir("qwen3-moe"), tmp_path, num_hidden_layers=4, decoder_sparse_step=2,
                             mlp_only_layers=[3])
    spec = Qwen3MoeForCausalLM.moe_spec(ModelConfig.from_hf(model_dir))
    assert spec.sparse_layers == (False, True, False, False)
    assert (spec.num_experts, spec.top_k, spec.renormalize) == (8, 2, True)


def test_moe_config_errors_name_the_fix(moe_model_dir, tmp_path):
    model_dir = _with_config(moe_model_dir("mixtral"), tmp_path, hidden_act="gelu")
    with pytest.raises(ConfigError, match="hidden_act='gelu'.*model_impl='transformers'"):
        load_model(ModelConfig.from_hf(model_dir, dtype="float32"))
    broken = _with_config(moe_model_dir("mixtral"), tmp_path / "other", num_local_experts=0)
    with pytest.raises(ConfigError, match="needs a positive integer `num_local_experts`, got 0"):
        load_model(ModelConfig.from_hf(broken, dtype="float32"))
