"""pdserve's kernels: paged KV cache store, paged decode/prefill attention, KV pack/unpack for
transfer, fused residual-add + RMSNorm and rotary embedding.

Each name below runs the Triton kernel on CUDA tensors and the pure-torch implementation
(kernels.reference, kernels.reference_extra) elsewhere; PDSERVE_KERNELS=torch|triton forces one
(see kernels.dispatch). `kernel_backend(device)` says which one a device gets. The KV transfer path
calls these names; the model's layers do not: a model runner picks its attention backend once
(engine/attention), which calls the kernel modules directly.

"""

from pdserve.kernels.dispatch import build as _build
from pdserve.kernels.dispatch import kernel_backend

store_kv = _build("store_kv")
paged_decode_attention = _build("paged_decode_attention")
paged_prefill_attention = _build("paged_prefill_attention")
kv_pack = _build("kv_pack")
kv_unpack = _build("kv_unpack")
add_rms_norm = _build("add_rms_norm")
rotary_embedding = _build("rotary_embedding")

__all__ = [
    "add_rms_norm",
    "kernel_backend",
    "kv_pack",
    "kv_unpack",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rotary_embedding",
    "store_kv",
]
