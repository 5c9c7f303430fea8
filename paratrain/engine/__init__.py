"""The engine both doors drive (docs/architecture.md, "One engine, two doors"), top to bottom:

* ``parallelize``: the trainer's door (a Task built on the meta device, the run's settings);
* ``build``: THE build, one order of wrapping for both doors (``build_engine``), and ``checks``:
  every check of a run before any worker, with the layout rules the library shares;
* ``engine``: the Engine record and what both doors call on it (the gradient divisor, clipping,
  save, load behind the model check), ``make_mesh``, ``make_strategy``; ``lora``: LoRA in a run;
* ``checkpoint`` (sharded, atomic), ``rng``, ``task`` (what the engine needs of a model, its data
  and its loss), ``zero_averaging`` (ZeRO inside averaging replicas).
"""
