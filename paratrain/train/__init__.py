"""The training loop and what it needs: data, tasks, strategies, executors, checkpoints, metrics."""
