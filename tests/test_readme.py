"""Every command README.md and the docs pages it sends readers to show runs as written.

Commands are read from the pages themselves (README.md, then `PAGES`; a command or
snippet on a docs page is checked exactly like one in the README) (```bash blocks and 4-space indented blocks,
backslash continuations joined; ```python blocks), so a documented command cannot rot:
  - launcher commands run verbatim (they all carry `--dry_run`), and the training
    command they wrap is checked without a cluster: its Gin configuration parses, has a
    model, trainer and data config, every binding is read, every config builds, and its
    mesh and batch divide the cluster's devices;
  - `pretrain.summary` runs verbatim and its memory plan must fit;
  - local training runs for real, verbatim, shortened through the documented
    `GRIFFIN_EXTRA_GIN_PARAMS` override (2 steps on a tiny corpus; the corpus commands
    of docs/data.md on small Parquet and .jsonl.zst files the test writes); the Python snippet
    and the `pretrain.report` command then run against the workdir it wrote;
  - the Python snippet, run as a user runs it, writes nothing to stderr;
  - the experiment-tracker commands run verbatim (the MLflow server on its port, in the
    background; the training shortened the same way, W&B offline), and each tracker
    is read back with its own client.
A command of a kind not listed here fails the test, so a new README or docs command
needs a check before it can be documented.
"""
import hashlib
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile

import filelock
import gin
import numpy as np
import pytest

from launch.clusters import common
from model.config import ModelConfig
from plumbing import storage
from pretrain import gin_config
from pretrain.checkpoints.checkpointer import CheckpointConfig
from pretrain.data import pipeline
from pretrain.data.vocabularies import token_byte_lengths
from pretrain.optimizer import OptimizerConfig
from pretrain.train_config import TrainConfig
from sharding.mesh import MeshConfig
from trainer_helpers import (assert_ok, bucket_rows, make_corpus, read_metrics,  # pylint: disable=unused-import
                             storage_env, trained_workdir, trainer_env)
import tracker_tools

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Commands not run here, and why: installation, and the test suite itself.
NOT_RUN = {
    "python3 -m venv .venv": "creates the environment the tests run in",
    ". .venv/bin/activate": "environment set-up",
    "pip install": "installation (CI installs the same way)",
    "python -m pytest": "the test suite itself",
}
# Devices each launcher command brings up: {flag pattern: devices}.
TPU_CHIPS = {"v5p-128": 64}


def _commands_and_snippets(text):
  """(shell commands, python snippets) in order of appearance."""
  commands, snippets = [], []
  lines = text.splitlines()
  i = 0
  while i < len(lines):
    fence = re.match(r"^```(\w*)", lines[i])
    if fence:
      body = []
      i += 1
      while not lines[i].startswith("```"):
        body.append(lines[i])
        i += 1
      if fence.group(1) == "python":
        snippets.append("\n".join(body))
      elif fence.group(1) in ("bash", "sh"):
        commands += _join(body)
    elif lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()):
      body = []
      while i < len(lines) and lines[i].startswith("    "):
        body.append(lines[i][4:])
        i += 1
      commands += _join(body)
      continue
    i += 1
  return commands, snippets


def _join(lines):
  """Logical commands of a block: continuations joined, comments and blanks dropped."""
  commands, current = [], ""
  for line in lines:
    if not current and (not line.strip() or line.lstrip().startswith("#")):
      continue
    current += line.rstrip()
    if current.endswith("\\"):
      current = current[:-1].rstrip() + " "
      continue
    commands.append(" ".join(current.split()))
    current = ""
  return commands


# The docs pages whose commands are checked with the README's: the README's long
# explanations, moved there by topic (tests/test_tpu_compile.py and test_gpu_compile.py
# read their commands from `read_pages` too).
PAGES = ("README.md", "docs/data.md", "docs/interchange.md", "docs/clusters.md",
         "docs/compiling.md")


def read_pages():
  """{page: its text}, for every page of `PAGES`."""
  texts = {}
  for page in PAGES:
    with open(os.path.join(REPO, page), encoding="utf-8") as f:
      texts[page] = f.read()
  return texts


