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

"pallas" is the kernel with the strategy the default `ScanOptions` pick for the device;
"pallas:S" forces launch strategy S (sequential, chunked or lookback); a strategy
the device cannot run is reported as skipped, with the reason.

On CPU the Pallas kernel only runs in interpret mode, which is not a performance
number: it is skipped unless --include_interpret, and then marked "interpret".
"""
from __future__ import annotations

from plumbing import quiet
quiet.setup()  # first, before JAX or TensorFlow load: see plumbing/quiet.py
# pylint: disable=wrong-import-position
import statistics
import time
from typing import Callable, Sequence

from absl import flags
import jax
import jax.numpy as jnp

from model.scan import ScanOptions
from model.scan import linear_scan
from plumbing import cli
from plumbing.errors import usage_error

ALL_IMPLS = ("lax:1", "lax:8", "lax:128", "associative", "pallas", "pallas:chunked",
             "pallas:lookback", "recurrentgemma")
_PALLAS_STRATEGIES = ("pallas:sequential", "pallas:chunked", "pallas:lookback")
MODES = ("fwd", "fwd+bwd")

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_integer("batch", 8, "Batch size B.", lower_bound=1)
  flags.DEFINE_list("channels", ["1024", "2048", "4096"], "Channel counts D.")
  flags.DEFINE_list("lengths", ["512", "1024", "2048", "4096", "8192", "16384"],
                    "Sequence lengths T.")
  flags.DEFINE_list("impls", list(ALL_IMPLS),
                    f"Implementations, of {sorted(set(ALL_IMPLS) | set(_PALLAS_STRATEGIES))}.")
  flags.DEFINE_list("modes", list(MODES), f"Passes to time, of {list(MODES)}.")
  flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "Dtype of x and h.")
  flags.DEFINE_integer("repeats", 5, "Timed runs per measurement (the median is shown).",
                       lower_bound=1)
  flags.DEFINE_bool("quick", False, "CPU-sized: D=1024, T=512,2048, 3 repeats.")
  flags.DEFINE_bool("include_interpret", False,
                    "Also time Pallas in CPU interpret mode (not a perf number).")


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
  if name == "pallas":
    options = ScanOptions(pallas_strategy=strategy or "auto")
    return lambda a, x, h0: linear_scan(a, x, h0, options=options, impl="pallas")
  return lambda a, x, h0: linear_scan(a, x, h0, options=ScanOptions(), impl=impl)


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


def _sizes(flag: str, values: Sequence[str]) -> list[int]:
  """A list flag of positive integers; a usage error naming the values that are not."""
  bad = [v for v in values if not (v.isdigit() and int(v) >= 1)]
  if bad or not values:
    raise usage_error(f"--{flag}: values must be integers >= 1, got {bad or 'none'}")
  return [int(v) for v in values]


def _choices(flag: str, values: Sequence[str], known: Sequence[str]) -> list[str]:
  """A list flag of names from `known`; a usage error naming the unknown ones."""
  unknown = sorted(set(values) - set(known))
  if unknown or not values:
    got = f"unknown {unknown}" if unknown else "none"
    raise usage_error(f"--{flag}: choose from {sorted(known)}, got {got}")
  return list(values)


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  if FLAGS.quick:
    channel_list, lengths, repeats = [1024], [512, 2048], 3
  else:
    channel_list = _sizes("channels", FLAGS.channels)
    lengths = _sizes("lengths", FLAGS.lengths)
    repeats = FLAGS.repeats
  impls = _choices("impls", FLAGS.impls, set(ALL_IMPLS) | set(_PALLAS_STRATEGIES))
  modes = _choices("modes", FLAGS.modes, MODES)
  batch = FLAGS.batch
  on_cpu = jax.default_backend() == "cpu"
  dtype = jnp.dtype(FLAGS.dtype)
  print(f"# device: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"jax {jax.__version__}, x/h dtype {FLAGS.dtype}, a float32, B={batch}")
  print("| impl | mode | T | D | time ms | GB/s | x floor | vs rg | compile s |")
  print("|---|---|---|---|---|---|---|---|---|")
  for channels in channel_list:
    for length in lengths:
      key = jax.random.PRNGKey(0)
      shape = (batch, length, channels)
      a = jax.random.uniform(key, shape, jnp.float32, 0.9, 1.0)
      x = jax.random.normal(key, shape, jnp.float32).astype(dtype)
      h0 = jnp.zeros((batch, channels), jnp.float32)
      for mode in modes:
        num_bytes = _bytes(batch, length, channels, dtype.itemsize, mode)
        floor = _copy_seconds(num_bytes, repeats)
        results = {}
        for impl in impls:
          interpret = impl.startswith("pallas") and on_cpu
          if interpret and not FLAGS.include_interpret:
            print(f"| {impl} | {mode} | {length} | {channels} | skipped: CPU runs "
                  "Pallas only in interpret mode | | | | |")
            continue
          try:
            compile_s, seconds = _time(_modes(_scan_fn(impl))[mode], (a, x, h0),
                                       repeats)
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
  define_flags()
  cli.run(main)
