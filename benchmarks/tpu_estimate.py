r"""The Griffin paper's Figure 3 (training step time against sequence length) read from
libtpu's cost model, with the depth extrapolated from one- and two-unit compiles.

  nice -n 19 python benchmarks/tpu_estimate.py [--families=griffin,hawk,mqa] \
      [--sizes=400m,1_3b,7b] [--sequence_lengths=2048,4096,8192] \
      [--tokens_per_batch=32768] [--validate=griffin_100m,mqa_100m] \
      [--output=benchmarks/results/tpu_figure3.json] [--plot=docs/figures/tpu_figure3.png]

Why extrapolate: compiling a whole preset for TPU on a small host is too costly (griffin_100m
at 8K tokens passed 23.8 GB of host memory; a 7B step takes most of an hour). Every layer of
a family costs the same at a given shape, and the embedding, loss and the optimizer's
per-parameter work are either fixed or proportional to the layers, so XLA's estimate of a
step is affine in the number of residual units. Each point therefore compiles the trainer's
real step (`python -m pretrain.compile --json`) twice, with the depth cut to one unit and
to two, every layer unrolled (no depth loop, whose body XLA would count once) and the loss
in one chunk (no loop either), and takes

    cost(n) = cost(1) + (n - 1) * (cost(2) - cost(1))

for XLA's estimated step time, HBM bytes, compiled FLOPs and the trainer's model FLOPs.
A unit is 3 layers for every family by default: one repetition of Griffin's block
pattern (recurrent, recurrent, attention), three layers of Hawk or MQA. Hawk's and MQA's
layers are all alike, so `--unit_layers=hawk=1,mqa=1` extrapolates to the same quantity
from far cheaper compiles, but less exactly: on mqa_100m (12 layers, v5p-8 data:4,
16 x 2048) one-layer units overstated the whole compile's estimated step by 2.7% and its
bytes by 2.9%, three-layer units by 0.4% and 0.5% (benchmarks/RESULTS.md). A preset whose depth
is not a multiple of its unit (the 7B ones: 32 layers) is cut to its remainder plus one
and plus two units, so the extra layers keep their own block types. `--validate` compiles
presets whose whole depth fits this host as well and reports the extrapolation's error
against the whole compile.

Every compile runs in a child process whose resident memory is watched (`--max_rss_gb`:
killed above it, the point recorded as missing with the reason) and each result is saved
to `--output` as it comes, so an interrupted run resumes where it stopped. The figures are
the compiler's estimates on a chip nobody ran: deterministic, not timings.
"""
from __future__ import annotations

from plumbing import quiet
quiet.setup()  # first, before JAX or TensorFlow load: see plumbing/quiet.py
# pylint: disable=wrong-import-position
import dataclasses
import datetime
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional, Sequence

from absl import flags

from plumbing import cli
from plumbing.errors import usage_error

FLAGS = flags.FLAGS
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ("griffin", "hawk", "mqa")
# Each size's slice and mesh: four-way batch parallelism everywhere (data or FSDP), so the
# same global batch gives every chip the same tokens; tensor parallelism only for 7B.
DEFAULT_MESHES = {"100m": ("v5p-8", "data:4"), "400m": ("v5p-8", "data:4"),
                  "1_3b": ("v5p-8", "fsdp:4"), "7b": ("v5p-16", "fsdp:4,tensor:2")}
# The affine quantities: extrapolated in depth from the one- and two-unit compiles.
AFFINE = ("estimated_seconds", "bytes_accessed", "compiled_flops", "model_flops",
          "peak_bytes")


