"""Every command-line module imports next to every other one (as pytest and notebooks do).

absl flags are process-global: a module that defines flags at import time clashes with any
other module defining a flag of the same name, which breaks test collection.
"""
import importlib

import pytest

ENTRY_POINTS = [
    "pretrain.train", "pretrain.evaluate", "pretrain.sample", "pretrain.convert",
    "pretrain.tokenizer", "pretrain.extrapolation", "pretrain.summary", "launch.local",
    "launch.sweep", "launch.tpu_vm", "launch.gke", "launch.slurm", "launch.scaling_fit",
    "launch.sweep_job", "launch.chaos", "pretrain.report", "pretrain.export",
    "launch.fork",
]


def test_entry_points_import_together_without_flag_clashes():
  modules = [importlib.import_module(name) for name in ENTRY_POINTS]
  assert all(hasattr(module, "main") for module in modules)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_flags_are_defined_only_when_run(name):
  from absl import flags
  module = importlib.import_module(name)
  before = set(flags.FLAGS)
  importlib.reload(module)  # a module defining flags at import raises DuplicateFlagError
  assert set(flags.FLAGS) == before, f"{name} defines flags at import time"
