"""The layering holds: plumbing -> sharding -> model -> pretrain -> launch, each package
importing only from its own layer and those below; no import cycle anywhere, imports
inside functions included; imports inside functions only for optional dependencies;
`plumbing.quiet` set up by each package's `__init__`, never by importing it."""
import ast
import os

import pytest

from trainer_helpers import last_line_of_fresh_python

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = ("plumbing", "sharding", "model", "pretrain", "launch")   # lowest first
# Imports that may stay inside functions: optional dependencies a command can run without,
# and the repository's modules that need them. The Pallas kernels and backends load only
# when a scan runs on impl="pallas" (a backend may be missing from a JAX build); plotting
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
                             "tokenizers", "transformers",
                             "transformers.tokenization_utils_base", "sentencepiece",
                             "lm_eval", "lm_eval.tasks", "pretrain.lm_eval_backend"}
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
  as files): no module imports it for a side effect."""
  users = sorted(module for module, path in MODULES.items()
                 if "plumbing.quiet" in {t for node in ast.walk(_parse(path))
                                         for t in _targets(node)})
  assert users == ["launch", "model", "plumbing.cli", "pretrain", "sharding"]


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


def test_entry_points_load_tensorflow_only_when_data_is_read():
  """SeqIO and TensorFlow cost about 6 s to import; parsing configs, `--help`, memory
  planning, compiling for TPU and launching must not pay it. Nor lm_eval, which loads
  only where downstream tasks run."""
  entry_points = ["pretrain.train", "pretrain.evaluate", "pretrain.sample",
                  "pretrain.convert", "pretrain.compile", "pretrain.extrapolation",
                  "pretrain.summary", "launch.sweep", "launch.local", "pretrain.export"]
  script = ("import importlib, sys\n"
            f"for name in {entry_points!r}: importlib.import_module(name)\n"
            "print(sorted(m for m in ('seqio', 'tensorflow', 'lm_eval') "
            "if m in sys.modules))\n")
  assert last_line_of_fresh_python(script) == "[]"