TEXTS = read_pages()
README = TEXTS["README.md"]
# The "## Commands" block is a synopsis with placeholders; --help of each command is
# tested in test_cli_output.py.
_SYNOPSIS = README.split("## Commands", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
COMMANDS, SNIPPETS = [], []
for _page, _text in TEXTS.items():
  _commands, _snippets = _commands_and_snippets(_text.replace(_SYNOPSIS, "\n"))
  COMMANDS += _commands
  SNIPPETS += _snippets
PIECES = [piece.strip() for command in COMMANDS for piece in command.split(" && ")]


def _kind(piece):
  if any(piece.startswith(prefix) for prefix in NOT_RUN):
    return "not_run"
  if piece.startswith("python -m launch.slurm") and "--dry_run" not in piece.split():
    return "slurm_cluster"   # submitted for real by tests/test_slurm_cluster.py
  if piece.startswith("python -m launch."):
    return "launcher"
  if piece.startswith("python -m pretrain.compile"):
    return "compile"  # run verbatim by tests/test_tpu_compile.py and test_gpu_compile.py
  if piece.startswith("python -m pretrain.summary"):
    return "summary"
  if piece.startswith("python -m pretrain.tokenizer"):
    return "corpus_train"   # a tokenizer of the corpus files the test writes
  if piece.startswith("python -m pretrain.train") and "configs/data/corpus.gin" in piece:
    return "corpus_train"   # on corpus files the test writes
  if piece.startswith("python -m pretrain.train"):
    return "train"
  if piece.startswith("python -m pretrain.data.prepare"):
    return "prepare"
  if piece.startswith("python -m pretrain.report"):
    return "report"   # after the training commands, on their workdir
  if piece.startswith(("python -m pretrain.export", "python -m pretrain.convert hf")):
    return "interchange"   # after the training commands, on their workdir
  if piece.startswith("python -m pretrain.evaluate --workdir=workdirs/"):
    return "downstream"   # after the training commands, on their workdir
  if piece.startswith(("mlflow server ", "WANDB_MODE=offline MLFLOW_TRACKING_URI=",
                       "wandb leet inspect ")):
    return "trackers"
  return "unknown"


def test_every_readme_command_has_a_check():
  assert PIECES, "no commands found in README.md and the docs pages"
  unknown = [piece for piece in PIECES if _kind(piece) == "unknown"]
  assert not unknown, f"README/docs commands without a check in {__file__}: {unknown}"
  kinds = {_kind(piece) for piece in PIECES}
  assert {"launcher", "summary", "train", "prepare", "report"} <= kinds, kinds


def _env():
  env = dict(os.environ)
  env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
  return env


def _run(piece, cwd=REPO, env=None, timeout=600):
  return subprocess.run(piece, shell=True, cwd=cwd, env=env or _env(), capture_output=True,
                        text=True, timeout=timeout, executable="/bin/bash")


def _cluster_devices(argv):
  """Devices the launcher command brings up."""
  options = dict(arg[2:].split("=", 1) for arg in argv if arg.startswith("--") and "=" in arg)
  if "tpu_type" in options:
    return TPU_CHIPS[options["tpu_type"]] * int(options.get("num_slices", 1))
  return int(options["nodes"]) * int(options["gpus_per_node"])


def check_cluster_training_config(command, devices):
  """The wrapped training command's Gin config parses, is complete, binds nothing
  unread, builds every config, and its mesh and batch divide `devices`."""
  files, params = common.gin_arguments(command)
  try:
    gin_config.parse(files, params)
    gin_config.check_training_config()
    train = gin_config.build(TrainConfig)
    gin_config.build_model_config()
    gin_config.build(CheckpointConfig)
    gin_config.build(OptimizerConfig)
    shape = gin_config.build(MeshConfig).resolved_shape(devices)
  finally:
    gin.clear_config()
  batch_shards = shape["replica"] * shape["data"] * shape["fsdp"]
  assert train.batch_size % batch_shards == 0, (train.batch_size, shape)
  return shape


LAUNCHERS = [piece for piece in PIECES if _kind(piece) == "launcher"]


@pytest.mark.slow
@pytest.mark.parametrize("piece", LAUNCHERS, ids=[p.split()[2] for p in LAUNCHERS])
def test_launcher_command_dry_runs_and_its_training_config_binds(piece):
  argv = shlex.split(piece)
  assert "--dry_run" in argv
  result = _run(piece)
  assert result.returncode == 0 and result.stderr == "", result.stderr
  command = argv[argv.index("--") + 1:]
  assert command[:3] == ["python", "-m", "pretrain.train"]
  check_cluster_training_config(command, _cluster_devices(argv[:argv.index("--")]))


def test_cluster_training_configs_bind_fully():
  """The fast half of the launcher test: no subprocess, Gin only."""
  for piece in LAUNCHERS:
    argv = shlex.split(piece)
    command = argv[argv.index("--") + 1:]
    check_cluster_training_config(command, _cluster_devices(argv[:argv.index("--")]))


@pytest.mark.slow
@pytest.mark.parametrize("piece", [p for p in PIECES if _kind(p) == "summary"])
def test_memory_planning_command_fits(piece):
  result = _run(piece)
  assert result.returncode == 0 and result.stderr == "", result.stderr
  assert result.stdout.rstrip().endswith("; fits"), result.stdout


@pytest.mark.slow
def test_local_training_commands_and_python_snippet_run_verbatim(tmp_path):
  corpus = make_corpus(str(tmp_path / "corpus"))
  env = _env()
  env.update(JAX_PLATFORMS="cpu", GRIFFIN_DATA_CACHE=str(tmp_path / "tokens"),
             GRIFFIN_EXTRA_GIN_PARAMS="\n".join([
                 "TRAIN_STEPS = 2", "CHECKPOINT_EVERY = 2", "EVAL_EVERY = 0",
                 f"TRAIN_FILES = '{corpus}/*.txt'", "TrainConfig.eval_batches = 1",
                 "TrainConfig.sample_tokens = 4"]))
  trains = [piece for piece in PIECES if _kind(piece) == "train"]
  assert trains
  os.symlink(os.path.join(REPO, "tests"), tmp_path / "tests")   # the README's local tasks
  for piece in trains:
    result = _run(piece, cwd=tmp_path, env=env)
    assert result.returncode == 0, (piece, result.stdout[-2000:], result.stderr[-2000:])
    assert result.stderr == "", result.stderr
  for piece in [piece for piece in PIECES if _kind(piece) == "report"]:
    result = _run(piece, cwd=tmp_path, env=env)
    assert result.returncode == 0 and result.stderr == "", (piece, result.stderr[-2000:])
    for path in result.stdout.split():
      assert os.path.getsize(tmp_path / path) > 0, path
  interchange = [piece for piece in PIECES if _kind(piece) == "interchange"]
  assert len(interchange) == 2, interchange   # export, then import the export
  for piece in interchange:
    result = _run(piece, cwd=tmp_path, env=env)
    assert result.returncode == 0 and result.stderr == "", (piece, result.stderr[-2000:])
  downstream_rows = [row for row in bucket_rows(str(tmp_path / "workdirs" /
                                                    "quickstart-downstream"))
                     if "downstream/tiny_mc/acc" in row]
  assert downstream_rows and downstream_rows[-1]["step"] == 2, downstream_rows
  for piece in [piece for piece in PIECES if _kind(piece) == "downstream"]:
    result = _run(piece, cwd=tmp_path, env=env)
    assert result.returncode == 0, (piece, result.stderr[-2000:])
    assert "|tiny_mc|" in result.stdout.replace(" ", ""), result.stdout
    # stderr holds only our own progress lines: lm_eval's logs and bars are hidden.
    assert all("(batches):" in line for line in result.stderr.splitlines()), result.stderr
  for snippet in SNIPPETS:
    result = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("def main("), result.stdout


@pytest.mark.slow
def test_corpus_training_commands_run_verbatim(tmp_path):
  """docs/data.md's "Train on your corpus": a Parquet directory, a two-corpus mixture
  (that Parquet and .jsonl.zst files with a `content` field), then a byte-level BPE
  tokenizer.json trained on the Parquet directory and a run on its ids, each run
  shortened to 2 steps, on the files the commands name, written here (the tokenizer's
  run reports bits per byte, as `pretrain.evaluate` of it would); then
  `pretrain.sample` on the tokenizer's run, from the checkpoint's copy of the file, and
  its export, whose tokenizer and log-likelihoods transformers and lm_eval's `hf`
  backend reproduce."""
  from test_data_corpora import documents, write_parquet, write_zst  # pylint: disable=import-outside-toplevel
  (tmp_path / "corpus" / "web").mkdir(parents=True)
  (tmp_path / "corpus" / "code").mkdir()
  for i in range(2):
    write_parquet(tmp_path / "corpus" / "web" / f"part-{i}.parquet",
                  documents(300, seed=i, prefix="web"))
    write_zst(tmp_path / "corpus" / "code" / f"part-{i}.jsonl.zst",
              documents(300, seed=5 + i, prefix="code"), field="content")
  env = _env()
  env.update(JAX_PLATFORMS="cpu", GRIFFIN_DATA_CACHE=str(tmp_path / "tokens"),
             # The second command's step is the first's: compiled once.
             JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             GRIFFIN_EXTRA_GIN_PARAMS="\n".join([
                 "TRAIN_STEPS = 2", "CHECKPOINT_EVERY = 2", "EVAL_EVERY = 0", "LOG_EVERY = 1",
                 "TrainConfig.eval_batches = 1"]))
  pieces = [piece for piece in PIECES if _kind(piece) == "corpus_train"]
  assert len(pieces) == 4, pieces
  for piece in pieces:
    result = _run(piece, cwd=tmp_path, env=env)
    assert result.returncode == 0, (piece, result.stdout[-2000:], result.stderr[-2000:])
    assert result.stderr == "", result.stderr
  workdir = dict(arg.split("=", 1) for arg in shlex.split(pieces[1]) if "=" in arg)[
      "--workdir"]
  shares = [row for row in read_metrics(str(tmp_path / workdir))
            if row.get("kind") == "mixture"]
  assert [row["step"] for row in shares] == [1, 2], shares
  assert shares[0]["weight/web"] == 0.7 and shares[0]["weight/code"] == 0.3
  # The tokenizer's run trained on its ids, and its checkpoint keeps the file.
  digest = hashlib.sha256(
      (tmp_path / "corpus" / "tokenizer" / "tokenizer.json").read_bytes()).hexdigest()
  assert os.listdir(tmp_path / "workdirs" / "web_bpe" / "vocabulary") == [
      f"{digest}.tokenizer.json"]
  # Its final evaluation has bits per byte: the scored text has more bytes than tokens.
  final = [row for row in read_metrics(str(tmp_path / "workdirs" / "web_bpe"))
           if "eval_loss" in row][-1]
  scored_bytes = final["eval_loss"] * final["eval_tokens"] / (
      math.log(2) * final["eval_bits_per_byte"])
  assert final["eval_tokens"] < scored_bytes < 10 * final["eval_tokens"], final
  # Sampling reads that copy: the file the run was given may be gone.
  os.remove(tmp_path / "corpus" / "tokenizer" / "tokenizer.json")
  result = _run("python -m pretrain.sample --workdir=workdirs/web_bpe --prompt='the web' "
                "--max_new_tokens=5 --seed=1", cwd=tmp_path, env=env)
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.startswith("the web")
  # The run leaves the framework with its tokenizer: the export's tokenizer gives the
  # ids training saw, and lm_eval's own `hf` backend scores the export as ours does.
  from test_hf_export import assert_lm_evals_hf_backend_scores_like_ours  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  import pretrain  # pylint: disable=import-outside-toplevel
  from pretrain.interchange import hf_export  # pylint: disable=import-outside-toplevel
  run, output = str(tmp_path / "workdirs" / "web_bpe"), str(tmp_path / "web_bpe_hf")
  loaded = pretrain.load(run)   # pretrain.evaluate's byte table, from the checkpoint's copy
  assert token_byte_lengths(loaded.vocabulary, loaded.config.vocab_size) is not None
  hf_export.export(run, output)
  tokenizer = transformers.AutoTokenizer.from_pretrained(output)
  text = "the web page\n\n  says: déjà vu 42"
  assert tokenizer(text).input_ids == [0] + list(loaded.vocabulary.encode(text))
  assert_lm_evals_hf_backend_scores_like_ours(run, output, "the docs' tokenizer.json run")


@pytest.mark.slow
def test_tracker_commands_run_verbatim_with_offline_wandb_and_a_local_mlflow_server(
    tmp_path):
  """The README's tracker commands as written: the MLflow server in the background (the
  `&`), the training (shortened through GRIFFIN_EXTRA_GIN_PARAMS) quiet on stderr, W&B's
  reader on the offline run; then MLflow's client and W&B's reader find one run each,
  with the operative Gin config and every row logged. The server's fixed port is taken
  by one test process at a time on a machine (a file lock)."""
  server, train, read = [piece for piece in PIECES if _kind(piece) == "trackers"]
  assert server.startswith("mlflow server ") and server.endswith(" &")
  port = int(re.search(r"--port (\d+)", server).group(1))
  url = f"http://127.0.0.1:{port}"
  corpus = make_corpus(str(tmp_path / "corpus"))
  env = _env()
  # A 2-step session lasts seconds, less than W&B's offline `init` and MLflow's first
  # calls can take on 2 loaded cores; its end waits for them (`tracker_exit_wait_s`),
  # since this test is about what reaches them (the bound has tests in test_trackers).
  env.update(JAX_PLATFORMS="cpu", GRIFFIN_DATA_CACHE=str(tmp_path / "tokens"),
             WANDB_CONFIG_DIR=str(tmp_path / "wandb_home"),
             WANDB_CACHE_DIR=str(tmp_path / "wandb_home"),
             WANDB_DATA_DIR=str(tmp_path / "wandb_home"), **tracker_tools.QUIET_SERVER,
             GRIFFIN_EXTRA_GIN_PARAMS="\n".join([
                 "TRAIN_STEPS = 2", "CHECKPOINT_EVERY = 2", "EVAL_EVERY = 0",
                 f"TRAIN_FILES = '{corpus}/*.txt'", "TrainConfig.eval_batches = 1",
                 "TrainConfig.sample_tokens = 4", "TrainConfig.tracker_exit_wait_s = 120"]))
  with filelock.FileLock(os.path.join(tempfile.gettempdir(), f"griffin-mlflow-{port}.lock")):
    with open(tmp_path / "mlflow.log", "w", encoding="utf-8") as log:
      process = subprocess.Popen(["/bin/bash", "-c", f"{server}\nwait"], cwd=tmp_path,
                                 env=env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    try:
      tracker_tools.wait_until_up(process, url, str(tmp_path / "mlflow.log"))
      result = _run(train, cwd=tmp_path, env=env)
      assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-2000:])
      assert result.stderr == "", result.stderr
      from mlflow.tracking import MlflowClient  # pylint: disable=import-outside-toplevel
      client = MlflowClient(url)
      runs = client.search_runs([client.get_experiment_by_name("griffin-pretrain")
                                 .experiment_id])
    finally:
      tracker_tools.stop(process)
  assert [run.info.run_name for run in runs] == ["quickstart-tracked"]
  assert runs[0].data.params["TRAIN_STEPS"] == "2"   # the operative config, overrides in
  assert runs[0].data.params["ModelConfig.width"] == "192"
  assert runs[0].data.metrics["train/loss"] > 0 and runs[0].info.status == "FINISHED"
  result = _run(read, cwd=tmp_path, env=env)
  assert result.returncode == 0 and result.stderr == "", result.stderr
  assert "train/loss" in result.stdout and "finished" in result.stdout, result.stdout
  run_dir, = (tmp_path / "workdirs" / "quickstart-tracked" / "wandb").glob("offline-run-*")
  records = tracker_tools.wandb_records(str(run_dir))
  config, = [r["run"]["config"]["update"] for r in records if r["type"] == "run"]
  assert config["ModelConfig.width"] == 192 and config["TrainConfig.trackers"] == [
      "tensorboard", "wandb", "mlflow"]
  logged = bucket_rows(str(tmp_path / "workdirs" / "quickstart-tracked"))
  for name, field in (("train/loss", "loss"), ("eval/loss", "eval_loss")):
    assert [(r["history"]["item"]["_step"], r["history"]["item"][name]) for r in records
            if r["type"] == "history" and name in r["history"]["item"]] == [
                (row["step"], row[field]) for row in logged if field in row], name


