"""Shared pieces of the trainer's end-to-end tests: a tiny corpus and config, and runs of
the real commands in subprocesses (2 simulated devices each, one persistent compilation
cache and one token-store cache for the whole test session, so each program compiles
once per session).
"""
import contextlib
import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import filelock
import pytest

from plumbing import storage

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("def", "return", "class", "self", "import", "for", "in", "if", "else", "print",
         "value", "items", "(", ")", ":", "=", "+", "\n", "    ")


def last_line_of_fresh_python(code: str, env=None, timeout: float = 120) -> str:
  """Runs `code` in a new interpreter from the repository root and returns the last line
  it printed: for checks that the test worker's own state (modules already imported,
  flags already defined, other threads' memory) would spoil."""
  result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=env)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout.strip().splitlines()[-1]

TINY_GIN = """
include 'configs/base/trainer.gin'
include 'configs/base/optimizer.gin'
include 'configs/data/text_files.gin'
import model.config

TRAIN_FILES = '{corpus}/*.txt'
TRAIN_STEPS = 24
BATCH_SIZE = 4
SEQUENCE_LENGTH = 32
CHECKPOINT_EVERY = 2       # an async save is in flight most of the time
EVAL_EVERY = 0
LOG_EVERY = 1
SEED = 3

ModelConfig.vocab_size = 259
ModelConfig.width = 32
ModelConfig.rnn_width = 32
ModelConfig.num_heads = 2
ModelConfig.depth = 3
ModelConfig.attention_window = 8
ModelConfig.scan_impl = "lax"

OptimizerConfig.peak_learning_rate = 1e-2
OptimizerConfig.warmup_steps = 2
TrainConfig.final_eval = False
TrainConfig.eval_batches = 2
text_files_task.validation_fraction = 0.25
DataPipeline.cache_dir = '{cache}'
"""


def make_corpus(directory, documents=24, words=400, seed=0):
  """Small text files drawn from a Python-ish word list (learnable in a few steps).

  Written once per session (the token store keys on it) and published with one rename,
  so a second xdist worker asking for the same directory never reads a partial corpus."""
  if os.path.isdir(directory):
    return directory
  staging = f"{directory}.{os.getpid()}.partial"
  os.makedirs(staging)
  rng = random.Random(seed)
  for i in range(documents):
    with open(os.path.join(staging, f"doc{i:03d}.txt"), "w", encoding="utf-8") as f:
      f.write(" ".join(rng.choice(WORDS) for _ in range(words)))
  try:
    os.rename(staging, directory)
  except OSError:   # the other worker published the same corpus first
    shutil.rmtree(staging)
  return directory


