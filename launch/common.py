"""Pieces every launcher shares: splitting the user command, quoting, environments.

All launchers take the program to run after `--`, exactly as it would run on one host
(`python -m launch.X [launcher flags] -- python -m pretrain.train --gin_file=...`), and
add only what the cluster needs around it.
"""
from __future__ import annotations

import argparse
import re
import shlex
import socket
from typing import Mapping, Sequence

from sharding import distributed

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
  """Splits `argv` at the first `--` into (launcher flags, command to run)."""
  argv = list(argv)
  if "--" not in argv:
    raise SystemExit("usage: put the command to run after `--`, e.g. "
                     "`-- python -m pretrain.train --gin_file=configs/quickstart.gin "
                     "--workdir=/tmp/run`")
  cut = argv.index("--")
  command = argv[cut + 1:]
  if not command:
    raise SystemExit("no command after `--`")
  return argv[:cut], command


def parse_launcher_args(parser: argparse.ArgumentParser,
                        argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
  flags, command = split_command(argv)
  return parser.parse_args(flags), command


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
      raise SystemExit(f"--env {item!r} must look like NAME=VALUE")
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
