"""Writes the ModelConfigs benchmarks/gpu_checks.sh times, as JSON, for a GPU machine
without the trainer's data stack (SeqIO, TensorFlow) that the Gin presets import.

    python benchmarks/gpu_checks_prepare.py CARRY_DIR

writes CARRY_DIR/griffin_100m.model.json and CARRY_DIR/griffin_1_3b.model.json
(`benchmarks/train_step.py --preset=FILE.json` reads them).
"""
from plumbing import quiet
quiet.setup()  # first, before JAX or TensorFlow load: see plumbing/quiet.py
# pylint: disable=wrong-import-position
import json
import os
import sys

from model.config import model_config_to_dict
from train_step import load_model_config

PRESETS = ("griffin_100m", "griffin_1_3b")


def main(carry_dir: str) -> None:
  os.makedirs(carry_dir, exist_ok=True)
  for preset in PRESETS:
    path = os.path.join(carry_dir, f"{preset}.model.json")
    with open(path, "w") as f:
      json.dump(model_config_to_dict(load_model_config(preset)), f, indent=1)
    print(path)


if __name__ == "__main__":
  main(sys.argv[1])
