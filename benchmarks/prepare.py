"""Throughput and worker memory of preparing token stores: Beam workers vs in-process.

Prepares both splits of the quickstart's data config (the running Python's standard
library, `{stdlib}/**/*.py`, SEQUENCE_LENGTH 256; `--base` picks a part of it), or of a
corpus `--copies` times larger made of that many copies of it (symlinks to the standard
library, so each copy is separate documents at separate paths), into a fresh output
directory, either

- `--mode=inprocess`: the trainer's own single-process build (`DataPipeline` with that
  directory as its cache), or
- `--mode=beam --workers=N`: `python -m pretrain.data.prepare`'s pipeline on Beam's
  DirectRunner in multi-process mode with N workers,

and prints one JSON line: tokens, wall seconds, tokens/s and peak RSS. Peak RSS is the
whole process's for `inprocess`, and the largest Beam worker's (each worker records its
`ru_maxrss` in its shard markers; the manifest keeps the maximum) for `beam`.

  nice -n 19 python benchmarks/prepare.py --mode=inprocess --copies=1
  nice -n 19 python benchmarks/prepare.py --mode=beam --workers=2 --copies=10
"""
from __future__ import annotations

from plumbing import quiet
quiet.setup()  # first, before JAX or TensorFlow load: see plumbing/quiet.py
# pylint: disable=wrong-import-position
import json
import re
import os
import resource
import sysconfig
import tempfile
import time
from typing import Dict, List, Sequence

import gin
from absl import flags

from plumbing import cli
from pretrain import gin_config
from pretrain.data import pipeline, prepare
from pretrain.train_config import TrainConfig

flags.DEFINE_enum("mode", "beam", ["beam", "inprocess"], "Who prepares the stores.")
flags.DEFINE_integer("workers", 2, "Beam workers (--mode=beam).")
flags.DEFINE_integer("copies", 1, "Copies of the base corpus in the corpus.")
flags.DEFINE_string("base", "**/*.py", "The base corpus: this glob inside the standard "
                    "library (default: all of its sources, the quickstart's corpus).")
flags.DEFINE_string("workdir", None, "Where the corpus links and stores go (default: a "
                    "fresh temporary directory).")
FLAGS = flags.FLAGS

CONFIG = "configs/quickstart.gin"


def corpus_bindings(root: str, copies: int, base: str) -> List[str]:
  """TRAIN_FILES over `copies` links to the standard library, `base` inside each."""
  if copies == 1:
    return [f"TRAIN_FILES = '{{stdlib}}/{base}'"]
  stdlib = sysconfig.get_paths()["stdlib"]
  for i in range(copies):
    link = os.path.join(root, "corpus", f"copy{i:02d}")
    os.makedirs(os.path.dirname(link), exist_ok=True)
    if not os.path.islink(link):
      os.symlink(stdlib, link)
  return [f"TRAIN_FILES = '{root}/corpus/*/{base}'"]


def inprocess(output: str, bindings: Sequence[str]) -> Dict:
  gin_config.parse([CONFIG], [*bindings, f"DataPipeline.cache_dir = '{output}'"])
  train = gin_config.build(TrainConfig)
  data = gin_config.build(pipeline.DataPipeline, sequence_length=train.sequence_length,
                          batch_size=train.batch_size, seed=train.seed)
  stores = [data.train_store, data.validation_store]
  gin.clear_config()
  return {"tokens": sum(s.metadata["num_tokens"] for s in stores),
          "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def beam(output: str, bindings: Sequence[str], workers: int) -> Dict:
  stores = prepare.prepare(output, [CONFIG], bindings, (
      "--direct_running_mode=multi_processing", f"--direct_num_workers={workers}"))
  return {"tokens": sum(s.metadata["num_tokens"] for s in stores),
          "peak_rss_bytes": max(s.metadata["prepared_by"]["peak_worker_rss_bytes"]
                                for s in stores)}


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  root = FLAGS.workdir or tempfile.mkdtemp(prefix="prepare_benchmark_")
  bindings = corpus_bindings(root, FLAGS.copies, FLAGS.base)
  base = re.sub(r"\W+", "_", FLAGS.base)
  output = os.path.join(root, f"stores-{FLAGS.mode}-{FLAGS.workers}-{FLAGS.copies}-{base}")
  start = time.perf_counter()
  if FLAGS.mode == "inprocess":
    result = inprocess(output, bindings)
  else:
    result = beam(output, bindings, FLAGS.workers)
  seconds = time.perf_counter() - start
  print(json.dumps({"mode": FLAGS.mode, "workers": FLAGS.workers if FLAGS.mode == "beam"
                    else 1, "base": FLAGS.base, "copies": FLAGS.copies,
                    "seconds": round(seconds, 1),
                    "tokens_per_second": round(result["tokens"] / seconds),
                    **result}))


if __name__ == "__main__":
  cli.run(main)
