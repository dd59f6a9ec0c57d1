"""The trainer's train step compiled by the real TPU compiler (libtpu), from this CPU host.

`pretrain.compile` lowers the trainer's own jitted step over a mesh of TPU v5p chip
descriptions and compiles it with XLA:TPU and Mosaic; no TPU is attached and the host's
backend stays CPU (the other tests never start a TPU runtime). Each model compiles
forward and backward with the optimizer on an 8-chip v5p-16 under the meshes the
trainer accepts; where the scan is the Pallas kernel ("auto" on TPU) the Mosaic custom
call must be in the compiled program, inside `shard_map` (before model.recurrence ran
every Pallas call in shard_map, Mosaic refused data and fsdp x tensor meshes:
"Mosaic kernels cannot be automatically partitioned"). libtpu comes with the test
extra (`pip install -e ".[test]"`); each compile takes 10-40 s on 2 cores.
"""
import importlib.util
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
from pretrain.compilation import tpu_target

pytestmark = pytest.mark.skipif(not tpu_target.libtpu_available(),
                                reason='libtpu is not installed (pip install -e ".[tpu]")')

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# XLA's cost-model estimate of each case's step, recorded; a >5% growth fails the test.
ESTIMATE_BASELINE = os.path.join(REPO, "benchmarks", "results", "tpu_estimate_baseline.json")
UPDATE_BASELINE_ENV = "UPDATE_TPU_ESTIMATE_BASELINE"
TARGET = "v5p-16"  # 8 chips, 2 hosts
TINY = ["--gin_param=BATCH_SIZE=16", "--gin_param=SEQUENCE_LENGTH=64"]
GRIFFIN = "configs/models/tiny_griffin.gin"
CASES = [
    # (model file, extra bindings, mesh, scan is Pallas)
    (GRIFFIN, [], "data:8", True),
    (GRIFFIN, [], "fsdp:8", True),
    (GRIFFIN, [], "fsdp:4,tensor:2", True),
    (GRIFFIN, [], "data:4,sequence:2", True),
    (GRIFFIN, [], "sequence:4,tensor:2", True),
    ("configs/models/tiny_hawk.gin", [], "data:2,fsdp:2,tensor:2", True),
    ("configs/models/tiny_mqa.gin", [], "data:4,sequence:2", False),
    (GRIFFIN, ['ModelConfig.lru_variant="complex"'], "fsdp:4,tensor:2", True),  # CG-LRU
    ("configs/models/gateloop_tiny.gin", [], "sequence:2,tensor:4", True),
]


def _compile(model_file, bindings, mesh, target=TARGET, sizes=TINY):
  params = [p.removeprefix("--gin_param=") for p in sizes] + bindings
  return compile_lib.compile_from_gin(target, 1, [model_file], params, mesh)


CASE_IDS = [f"{c[0].split('/')[-1][:-4]}{'-cglru' if c[1] else ''}-{c[2]}" for c in CASES]


def _check_estimate(case: str, report: aot.CompileReport) -> None:
  """The regression guard on XLA's estimate: deterministic for one libtpu, so a growth
  of HBM bytes per token or estimated step time by more than 5% over the recorded
  baseline is a change in the program, not noise. Record a new baseline deliberately
  (`UPDATE_TPU_ESTIMATE_BASELINE=1 pytest tests/test_tpu_compile.py`) and say why in
  the commit."""
  assert report.while_loops == 0  # tiny depths unroll: the estimate counts every layer
  measured = {"bytes_accessed_per_token": report.bytes_accessed_per_token,
              "estimated_seconds": report.estimated_seconds}
  assert all(value and value > 0 for value in measured.values()), measured
  with open(ESTIMATE_BASELINE, encoding="utf-8") as f:
    baseline = json.load(f)
  if os.environ.get(UPDATE_BASELINE_ENV):
    baseline["cases"][case] = measured
    with open(ESTIMATE_BASELINE, "w", encoding="utf-8") as f:
      json.dump(baseline, f, indent=1, sort_keys=True)
      f.write("\n")
    return
  assert case in baseline["cases"], (
      f"no recorded estimate for {case}: run with {UPDATE_BASELINE_ENV}=1 to record it")
  for key, value in measured.items():
    assert value <= 1.05 * baseline["cases"][case][key], (
        f"{case}: {key} grew from {baseline['cases'][case][key]:.6g} to {value:.6g}")


