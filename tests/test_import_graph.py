"""The layering holds: plumbing -> sharding -> model -> pretrain -> launch, each package
importing only from its own layer and those below; inside `model`, `pretrain` and
`launch` the wings keep their order too (docs/INTERNALS.md draws both); no import cycle anywhere,
imports inside functions included; imports inside functions only for optional
dependencies; the `python -m` commands are thin modules that no library imports;
`plumbing.quiet` set up by each package's `__init__`, never by importing it."""
import ast
import os

import pytest

from trainer_helpers import last_line_of_fresh_python

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = ("plumbing", "sharding", "model", "pretrain", "launch")   # lowest first
# Imports that may stay inside functions: optional dependencies a command can run without,
# and the repository's modules that need them. The Pallas kernels and backends load only
# when a scan runs on impl="pallas" (a backend may be missing from a JAX build), JAX's
# fused attention kernels only when a training call runs one; plotting
# only where a plot is written; the `hf` extra's packages only where a Hugging Face model
# or tokenizer is written or read; lm_eval (the `eval` extra, and the backend that
# subclasses its LM) only where downstream tasks run; the GCS emulator (the `test` extra)
# only where one is served; W&B and MLflow (the `wandb` and `mlflow` extras) only in the
# trackers that send to them, once a run opens them.
OPTIONAL_INSIDE_FUNCTIONS = {"wandb", "mlflow.entities", "mlflow.exceptions",
                             "mlflow.tracking", "mlflow.utils.validation",
                             "gcp_storage_emulator", "gcp_storage_emulator.handlers",
                             "matplotlib", "matplotlib.pyplot", "jax.experimental.pallas",
                             "model.scan.pallas_scan", "model.scan.pallas_compat",
                             "model.scan.pallas_lookback", "safetensors.numpy",
                             "jax.experimental.pallas.ops.tpu.splash_attention",
                             "jax.experimental.pallas.ops.gpu",
                             "tokenizers", "transformers",
                             "transformers.tokenization_utils_base", "sentencepiece",
                             "lm_eval", "lm_eval.tasks", "pretrain.evaluation.lm_eval_backend"}
# `plumbing.quiet` imports JAX only once its filter is in place, and only on a host
# where JAX's platform must be chosen (see its docstring).
AFTER_QUIET_SET_UP = {"plumbing.quiet": {"jax", "jax._src"}}


def _modules():
  for package in LAYERS:
    for directory, _, files in os.walk(os.path.join(REPO, package)):
      for name in files:
        if name.endswith(".py"):
          path = os.path.join(directory, name)
          module = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
          yield module.removesuffix(".__init__"), path


MODULES = dict(_modules())


def _parse(path):
  with open(path, encoding="utf-8") as f:
    return ast.parse(f.read())


def _targets(node):
  """The modules an import statement loads: `from package import submodule` loads the
  submodule; `from module import name` and `import module` the module."""
  if isinstance(node, ast.Import):
    return [alias.name for alias in node.names]
  if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
    submodules = [f"{node.module}.{alias.name}" for alias in node.names
                  if f"{node.module}.{alias.name}" in MODULES]
    return submodules or [node.module]
  return []


def _graph():
  """Every module of the layers -> the repository modules it imports, anywhere."""
  graph = {}
  for module, path in MODULES.items():
    targets = {target for node in ast.walk(_parse(path)) for target in _targets(node)}
    graph[module] = {t for t in targets if t in MODULES and t != module}
  return graph


def _layer(module):
  return LAYERS.index(module.split(".")[0])


def _upward(graph):
  """Imports from a lower layer into a higher one, as "importer -> imported"."""
  return sorted(f"{module} -> {target}" for module, targets in graph.items()
                for target in targets if _layer(target) > _layer(module))


def _cycle(graph):
  """One import cycle as a list of modules, or None."""
  state = {}

  def visit(module, stack):
    state[module] = "open"
    for target in sorted(graph.get(module, ())):
      if state.get(target) == "open":
        return stack[stack.index(target):] + [target]
      if target not in state:
        found = visit(target, stack + [target])
        if found:
          return found
    state[module] = "done"
    return None

  for module in sorted(graph):
    if module not in state:
      found = visit(module, [module])
      if found:
        return found
  return None


