"""`python tests/hang_in_data.py ARGS` runs `python -m pretrain.train ARGS` with a data
loader that stalls: `DATA_SLEEPS="P:S:SECONDS[,P:S:SECONDS...]"` makes process P sleep
SECONDS when asked for the batch of step S, on the launcher's first attempt only
(`GRIFFIN_RESTART_ATTEMPT` 0), so a restarted run goes through. The injected fault of
the watchdog and straggler tests: a real process slow or stuck in its input pipeline,
as on a slow or dead file-system mount."""
import os
import runpy
import sys
import time

from launch.clusters import common
from pretrain.data import pipeline

_plain_batch = pipeline.DataPipeline.batch


def _sleeps() -> dict[tuple[int, int], float]:
  """{(process, step): seconds} of `DATA_SLEEPS`."""
  sleeps = {}
  for item in filter(None, os.environ.get("DATA_SLEEPS", "").split(",")):
    process, step, seconds = item.split(":")
    sleeps[int(process), int(step)] = float(seconds)
  return sleeps


def _stalling_batch(self, step):
  seconds = _sleeps().get((self.process_index, step))
  if seconds and os.environ.get(common.ENV_RESTART_ATTEMPT, "0") == "0":
    time.sleep(seconds)
  return _plain_batch(self, step)


if __name__ == "__main__":
  pipeline.DataPipeline.batch = _stalling_batch
  sys.argv[0] = "pretrain.train"
  runpy.run_module("pretrain.train", run_name="__main__", alter_sys=True)
