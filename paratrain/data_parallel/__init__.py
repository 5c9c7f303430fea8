"""data_parallel."""