# The snippet that loads a trained model ("From Python, a trained model is one call away").
LOAD_SNIPPET = README.split("From Python, a trained model is one call away", 1)[1].split(
    "```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_python_snippet_writes_nothing_to_stderr(trained_workdir, tmp_path):
  """Library use is as quiet as the commands: the snippet prints its continuation and no
  libtpu probe of an absent TPU, TensorFlow start-up line or Orbax notice. It runs in the
  environment a user has: without conftest's settings, and without the TPU_* variables
  that importing JAX and libtpu put into this process (TPU_SKIP_MDS_QUERY alone
  silences part of libtpu's probe)."""
  (tmp_path / "workdirs").mkdir()
  (tmp_path / "workdirs" / "quickstart").symlink_to(trained_workdir[0])
  env = {name: value for name, value in _env().items()
         if name not in ("JAX_PLATFORMS", "TF_CPP_MIN_LOG_LEVEL", "XLA_FLAGS")
         and not name.startswith("TPU_")}
  result = subprocess.run([sys.executable, "-c", LOAD_SNIPPET], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip(), result.stdout
  assert result.stderr == "", result.stderr


@pytest.mark.slow
def test_prepare_command_runs_verbatim_and_the_trainer_reads_its_stores(tmp_path):
  corpus = make_corpus(str(tmp_path / "corpus"))
  env = _env()
  env.update(JAX_PLATFORMS="cpu", GRIFFIN_EXTRA_GIN_PARAMS=f"TRAIN_FILES = '{corpus}/*.txt'")
  prepares = [piece for piece in PIECES if _kind(piece) == "prepare"]
  assert prepares
  for piece in prepares:
    result = _run(piece, cwd=tmp_path, env=env)
    assert result.returncode == 0, (piece, result.stdout[-2000:], result.stderr[-2000:])
    output = dict(arg.split("=", 1) for arg in shlex.split(piece) if "=" in arg)["--output"]
    stores = [name for name in os.listdir(tmp_path / output) if not name.startswith(".")]
    assert sorted(name.split("-")[1] for name in stores) == ["train", "validation"]
    assert result.stderr == "", result.stderr
    # The trainer, given the same config and the output as its cache, opens those stores
    # (Beam wrote them: `prepared_by`) rather than building its own.
    argv = shlex.split(piece)
    files, params = common.gin_arguments(argv)
    gin_config.parse(files, [*params, f"TRAIN_FILES = '{corpus}/*.txt'",
                             f"DataPipeline.cache_dir = '{tmp_path / output}'"])
    try:
      train = gin_config.build(TrainConfig)
      data = gin_config.build(pipeline.DataPipeline, sequence_length=train.sequence_length,
                              batch_size=train.batch_size, seed=train.seed)
      for store in (data.train_store, data.validation_store):
        assert os.path.basename(store.path) in stores
        assert store.metadata["prepared_by"]["runner"] == "apache_beam"
    finally:
      gin.clear_config()


# What a CPU needs to run the TPU example's training command (README, "TPU v5p-128"):
# a tiny Griffin of the same shape family (heads divisible by the mesh's tensor 4), a few
# steps of short rows, and no evaluation in between. Its mesh config (fsdp -1 x tensor 4)
# fits the 8 simulated devices as is.
CPU_OVERRIDES = (
    "VOCAB_SIZE=260", "ModelConfig.width=32", "ModelConfig.rnn_width=32",
    "ModelConfig.depth=3", "ModelConfig.num_heads=4", "ModelConfig.num_gate_blocks=4",
    "ModelConfig.attention_window=8", "ModelConfig.scan_impl='lax'", "TRAIN_STEPS=3",
    "BATCH_SIZE=4", "SEQUENCE_LENGTH=32", "LOG_EVERY=1", "EVAL_EVERY=0",
    "TrainConfig.eval_batches=1")
# The same mesh split over 1 or 2 processes: float32 losses reduced in another order
# (measured: 4.8e-7 at step 3).
TWO_PROCESS_TOLERANCE = 1e-5


def write_c4_stand_in(data_dir: str, corpus: str) -> str:
  """A TFDS `c4/en:3.1.0` directory (C4's features: text, url, timestamp) holding the
  test corpus, for `c4_task.tfds_data_dir`: C4 itself cannot be downloaded here. The
  C4 task, `prepare` and the trainer run unchanged on it."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
  features = tfds.features.FeaturesDict({name: tfds.features.Text()
                                         for name in ("text", "url", "timestamp")})
  version_dir = os.path.join(data_dir, "c4", "en", "3.1.0")
  os.makedirs(version_dir)
  names = sorted(os.listdir(corpus))
  for split, split_names in (("train", names[3:]), ("validation", names[:3])):
    path = os.path.join(version_dir, f"c4-{split}.tfrecord-00000-of-00001")
    with tf.io.TFRecordWriter(path) as writer:
      for name in split_names:
        with open(os.path.join(corpus, name), encoding="utf-8") as f:
          writer.write(features.serialize_example(
              {"text": f.read(), "url": name, "timestamp": "2019-04-01T00:00:00Z"}))
  tfds.folder_dataset.write_metadata(data_dir=version_dir, features=features)
  return data_dir


def tpu_training_command(bucket: str) -> list[str]:
  """The README's TPU example training command, its BUCKET replaced by `bucket`."""
  piece, = [p for p in LAUNCHERS if p.startswith("python -m launch.tpu_vm")]
  argv = shlex.split(piece.replace("gs://BUCKET/", bucket + "/"))
  return argv[argv.index("--") + 1:]


@pytest.mark.slow
@pytest.mark.soak   # 2.5 minutes (Beam, 1 and 2 processes); bucket runs: test_object_storage
def test_tpu_example_trains_against_the_emulated_bucket(gcs_bucket, tmp_path):
  """The issue's "done when": the TPU example runs unchanged against a GCS emulator,
  workdir and token store both in the bucket. `prepare` (2 Beam workers) writes the C4
  config's stores to the bucket; the training command runs with only the CPU overrides
  and `DataPipeline.cache_dir` at the bucket store (C4 read from a local stand-in); the
  same command under `launch.local` on 2 processes x 4 devices reads the same store,
  each process its own rows: its losses are the 1-process run's."""
  corpus = make_corpus(str(tmp_path / "corpus"))
  tfds_dir = write_c4_stand_in(str(tmp_path / "tfds"), corpus)
  data = f"{gcs_bucket}/c4_tokens"
  overrides = [*CPU_OVERRIDES, f"c4_task.tfds_data_dir='{tfds_dir}'",
               f"DataPipeline.cache_dir='{data}'"]
  command = tpu_training_command(gcs_bucket)
  files, params = common.gin_arguments(command)
  # A child process: Beam's threaded runner leaves gRPC threads behind in its process.
  prepared = subprocess.run(
      [sys.executable, "-m", "pretrain.data.prepare", f"--output={data}",
       *[f"--gin_file={f}" for f in files],
       *[f"--gin_param={p}" for p in [*params, *overrides]],
       "--", "--direct_running_mode=multi_threading", "--direct_num_workers=2"],
      env=storage_env(_env(), JAX_PLATFORMS="cpu"), cwd=REPO, capture_output=True,
      text=True, timeout=600)
  assert_ok(prepared)
  stores = dict(re.findall(r"^(\w+): .* rows of \d+: (\S+)$", prepared.stdout, re.M))
  assert set(stores) == {"train", "validation"}, prepared.stdout
  assert all(path.startswith(data + "/c4_en-") for path in stores.values())

  env = storage_env(_env(), JAX_PLATFORMS="cpu",
                    XLA_FLAGS="--xla_force_host_platform_device_count=8")
  argv = [sys.executable if arg == "python" else arg for arg in command]
  argv += [f"--gin_param={override}" for override in overrides]
  workdir = argv[-len(overrides) - 1].split("=", 1)[1]
  assert workdir == f"{gcs_bucket}/runs/griffin_7b"
  result = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=600)
  assert_ok(result)
  assert f"store {stores['train']}" in result.stdout, result.stdout[-3000:]
  one = {row["step"]: row["loss"] for row in bucket_rows(workdir) if "loss" in row}
  assert sorted(one) == [1, 2, 3] and all(np.isfinite(list(one.values())))
  assert storage.exists(storage.join(workdir, "checkpoints"))

  two_workdir = workdir + "_2proc"
  launch = [sys.executable, "-m", "launch.local", "--num_processes=2",
            "--devices_per_process=4", "--",
            *[f"--workdir={two_workdir}" if arg.startswith("--workdir=") else arg
              for arg in argv]]
  result = subprocess.run(launch, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=600)
  assert_ok(result)
  two = {row["step"]: row["loss"] for row in bucket_rows(two_workdir) if "loss" in row}
  assert sorted(two) == sorted(one)
  for step, loss in one.items():
    assert abs(two[step] - loss) <= TWO_PROCESS_TOLERANCE, (step, two[step], loss)
