"""Times our full training step against the same model built from recurrentgemma.

Both models run inside the same jitted, state-donating AdamW step (`pretrain.optimizer`,
one optimizer object for both) with the same loss (mean next-token NLL,
`pretrain.losses.token_losses`), on identical random batches of packed documents
(positions restart at 0 at every document start). The reference is
`recurrentgemma.jax.Griffin` with a `GriffinConfig` of the same width, depth, heads,
window, block types, vocabulary and MLP width, and the same remat setting:

- remat "none": `Griffin(gradient_checkpointing=False)`;
- remat "full": `Griffin(gradient_checkpointing=True)`, which rematerialises every
  residual block (ours rematerialises every repeating unit of the block pattern: both
  keep only the inputs of the remat unit for the backward pass);
- remat "save_matmuls" or gate blocks != heads (recurrentgemma has neither a remat
  policy nor separate RG-LRU gate blocks): `_ReferenceGriffin`, a `Griffin` whose setup
  builds the same recurrentgemma modules with the policy applied per residual block
  and with `num_heads` = the gate blocks in recurrent blocks (a residual block uses
  `num_heads` only for its temporal block, so this is exactly the model with both
  counts).

Before timing, the reference's initial parameters are mapped into ours
(`model.recurrentgemma_params`), so both start from the same weights: the first step's
losses must then agree (float32: 1e-4 relative, bfloat16: 2e-2), otherwise the script
stops, because the comparison would not be apples to apples.

Timing: compile time (lower + compile), then `--warmup` steps (the first is the loss
check), then `--steps` timed steps per model, alternating which model goes first each
step so that load from other jobs on a shared machine hits both alike. tokens/s =
batch x seq / median step time; the ratio is ours / reference.

Examples:
  python benchmarks/train_step.py --preset=quickstart --batch=8 --seq=256
  python benchmarks/train_step.py --preset=griffin_100m --batch=2 --seq=512 --dtype=float32
  python benchmarks/train_step.py --preset=configs/models/tiny_griffin.gin --batch=2 \\
      --seq=32 --steps=2 --warmup=1 --json=/tmp/result.json

recurrentgemma's RG-LRU scan uses unroll=128, which takes about a minute per scan to
compile on CPU: expect the reference's compile time to dominate a CPU run.
"""
from __future__ import annotations

from plumbing import quiet
quiet.setup()  # first, before JAX or TensorFlow load: see plumbing/quiet.py
# pylint: disable=wrong-import-position
import dataclasses
import json
import os
import platform
import statistics
import time
from typing import Any, Callable, Optional

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
from recurrentgemma import common
from recurrentgemma.jax import griffin
from recurrentgemma.jax import layers as rg_layers
from recurrentgemma.jax import modules as rg_modules

from model import lm
from model import recurrentgemma_params
from model.config import BlockType, ModelConfig, model_config_from_dict
from absl import flags

from plumbing import cli
from plumbing.errors import UserError, usage_error
from pretrain.observability import flops as flops_lib
from pretrain import optimizer as optimizer_lib
from pretrain.losses import token_losses

PRESET_FILES = {
    "quickstart": "configs/quickstart.gin",
    "griffin_100m": "configs/models/griffin_100m.gin",
}
REMAT_POLICIES = {
    "full": None,  # save nothing
    "save_matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
# Relative first-step loss difference allowed between the two models.
LOSS_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}


# -- configuration -------------------------------------------------------------------
def preset_file(preset: str) -> str:
  """A preset name (quickstart, griffin_100m, any configs/models/<name>) or a gin path."""
  from pretrain import gin_config  # pylint: disable=g-import-not-at-top  # see load_model_config
  if preset in PRESET_FILES:
    return os.path.join(gin_config.REPO_ROOT, PRESET_FILES[preset])
  for candidate in (preset, os.path.join(gin_config.REPO_ROOT, preset),
                    os.path.join(gin_config.REPO_ROOT, "configs", "models", preset + ".gin")):
    if os.path.isfile(candidate):
      return candidate
  raise usage_error(f"--preset={preset!r} is neither a preset ({sorted(PRESET_FILES)}), "
                   "a configs/models/<name>.gin name, nor an existing gin file")


