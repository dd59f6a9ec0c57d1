"""The training step with the Pallas scan inside `shard_map`, on a mesh of every device.

A Pallas kernel has no partitioning rule, so under a mesh the recurrent layers run it
in `shard_map` (model.recurrence). This runs one value-and-grad training step of a
small Griffin that way, with the real kernels of the default device, on a `data` mesh
of all local devices (rows split across them), and checks the loss and every gradient
against the same model on one device with the lax scan. Then it times both steps.

    python benchmarks/gpu_shard_map_step.py [--batch=8 --seq=1024 --strategy=chunked]

Matrix products run at float32 ("highest") precision: a GPU's default TF32 products
round differently in the two programs (7.9e-4 relative on an H200), which would hide
the scan's own error.

On CPU the kernel runs in interpret mode (a check of the plumbing, not of speed): set
XLA_FLAGS=--xla_force_host_platform_device_count=N for N simulated devices.
"""
from __future__ import annotations

from plumbing import quiet
quiet.setup()  # first, before JAX or TensorFlow load: see plumbing/quiet.py
# pylint: disable=wrong-import-position
import statistics
import time

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from model import lm
from model.config import ModelConfig
from model.scan import ScanOptions
from plumbing import cli
from plumbing.errors import UserError
from pretrain.losses import token_losses
from sharding import mesh as mesh_lib
from sharding import partition
from sharding import rules as rules_lib

FLAGS = flags.FLAGS
TOLERANCE = 2e-4  # float32 model: relative difference of loss and gradient norms


def define_flags() -> None:
  flags.DEFINE_integer("batch", 8, "Global batch (rows); a multiple of the devices.",
                       lower_bound=1)
  flags.DEFINE_integer("seq", 1024, "Sequence length.", lower_bound=16)
  flags.DEFINE_enum("strategy", "auto", ["auto", "sequential", "chunked", "lookback"],
                    "Pallas launch strategy.")
  flags.DEFINE_integer("repeats", 5, "Timed steps per variant.", lower_bound=1)


def model_config(scan_impl: str, strategy: str) -> ModelConfig:
  return ModelConfig(vocab_size=512, width=256, rnn_width=384, num_heads=4, depth=3,
                     block_pattern=("recurrent", "recurrent", "attention"),
                     attention_window=128, dtype="float32", scan_impl=scan_impl,
                     scan=ScanOptions(pallas_strategy=strategy, pallas_time_chunk=32))


def loss_fn(model: lm.LanguageModel):
  def loss(params, tokens, positions, targets):
    logits, _ = model.apply({"params": params}, tokens, positions)
    return jnp.mean(token_losses(logits, targets)[0])
  return jax.jit(jax.value_and_grad(loss))


def batch(rows: int, seq: int, vocab: int) -> tuple[np.ndarray, ...]:
  """Random tokens with document starts inside rows (positions restart at 0)."""
  rng = np.random.default_rng(0)
  positions = np.tile(np.arange(seq, dtype=np.int32), (rows, 1))
  for row in range(rows):
    for start in sorted(rng.integers(1, seq, size=3)):
      positions[row, start:] = np.arange(seq - start)
  draw = lambda: rng.integers(0, vocab, (rows, seq)).astype(np.int32)
  return draw(), positions, draw()


def timed(step, *args) -> float:
  jax.block_until_ready(step(*args))
  runs = []
  for _ in range(FLAGS.repeats):
    start = time.perf_counter()
    jax.block_until_ready(step(*args))
    runs.append(time.perf_counter() - start)
  return statistics.median(runs)


def main(argv: list[str]) -> None:
  cli.reject_extra_arguments(argv)
  jax.config.update("jax_default_matmul_precision", "highest")
  devices = jax.devices()
  if FLAGS.batch % len(devices):
    raise UserError(f"--batch={FLAGS.batch} must be a multiple of the {len(devices)} "
                    "devices (rows are split across them)")
  tokens, positions, targets = batch(FLAGS.batch, FLAGS.seq, 512)
  reference = lm.LanguageModel(model_config("lax", "auto"))
  params = reference.init(jax.random.PRNGKey(0), tokens[:1, :16], positions[:1, :16])["params"]
  ref_step = loss_fn(reference)
  ref_loss, ref_grads = ref_step(params, tokens, positions, targets)

  mesh = mesh_lib.create_mesh(mesh_lib.mesh_config_from_flag(f"data:{len(devices)}"))
  rows = partition.batch_sharding(mesh)
  sharded_step = loss_fn(lm.LanguageModel(model_config("pallas", FLAGS.strategy)))
  with rules_lib.activation_sharding(mesh):
    args = (jax.device_put(params, NamedSharding(mesh, P())),
            *(jax.device_put(v, rows) for v in (tokens, positions, targets)))
    lowered = sharded_step.lower(*args).as_text()
    loss, grads = sharded_step(*args)
    sharded_s = timed(sharded_step, *args)
  in_shard_map = "shard_map" in lowered or "manual_computation" in lowered
  if len(devices) > 1 and not in_shard_map:  # one device needs no shard_map
    raise UserError("the Pallas scan did not run inside shard_map under the mesh")

  worst = abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))
  for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    g, g_ref = np.asarray(g, np.float64), np.asarray(g_ref, np.float64)
    worst = max(worst, np.linalg.norm(g - g_ref) / max(np.linalg.norm(g_ref), 1e-30))
  ref_s = timed(ref_step, params, tokens, positions, targets)
  print(f"devices: {len(devices)} x {devices[0].device_kind}; mesh data:{len(devices)}; "
        f"batch {FLAGS.batch} x seq {FLAGS.seq}; Pallas strategy {FLAGS.strategy}; "
        f"shard_map in the program: {in_shard_map}")
  print(f"loss: shard_map+Pallas {float(loss):.6f}, one device lax {float(ref_loss):.6f}; "
        f"worst relative difference (loss, gradients) {worst:.2e} (tolerance {TOLERANCE:.0e})")
  print(f"step: shard_map+Pallas {1e3 * sharded_s:.2f} ms, one device lax "
        f"{1e3 * ref_s:.2f} ms (median of {FLAGS.repeats})")
  if not worst <= TOLERANCE:
    raise UserError("the sharded Pallas step disagrees with the single-device lax step")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
