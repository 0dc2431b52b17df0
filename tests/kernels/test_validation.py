"""The Triton wrappers reject bad arguments with a ValueError that names the argument."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.triton_decode_attention import paged_decode_attention
from pdserve.kernels.triton_kv_transfer import kv_pack, kv_unpack
from pdserve.kernels.triton_norm import add_rms_norm
from pdserve.kernels.triton_prefill_attention import paged_prefill_attention
from pdserve.kernels.triton_rotary import rotary_embedding
from pdserve.kernels.triton_store_kv import store_kv


def _decode_args(**changes):
    args = dict(
        query=torch.randn(2, 4, 64),
        key_cache=torch.randn(5, 16, 2, 64),
        value_cache=torch.randn(5, 16, 2, 64),
        block_tables=torch.zeros(2, 3, dtype=torch.int32),
        seq_lens=torch.ones(2, dtype=torch.int32),
        scale=0.125,
    )
    return args | changes


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(block_tables=torch.zeros(2, 3, dtype=torch.int64)), "block_tables has dtype torch.int64"),
        (dict(seq_lens=torch.ones(3, dtype=torch.int32)), r"seq_lens has shape \(3,\)"),
        (dict(query=torch.randn(2, 3, 64)), "multiple of num_kv_heads"),
        (dict(query=torch.randn(2, 4, 64, dtype=torch.float16)), "dtypes differ"),
        (dict(query=torch.randn(2, 4, 64, 2)[..., 0]), "stride 2 in its last dimension"),
        (dict(query=torch.randn(2, 4, 32)), r"key_cache has shape .*head_dim"),
        (dict(query=torch.randn(8, 64)), "query must have 3 dimensions"),
        (dict(query=torch.randn(2, 4, 64).to(torch.float64)), "query has dtype torch.float64"),
        (dict(scale=torch.tensor(0.1)), "scale must be a Python float"),
        (dict(query=torch.randn(2, 4, 64, device="meta")), "key_cache is on cpu but query is on meta"),
    ],
)
def test_decode_rejects(changes, message):
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**_decode_args(**changes))


def test_non_cuda_device_is_refused_with_the_fix():
    meta = {name: v.to("meta") if isinstance(v, torch.Tensor) else v for name, v in _decode_args().items()}
    with pytest.raises(ValueError, match="need CUDA tensors.*TRITON_INTERPRET=1.*kernels.reference"):
        paged_decode_attention(**meta)


def test_prefill_rejects_bad_query_start_loc():
    args = _decode_args()
    with pytest.raises(ValueError, match=r"query_start_loc has shape \(2,\).*num_seqs \+ 1"):
        paged_prefill_attention(args["query"], args["key_cache"], args["value_cache"], args["block_tables"],
                                torch.tensor([0, 2], dtype=torch.int32), args["seq_lens"], 0.1)


def test_store_kv_rejects():
    key = torch.randn(3, 2, 64)
    cache = torch.randn(4, 16, 2, 64)
    with pytest.raises(ValueError, match="slot_mapping has dtype torch.int32; expected one of int64"):
        store_kv(key, key, cache, cache, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"slot_mapping has shape \(2,\).*one slot per token"):
        store_kv(key, key, cache, cache, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"value has shape \(3, 1, 64\)"):
        store_kv(key, key[:, :1], cache, cache, torch.zeros(3, dtype=torch.int64))


def test_kv_transfer_rejects():
    kv_cache = torch.randn(3, 2, 4, 16, 2, 64)
    blocks = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="fewer than num_tokens=40"):
        kv_pack(kv_cache, blocks, 40)
    with pytest.raises(ValueError, match=r"layer range \[2, 5\)"):
        kv_pack(kv_cache, blocks, 20, 2, 5)
    with pytest.raises(ValueError, match=r"planes 2 \(K then V\) or 1 \(a latent\)"):
        kv_pack(torch.randn(3, 3, 4, 16, 2, 64), blocks, 20)
    with pytest.raises(ValueError, match="contiguous"):
        kv_pack(kv_cache.transpose(4, 5), blocks, 20)
    with pytest.raises(ValueError, match="blocks has dtype|block_ids has dtype torch.float32"):
        kv_pack(kv_cache, blocks.float(), 20)
    with pytest.raises(ValueError, match="buffer .* must be contiguous"):
        kv_unpack(torch.randn(1, 2, 20, 64, 2).transpose(3, 4), kv_cache, blocks, 20)
    with pytest.raises(ValueError, match=r"layer range \[2, 4\)"):
        kv_unpack(torch.randn(2, 2, 20, 2, 64), kv_cache, blocks, 20, layer_start=2)


def test_norm_and_rotary_reject():
    with pytest.raises(ValueError, match=r"weight has shape \(8,\); expected \(16,\)"):
        add_rms_norm(torch.randn(2, 16), None, torch.randn(8), 1e-5)
    with pytest.raises(ValueError, match="cos_sin_cache has 65 columns"):
        rotary_embedding(torch.zeros(2, dtype=torch.int64), torch.randn(2, 2, 64), torch.randn(2, 1, 64),
                         torch.randn(8, 65))