def define_flags() -> None:
  """Defined on demand, so that importing the module (tests do) claims no flag names."""
  flags.DEFINE_list("unit_layers", ["griffin=3", "hawk=3", "mqa=3"], "FAMILY=LAYERS of "
                    "one unit (a preset's family is its file name up to the first '_'; "
                    "other families: 3).")
  flags.DEFINE_list("families", list(FAMILIES),
                    "Model families (configs/models/FAMILY_SIZE.gin).")
  flags.DEFINE_list("sizes", ["400m", "1_3b", "7b"], "Preset sizes.")
  flags.DEFINE_list("sequence_lengths", ["2048", "4096", "8192"], "Tokens per sequence.")
  flags.DEFINE_integer("tokens_per_batch", 32768, "Global tokens per step, fixed across "
                       "sequence lengths (batch = tokens_per_batch / sequence length).")
  flags.DEFINE_list("validate", ["griffin_100m", "mqa_100m"], "Presets compiled whole as "
                    "well, at the first sequence length on the 100m mesh, to measure the "
                    "extrapolation's error (empty: none).")
  flags.DEFINE_multi_string("mesh_for", [], "SIZE=TOPOLOGY/MESH overriding a size's slice, "
                            "e.g. 7b=v5p-16/fsdp:4,tensor:2.")
  flags.DEFINE_string("preset_dir", "configs/models", "Where FAMILY_SIZE.gin presets live.")
  flags.DEFINE_string("output", "benchmarks/results/tpu_figure3.json",
                      "JSON of every compile and point; read back to resume.")
  flags.DEFINE_string("plot", "docs/figures/tpu_figure3.png", "Plot path (empty: none).")
  flags.DEFINE_float("max_rss_gb", 10.0, "Kill a compile whose resident memory passes this.")
  flags.DEFINE_integer("compile_timeout_s", 7200, "Kill a compile running longer (wall).")
  flags.DEFINE_bool("retry_failed", False, "Compile again the points recorded as failed.")
  flags.DEFINE_bool("report_only", False, "Compile nothing: table and plot from --output.")


# -- the arithmetic ---------------------------------------------------------------------

def compile_depths(depth: int, unit_layers: int) -> tuple[int, int, float]:
  """(depth of the one-unit compile, of the two-unit compile, units n of the preset):
  the preset's remainder layers are kept in both compiles, so cost(n) needs no guess
  about their block types."""
  remainder = depth % unit_layers
  units = (depth - remainder) // unit_layers
  if units < 1:
    raise ValueError(f"depth {depth} is shorter than one unit of {unit_layers} layers")
  return remainder + unit_layers, remainder + 2 * unit_layers, float(units)


def extrapolate(one: float, two: float, units: float) -> float:
  """cost(n) of a step affine in its units, from cost(1) and cost(2)."""
  return one + (units - 1.0) * (two - one)


def relative_error(estimate: float, truth: float) -> float:
  return estimate / truth - 1.0


# -- compiling ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Shape:
  """One compile: a preset cut to `depth` layers, on a slice and mesh, at a batch."""
  preset: str
  topology: str
  mesh: str
  batch: int
  sequence_length: int
  depth: int

  @property
  def key(self) -> str:
    return (f"{os.path.basename(self.preset)}|{self.topology}|{self.mesh}|"
            f"{self.batch}x{self.sequence_length}|depth={self.depth}")

  def command(self) -> list[str]:
    params = {"BATCH_SIZE": self.batch, "SEQUENCE_LENGTH": self.sequence_length,
              "ModelConfig.depth": self.depth,
              # Unroll every unit (the depth loop's body would count once) ...
              "ModelConfig.depth_scan_unroll": self.depth,
              # ... and form the loss in one piece (the chunk loop is a loop too).
              "TrainConfig.loss_chunks": 1}
    return [sys.executable, "-m", "pretrain.compile", f"--topology={self.topology}",
            f"--gin_file={self.preset}", f"--mesh={self.mesh}", "--json",
            *(f"--gin_param={name}={value}" for name, value in params.items())]


