"""Does the best learning rate hold across widths? A learning-rate sweep at several widths
under the standard parametrisation and under μP, for Griffin and MQA.

For each family, parametrisation and width (the first width is μP's base width), every
learning rate of a log-spaced grid trains the same tiny model from the same
initialisation on the same stream of real text (byte tokens of the running Python's
standard-library sources, random windows, as the quickstart trains on), with the
project's optimizer: AdamW with linear warm-up and cosine decay, global-norm clipping,
no weight decay, and μP's per-parameter multipliers under μP. All rates of one width
train side by side in one compiled program (the rate is an input: with no weight decay
AdamW's update is the rate times a rate-free direction), so a width costs one compile.
The score is the loss on held-out windows (from files the training windows never touch)
after the last step.

Printed: the loss of every (width, rate), the best rate per width, and its drift from
the base width's best in grid steps; written: --output (JSON) and a PNG beside it (loss
against rate, one curve per width, a panel per family and parametrisation).
docs/model.md ("μP") and benchmarks/RESULTS.md read the results.

  nice -n 19 python benchmarks/mup_transfer.py                 # the recorded run
  python benchmarks/mup_transfer.py --families=mqa --widths=16,32 --steps=20
"""
from __future__ import annotations

from plumbing import quiet
quiet.setup()  # first, before JAX or TensorFlow load: see plumbing/quiet.py
# pylint: disable=wrong-import-position
import importlib.util
import json
import os
import sysconfig
import time
from typing import Any, Sequence

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

import model  # pylint: disable=unused-import  # registers the built-in blocks
from model import lm, parametrization
from plumbing import cli
from pretrain import optimizer as optimizer_lib

FLAGS = flags.FLAGS
PARAMETRIZATIONS = ("standard", "mup")


def define_flags() -> None:
  flags.DEFINE_list("families", ["griffin", "mqa"], "Families to sweep.")
  flags.DEFINE_list("widths", ["16", "32", "64", "128"],
                    "Widths; the first is μP's base width.")
  flags.DEFINE_float("min_log2_rate", -12.0, "log2 of the smallest learning rate.")
  flags.DEFINE_float("max_log2_rate", -3.0, "log2 of the largest learning rate.")
  flags.DEFINE_float("log2_step", 1.0, "Grid step in log2 (one grid step = a factor 2).")
  flags.DEFINE_integer("steps", 200, "Training steps.", lower_bound=2)
  flags.DEFINE_integer("batch", 8, "Sequences per step.", lower_bound=1)
  flags.DEFINE_integer("seq", 64, "Tokens per sequence.", lower_bound=2)
  flags.DEFINE_string("output", "benchmarks/results/mup_transfer.json",
                      "JSON results; the plot is written beside it (.png).")


def _coord_check() -> Any:
  """benchmarks/mup_coord_check.py, for its tiny model of each family."""
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mup_coord_check.py")
  spec = importlib.util.spec_from_file_location("mup_coord_check", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def text_windows(count: int, seq: int, held_out: bool, seed: int) -> np.ndarray:
  """int32 [count, seq + 1] random windows of the standard library's sources: the
  first 80% of its files (sorted by path) for training, the rest held out."""
  files = sorted(os.path.join(root, name)
                 for root, _, names in os.walk(sysconfig.get_paths()["stdlib"])
                 for name in names if name.endswith(".py") and "test" not in root)
  cut = int(len(files) * 0.8)
  chunks = []
  for path in (files[cut:] if held_out else files[:cut]):
    with open(path, "rb") as f:
      chunks.append(np.frombuffer(f.read(), np.uint8))
  data = np.concatenate(chunks)
  starts = np.random.default_rng(seed).integers(0, data.size - seq - 1, count)
  return np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int32)


