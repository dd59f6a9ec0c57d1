"""`pretrain.convert recurrentgemma`: a checkpoint written by RecurrentGemma's own
`save_parameters` becomes a step-0 checkpoint whose `pretrain.load(...).logits` match
the reference model, and `pretrain.train` continues from it."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from recurrentgemma import common
from recurrentgemma.jax import griffin
from recurrentgemma.jax import utils as rg_utils

import pretrain
from pretrain.interchange import conversion as convert
from pretrain.checkpoints.persistent import complete_steps
from trainer_helpers import assert_ok, train_losses, trainer_env  # pylint: disable=unused-import
from recurrentgemma_helpers import perturbed

R, A = common.TemporalBlockType.RECURRENT, common.TemporalBlockType.ATTENTION
VOCAB = 260      # >= the byte vocabulary's 259 ids, so the tiny corpus can train it
WINDOW, SOFT_CAP = 8, 30.0


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """A small random RecurrentGemma (R, R, A, R), saved with its own save_parameters."""
  config = common.GriffinConfig(
      vocab_size=VOCAB, width=32, mlp_expanded_width=96, num_heads=2,
      block_types=(R, R, A, R), embeddings_scale_by_sqrt_dim=True,
      attention_window_size=WINDOW, logits_soft_cap=SOFT_CAP, lru_width=48,
      scan_type=common.ScanType.LINEAR_NATIVE)
  model = griffin.Griffin(config, gradient_checkpointing=False)
  dummy = jnp.zeros((1, 1), jnp.int32)
  params = perturbed(jax.jit(model.init)(jax.random.PRNGKey(0), dummy, dummy)["params"],
                    jax.random.PRNGKey(1))
  path = str(tmp_path_factory.mktemp("rg") / "checkpoint")
  rg_utils.save_parameters(path, params)
  return model, params, path


@pytest.mark.slow
def test_convert_then_load_matches_reference_logits(reference, tmp_path):
  model, params, path = reference
  workdir = str(tmp_path / "converted")
  settings = convert.flag_settings(str(WINDOW), SOFT_CAP, True)
  convert.convert_recurrentgemma(path, workdir, settings, vocab="byte")
  assert complete_steps(os.path.join(workdir, "checkpoints")) == [0]

  loaded = pretrain.load(workdir)
  assert loaded.step == 0
  assert loaded.config.block_pattern == ("recurrent", "recurrent", "attention")
  assert (loaded.config.depth, loaded.config.width, loaded.config.rnn_width) == (4, 32, 48)
  assert loaded.config.attention_window == WINDOW
  assert loaded.config.logits_soft_cap == SOFT_CAP
  assert loaded.config.embeddings_scale_by_sqrt_dim

  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 24), 0, VOCAB)
  # Row 1 packs two documents: positions restart at 0 mid-row.
  positions = jnp.asarray(np.stack([np.arange(24), np.r_[np.arange(10), np.arange(14)]]),
                          jnp.int32)
  expected, _ = jax.jit(model.apply)({"params": params}, tokens, positions)
  logits = loaded.logits(tokens, positions)
  assert logits.dtype == jnp.float32 and logits.shape == (2, 24, VOCAB)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), rtol=1e-5,
                             atol=1e-5 * float(jnp.max(jnp.abs(expected))))
  np.testing.assert_allclose(np.asarray(loaded.apply(loaded.params, tokens, positions)),
                             np.asarray(logits))


@pytest.mark.slow
def test_train_continues_from_converted_checkpoint(trainer_env, reference, tmp_path):
  _, _, path = reference
  workdir = str(tmp_path / "continued")
  assert_ok(trainer_env.run(trainer_env.command(
      "pretrain.convert", "recurrentgemma", f"--checkpoint={path}", f"--workdir={workdir}",
      "--preset=recurrentgemma_2b", "--vocab=byte")))
  result = trainer_env.run(trainer_env.train_command(
      workdir, "TRAIN_STEPS=3", "CHECKPOINT_EVERY=3",
      gin_files=[trainer_env.gin, os.path.join(workdir, "model.gin")]))
  assert_ok(result)
  assert "Resuming from the checkpoint of step 0" in result.stdout
  losses = train_losses(workdir)
  assert sorted(losses) == [1, 2, 3] and all(np.isfinite(list(losses.values())))
  assert complete_steps(os.path.join(workdir, "checkpoints"))[-1] == 3


@pytest.mark.slow
def test_convert_needs_preset_or_all_flags(trainer_env, reference, tmp_path):
  _, _, path = reference
  result = trainer_env.run(trainer_env.command(
      "pretrain.convert", "recurrentgemma", f"--checkpoint={path}",
      f"--workdir={tmp_path / 'w'}", "--window=8"))
  assert result.returncode == 2
  assert "Traceback" not in result.stderr and "--logits_soft_cap" in result.stderr