def _rss_bytes(pid: int) -> int:
  try:
    with open(f"/proc/{pid}/status") as status:
      for line in status:
        if line.startswith("VmRSS:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return 0


def run_compile(shape: Shape, max_rss_bytes: float, timeout_s: float) -> dict[str, Any]:
  """`pretrain.compile --json` of one shape in a child process: its report plus the
  child's peak resident memory and wall time, or {"error": why} when it failed or was
  stopped for memory or time. A child keeps the compiler's memory out of this process
  and lets the kernel report its own peak (`wait4`'s ru_maxrss)."""
  with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
    start = time.perf_counter()
    child = subprocess.Popen(shape.command(), cwd=REPO_ROOT, stdout=out, stderr=err)
    stopped, watched_peak = None, 0
    while True:
      pid, status, usage = os.wait4(child.pid, os.WNOHANG)
      if pid:
        break
      watched_peak = max(watched_peak, _rss_bytes(child.pid))
      if stopped is None and watched_peak > max_rss_bytes:
        stopped = f"host memory passed {max_rss_bytes / 2**30:.1f} GiB"
        os.kill(child.pid, signal.SIGKILL)
      elif stopped is None and time.perf_counter() - start > timeout_s:
        stopped = f"ran past {timeout_s:.0f} s of wall time"
        os.kill(child.pid, signal.SIGKILL)
      time.sleep(1.0)
    child.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    peak = max(usage.ru_maxrss * 1024, watched_peak)
    out.seek(0)
    err.seek(0)
    lines = [line for line in out.read().splitlines() if line.startswith("{")]
    if stopped or not lines:
      why = stopped or f"exit {child.returncode}: {err.read()[-600:]}"
      return {"error": why, "host_peak_bytes": peak, "wall_seconds": wall}
  # The load average as it ended says how shared the host was (wall/CPU seconds).
  return {**json.loads(lines[-1]), "host_peak_bytes": peak, "wall_seconds": wall,
          "load_average": list(os.getloadavg())}


# -- points ------------------------------------------------------------------------------

def preset_path(name: str, preset_dir: str) -> str:
  path = name if name.endswith(".gin") else os.path.join(preset_dir, f"{name}.gin")
  if not os.path.exists(os.path.join(REPO_ROOT, path)):
    raise usage_error(f"no preset {path}")
  return path


def preset_depth(path: str) -> int:
  """ModelConfig.depth as the preset binds it (every preset here binds it directly)."""
  with open(os.path.join(REPO_ROOT, path)) as preset:
    found = re.findall(r"^ModelConfig\.depth\s*=\s*(\d+)", preset.read(), re.M)
  if not found:
    raise usage_error(f"{path} binds no ModelConfig.depth")
  return int(found[-1])


def point_from_compiles(one: dict[str, Any], two: dict[str, Any], units: float
                        ) -> dict[str, Any]:
  """The whole-depth estimate of one point from its one- and two-unit reports."""
  point = {name: (None if one.get(name) is None or two.get(name) is None
                  else extrapolate(one[name], two[name], units)) for name in AFFINE}
  devices, tokens = one["devices"], one["batch_size"] * one["sequence_length"]
  seconds = point["estimated_seconds"]
  point.update(
      units=units, devices=devices, tokens=tokens, hbm_bytes=one["hbm_bytes"],
      while_loops=max(one["while_loops"], two["while_loops"]),
      bytes_per_token=(None if point["bytes_accessed"] is None
                       else point["bytes_accessed"] * devices / tokens),
      estimated_mfu=(None if not seconds or not one.get("peak_flops") else
                     point["model_flops"] / (seconds * one["peak_flops"] * devices)),
      compile_cpu_seconds=one["compile_cpu_seconds"] + two["compile_cpu_seconds"],
      host_peak_bytes=max(one["host_peak_bytes"], two["host_peak_bytes"]))
  return point


class Study:
  """The compiles done so far (saved after each) and the points they give."""

  def __init__(self, path: str, max_rss_bytes: float, timeout_s: float,
               retry_failed: bool, unit_layers: dict[str, int]):
    self.path, self.max_rss_bytes, self.timeout_s = path, max_rss_bytes, timeout_s
    self.unit_layers = unit_layers
    self.data: dict[str, Any] = {"compiles": {}}
    if os.path.exists(path):
      with open(path) as saved:
        self.data = json.load(saved)
    if retry_failed:
      self.data["compiles"] = {key: value for key, value in self.data["compiles"].items()
                               if "error" not in value}

  def save(self) -> None:
    os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
    with open(self.path + ".tmp", "w") as out:
      json.dump(self.data, out, indent=1, sort_keys=True)
    os.replace(self.path + ".tmp", self.path)

  def compile(self, shape: Shape, compile_missing: bool = True) -> Optional[dict[str, Any]]:
    """The shape's saved result, compiling it first where it is new."""
    compiles = self.data["compiles"]
    if shape.key not in compiles:
      if not compile_missing:
        return None
      print(f"[{time.strftime('%H:%M:%S')}] compiling {shape.key}", file=sys.stderr,
            flush=True)
      compiles[shape.key] = run_compile(shape, self.max_rss_bytes, self.timeout_s)
      self.save()
      result = compiles[shape.key]
      print(f"  -> {result.get('error') or 'ok'}: cpu "
            f"{result.get('compile_cpu_seconds', float('nan')):.0f} s, wall "
            f"{result['wall_seconds']:.0f} s, host peak "
            f"{result['host_peak_bytes'] / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    return compiles[shape.key]

  def point(self, preset: str, topology: str, mesh: str, batch: int, seq: int,
            compile_missing: bool = True) -> dict[str, Any]:
    """The extrapolated point, or {"missing": why}."""
    depth = preset_depth(preset)
    family = os.path.basename(preset).split("_")[0]
    one_depth, two_depth, units = compile_depths(depth, self.unit_layers.get(family, 3))
    results = []
    for cut in (one_depth, two_depth):
      result = self.compile(Shape(preset, topology, mesh, batch, seq, cut), compile_missing)
      if result is None:
        return {"missing": "not compiled"}
      if "error" in result:
        return {"missing": f"depth {cut}: {result['error']}"}
      results.append(result)
    return {**point_from_compiles(*results, units), "depth": depth,
            "compile_depths": [one_depth, two_depth]}

  def validation(self, preset: str, topology: str, mesh: str, batch: int, seq: int,
                 compile_missing: bool = True) -> dict[str, Any]:
    """Extrapolated against whole-depth figures of a preset small enough to compile."""
    point = self.point(preset, topology, mesh, batch, seq, compile_missing)
    whole = self.compile(Shape(preset, topology, mesh, batch, seq, preset_depth(preset)),
                         compile_missing)
    if "missing" in point or whole is None or "error" in whole:
      return {"missing": point.get("missing") or (whole or {}).get("error", "not compiled")}
    errors = {name: relative_error(point[name], whole[name])
              for name in ("estimated_seconds", "bytes_accessed", "compiled_flops",
                           "model_flops") if point[name] is not None and whole[name]}
    return {"extrapolated": {name: point[name] for name in errors},
            "whole": {name: whole[name] for name in errors}, "relative_error": errors,
            "whole_compile_cpu_seconds": whole["compile_cpu_seconds"],
            "whole_host_peak_bytes": whole["host_peak_bytes"],
            "while_loops": max(point["while_loops"], whole["while_loops"])}


# -- output ------------------------------------------------------------------------------

def add_relative(points: list[dict[str, Any]]) -> None:
  """Each point's estimated step over MQA's at the shortest sequence of its size."""
  for point in points:
    base = [p for p in points if p["family"] == "mqa" and p["size"] == point["size"]
            and "missing" not in p]
    base = min(base, key=lambda p: p["sequence_length"], default=None)
    if "missing" in point or base is None or not base["estimated_seconds"]:
      point["relative_to_mqa"] = None
    else:
      point["relative_to_mqa"] = point["estimated_seconds"] / base["estimated_seconds"]


def markdown_table(points: list[dict[str, Any]]) -> str:
  rows = ["| family | size | slice, mesh | batch x T | est. step ms | vs MQA at shortest T "
          "| HBM MB per token | est. MFU | layers compiled | compile CPU s | host peak GiB |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
  for p in points:
    head = (f"| {p['family']} | {p['size']} | {p['topology']} {p['mesh']} | "
            f"{p['batch']} x {p['sequence_length']} |")
    if "missing" in p:
      rows.append(f"{head} missing: {p['missing'][:120]} | | | | | | |")
      continue
    relative = "n/a" if p["relative_to_mqa"] is None else f"{p['relative_to_mqa']:.3f}"
    mfu = "n/a" if p["estimated_mfu"] is None else f"{100 * p['estimated_mfu']:.1f}%"
    rows.append(f"{head} {1e3 * p['estimated_seconds']:.2f} | {relative} | "
                f"{p['bytes_per_token'] / 1e6:.3f} | {mfu} | "
                f"{' + '.join(map(str, p['compile_depths']))} of {p['depth']} | "
                f"{p['compile_cpu_seconds']:.0f} | {p['host_peak_bytes'] / 2**30:.2f} |")
  return "\n".join(rows)


def validation_table(validations: dict[str, dict[str, Any]]) -> str:
  rows = ["| preset | est. step ms, extrapolated / whole | error | HBM GB/chip, "
          "extrapolated / whole | error | compiled FLOPs error | while loops |",
          "|---|---|---|---|---|---|---|"]
  for name, v in validations.items():
    if "missing" in v:
      rows.append(f"| {name} | missing: {v['missing'][:120]} | | | | | |")
      continue
    e, w, err = v["extrapolated"], v["whole"], v["relative_error"]
    flops = ("n/a" if "compiled_flops" not in err else f"{100 * err['compiled_flops']:+.3f}%")
    rows.append(f"| {name} | {1e3 * e['estimated_seconds']:.2f} / "
                f"{1e3 * w['estimated_seconds']:.2f} | {100 * err['estimated_seconds']:+.3f}% | "
                f"{e['bytes_accessed'] / 1e9:.2f} / {w['bytes_accessed'] / 1e9:.2f} | "
                f"{100 * err['bytes_accessed']:+.3f}% | {flops} | {v['while_loops']} |")
  return "\n".join(rows)


def plot(points: list[dict[str, Any]], path: str) -> None:
  """Estimated step over MQA's at the shortest sequence, per size, beside the paper's
  qualitative trend (Fig. 3: Griffin about MQA's time at 2K and flat; MQA rising)."""
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  sizes = list(dict.fromkeys(p["size"] for p in points    # sizes with a point to draw
                             if p.get("relative_to_mqa") is not None))
  figure, axes = plt.subplots(1, max(len(sizes), 1), figsize=(max(4.5 * len(sizes), 7.5), 4.5),
                              sharey=True, squeeze=False)
  styles = {"griffin": ("C0", "o"), "hawk": ("C2", "s"), "mqa": ("C3", "^")}
  for axis, size in zip(axes[0], sizes):
    lengths = sorted({p["sequence_length"] for p in points if p["size"] == size})
    for family in dict.fromkeys(p["family"] for p in points):
      done = sorted((p["sequence_length"], p["relative_to_mqa"]) for p in points
                    if p["size"] == size and p["family"] == family
                    and p.get("relative_to_mqa") is not None)
      if done:
        color, marker = styles.get(family, ("k", "x"))
        axis.plot(*zip(*done), color=color, marker=marker, label=f"{family} (libtpu est.)")
    axis.axhline(1.0, color="grey", linestyle=":", linewidth=1.5,
                 label="paper Fig. 3, qualitative:\nGriffin ~ MQA at 2K, flat in T")
    if len(lengths) > 1:  # the paper's MQA curve, as a direction only (no numbers)
      axis.annotate("paper Fig. 3, qualitative:\nMQA rises with T", xy=(0.93, 0.45),
                    xytext=(0.55, 0.12), xycoords="axes fraction", color="grey",
                    fontsize=7, arrowprops={"arrowstyle": "->", "color": "grey",
                                            "linestyle": "--", "linewidth": 1.5})
    axis.set_xscale("log", base=2)
    axis.set_xticks(lengths, [f"{n // 1024}K" if n >= 1024 else str(n) for n in lengths])
    axis.set_title(size.replace("_", ".").upper())
    axis.set_xlabel("sequence length (tokens per batch fixed)")
    axis.grid(alpha=0.3)
  axes[0][0].set_ylabel("estimated step / MQA's at shortest T")
  axes[0][0].legend(fontsize=7, loc="upper left")
  figure.suptitle("Training step time vs sequence length: XLA:TPU cost model (v5p), "
                  "not a measurement", fontsize=10)
  figure.tight_layout()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  figure.savefig(path, dpi=120)


def _environment() -> dict[str, Any]:
  def version(name):
    try:
      return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      return None
  return {"libtpu": version("libtpu"), "jax": version("jax"),
          "load_average": list(os.getloadavg()), "cpus": os.cpu_count(),
          "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _positive_ints(name: str, values: Sequence[str]) -> list[int]:
  if not values or not all(v.isdigit() and int(v) > 0 for v in values):
    raise usage_error(f"--{name} must be positive integers, got {list(values)}")
  return [int(v) for v in values]


def _unit_layers(values: Sequence[str]) -> dict[str, int]:
  units = {}
  for value in values:
    family, _, layers = value.partition("=")
    if not (family and layers.isdigit() and int(layers) > 0):
      raise usage_error(f"--unit_layers must read FAMILY=LAYERS, got {value!r}")
    units[family] = int(layers)
  return units


def _meshes(overrides: Sequence[str]) -> dict[str, tuple[str, str]]:
  meshes = dict(DEFAULT_MESHES)
  for override in overrides:
    size, _, target = override.partition("=")
    topology, _, mesh = target.partition("/")
    if not (size and topology and mesh):
      raise usage_error(f"--mesh_for must read SIZE=TOPOLOGY/MESH, got {override!r}")
    meshes[size] = (topology, mesh)
  return meshes


def main(argv: Sequence[str]) -> None:
  cli.reject_extra_arguments(argv)
  lengths = _positive_ints("sequence_lengths", FLAGS.sequence_lengths)
  meshes = _meshes(FLAGS.mesh_for)
  for family in FLAGS.families:
    if family not in FAMILIES:
      raise usage_error(f"--families takes {', '.join(FAMILIES)}; got {family!r}")
  for size in FLAGS.sizes:
    if size not in meshes:
      raise usage_error(f"--sizes: no slice for {size!r}; add --mesh_for={size}=T/MESH")
  for n in lengths:
    if FLAGS.tokens_per_batch % n:
      raise usage_error(f"--sequence_lengths: {n} does not divide --tokens_per_batch")
  grid = [(f, s, preset_path(f"{f}_{s}", FLAGS.preset_dir), n)
          for s in FLAGS.sizes for n in lengths for f in FLAGS.families]
  checks = [(name, preset_path(name, FLAGS.preset_dir)) for name in FLAGS.validate if name]
  study = Study(os.path.join(REPO_ROOT, FLAGS.output), FLAGS.max_rss_gb * 2**30,
                FLAGS.compile_timeout_s, FLAGS.retry_failed, _unit_layers(FLAGS.unit_layers))
  study.data.setdefault("environment_at_start", _environment())
  compile_missing = not FLAGS.report_only
  validations = {}
  for name, preset in checks:
    topology, mesh = meshes["100m"]
    validations[name] = {
        "preset": name, "topology": topology, "mesh": mesh,
        "batch": FLAGS.tokens_per_batch // lengths[0], "sequence_length": lengths[0],
        **study.validation(preset, topology, mesh, FLAGS.tokens_per_batch // lengths[0],
                           lengths[0], compile_missing)}
  points = []
  for family, size, preset, n in grid:
    topology, mesh = meshes[size]
    batch = FLAGS.tokens_per_batch // n
    points.append({"family": family, "size": size, "preset": preset,
                   "topology": topology, "mesh": mesh, "batch": batch,
                   "sequence_length": n,
                   **study.point(preset, topology, mesh, batch, n, compile_missing)})
  add_relative(points)
  study.data.update(points=points, validation=validations, unit_layers=study.unit_layers,
                    environment_at_end=_environment(),
                    tokens_per_batch=FLAGS.tokens_per_batch)
  study.save()
  print(f"libtpu {study.data['environment_at_end']['libtpu']}; XLA:TPU cost-model "
        "estimates, depth extrapolated from one- and two-unit compiles (units of "
        f"{', '.join(f'{f}: {n} layer(s)' for f, n in study.unit_layers.items())}; "
        "not measurements)\n")
  print(markdown_table(points))
  if validations:
    print("\nExtrapolated against the whole-depth compile:\n")
    print(validation_table(validations))
  if FLAGS.plot and any(p.get("relative_to_mqa") is not None for p in points):
    plot(points, os.path.join(REPO_ROOT, FLAGS.plot))


if __name__ == "__main__":
  define_flags()
  cli.run(main)
