"""A run written before `pretrain/` was arranged in wings (main at 456fe4d) still reads.

tests/data/run_456fe4d.tar.gz holds that revision's tiny run (width 8, depth 2, one
step; made with `python -m pretrain.train` and the tiny.gin it carries), the logits its
`pretrain.load(...).logits` gave on a fixed prompt, and its corpus. The checkpoint
stores no module path (the Orbax items are arrays and JSON); the run's config.gin does
(`import pretrain.checkpointing`), which `gin_config.MOVED_MODULES` keeps importable.
"""
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest

import pretrain
from pretrain import gin_config
from trainer_helpers import assert_ok

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHIVE = os.path.join(REPO, "tests", "data", "run_456fe4d.tar.gz")
TOKENS = np.array([[3, 10, 40, 99, 120, 7]], dtype=np.int32)


@pytest.fixture
def old_run(tmp_path):
  with tarfile.open(ARCHIVE) as archive:
    archive.extractall(tmp_path, filter="data")
  return str(tmp_path / "run_456fe4d")


def test_no_module_path_is_stored_in_the_checkpoint(old_run):
  for directory, _, files in os.walk(os.path.join(old_run, "checkpoints")):
    for name in files:
      with open(os.path.join(directory, name), "rb") as f:
        assert b"pretrain." not in f.read(), name


def test_the_old_checkpoint_restores_with_the_same_logits(old_run):
  model = pretrain.load(old_run)
  assert model.step == 1
  logits = np.asarray(model.logits(TOKENS, np.arange(6, dtype=np.int32)[None]))
  np.testing.assert_allclose(logits, np.load(os.path.join(old_run, "logits.npy")),
                             rtol=1e-5, atol=1e-5)


def test_the_old_config_gin_parses(old_run):
  try:
    gin_config.parse([os.path.join(old_run, "config.gin")], [], skip_unknown=True)
  finally:
    import gin  # pylint: disable=import-outside-toplevel
    gin.clear_config()


@pytest.mark.slow
def test_the_old_run_resumes(old_run):
  """Training goes on from the old step 1 (parameters, optimizer state, step, RNG)."""
  corpus = os.path.join(old_run, "corpus")
  with open(os.path.join(old_run, "tiny.gin"), encoding="utf-8") as f:
    config = f.read().replace("/tmp/oldrun/corpus", corpus).replace(
        "/tmp/oldrun/cache", os.path.join(old_run, "cache"))
  path = os.path.join(old_run, "resume.gin")
  with open(path, "w", encoding="utf-8") as f:
    f.write(config)
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
             XLA_FLAGS="--xla_force_host_platform_device_count=1")
  result = subprocess.run(
      [sys.executable, "-m", "pretrain.train", f"--workdir={old_run}", f"--gin_file={path}",
       "--gin_param=TRAIN_STEPS=2"], capture_output=True, text=True, env=env, cwd=REPO,
      timeout=600)
  assert_ok(result)
  assert "resum" in (result.stdout + result.stderr).lower()
  assert pretrain.load(old_run).step == 2
