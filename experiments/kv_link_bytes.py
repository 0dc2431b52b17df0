"""KV bytes on the link per request against a full-KV transfer of the same prompt, for sliding-window models,
on real prefill and decode processes over loopback.

    python experiments/kv_link_bytes.py [--window 64] [--block-size 16] [--multiples 4]

Models (tiny, random weights, fp32, built once under a temporary directory):
  mistral  every layer slides (the demo Mistral with --window)
  gemma3   5 sliding : 1 full layers (transformers' Gemma3TextConfig, 6 layers)
Each prompt is `multiples` x the window long, sent alone, new to both engines. A full transfer would send
every layer's K and V of every prompt token; a sliding layer sends only the blocks its window reaches from
the first decoded token (docs/design/kv-link.md). The bound is window/prompt x the sliding layers' share +
the full layers' share. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch
import transformers

from pdserve.demo_model import make_demo_model
from pdserve.engine.config import ModelConfig
from pdserve.local_cluster import Driver, EngineProcess

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def build_models(root: Path, window: int, max_len: int) -> dict[str, str]:
    mistral = make_demo_model(root / "mistral", "mistral", "tiny",
                              config_overrides={"sliding_window": window, "max_position_embeddings": max_len})
    config = transformers.Gemma3TextConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=window, max_position_embeddings=max_len,
        query_pre_attn_scalar=16, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(0)
    gemma3 = root / "gemma3"
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(gemma3)
    for name in TOKENIZER_FILES:
        if (Path(mistral) / name).is_file():
            shutil.copy(Path(mistral) / name, gemma3 / name)
    return {"mistral": str(mistral), "gemma3": str(gemma3)}


def measure(model_dir: str, prompt_len: int, block_size: int, log_dir: Path) -> int:
    """KV payload bytes the prefill engine sent for one request of prompt_len tokens."""
    args = ("--block-size", str(block_size), "--num-kv-blocks", "1024", "--dtype", "float32",
            "--log-level", "WARNING")
    prefill = EngineProcess("prefill", model_dir, *args, "--kv-streaming", "on", log_dir=log_dir)
    decode = EngineProcess("decode", model_dir, *args, *prefill.kv_peer_args(), log_dir=log_dir)
    driver = Driver(decode, prefill)
    try:
        prompt = [3 + (i * 7) % 1000 for i in range(prompt_len)]
        driver.generate([prompt], temperature=0.0, max_tokens=4, ignore_eos=True)
        decode_stats, prefill_stats = driver.wait_idle()
        if decode_stats.num_kv_transfers != 1 or decode_stats.kv_blocks_used or prefill_stats.kv_blocks_used:
            raise RuntimeError(f"the transfer failed or leaked blocks: {decode_stats}, {prefill_stats}")
        return prefill_stats.kv_bytes_sent
    finally:
        driver.close()
        prefill.stop()
        decode.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--multiples", type=int, nargs="+", default=[4])
    args = parser.parse_args()
    transformers.utils.logging.disable_progress_bar()
    prompt_lens = [m * args.window for m in args.multiples]
    print("| model | layers (sliding : full) | window | block | prompt | bytes sent | full-KV bytes | ratio | bound |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, model_dir in build_models(root, args.window, 2 * max(prompt_lens)).items():
            config = ModelConfig.from_hf(model_dir, dtype="float32")
            windows = [config.sliding_window_of(layer) for layer in range(config.num_layers)]
            sliding = sum(w is not None for w in windows)
            token_bytes = 2 * config.num_kv_heads * config.head_dim * 4  # one layer's K and V of one token
            for prompt_len in prompt_lens:
                sent = measure(model_dir, prompt_len, args.block_size, root)
                full = config.num_layers * prompt_len * token_bytes
                bound = (args.window / prompt_len * sliding + (len(windows) - sliding)) / len(windows)
                print(f"| {name} | {sliding} : {len(windows) - sliding} | {args.window} | {args.block_size} | "
                      f"{prompt_len} | {sent:,} | {full:,} | {sent / full:.3f} | {bound:.3f} |")


if __name__ == "__main__":
    main()
