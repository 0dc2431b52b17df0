"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over pdserve's paged cache of latents.

Per layer, each token caches one row: its normalised latent c (kv_lora_rank values) and its rotated rope
key k_pe (qk_rope_head_dim values), shared by every head. kv_b_proj maps c to each head's key (nope part)
and value. Attention reads the cached rows one of two ways:
  decompressed  up-project the context's latents to per-head K (with k_pe appended) and V, then attend;
  absorbed      fold kv_b_proj's key half into the query and its value half into the output, and attend
                over the latent rows themselves, one row shared by every head.
Both compute the same attention up to rounding. Decode steps and prefill chunks each use their faster
one by default (docs/design/attention-features.md has the measurement). The step's plans are the
torch-paged backend's (kernels/torch_paged.py).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention.torch_paged import TorchPagedMetadata
from pdserve.engine.forward_context import get_forward_context
from pdserve.engine.layers.linear import default_weight_loader
from pdserve.kernels import torch_paged

MLAMode = Literal["absorbed", "decompressed"]
DEFAULT_DECODE_MODE: MLAMode = "absorbed"
DEFAULT_PREFILL_MODE: MLAMode = "decompressed"


class LatentUpProjection(nn.Module):
    """kv_b_proj: a latent [.., kv_lora_rank] -> each head's key nope part [nope_dim] and value [v_dim].
    A plain weight rather than a oneDNN-packed Linear: absorbed attention reads its per-head blocks."""

    def __init__(self, kv_lora_rank: int, num_heads: int, nope_dim: int, v_dim: int) -> None:
        super().__init__()
        self.num_heads, self.nope_dim, self.v_dim = num_heads, nope_dim, v_dim
        self.weight = nn.Parameter(torch.empty(num_heads * (nope_dim + v_dim), kv_lora_rank), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def key_value(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [.., S, kv_lora_rank] -> (key nope [.., S, H, nope_dim], value [.., S, H, v_dim])."""
        kv = F.linear(latent, self.weight).unflatten(-1, (self.num_heads, self.nope_dim + self.v_dim))
        return kv.split((self.nope_dim, self.v_dim), dim=-1)

    def per_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_uk [H, nope_dim, kv_lora_rank], W_uv [H, v_dim, kv_lora_rank]), views of the weight."""
        blocks = self.weight.view(self.num_heads, self.nope_dim + self.v_dim, -1)
        return blocks[:, :self.nope_dim], blocks[:, self.nope_dim:]


class LatentAttention(nn.Module):
    """One layer's MLA over its latent cache [num_blocks, block_size, 1, kv_lora_rank + rope_dim]."""

    def __init__(self, layer_idx: int, kv_b_proj: LatentUpProjection, kv_lora_rank: int, rope_dim: int,
                 scale: float, decode_mode: MLAMode = DEFAULT_DECODE_MODE,
                 prefill_mode: MLAMode = DEFAULT_PREFILL_MODE) -> None:
        super().__init__()
        self.layer_idx, self.kv_lora_rank, self.rope_dim, self.scale = layer_idx, kv_lora_rank, rope_dim, scale
        self.kv_b_proj = kv_b_proj
        self.decode_mode, self.prefill_mode = decode_mode, prefill_mode
        self.latent_cache: torch.Tensor | None = None  # [N, B, 1, kv_lora_rank + rope_dim]
        self.w_uk: torch.Tensor | None = None  # [H, nope_dim, kv_lora_rank], contiguous (absorbed queries)
        self.w_uv_t: torch.Tensor | None = None  # [H, kv_lora_rank, v_dim], contiguous (absorbed outputs)

    def bind_kv_cache(self, latent_cache: torch.Tensor) -> None:
        """The layer's latent plane; called once the weights are loaded (the absorbed weights come from them)."""
        self.latent_cache = latent_cache
        w_uk, w_uv = self.kv_b_proj.per_head()
        self.w_uk, self.w_uv_t = w_uk.contiguous(), w_uv.transpose(1, 2).contiguous()

    def forward(
        self,
        q_nope: torch.Tensor,  # [T, H, nope_dim]
        q_pe: torch.Tensor,  # [T, H, rope_dim], rotated
        latent: torch.Tensor,  # [T, kv_lora_rank], normalised
        k_pe: torch.Tensor,  # [T, rope_dim], rotated
    ) -> torch.Tensor:  # [T, H * v_dim]
        if self.latent_cache is None:
            raise RuntimeError(f"MLA layer {self.layer_idx} has no latent cache bound: the engine allocates it")
        context = get_forward_context()
        metadata = context.attn_metadata
        if not isinstance(metadata, TorchPagedMetadata):
            raise RuntimeError(f"MLA runs on the torch-paged attention backend, not {type(metadata).__name__}: "
                               "the model runner picks it for MLA models")
        self._store(torch.cat((latent, k_pe), dim=-1), metadata.store)
        if context.on_layer_stored is not None:
            context.on_layer_stored(self.layer_idx)
        num_decodes = context.num_decode_tokens
        outs = []
        if num_decodes:
            plan = metadata.decode(None)
            outs.append(self._attend(q_nope[:num_decodes], q_pe[:num_decodes], self.decode_mode, plan, None))
        if num_decodes < q_nope.shape[0]:
            plan = metadata.prefill(None)
            outs.append(self._attend(q_nope[num_decodes:], q_pe[num_decodes:], self.prefill_mode, None, plan))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)  # [T, H, v_dim]
        return out.flatten(1)

    def _store(self, rows: torch.Tensor, plan: torch_paged.StorePlan) -> None:  # rows [T, L + R]
        if plan.keep is not None:
            rows = rows[plan.keep]
        cache = self.latent_cache
        cache.view(-1, cache.shape[-1]).index_copy_(0, plan.slots, rows.to(cache.dtype))

    def _attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, mode: MLAMode,
                decode_plan: torch_paged.DecodePlan | None,
                prefill_plan: list[torch_paged.PrefillSequence] | None) -> torch.Tensor:  # [n, H, v_dim]
        if mode == "absorbed":
            # q_nope W_uk: [H, n, nope] @ [H, nope, L] -> [n, H, L]
            q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
            query = torch.cat((q_latent, q_pe), dim=-1)  # [n, H, L + R]
            if decode_plan is not None:
                out_latent = latent_decode(query, self.latent_cache, decode_plan, self.scale, self.kv_lora_rank)
            else:
                out_latent = latent_prefill(query, self.latent_cache, prefill_plan, self.scale, self.kv_lora_rank)
            # [H, n, L] @ W_uv^T [H, L, v] -> [n, H, v]
            return torch.bmm(out_latent.transpose(0, 1), self.w_uv_t).transpose(0, 1)
        query = torch.cat((q_nope, q_pe), dim=-1)  # [n, H, nope + R]
        if decode_plan is not None:
            return decompressed_decode(query, self.latent_cache, decode_plan, self.scale, self.kv_b_proj)
        return decompressed_prefill(query, self.latent_cache, prefill_plan, self.scale, self.kv_b_proj)


