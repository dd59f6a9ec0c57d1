"""Keeps third-party start-up noise off the terminal; `--verbose` shows all of it.

TensorFlow (imported by SeqIO and clu), XLA, libtpu and gloo log from C++ straight to
file descriptor 2, most of it before any Python logging is configured and regardless
of TF_CPP_MIN_LOG_LEVEL: "All log messages before absl::InitializeLog()", `cudart_stub`
and `cuInit` on machines without a GPU, CPU-feature notices, gloo's connection lines.
So every command calls `setup()` before anything loads them (each package's `__init__`
does, see `setup`), and it puts a small filter process between descriptor 2 and the
terminal: it drops lines of those known kinds (INFO and WARNING
lines in the absl/glog format, accelerator probes that failed) and passes everything
else unchanged, in order, our own messages and a native crash's last words included.
The filter is a separate process so that it still delivers what a dying command wrote.

Client libraries of the outside services a run talks to (object storage, experiment
trackers) log a retry warning for every attempt at a service that is down, and some a
traceback: the run reports each such event in one line of its own, so their records go
to a file instead (`keep_client_logs`: the workdir's `clients.log` while training), which
that line names.

Only a command of this repository run as `__main__` gets that filter; Python-side noise
(Orbax's "Given directory is read only", and the tracebacks it logs of a failed save,
which the command reports in one line) is dropped there by `install_log_filters`,
called from `plumbing.cli.run` once absl logging is set up.

Using the packages from Python (`pretrain.load`, notebooks, tests) must be as quiet, and
there the same `setup()` (run by the package's `__init__`) does not take over
descriptor 2 for the life of someone else's process:
  - TensorFlow writes its start-up lines while its shared libraries load, whatever
    TF_CPP_MIN_LOG_LEVEL says (TF 2.21); so only the import of `tensorflow` itself,
    wherever SeqIO, clu or TFDS trigger it, runs with descriptor 2 through the filter
    (`_QuietImport`), and so do the imports of `jax` and of its CUDA plugin, which
    write lines of their own where the plugin is installed without a GPU. TF_CPP_MIN_LOG_LEVEL, unless
    set, is 3 as in the commands: it does silence TF's later lines, such as the CUDA
    probe when a first op runs;
  - the Orbax notices are dropped by `install_log_filters`, as in the commands.
And everywhere, commands included: on a host with libtpu installed (the tpu and test
extras) but no accelerator, JAX would start libtpu, which probes for a TPU and writes
a dozen lines about the one it did not find before JAX settles on the CPU; with the
CUDA plugin (the gpu-aot and test extras, to compile for GPUs) it would try to load
CUDA and print a traceback of the failure. There JAX's
platform is set to "cpu" before any backend starts, in this process only (an exported
JAX_PLATFORMS would follow `sbatch` from a login node to GPU nodes). A JAX_PLATFORMS
the user set, a TPU or GPU device, or the variables that describe a TPU host to libtpu
leave JAX to choose, so a TPU host still finds its TPU.
"""
from __future__ import annotations

import atexit
import contextlib
import glob
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import subprocess
import sys
import traceback
import types
from typing import Any, Callable, Iterator, Optional, Sequence

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
    # lm-evaluation-harness asks git for the commit it runs in, from any directory.
    r"^fatal: not a git repository",
    # tensorstore's AWS SDK looks for ~/.aws files before the environment's credentials.
    r"^E\d{4} [\d:.]+\s+\d+ (common-io|AuthCredentialsProvider):\d+\]",
)

# Orbax logs at WARNING every time a command opens checkpoints to read them,
# when a save overlaps the next one, how long it waited (the trainer already reports
# where its time goes), and, for a local-tier save made while the run stops (a bucket
# outage), that it keeps no object-size statistics.
LOG_NOISE = ("Given directory is read only", "Waiting for previous save to complete took",
             "Global object size logging disabled")

# The loggers of the clients of outside services (`keep_client_logs`).
CLIENT_LOGGERS = ("urllib3", "requests", "botocore", "aiobotocore", "s3fs", "boto3",
                  "google.auth", "google_auth_httplib2", "google.api_core",
                  "google.cloud.storage", "gcsfs", "fsspec", "mlflow", "wandb",
                  "opentelemetry",   # W&B's telemetry exporter: 401s, timeouts
                  "datasets", "huggingface_hub")   # the Hub's, for lm_eval's tasks

