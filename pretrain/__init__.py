"""The trainer package: `python -m pretrain.train` and friends, and `pretrain.load`.

`pretrain.load(workdir, step=None)` returns a restored model (see pretrain/checkpoints/loading.py). It is
imported on first use, so `import pretrain` stays light (no TensorFlow or Orbax; JAX only
on a host where `plumbing.quiet` must choose its platform).

`plumbing.quiet` is set up first, whichever part of the package is imported (and before
`python -m pretrain.<command>` runs the command): it keeps third-party start-up noise
off stderr in library use (`pretrain.load`, notebooks) as in the commands, and must act
before JAX starts a backend or TensorFlow loads.
"""
from plumbing import quiet

quiet.setup()

import importlib  # noqa: E402  # pylint: disable=wrong-import-position,wrong-import-order


def __getattr__(name):
  if name == "load":
    # `pretrain.checkpoints.loading` (Orbax, and SeqIO on first use) loads only when asked for.
    return importlib.import_module("pretrain.checkpoints.loading").load
  raise AttributeError(f"module 'pretrain' has no attribute {name!r}")
