"""Hugging Face export of a preset's weights: time and size of `pretrain.export`.

Writes a step-0 checkpoint of randomly initialised weights of a model preset (the
export does not care whether they were trained), then runs the export command
(`python -m pretrain.export`: start-up, checkpoint restore, mapping, safetensors and
tokenizer writing) at float32 and bfloat16, each in its own process, and reports its
wall time, its peak resident memory and the output's size. One JSON line.

  nice -n 19 python benchmarks/export.py --preset=griffin_1_3b --workdir=/tmp/export-bench
"""
from __future__ import annotations

from plumbing import quiet
quiet.setup()  # first, before JAX or TensorFlow load: see plumbing/quiet.py
# pylint: disable=wrong-import-position
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from typing import Sequence

from absl import flags
import jax
import numpy as np

from model import lm
from plumbing import cli
from pretrain.interchange import conversion as convert, hf_export as export
from pretrain import gin_config
from pretrain.checkpoints.metadata import make_vocabulary

flags.DEFINE_string("preset", "griffin_1_3b", "Model preset under configs/models/.")
flags.DEFINE_string("workdir", None, "Scratch directory (emptied first).")
flags.mark_flag_as_required("workdir")
FLAGS = flags.FLAGS


def directory_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(parent, name))
             for parent, _, names in os.walk(path) for name in names)


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  shutil.rmtree(FLAGS.workdir, ignore_errors=True)
  gin_config.parse([os.path.join(gin_config.REPO_ROOT, "configs", "models",
                                 f"{FLAGS.preset}.gin")], [])
  config = gin_config.build_model_config()
  params = jax.tree.map(np.asarray, lm.init_params(config, jax.random.key(0)))
  count = sum(p.size for p in jax.tree.leaves(params))
  run = os.path.join(FLAGS.workdir, "run")
  convert.write_step0(run, config, params, make_vocabulary("byte"), 2048)
  del params
  result = {"preset": FLAGS.preset, "parameters": int(count)}
  for dtype in reversed(export.DTYPES):   # bfloat16 first: the peak is a running maximum
    output = os.path.join(FLAGS.workdir, f"hf-{dtype}")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pretrain.export", f"--workdir={run}",
                    f"--output={output}", f"--dtype={dtype}"], check=True,
                   cwd=gin_config.REPO_ROOT, stdout=subprocess.DEVNULL)
    result[f"{dtype}_seconds"] = round(time.perf_counter() - start, 1)
    # ru_maxrss of the children is the largest of them so far (KiB on Linux).
    result[f"{dtype}_peak_rss_gib"] = round(
        resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2 ** 20, 2)
    result[f"{dtype}_bytes"] = directory_bytes(output)
  print(json.dumps(result))


if __name__ == "__main__":
  cli.run(main)
