"""The package layering holds: no import cycle inside `pretrain/` or `model/scan/`, and
no import inside a function except the optional heavy dependencies listed here."""
import ast
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("pretrain", "model/scan")
# Imports that may stay inside functions: optional dependencies a command can run without.
# The Pallas kernels and backends load only when a scan runs on impl="pallas" (a backend
# may be missing from a JAX build); plotting only where a plot is written; the `hf`
# extra's packages only where a Hugging Face model or tokenizer is written or read;
# lm_eval (the `eval` extra, and the backend that subclasses its LM) only where
# downstream tasks run; the GCS emulator (the `test` extra) only where one is served.
OPTIONAL_INSIDE_FUNCTIONS = {"gcp_storage_emulator", "gcp_storage_emulator.handlers",
                             "matplotlib", "matplotlib.pyplot", "jax.experimental.pallas",
                             "model.scan", "model.scan.pallas_scan", "safetensors.numpy",
                             "tokenizers", "transformers",
                             "transformers.tokenization_utils_base", "sentencepiece",
                             "lm_eval", "lm_eval.tasks", "pretrain.lm_eval_backend"}


def _modules(package):
  root = os.path.join(REPO, package)
  for directory, _, files in os.walk(root):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(directory, name)
        module = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
        yield module.removesuffix(".__init__"), path


def _imported(node):
  if isinstance(node, ast.Import):
    return [alias.name for alias in node.names]
  if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
    return [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
  return []


def _module_level(tree):
  """Nodes outside function bodies (imports there run when the module is imported)."""
  stack = list(tree.body)
  while stack:
    node = stack.pop()
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      continue
    yield node
    stack.extend(ast.iter_child_nodes(node))


def _graph(package):
  modules = dict(_modules(package))
  graph = {}
  for module, path in modules.items():
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read())
    targets = set()
    for node in _module_level(tree):
      names = _imported(node)
      submodules = [name for name in names[1:] if name in modules]
      # `from package import submodule` depends on the submodule, not on the package.
      targets.update(submodules if isinstance(node, ast.ImportFrom) and submodules
                     else names)
    graph[module] = {name for name in targets if name in modules and name != module}
  return graph


def _cycle(graph):
  """One import cycle as a list of modules, or None."""
  state = {}

  def visit(module, stack):
    state[module] = "open"
    for target in sorted(graph[module]):
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


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle(package):
  assert _cycle(_graph(package)) is None, " -> ".join(_cycle(_graph(package)))


def test_cycle_finder_finds_a_cycle():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("package", ("pretrain", "model", "sharding", "launch"))
def test_imports_at_module_top(package):
  offenders = []
  for module, path in _modules(package):
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read())
    for function in ast.walk(tree):
      if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for node in ast.walk(function):
          names = _imported(node) if isinstance(node, ast.Import) else (
              [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
          offenders += [f"{module}:{node.lineno} {name}" for name in names
                        if name not in OPTIONAL_INSIDE_FUNCTIONS]
  assert not offenders, "imports inside functions: " + ", ".join(offenders)


def test_entry_points_load_tensorflow_only_when_data_is_read():
  """SeqIO and TensorFlow cost about 6 s to import; parsing configs, `--help`, memory
  planning, compiling for TPU and launching must not pay it. Nor lm_eval, which loads
  only where downstream tasks run."""
  entry_points = ["pretrain.train", "pretrain.evaluate", "pretrain.sample",
                  "pretrain.convert", "pretrain.compile", "pretrain.extrapolation",
                  "model.summary", "launch.sweep", "launch.local", "pretrain.export"]
  script = ("import importlib, sys\n"
            f"for name in {entry_points!r}: importlib.import_module(name)\n"
            "print(sorted(m for m in ('seqio', 'tensorflow', 'lm_eval') "
            "if m in sys.modules))\n")
  result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip() == "[]"