def config_from_json(path: str) -> ModelConfig:
  """The ModelConfig in a JSON file: `model.config.model_config_to_dict`'s form, e.g.
  the "config" of an earlier --json (its extra "depth_unroll" is ignored).

  This path needs no Gin and none of the trainer's data stack (SeqIO, TensorFlow), so
  the benchmark also runs where only JAX and Flax are installed.
  """
  with open(path) as f:
    fields = json.load(f)
  fields = fields.get("config", fields)  # a whole result file works too
  fields.pop("depth_unroll", None)
  try:
    return model_config_from_dict(fields)
  except (TypeError, ValueError) as error:
    raise usage_error(f"--preset={path}: not a ModelConfig: {error}") from None


def load_model_config(preset: str, **overrides: Any) -> ModelConfig:
  """The preset's ModelConfig with the non-None `overrides` applied.

  A gin preset goes through the trainer's Gin set-up (imported here, not at the top:
  it brings the data pipeline); a .json preset through `config_from_json`.
  """
  if preset.endswith(".json"):
    config = config_from_json(preset)
  else:
    from pretrain import gin_config  # pylint: disable=g-import-not-at-top
    try:
      gin_config.parse([preset_file(preset)], [])
      config = gin_config.build(ModelConfig)
    finally:
      gin.clear_config()
  try:
    return config.replace(**{k: v for k, v in overrides.items() if v is not None})
  except ValueError as error:
    raise usage_error(str(error).splitlines()[0]) from None


def reference_config(config: ModelConfig, seq: int) -> common.GriffinConfig:
  """recurrentgemma's GriffinConfig of the same model; ValueError if it has none."""
  unsupported = set(config.block_pattern) - {BlockType.RECURRENT.value,
                                             BlockType.ATTENTION.value}
  if unsupported:
    raise ValueError(f"ModelConfig.block_pattern has {sorted(unsupported)} blocks, which "
                     "recurrentgemma does not implement; benchmark a Griffin, Hawk or MQA "
                     "preset")
  if config.lru_variant != "real":
    raise ValueError("ModelConfig.lru_variant must be 'real' to compare with "
                     "recurrentgemma (its training model has only the real RG-LRU)")
  if config.conv_width != 4:
    raise ValueError(f"ModelConfig.conv_width={config.conv_width}: recurrentgemma's "
                     "Griffin always builds a Conv1D of width 4; use conv_width=4")
  block_type = {BlockType.RECURRENT.value: common.TemporalBlockType.RECURRENT,
                BlockType.ATTENTION.value: common.TemporalBlockType.ATTENTION}
  return common.GriffinConfig(
      vocab_size=config.vocab_size, width=config.width,
      mlp_expanded_width=config.mlp_width, num_heads=config.num_heads,
      block_types=tuple(block_type[t] for t in config.block_types),
      embeddings_scale_by_sqrt_dim=config.embeddings_scale_by_sqrt_dim,
      # Our global attention (window None) is a window covering the whole row.
      attention_window_size=config.attention_window or seq,
      logits_soft_cap=config.logits_soft_cap or 0.0, lru_width=config.rnn_width,
      scan_type=common.ScanType.LINEAR_NATIVE)


class _ReferenceGriffin(griffin.Griffin):
  """`Griffin` with a remat policy and RG-LRU gate blocks recurrentgemma does not expose.

  Only `setup` differs: the same recurrentgemma modules, with `remat_policy` given to
  `nn.remat` around every residual block, and `gate_blocks` as the `num_heads` of
  recurrent blocks (where it only sets the gates' block count).
  """
  gate_blocks: int = 0
  remat_policy: Optional[Callable[..., bool]] = None

  def setup(self):
    cfg = self.config
    self.embedder = rg_modules.Embedder(
        vocab_size=cfg.vocab_size, embed_dim=cfg.width,
        scale_by_sqrt_dim=cfg.embeddings_scale_by_sqrt_dim, dtype=self.dtype,
        param_dtype=self.param_dtype)
    block_class = rg_modules.ResidualBlock
    if self.gradient_checkpointing:
      block_class = nn.remat(block_class, static_argnums=4, policy=self.remat_policy)
    self.blocks = [
        block_class(
            name=f"blocks.{i}", width=cfg.width, mlp_expanded_width=cfg.mlp_expanded_width,
            num_heads=(self.gate_blocks if block == common.TemporalBlockType.RECURRENT
                       else cfg.num_heads),
            lru_width=cfg.lru_width, attention_window_size=cfg.attention_window_size,
            temporal_block_type=block, scan_type=cfg.scan_type,
            final_w_init_variance_scale=2.0 / cfg.num_layers,
            scan_sharding_spec=self.scan_sharding_spec, dtype=self.dtype,
            param_dtype=self.param_dtype)
        for i, block in enumerate(cfg.block_types)]
    self.final_norm = rg_layers.RMSNorm(width=cfg.width, dtype=self.dtype,
                                        param_dtype=self.param_dtype)