def sweep(config: Any, rates: np.ndarray, train: np.ndarray, held_out: np.ndarray,
          steps: int) -> np.ndarray:
  """The held-out loss after `steps` steps at each of `rates` (one compiled program)."""
  language_model = lm.LanguageModel(config)
  abstract_params, _ = lm.abstract_params_and_axes(config)
  direction = optimizer_lib.make_optimizer(
      optimizer_lib.OptimizerConfig(peak_learning_rate=1.0, warmup_steps=steps // 10,
                                    weight_decay=0.0),
      steps, parametrization.learning_rate_multipliers(config, abstract_params))

  def loss(params: Any, tokens: jax.Array) -> jax.Array:
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32),
                                 inputs.shape)
    logits, _ = language_model.apply({"params": params}, inputs, positions)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  def train_one(rate: jax.Array, params: Any, batches: jax.Array) -> jax.Array:
    def step(carry, tokens):
      params, state = carry
      updates, state = direction.update(jax.grad(loss)(params, tokens), state, params)
      updates = jax.tree.map(lambda u: rate * u, updates)
      return (optax.apply_updates(params, updates), state), None
    (trained, _), _ = jax.lax.scan(step, (params, direction.init(params)), batches)
    return loss(trained, held_out)

  params = lm.init_params(config, jax.random.key(0))
  run = jax.jit(jax.vmap(train_one, in_axes=(0, None, None)))
  batches = jnp.asarray(train.reshape(steps, -1, train.shape[-1]))
  return np.asarray(run(jnp.asarray(rates, jnp.float32), params, batches))


def best_index(losses: Sequence[float]) -> int:
  """The grid index of the lowest finite loss."""
  finite = np.where(np.isfinite(losses), losses, np.inf)
  return int(np.argmin(finite))


def _plot(coord_check: Any, results: dict[str, Any], path: str) -> None:
  def draw(axis: Any, runs: dict[str, Any]) -> str:
    for width, losses in zip(results["widths"], runs["losses"]):
      axis.semilogx(results["rates"], np.minimum(losses, 8.0), marker="o",
                    label=f"width {width}", base=2)
    return f": best-rate drift {runs['drift']} steps"
  coord_check.plot_panels(results, path, "learning rate", "held-out loss", draw)


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  coord_check = _coord_check()
  widths = [int(w) for w in FLAGS.widths]
  rates = 2.0 ** np.arange(FLAGS.min_log2_rate, FLAGS.max_log2_rate + 1e-9,
                           FLAGS.log2_step)
  train = text_windows(FLAGS.steps * FLAGS.batch, FLAGS.seq, held_out=False, seed=0)
  held_out = jnp.asarray(text_windows(4 * FLAGS.batch, FLAGS.seq, held_out=True, seed=1))
  results: dict[str, Any] = {
      "widths": widths, "base_width": widths[0], "rates": rates.tolist(),
      "steps": FLAGS.steps, "batch": [FLAGS.batch, FLAGS.seq], "families": {}}
  started = time.perf_counter()
  for family in FLAGS.families:
    results["families"][family] = {}
    for kind in PARAMETRIZATIONS:
      losses = [sweep(coord_check.family_config(family, width, kind, widths[0]), rates,
                      train, held_out, FLAGS.steps).tolist() for width in widths]
      best = [best_index(row) for row in losses]
      drift = max(abs(b - best[0]) for b in best)
      results["families"][family][kind] = {"losses": losses, "best": best, "drift": drift}
      print(f"{family:8s} {kind:9s} best rate per width: "
            + ", ".join(f"{w}: 2^{np.log2(rates[b]):+.0f}" for w, b in zip(widths, best))
            + f"; drift {drift} grid step(s)", flush=True)
  results["seconds"] = time.perf_counter() - started
  os.makedirs(os.path.dirname(os.path.abspath(FLAGS.output)), exist_ok=True)
  with open(FLAGS.output, "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1)
  _plot(coord_check, results, os.path.splitext(FLAGS.output)[0] + ".png")
  print(f"wrote {FLAGS.output} and its .png")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
