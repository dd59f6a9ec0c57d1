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

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# pylint: disable-next=g-import-not-at-top,wrong-import-position
from train_step import load_model_config

from model import lm  # pylint: disable=wrong-import-position
from model.config import ModelConfig  # pylint: disable=wrong-import-position


def _loss_gradient(config: ModelConfig):
  model = lm.LanguageModel(config)

  def loss(params, tokens, positions):
    logits, _ = model.apply({"params": params}, tokens, positions)
    targets = jnp.roll(tokens, -1, axis=1)
    nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
        logits, targets[..., None], -1)[..., 0]
    return jnp.mean(nll)

  return jax.jit(jax.grad(loss))


def _unroll_values(spec: str, config: ModelConfig) -> list[int]:
  """--unrolls as sorted unit counts; ValueError naming a value that is not one."""
  units = max(config.num_scanned_units, 1)
  bad = [v for v in spec.split(",") if v != "full" and not (v.isdigit() and int(v) >= 1)]
  if bad:
    raise ValueError(f"--unrolls: values must be integers >= 1 or 'full', got {bad}")
  return sorted({units if v == "full" else min(int(v), units) for v in spec.split(",")})


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="quickstart")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--dtype", choices=("float32", "bfloat16"),
                      help="compute dtype; default: the preset's")
  parser.add_argument("--unrolls", default="1,full",
                      help="comma-separated units per iteration; 'full' = all units")
  parser.add_argument("--steps", type=int, default=6, help="timed steps per variant")
  args = parser.parse_args(argv)

  try:
    base = load_model_config(args.preset, dtype=args.dtype)
    unrolls = _unroll_values(args.unrolls, base)
  except ValueError as e:
    parser.error(str(e).splitlines()[0])
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, base.vocab_size, (args.batch, args.seq)), jnp.int32)
  positions = jnp.tile(jnp.arange(args.seq, dtype=jnp.int32), (args.batch, 1))
  params = lm.init_params(base, jax.random.PRNGKey(0))
  default_unroll = base.replace(depth_scan_unroll=None).depth_unroll
  print(f"# {args.preset}: depth {base.depth}, {base.num_scanned_units} scanned unit(s) "
        f"of {len(base.block_pattern)} block(s), batch {args.batch} x seq {args.seq}, "
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
  for step in range(args.steps):
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
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