# The wings of `pretrain`, lowest first: a module imports only from its own wing and the
# wings before it. Wings in one tuple are peers: neither imports the other. The centre
# is in two halves: the step and its parts below the wings, the trainer and its Gin
# loader above them. A module belongs to the first entry that names it or a package
# above it; the commands (every module with a `__main__` block) sit on top.
PRETRAIN_WINGS = (
    {"data": ("pretrain.data",)},
    {"centre: the step": ("pretrain", "pretrain.runtime", "pretrain.losses", "pretrain.steps",
                          "pretrain.optimizer", "pretrain.extras", "pretrain.hook_interface",
                          "pretrain.run_directory")},
    {"checkpoints": ("pretrain.checkpoints",)},
    {"observability": ("pretrain.observability",)},
    {"evaluation": ("pretrain.evaluation",), "interchange": ("pretrain.interchange",)},
    {"centre: the trainer": ("pretrain.train_config", "pretrain.trainer", "pretrain.hooks",
                             "pretrain.gin_config")},
    {"compilation": ("pretrain.compilation",)},
)
PRETRAIN_COMMANDS = ("pretrain.train", "pretrain.evaluate", "pretrain.sample",
                     "pretrain.convert", "pretrain.export", "pretrain.tokenizer",
                     "pretrain.summary", "pretrain.compile", "pretrain.report",
                     "pretrain.extrapolation", "pretrain.data.prepare")


# The wings of `launch`, in the same way, each one package on one floor
# (`test_each_launch_wing_is_one_package`): the contract between a study and the backends
# that run it (the dispatcher's registry and run states, and the wrapper every run
# starts through) below the cluster launchers, whose modules each also define their
# sweep backend; the study's design, execution and results above them.
LAUNCH_WINGS = (
    {"the package": ("launch",)},
    {"faults": ("launch.faults",), "scaling": ("launch.scaling",),
     "dispatch": ("launch.dispatch",)},
    {"clusters": ("launch.clusters",)},
    {"sweeps": ("launch.sweeps",)},
)
LAUNCH_COMMANDS = ("launch.local", "launch.slurm", "launch.gke", "launch.tpu_vm",
                   "launch.sweep", "launch.sweep_job", "launch.fork", "launch.scaling_fit",
                   "launch.chaos", "launch.gcs_emulator")
# The wings of `model`, in the same way. The centre holds what every block shares (the
# config and registry, the logical axes, the scan engine and the pieces two blocks use,
# the residual block, the language model, decoding); each built-in block is one package
# on the row above, a peer of the others and of the tools that count, plan and export
# through the registry's optional capabilities without knowing any block (nor any block
# them). The package's `__init__` and `model.blocks`, which register the built-ins, top it.
MODEL_WINGS = (
    {"centre": ("model.config", "model.attention_options", "model.block_registry",
                "model.partitioning", "model.scan",
                "model.recurrence", "model.time_shift", "model.rope", "model.norms",
                "model.mlp", "model.parametrization", "model.embedder", "model.residual_block",
                "model.lm",
                "model.decoding")},
    {"recurrent": ("model.blocks.recurrent",), "attention": ("model.blocks.attention",),
     "gateloop": ("model.blocks.gateloop",),
     "tools": ("model.counting", "model.memory", "model.hf_params",
               "model.recurrentgemma_params")},
    {"registration": ("model", "model.blocks")},
)
WINGS = {"pretrain": (PRETRAIN_WINGS, PRETRAIN_COMMANDS),
         "launch": (LAUNCH_WINGS, LAUNCH_COMMANDS),
         "model": (MODEL_WINGS, ())}


def _is_command(module):
  source = open(MODULES[module], encoding="utf-8").read()
  return '__name__ == "__main__"' in source


def _wing(module):
  """(rank, wing) of a `pretrain` or `launch` module: its wing's place in its package's
  wings and the wing's name (the commands rank above every wing)."""
  package = module.split(".")[0]
  wings, commands = WINGS[package]
  if module in commands:
    return len(wings), module
  for rank, peers in enumerate(wings):
    for wing, packages in peers.items():
      for prefix in packages:
        if module == prefix or (prefix != package and module.startswith(prefix + ".")):
          return rank, wing
  raise AssertionError(f"{module} is in no wing of {package}; add it to one")


