"""What both the runtime and the planner know about performance, from plain descriptions alone:
the op model (ops.py), the hardware facts and presets (hardware.py), pipeline stage costs and the
balanced cut (stages.py), and FLOP counts (flops.py).

It sits below the techniques and beside the data (docs/architecture.md): it reads model shapes
(models/shape.py), never a module, a tensor or the runtime, so the runtime's ``--pp-split auto``
and the planner price a model the same way without the runtime importing the planner.
"""
