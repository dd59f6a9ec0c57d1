r"""Trains a model, or resumes the run in --workdir.

  python -m pretrain.train --gin_file=configs/quickstart.gin --workdir=workdirs/quickstart
  python -m pretrain.train --gin_file=F --gin_param=TRAIN_STEPS=2000 --workdir=DIR

If DIR holds checkpoints the run continues from the newest complete one (same losses as
an uninterrupted run). SIGTERM or Ctrl-C saves a checkpoint at the next step boundary
and exits 0 (a second Ctrl-C aborts without saving); run the same command again to
resume. Exit codes: 0 done or preempted-and-saved, 1 the run failed (diverged, data or
checkpoint problem), 2 bad command line or config.
"""
from __future__ import annotations

import os
from typing import Sequence

import jax
from absl import flags

from plumbing import cli
from plumbing import storage
from pretrain import gin_config
from pretrain import trainer
from pretrain.checkpoints.checkpointer import CheckpointConfig, Checkpointer
from pretrain.optimizer import OptimizerConfig
from pretrain.checkpoints.outage import StorageConfig
from pretrain.run_directory import RunDirectory
from pretrain.train_config import TrainConfig
from sharding.distributed import initialize_from_environment

FLAGS = flags.FLAGS

# JAX's persistent compilation cache: a restarted or resumed run loads its compiled
# programs instead of compiling them again (the largest part of a restart on small and
# medium jobs). JAX's own environment variables, where set, take precedence.
DEFAULT_COMPILATION_CACHE = "~/.cache/griffin-pretrain/jax-compilation-cache"
COMPILATION_CACHE_MAX_BYTES = 8 << 30   # least recently used programs are evicted
# A file that process 0 writes (the step it saved) when the run stopped on a preemption
# notice rather than at its last step. Both exits are 0, so that a scheduler does not
# kill the other tasks of the step; launch.slurm's batch script reads the file to tell a
# run to requeue from a finished one.
PREEMPTED_MARKER_ENV = "GRIFFIN_PREEMPTED_MARKER"


def define_flags() -> None:
  cli.define_gin_flags()
  flags.DEFINE_string("workdir", None, "Run directory (a path, gs:// or s3:// URL): "
                      "checkpoints, metrics, config.gin.")
  flags.mark_flag_as_required("workdir")
  flags.DEFINE_string(
      "compilation_cache_dir",
      os.environ.get("JAX_COMPILATION_CACHE_DIR", DEFAULT_COMPILATION_CACHE),
      "JAX's persistent compilation cache (a path or gs:// URL every restart of the "
      "run sees; default $JAX_COMPILATION_CACHE_DIR, else "
      f"{DEFAULT_COMPILATION_CACHE}); empty turns it off.")
  cli.require_gin_files()


def use_compilation_cache(directory: str) -> None:
  """Points JAX's persistent compilation cache at `directory` ('' turns it off)."""
  if not directory:
    jax.config.update("jax_enable_compilation_cache", False)
    return
  directory = os.path.expanduser(directory)
  storage.check_writable(directory, flag="--compilation_cache_dir")
  jax.config.update("jax_compilation_cache_dir", directory)
  # Eviction locks the directory with a lock file, which only a local disk can hold; a
  # bucket keeps everything (its lifecycle rules can age entries out).
  if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ and not storage.is_url(directory):
    jax.config.update("jax_compilation_cache_max_size", COMPILATION_CACHE_MAX_BYTES)


def write_config(run: RunDirectory) -> None:
  """Checks that every binding was used, then writes the operative Gin config (only
  process 0)."""
  gin_config.check_bindings_used()
  if jax.process_index() == 0:
    storage.write_text(run.config, gin_config.operative_config())


def train_from_gin(workdir: str, gin_files: Sequence[str],
                   gin_bindings: Sequence[str]) -> trainer.RunResult:
  """Parses Gin, builds every config once, and trains in `workdir`."""
  gin_config.parse(gin_files, gin_bindings)
  gin_config.check_training_config()
  cli.prepare_workdir(workdir)
  gin_config.build(initialize_from_environment)
  train_config = gin_config.build(TrainConfig)
  runtime = gin_config.build_runtime(gin_config.build_model_config())
  storage_config = gin_config.build(StorageConfig)
  checkpoint_config = gin_config.build(CheckpointConfig)
  run = RunDirectory(workdir, checkpoint_config.local_dir)
  checkpointer = Checkpointer.for_run(run, checkpoint_config,
                                      every=train_config.checkpoint_every,
                                      outage_s=storage_config.outage_s)
  return trainer.train(run, train_config, runtime,
                       gin_config.build(OptimizerConfig), checkpointer,
                       gin_config.build_pipeline, on_ready=lambda: write_config(run),
                       storage_config=storage_config)


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  use_compilation_cache(FLAGS.compilation_cache_dir)
  result = train_from_gin(storage.resolve(FLAGS.workdir), FLAGS.gin_file,
                          FLAGS.gin_param + gin_config.extra_bindings())
  note_preemption(result)


def note_preemption(result: trainer.RunResult) -> None:
  """Writes the saved step to $GRIFFIN_PREEMPTED_MARKER (process 0, preempted runs only)."""
  marker = os.environ.get(PREEMPTED_MARKER_ENV)
  if marker and result.preempted and jax.process_index() == 0:
    with open(marker, "w", encoding="utf-8") as f:
      f.write(f"{result.last_step}\n")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
