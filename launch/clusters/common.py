"""Pieces every launcher shares: splitting the user command, quoting, environments.

All launchers take the program to run after `--`, exactly as it would run on one host
(`python -m launch.X [launcher flags] -- python -m pretrain.train --gin_file=...`), and
add only what the cluster needs around it. Their flags are absl flags, run through
`plumbing.cli.run`: a bad command line is one `error: ...` line and exit code 2.
"""
from __future__ import annotations

import ast
import math
import json
import os
import re
import shlex
import socket
import sys
from typing import Any, Mapping, Optional, Sequence

from absl import flags

from plumbing.errors import usage_error
from sharding import distributed

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
_COMMAND_EXAMPLE = ("-- python -m pretrain.train --gin_file=configs/quickstart.gin "
                    "--workdir=/tmp/run")


# Restarts after a failure or preemption that the cluster launchers allow by default: a
# run on a large pod meets interruptions every few hours, and the trainer resumes from
# its newest checkpoint; a budget still ends a run that fails for good (a bad config).
DEFAULT_MAX_RESTARTS = 5
# Which attempt a restarted process belongs to (0 = the first start), for its logs.
ENV_RESTART_ATTEMPT = "GRIFFIN_RESTART_ATTEMPT"


def stop_flags_at_command() -> None:
  """Makes absl stop reading launcher flags at the first argument that is not one.

  Called from every launcher's `define_flags`, so that a command given without `--`
  reaches `child_command` (and its message) instead of having its own flags (`-m`,
  `--gin_file`) rejected as unknown launcher flags.
  """
  flags.FLAGS.set_gnu_getopt(False)


def define_cluster_flags(dry_run_help: str, setup_help: Optional[str] = None) -> None:
  """--env and --dry_run (and --setup with `setup_help`), shared by the cluster launchers."""
  flags.DEFINE_multi_string(
      "env", [], "NAME=VALUE: an environment variable of the command (repeatable).")
  flags.DEFINE_bool("dry_run", False, dry_run_help)
  if setup_help is not None:
    flags.DEFINE_string("setup", "", setup_help)


def child_command(argv: Sequence[str],
                  full_argv: Optional[Sequence[str]] = None) -> list[str]:
  """The command to run: what follows the first `--` of the command line.

  Args:
    argv: what absl left after the launcher's flags (argv[0] first).
    full_argv: the whole command line (default `sys.argv`), to tell `-- cmd` from a
      command given without `--`, which absl returns the same way.

  Raises:
    UserError (exit code 2): no `--`, nothing after it, or arguments before it that
      are not launcher flags.
  """
  full = list(sys.argv if full_argv is None else full_argv)
  if "--" not in full[1:]:
    raise usage_error(f"put the command to run after `--`, e.g. `{_COMMAND_EXAMPLE}`")
  command = full[full.index("--", 1) + 1:]
  if not command:
    raise usage_error(f"no command after `--`; e.g. `{_COMMAND_EXAMPLE}`")
  rest = list(argv[1:])
  if rest != command:  # absl stopped at a positional argument before the `--`
    tail = ["--"] + command
    extra = rest[:-len(tail)] if rest[-len(tail):] == tail else rest
    raise usage_error(f"unexpected arguments {extra} before `--`; launcher options are "
                      "--flags, and the command to run goes after `--`")
  return command


_GIN_ROOTS = (REPO_ROOT, os.path.join(REPO_ROOT, "configs"))


def _gin_lines(path: str, seen: set[str]) -> list[str]:
  """The statements of a Gin file with its includes spliced in, in parse order."""
  found = next((p for p in [path] + [os.path.join(r, path) for r in _GIN_ROOTS]
                if os.path.isfile(p)), None)
  if found is None or found in seen:
    return []
  seen.add(found)
  lines = []
  with open(found, encoding="utf-8") as f:
    for line in f:
      line = line.split("#", 1)[0].strip()
      include = re.match(r"include\s+['\"](.+)['\"]$", line)
      lines += _gin_lines(include.group(1), seen) if include else [line]
  return lines


def gin_literal(command: Sequence[str], binding: str) -> Any:
  """The literal value the training command's Gin files and --gin_param set for
  `binding` (the last one wins, as in Gin), or None if unset or not a literal.

  Launchers only read the command, for sanity notes and estimates; reading it through
  Gin would import the data libraries (TensorFlow) into every launcher.
  """
  return gin_literals(command).get(binding)


def gin_literals(command: Sequence[str]) -> dict[str, Any]:
  """Every binding the training command's Gin files and --gin_param set to a literal
  (`name -> value`, the last statement winning), with `%MACRO` references resolved to
  the macro's last literal value, as Gin resolves them when the config is built.
  Bindings whose value is not a literal (`@configurable()`, expressions) are left out."""
  files, params = gin_arguments(command)
  seen: set[str] = set()
  texts: dict[str, str] = {}
  for statement in [line for path in files for line in _gin_lines(path, seen)] + params:
    name, sep, text = statement.partition("=")
    if sep and name.strip():
      texts[name.strip()] = text.strip()

  def value(text: str, depth: int = 0) -> Any:
    macro = re.fullmatch(r"%([A-Za-z_][\w.]*)", text)
    if macro:
      target = texts.get(macro.group(1))
      return None if target is None or depth > 8 else value(target, depth + 1)
    try:
      return ast.literal_eval(text)
    except (ValueError, SyntaxError):
      return None

  values = {name: value(text) for name, text in texts.items()}
  return {name: v for name, v in values.items() if v is not None}


