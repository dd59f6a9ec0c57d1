"""μP's coordinate check: how far every layer's output and the logits move, against width.

For each family (Griffin, Hawk, MQA, GateLoop) and parametrisation (standard, μP with
the smallest width as the base), a tiny model of each width takes a few Adam steps at
one constant learning rate on a fixed batch of real text (bytes of the running Python's
standard-library sources, as the quickstart trains on), and the script records the RMS of
(output after − output before) of every residual block and of the logits, on that
batch. Under μP the moves stay flat in width; under the standard parametrisation they
grow (Adam's steps are Θ(1) per entry, so a matrix's effect on its output grows with its
fan-in). The slope of log RMS against log width is the summary tests/test_mup.py
bounds. docs/model.md ("μP") reads the results.

Every block is kept out of the depth scan (a block pattern longer than the depth leaves
them all in the unscanned remainder), so Flax can capture each block's output; the
model is the same either way.

Examples:
  python benchmarks/mup_coord_check.py                       # widths 64 … 1024, all families
  python benchmarks/mup_coord_check.py --families=hawk --widths=64,128,256
Writes --output (JSON) and a PNG beside it (log-log panels per family).
"""
from __future__ import annotations

from plumbing import quiet
quiet.setup()  # first, before JAX or TensorFlow load: see plumbing/quiet.py
# pylint: disable=wrong-import-position
import json
import os
from typing import Any, Callable, Sequence

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

import model  # pylint: disable=unused-import  # registers the built-in blocks
from model import lm, parametrization
from model.config import ModelConfig
from model.residual_block import ResidualBlock
from plumbing import cli
from pretrain import optimizer as optimizer_lib

# family -> (block pattern, depth): the pattern is longer than the depth (module docstring).
FAMILIES = {
    "griffin": (("recurrent", "recurrent", "attention", "recurrent"), 3),
    "hawk": (("recurrent",) * 3, 2),
    "mqa": (("attention",) * 3, 2),
    "gateloop": (("gateloop",) * 3, 2),
    # Every block type in one model: what tests/test_mup.py checks in the fast tier.
    "mixed": (("recurrent", "attention", "gateloop", "recurrent"), 3),
}
PARAMETRIZATIONS = ("standard", "mup")
VOCAB = 256   # raw bytes
HEADS = 2     # fixed in width: μP's convention here (model.parametrization)
WINDOW = 16   # Griffin's local attention; MQA's is global

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_list("families", ["griffin", "hawk", "mqa", "gateloop"], "Families to check.")
  flags.DEFINE_list("widths", ["64", "128", "256", "512", "1024"],
                    "Widths; the first is μP's base width.")
  flags.DEFINE_float("learning_rate", 1e-2, "Adam's constant learning rate.")
  flags.DEFINE_integer("steps", 3, "Adam steps.", lower_bound=1)
  flags.DEFINE_integer("batch", 4, "Sequences in the fixed batch.", lower_bound=1)
  flags.DEFINE_integer("seq", 64, "Tokens per sequence.", lower_bound=2)
  flags.DEFINE_string("output", "benchmarks/results/mup_coord_check.json",
                      "JSON results; the plot is written beside it (.png).")


def family_config(family: str, width: int, kind: str, base_width: int) -> ModelConfig:
  """A tiny model of `family` at `width` under parametrisation `kind`."""
  pattern, depth = FAMILIES[family]
  return ModelConfig(
      vocab_size=VOCAB, width=width, rnn_width=width, num_heads=HEADS, depth=depth,
      block_pattern=pattern, attention_window=None if family in ("mqa", "mixed") else WINDOW,
      parametrization=kind,
      mup_base_width=base_width if kind == "mup" else None)


def text_batch(batch: int, seq: int) -> np.ndarray:
  """int32 [batch, seq] byte tokens of the standard library's `os.py` (fixed text)."""
  with open(os.__file__, "rb") as f:
    data = np.frombuffer(f.read(batch * seq), np.uint8)
  if data.size < batch * seq:
    raise ValueError(f"{os.__file__} has fewer than {batch * seq} bytes")
  return data.reshape(batch, seq).astype(np.int32)


