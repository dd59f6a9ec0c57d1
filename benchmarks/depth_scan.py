"""Scanned versus unrolled depth: compile time and step time of our loss gradient.

`model.lm` scans the repeating unit of the block pattern over depth, so compile time
stays flat in depth; `ModelConfig.depth_scan_unroll` runs several units per loop
iteration instead. This script measures what that choice costs for one preset and
shape: for each unroll value it compiles the jitted gradient of the mean next-token
loss (forward + backward, the part of a training step the choice affects), then times
the variants interleaved, alternating which goes first, so load from other jobs hits
all alike. It is the measurement behind the default (`depth_scan_unroll=None`: unroll
models of at most `model.config.AUTO_UNROLL_MAX_DEPTH` layers).

Examples:
  python benchmarks/depth_scan.py --preset=quickstart --batch=8 --seq=256
  python benchmarks/depth_scan.py --preset=griffin_100m --batch=2 --seq=512 --dtype=float32
  python benchmarks/depth_scan.py --preset=griffin_400m --batch=1 --seq=256 --unrolls=1,2,full
"""
from __future__ import annotations

from plumbing import quiet
quiet.setup()  # first, before JAX or TensorFlow load: see plumbing/quiet.py
# pylint: disable=wrong-import-position
import os
import statistics
import sys
import time
from typing import Sequence

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# pylint: disable-next=g-import-not-at-top,wrong-import-position
from train_step import load_model_config

from model import lm  # pylint: disable=wrong-import-position
from model.config import ModelConfig  # pylint: disable=wrong-import-position
from plumbing import cli  # pylint: disable=wrong-import-position
from plumbing.errors import usage_error  # pylint: disable=wrong-import-position

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_string("preset", "quickstart",
                      "quickstart, griffin_100m, a configs/models name, or a gin file.")
  flags.DEFINE_integer("batch", 8, "Sequences per step.", lower_bound=1)
  flags.DEFINE_integer("seq", 256, "Sequence length.", lower_bound=1)
  flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"],
                    "Compute dtype; default: the preset's.")
  flags.DEFINE_list("unrolls", ["1", "full"],
                    "Comma-separated units per iteration; 'full' = all units.")
  flags.DEFINE_integer("steps", 6, "Timed steps per variant.", lower_bound=1)


def _loss_gradient(config: ModelConfig):
  model = lm.LanguageModel(config)

  def loss(params, tokens, positions):
    logits, _ = model.apply({"params": params}, tokens, positions)
    targets = jnp.roll(tokens, -1, axis=1)
    nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
        logits, targets[..., None], -1)[..., 0]
    return jnp.mean(nll)

  return jax.jit(jax.grad(loss))


def _unroll_values(values: Sequence[str], config: ModelConfig) -> list[int]:
  """--unrolls as sorted unit counts; a usage error naming values that are not ones."""
  units = max(config.num_scanned_units, 1)
  bad = [v for v in values if v != "full" and not (v.isdigit() and int(v) >= 1)]
  if bad or not values:
    raise usage_error(f"--unrolls: values must be integers >= 1 or 'full', got {bad}")
  return sorted({units if v == "full" else min(int(v), units) for v in values})


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  base = load_model_config(FLAGS.preset, dtype=FLAGS.dtype)
  unrolls = _unroll_values(FLAGS.unrolls, base)
  batch, seq = FLAGS.batch, FLAGS.seq
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, base.vocab_size, (batch, seq)), jnp.int32)
  positions = jnp.tile(jnp.arange(seq, dtype=jnp.int32), (batch, 1))
  params = lm.init_params(base, jax.random.PRNGKey(0))
  default_unroll = base.replace(depth_scan_unroll=None).depth_unroll
  print(f"# {FLAGS.preset}: depth {base.depth}, {base.num_scanned_units} scanned unit(s) "
        f"of {len(base.block_pattern)} block(s), batch {batch} x seq {seq}, "
        f"{base.dtype}; device {jax.devices()[0].device_kind}, JAX {jax.__version__}; "
        f"default unroll (depth_scan_unroll=None): {default_unroll}")
  compiled, compile_s = {}, {}
  for unroll in unrolls:
    grad = _loss_gradient(base.replace(depth_scan_unroll=unroll))
    start = time.perf_counter()
    compiled[unroll] = grad.lower(params, tokens, positions).compile()
    compile_s[unroll] = time.perf_counter() - start
    jax.block_until_ready(compiled[unroll](params, tokens, positions))
  times = {u: [] for u in compiled}
  order = list(compiled)
  for step in range(FLAGS.steps):
    for unroll in (order if step % 2 == 0 else order[::-1]):
      start = time.perf_counter()
      jax.block_until_ready(compiled[unroll](params, tokens, positions))
      times[unroll].append(time.perf_counter() - start)
  scanned = statistics.median(times[order[0]])
  print("| units per iteration | compile s | median step ms | "
        f"step time / unroll {order[0]} |")
  print("|---|---|---|---|")
  for unroll in order:
    median = statistics.median(times[unroll])
    print(f"| {unroll} | {compile_s[unroll]:.1f} | {1e3 * median:.1f} | "
          f"{median / scanned:.2f} |")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
