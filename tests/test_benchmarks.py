"""Smoke tests of benchmarks/train_step.py on a tiny Griffin, so the script cannot rot.

Each run compiles our training step and the recurrentgemma-built one and checks that the
two compute the same first-step loss from the same (mapped) weights.
"""
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from plumbing.errors import UserError
from trainer_helpers import last_line_of_fresh_python

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO_ROOT, "benchmarks", "train_step.py")

def _tiny_gin(depth: int, block_pattern: str, attention_window: str, dtype: str) -> str:
  """A tiny model preset (64-token vocabulary, width 32, two heads) as Gin text."""
  return f"""
import model.config
ModelConfig.vocab_size = 64
ModelConfig.width = 32
ModelConfig.rnn_width = 32
ModelConfig.depth = {depth}
ModelConfig.num_heads = 2
ModelConfig.block_pattern = {block_pattern}
ModelConfig.attention_window = {attention_window}
ModelConfig.dtype = "{dtype}"
"""


TINY_GIN = _tiny_gin(3, '("recurrent", "recurrent", "attention")', "4", "float32")


def _load_benchmark(name: str):
  spec = importlib.util.spec_from_file_location(name, os.path.join(REPO_ROOT, "benchmarks",
                                                                   f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up while being built
  spec.loader.exec_module(module)
  return module


def test_benchmarks_loaded_in_process_claim_no_flag_names():
  """The benchmarks this module loads in-process define their flags only when run: a
  module-level definition would collide with a library flag of the same name (`--output`
  of pretrain.evaluate did) in whichever test the same worker ran next."""
  names = ("train_step", "tpu_estimate", "step_bytes")
  code = ("import importlib.util, os, sys\n"
          "from absl import flags\n"
          f"for name in {names!r}:\n"
          "  spec = importlib.util.spec_from_file_location(name, os.path.join('benchmarks', "
          "name + '.py'))\n"
          "  module = importlib.util.module_from_spec(spec)\n"
          "  sys.modules[name] = module\n"
          "  spec.loader.exec_module(module)\n"
          f"print(sorted(m for m in flags.FLAGS.flags_by_module_dict() if m in {names!r}))\n")
  assert last_line_of_fresh_python(code, timeout=300) == "[]"


@pytest.fixture(scope="module")
def train_step():
  return _load_benchmark("train_step")


@pytest.fixture
def tiny_gin(tmp_path):
  path = tmp_path / "tiny.gin"
  path.write_text(TINY_GIN)
  return str(path)


def _check(result, steps):
  assert result["loss_relative_difference"] <= result["loss_tolerance"]
  for name in ("ours", "reference"):
    model = result["models"][name]
    assert model["compile_s"] > 0 and len(model["step_s"]) == steps
    assert 0 < model["median_step_s"] and model["tokens_per_s"] > 0
  ratio = result["models"]["ours"]["tokens_per_s"] / result["models"]["reference"][
      "tokens_per_s"]
  assert result["ratio_tokens_per_s"] == pytest.approx(ratio)


@pytest.mark.slow
def test_command_line_runs_and_writes_json(tiny_gin, tmp_path):
  out = tmp_path / "result.json"
  run = subprocess.run([sys.executable, SCRIPT, f"--preset={tiny_gin}", "--batch=2",
                        "--seq=8", "--steps=2", "--warmup=1", f"--json={out}"],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  assert "ours / reference tokens/s" in run.stdout
  result = json.loads(out.read_text())
  assert result["reference"].startswith("recurrentgemma.jax.Griffin")
  assert result["batch"] == 2 and result["seq"] == 8
  _check(result, steps=2)


@pytest.mark.slow
def test_reference_with_separate_gate_blocks_computes_our_model(train_step, tiny_gin):
  """recurrentgemma ties gate blocks to heads; the script's reference unties them."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from model import lm
  config = train_step.load_model_config(tiny_gin, remat="save_matmuls",
                                        num_gate_blocks=4)
  assert config.gate_blocks == 4 and config.num_heads == 2
  reference, description = train_step.reference_model(config, seq=8)
  assert "gate blocks 4" in description
  dummy = jnp.zeros((1, 1), jnp.int32)
  params = jax.jit(reference.init)(jax.random.PRNGKey(0), dummy, dummy)["params"]
  assert params["blocks.0"]["recurrent_block"]["rg_lru"]["a_gate"]["w"].shape == (4, 8, 8)
  ours = train_step.recurrentgemma_params.recurrentgemma_to_ours(params, config)
  batch = train_step.packed_batch(np.random.default_rng(0), 2, 8, config.vocab_size)

  @jax.jit
  def both_logits(ours, theirs, tokens, positions):
    return (lm.LanguageModel(config).apply({"params": ours}, tokens, positions)[0],
            reference.apply({"params": theirs}, tokens, positions, return_cache=False)[0])

  logits, expected = both_logits(ours, params, batch["inputs"], batch["positions"])
  np.testing.assert_allclose(logits, expected, rtol=1e-5,
                             atol=1e-5 * float(jnp.max(jnp.abs(expected))))


def test_models_recurrentgemma_cannot_build_are_rejected(train_step):
  config = train_step.load_model_config("gateloop_tiny")
  with pytest.raises(ValueError, match="recurrentgemma does not implement"):
    train_step.reference_config(config, seq=8)
  with pytest.raises(UserError, match="--preset"):
    train_step.preset_file("no_such_preset")


def _run_benchmark(script: str, *flags: str) -> subprocess.CompletedProcess:
  """Runs benchmarks/<script> as its users do, from the repository root."""
  return subprocess.run([sys.executable, os.path.join(REPO_ROOT, "benchmarks", script),
                         *flags], cwd=REPO_ROOT, capture_output=True, text=True,
                        timeout=600)


def _assert_usage_error(run: subprocess.CompletedProcess, named: str) -> None:
  """Exit status 2 and an `error:` line naming the flag, no traceback."""
  assert run.returncode == 2, run.stderr[-3000:]
  assert "Traceback" not in run.stderr, run.stderr[-3000:]
  error = [line for line in run.stderr.splitlines() if line.startswith("error:")]
  assert len(error) == 1 and named in error[0], run.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.soak  # 45 s of CPU timings; the script's numbers count only on a device
def test_depth_scan_script_times_scanned_and_unrolled(tiny_gin):
  """benchmarks/depth_scan.py on the tiny Griffin at depth 6 (two scanned units)."""
  with open(tiny_gin, "a") as f:
    f.write("ModelConfig.depth = 6\n")
  run = _run_benchmark("depth_scan.py", f"--preset={tiny_gin}", "--batch=1", "--seq=8",
                       "--steps=2", "--unrolls=1,full")
  assert run.returncode == 0, run.stderr[-3000:]
  printed = run.stdout
  assert "2 scanned unit(s)" in printed and "default unroll (depth_scan_unroll=None): 2" in printed
  rows = [line for line in printed.splitlines() if line.startswith("| 1 |")
          or line.startswith("| 2 |")]
  assert len(rows) == 2, printed
  assert rows[0].endswith("| 1.00 |"), rows[0]
  for bad, named in (("--unrolls=abc", "--unrolls"), ("--preset=no_such_preset", "--preset"),
                     ("--steps=0", "--steps")):
    _assert_usage_error(_run_benchmark("depth_scan.py", bad), named)


@pytest.mark.slow
def test_scan_script_times_each_implementation():
  """benchmarks/scan.py on one tiny shape: XLA scans, a Pallas strategy (interpreted on
  CPU, so only with --include_interpret) and the copy floor, in both modes."""
  run = _run_benchmark("scan.py", "--batch=2", "--channels=128", "--lengths=16",
                       "--impls=lax:1,associative,pallas:sequential", "--repeats=1",
                       "--dtype=float32", "--include_interpret")
  assert run.returncode == 0, run.stderr[-3000:]
  rows = [line.split(" | ")[:4] for line in run.stdout.splitlines()
          if line.startswith("| ") and "| 16 | 128 |" in line]
  names = ["lax:1", "associative", "pallas:sequential (interpret)", "copy floor"]
  assert rows == [[f"| {name}", mode, "16", "128"] for mode in ("fwd", "fwd+bwd")
                  for name in names], run.stdout
  for bad, named in (("--impls=lax:1,scan", "--impls"), ("--lengths=16,x", "--lengths"),
                     ("--modes=backward", "--modes"), ("--repeats=0", "--repeats")):
    _assert_usage_error(_run_benchmark("scan.py", bad), named)


@pytest.mark.slow   # fast tier under 5 min: compiles for TPU (10 s)
def test_scan_tpu_bytes_script_splits_kernel_and_relayout_bytes():
  """benchmarks/scan_tpu_bytes.py on one tiny shape: libtpu's bytes of the Pallas scan
  program, the kernels' declared share and what lies outside them."""
  run = _run_benchmark("scan_tpu_bytes.py", "--shape=2,256,256", "--dtypes=float32")
  assert run.returncode == 0, run.stderr[-3000:]
  rows = [line.split() for line in run.stdout.splitlines() if line.startswith("float32")]
  assert [row[1] for row in rows] == ["forward", "forward+backward"], run.stdout
  for row in rows:
    everything, kernels, outside = (float(v) for v in row[2:5])
    assert 0 < kernels <= everything and outside == pytest.approx(everything - kernels, abs=0.2)
  # The forward kernel moves a (float32), x and h once: 3 x 2 x 256 x 256 x 4 bytes, and
  # nothing else moves (its view of [B, T, D] is XLA:TPU's own tiling: no relayout).
  forward = [float(v) for v in rows[0][2:5]]
  assert forward[1] == pytest.approx(3 * 2 * 256 * 256 * 4 / 1e6, abs=0.05)
  assert forward[2] == pytest.approx(0, abs=0.05)
  _assert_usage_error(_run_benchmark("scan_tpu_bytes.py", "--shape=2,256"), "--shape")


@pytest.mark.slow
def test_json_preset_times_ours_alone(train_step, tiny_gin, tmp_path):
  """A JSON preset (what benchmarks/gpu_checks_prepare.py writes for machines without
  the data stack) rebuilds the gin preset's config; --noreference times ours alone."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  config = train_step.load_model_config(tiny_gin)
  path = tmp_path / "tiny.model.json"
  path.write_text(json.dumps({**dataclasses.asdict(config), "depth_unroll": 1}))
  assert train_step.load_model_config(str(path)) == config
  result = train_step.run(config, batch=2, seq=8, steps=1, warmup=1, with_reference=False)
  assert list(result["models"]) == ["ours"] and result["reference"] is None
  assert result["models"]["ours"]["mfu"] is None  # CPU: no peak, so no MFU
  assert "not run (--noreference)" in train_step.format_table(result)
  path.write_text(json.dumps({"width": "wide"}))
  with pytest.raises(UserError, match="not a ModelConfig"):
    train_step.load_model_config(str(path))


@pytest.mark.slow
def test_shard_map_step_script_matches_the_single_device_step():
  """benchmarks/gpu_shard_map_step.py on 2 CPU devices (Pallas in interpret mode)."""
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
         "JAX_PLATFORMS": "cpu"}
  run = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "benchmarks",
                                                     "gpu_shard_map_step.py"),
                        "--batch=2", "--seq=32", "--repeats=1"],
                       cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  assert "mesh data:2" in run.stdout and "shard_map in the program: True" in run.stdout
  difference = float(run.stdout.split("worst relative difference (loss, gradients) ")[1]
                     .split()[0])
  assert difference <= 2e-4


@pytest.mark.slow
def test_corpus_throughput_script_measures_every_reader(tmp_path):
  """benchmarks/corpus_throughput.py on 300 documents: every reader of both formats reads
  every row, and the tokenizing ones pack every document."""
  run = _run_benchmark("corpus_throughput.py", "--rows=300", "--files=2",
                       "--row_group_rows=50", "--repeats=1", "--spm_vocab=300",
                       "--bpe_vocabs=400", "--lexicon=5000", "--sequence_length=128",
                       f"--workdir={tmp_path}")
  assert run.returncode == 0, run.stderr[-3000:]
  report = json.loads(run.stdout.strip().splitlines()[-1])
  results = report["results"]
  assert [(r["format"], r["reader"]) for r in results] == [
      ("parquet", "pyarrow"), ("parquet", "pyarrow+pylist"), ("parquet", "source"),
      ("parquet", "tokenize/bytes"), ("parquet", "tokenize/spm"),
      ("parquet", "tokenize/bpe400"),
      ("jsonl.zst", "zstd+json"), ("jsonl.zst", "source"),
      ("jsonl.zst", "tokenize/bytes"), ("jsonl.zst", "tokenize/spm"),
      ("jsonl.zst", "tokenize/bpe400"),
      ("text", "encode/bytes"), ("text", "encode/spm"), ("text", "encode/bpe400")]
  assert all(r["rows"] == 300 and r["rows_per_cpu_s"] > 0 and r["mb_per_cpu_s"] > 0
             for r in results), results
  assert report["vocab_sizes"] == {"bytes": 259, "spm": 300, "bpe400": 400}, report
  assert run.stdout.count("bound by: ") == 6, run.stdout


def test_wsd_three_families_script_prints_the_recorded_study():
  """The tables of docs/scaling.md's three-family study, from the recorded results."""
  result = subprocess.run([sys.executable, "benchmarks/wsd_three_families.py"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
  assert result.returncode == 0, result.stderr
  forecasts = [line for line in result.stdout.splitlines()
               if line.startswith(("| griffin | 49,248, ", "| hawk | 186,880, ",
                                   "| mqa | 40,928, "))]
  assert len(forecasts) == 3, result.stdout
  assert all(line.endswith("| yes |") for line in forecasts), forecasts
  assert "| total | 7.14e+12 | 2.31e+12 | 1.54e+13 | 0.46 " in result.stdout


def test_tpu_estimate_extrapolates_an_affine_cost_exactly():
  """benchmarks/tpu_estimate.py's depth arithmetic: the cut depths keep the preset's
  remainder layers, and an affine cost comes back exactly."""
  bench = _load_benchmark("tpu_estimate")
  assert bench.compile_depths(12, 3) == (3, 6, 4.0)    # Griffin 400M and 100M: four units
  assert bench.compile_depths(24, 3) == (3, 6, 8.0)    # Griffin 1.3B
  assert bench.compile_depths(32, 3) == (5, 8, 10.0)   # Griffin 7B: the two extra layers kept
  assert bench.compile_depths(32, 1) == (1, 2, 32.0)   # Hawk or MQA 7B, one-layer units
  with pytest.raises(ValueError, match="shorter than one unit"):
    bench.compile_depths(2, 3)
  cost = lambda layers: 7.5 + 2.25 * layers            # fixed part + per layer
  for depth, unit in ((12, 3), (24, 3), (32, 3), (32, 1)):
    one, two, units = bench.compile_depths(depth, unit)
    assert bench.extrapolate(cost(one), cost(two), units) == pytest.approx(cost(depth))
  report = lambda layers: {
      "estimated_seconds": 1e-3 * cost(layers), "bytes_accessed": 1e9 * cost(layers),
      "compiled_flops": 1e12 * cost(layers), "model_flops": 4e12 * cost(layers),
      "peak_bytes": 1e8 * cost(layers), "devices": 4, "batch_size": 16,
      "sequence_length": 2048, "hbm_bytes": 95 * 2**30, "while_loops": 0,
      "peak_flops": 459e12, "compile_cpu_seconds": 10.0 * layers,
      "host_peak_bytes": 2**30 * layers}
  point = bench.point_from_compiles(report(5), report(8), 10.0)
  assert point["estimated_seconds"] == pytest.approx(1e-3 * cost(32))
  assert point["bytes_per_token"] == pytest.approx(1e9 * cost(32) * 4 / (16 * 2048))
  assert point["estimated_mfu"] == pytest.approx(
      4e12 * cost(32) / (1e-3 * cost(32) * 459e12 * 4))
  assert point["compile_cpu_seconds"] == 130.0 and point["host_peak_bytes"] == 8 * 2**30


TINY_MQA_GIN = _tiny_gin(9, '("attention",)', "None", "bfloat16")


@pytest.mark.slow
def test_tpu_estimate_script_validates_its_extrapolation(tmp_path):
  """benchmarks/tpu_estimate.py end to end on a tiny MQA (9 layers, one-layer units) for
  a v5p-8 target: the one- and two-unit compiles extrapolated to the whole depth agree
  with the whole compile (XLA's estimate of every layer is the same), the table, JSON and
  plot are written, and a second run compiles nothing (resume)."""
  (tmp_path / "mqa_t.gin").write_text(TINY_MQA_GIN)
  output, figure = tmp_path / "fig3.json", tmp_path / "fig3.png"
  args = ["--families=mqa", "--sizes=t", "--unit_layers=mqa=1", "--mesh_for=t=v5p-8/data:4",
          "--sequence_lengths=64", "--tokens_per_batch=256", f"--preset_dir={tmp_path}",
          f"--validate={tmp_path / 'mqa_t.gin'}", f"--output={output}", f"--plot={figure}"]
  run = _run_benchmark("tpu_estimate.py", *args)
  assert run.returncode == 0, run.stderr[-3000:]
  result = json.loads(output.read_text())
  assert len(result["compiles"]) == 3 and figure.exists()   # depths 1, 2 and 9
  (point,) = result["points"]
  assert point["depth"] == 9 and point["compile_depths"] == [1, 2]
  assert point["while_loops"] == 0 and point["relative_to_mqa"] == 1.0
  (check,) = result["validation"].values()
  assert check["while_loops"] == 0
  for name in ("estimated_seconds", "bytes_accessed", "model_flops"):
    assert abs(check["relative_error"][name]) < 0.02, check
  assert "| mqa | t | v5p-8 data:4 | 4 x 64 |" in run.stdout
  _assert_usage_error(_run_benchmark("tpu_estimate.py", "--unit_layers=mqa"), "--unit_layers")
  again = _run_benchmark("tpu_estimate.py", *args, "--plot=")
  assert again.returncode == 0 and "compiling" not in again.stderr, again.stderr[-3000:]
  _assert_usage_error(_run_benchmark("tpu_estimate.py", "--sizes=9b"), "--sizes")


def test_step_bytes_charges_laid_out_hbm_arrays():
  """Arrays are charged as XLA:TPU lays them out: the tiled dimensions padded to whole
  tiles, and nothing for a buffer in another memory space (VMEM, `S(1)`)."""
  bench = _load_benchmark("step_bytes")
  assert bench.array_bytes("f32[1,64]{1,0:T(8,128)}") == 8 * 128 * 4
  # Minor to major 1, 2, 0: the 64 is the lane dimension (128), the 32 the sublane (8).
  assert bench.array_bytes("f32[1,64,32]{1,2,0:T(8,128)}") == 128 * 32 * 4
  assert bench.array_bytes("bf16[16,2048,1024]{2,1,0:T(8,128)(2,1)}") == 16 * 2048 * 1024 * 2
  assert bench.array_bytes("bf16[4096,4096]{1,0:T(8,128)(2,1)S(1)}") == 0
  assert bench.array_bytes("(f32[3]{0}, s32[2,5]{1,0})") == 3 * 4 + 10 * 4
  assert bench.part_of("jit(step)/transpose(jvp(LanguageModel))/blocks/block_4/recurrent/"
                       "rg_lru/shard_map/mul") == ("backward", "block/recurrent/rg_lru")
  assert bench.part_of("jit(step)/jvp(LanguageModel)/blocks/block_0/mlp/up/dot_general"
                       ) == ("forward", "block/mlp/up")
  assert bench.part_of("jit(step)/sqrt") == ("optimizer and rest", "loss, optimizer, other")
  # Splash attention's launches carry no name stack; their names say what they are.
  assert bench.splash_part("splash_mqa_fwd_segmented_residuals.1") == (
      "forward", "block/attention (splash kernel)")
  assert bench.splash_part("splash_mqa_dkv_segmented_no_residuals.1")[0] == "backward"
  # A launch's metadata may spread JSON over lines that start with a brace; only a line
  # that is the brace alone closes the entry computation.
  program = ("ENTRY %main {\n  %a = f32[2]{0} parameter(0)\n  %b = f32[2]{0} custom-call(%a), "
             'backend_config={"m":"{\n}"}\n  ROOT %c = f32[2]{0} negate(%b)\n}\n')
  assert [line.split()[0] for line in bench.entry_instructions(program)] == [
      "%a", "%b", "}\"}", "ROOT"]


def test_step_bytes_equals_xla_on_programs_without_a_matmul():
  """On elementwise and reduction programs XLA:TPU charges each instruction its operands
  and result once, as the breakdown does: the totals agree (to the few bytes XLA also
  charges for a tuple result's table of buffers)."""
  from pretrain.compilation import aot
  from pretrain import compile as compile_lib
  from pretrain.compilation import tpu_target
  if not tpu_target.libtpu_available():
    pytest.skip('libtpu is not installed (pip install -e ".[tpu]")')
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  bench = _load_benchmark("step_bytes")
  _, devices = compile_lib.target_and_devices("v5p-8")
  sharding = NamedSharding(Mesh(np.array(devices[:1]), ("chip",)), PartitionSpec())
  x = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16, sharding=sharding)
  for program in (lambda x: jnp.sin(x) * 2,
                  lambda x: jnp.sum(jnp.square(x.astype(jnp.float32)), -1),
                  lambda x: (jnp.cos(x) + 1, jnp.max(x, 0))):
    with aot.without_persistent_cache():  # a TPU executable cannot be read back here
      compiled = jax.jit(program).lower(x).compile()
    costs = compiled.cost_analysis()
    costs = costs[0] if isinstance(costs, (list, tuple)) else costs
    moved = sum(part["bytes"] for part in bench.breakdown(compiled.as_text()).values())
    assert moved == pytest.approx(costs["bytes accessed"], rel=1e-4, abs=0)
    assert moved > 0


@pytest.mark.slow
def test_step_bytes_script_splits_a_train_step_by_part(tmp_path):
  """benchmarks/step_bytes.py on tiny Griffin for v5p: each block part forward and
  backward gets its row, and the one-pass sum stays under XLA's figure (which adds a
  tiled matmul's re-reads)."""
  out = tmp_path / "bytes.json"
  run = _run_benchmark("step_bytes.py", "--topology=v5p-8",
                       "--gin_file=configs/models/tiny_griffin.gin", "--mesh=data:4",
                       "--gin_param=BATCH_SIZE=16", "--gin_param=SEQUENCE_LENGTH=64",
                       "--gin_param=ModelConfig.depth=3", f"--json={out}")
  if "libtpu is not installed" in run.stderr:
    pytest.skip("libtpu is not installed")
  assert run.returncode == 0, run.stderr[-3000:]
  result = json.loads(out.read_text())
  assert result["report"]["while_loops"] == 0
  parts = {(p["pass"], p["part"]) for p in result["parts"]}
  for step in ("forward", "backward"):
    assert {(step, "block/recurrent/rg_lru"), (step, "block/recurrent/conv1d"),
            (step, "block/mlp/up"), (step, "block/attention/q")} <= parts, parts
  moved = sum(p["bytes"] for p in result["parts"])
  assert 0.1 * result["report"]["bytes_accessed"] < moved <= result["report"]["bytes_accessed"]
  assert "XLA's bytes accessed" in run.stdout


@pytest.mark.slow
def test_mup_transfer_script_sweeps_rates_at_each_width(tmp_path):
  """benchmarks/mup_transfer.py, shrunk to one family, one width (one compile per
  parametrisation), three rates and a few steps: every rate gets a finite held-out loss
  and the width a best rate."""
  output = tmp_path / "transfer.json"
  run = _run_benchmark("mup_transfer.py", "--families=mqa", "--widths=16", "--steps=4",
                       "--min_log2_rate=-8", "--max_log2_rate=-6", f"--output={output}")
  assert run.returncode == 0, run.stderr[-3000:]
  results = json.loads(output.read_text())
  for kind in ("standard", "mup"):
    runs = results["families"]["mqa"][kind]
    assert len(runs["losses"]) == 1 and len(runs["losses"][0]) == 3, runs
    assert all(np.isfinite(loss) for row in runs["losses"] for loss in row), runs
    assert runs["drift"] == max(abs(b - runs["best"][0]) for b in runs["best"]), runs
  assert (tmp_path / "transfer.png").exists()


def _mup_study_dir(directory, family, exponent, budget, forecast):
  """A finished study's files as benchmarks/mup_study.py reads them."""
  directory.mkdir(parents=True)
  rule = {"coefficient": 0.01, "exponent": exponent,
          "sizes": [{"params": 49248}] + ([{"params": 84832}] if exponent else [])}
  (directory / "size_rule.json").write_text(json.dumps({"families": {family: rule}}))
  (directory / "sweep.csv").write_text("run,flops,own_flops,role\n"
                                       "s,9e11,9e11,stable\nf1,4e11,1e11,fork\n"
                                       "f2,8e11,2e11,fork\n")
  ladder_dir = directory / "ladder" / f"{family}_optimum_C{budget}"
  ladder_dir.mkdir(parents=True)
  (ladder_dir / "forecast.json").write_text(json.dumps(forecast))


def test_mup_study_script_tables_both_studies_forecasts(tmp_path):
  """benchmarks/mup_study.py's reading of two finished studies (synthetic files): C is
  4x the largest fork, a row per study, the μP study's single rate shown as such."""
  mup_study = _load_benchmark("mup_study")
  scored = {"params": 49248, "tokens": 1000, "peak_learning_rate": 0.01,
            "predicted": {"value": 1.2, "low": 1.1, "high": 1.3}, "measured": 1.25,
            "error": 0.05, "relative_error": 0.04, "inside_interval": True}
  _mup_study_dir(tmp_path / "griffin" / "size_rule", "griffin", -0.4, "3.2e12", scored)
  _mup_study_dir(tmp_path / "griffin" / "mup", "griffin", 0.0, "3.2e12",
                 {k: v for k, v in scored.items() if k not in ("measured", "error")})
  budget = mup_study.ladder_budget(str(tmp_path / "griffin" / "size_rule"))
  assert budget == 3.2e12
  rows = [mup_study.study_row(str(tmp_path), "griffin", s, budget) for s in mup_study.STUDIES]
  lines = mup_study.table(rows).splitlines()
  assert lines[2].startswith("| griffin | size rule | 0.01·N^-0.400 | 49,248, 84,832 | "
                             "3.2e+12 (4.0x) |")
  assert lines[2].endswith("| 1.2000 [1.1000, 1.3000] | 1.2500 | +0.0500 (+4.00%), inside |")
  assert lines[3].startswith("| griffin | mup | 0.01 (one rate) | 49,248 | ")
  assert lines[3].endswith("| — | — |")           # its ladder has not finished
  assert rows[0]["fit_flops"] == pytest.approx(1.2e12)