# ---- absorbed: attention over the latent rows, one row shared by every head ----

def latent_decode(
    query: torch.Tensor,  # [S, H, L + R], absorbed
    cache: torch.Tensor,  # [N, B, 1, L + R]
    plan: torch_paged.DecodePlan,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:  # [S, H, L], in the query's dtype
    """Each sequence's heads are the query rows of one attention over its latent rows (float32)."""
    num_seqs = query.shape[0]
    rows = query if plan.order is None else query.index_select(0, plan.order)
    rows = rows.float().unsqueeze(1)  # [S, 1, H, L + R]
    outs, begin = [], 0
    for group in plan.groups:
        q = rows.narrow(0, begin, group.num_seqs)
        begin += group.num_seqs
        if group.max_len == 0:
            outs.append(q.new_zeros(group.num_seqs, 1, q.shape[2], kv_lora_rank))
            continue
        for first, count, latents in _decode_chunks(cache, group):  # latents [count, 1, span, L + R] float32
            mask = None if group.mask is None else group.mask.narrow(0, first, count)  # [count, 1, 1, span]
            # the whole rows as values (SDPA's fused kernel wants keys and values alike), the rope part dropped
            o = F.scaled_dot_product_attention(q.narrow(0, first, count), latents, latents, attn_mask=mask, scale=scale)
            outs.append(o[..., :kv_lora_rank])
    out = torch.cat(outs) if len(outs) > 1 else outs[0]  # [S, 1, H, L]
    if plan.restore is not None:
        out = out.index_select(0, plan.restore)
    return out.view(num_seqs, -1, kv_lora_rank).to(query.dtype)


def latent_prefill(
    query: torch.Tensor,  # [T, H, L + R], absorbed, the new tokens of all sequences
    cache: torch.Tensor,  # [N, B, 1, L + R], new tokens already stored
    plan: list[torch_paged.PrefillSequence],
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:  # [T, H, L]
    out = query.new_empty(*query.shape[:2], kv_lora_rank)
    for seq in plan:
        q = query[seq.begin:seq.end].transpose(0, 1)[None]  # [1, H, q, L + R]
        latents = _context_rows(cache, seq).to(query.dtype)[None, None]  # [1, 1, span, L + R]
        o = F.scaled_dot_product_attention(q, latents, latents, attn_mask=seq.mask, is_causal=seq.mask is None,
                                           scale=scale, enable_gqa=True)  # [1, H, q, L + R]
        out[seq.begin:seq.end] = o[0, ..., :kv_lora_rank].transpose(0, 1)
    return out


# ---- decompressed: per-head K and V from the latent rows, then ordinary attention ----

def decompressed_decode(
    query: torch.Tensor,  # [S, H, nope + R]
    cache: torch.Tensor,  # [N, B, 1, L + R]
    plan: torch_paged.DecodePlan,
    scale: float,
    kv_b_proj: LatentUpProjection,
) -> torch.Tensor:  # [S, H, v_dim], in the query's dtype
    num_seqs, num_heads, _ = query.shape
    rows = query if plan.order is None else query.index_select(0, plan.order)
    rows = rows.float().unsqueeze(2)  # [S, H, 1, nope + R]
    weight = kv_b_proj.weight.float()
    outs, begin = [], 0
    for group in plan.groups:
        q = rows.narrow(0, begin, group.num_seqs)
        begin += group.num_seqs
        if group.max_len == 0:
            outs.append(q.new_zeros(group.num_seqs, num_heads, 1, kv_b_proj.v_dim))
            continue
        for first, count, latents in _decode_chunks(cache, group):  # latents [count, 1, span, L + R] float32
            keys, values = _decompress(latents[:, 0], kv_b_proj, weight)  # [count, H, span, D], [count, H, span, v]
            mask = None if group.mask is None else group.mask.narrow(0, first, count)
            outs.append(_attend(q.narrow(0, first, count), keys, values, mask, False, scale))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]  # [S, H, 1, v]
    if plan.restore is not None:
        out = out.index_select(0, plan.restore)
    return out.view(num_seqs, num_heads, -1).to(query.dtype)


def decompressed_prefill(
    query: torch.Tensor,  # [T, H, nope + R]
    cache: torch.Tensor,  # [N, B, 1, L + R], new tokens already stored
    plan: list[torch_paged.PrefillSequence],
    scale: float,
    kv_b_proj: LatentUpProjection,
) -> torch.Tensor:  # [T, H, v_dim]
    out = query.new_empty(*query.shape[:2], kv_b_proj.v_dim)
    weight = kv_b_proj.weight.to(query.dtype)
    for seq in plan:
        q = query[seq.begin:seq.end].transpose(0, 1)[None]  # [1, H, q, nope + R]
        keys, values = _decompress(_context_rows(cache, seq).to(query.dtype)[None], kv_b_proj, weight)
        o = _attend(q, keys, values, seq.mask, seq.mask is None, scale)  # [1, H, q, v]
        out[seq.begin:seq.end] = o[0].transpose(0, 1)
    return out


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, causal: bool,
            scale: float) -> torch.Tensor:  # [s, H, q, v_dim]
    """SDPA with values zero-padded to the keys' width: torch's fused CPU kernel needs them alike (else the
    unfused path materialises every attention weight)."""
    v_dim = values.shape[-1]
    if v_dim != keys.shape[-1]:
        values = F.pad(values, (0, keys.shape[-1] - v_dim))
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, scale=scale)
    return out[..., :v_dim]


