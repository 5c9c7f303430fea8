"""A parameter server over torch.distributed.rpc (``--sync parameter-server``): docs/data_parallel.md."""
