"""The trainer package: `python -m pretrain.train` and friends, and `pretrain.load`.

`pretrain.load(workdir, step=None)` returns a restored model (see pretrain/load.py). It is
imported on first use, so `import pretrain` stays light (no JAX, TensorFlow or Orbax).
"""
import importlib


def __getattr__(name):
  if name == "load":
    # The submodule `pretrain.load` is itself callable as `load(workdir, step=None)`, so
    # the attribute works the same whether or not the submodule was imported before.
    return importlib.import_module("pretrain.load")
  raise AttributeError(f"module 'pretrain' has no attribute {name!r}")
