"""The generator (GPT-style decoder) family: its deployments, continuous batching, the KV cache,
the decoder graph, sampling and each generation's state."""
