"""Compiles the Pallas scan kernels alone for GPU targets; run by tests/test_gpu_compile.py.

    python tests/gpu_kernels.py KIND:BACKEND:STRATEGY:DTYPE ...

For each case (e.g. `h100:triton:lookback:bfloat16`; DTYPE `complex` runs the complex
scan on real and imaginary planes) it jits forward and backward of `linear_scan` for one
GPU of that kind ([2, 256, 256], float32 decays), compiles it with XLA:GPU, the kernel's
compiler and ptxas, and prints one JSON line: the case and the Pallas kernels in the
compiled program. A separate process, because a compiler that crashes (XLA:GPU once
segfaulted on the look-back kernel, inside Triton) must fail a test, not end pytest.
"""
import json
import sys

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from model.scan import engine
from pretrain.compilation import aot
from pretrain.compilation import gpu_target

SHAPE = (2, 256, 256)


def compile_case(case: str) -> dict:
  kind, backend, strategy, dtype = case.split(":")
  device = gpu_target.target_devices(gpu_target.parse_target(f"{kind}-1"))[0]
  options = engine.ScanOptions(pallas_strategy=strategy, pallas_gpu_backend=backend,
                               lowering_platform="gpu")
  sharding = SingleDeviceSharding(device)
  plane = lambda d: jax.ShapeDtypeStruct(SHAPE, jnp.dtype(d), sharding=sharding)
  if dtype == "complex":
    def loss(a_re, a_im, x_re, x_im):
      (h_re, h_im), (l_re, l_im) = engine.linear_scan_pairs(
          (a_re, a_im), (x_re, x_im), options=options, impl="pallas")
      return (h_re * h_im).sum() + l_re.sum() + l_im.sum()
    args = [plane("float32")] * 4
  else:
    def loss(a, x):
      h, last = engine.linear_scan(a, x, options=options, impl="pallas")
      return h.astype(jnp.float32).sum() + last.sum()
    args = [plane("float32"), plane(dtype)]
  step = jax.grad(loss, argnums=tuple(range(len(args))))
  compiled = jax.jit(step).lower(*args).compile()
  return {"case": case, "kernels": aot.kernel_calls(compiled.as_text())}


if __name__ == "__main__":
  jax.config.update("jax_platforms", "cpu")
  for name in sys.argv[1:]:
    print(json.dumps(compile_case(name)), flush=True)