@pytest.mark.slow
@pytest.mark.parametrize("model_file,bindings,mesh,pallas", CASES, ids=CASE_IDS)
def test_train_step_compiles_for_tpu(model_file, bindings, mesh, pallas, request):
  report, compiled = _compile(model_file, bindings, mesh)
  assert jax.default_backend() == "cpu"  # the host never started a TPU runtime
  devices = jax.tree.leaves(compiled.input_shardings)[0].device_set
  assert report.devices == len(devices) == 8 and {d.platform for d in devices} == {"tpu"}
  assert set(report.kernels) == ({"Mosaic"} if pallas else set())
  assert set(aot.kernel_calls(compiled.as_text())) == set(report.kernels)
  assert 0 < report.peak_bytes < report.hbm_bytes and report.fits
  # XLA's per-chip FLOPs over 8 chips against the trainer's analytic count: the same
  # program, so within a factor of two (XLA counts elementwise work and the optimizer).
  assert 0.5 < report.compiled_flops * report.devices / report.model_flops < 2.0
  assert report.estimated_mfu is not None and 0 < report.estimated_mfu < 1
  _check_estimate(request.node.callspec.id, report)


FUSED_SIZES = ["--gin_param=BATCH_SIZE=16", "--gin_param=SEQUENCE_LENGTH=256"]


# The presets' own path: depth scanned one unit a trip (a while loop) with remat, whose
# backward recomputes the forward launch.
SCANNED = ["ModelConfig.depth=6", "ModelConfig.depth_scan_unroll=1",
           'ModelConfig.remat="full"']


@pytest.mark.slow
@pytest.mark.parametrize("model_file,bindings,mesh,impl,launches", [
    (GRIFFIN, [], "fsdp:4,tensor:2", "splash", (1, 1, 1)),  # local attention, heads split
    (GRIFFIN, SCANNED, "fsdp:4,tensor:2", "splash", (2, 1, 1)),  # in the loop body
    ("configs/models/tiny_mqa.gin", [], "data:8", "splash", (2, 2, 2)),  # global
    ("configs/models/tiny_mqa.gin", [], "data:4,sequence:2", "xla", None),  # time split
])
def test_fused_attention_compiles_for_tpu(model_file, bindings, mesh, impl, launches):
  """"auto" attention on TPU at 256 tokens a row: splash attention's forward, dq and dkv
  launches are in the compiled program (inside shard_map, and inside the scanned depth
  with remat), priced from the kernel's block arithmetic and added to XLA's estimate; a
  mesh that splits time runs XLA's path and the report says why."""
  report, compiled = _compile(model_file, bindings, mesh, sizes=FUSED_SIZES)
  text = compiled.as_text()
  assert report.attention["impl"] == impl
  if impl == "xla":
    assert "'sequence'" in report.attention["reason"]
    assert "splash_mqa" not in text and report.declared_kernels is None
    return
  assert report.attention["reason"] == ""
  declared = report.declared_kernels
  assert declared["launches"] == dict(zip(("fwd", "dq", "dkv"), launches))
  assert declared["flops"] > 0 and declared["bytes"] > 0 and declared["seconds"] > 0
  assert report.while_loops == (2 if bindings else 0)
  assert report.estimated_seconds == pytest.approx(
      report.xla_estimated_seconds + declared["seconds"])
  assert report.bytes_accessed == pytest.approx(report.xla_bytes_accessed + declared["bytes"])
  formatted = compile_lib.format_report(report)
  assert "attention:         fused, splash" in formatted
  assert "of which fused attention, declared here" in formatted


def _readme_command() -> str:
  """The command as the README's compiling page (docs/compiling.md) shows it."""
  lines = []
  for page in ("README.md", "docs/compiling.md"):   # where the README sends compiling
    with open(os.path.join(REPO, page), encoding="utf-8") as f:
      lines += [line.strip() for line in f
                if line.startswith("    python -m pretrain.compile --topology=v5p")]
  assert len(lines) == 1, lines
  return lines[0]


