"""KV blocks one long request holds at its peak on a hybrid tiny model (sliding and full layers), with a block
table per layer group (sliding groups free what left their window) against one table for every layer.

    python experiments/hybrid_kv_blocks.py [--window 64] [--block-size 16] [--prompt 1024] [--new 64] [--pd]

--pd measures the decode engine of a 1P1D pair instead (real prefill and decode processes over loopback, the
prompt's KV over the KV link; Gemma 3 only): the decode engine runs through this file's `engine` mode, which
logs its peak and, with $HYBRID_KV_ONE_TABLE=1, keeps one table for every layer (the layout before).

Models (tiny, random weights, fp32, built under a temporary directory with transformers' config classes):
  gemma3  5 sliding : 1 full layers (6 layers: groups of one layer)
  gemma2  alternating sliding / full layers (4 layers: groups of two)
Each run generates once, colocated with chunked prefill (or disaggregated); the peak is read after every
allocation. Counts are layer-blocks (one layer's K and V for block-size tokens), so both layouts compare: a pool
block of the grouped layout holds a group's layers, one of the single table every layer's. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import transformers

from pdserve import LLM, SamplingParams
from pdserve.cli import main as pdserve_main
from pdserve.demo_model import make_demo_model
from pdserve.engine import model_runner
from pdserve.local_cluster import Driver, EngineProcess

PEAK_LINE = "peak KV layer-blocks: "  # tests/decode/peak_blocks_engine.py's log line
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
COMMON = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, query_pre_attn_scalar=16, bos_token_id=0, eos_token_id=1, pad_token_id=2)


def build_model(root: Path, name: str, window: int, max_len: int, tokenizer_dir: Path) -> str:
    if name == "gemma3":
        config = transformers.Gemma3TextConfig(num_hidden_layers=6, sliding_window=window, max_position_embeddings=max_len,
                                               **COMMON)
        config.architectures = ["Gemma3ForCausalLM"]
    else:
        config = transformers.Gemma2Config(num_hidden_layers=4, sliding_window=window, max_position_embeddings=max_len,
                                           **COMMON)
        config.architectures = ["Gemma2ForCausalLM"]
    torch.manual_seed(0)
    path = root / name
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    for file in TOKENIZER_FILES:
        if (tokenizer_dir / file).is_file():
            shutil.copy(tokenizer_dir / file, path / file)
    return str(path)


def peak_layer_blocks(model_dir: str, args, grouped: bool) -> tuple[int, list[int]]:
    """(peak layer-blocks in use, the generated tokens) for one request of args.prompt tokens."""
    original = model_runner.group_layers_by_window
    if not grouped:  # one table for every layer: the layout before layer groups
        model_runner.group_layers_by_window = lambda windows: None
    try:
        llm = LLM(model_dir, dtype="float32", block_size=args.block_size, num_kv_blocks=4096,
                  max_num_batched_tokens=args.chunk)
    finally:
        model_runner.group_layers_by_window = original
    runner, manager = llm.engine.runner, llm.kv_cache_manager
    layers_per_block = runner.kv_cache.shape[0]
    peak = [0]
    allocate = manager.allocate_slots

    def recording(*call_args, **kwargs):
        blocks = allocate(*call_args, **kwargs)
        peak[0] = max(peak[0], manager.num_used_blocks)
        return blocks

    manager.allocate_slots = recording
    prompt = [3 + (i * 7) % 1000 for i in range(args.prompt)]
    params = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
    tokens = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
    if manager.num_used_blocks:
        raise RuntimeError(f"{manager.num_used_blocks} blocks leaked")
    return peak[0] * layers_per_block, list(tokens)


def run_engine(argv: list[str]) -> int:
    """`pdserve ROLE ARGS...` logging its peak (the tests' recorder: EngineProcess puts the checkout on the path);
    one table for every layer with $HYBRID_KV_ONE_TABLE=1."""
    from tests.decode.peak_blocks_engine import record_peaks

    record_peaks()
    if os.environ.get("HYBRID_KV_ONE_TABLE") == "1":
        model_runner.group_layers_by_window = lambda windows: None
    return pdserve_main(argv)


def decode_peak(model_dir: str, args, grouped: bool, log_dir: Path) -> tuple[int, list[int], int]:
    """(the decode engine's peak layer-blocks, the generated tokens, KV bytes sent) for one 1P1D request."""
    engine_args = ("--block-size", str(args.block_size), "--num-kv-blocks", "4096", "--max-num-batched-tokens",
                   str(args.chunk), "--log-level", "WARNING")
    env = {"HYBRID_KV_ONE_TABLE": "0" if grouped else "1"}
    prefill = EngineProcess("prefill", model_dir, *engine_args, "--kv-streaming", "on", log_dir=log_dir, env=env,
                            module="experiments.hybrid_kv_blocks")
    decode = EngineProcess("decode", model_dir, *engine_args, *prefill.kv_peer_args(), log_dir=log_dir, env=env,
                           module="experiments.hybrid_kv_blocks")
    driver = Driver(decode, prefill)
    try:
        prompt = [3 + (i * 7) % 1000 for i in range(args.prompt)]
        tokens = driver.generate([prompt], temperature=0.0, max_tokens=args.new, ignore_eos=True)[0].token_ids
        decode_stats, prefill_stats = driver.wait_idle()
        if decode_stats.num_kv_transfers != 1 or decode_stats.kv_blocks_used or prefill_stats.kv_blocks_used:
            raise RuntimeError(f"the transfer failed or leaked blocks: {decode_stats}, {prefill_stats}")
    finally:
        driver.close()
        prefill.stop()
        decode.stop()
    peaks = [int(line.split(PEAK_LINE, 1)[1].split()[0]) for line in decode.log().splitlines() if PEAK_LINE in line]
    return max(peaks), list(tokens), prefill_stats.kv_bytes_sent


def main_pd(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tokenizer_dir = Path(make_demo_model(root / "demo", "llama", "tiny"))
        model_dir = build_model(root, "gemma3", args.window, args.prompt + args.new + 16, tokenizer_dir)
        print("| model (1P1D, decode engine) | window | block | prompt + new | one table | per-group tables | ratio "
              "| same tokens | KV bytes sent (one table, groups) |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
        before, tokens_before, sent_before = decode_peak(model_dir, args, grouped=False, log_dir=root)
        after, tokens_after, sent_after = decode_peak(model_dir, args, grouped=True, log_dir=root)
        print(f"| gemma3 (5 : 1) | {args.window} | {args.block_size} | {args.prompt} + {args.new} | {before} | {after} "
              f"| {after / before:.3f} | {tokens_before == tokens_after} | {sent_before:,}, {sent_after:,} |")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("prefill", "decode"):  # engine mode: EngineProcess(module=...)
        sys.exit(run_engine(sys.argv[1:]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=256, help="max_num_batched_tokens")
    parser.add_argument("--pd", action="store_true", help="the decode engine of a 1P1D pair (Gemma 3)")
    args = parser.parse_args()
    transformers.utils.logging.disable_progress_bar()
    if args.pd:
        main_pd(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tokenizer_dir = Path(make_demo_model(root / "demo", "llama", "tiny"))
        print("| model | layers (sliding : full) | window | block | prompt + new | one table | per-group tables "
              "| ratio | same tokens |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for name, (sliding, full) in {"gemma3": (5, 1), "gemma2": (2, 2)}.items():
            model_dir = build_model(root, name, args.window, args.prompt + args.new + 16, tokenizer_dir)
            before, tokens_before = peak_layer_blocks(model_dir, args, grouped=False)
            after, tokens_after = peak_layer_blocks(model_dir, args, grouped=True)
            print(f"| {name} | {sliding} : {full} | {args.window} | {args.block_size} | {args.prompt} + {args.new} "
                  f"| {before} | {after} | {after / before:.3f} | {tokens_before == tokens_after} |")


if __name__ == "__main__":
    main()