# The filter ends when the command closes the pipe. It ignores SIGTERM, which a
# scheduler may send to every process of a job (SLURM's `scancel`, its time limit) while
# the command saves: ended first, it would leave the command writing into a closed pipe.
_FILTER_PROGRAM = """
import re, signal, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
noise = re.compile("|".join(sys.argv[1:]))
out = sys.stdout.buffer
for line in sys.stdin.buffer:
  if not noise.search(line.decode("utf-8", "replace")):
    out.write(line)
    out.flush()
"""

VERBOSE_FLAG = "--verbose"

# Device files through which JAX reaches an accelerator: TPU chips (/dev/accel*, or
# VFIO on v5e and later), NVIDIA and AMD GPUs, GPUs under WSL2.
ACCELERATOR_DEVICES = ("/dev/accel*", "/dev/vfio", "/dev/nvidia*", "/dev/kfd", "/dev/dxg")
# Variables that describe a TPU host to libtpu, or tell JAX to start it regardless.
TPU_VARIABLES = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID",
                 "JAX_FORCE_TPU_INIT")


def verbose_requested(argv: list[str]) -> bool:
  """Whether the command line asks for everything (`--verbose`, `--verbose=true`)."""
  return any(arg == VERBOSE_FLAG or arg.lower() in (f"{VERBOSE_FLAG}=true",
                                                       f"{VERBOSE_FLAG}=1")
             for arg in argv[1:])


def _main_file() -> Optional[str]:
  """The file this process runs as `__main__`. `python -m pretrain.<command>` imports the
  package, and so this module, while runpy is still locating the command (argv[0] is
  "-m" until then): its file is found from the module named on the command line."""
  if sys.argv[:1] == ["-m"] and "-m" in sys.orig_argv:
    spec = importlib.util.find_spec(sys.orig_argv[sys.orig_argv.index("-m") + 1])
    return spec.origin if spec else None
  return getattr(sys.modules.get("__main__"), "__file__", None)


def _is_command() -> bool:
  """Whether this process runs one of the repository's commands as `__main__`."""
  main_file = _main_file()
  if not main_file:
    return False
  path = os.path.abspath(main_file)
  return (path.startswith(REPO_ROOT + os.sep)
          and not path.startswith(os.path.join(REPO_ROOT, "tests") + os.sep))


# Orbax logs each failure of a background save, traceback and all, at ERROR from every
# thread it passes through, then raises it to the caller, which reports it in one line
# (`pretrain.checkpoints.checkpointer`, `CheckpointSaveError`); asyncio adds the failed writes of
# that save that nobody awaited any more.
ORBAX_SOURCE = os.sep + os.path.join("orbax", "checkpoint") + os.sep
# After such a failure, tensorstore completes the save's other writes on its own threads
# and hands each result to the event loop Orbax ran the save in, which Orbax has closed
# by then: every one of them is an unraisable "Event loop is closed" traceback (hundreds
# of lines for one failed save).
CLOSED_LOOP = "Event loop is closed"


def _orbax_failure(record: logging.LogRecord) -> bool:
  """Whether `record` reports an exception that Orbax logged or that passed through it."""
  if not record.exc_info:
    return False
  frames = traceback.extract_tb(record.exc_info[2])
  return (ORBAX_SOURCE in record.pathname or ORBAX_SOURCE in str(record.msg)
          or any(ORBAX_SOURCE in frame.filename for frame in frames))


class _LogFilter(logging.Filter):

  def filter(self, record: logging.LogRecord) -> bool:
    if _orbax_failure(record):
      return False
    return not any(str(record.msg).startswith(noise) for noise in LOG_NOISE)


class _UnraisableFilter:
  """`sys.unraisablehook` that drops the closed-loop reports of a failed save and hands
  every other unraisable exception to the hook it replaced."""

  def __init__(self, previous: Callable[[Any], None]):
    self.previous = previous

  def __call__(self, unraisable: Any) -> None:
    if not (unraisable.object is None and isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == CLOSED_LOOP):
      self.previous(unraisable)


# JAX logs a plugin that fails to start (the CUDA plugin on a node with NVIDIA device
# files but no CUDA runtime, as on a CPU-only SLURM node with GRES placeholders) with
# logger.exception: a two-part traceback for every process. It is a notice, not an
# error (JAX goes on with the platforms that start), so it becomes one line, once.
JAX_PLUGIN_LOGGER = "jax._src.xla_bridge"
PLUGIN_FAILURE = "Jax plugin configuration error: Exception when calling"
# What JAX adds once it has fallen back to the CPU, as if no CUDA plugin were installed.
NO_CUDA_JAXLIB = "An NVIDIA GPU may be present on this machine, but a CUDA-enabled jaxlib"