class TrainerEnv:
  """Paths and environment shared by every subprocess run of a test session."""

  def __init__(self, root):
    self.root = str(root)
    self.corpus = make_corpus(os.path.join(self.root, "corpus"))
    self.cache = os.path.join(self.root, "token_cache")
    self.gin = os.path.join(self.root, "tiny.gin")
    staging = f"{self.gin}.{os.getpid()}"
    with open(staging, "w", encoding="utf-8") as f:
      f.write(TINY_GIN.format(corpus=self.corpus, cache=self.cache))
    os.replace(staging, self.gin)   # the same text from either worker, never half of it
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    env["JAX_PLATFORMS"] = "cpu"
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(self.root, "jax_cache")
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    env["GRIFFIN_DATA_CACHE"] = self.cache
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    self.env = env

  def command(self, module, *args):
    return [sys.executable, "-m", module, *args]

  def train_command(self, workdir, *gin_params, gin_files=None):
    args = [f"--gin_file={f}" for f in (gin_files or [self.gin])]
    args += [f"--gin_param={p}" for p in gin_params]
    return self.command("pretrain.train", *args, f"--workdir={workdir}")

  def run(self, command, timeout=600):
    """`command` to its end. The timeout only guards against a hang: in CI's first
    minutes a two-process run shares 2 cores with the SLURM cluster's four training
    tasks and took 330 s (262 s of it the trainer's own wall time)."""
    return subprocess.run(command, env=self.env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)

  def evaluate(self, workdir, output):
    """Runs `pretrain.evaluate` on workdir; checks that the JSON it prints last is
    the JSON it wrote to `output` and returns it."""
    result = self.run(self.command("pretrain.evaluate", f"--workdir={workdir}",
                                   f"--output={output}"))
    assert_ok(result)
    printed = json.loads(result.stdout.strip().splitlines()[-1])
    with open(output, encoding="utf-8") as f:
      assert printed == json.loads(f.read())
    return printed

  def popen(self, command):
    return subprocess.Popen(command, env=self.env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def read_metrics(workdir):
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  rows = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      if line.endswith("\n"):   # a line being written is not a row yet
        rows.append(json.loads(line))
  return rows


def train_losses(workdir):
  """{step: loss} of the training rows (eval rows skipped)."""
  return {row["step"]: row["loss"] for row in read_metrics(workdir) if "loss" in row}


def kill_after_steps(env, command, workdir, steps, timeout_s=240):
  """Starts `command` and SIGKILLs it once `workdir` has logged `steps` training rows."""
  process = env.popen(command)
  deadline = time.time() + timeout_s
  while time.time() < deadline and len(train_losses(workdir)) < steps:
    if process.poll() is not None:
      break
    time.sleep(0.01)
  assert process.poll() is None, "the run ended before it could be killed"
  os.kill(process.pid, signal.SIGKILL)
  process.wait(timeout=60)


def stderr_excerpt(stderr: str, tail: int = 3000) -> str:
  """What a failure message needs of a child's stderr: its tail, and for a native crash
  also what the tail leaves out. On a crash (SIGABRT, SIGSEGV) Python's faulthandler
  writes "Fatal Python error: ...", every thread's stack, then the list of loaded
  extension modules (about 5000 characters with TensorFlow and Beam loaded), so the
  tail alone is that list: the native library's own last words (a CHECK failure,
  "terminate called ...", "LLVM ERROR: ...") come before the fatal-error line, and the
  stack of the thread that died follows it ("Current thread")."""
  fatal = stderr.find("Fatal Python error:")
  if fatal < 0 or fatal >= len(stderr) - tail:
    return stderr[-tail:]
  before = stderr[:fatal].splitlines()[-20:]
  fatal_line = stderr[fatal:].splitlines()[0]
  current = re.search(r"^Current thread .*?(?=^\S|\Z)", stderr[fatal:], re.M | re.S)
  return "\n".join(["[native crash: the lines before Python's fatal error]", *before,
                     fatal_line, current.group(0).rstrip() if current else
                     "[no 'Current thread' stack]", "[... last characters:]",
                     stderr[-tail:]])


def exit_summary(result) -> str:
  """One line: the exit status (the signal's name when a signal ended the child) and,
  after a native crash, the last line written before Python's fatal error (pytest's
  short summary shows only the start of a failure message)."""
  code = result.returncode
  text = f"exit {code}"
  if code < 0:
    with contextlib.suppress(ValueError):
      text += f" ({signal.Signals(-code).name})"
  fatal = result.stderr.find("Fatal Python error:")
  if fatal >= 0:
    last = [line for line in result.stderr[:fatal].splitlines() if line.strip()][-1:]
    text += f": {' / '.join(last + [result.stderr[fatal:].splitlines()[0]])}"
  return text


def assert_ok(result):
  assert result.returncode == 0, (
      f"{exit_summary(result)}\nstdout:\n{result.stdout[-3000:]}\n"
      f"stderr:\n{stderr_excerpt(result.stderr)}")


def _shared_root(tmp_path_factory):
  """One directory per test session, shared by the xdist workers. Test modules import
  these fixtures, which gives each module (and each worker) its own fixture instance;
  keeping their state on disk under a fixed path of the session still lets all of them
  share one corpus, token store, compilation cache and trained run (each built once, not
  once per worker)."""
  base = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    base = base.parent   # pytest-N/, above the workers' popen-gwK/
  root = base / "trainer_shared"
  root.mkdir(exist_ok=True)
  return root


@pytest.fixture(scope="session")
def trainer_env(tmp_path_factory):
  return TrainerEnv(_shared_root(tmp_path_factory))


# lm_eval (the eval extra) scores the trained run on this local multiple-choice task.
LM_EVAL_TASKS = os.path.join(REPO, "tests", "data", "lm_eval_tasks")
DOWNSTREAM_SETTINGS = ("TrainConfig.downstream_tasks=('tiny_mc',)",
                       "TrainConfig.downstream_every=12",
                       f"TrainConfig.downstream_include_path='{LM_EVAL_TASKS}'")


@pytest.fixture(scope="session")
def trained_workdir(trainer_env):
  """A finished tiny run (24 steps, evals, downstream tiny_mc scores (the
  test extra installs lm_eval), sample, a profile of steps 2-3) shared by several test modules; also
  the uninterrupted reference of the exact-resume test (evaluation does not touch the
  training state)."""
  workdir = os.path.join(trainer_env.root, "trained")
  finished = os.path.join(trainer_env.root, "trained_run.json")
  with filelock.FileLock(finished + ".lock"):   # the other worker may be training it
    if not os.path.exists(finished):
      shutil.rmtree(workdir, ignore_errors=True)   # what a failed attempt left
      result = trainer_env.run(trainer_env.train_command(
          workdir, "EVAL_EVERY=12", "TrainConfig.final_eval=True",
          "TrainConfig.sample_prompt='def '", "TrainConfig.sample_tokens=16",
          "TrainConfig.profile_steps=(2, 3)", *DOWNSTREAM_SETTINGS))
      assert_ok(result)
      with open(finished, "w", encoding="utf-8") as f:
        json.dump({"stdout": result.stdout, "stderr": result.stderr}, f)
  with open(finished, encoding="utf-8") as f:
    outputs = json.load(f)
  return workdir, subprocess.CompletedProcess([], 0, outputs["stdout"], outputs["stderr"])


@contextlib.contextmanager
def small_disk(directory, size_bytes):
  """A tmpfs of `size_bytes` mounted at `directory` for the block: a disk that really
  fills up. Skips the test where mounting is not allowed (it needs root)."""
  os.makedirs(directory, exist_ok=True)
  mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs",
                            str(directory)], capture_output=True, text=True, check=False)
  if mounted.returncode:
    pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
  try:
    yield
  finally:
    subprocess.run(["umount", "--lazy", str(directory)], check=True)


