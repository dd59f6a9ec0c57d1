"""`python -m pretrain.summary`, run as users run it (a subprocess), plus its error paths."""
import json
import os
import subprocess
import sys
import time

import pytest

from model import counting
from model.config import ModelConfig
from tiers import slow_after_first

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))


def run_summary(*args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "pretrain.summary", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # a subprocess; its path is covered fast by a sibling test
def test_griffin_14b_json_in_under_60_seconds():
  start = time.monotonic()
  result = run_summary("--gin_file=configs/models/griffin_14b.gin", "--json")
  elapsed = time.monotonic() - start
  assert result.returncode == 0, result.stderr
  summary = json.loads(result.stdout)
  assert abs(summary["params_non_embedding"] / 14e9 - 1) <= 0.15
  config = ModelConfig(**{k: tuple(v) if isinstance(v, list) else v
                          for k, v in summary["model"].items()})
  assert summary["params_total"] == counting.analytic_param_counts(config).total
  assert summary["params_non_embedding"] == summary["params_total"] - 32768 * 5120
  assert summary["flops_per_token"] == pytest.approx(
      counting.training_flops_per_token(config, 2048))
  assert summary["seq"] == 2048 and summary["decode_state_bytes"] > 0
  assert elapsed < 60, f"took {elapsed:.1f}s"


def test_text_output_and_bindings_and_seq():
  result = run_summary("--gin_file=configs/models/tiny_mqa.gin",
                       "--gin_param=ModelConfig.depth = 3", "--seq=100")
  assert result.returncode == 0, result.stderr
  config = ModelConfig(vocab_size=256, width=64, depth=3, num_heads=2,
                       block_pattern=("attention",), attention_window=None)
  total = counting.analytic_param_counts(config).total
  assert f"parameters, total:          {total:,}" in result.stdout
  assert "at T=100" in result.stdout
  # Global attention caches all 100 positions: K and V of one 32-wide head, float32.
  assert counting.decode_state_bytes(config, 100) >= 3 * 2 * 100 * 32 * 4
  assert f"{counting.decode_state_bytes(config, 100):,} bytes" in result.stdout


@pytest.mark.slow
def test_training_configs_work_too():
  """A whole training config (trainer, data, optimizer and model bindings) is read by the
  trainer's Gin loader, so its model can be summarised as it is."""
  result = run_summary("--gin_file=configs/quickstart.gin", "--json")
  assert result.returncode == 0, result.stderr
  model = json.loads(result.stdout)["model"]
  assert model["block_pattern"] == ["recurrent", "recurrent", "attention"]
  assert (model["vocab_size"], model["width"], model["depth"]) == (259, 192, 6)


@pytest.mark.slow  # a subprocess; its path is covered fast by a sibling test
def test_mesh_adds_per_device_memory():
  result = run_summary("--gin_file=configs/models/griffin_100m.gin", "--json",
                       "--mesh=data:2,fsdp:4,tensor:1", "--batch=16", "--seq=512",
                       "--device_memory_gb=16")
  assert result.returncode == 0, result.stderr
  summary = json.loads(result.stdout)
  per_device = summary["per_device_bytes"]
  for key in ("params", "optimizer", "gradients", "activations", "total"):
    assert per_device[key] > 0
  # fsdp:4 shards the float32 parameters (about 4 bytes each) over 4 of the 8 devices.
  assert per_device["params"] < 4 * summary["params_total"] / 3
  assert per_device["total"] >= sum(per_device[k] for k in
                                    ("params", "optimizer", "gradients", "activations"))
  assert summary["memory_fits"] in (True, False)


@pytest.mark.slow   # fast tier under 5 min: three summaries of the 1.3B preset (23 s)
def test_attention_and_platform_plans():
  """The summary says what attention each platform runs, and `--platform=tpu` plans the
  splash kernel's memory: one log-sum-exp per head where XLA keeps 2 x 2w scores."""
  result = run_summary("--gin_file=configs/models/griffin_1_3b.gin", "--json",
                       "--mesh=fsdp:4", "--batch=16", "--platform=tpu")
  host = run_summary("--gin_file=configs/models/griffin_1_3b.gin", "--json",
                     "--mesh=fsdp:4", "--batch=16")
  assert result.returncode == host.returncode == 0, result.stderr + host.stderr
  tpu, cpu = json.loads(result.stdout), json.loads(host.stdout)
  assert tpu["attention"]["tpu"] == {"impl": "splash", "reason": ""}
  assert tpu["attention"]["cpu"]["impl"] == "xla"
  assert "sliding-window" in tpu["attention"]["gpu"]["reason"]
  # Griffin 1.3B: 8 attention layers of 16 heads; at 16 x 2048 tokens over 4 chips XLA's
  # path keeps 2 x 2048 float32 scores per head and token where splash keeps 1. Its 16
  # RG-LRU layers (D_RNN 2560, remat none) keep the TPU scan's row, 5 bf16 + 2 float32
  # buffers per channel, where a scan lowered elsewhere is planned at 3 + 4: 4 bytes more.
  saved = (cpu["per_device_bytes"]["activations"] - tpu["per_device_bytes"]["activations"])
  tokens = 16 * 2048 / 4
  rg_lru = 16 * 2560 * ((3 * 2 + 4 * 4) - (5 * 2 + 2 * 4)) * tokens
  assert saved == pytest.approx(8 * 16 * (2 * 2048 - 1) * 4 * tokens + rg_lru, rel=0.01)
  text = run_summary("--gin_file=configs/models/tiny_mqa.gin", "--seq=256").stdout
  assert "attention at T=256:    TPU splash; GPU triton; CPU xla" in text


@pytest.mark.parametrize("args, message", slow_after_first([
    (["--gin_file=configs/models/no_such.gin"], "Gin file not found"),
    (["--gin_file=configs/models/tiny_hawk.gin", "--gin_param=ModelConfig.width = 63"],
     "divisible"),
    (["--gin_file=configs/models/tiny_hawk.gin", "--gin_param=ModelConfig.widht = 64"],
     "widht"),
    (["--gin_file=configs/models/tiny_hawk.gin", "--gin_param=ModelConfig.width = ("],
     "Bad Gin configuration"),
    (["--gin_file=configs/models/tiny_hawk.gin", "--seq=0"], "--seq"),
    (["--gin_file=configs/models/tiny_hawk.gin", "--no_such_flag"], "no_such_flag"),
    (["--json"], "--gin_file"),
    (["--gin_file=configs/models/tiny_hawk.gin", "--mesh=data:2"], "--batch"),
    (["--gin_file=configs/models/tiny_hawk.gin", "--mesh=data:x", "--batch=2"], "integer"),
    (["--gin_file=configs/models/tiny_hawk.gin", "--batch=2"], "--mesh"),
    (["--gin_file=configs/models/tiny_hawk.gin", "extra"], "Unexpected arguments"),
]))
def test_bad_input_gives_one_clear_line(args, message):
  result = run_summary(*args)
  assert result.returncode == 2, result.stderr
  assert result.stdout == ""
  assert "Traceback" not in result.stderr, result.stderr
  errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1 and message in errors[0], result.stderr