@pytest.mark.slow
def test_readme_command_compiles_a_preset(tmp_path):
  """The README's command verbatim (2048 tokens, remat full), plus --json and --save."""
  command = _readme_command() + f" --json --save={tmp_path / 'step.exe'}"
  env = {**os.environ, "PYTHONPATH": REPO}
  env.pop("JAX_PLATFORMS", None)  # the command itself keeps the host on CPU
  done = subprocess.run(shlex.split(command.replace("python", sys.executable, 1)), cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  report = json.loads(done.stdout.strip().splitlines()[-1])
  assert report["target"] == "v5p-16" and report["devices"] == 8
  assert report["kernels"].get("Mosaic") and report["fits"] and report["model"]["remat"] == "full"
  assert 0 < report["peak_bytes"] < report["hbm_bytes"]
  # The compiler's host memory: more than an idle JAX process, less than this host.
  assert 2**28 < report["compile_host_peak_bytes"] < 24 * 2**30
  assert (tmp_path / "step.exe").stat().st_size > 0


def test_without_libtpu_says_how_to_install(monkeypatch):
  monkeypatch.setattr(tpu_target, "libtpu_available", lambda: False)
  with pytest.raises(UserError, match=r'pip install -e "\.\[tpu\]"'):
    compile_lib.compile_from_gin(TARGET, 1, [GRIFFIN], [], "data:8")


@pytest.mark.parametrize("name,chips,topology,hosts_bound", [
    ("v5p-128", 64, "4x4x4", (2, 2, 1)), ("v4-8", 4, "2x2x1", (2, 2, 1)),
    ("v5litepod-16", 16, "4x4", (2, 2, 1)), ("v6e-8", 8, "2x4", (2, 4, 1))])
def test_targets_describe_their_chips(name, chips, topology, hosts_bound):
  target = tpu_target.parse_target(name, num_slices=2)
  assert (target.chips, target.topology, target.devices) == (chips, topology, 2 * chips)
  assert tpu_target._host_bounds(target) == hosts_bound  # pylint: disable=protected-access
  devices = tpu_target.target_devices(target)
  assert len(devices) == 2 * chips and {d.slice_index for d in devices} == {0, 1}


def test_compiling_for_tpu_leaves_later_subprocesses_process_zero():
  """libtpu, asked for a topology without a worker id, writes a warning sentence into the
  C environment as TPU_WORKER_ID; every subprocess started afterwards (a local sweep's
  `launch.sweep_job`) inherited it and took itself for a process other than 0."""
  tpu_target.target_devices(tpu_target.parse_target("v5p-8"))
  child = subprocess.run(
      [sys.executable, "-c", "import os; from launch.dispatch import sweep_job; "
       "print(os.environ.get('TPU_WORKER_ID'), sweep_job.is_process_zero())"],
      capture_output=True, text=True, check=True)
  assert child.stdout.split() == ["0", "True"], child.stdout + child.stderr


@pytest.mark.slow
def test_planner_vs_compiler_script_reports_both(tmp_path):
  """benchmarks/planner_vs_compiler.py in-process on the tiny Griffin: the compiled
  peak and the analytic plan of one run, ratios that are theirs, and a record that
  replaces the earlier one of the same run."""
  spec = importlib.util.spec_from_file_location(
      "planner_vs_compiler", os.path.join(REPO, "benchmarks", "planner_vs_compiler.py"))
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  params = [p.removeprefix("--gin_param=") for p in TINY]
  row = script.compare(TARGET, [GRIFFIN], params, "fsdp:8")
  assert row["compiled_peak_gib"] > row["compiled_activations_gib"] > 0
  assert row["analytic_total_gib"] > row["analytic_activations_gib"] > 0
  assert row["total_ratio"] == pytest.approx(row["analytic_total_gib"]
                                             / row["compiled_peak_gib"])
  assert row["compile_wall_s"] > 0 and row["compile_cpu_s"] > 0
  assert row["compiled_peak_bytes"] == round(row["compiled_peak_gib"] * 2**30)
  records = tmp_path / "records.json"
  script.record(str(records), {**row, "date": "first"})
  script.record(str(records), {**row, "mesh": "data:8", "date": "other run"})
  script.record(str(records), {**row, "date": "again"})
  assert [r["date"] for r in json.loads(records.read_text())] == ["other run", "again"]
