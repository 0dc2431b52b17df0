"""pdserve's inference runtime, no sockets: config, loading, models, KV cache, scheduling, sampling."""
