"""The base classes every technique extends, below the training loop (train/) and the library (api.py):

* ``strategy.Strategy``: gradients, their synchronisation, the optimizer, layout-free state (DDP,
  plain DP and ZeRO-1/2/3 subclass it), with the protocols of its seams (``OptimizerSettings``,
  ``OptimizerSource``, ``StateStore``);
* ``executor.MicroBatchLoop``: one step's micro-batches (pipeline schedules are its peers);
* ``weight_grad``: weight gradients deferred from B to W (zero-bubble schedules).

Nothing here imports the trainer, the config or the engine (engine/build.py).
"""
