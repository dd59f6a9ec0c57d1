"""A block type registered from this file alone (a diagonal linear recurrence, no edit
to any model module) is validated, trained, counted, planned, decoded and offered as a
sweep family. Declaring only its name, layer and parameter count is enough for all of
that (the defaults of `model.block_registry`: FLOPs of 6N, an estimated memory plan
that says so, a zero decoding cache); the Hugging Face export refuses such a block in
one line. An unregistered type is an error wherever it is looked up, never 0 FLOPs."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from launch.sweeps import sweep_design
from model import block_registry, counting, decoding, hf_params, memory, recurrence
from model import partitioning as P
from model.config import ModelConfig
from model.lm import init_params
from pretrain.compilation import summary
from inprocess_trainer import make_trainer

NAME = "diagonal"
BARE = "bare_diagonal"


class DiagonalRecurrence(nn.Module):
  """h_t = σ(λ) ⊙ h_{t-1} + W_in x_t (reset at document starts), y_t = W_out h_t."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x, segment_pos, cache=None, return_cache=False):
    cfg = self.config
    decay = P.logical_param(self, "decay", nn.initializers.constant(2.0), (cfg.rnn_width,),
                            (P.RNN,))
    u = P.Dense(cfg.rnn_width, (P.EMBED, P.RNN), dtype=cfg.dtype, name="w_in")(x)
    a = jnp.broadcast_to(jax.nn.sigmoid(decay), u.shape)
    a = jnp.where((segment_pos == 0)[..., None], 0.0, a)
    h, last = recurrence.mesh_aware_linear_scan(
        a, P.constrain(u.astype(jnp.float32), (P.BATCH, P.LENGTH, P.ACT_RNN)), cache,
        impl=cfg.scan_impl, options=cfg.scan)
    y = P.Dense(cfg.width, (P.RNN, P.EMBED), dtype=cfg.dtype, name="w_out")(h.astype(x.dtype))
    return y, (last if return_cache else None)


def diagonal_param_count(config):
  return 2 * config.width * config.rnn_width + 2 * config.rnn_width + config.width


class BareDiagonalSpec:
  """Only what every block declares: its name, its layer and its parameter count."""
  name = BARE
  layer = DiagonalRecurrence

  def param_count(self, config):
    return diagonal_param_count(config)   # w_in, w_out; decay, their biases


class DiagonalCounting:
  def matmul_params(self, config):
    return 2 * config.width * config.rnn_width

  def mixing_flops(self, config, seq_len):
    return {"recurrence": 3.0 * 3 * config.rnn_width}   # σ(λ)·h + u, reset


class DiagonalMemory:
  def kept_activations(self, config, seq, tensor):
    return 2 * config.rnn_width / tensor, 2 * config.rnn_width / tensor, 0.0

  def saved_matmul_outputs(self, config, seq, tensor):
    return config.rnn_width / tensor + config.width, 0.0


class DiagonalSpec:
  """The same layer with every optional declaration."""
  name = NAME
  title = "diagonal recurrence"
  layer = DiagonalRecurrence
  family = "diagonal_lm"
  logical_axes = (P.EMBED, P.RNN, P.BATCH, P.LENGTH, P.ACT_RNN)
  counting = DiagonalCounting()
  memory = DiagonalMemory()
  hf_export = None

  def validate(self, config):
    if config.rnn_width > 4 * config.width:
      raise ValueError(f"ModelConfig.rnn_width={config.rnn_width} must be at most 4 x "
                       "width for a diagonal recurrence")

  def init_cache(self, config, batch_size, dtype, max_length):
    return jnp.zeros((batch_size, config.rnn_width), jnp.float32)

  def param_count(self, config):
    return diagonal_param_count(config)


def _config(pattern):
  return ModelConfig(vocab_size=260, width=32, rnn_width=32, num_heads=2, depth=3,
                     block_pattern=pattern, attention_window=8, scan_impl="lax")


