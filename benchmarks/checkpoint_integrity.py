"""What checkpoint integrity manifests cost: save, verify and restore, with and without.

Saves a preset's parameters (randomly initialised: as incompressible as trained ones)
and, with --optimizer_state, two more trees of their shapes standing for AdamW's
moments, with `pretrain.checkpoints.persistent.PersistentTier`, which writes
`integrity.json` from Orbax's background thread before the commit, and with the same tier whose
manifest step (`integrity.seal`) is switched off; each time is until the step is
committed, the fastest of --rounds alternating saves. Then it times `integrity.verify`
of the step with its files in the page cache (right after a save) and out of it (as
after a restart: the step's pages are dropped with posix_fadvise, nothing else's), and
a cold restore of the parameters with the verification and without it. One JSON line;
seconds and bytes.

  nice -n 19 python benchmarks/checkpoint_integrity.py --preset=griffin_1_3b \
      --workdir=/tmp/integrity-bench [--optimizer_state]

griffin_1_3b's parameters are 5.2 GB in float32 (15.6 GB with the moments); the
process holds about two copies at a time, and the disk up to two steps.
"""
from __future__ import annotations

from plumbing import quiet
quiet.setup()  # first, before JAX or TensorFlow load: see plumbing/quiet.py
# pylint: disable=wrong-import-position
import contextlib
import json
import os
import shutil
import time
from typing import Any, Callable, Iterator, Sequence

from absl import flags
import jax

from plumbing import cli, storage
from pretrain.checkpoints import integrity
from pretrain.checkpoints.persistent import PersistentTier
from pretrain import gin_config
from pretrain.run_directory import RunDirectory
from pretrain.runtime import Runtime

flags.DEFINE_string("preset", "griffin_1_3b", "Model preset under configs/models/.")
flags.DEFINE_string("workdir", None, "Scratch directory (emptied first).")
flags.DEFINE_bool("optimizer_state", False, "Also save two parameter-shaped trees, the "
                  "size of AdamW's moments.")
flags.DEFINE_integer("rounds", 2, "Saves of each kind; the fastest counts.", lower_bound=1)
flags.mark_flag_as_required("workdir")
FLAGS = flags.FLAGS


def timed(action: Callable[[], Any]) -> tuple[float, Any]:
  start = time.perf_counter()
  result = action()
  return round(time.perf_counter() - start, 2), result


@contextlib.contextmanager
def switched_off(name: str, replacement: Callable[..., Any]) -> Iterator[None]:
  """`integrity.<name>` replaced for the block: the tier without that step."""
  original = getattr(integrity, name)
  setattr(integrity, name, replacement)
  try:
    yield
  finally:
    setattr(integrity, name, original)


def drop_from_page_cache(directory: str) -> None:
  """Evicts the files under `directory` from the page cache (after writing them back),
  so that the next read comes from the disk, as after a restart."""
  for parent, _, names in os.walk(directory):
    for name in names:
      fd = os.open(os.path.join(parent, name), os.O_RDONLY)
      try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      finally:
        os.close(fd)


def save_times(params: Any, opt_state: Any) -> tuple[dict[str, float], str]:
  """Save times without and with the manifest, and the last step saved (with it).
  Keeping one step, each save also deletes the one before, alike for both kinds."""
  checkpointer = PersistentTier(RunDirectory(os.path.join(FLAGS.workdir, "run")),
                                keep_last=1)

  def save(step):
    checkpointer.save(step, params=params, opt_state=opt_state, rng=jax.random.key(0),
                      metadata={})
    checkpointer.wait()
  times = {"save_s": [], "save_without_manifest_s": []}
  for step in range(1, 2 * FLAGS.rounds + 1, 2):
    with switched_off("seal", lambda directory, step: None):
      times["save_without_manifest_s"].append(timed(lambda: save(step))[0])
    times["save_s"].append(timed(lambda: save(step + 1))[0])
  checkpointer.close()
  return ({name: min(values) for name, values in times.items()},
          checkpointer.step_dir(2 * FLAGS.rounds))


def restore_cold(runtime: Runtime, step_dir: str) -> float:
  """Seconds to restore the parameters of `step_dir`, its files read from the disk."""
  drop_from_page_cache(step_dir)
  checkpointer = PersistentTier(RunDirectory(os.path.join(FLAGS.workdir, "run")),
                                read_only=True)
  seconds = timed(lambda: checkpointer.restore(
      int(os.path.basename(step_dir)), abstract_params=runtime.abstract_params))[0]
  checkpointer.close()
  return seconds


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  shutil.rmtree(FLAGS.workdir, ignore_errors=True)
  gin_config.parse([os.path.join(gin_config.REPO_ROOT, "configs", "models",
                                 f"{FLAGS.preset}.gin")], [])
  runtime = Runtime.create(gin_config.build_model_config())
  params = runtime.init_params(seed=0)
  opt_state = ({"mu": jax.tree.map(lambda p: p * 0.5, params),
                "nu": jax.tree.map(lambda p: p * p, params)}
               if FLAGS.optimizer_state else None)
  result = {"preset": FLAGS.preset, "optimizer_state": FLAGS.optimizer_state,
            "parameters": sum(p.size for p in jax.tree.leaves(params))}
  times, step_dir = save_times(params, opt_state)
  result.update(times)
  del params, opt_state
  result["bytes"] = sum(storage.list_files(step_dir).values())
  result["manifest_s"] = timed(lambda: integrity.write_manifest(step_dir))[0]
  result["verify_warm_s"] = timed(lambda: integrity.verify(step_dir))[0]
  drop_from_page_cache(step_dir)
  result["verify_cold_s"], problem = timed(lambda: integrity.verify(step_dir))
  assert problem is None, problem
  result["restore_cold_s"] = restore_cold(runtime, step_dir)
  with switched_off("verify", lambda *args, **kwargs: None):
    result["restore_cold_without_verify_s"] = restore_cold(runtime, step_dir)
  print(json.dumps(result))


if __name__ == "__main__":
  cli.run(main)