def reference_model(config: ModelConfig, seq: int) -> tuple[nn.Module, str]:
  """The recurrentgemma-built model of `config` and a one-line description of it."""
  rg_config = reference_config(config, seq)
  dtype = jnp.dtype(config.dtype)
  checkpointing = config.remat != "none"
  if config.remat != "save_matmuls" and config.gate_blocks == config.num_heads:
    return (griffin.Griffin(rg_config, gradient_checkpointing=checkpointing, dtype=dtype),
            f"recurrentgemma.jax.Griffin(gradient_checkpointing={checkpointing})")
  model = _ReferenceGriffin(rg_config, gradient_checkpointing=checkpointing, dtype=dtype,
                            gate_blocks=config.gate_blocks,
                            remat_policy=REMAT_POLICIES.get(config.remat))
  return model, (f"Griffin built from recurrentgemma modules (gate blocks "
                 f"{config.gate_blocks}, remat {config.remat} per residual block)")


# -- data and step -------------------------------------------------------------------
def packed_batch(rng: np.random.Generator, batch: int, seq: int, vocab: int
                 ) -> dict[str, jax.Array]:
  """Random tokens in rows packing documents of 1..seq/2 tokens (positions restart)."""
  positions = np.zeros((batch, seq), np.int32)
  for row in positions:
    start = 0
    while start < seq:
      length = int(rng.integers(1, max(seq // 2, 1) + 1))
      row[start:start + length] = np.arange(min(length, seq - start))
      start += length
  return {"inputs": jnp.asarray(rng.integers(0, vocab, (batch, seq)), jnp.int32),
          "targets": jnp.asarray(rng.integers(0, vocab, (batch, seq)), jnp.int32),
          "positions": jnp.asarray(positions),
          "weights": jnp.ones((batch, seq), jnp.float32)}


def make_train_step(logits_fn: Callable[[Any, jax.Array, jax.Array], jax.Array],
                    optimizer: optax.GradientTransformation) -> Callable:
  """jit(params, opt_state, batch) -> (params, opt_state, loss), state donated."""
  def loss_fn(params, batch):
    logits = logits_fn(params, batch["inputs"], batch["positions"])
    nll, _ = token_losses(logits, batch["targets"])
    return jnp.sum(nll * batch["weights"]) / jnp.sum(batch["weights"])

  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1))


class Runner:
  """One model's compiled step and its state; `step` times one call to completion."""

  def __init__(self, name: str, train_step: Callable, params: Any,
               optimizer: optax.GradientTransformation, example_batch: dict):
    self.name = name
    # Fresh buffers: `params` may alias the other model's (numpy views), and are donated.
    self.params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
    self.opt_state = jax.jit(optimizer.init)(self.params)
    start = time.perf_counter()
    self.compiled = train_step.lower(self.params, self.opt_state, example_batch).compile()
    self.compile_s = time.perf_counter() - start
    self.step_s: list[float] = []

  def step(self, batch: dict) -> tuple[float, float]:
    """(loss, seconds) of one step on `batch`."""
    start = time.perf_counter()
    self.params, self.opt_state, loss = self.compiled(self.params, self.opt_state, batch)
    loss = float(jax.block_until_ready(loss))
    return loss, time.perf_counter() - start


# -- benchmark -----------------------------------------------------------------------
def run(config: ModelConfig, batch: int, seq: int, steps: int, warmup: int,
        seed: int = 0, with_reference: bool = True) -> dict:
  """Compiles and times both models (ours alone without `with_reference`, e.g. for
  MFU on an accelerator, where the reference's unroll-128 scans compile for minutes);
  returns the results as a JSON-able dict."""
  if warmup < 1 or steps < 1:
    raise ValueError(f"--warmup ({warmup}) and --steps ({steps}) must be >= 1: the first "
                     "warm-up step is the loss check")
  reference, reference_name = reference_model(config, seq)
  dummy = jnp.zeros((1, 1), jnp.int32)  # init needs shapes only; T=1 keeps it cheap
  reference_params = jax.jit(reference.init)(jax.random.PRNGKey(seed), dummy, dummy)["params"]
  our_params = recurrentgemma_params.recurrentgemma_to_ours(reference_params, config)

  # One optimizer for both trees: our no-decay patterns plus recurrentgemma's bias name.
  optimizer = optimizer_lib.make_optimizer(
      optimizer_lib.OptimizerConfig(
          no_decay_patterns=optimizer_lib.NO_DECAY_PATTERNS + ("b",)),
      total_steps=warmup + steps)
  rng = np.random.default_rng(seed)
  batches = [packed_batch(rng, batch, seq, config.vocab_size) for _ in range(2)]

  ours_model = lm.LanguageModel(config)
  runners = [Runner("ours", make_train_step(
      lambda p, t, s: ours_model.apply({"params": p}, t, s)[0], optimizer),
      our_params, optimizer, batches[0])]
  print(f"compiled ours in {runners[0].compile_s:.1f} s", flush=True)
  if with_reference:
    runners.append(Runner("reference", make_train_step(
        lambda p, t, s: reference.apply({"params": p}, t, s, return_cache=False)[0],
        optimizer), reference_params, optimizer, batches[0]))
    print(f"compiled the reference in {runners[1].compile_s:.1f} s", flush=True)
  first_losses = {}
  for i in range(warmup + steps):
    order = runners if i % 2 == 0 else runners[::-1]
    for runner in order:
      loss, seconds = runner.step(batches[i % len(batches)])
      if i == 0:
        first_losses[runner.name] = loss
      if i >= warmup:
        runner.step_s.append(seconds)

  reference_loss = first_losses.get("reference", first_losses["ours"])
  difference = abs(first_losses["ours"] - reference_loss)
  relative = difference / abs(reference_loss)
  tokens = batch * seq
  flops_per_token = flops_lib.training_flops_per_token(config, seq)
  models = {}
  for runner in runners:
    median = statistics.median(runner.step_s)
    models[runner.name] = {
        "compile_s": runner.compile_s, "mean_step_s": statistics.mean(runner.step_s),
        "median_step_s": median, "tokens_per_s": tokens / median,
        "mfu": flops_lib.mfu(tokens / median, flops_per_token),
        "first_loss": first_losses[runner.name], "step_s": runner.step_s}
  return {
      "config": {**dataclasses.asdict(config), "depth_unroll": config.depth_unroll},
      "batch": batch, "seq": seq, "steps": steps, "warmup": warmup,
      "reference": reference_name if with_reference else None, "models": models,
      "ratio_tokens_per_s": (models["ours"]["tokens_per_s"]
                             / models["reference"]["tokens_per_s"]
                             if with_reference else None),
      "loss_difference": difference, "loss_relative_difference": relative,
      "loss_tolerance": LOSS_TOLERANCE[config.dtype],
      "training_flops_per_token": flops_per_token,
      "device": describe_device(), "jax_version": jax.__version__,
  }


def describe_device() -> str:
  device = jax.devices()[0]
  if device.platform == "cpu":
    return f"CPU ({os.cpu_count()} cores, {platform.processor() or platform.machine()})"
  return f"{device.platform.upper()} ({device.device_kind}) x{jax.device_count()}"


def format_table(result: dict) -> str:
  cfg = result["config"]
  lines = [
      f"Training step, batch {result['batch']} x seq {result['seq']}: width {cfg['width']}, "
      f"depth {cfg['depth']}, rnn {cfg['rnn_width']}, heads {cfg['num_heads']}, gate blocks "
      f"{cfg['num_gate_blocks'] or cfg['num_heads']}, window {cfg['attention_window']}, "
      f"vocab {cfg['vocab_size']}, dtype {cfg['dtype']}, remat {cfg['remat']}, "
      f"scan_impl {cfg['scan_impl']}, depth scan {cfg['depth_unroll']} unit(s) per "
      f"iteration of {max(cfg['depth'] // len(cfg['block_pattern']), 1)}",
      f"Device: {result['device']}, JAX {result['jax_version']}; {result['steps']} timed "
      f"steps after {result['warmup']} warm-up",
      f"Reference: {result['reference'] or 'not run (--noreference)'}",
      "",
      "| model | compile s | mean step ms | median step ms | tokens/s | MFU |",
      "|---|---|---|---|---|---|",
  ]
  for name, m in result["models"].items():
    mfu = "n/a" if m["mfu"] is None else f"{100 * m['mfu']:.1f}%"
    lines.append(f"| {name} | {m['compile_s']:.1f} | {1e3 * m['mean_step_s']:.1f} | "
                 f"{1e3 * m['median_step_s']:.1f} | {m['tokens_per_s']:.0f} | {mfu} |")
  if result["reference"] is None:
    return "\n".join(lines)
  lines += [
      "",
      f"ours / reference tokens/s: {result['ratio_tokens_per_s']:.2f}",
      f"first-step loss: ours {result['models']['ours']['first_loss']:.6f}, reference "
      f"{result['models']['reference']['first_loss']:.6f}, |difference| "
      f"{result['loss_difference']:.2e} (relative {result['loss_relative_difference']:.2e},"
      f" tolerance {result['loss_tolerance']:.0e})",
  ]
  return "\n".join(lines)


FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_string("preset", "quickstart",
                      "quickstart, griffin_100m, a configs/models name, a gin file, or a "
                      "JSON file of ModelConfig fields (e.g. an earlier --json result)")
  flags.DEFINE_integer("batch", 8, "Global batch (sequences).", lower_bound=1)
  flags.DEFINE_integer("seq", 256, "Sequence length.", lower_bound=1)
  flags.DEFINE_integer("steps", 10, "Timed steps per model.", lower_bound=1)
  flags.DEFINE_integer("warmup", 2, "Untimed steps per model; the first checks the losses "
                       "agree.", lower_bound=1)
  flags.DEFINE_enum("remat", None, ["none", "full", "save_matmuls"],
                    "Default: the preset's.")
  flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"],
                    "Compute dtype; default: the preset's.")
  flags.DEFINE_integer("vocab_size", None, "Default: the preset's.", lower_bound=1)
  flags.DEFINE_string("scan_impl", None, "Our ModelConfig.scan_impl; default: the preset's.")
  flags.DEFINE_integer("depth_scan_unroll", None,
                       "Our ModelConfig.depth_scan_unroll; default: the preset's.")
  flags.DEFINE_integer("seed", 0, "Seed of weights and batches.")
  flags.DEFINE_bool("reference", True, "Also build, check and time recurrentgemma's "
                    "model; --noreference times ours alone (no loss check).")
  flags.DEFINE_string("json", None, "Also write the results to this JSON file.")


def main(argv: list[str]) -> None:
  cli.reject_extra_arguments(argv)
  config = load_model_config(FLAGS.preset, remat=FLAGS.remat, dtype=FLAGS.dtype,
                             vocab_size=FLAGS.vocab_size, scan_impl=FLAGS.scan_impl,
                             depth_scan_unroll=FLAGS.depth_scan_unroll)
  result = run(config, FLAGS.batch, FLAGS.seq, FLAGS.steps, FLAGS.warmup, FLAGS.seed,
               FLAGS.reference)
  print(format_table(result))
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(result, f, indent=1)
  if result["loss_relative_difference"] > result["loss_tolerance"]:
    raise UserError("the two models disagree on the first batch's loss, so they do not "
                    "compute the same function and the timing comparison is meaningless; "
                    "check reference_config() and model/recurrentgemma_params.py")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