def update_rms(config: ModelConfig, tokens: np.ndarray, learning_rate: float,
               steps: int, seed: int = 0) -> dict[str, float]:
  """{"block_{l}": …, "logits": …}: the RMS of how far each residual block's output and
  the logits move on `tokens` after `steps` Adam steps of next-token loss on them (no
  decay, no clipping, a constant rate times μP's per-parameter multipliers)."""
  language_model = lm.LanguageModel(config)
  inputs, targets = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])
  positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
  abstract_params, _ = lm.abstract_params_and_axes(config)
  optimizer = optimizer_lib.make_optimizer(
      optimizer_lib.OptimizerConfig(peak_learning_rate=learning_rate, warmup_steps=0,
                                    final_learning_rate_fraction=1.0, weight_decay=0.0,
                                    clip_norm=None),
      steps, parametrization.learning_rate_multipliers(config, abstract_params))

  def outputs(params: Any) -> dict[str, jax.Array]:
    (logits, _), state = language_model.apply(
        {"params": params}, inputs, positions, mutable=["intermediates"],
        capture_intermediates=lambda module, _: isinstance(module, ResidualBlock))
    blocks = state["intermediates"]
    return {"logits": logits, **{f"block_{l}": blocks[f"remainder_{l}"]["__call__"][0][0]
                                 for l in range(config.depth)}}

  def loss(params: Any) -> jax.Array:
    logits, _ = language_model.apply({"params": params}, inputs, positions)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  def step(_, carry):
    params, state = carry
    updates, state = optimizer.update(jax.grad(loss)(params), state, params)
    return optax.apply_updates(params, updates), state

  @jax.jit
  def moved(key: jax.Array) -> dict[str, jax.Array]:
    params = lm.init_params(config, key)   # one program: init, steps, both measurements
    trained, _ = jax.lax.fori_loop(0, steps, step, (params, optimizer.init(params)))
    return jax.tree.map(lambda a, b: jnp.sqrt(jnp.mean(jnp.square(a - b))),
                        outputs(trained), outputs(params))

  return {name: float(value) for name, value in moved(jax.random.key(seed)).items()}


def slope(widths: Sequence[int], values: Sequence[float]) -> float:
  """The least-squares slope of log value against log width."""
  return float(np.polyfit(np.log(widths), np.log(values), 1)[0])


def plot_panels(results: dict[str, Any], path: str, xlabel: str, ylabel: str,
                draw: Callable[[Any, dict[str, Any]], str]) -> None:
  """A panel per family (columns) and parametrisation (rows) of `results["families"]`:
  `draw(axis, runs)` plots one panel's runs and returns its title's detail."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
  families = list(results["families"])
  figure, axes = plt.subplots(len(PARAMETRIZATIONS), len(families),
                              figsize=(4.5 * len(families), 7), squeeze=False,
                              sharex=True)
  for column, family in enumerate(families):
    for row, kind in enumerate(PARAMETRIZATIONS):
      axis = axes[row][column]
      detail = draw(axis, results["families"][family][kind])
      axis.set_title(f"{family}, {kind}{detail}")
      axis.set_xlabel(xlabel)
      axis.legend(fontsize=7)
    axes[0][column].set_ylabel(ylabel)
  figure.tight_layout()
  figure.savefig(path, dpi=110)


def _plot(results: dict[str, Any], path: str) -> None:
  def draw(axis: Any, runs: dict[str, Any]) -> str:
    for name in runs["rms"][0]:
      axis.loglog(results["widths"], [rms[name] for rms in runs["rms"]], marker="o",
                  label=f"{name} ({runs['slopes'][name]:+.2f})")
    return ""
  plot_panels(results, path, "width", "RMS of the move", draw)


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  widths = [int(w) for w in FLAGS.widths]
  tokens = text_batch(FLAGS.batch, FLAGS.seq)
  results: dict[str, Any] = {"widths": widths, "base_width": widths[0],
                             "learning_rate": FLAGS.learning_rate, "steps": FLAGS.steps,
                             "batch": [FLAGS.batch, FLAGS.seq], "families": {}}
  for family in FLAGS.families:
    results["families"][family] = {}
    for kind in PARAMETRIZATIONS:
      rms = [update_rms(family_config(family, w, kind, widths[0]), tokens,
                        FLAGS.learning_rate, FLAGS.steps) for w in widths]
      slopes = {name: slope(widths, [r[name] for r in rms]) for name in rms[0]}
      results["families"][family][kind] = {"rms": rms, "slopes": slopes}
      print(f"{family:9s} {kind:9s} slopes: "
            + ", ".join(f"{name} {value:+.2f}" for name, value in slopes.items()))
  os.makedirs(os.path.dirname(os.path.abspath(FLAGS.output)), exist_ok=True)
  with open(FLAGS.output, "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1)
  _plot(results, os.path.splitext(FLAGS.output)[0] + ".png")
  print(f"wrote {FLAGS.output} and its .png")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
