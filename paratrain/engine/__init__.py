"""The base classes every technique extends, below the training loop (train/) and the library (api.py):

* ``strategy.Strategy``: gradients, their synchronisation, the optimizer, layout-free state (DDP,
  plain DP and ZeRO-1/2/3 subclass it);
* ``executor.MicroBatchLoop``: one step's micro-batches (pipeline schedules are its peers);
* ``shards``: pieces of full tensors, the one description of what a rank holds (checkpoints,
  exports and the library's gathers are built from it).

Nothing here imports the trainer, the config or the dispatcher (engine/parallelize.py).
"""
