"""The planner: which layout for a model on a cluster, whether it fits, how fast, and why.

It reads plain descriptions only: a model's shape (models/shape.py), the hardware and the op model
(perf/), and this machine's calibration as data (machine.py); it never imports the runtime. The
command that measures this machine and runs the trainer is paratrain/plan_cli/.
"""
