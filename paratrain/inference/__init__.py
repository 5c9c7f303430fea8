"""Generation: a KV cache decode loop over paratrain's families, in one process or across ranks."""
