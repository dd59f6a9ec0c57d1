"""The trainer package: `python -m pretrain.train` and friends, and `pretrain.load`.

`pretrain.load(workdir, step=None)` returns a restored model (see pretrain/load.py). It is
imported on first use, so `import pretrain` stays light (no TensorFlow or Orbax; JAX only
on a host where `pretrain.quiet` must choose its platform).

`pretrain.quiet` comes first, whichever part of the package is imported: it keeps
third-party start-up noise off stderr in library use (`pretrain.load`, notebooks) as in
the commands, and must act before JAX starts a backend or TensorFlow loads.
"""
import importlib

from pretrain import quiet  # pylint: disable=unused-import  # first: see its docstring


def __getattr__(name):
  if name == "load":
    # The submodule `pretrain.load` is itself callable as `load(workdir, step=None)`, so
    # the attribute works the same whether or not the submodule was imported before.
    return importlib.import_module("pretrain.load")
  raise AttributeError(f"module 'pretrain' has no attribute {name!r}")
