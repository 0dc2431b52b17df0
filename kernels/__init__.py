"""pdserve's kernels: paged KV cache store, paged decode/prefill attention, KV pack/unpack for
transfer, fused residual-add + RMSNorm, rotary embedding, and the grouped GEMM of mixture-of-experts layers.

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
    # The kernels are built on first use (kernels.dispatch imports torch); a bad PDSERVE_KERNELS fails here, at
    # import. Torch-free modules of the package (length_groups, which `pdserve plan` prices) import without it.
    from pdserve.kernels.forced_backend import read_forced_backend as _read_forced_backend

    _read_forced_backend()

    __all__ = [
        "add_rms_norm",
        "grouped_gemm",
        "kernel_backend",
        "kv_pack",
        "kv_unpack",
        "paged_decode_attention",
        "paged_prefill_attention",
        "rotary_embedding",
        "store_kv",
    ]

    def __getattr__(name: str):
        if name not in __all__:
            raise AttributeError(f"module 'pdserve.kernels' has no attribute {name!r}")
        from pdserve.kernels import dispatch

        value = dispatch.kernel_backend if name == "kernel_backend" else dispatch.build(name)
        globals()[name] = value
        return value
