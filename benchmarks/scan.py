"""Times every linear-scan implementation against the copy floor and recurrentgemma.

For each shape (B, T, D) and implementation it measures the forward pass and the
forward+backward pass (gradients w.r.t. a, x and h0) and prints

- time (median of --repeats runs after one warm-up) and compile time;
- achieved GB/s over the minimal bytes: forward reads a (float32) and x and writes h;
  forward+backward adds reading dy, a and h and writing dx and da;
- "x floor": time / (time of a memory-bound elementwise copy moving the same bytes,
  measured in the same run), so 1.0 is the bandwidth floor;
- "vs rg": recurrentgemma's native linear scan time / this time (> 1 is faster).
  recurrentgemma uses unroll=128 in its RG-LRU, which compiles slowly on CPU.

Examples:
  python benchmarks/scan.py --quick                      # CPU-sized
  python benchmarks/scan.py                              # full grid (accelerator)
  python benchmarks/scan.py --channels=1024 --lengths=512,2048 --impls=lax:1,associative
  python benchmarks/scan.py --impls=pallas:chunked,pallas:lookback   # GPU strategies

"pallas" is the kernel with the strategy `ScanOptions` picks for the device;
"pallas:S" forces launch strategy S (sequential, chunked or lookback); a strategy
the device cannot run is reported as skipped, with the reason.

On CPU the Pallas kernel only runs in interpret mode, which is not a performance
number: it is skipped unless --include_interpret, and then marked "interpret".
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import gin
import jax
import jax.numpy as jnp

from model.scan import linear_scan

ALL_IMPLS = ("lax:1", "lax:8", "lax:128", "associative", "pallas", "pallas:chunked",
             "pallas:lookback", "recurrentgemma")
_PALLAS_STRATEGIES = ("pallas:sequential", "pallas:chunked", "pallas:lookback")


def _recurrentgemma_scan(a, x, h0):
  from recurrentgemma import common  # pylint: disable=g-import-not-at-top
  from recurrentgemma.jax import scan as rg_scan  # pylint: disable=g-import-not-at-top
  # Its native scan wants a in x's dtype and takes (x, a); unroll as in its RG-LRU.
  return rg_scan.linear_scan(x, a.astype(x.dtype), h0, scan_type=common.ScanType.LINEAR_NATIVE,
                             unroll=128)


def _scan_fn(impl: str) -> Callable:
  """The scan of `impl`; "pallas:S" is the Pallas kernel with launch strategy S."""
  if impl == "recurrentgemma":
    return _recurrentgemma_scan
  name, _, strategy = impl.partition(":")
  gin.clear_config()
  if name == "pallas" and strategy:
    gin.bind_parameter("ScanOptions.pallas_strategy", strategy)
    return lambda a, x, h0: linear_scan(a, x, h0, impl="pallas")
  return lambda a, x, h0: linear_scan(a, x, h0, impl=impl)


def _time(fn, args, repeats: int) -> tuple[float, float]:
  """(compile seconds, median run seconds) of a jitted fn."""
  start = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  compile_s = time.perf_counter() - start
  jax.block_until_ready(compiled(*args))
  runs = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    runs.append(time.perf_counter() - start)
  return compile_s, statistics.median(runs)


def _copy_seconds(num_bytes: int, repeats: int) -> float:
  """Time of an elementwise pass reading num_bytes/2 and writing num_bytes/2."""
  buf = jnp.ones((num_bytes // 8,), jnp.float32)
  return _time(lambda v: v + 1.0, (buf,), repeats)[1]


def _modes(scan: Callable):
  def forward(a, x, h0):
    return scan(a, x, h0)

  def forward_backward(a, x, h0):
    def loss(a, x, h0):
      h, last = scan(a, x, h0)
      return jnp.sum(h.astype(jnp.float32)) + jnp.sum(last)
    return jax.grad(loss, argnums=(0, 1, 2))(a, x, h0)

  return {"fwd": forward, "fwd+bwd": forward_backward}


def _bytes(batch, time_, channels, x_itemsize, mode) -> int:
  n = batch * time_ * channels
  forward = n * (4 + 2 * x_itemsize)                     # a (f32), x, h
  if mode == "fwd":
    return forward
  return forward + n * (4 + 4 + 3 * x_itemsize)          # + a, da (f32), dy, h, dx


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--channels", default="1024,2048,4096")
  parser.add_argument("--lengths", default="512,1024,2048,4096,8192,16384")
  parser.add_argument("--impls", default=",".join(ALL_IMPLS))
  parser.add_argument("--modes", default="fwd,fwd+bwd")
  parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--quick", action="store_true",
                      help="CPU-sized: D=1024, T=512,2048, 3 repeats.")
  parser.add_argument("--include_interpret", action="store_true",
                      help="Also time Pallas in CPU interpret mode (not a perf number).")
  args = parser.parse_args()
  if args.quick:
    args.channels, args.lengths, args.repeats = "1024", "512,2048", 3
  impls = args.impls.split(",")
  unknown = {i for i in impls if i not in ALL_IMPLS and i not in _PALLAS_STRATEGIES}
  if unknown:
    parser.error(f"unknown --impls {sorted(unknown)}; choose from "
                 f"{sorted(set(ALL_IMPLS) | set(_PALLAS_STRATEGIES))}")
  on_cpu = jax.default_backend() == "cpu"
  dtype = jnp.dtype(args.dtype)
  print(f"# device: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"jax {jax.__version__}, x/h dtype {args.dtype}, a float32, B={args.batch}")
  print("| impl | mode | T | D | time ms | GB/s | x floor | vs rg | compile s |")
  print("|---|---|---|---|---|---|---|---|---|")
  for channels in map(int, args.channels.split(",")):
    for length in map(int, args.lengths.split(",")):
      key = jax.random.PRNGKey(0)
      shape = (args.batch, length, channels)
      a = jax.random.uniform(key, shape, jnp.float32, 0.9, 1.0)
      x = jax.random.normal(key, shape, jnp.float32).astype(dtype)
      h0 = jnp.zeros((args.batch, channels), jnp.float32)
      for mode in args.modes.split(","):
        num_bytes = _bytes(args.batch, length, channels, dtype.itemsize, mode)
        floor = _copy_seconds(num_bytes, args.repeats)
        results = {}
        for impl in impls:
          interpret = impl.startswith("pallas") and on_cpu
          if interpret and not args.include_interpret:
            print(f"| {impl} | {mode} | {length} | {channels} | skipped: CPU runs "
                  "Pallas only in interpret mode | | | | |")
            continue
          try:
            compile_s, seconds = _time(_modes(_scan_fn(impl))[mode], (a, x, h0),
                                       args.repeats)
          except ValueError as e:  # A strategy this device cannot run (named in e).
            reason = str(e).splitlines()[0]
            print(f"| {impl} | {mode} | {length} | {channels} | skipped: {reason} "
                  "| | | | |")
            continue
          results[impl] = (seconds, compile_s, interpret)
        reference = results.get("recurrentgemma", (None,))[0]
        for impl, (seconds, compile_s, interpret) in results.items():
          name = impl + (" (interpret)" if interpret else "")
          vs_rg = f"{reference / seconds:.2f}" if reference else "n/a"
          print(f"| {name} | {mode} | {length} | {channels} | {seconds * 1e3:.2f} | "
                f"{num_bytes / seconds / 1e9:.2f} | {seconds / floor:.2f} | {vs_rg} | "
                f"{compile_s:.1f} |", flush=True)
        print(f"| copy floor | {mode} | {length} | {channels} | {floor * 1e3:.2f} | "
              f"{num_bytes / floor / 1e9:.2f} | 1.00 | | |", flush=True)


if __name__ == "__main__":
  main()