def fill_disk(directory):
  """Fills the file system of `directory` to its last byte (a file `filler`)."""
  with open(os.path.join(directory, "filler"), "wb", buffering=0) as f:
    try:
      while True:
        f.write(b"\0" * 4096)
    except OSError as error:
      if error.errno != errno.ENOSPC:
        raise


# Variables through which the fixtures point clients at their server.
_STORAGE_PREFIXES = ("AWS_", "STORAGE_", "TENSORSTORE_", "GOOGLE_AUTH", "FSSPEC_",
                     "GCSFS_", "GCE_", "NO_GCE")


def bucket_rows(workdir: str) -> list[dict]:
  """The per-step rows of the run's metrics.jsonl (training and evaluation)."""
  path = storage.join(workdir, "metrics.jsonl")
  if not storage.exists(path):
    return []
  rows = [json.loads(line) for line in storage.read_text(path).splitlines(True)
          if line.endswith("\n")]
  return [row for row in rows if "kind" not in row]  # step rows, not goodput records


def storage_env(base: dict, **overrides) -> dict:
  """A subprocess environment: `base` plus the variables of the active storage server."""
  env = dict(base)
  env.update({k: v for k, v in os.environ.items() if k.startswith(_STORAGE_PREFIXES)})
  env.update(overrides)
  return env
