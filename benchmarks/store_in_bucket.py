"""Training step time with the token store on local disk vs in a (GCS-emulator) bucket.

Starts gcp-storage-emulator as the test fixtures do (`tests/storage_servers.py`: a
subprocess on a free loopback port, with the emulator gaps the fixture fills), prepares
the stores of the quickstart config with `--base` as its corpus once locally and once
into `gs://bucket/tokens` (`pretrain.data.prepare`, 1 in-memory Beam worker), then trains
the same command twice, `DataPipeline.cache_dir` local and then in the bucket (workdirs
local, so only the data reads differ), alternating `--rounds` times. Per run it reports
the median `step_time_s` of the logged steps after the first (which includes compiling),
and the median time of `DataPipeline.batch(step)` alone for both stores, in this process.
One JSON line; the ratios (bucket / local) are what to compare, on a shared machine.

  nice -n 19 python benchmarks/store_in_bucket.py --steps=40 --rounds=2
"""
from __future__ import annotations

from plumbing import quiet
quiet.setup()  # first, before JAX or TensorFlow load: see plumbing/quiet.py
# pylint: disable=wrong-import-position
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Sequence

import gin
from absl import flags

from plumbing import cli, storage
from pretrain import gin_config
from pretrain.data import pipeline, prepare
from pretrain.train_config import TrainConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
import storage_servers  # pylint: disable=wrong-import-position  # noqa: E402

flags.DEFINE_string("base", "json/*.py", "Corpus: this glob inside the standard library.")
flags.DEFINE_integer("steps", 40, "Training steps per run.")
flags.DEFINE_integer("rounds", 2, "Local/bucket run pairs, alternating.")
flags.DEFINE_integer("reads", 50, "DataPipeline.batch calls timed per store.")
FLAGS = flags.FLAGS

CONFIG = "configs/quickstart.gin"


def bindings(cache_dir: str) -> List[str]:
  return [f"TRAIN_FILES = '{{stdlib}}/{FLAGS.base}'", f"TRAIN_STEPS = {FLAGS.steps}",
          "LOG_EVERY = 1", "EVAL_EVERY = 0", f"CHECKPOINT_EVERY = {FLAGS.steps}",
          "TrainConfig.final_eval = False", "TrainConfig.sample_prompt = None",
          f"DataPipeline.cache_dir = '{cache_dir}'"]


def read_seconds(cache_dir: str) -> float:
  """Median seconds of one `batch(step)` (this process's rows of a global batch)."""
  gin_config.parse([CONFIG], bindings(cache_dir))
  try:
    train = gin_config.build(TrainConfig)
    data = gin_config.build(pipeline.DataPipeline, sequence_length=train.sequence_length,
                            batch_size=train.batch_size, seed=train.seed)
  finally:
    gin.clear_config()
  times = []
  for step in range(FLAGS.reads):
    start = time.perf_counter()
    data.batch(step)
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def train_step_seconds(cache_dir: str, workdir: str) -> float:
  """Median step_time_s of a fresh training run, its first logged step left out."""
  command = [sys.executable, "-m", "pretrain.train", f"--gin_file={CONFIG}",
             *[f"--gin_param={b}" for b in bindings(cache_dir)], f"--workdir={workdir}"]
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  subprocess.run(command, env=env, cwd=REPO, check=True, capture_output=True)
  rows = [json.loads(line) for line in storage.read_text(
      os.path.join(workdir, "metrics.jsonl")).splitlines()]
  times = [row["step_time_s"] for row in rows if "step_time_s" in row][1:]
  return statistics.median(times)


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  root = tempfile.mkdtemp(prefix="store_in_bucket_")
  port = storage_servers.free_port()
  endpoint = f"http://127.0.0.1:{port}"
  command = [sys.executable, storage_servers.__file__, "gcs", str(port)]
  with (storage_servers.server(command, endpoint + "/storage/v1/b"),
        storage_servers.environment(**storage_servers.gcs_environment(endpoint)),
        storage_servers.fsspec_options(("gs", "gcs"), token="anon")):
    stores = {"local": os.path.join(root, "tokens"),
              "bucket": f"gs://{storage_servers.BUCKET}/tokens"}
    for output in stores.values():
      prepare.prepare(output, [CONFIG], bindings(output)[:1],
                      ("--direct_running_mode=in_memory", "--direct_num_workers=1"))
      gin.clear_config()
    result: Dict[str, object] = {
        f"batch_read_s_{name}": round(read_seconds(path), 5) for name, path in stores.items()}
    steps: Dict[str, List[float]] = {name: [] for name in stores}
    for round_index in range(FLAGS.rounds):
      for name, path in stores.items():
        workdir = os.path.join(root, f"run-{name}-{round_index}")
        steps[name].append(train_step_seconds(path, workdir))
    result.update({f"step_time_s_{name}": [round(t, 4) for t in times]
                   for name, times in steps.items()})
    result["step_time_ratio_bucket_over_local"] = round(
        statistics.median(steps["bucket"]) / statistics.median(steps["local"]), 3)
    result["batch_read_ratio_bucket_over_local"] = round(
        result["batch_read_s_bucket"] / result["batch_read_s_local"], 2)
  print(json.dumps({"base": FLAGS.base, "steps": FLAGS.steps, "rounds": FLAGS.rounds,
                    **result}))


if __name__ == "__main__":
  cli.run(main)