def gin_arguments(command: Sequence[str]) -> tuple[list[str], list[str]]:
  """The --gin_file and --gin_param values of a training command, in order."""
  found: dict[str, list[str]] = {"gin_file": [], "gin_param": []}
  args = list(command)
  for i, arg in enumerate(args):
    for name, values in found.items():
      if arg.startswith(f"--{name}="):
        values.append(arg.split("=", 1)[1])
      elif arg == f"--{name}" and i + 1 < len(args):
        values.append(args[i + 1])
  return found["gin_file"], found["gin_param"]


def shell_join(argv: Sequence[str]) -> str:
  return " ".join(shlex.quote(str(a)) for a in argv)


def env_prefix(env: Mapping[str, str]) -> str:
  """`A=1 B='x y' ` style assignments for the front of a shell command."""
  return "".join(f"{name}={shlex.quote(str(value))} " for name, value in env.items())


def parse_env_flags(items: Sequence[str]) -> dict[str, str]:
  """`--env=NAME=VALUE` flags into a dict, with a clear error for malformed ones."""
  env = {}
  for item in items or ():
    name, sep, value = item.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
      raise usage_error(f"--env {item!r} must look like NAME=VALUE")
    env[name] = value
  return env


def free_port() -> int:
  """A TCP port on 127.0.0.1 that is free right now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def with_device_count(xla_flags: str, devices: int) -> str:
  """XLA_FLAGS with the simulated host-device count set to `devices` (replacing any)."""
  kept = [f for f in xla_flags.split() if not f.startswith(DEVICE_COUNT_FLAG)]
  return " ".join(kept + [f"{DEVICE_COUNT_FLAG}={devices}"])


def local_process_env(coordinator: str, num_processes: int, process_id: int,
                      devices_per_process: int, xla_flags: str = "") -> dict[str, str]:
  """What `sharding.distributed.initialize_from_environment` needs in process `process_id`
  of a run of simulated CPU hosts on this machine."""
  return {
      distributed.ENV_COORDINATOR: coordinator,
      distributed.ENV_NUM_PROCESSES: str(num_processes),
      distributed.ENV_PROCESS_ID: str(process_id),
      "JAX_PLATFORMS": "cpu",
      "XLA_FLAGS": with_device_count(xla_flags, devices_per_process),
  }


# -- Manifests -----------------------------------------------------------------------------
def to_yaml(value: Any, indent: int = 0) -> str:
  """Block-style YAML for dicts, lists, strings, numbers and booleans.

  Strings are written as JSON strings (a subset of YAML's double-quoted scalars), so
  shell commands with quotes, `$(VAR)` references and colons round-trip exactly.
  """
  pad = "  " * indent
  if isinstance(value, dict):
    if not value:
      return pad + "{}\n"
    out = []
    for key, item in value.items():
      if isinstance(item, (dict, list)) and item:
        out.append(f"{pad}{_yaml_key(key)}:\n" + to_yaml(item, indent + 1))
      else:
        out.append(f"{pad}{_yaml_key(key)}: {_yaml_scalar(item)}\n")
    return "".join(out)
  if isinstance(value, list):
    if not value:
      return pad + "[]\n"
    out = []
    for item in value:
      if isinstance(item, (dict, list)) and item:
        nested = to_yaml(item, indent + 1)
        out.append(f"{pad}- " + nested[len(pad) + 2:])
      else:
        out.append(f"{pad}- {_yaml_scalar(item)}\n")
    return "".join(out)
  return pad + _yaml_scalar(value) + "\n"


def _yaml_key(key: Any) -> str:
  key = str(key)
  return key if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_./-]*", key) else json.dumps(key)


def _yaml_scalar(value: Any) -> str:
  if isinstance(value, bool):
    return "true" if value else "false"
  if value is None:
    return "null"
  if isinstance(value, (int, float)):
    return str(value)
  if isinstance(value, dict):
    return "{}"
  if isinstance(value, list):
    return "[]"
  return json.dumps(str(value))


def positive_numbers(texts: Sequence[str], flag: str, what: str, example: str) -> list[float]:
  """The values of a comma-separated flag, each a positive finite number; a ValueError
  naming the flag, the bad value and an example otherwise."""
  values = []
  for text in texts:
    try:
      value = float(text)
    except ValueError:
      value = -1.0
    if not (value > 0 and math.isfinite(value)):
      raise ValueError(f"{flag}: {text!r} is not a positive {what}; write e.g. {example}")
    values.append(value)
  return values
