"""μP (`model.parametrization`): the coordinate check, the standard parametrisation left
as it was, the export and the decoding cache of a μP model, and bad input as one line.

The coordinate check (benchmarks/mup_coord_check.py) trains tiny models of two widths 4x
apart for a few Adam steps at one learning rate and fits the slope of log RMS(move)
against log width, for the logits and every block's output. The fast tier checks μP on
one model holding every block type (recurrent, attention, GateLoop: two compiles); the
full suite checks that model against the standard parametrisation too. The families one
by one, at widths 64 to 1024, are the benchmark's.
"""
import importlib.util
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import block_registry, hf_params, parametrization
from model import partitioning as P
from model.config import ModelConfig, model_config_from_dict, model_config_to_dict
from model.lm import LanguageModel, abstract_params_and_axes, init_params
from model.decoding import decode_step, prefill
from plumbing.errors import CheckpointMismatchError, UserError
from pretrain import gin_config
from pretrain import optimizer as optimizer_lib
from pretrain.checkpoints import persistent
from pretrain.checkpoints.metadata import RunMetadata
from pretrain.run_directory import RunDirectory

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDTHS = (64, 256)
LEARNING_RATE = 1e-2
STEPS = 12
# Slopes of log RMS(move) against log width: flat under μP; growing under standard, the
# logits less than the blocks because the final RMSNorm bounds the state they read
# (docs/model.md, "μP"; 0.22-0.55 measured).
MUP_MAX_SLOPE = 0.25
STANDARD_MIN_BLOCK_SLOPE = 1.0
STANDARD_MIN_LOGIT_GAIN = 0.15   # over μP's logit slope (or 0, if that is negative)


