"""The trainer's train step compiled by XLA's GPU compiler (CUDA plugin), from this CPU host.

`pretrain.compile` lowers the trainer's own jitted step over a mesh of GPU descriptions
(`pretrain.compilation.gpu_target`, specs in pretrain/compilation/gpu_specs/) and compiles it with XLA:GPU,
Triton or Mosaic GPU, and ptxas; no GPU is attached and the host's backend stays CPU.
Each tiny model compiles forward and backward with the optimizer on 8 H100s under the
meshes the trainer accepts, with the scan as the Triton kernel, the Mosaic GPU kernel
or "auto"; the kernel's custom calls must be in the compiled program. The README's GPU
example (griffin_1_3b on 4 x 8 H100s) compiles verbatim and must fit. The kernels alone
compile for A100, H200 and B200 too, and the look-back strategy, which once segfaulted
XLA:GPU, compiles in a subprocess (a crash fails a test instead of ending pytest).
The CUDA plugin and ptxas come with the test extra (`pip install -e ".[test]"`); a tiny
model's compile takes 10-20 s of CPU, the 1.3B preset's about 30 s.
"""
import json
import os
import shlex
import subprocess
import sys

import jax
import pytest

from plumbing.errors import UserError
from pretrain.compilation import aot
from pretrain import compile as compile_lib
from pretrain.compilation import gpu_target

needs_plugin = pytest.mark.skipif(not gpu_target.plugin_available(),
                                  reason='CUDA plugin not installed (pip install -e ".[gpu-aot]")')

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = "h100-8"  # 8 GPUs, one node
TINY = ["BATCH_SIZE=16", "SEQUENCE_LENGTH=64"]
GRIFFIN = "configs/models/tiny_griffin.gin"
PALLAS = 'ModelConfig.scan_impl="pallas"'
TRITON = [PALLAS, 'ScanOptions.pallas_gpu_backend="triton"']
MOSAIC = [PALLAS, 'ScanOptions.pallas_gpu_backend="mosaic_gpu"']
CGLRU = 'ModelConfig.lru_variant="complex"'
CASES = [
    # (model file, extra bindings, mesh, the kernel compiler in the program: None = no
    # kernel). No binding is "auto": the Triton kernel (JAX 0.10 ships Pallas Triton).
    (GRIFFIN, TRITON, "data:8", "Triton"),
    (GRIFFIN, MOSAIC, "fsdp:8", "Mosaic GPU"),
    (GRIFFIN, [], "fsdp:4,tensor:2", "Triton"),
    (GRIFFIN, MOSAIC, "data:4,sequence:2", "Mosaic GPU"),
    (GRIFFIN, TRITON, "sequence:4,tensor:2", "Triton"),
    ("configs/models/tiny_hawk.gin", [], "data:2,fsdp:2,tensor:2", "Triton"),
    ("configs/models/tiny_mqa.gin", [], "data:4,sequence:2", None),
    (GRIFFIN, [CGLRU] + MOSAIC, "fsdp:4,tensor:2", "Mosaic GPU"),
    ("configs/models/gateloop_tiny.gin", TRITON, "sequence:2,tensor:4", "Triton"),
]


def _case_id(case):
  model, bindings, mesh, _ = case
  scan = "mosaic" if bindings and bindings[-1] == MOSAIC[-1] else (
      "triton" if bindings and bindings[-1] == TRITON[-1] else "auto")
  return (f"{model.split('/')[-1][:-4]}{'-cglru' if CGLRU in bindings else ''}-{scan}-"
          f"{mesh}")


@needs_plugin
@pytest.mark.slow
@pytest.mark.parametrize("model_file,bindings,mesh,kernel", CASES,
                         ids=[_case_id(c) for c in CASES])
