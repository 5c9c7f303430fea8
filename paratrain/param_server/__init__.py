"""A parameter server (``--sync parameter-server``): tensors over the run's gloo group, never code;
docs/data_parallel.md."""