class _PluginFailureFilter(logging.Filter):
  """Turns JAX's traceback of a plugin that did not start into one line, once."""

  reported = False

  def filter(self, record: logging.LogRecord) -> bool:
    if str(record.msg).startswith(NO_CUDA_JAXLIB):
      return not _PluginFailureFilter.reported   # the line above said why
    if not str(record.msg).startswith(PLUGIN_FAILURE):
      return True
    if _PluginFailureFilter.reported:
      return False
    _PluginFailureFilter.reported = True
    plugin = str(record.args[0]).removesuffix(".initialize()").removeprefix("jax_plugins.") \
        if record.args else "a plugin"
    reason = record.exc_info[1] if record.exc_info else None
    record.msg = "JAX's %s plugin did not start (%s); running on the platforms that did"
    record.args = (plugin, reason or "no reason given")
    record.exc_info = record.exc_text = None
    record.levelno, record.levelname = logging.WARNING, "WARNING"
    return True


def install_log_filters() -> None:
  """Drops known Python-logging noise (absl's logger, which Orbax and JAX use; asyncio's)
  and the unraisable reports of a failed save; shortens a failed JAX plugin to a line."""
  for name in ("absl", "asyncio"):
    logging.getLogger(name).addFilter(_LogFilter())
  plugin_logger = logging.getLogger(JAX_PLUGIN_LOGGER)
  if not any(isinstance(f, _PluginFailureFilter) for f in plugin_logger.filters):
    plugin_logger.addFilter(_PluginFailureFilter())
  if not isinstance(sys.unraisablehook, _UnraisableFilter):
    sys.unraisablehook = _UnraisableFilter(sys.unraisablehook)


class _ClientLog(logging.FileHandler):
  """The client libraries' log file, created on its first record (most runs have none)."""

  def __init__(self, path: str):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    super().__init__(path, delay=True, encoding="utf-8")
    self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))


_client_log: Optional[_ClientLog] = None


def keep_client_logs(path: str) -> None:
  """From now on, the records of the `CLIENT_LOGGERS` go to the file `path` (appended)
  instead of the console; a later call moves them to another file. Not undone when a
  run ends: a tracker's thread may still be retrying a service that does not answer
  when the process exits, and its retries must not reach the console after the run's
  last line. MLflow's own console handler is not installed (MLFLOW_CONFIGURE_LOGGING,
  unless set), and is replaced where MLflow was imported already."""
  global _client_log
  os.environ.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")
  previous, _client_log = _client_log, _ClientLog(path)
  for name in CLIENT_LOGGERS:
    logger = logging.getLogger(name)
    logger.handlers[:] = [_client_log]
    logger.propagate = False
  if previous is not None:
    previous.close()


def route_to_client_log(names: Sequence[str]) -> bool:
  """Sends loggers `names` (some of `CLIENT_LOGGERS`) to the client log again where one
  is kept (`keep_client_logs`); returns whether one is. A library that installs a console handler of its
  own when it is imported (datasets, huggingface_hub) may have done so after the client
  log was set up."""
  if _client_log is None:
    return False
  for name in names:
    logger = logging.getLogger(name)
    logger.handlers[:] = [_client_log]
    logger.propagate = False
  return True


def _route_stderr_through_filter() -> tuple[subprocess.Popen, int]:
  """Puts a noise filter process between descriptor 2 and where it led; returns the
  process and a new descriptor of that destination."""
  sys.stderr.flush()
  terminal = os.dup(2)
  # Its own session: a Ctrl-C meant for the command must not stop the filter.
  process = subprocess.Popen([sys.executable, "-c", _FILTER_PROGRAM, *NOISE_PATTERNS],
                             stdin=subprocess.PIPE, stdout=terminal,
                             start_new_session=True)
  os.dup2(process.stdin.fileno(), 2)
  process.stdin.close()
  return process, terminal


def _filter_native_stderr() -> subprocess.Popen:
  """Routes descriptor 2 through the noise filter; returns the filter process."""
  process, terminal = _route_stderr_through_filter()
  os.close(terminal)

  def drain() -> None:
    sys.stderr.flush()
    os.close(2)         # the filter sees end-of-file and exits after the last line
    process.wait(timeout=10)
  atexit.register(drain)
  return process