def test_train_step_compiles_for_gpu(model_file, bindings, mesh, kernel):
  report, compiled = compile_lib.compile_from_gin(TARGET, 1, [model_file],
                                                  TINY + bindings, mesh)
  assert jax.default_backend() == "cpu"  # the host never started a GPU client
  devices = jax.tree.leaves(compiled.input_shardings)[0].device_set
  assert report.devices == len(devices) == 8 and {d.platform for d in devices} == {"gpu"}
  assert report.platform == "gpu" and report.hbm_bytes == 85520809984
  assert list(report.kernels) == ([kernel] if kernel else [])
  assert aot.kernel_calls(compiled.as_text()) == report.kernels
  if kernel:
    # Forward and backward: the chunked strategy's 2 kernels each way, at least.
    assert report.kernels[kernel] >= 4
  assert 0 < report.peak_bytes < report.hbm_bytes and report.fits
  assert report.compile_cpu_seconds > 0 and report.compile_host_peak_bytes > 2**27


@needs_plugin
@pytest.mark.slow
def test_global_attention_compiles_with_the_triton_kernel():
  """"auto" attention on an H100 for global MQA at 256 tokens a row: JAX's Pallas GPU
  flash attention (forward and backward Triton launches, per layer) in the program,
  heads split over `tensor` inside shard_map; the report names it."""
  report, compiled = compile_lib.compile_from_gin(
      TARGET, 1, ["configs/models/tiny_mqa.gin"], ["BATCH_SIZE=16", "SEQUENCE_LENGTH=256"],
      "fsdp:4,tensor:2")
  assert report.attention == {"impl": "triton", "reason": ""}
  text = compiled.as_text()
  assert report.kernels == {"Triton": text.count('custom_call_target="__gpu$xla.gpu.triton')}
  assert text.count("mha_forward") >= 2   # one forward launch per attention layer
  assert report.kernels["Triton"] >= 4 and report.fits


def _readme_command() -> str:
  """The command as the README's compiling page (docs/compiling.md) shows it."""
  lines = []
  for page in ("README.md", "docs/compiling.md"):   # where the README sends compiling
    with open(os.path.join(REPO, page), encoding="utf-8") as f:
      lines += [line.strip() for line in f
                if line.startswith("    python -m pretrain.compile --topology=h100")]
  assert len(lines) == 1, lines
  return lines[0]