@pytest.fixture()
def diagonal():
  block_registry.register(DiagonalSpec())
  yield _config((NAME, "attention"))
  block_registry.unregister(NAME)


@pytest.fixture()
def bare():
  block_registry.register(BareDiagonalSpec())
  yield _config((BARE, "attention"))
  block_registry.unregister(BARE)


def _prefill_then_step_equals_one_call(config):
  params = init_params(config, jax.random.key(0))
  tokens = jnp.asarray(np.arange(10)[None] % 7 + 3, jnp.int32)
  positions = jnp.arange(10, dtype=jnp.int32)[None]
  full, _ = decoding.prefill(config, params, tokens, positions)
  cache = decoding.init_cache(config, 1, max_length=16)
  _, cache = decoding.prefill(config, params, tokens[:, :9], positions[:, :9], cache)
  step, _ = decoding.decode_step(config, params, tokens[:, 9:], positions[:, 9:], cache)
  np.testing.assert_allclose(step[:, 0], full[:, 9], rtol=1e-5, atol=1e-5)


@pytest.mark.slow   # fast tier under 5 min: 13 s of counting, planning, decoding and a sweep
def test_a_registered_block_counts_plans_decodes_and_sweeps(diagonal):
  config = diagonal
  with pytest.raises(ValueError, match="rnn_width=256 must be at most 4 x width"):
    config.replace(rnn_width=256)

  # Counts: the real parameter tree agrees with what the spec declares.
  assert counting.count_params(config).total == counting.analytic_param_counts(config).total
  flops = counting.training_flops_breakdown(config, 32)
  assert flops.recurrence == 2 * 9.0 * config.rnn_width   # two diagonal layers
  assert counting.undeclared_counting(config) == []

  # Plans: the analytic planner adds the block's kept activations.
  plan = memory.plan_memory(config, {"data": 2}, 4, 32)
  attention_only = memory.plan_memory(config.replace(block_pattern=("attention",)),
                                      {"data": 2}, 4, 32)
  assert plan["activations"] > 0 and plan["total"] != attention_only["total"]
  assert plan["estimated"] == [] and "estimated" not in memory.format_plan(plan)

  # Decodes: prefill then one step equals the full forward pass.
  _prefill_then_step_equals_one_call(config)
  assert counting.decode_state_bytes(config, 16) > 0

  # A sweep family of its own.
  assert sweep_design.FAMILY_PATTERNS["diagonal_lm"] == (NAME,)
  sized = sweep_design.config_for_size("diagonal_lm", 200_000, vocab_size=259, sequence_length=64)
  assert sized.block_pattern == (NAME,)