def _across_wings(graph, wing_of):
  """Imports of a wing from a wing that is not below it, as "importer -> imported"."""
  bad = []
  for module, targets in graph.items():
    if wing_of(module) is None:
      continue
    for target in targets:
      if wing_of(target) is None:
        continue
      (rank, wing), (target_rank, target_wing) = wing_of(module), wing_of(target)
      if wing != target_wing and target_rank >= rank:
        bad.append(f"{module} -> {target}")
  return sorted(bad)


def _pretrain_wing(module):
  return _wing(module) if module.split(".")[0] == "pretrain" else None


def _launch_wing(module):
  return _wing(module) if module.split(".")[0] == "launch" else None


def _model_wing(module):
  return _wing(module) if module.split(".")[0] == "model" else None


@pytest.mark.parametrize("wing_of", [_pretrain_wing, _launch_wing, _model_wing])
def test_wings_keep_their_order(wing_of):
  bad = _across_wings(_graph(), wing_of)
  assert not bad, "imports against the order of the wings: " + ", ".join(bad)


@pytest.mark.parametrize("package", sorted(WINGS))
def test_every_module_is_in_a_wing(package):
  for module in MODULES:
    if module.split(".")[0] == package:
      _wing(module)


@pytest.mark.parametrize("package", sorted(WINGS))
def test_commands_are_the_modules_with_a_main_and_nothing_imports_them(package):
  """A `python -m` command is a thin module (flags, main); no library doubles as one."""
  commands = WINGS[package][1]
  assert {m for m in MODULES if m.split(".")[0] == package and _is_command(m)} == set(commands)
  importers = sorted(f"{module} -> {target}" for module, targets in _graph().items()
                     for target in targets if target in commands)
  assert not importers, "a library imports a command: " + ", ".join(importers)


def test_each_launch_wing_is_one_package():
  """Every folder of `launch/` is one wing on one floor, named by that package alone,
  so that no wing sits both below and above another."""
  packages = sorted(module for module, path in MODULES.items()
                    if module.count(".") == 1 and module.startswith("launch.")
                    and path.endswith("__init__.py"))
  named = [prefix for peers in LAUNCH_WINGS for prefixes in peers.values()
           for prefix in prefixes]
  assert sorted(named) == ["launch", *packages], named
  assert all(len(prefixes) == 1 for peers in LAUNCH_WINGS for prefixes in peers.values())


def test_the_wing_check_finds_what_it_looks_for():
  assert _across_wings({"pretrain.checkpoints.loading": {"pretrain.trainer"}},
                       _pretrain_wing) == ["pretrain.checkpoints.loading -> pretrain.trainer"]
  assert _across_wings({"pretrain.evaluation.loss": {"pretrain.interchange.hf_import"}},
                       _pretrain_wing) == ["pretrain.evaluation.loss -> pretrain.interchange.hf_import"]
  assert _across_wings({"pretrain.trainer": {"pretrain.checkpoints.loading"},
                        "pretrain.export": {"pretrain.interchange.hf_export"}},
                       _pretrain_wing) == []
  assert _across_wings({"launch.clusters.slurm": {"launch.sweeps.sweep_execute"},
                        "launch.dispatch.sweep_dispatch": {"launch.clusters.gke",
                                                           "launch.scaling.scaling_fit"},
                        "launch.sweeps.sweep_execute": {"launch.clusters.slurm"}},
                       _launch_wing) == [
      "launch.clusters.slurm -> launch.sweeps.sweep_execute",
      "launch.dispatch.sweep_dispatch -> launch.clusters.gke",
      "launch.dispatch.sweep_dispatch -> launch.scaling.scaling_fit"]
  assert _across_wings({"model.blocks.attention.spec": {"model.memory",
                                                        "model.blocks.recurrent.layer"},
                        "model.lm": {"model.blocks.recurrent.layer"},
                        "model.memory": {"model.counting", "model.block_registry"}},
                       _model_wing) == ["model.blocks.attention.spec -> model.blocks.recurrent.layer",
                                        "model.blocks.attention.spec -> model.memory",
                                        "model.lm -> model.blocks.recurrent.layer"]