def _decompress(latents: torch.Tensor, kv_b_proj: LatentUpProjection,
                weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """latent rows [s, span, L + R] -> keys [s, H, span, nope + R] (k_pe shared by the heads), values
    [s, H, span, v_dim]."""
    kv_lora_rank = weight.shape[1]
    kv = F.linear(latents[..., :kv_lora_rank], weight).unflatten(-1, (kv_b_proj.num_heads, -1))
    key_nope, values = kv.split((kv_b_proj.nope_dim, kv_b_proj.v_dim), dim=-1)  # [s, span, H, *]
    k_pe = latents[..., None, kv_lora_rank:].expand(-1, -1, kv_b_proj.num_heads, -1)  # [s, span, H, R]
    keys = torch.cat((key_nope, k_pe), dim=-1)
    return keys.transpose(1, 2), values.transpose(1, 2)


# ---- gathering the cached rows ----

def _decode_chunks(cache: torch.Tensor, group: torch_paged.DecodeGroup):
    """(first sequence, count, latent rows [count, 1, span, L + R] float32) for about DECODE_CHUNK_TOKENS
    positions at a time, so each chunk is attended while it is still in the core's cache."""
    per_chunk = max(1, torch_paged.DECODE_CHUNK_TOKENS // group.span)
    blocks_per_seq = group.block_ids.numel() // group.num_seqs
    for first in range(0, group.num_seqs, per_chunk):
        count = min(per_chunk, group.num_seqs - first)
        block_ids = group.block_ids.narrow(0, first * blocks_per_seq, count * blocks_per_seq)
        blocks = cache.index_select(0, block_ids)  # [count * blocks, B, 1, L + R]
        yield first, count, blocks.view(count, -1, cache.shape[-1])[:, :group.span].float().unsqueeze(1)


def _context_rows(cache: torch.Tensor, seq: torch_paged.PrefillSequence) -> torch.Tensor:  # [span, L + R]
    return cache.index_select(0, seq.block_ids).view(-1, cache.shape[-1])[:seq.context_len - seq.first_pos]
