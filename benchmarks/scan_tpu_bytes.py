"""Where the Pallas scan's HBM bytes go on TPU, from libtpu's compiled program.

  python benchmarks/scan_tpu_bytes.py [--shape=4,2048,1024] [--dtypes=float32,bfloat16]

Compiles the scan alone (forward, and forward + backward of a sum of squares) for one
v5p chip with libtpu, no TPU attached, and prints per pass: XLA's estimated HBM bytes
of the whole program, the bytes the Pallas kernels themselves move (their declared
`CostEstimate`s, which tests/test_scan_cost_estimate.py checks against the operands),
the bytes outside them (the relayout copies XLA inserts around the kernels), and the estimate for
the XLA associative scan on the same shape. Deterministic: a compiler's figures, not a
timing. The copies exist because XLA:TPU tiles the last two axes of an array by
(8, 128): the kernel's [B, T, R, 128] view of [B, T, D] is a different memory layout.
"""
from __future__ import annotations

from plumbing import quiet
quiet.setup()  # first, before JAX or TensorFlow load: see plumbing/quiet.py
# pylint: disable=wrong-import-position
import re
from typing import Sequence

import jax
import jax.numpy as jnp
from absl import flags

from model.scan import ScanOptions
from model.scan import linear_scan
from plumbing import cli
from plumbing.errors import usage_error
from pretrain.compilation import aot
from pretrain.compilation import tpu_target

FLAGS = flags.FLAGS
flags.DEFINE_list("shape", ["4", "2048", "1024"], "B,T,D of the scan.")
flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "dtypes of x (a is float32).")

# `custom-call(...)`'s backend config carries the kernel's cost estimate as JSON.
_DECLARED_BYTES = re.compile(r'"bytes_accessed":"?(\d+)')
# Top-level data movement of the entry computation: relayout copies and reshapes.
_MOVES = re.compile(r"^\s*(?:ROOT )?%\S+ = \S+ (copy|copy-start|reshape|transpose)\(", re.M)


def program_bytes(fn, args) -> dict[str, float]:
  """XLA's estimated bytes, the kernels' declared bytes, the bytes outside the kernels
  and the relayout operations XLA put there."""
  with aot.without_persistent_cache():
    compiled = jax.jit(fn).lower(*args).compile()
  costs = compiled.cost_analysis()
  costs = costs[0] if isinstance(costs, (list, tuple)) else costs
  text = compiled.as_text()
  kernels = sum(int(n) for n in _DECLARED_BYTES.findall(text))
  moves = _MOVES.findall(text)
  return {"xla": costs["bytes accessed"], "kernels": kernels,
          "outside": costs["bytes accessed"] - kernels,
          "moves": ",".join(f"{op}x{moves.count(op)}" for op in sorted(set(moves))),
          "estimated_us": 1e6 * costs["optimal_seconds"]}


def passes(impl: str):
  options = ScanOptions(lowering_platform="tpu")
  forward = lambda a, x: linear_scan(a, x, options=options, impl=impl)[0]
  loss = lambda a, x: jnp.sum(jnp.square(forward(a, x).astype(jnp.float32)))
  return {"forward": forward, "forward+backward": jax.grad(loss, argnums=(0, 1))}


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  jax.config.update("jax_platforms", "cpu")
  device = tpu_target.target_devices(tpu_target.parse_target("v5p-8"))[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  if len(FLAGS.shape) != 3 or not all(n.isdigit() and int(n) > 0 for n in FLAGS.shape):
    raise usage_error(f"--shape must be three positive integers B,T,D, got {FLAGS.shape}")
  shape = tuple(int(n) for n in FLAGS.shape)
  print(f"scan [B, T, D] = {list(shape)} on one v5p chip (libtpu's estimates, MB)")
  print(f"{'x dtype':9} {'pass':17} {'pallas: all':>12} {'kernels':>9} {'outside':>9} "
        f"{'est. us':>8} {'associative':>12} {'est. us':>8}  relayouts outside the kernels")
  for dtype in FLAGS.dtypes:
    args = (jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding),
            jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding))
    pallas, associative = passes("pallas"), passes("associative")
    for name in pallas:
      p = program_bytes(pallas[name], args)
      x = program_bytes(associative[name], args)
      print(f"{dtype:9} {name:17} {p['xla'] / 1e6:12.1f} {p['kernels'] / 1e6:9.1f} "
            f"{p['outside'] / 1e6:9.1f} {p['estimated_us']:8.1f} {x['xla'] / 1e6:12.1f} "
            f"{x['estimated_us']:8.1f}  {p['moves']}")


if __name__ == "__main__":
  cli.run(main)