def test_no_import_runs_up_a_layer():
  assert not _upward(_graph()), "imports into a higher layer: " + ", ".join(_upward(_graph()))


def test_no_import_cycle():
  cycle = _cycle(_graph())
  assert cycle is None, " -> ".join(cycle)


def test_the_checks_find_what_they_look_for():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b"}, "b": set()}) is None
  assert _upward({"model.lm": {"pretrain.train", "sharding.mesh"}}) == [
      "model.lm -> pretrain.train"]


@pytest.mark.parametrize("package", LAYERS)
def test_imports_at_module_top(package):
  offenders = []
  for module, path in MODULES.items():
    if module.split(".")[0] != package:
      continue
    allowed = OPTIONAL_INSIDE_FUNCTIONS | AFTER_QUIET_SET_UP.get(module, set())
    for function in ast.walk(_parse(path)):
      if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for node in ast.walk(function):
          offenders += [f"{module}:{node.lineno} {name}" for name in _targets(node)
                        if name not in allowed]
  assert not offenders, "imports inside functions: " + ", ".join(offenders)


def _calls_quiet_setup_first(tree):
  """Whether the module's first statement after its docstring and `from plumbing import
  quiet` is `quiet.setup()`."""
  body = [node for node in tree.body
          if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
  return (len(body) >= 2 and ast.unparse(body[0]) == "from plumbing import quiet"
          and ast.unparse(body[1]) == "quiet.setup()")


@pytest.mark.parametrize("package", LAYERS[1:])
def test_each_package_sets_up_quiet_first(package):
  assert _calls_quiet_setup_first(_parse(MODULES[package]))


def test_quiet_is_used_only_by_the_packages_and_the_command_runner():
  """Its effect comes from `setup()`, called by the package `__init__`s (and scripts run
  as files): no module imports it for a side effect. The trainer calls
  `keep_client_logs` when it knows its workdir, and the downstream tasks' loading sends
  the Hub clients' records to that log (`route_to_client_log`)."""
  users = sorted(module for module, path in MODULES.items()
                 if "plumbing.quiet" in {t for node in ast.walk(_parse(path))
                                         for t in _targets(node)})
  assert users == ["launch", "model", "plumbing.cli", "pretrain",
                   "pretrain.evaluation.downstream", "pretrain.trainer", "sharding"]


def test_importing_quiet_changes_nothing():
  script = ("import os, sys\n"
            "before = (list(sys.meta_path), os.environ.get('TF_CPP_MIN_LOG_LEVEL'), "
            "os.readlink('/proc/self/fd/2'))\n"
            "from plumbing import quiet\n"
            "after = (list(sys.meta_path), os.environ.get('TF_CPP_MIN_LOG_LEVEL'), "
            "os.readlink('/proc/self/fd/2'))\n"
            "print(before == after, 'jax' in sys.modules)\n")
  env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
  assert last_line_of_fresh_python(script, env=env).split() == ["True", "False"]


@pytest.mark.slow   # fast tier under 5 min: fresh interpreters per entry point (10 s)
def test_entry_points_load_tensorflow_only_when_data_is_read():
  """SeqIO and TensorFlow cost about 6 s to import; parsing configs, `--help`, memory
  planning, compiling for TPU and launching must not pay it. Nor lm_eval, which loads
  only where downstream tasks run."""
  entry_points = ["pretrain.train", "pretrain.evaluate", "pretrain.sample",
                  "pretrain.convert", "pretrain.compile", "pretrain.extrapolation",
                  "pretrain.summary", "launch.sweep", "launch.local", "pretrain.export",
                  "pretrain.report", "pretrain.tokenizer"]
  script = ("import importlib, sys\n"
            f"for name in {entry_points!r}: importlib.import_module(name)\n"
            "print(sorted(m for m in ('seqio', 'tensorflow', 'lm_eval') "
            "if m in sys.modules))\n")
  assert last_line_of_fresh_python(script) == "[]"