@pytest.mark.slow   # fast tier under 5 min: 20 s on a loaded machine
def test_a_block_of_layer_and_param_count_alone_counts_plans_decodes_and_sweeps(bare):
  config = bare
  # Counts: its parameter count is checked against the tree; its FLOPs are 6N.
  assert counting.count_params(config).total == counting.analytic_param_counts(config).total
  flops = counting.training_flops_breakdown(config, 32)
  attention = counting.training_flops_breakdown(config.replace(block_pattern=("attention",)), 32)
  assert flops.recurrence == 0 and flops.attention == attention.attention / 3   # 1 of 3 layers
  assert flops.matmul == 6.0 * counting.analytic_matmul_params(config)
  assert counting.block_matmul_params(config, BARE) == diagonal_param_count(config)
  assert counting.undeclared_counting(config) == [BARE]

  # Plans: an estimate, said so in one line, and above the declared block's own terms.
  plan = memory.plan_memory(config, {"data": 2}, 4, 32)
  assert plan["estimated"] == [BARE] and plan["activations"] > 0
  line, = [line for line in memory.format_plan(plan).splitlines() if "estimated" in line]
  assert "'bare_diagonal' declare no memory terms" in line
  block_registry.register(DiagonalSpec())
  try:
    for remat in ("none", "full", "save_matmuls"):
      estimated = memory.plan_memory(config.replace(remat=remat), {"fsdp": 2}, 4, 32)
      planned = memory.plan_memory(config.replace(remat=remat, block_pattern=(NAME, "attention")),
                                   {"fsdp": 2}, 4, 32)
      assert estimated["activations"] >= planned["activations"], remat
  finally:
    block_registry.unregister(NAME)

  # `pretrain.summary` says which of its figures are estimates, one line each (a mesh
  # larger than this machine's 8 devices is planned analytically, not compiled).
  text = summary.format_text(summary.summarize(config, 32, mesh="data:16", batch=16))
  assert [line.split(" declare ")[0] for line in text.splitlines() if "estimated" in line] == [
      "  estimated: block types 'bare_diagonal'"] * 2

  # Decodes from the default cache: zeros shaped like its layer's one-token cache.
  _prefill_then_step_equals_one_call(config)
  attention = counting.decode_state_bytes(config.replace(block_pattern=("attention",)), 16)
  assert counting.decode_state_bytes(config, 16) == (
      attention // 3 + 2 * 4 * config.rnn_width)   # and two layers' float32 [1, R] states

  # A sweep family named after it.
  assert sweep_design.FAMILY_PATTERNS[BARE] == (BARE,)
  sized = sweep_design.config_for_size(BARE, 200_000, vocab_size=259, sequence_length=64)
  assert sized.block_pattern == (BARE,)

  # The Hugging Face export refuses it in one line naming it.
  with pytest.raises(ValueError) as refused:
    hf_params.check_exportable(config)
  assert str(refused.value).startswith("bare_diagonal blocks have no transformers")
  assert "\n" not in str(refused.value)


@pytest.mark.slow   # compiles and runs the real train step (CI runs it)
def test_a_block_of_layer_and_param_count_alone_trains(bare, tmp_path):
  config = bare
  # Trains: the real trainer, sharded over data, fsdp and tensor.
  trainer, checkpointer, writer = make_trainer(str(tmp_path), config, train_steps=8,
                                               checkpoint_every=8)
  losses = []
  trainer.add_hook(lambda info: losses.append(info.metrics["loss"]))
  try:
    result = trainer.run()
  finally:
    checkpointer.close()
    writer.close()
  assert result.last_step == 8 and losses[-1] < losses[0]


def test_a_spec_without_a_layer_or_param_count_is_refused():
  spec = type("Nameless", (), {"name": "nameless", "layer": DiagonalRecurrence})()
  with pytest.raises(ValueError, match=r"lacks \['param_count'\]"):
    block_registry.register(spec)
  assert "nameless" not in block_registry.names()


def test_unregistered_block_types_are_errors_not_zeros(diagonal):
  config = diagonal
  with pytest.raises(ValueError, match="unknown block type 'mamba'"):
    ModelConfig(block_pattern=("recurrent", "mamba"))
  with pytest.raises(ValueError, match="diagonal recurrence blocks have no transformers"):
    hf_params.check_exportable(config)
  spec = block_registry.get(NAME).spec
  block_registry.register(spec)    # the same spec again is no error, another one is
  with pytest.raises(ValueError, match="registered already"):
    block_registry.register(DiagonalSpec())
  block_registry.unregister(NAME)
  try:
    # A config built while the type was known: every count names the missing type.
    with pytest.raises(ValueError, match="unknown block type 'diagonal'"):
      counting.training_flops_per_token(config, 32)
    with pytest.raises(ValueError, match="unknown block type 'diagonal'"):
      memory.activation_bytes_per_token(config, 32, 1)
  finally:
    block_registry.register(spec)   # for the fixture's teardown


def test_a_block_with_an_unruled_logical_axis_is_refused():
  spec = type("Unruled", (DiagonalSpec,), {"name": "unruled", "family": None,
                                           "logical_axes": ("diagonal_channels",)})()
  with pytest.raises(ValueError, match="no rule in sharding.rules.DEFAULT_RULES"):
    block_registry.register(spec)
  assert "unruled" not in block_registry.names()
