"""Model execution: the runner, the batched forward, paged attention, the layer math per family,
the sampler, token masks for structured outputs, the KV storage and the CPU runtime settings."""
