"""Keeps third-party start-up noise off the terminal; `--verbose` shows all of it.

TensorFlow (imported by SeqIO and clu), XLA, libtpu and gloo log from C++ straight to
file descriptor 2, most of it before any Python logging is configured and regardless
of TF_CPP_MIN_LOG_LEVEL: "All log messages before absl::InitializeLog()", `cudart_stub`
and `cuInit` on machines without a GPU, CPU-feature notices, gloo's connection lines.
So every command imports this module first, and it puts a small filter process between
descriptor 2 and the terminal: it drops lines of those known kinds (INFO and WARNING
lines in the absl/glog format, accelerator probes that failed) and passes everything
else unchanged, in order, our own messages and a native crash's last words included.
The filter is a separate process so that it still delivers what a dying command wrote.

Only a command of this repository run as `__main__` is filtered; importing an entry
point from Python (tests, notebooks) changes nothing. Python-side noise (Orbax's
"Given directory is read only") is dropped by `install_log_filters`, called from
`pretrain.cli.run` once absl logging is set up.
"""
from __future__ import annotations

import atexit
import logging
import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Patterns of native stderr lines that carry no information for the user.
NOISE_PATTERNS = (
    r"^WARNING: All log messages before absl::InitializeLog\(\) is called",
    r"^WARNING: Logging before InitGoogle\(\) is written to STDERR",
    r"^I\d{4} \d\d:\d\d:",                        # absl/glog INFO lines
    # Native (C++) WARNING lines only: our own Python warnings (e.g. a preemption
    # notice) have the same prefix but name a .py file, and must stay visible.
    r"^W\d{4} [\d:.]+\s+\d+\s+\S+\.(cc|h|cpp|c):\d+\]",
    r"^E\d{4} \d\d:\d\d:.*(cuInit|cuda_|cudart|libtpu|TPU_)",  # no GPU/TPU here
    r"^To enable the following instructions: .* rebuild TensorFlow",
    r"(TPU_ACCELERATOR_TYPE|TPU_WORKER_HOSTNAMES)",
    r"^=== Source Location Trace: ===\s*$",  # printed with a trailing space
    r"^learning/.*\.cc:\d+$",
    r"Rank connected",
    # Apache Beam (pretrain.data.prepare): optional Google Cloud clients it did not find,
    # and its worker processes' start-up and shut-down INFO lines.
    r"^WARNING:root:apitools not found",
    r"^INFO:(__main__|root|absl|apache_beam[\w.]*):",
    r"No semi_persistent_directory found",
    # (options the DirectRunner hands its own workers)
    r"Discarding unparseable args: \[\\?'--(direct_runner_use_stacked_bundle|"
    r"pipeline_type_check)\\?', \\?'--(direct_runner_use_stacked_bundle|"
    r"pipeline_type_check)\\?'\]",
    # tensorstore's AWS SDK looks for ~/.aws files before the environment's credentials.
    r"^E\d{4} [\d:.]+\s+\d+ (common-io|AuthCredentialsProvider):\d+\]",
)

# Orbax logs at WARNING every time a command opens checkpoints to read them,
# and, when a save overlaps the next one, how long it waited (the trainer already reports
# where its time goes).
LOG_NOISE = ("Given directory is read only", "Waiting for previous save to complete took")

_FILTER_PROGRAM = """
import re, sys
noise = re.compile("|".join(sys.argv[1:]))
out = sys.stdout.buffer
for line in sys.stdin.buffer:
  if not noise.search(line.decode("utf-8", "replace")):
    out.write(line)
    out.flush()
"""

VERBOSE_FLAG = "--verbose"


def verbose_requested(argv: list[str]) -> bool:
  """Whether the command line asks for everything (`--verbose`, `--verbose=true`)."""
  return any(arg == VERBOSE_FLAG or arg.lower() in (f"{VERBOSE_FLAG}=true",
                                                       f"{VERBOSE_FLAG}=1")
             for arg in argv[1:])


def _is_command() -> bool:
  """Whether this process runs one of the repository's commands as `__main__`."""
  main_file = getattr(sys.modules.get("__main__"), "__file__", None)
  if not main_file:
    return False
  path = os.path.abspath(main_file)
  return (path.startswith(REPO_ROOT + os.sep)
          and not path.startswith(os.path.join(REPO_ROOT, "tests") + os.sep))


class _LogFilter(logging.Filter):

  def filter(self, record: logging.LogRecord) -> bool:
    return not any(str(record.msg).startswith(noise) for noise in LOG_NOISE)


def install_log_filters() -> None:
  """Drops known Python-logging noise (absl's logger, which Orbax and JAX use)."""
  logging.getLogger("absl").addFilter(_LogFilter())


def _filter_native_stderr() -> subprocess.Popen:
  """Routes descriptor 2 through the noise filter; returns the filter process."""
  sys.stderr.flush()
  terminal = os.dup(2)
  # Its own session: a Ctrl-C meant for the command must not stop the filter.
  process = subprocess.Popen([sys.executable, "-c", _FILTER_PROGRAM, *NOISE_PATTERNS],
                             stdin=subprocess.PIPE, stdout=terminal,
                             start_new_session=True)
  os.close(terminal)
  os.dup2(process.stdin.fileno(), 2)
  process.stdin.close()

  def drain() -> None:
    sys.stderr.flush()
    os.close(2)         # the filter sees end-of-file and exits after the last line
    process.wait(timeout=10)
  atexit.register(drain)
  return process


if _is_command() and not verbose_requested(sys.argv):
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
  _filter_native_stderr()
