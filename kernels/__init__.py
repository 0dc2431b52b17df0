"""pdserve's kernels: paged KV cache store, paged decode/prefill attention, KV pack/unpack for
transfer, fused residual-add + RMSNorm and rotary embedding.

The engine chooses its kernels once: a model runner picks its attention backend (engine/attention),
the KV transfer path picks its copy kernels when it binds the cache (dispatch.kernel_for). The names
below dispatch on every call, by the device of their first tensor (Triton on CUDA, the torch
references elsewhere; PDSERVE_KERNELS=torch|triton forces one), for the kernel tests and benchmarks.
"""

if __name__ != "pdserve.kernels":
    # Imported as bare `kernels` through a checkout on sys.path: that name is Hugging Face's package.
    from ._bare_name import hand_over

    hand_over(__name__, __file__)
else:
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