def _load_coord_check():
  spec = importlib.util.spec_from_file_location(
      "mup_coord_check", os.path.join(REPO, "benchmarks", "mup_coord_check.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


coord_check = _load_coord_check()


def _slopes(family: str, kind: str) -> dict[str, float]:
  tokens = coord_check.text_batch(4, 33)
  runs = [coord_check.update_rms(coord_check.family_config(family, width, kind, WIDTHS[0]),
                                 tokens, LEARNING_RATE, STEPS) for width in WIDTHS]
  return {name: coord_check.slope(WIDTHS, [run[name] for run in runs]) for name in runs[0]}


def _assert_flat(family: str) -> dict[str, float]:
  mup = _slopes(family, "mup")
  print(f"{family} slopes under mup: {mup}")   # shown with -rA
  flat = {name: round(value, 2) for name, value in mup.items()}
  assert all(abs(value) < MUP_MAX_SLOPE for value in mup.values()), flat
  return mup


def test_coordinate_check_every_block_type_is_flat_under_mup():
  _assert_flat("mixed")


@pytest.mark.slow
def test_coordinate_check_grows_under_the_standard_parametrization():
  """The same check under the standard parametrisation, on the model of every block
  type: its moves grow with width, so the bounds above can fail. (Each family apart, at
  widths 64 to 1024: benchmarks/mup_coord_check.py.)"""
  family = "mixed"
  mup, standard = _assert_flat(family), _slopes(family, "standard")
  print(f"{family} slopes under standard: {standard}")
  grown = {name: round(value, 2) for name, value in standard.items()}
  assert standard["logits"] > max(mup["logits"], 0.0) + STANDARD_MIN_LOGIT_GAIN, grown
  assert all(value > STANDARD_MIN_BLOCK_SLOPE for name, value in standard.items()
             if name != "logits"), grown


# -- the standard parametrisation is what it was -------------------------------------------

CONFIG = ModelConfig(vocab_size=64, width=32, rnn_width=32, num_heads=2, depth=3,
                     attention_window=4, block_pattern=("recurrent", "attention", "gateloop"))


def _mup(config: ModelConfig, base_width: int) -> ModelConfig:
  return config.replace(parametrization="mup", mup_base_width=base_width)


def test_standard_optimizer_and_metadata_are_unchanged():
  params = init_params(CONFIG, jax.random.key(0))
  settings = optimizer_lib.OptimizerConfig()
  plain = optimizer_lib.make_optimizer(settings, 10)
  ours = optimizer_lib.model_optimizer(settings, 10, CONFIG, params)
  assert jax.tree.structure(ours.init(params)) == jax.tree.structure(plain.init(params))
  assert "parametrization" not in model_config_to_dict(CONFIG)
  assert "mup_base_width" not in model_config_to_dict(CONFIG)


@pytest.mark.slow   # fast tier under 5 min: 15 s on a loaded machine; the coordinate check stays fast
def test_mup_at_its_base_width_is_the_standard_model_bit_for_bit():
  """Every multiplier is 1 at m = 1: the proxy a rate is tuned on is an ordinary model."""
  base = _mup(CONFIG, CONFIG.width)
  params = init_params(CONFIG, jax.random.key(0))
  jax.tree.map(np.testing.assert_array_equal, init_params(base, jax.random.key(0)), params)
  tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
  positions = jnp.tile(jnp.arange(6, dtype=jnp.int32), (2, 1))
  logits = LanguageModel(CONFIG).apply({"params": params}, tokens, positions)[0]
  np.testing.assert_array_equal(
      LanguageModel(base).apply({"params": params}, tokens, positions)[0], logits)


def test_roles_and_multipliers_of_every_parameter():
  config = _mup(CONFIG, 16)
  abstract, _ = abstract_params_and_axes(config)
  roles = parametrization.param_roles(config, abstract)
  assert roles["embedder"]["embedding"] == "input"
  block = roles["blocks"]["block_0"]
  assert block["recurrent"]["rg_lru"]["a_gate"]["kernel"] == "hidden"
  assert block["recurrent"]["rg_lru"]["a_param"] == "vector"
  assert block["recurrent"]["conv1d"]["kernel"] == "vector"
  assert roles["blocks"]["block_2"]["gateloop"]["magnitude"]["bias"] == "vector"
  rates = parametrization.learning_rate_multipliers(config, abstract)
  assert rates["blocks"]["block_1"]["attention"]["q"]["kernel"] == 0.5
  assert rates["blocks"]["block_1"]["mlp"]["down"]["bias"] == 1.0
  assert rates["embedder"]["embedding"] == 1.0
  assert parametrization.logit_multiplier(config) == 0.5
  assert parametrization.query_multiplier(config) == pytest.approx(0.5 ** 0.5)
  assert model_config_from_dict(model_config_to_dict(config)) == config


# -- the export and the decoding cache of a μP model ---------------------------------------

GRIFFIN = ModelConfig(vocab_size=64, width=64, rnn_width=64, num_heads=2, depth=3,
                      attention_window=8)


@pytest.mark.slow   # fast tier under 5 min: an export and transformers per case (11 s)
@pytest.mark.parametrize("scaled", [False, True])
def test_export_folds_the_multipliers_and_unties(scaled):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  config = _mup(GRIFFIN.replace(embeddings_scale_by_sqrt_dim=scaled), 32)
  params = init_params(config, jax.random.key(1))
  values = hf_params.hf_config(config)
  assert values["tie_word_embeddings"] is False   # 1/m and √D_base need two tables
  theirs = transformers.RecurrentGemmaForCausalLM(transformers.RecurrentGemmaConfig(**values))
  state = {name: torch.tensor(np.array(value))
           for name, value in hf_params.ours_to_hf(params, config).items()}
  theirs.load_state_dict(state, strict=False)
  tokens = np.concatenate([[0], np.arange(3, 14)])[None].astype(np.int32)
  positions = np.arange(tokens.shape[1], dtype=np.int32)[None]
  ours = LanguageModel(config).apply({"params": params}, tokens, positions)[0]
  with torch.no_grad():
    logits = theirs.eval()(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(logits, np.asarray(ours), atol=2e-4, rtol=2e-4)


@pytest.mark.slow   # fast tier under 5 min: 9 s; the coordinate check stays fast
def test_decoding_cache_of_a_mup_model():
  config = _mup(GRIFFIN, 32)
  params = init_params(config, jax.random.key(2))
  tokens = jnp.arange(3, 13, dtype=jnp.int32)[None]
  positions = jnp.arange(10, dtype=jnp.int32)[None]
  whole = jax.jit(LanguageModel(config).apply)({"params": params}, tokens, positions)[0]
  _, cache = jax.jit(prefill, static_argnums=0)(config, params, tokens[:, :-1],
                                                positions[:, :-1])
  last, _ = jax.jit(decode_step, static_argnums=0)(config, params, tokens[:, -1:],
                                                   positions[:, -1:], cache)
  np.testing.assert_allclose(last[:, 0], whole[:, -1], atol=1e-5, rtol=1e-5)


# -- bad input: one line each, nothing lost -------------------------------------------------

def _usage_error(*bindings: str) -> str:
  gin_config.parse([], ["import model.config", *bindings])
  with pytest.raises(UserError) as info:
    gin_config.build_model_config()
  message = str(info.value)
  assert info.value.exit_code == 2 and "\n" not in message, message
  return message


def test_base_width_must_divide_the_width():
  message = _usage_error("ModelConfig.width = 96", "ModelConfig.parametrization = 'mup'",
                         "ModelConfig.mup_base_width = 64")
  assert "mup_base_width=64 must divide width=96" in message


def test_mup_needs_a_base_width_and_standard_takes_none():
  assert "needs mup_base_width" in _usage_error("ModelConfig.parametrization = 'mup'")
  assert "parametrization is 'standard'" in _usage_error("ModelConfig.mup_base_width = 64")


class _Diagonal(nn.Module):
  """A block of two projections and a per-channel decay."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x, segment_pos, cache=None, return_cache=False):
    del segment_pos, cache, return_cache
    decay = P.logical_param(self, "decay", nn.initializers.ones_init(),
                            (self.config.width,), (P.EMBED,))
    y = P.Dense(self.config.width, (P.EMBED, P.EMBED), name="w_in")(x) * decay
    return P.Dense(self.config.width, (P.EMBED, P.EMBED), name="w_out")(y), None


class _Undeclared:
  name = "undeclared_roles"
  layer = _Diagonal
  logical_axes = (P.EMBED,)

  def param_count(self, config):
    return 2 * config.width * (config.width + 1) + config.width


class _Partly(_Undeclared):
  name = "partly_declared_roles"
  param_roles = {"w_in/kernel": "hidden", "w_in/bias": "vector", "w_out/kernel": "hidden",
                 "w_out/bias": "vector"}


@pytest.fixture
def custom_blocks():
  for spec in (_Undeclared(), _Partly()):
    block_registry.register(spec)
  yield
  for spec in (_Undeclared, _Partly):
    block_registry.unregister(spec.name)


def test_a_block_without_roles_is_refused_under_mup(custom_blocks):
  del custom_blocks
  config = CONFIG.replace(block_pattern=("undeclared_roles",))
  with pytest.raises(ValueError, match="block type 'undeclared_roles' declares no parameter "
                                       "roles"):
    _mup(config, 16)
  abstract, _ = abstract_params_and_axes(config)   # standard still trains
  assert parametrization.learning_rate_multipliers(config, abstract) is None


def test_a_parameter_without_a_role_is_one_line_naming_it(custom_blocks):
  del custom_blocks
  config = _mup(CONFIG.replace(block_pattern=("partly_declared_roles",)), 16)
  abstract, _ = abstract_params_and_axes(config)
  with pytest.raises(UserError) as info:
    optimizer_lib.model_optimizer(optimizer_lib.OptimizerConfig(), 10, config, abstract)
  message = str(info.value)
  assert "'partly_declared_roles' declares no role for its parameter 'decay'" in message
  assert "\n" not in message and info.value.exit_code == 2


def test_resume_under_another_parametrization_is_refused(tmp_path):
  trained = _mup(GRIFFIN, 32)
  tier = persistent.PersistentTier(RunDirectory(str(tmp_path)), async_save=False)
  params = init_params(trained, jax.random.key(0))
  tier.save(1, params=params, opt_state=None, rng=jax.random.key(0),
            metadata=RunMetadata(trained).to_json())
  abstract, _ = abstract_params_and_axes(trained)
  tier.check_newest_matches(abstract, trained)   # the same parametrisation resumes
  for other in (GRIFFIN, _mup(GRIFFIN, 16)):
    with pytest.raises(CheckpointMismatchError) as info:
      tier.check_newest_matches(abstract, other)
    message = str(info.value)
    assert "\n" not in message
    assert "trained under the mup (base width 32) parametrization" in message
  restored = tier.restore(1, abstract_params=abstract)   # nothing lost
  jax.tree.map(np.testing.assert_array_equal, restored.params, params)
  tier.close()