@contextlib.contextmanager
def _native_stderr_filtered() -> Iterator[None]:
  """Descriptor 2 goes through the noise filter until the block ends (a separate
  process, so that it still delivers what a native crash in the block wrote)."""
  process, terminal = _route_stderr_through_filter()
  try:
    yield
  finally:
    sys.stderr.flush()
    os.dup2(terminal, 2)   # closes the pipe's last writer: the filter drains and exits
    os.close(terminal)
    process.wait(timeout=10)


class _QuietLoader(importlib.abc.Loader):
  """Executes a module with descriptor 2 filtered; the module keeps its own loader."""

  def __init__(self, loader: importlib.abc.Loader):
    self.loader = loader

  def create_module(self, spec: importlib.machinery.ModuleSpec
                    ) -> Optional[types.ModuleType]:
    return self.loader.create_module(spec)

  def exec_module(self, module: types.ModuleType) -> None:
    module.__loader__ = module.__spec__.loader = self.loader
    with _native_stderr_filtered():
      self.loader.exec_module(module)


# Packages whose import writes native start-up lines to descriptor 2: TensorFlow's,
# and where the CUDA plugin is installed, JAX's and the plugin's (JAX imports it when
# its first backend starts, CPU included): their CUDA stubs report, whatever
# TF_CPP_MIN_LOG_LEVEL says, that no driver was found.
_NOISY_IMPORTS = ("tensorflow", "jax", "jax_plugins.xla_cuda12")


class _QuietImport(importlib.abc.MetaPathFinder):
  """A `sys.meta_path` finder: the `_NOISY_IMPORTS`, found where Python's path finder
  finds them, are imported with `_QuietLoader`. TensorFlow loads lazily from many places
  (SeqIO, clu, TFDS), and the import of each is the one moment its native start-up
  lines are written."""

  def find_spec(self, name: str, path: Optional[list[str]] = None,
                target: Optional[types.ModuleType] = None
                ) -> Optional[importlib.machinery.ModuleSpec]:
    if name not in _NOISY_IMPORTS:
      return None
    spec = importlib.machinery.PathFinder.find_spec(name, path, target)
    if spec is not None and spec.loader is not None:
      spec.loader = _QuietLoader(spec.loader)
    return spec


def _installed(module: str) -> bool:
  """Whether `module` can be imported (a dotted name whose parent is missing cannot)."""
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:
    return False


def _accelerator_would_probe_in_vain() -> bool:
  """Whether JAX, left to choose its platform, would start libtpu or the CUDA plugin on
  a host without a TPU or GPU: one of them is installed, no accelerator device is here,
  and neither JAX_PLATFORMS nor a TPU host's variables are set."""
  return ("JAX_PLATFORMS" not in os.environ
          and not any(name in os.environ for name in TPU_VARIABLES)
          and any(_installed(name) for name in ("libtpu", "jax_plugins.xla_cuda12"))
          and not any(glob.glob(pattern) for pattern in ACCELERATOR_DEVICES))


_set_up = False


def setup() -> None:
  """Installs what the module docstring describes, once per process. Each package's
  `__init__` calls it first (`python -m <package>.<command>` runs that before the command
  module, and library use imports the package before anything else), and so does each
  script run as a file (`benchmarks/`): importing this module does nothing by itself."""
  global _set_up
  if _set_up:
    return
  _set_up = True
  command = _is_command()
  if not command:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # TF's runtime lines (a CUDA probe)
    install_log_filters()
    sys.meta_path.insert(0, _QuietImport())
  elif not verbose_requested(sys.argv):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    _filter_native_stderr()
  if _accelerator_would_probe_in_vain():
    _run_jax_on_cpu()
  if not command and _installed("jax_plugins.xla_cuda12"):
    _register_plugins_filtered()


def _run_jax_on_cpu() -> None:
  """JAX's platform set to "cpu" (after the filter above is in place, since this is
  where JAX is imported), unless an earlier `jax.config.update` chose one."""
  import jax  # pylint: disable=import-outside-toplevel
  if jax.config.jax_platforms is None:
    jax.config.update("jax_platforms", "cpu")


def _register_plugins_filtered() -> None:
  """JAX loads every installed plugin when its first backend starts, CPU included, and
  the CUDA plugin's library then reports the missing driver from native code; so the
  plugins are registered here, filtered (`jax.devices()` would do it as well, but would
  also fix the backends before the user's own configuration)."""
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  with _native_stderr_filtered():
    xla_bridge._discover_and_register_pjrt_plugins()  # pylint: disable=protected-access