@needs_plugin
@pytest.mark.slow
def test_readme_gpu_command_compiles_the_slurm_example(tmp_path):
  """The README's GPU command verbatim (griffin_1_3b, 32 H100s, the SLURM example's
  mesh, batch and remat), plus --json and --save: it fits, with the Triton kernel."""
  command = _readme_command() + f" --json --save={tmp_path / 'step.exe'}"
  env = {**os.environ, "PYTHONPATH": REPO}
  env.pop("JAX_PLATFORMS", None)  # the command itself keeps the host on CPU
  done = subprocess.run(shlex.split(command.replace("python", sys.executable, 1)), cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  report = json.loads(done.stdout.strip().splitlines()[-1])
  assert report["target"] == "h100-32" and report["devices"] == 32
  assert report["mesh"]["fsdp"] == 4 and report["mesh"]["tensor"] == 8
  assert report["model"]["remat"] == "full" and report["batch_size"] == 256
  assert report["kernels"].get("Triton") and report["fits"]
  assert 0 < report["peak_bytes"] < report["hbm_bytes"]
  assert (tmp_path / "step.exe").stat().st_size > 0


@needs_plugin
@pytest.mark.slow
def test_kernels_compile_for_each_generation_and_the_look_back_strategy():
  """The scan kernels alone, forward and backward, in a subprocess: Triton on A100
  (sm_80), H100 and B200 (sm_100); Mosaic GPU on H200 and B200 (it needs sm_90 or
  later); the look-back strategy, whose while loop once crashed Triton inside XLA:GPU,
  in bfloat16 and complex. Chunked: 2 kernels forward, 2 backward; look-back:
  1 and 1."""
  expected = {
      "a100:triton:chunked:bfloat16": {"Triton": 4},
      "b200:triton:chunked:float32": {"Triton": 4},
      "h200:mosaic_gpu:chunked:complex": {"Mosaic GPU": 4},
      "b200:mosaic_gpu:chunked:bfloat16": {"Mosaic GPU": 4},
      "h100:triton:lookback:bfloat16": {"Triton": 2},
      "h100:triton:lookback:complex": {"Triton": 2},
  }
  env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
  results = {}
  # Mosaic GPU keeps the first target's SM version for the life of a process (ptxas
  # then refuses sm_100a after sm_90a: "SM version specified by .target is higher than
  # default SM version assumed"), so its B200 case runs in a process of its own.
  b200_mosaic = "b200:mosaic_gpu:chunked:bfloat16"
  for cases in ([case for case in expected if case != b200_mosaic], [b200_mosaic]):
    done = subprocess.run([sys.executable, os.path.join(REPO, "tests", "gpu_kernels.py"),
                           *cases], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    results.update((r["case"], r["kernels"]) for r in map(json.loads, done.stdout.splitlines()))
    assert done.returncode == 0, (results, done.stderr[-3000:])
  assert results == expected


@needs_plugin
@pytest.mark.parametrize("kind", gpu_target.KINDS)
def test_each_spec_parses_into_devices(kind):
  """XLA:GPU parses every spec (a GpuTargetConfigProto) into devices of that kind, in
  nodes of --gpus_per_node."""
  target = gpu_target.parse_target(f"{kind}-16", gpus_per_node=4)
  devices = gpu_target.target_devices(target)
  assert len(devices) == 16 and target.nodes == 4
  assert {d.device_kind for d in devices} == {gpu_target.spec_field(kind, "name")}
  assert {d.compute_capability for d in devices} == {
      f"{gpu_target.spec_field(kind, 'major')}.{gpu_target.spec_field(kind, 'minor')}"}
  assert jax.default_backend() == "cpu"


@needs_plugin
def test_the_plugin_stays_out_of_cpu_runs():
  """With the CUDA plugin installed and no GPU, using the package as the README's
  snippet does (no JAX_PLATFORMS, no log-level variables) starts only the CPU backend
  and writes nothing to stderr: `plumbing.quiet` keeps JAX off the plugin."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_PLATFORMS", "TF_CPP_MIN_LOG_LEVEL", "XLA_FLAGS")}
  env["PYTHONPATH"] = REPO
  done = subprocess.run(
      [sys.executable, "-c", "import pretrain, jax, jax.numpy as jnp; "
       "print(jax.default_backend(), int(jnp.ones(3).sum()))"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0 and done.stderr == "", done.stderr[-3000:]
  assert done.stdout.split() == ["cpu", "3"]


@pytest.mark.parametrize("name,gpus,per_node,memory_gib", [
    ("h100-8", 8, 8, 79.6), ("h100-32", 32, 8, 79.6), ("h200-16", 16, 8, 140.4),
    ("a100-4", 4, 4, 80.0), ("b200-64", 64, 8, 167.6)])
def test_targets_are_named_by_kind_and_count(name, gpus, per_node, memory_gib):
  target = gpu_target.parse_target(name)
  assert (target.devices, target.gpus_per_node) == (gpus, per_node)
  assert target.hbm_bytes / 2**30 == pytest.approx(memory_gib, abs=0.1)


@pytest.mark.parametrize("name,per_node,problem", [
    ("h100-12", 8, "not whole nodes"), ("v100-8", 8, "not a known target"),
    ("h100", 8, "not a known target")])
def test_bad_gpu_targets_say_what_is_wrong(name, per_node, problem):
  with pytest.raises(UserError, match=problem):
    gpu_target.parse_target(name, per_node)


def test_compile_reads_any_non_tpu_name_as_gpus():
  with pytest.raises(UserError, match="not a known target: TPU slices look like v5p-128"):
    compile_lib.target_and_devices("x100-8")


def test_num_slices_is_for_tpus():
  with pytest.raises(UserError, match="--num_slices is for TPU slices"):
    compile_lib.target_and_devices("h100-16", num_slices=2)


def test_without_the_plugin_says_how_to_install(monkeypatch):
  monkeypatch.setattr(gpu_target, "plugin_available", lambda: False)
  with pytest.raises(UserError, match=r'pip install -e "\.\[gpu-aot\]"'):
    compile_lib.compile_from_gin(TARGET, 1, [GRIFFIN], [], "data:8")
