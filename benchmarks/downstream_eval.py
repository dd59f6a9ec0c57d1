"""Downstream evaluation throughput: our JAX backend against lm_eval's `hf` backend.

Writes a step-0 checkpoint of randomly initialised weights of a model config (the
throughput does not depend on training) and its Hugging Face export, generates a local
multiple-choice task of `--examples` questions over random words (4 choices each, the
shape of HellaSwag-like tasks at a smaller length), then runs lm_eval's evaluator on it
with each backend in this process, alternating `--rounds` times, and reports the
examples per second of each run (the first JAX run includes compiling its programs).
Both backends score the same requests on the same CPU; lm_eval's `hf` backend runs
transformers' RecurrentGemma in float32 with `logits_cache=False` (its shared-prefix
cache misscores requests, see tests/test_lm_eval_backend.py). One JSON line.

  nice -n 19 python benchmarks/downstream_eval.py --workdir=/tmp/downstream-bench
"""
from __future__ import annotations

from plumbing import quiet
quiet.setup()  # first, before JAX or TensorFlow load: see plumbing/quiet.py
# pylint: disable=wrong-import-position
import json
import os
import random
import shutil
import time
from typing import Sequence

from absl import flags
import jax
from lm_eval.models.huggingface import HFLM
import numpy as np

from model import lm as lm_lib
from plumbing import cli
from pretrain.interchange import conversion as convert, hf_export as export
from pretrain.evaluation import downstream
from pretrain import gin_config
from pretrain.checkpoints.loading import load
from pretrain.checkpoints.metadata import make_vocabulary

flags.DEFINE_string("workdir", None, "Scratch directory (emptied first).")
flags.DEFINE_string("model_gin", "configs/quickstart.gin", "Gin file giving the model.")
flags.DEFINE_integer("examples", 200, "Questions in the generated task.")
flags.DEFINE_integer("batch_size", 16, "Sequences per batch, both backends.")
flags.DEFINE_integer("rounds", 2, "JAX / hf run pairs.")
flags.mark_flag_as_required("workdir")
FLAGS = flags.FLAGS
WORDS = ("the", "model", "reads", "a", "long", "sequence", "of", "tokens", "and",
         "predicts", "next", "word", "from", "its", "recurrent", "state", "while", "local",
         "attention", "looks", "back")
TASK_YAML = """task: bench_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{query}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
metadata:
  version: 1.0
"""


def write_task(directory: str, examples: int) -> None:
  """A multiple-choice task of random-word questions (~40 words) and 4 ~8-word answers."""
  rng = random.Random(0)
  os.makedirs(directory)
  data = os.path.join(directory, "bench_mc.jsonl")
  with open(data, "w") as f:
    for _ in range(examples):
      sentence = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))
      f.write(json.dumps({"query": sentence(40), "label": rng.randrange(4),
                          "choices": [" " + sentence(8) for _ in range(4)]}) + "\n")
  with open(os.path.join(directory, "bench_mc.yaml"), "w") as f:
    f.write(TASK_YAML.format(data=data))


def timed(lm, manager) -> float:
  """Examples per second of one evaluation of `lm` on the task."""
  start = time.perf_counter()
  with downstream.quiet():
    downstream.simple_evaluate(lm, ["bench_mc"], manager)
  return FLAGS.examples / (time.perf_counter() - start)


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  shutil.rmtree(FLAGS.workdir, ignore_errors=True)
  gin_config.parse([os.path.join(gin_config.REPO_ROOT, FLAGS.model_gin)], [])
  config = gin_config.build_model_config()
  run, hf_dir = os.path.join(FLAGS.workdir, "run"), os.path.join(FLAGS.workdir, "hf")
  params = jax.tree.map(np.asarray, lm_lib.init_params(config, jax.random.key(0)))
  convert.write_step0(run, config, params, make_vocabulary("byte"), 512)
  export.export(run, hf_dir)
  tasks = os.path.join(FLAGS.workdir, "tasks")
  write_task(tasks, FLAGS.examples)
  manager = downstream.task_manager(["bench_mc"], tasks)
  model = load(run)
  ours = downstream.backend(model.runtime, model.params, model.vocabulary,
                            max_length=model.sequence_length, batch_size=FLAGS.batch_size)
  theirs = HFLM(pretrained=hf_dir, dtype="float32", device="cpu",
                batch_size=FLAGS.batch_size, logits_cache=False)
  result = {"model_gin": FLAGS.model_gin, "examples": FLAGS.examples,
            "batch_size": FLAGS.batch_size, "jax_examples_per_s": [],
            "hf_examples_per_s": []}
  for _ in range(FLAGS.rounds):
    result["jax_examples_per_s"].append(round(timed(ours, manager), 2))
    result["hf_examples_per_s"].append(round(timed(theirs, manager), 2))
  result["warm_ratio_jax_over_hf"] = round(
      result["jax_examples_per_s"][-1] / result["hf_examples_per_s"][-1], 2)
  print(json.dumps(result))


if __name__ == "__main__":
  cli.run(main)
