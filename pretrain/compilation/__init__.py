"""Compilation and planning: the trainer's step for hardware this host does not have.

  aot.py          compiling the exact train step ahead of time, for any target
  tpu_target.py   TPU slices as compile targets (libtpu)
  gpu_target.py   GPU clusters as compile targets (specs in gpu_specs/)
  memory_plan.py  the analytic memory plan of a step, checked against the compiler
  summary.py      a model's parameters, FLOPs and memory plan from its Gin config

The one wing above the trainer: it compiles what the trainer jits.
"""
