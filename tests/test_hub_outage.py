"""The Hugging Face Hub as an outside service (docs/contracts.md, "Outside services"):
lm_eval tasks whose dataset is on the Hub and not in the cache, with the Hub (a real
socket or HTTP server on loopback, `HF_ENDPOINT`) down, silent, refusing or stalling
after it answered the check, cost one line naming the Hub, the dataset and the fixes,
within `downstream.HUB_PROBE_S` (a stall: `downstream.hub_timeout_s()`), and no client
library's log line on the console; `pretrain.evaluate` says it before it loads any
checkpoint, the trainer before its first step. With the Hub down, a cache filled from a
loopback Hub serves `HF_DATASETS_OFFLINE=1` at once. Without the project's check,
huggingface_hub retried a refused connection for 23 s, its retry warnings on the
console.

A process's huggingface_hub and datasets read HF_ENDPOINT and offline mode when they are
imported, so every test in which a client asks the Hub runs a process of its own."""
import contextlib
import hashlib
import http.server
import json
import logging
import os
import subprocess
import sys
import threading
import time
from typing import Iterator

import pytest

from plumbing.errors import UserError
from pretrain.evaluation import downstream
from storage_servers import free_port
from trainer_helpers import REPO, read_metrics, trainer_env  # pylint: disable=unused-import
import tracker_tools

DATASET = "nobody/not-in-the-cache"
# A dataset the loopback Hub (`serving_hub`) serves: one JSON Lines file, split "test".
SERVED = "nobody/tiny-mc"
SERVED_ROWS = [{"query": f"question {i}", "choices": ["yes", "no"], "label": i % 2}
               for i in range(5)]
SERVED_FILE = "test.jsonl"
SERVED_SHA = "0123456789abcdef0123456789abcdef01234567"   # the repository's commit
TASK_YAML = f"""task: hub_mc
dataset_path: {DATASET}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{query}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
metadata:
  version: 1.0
"""
# Variables through which the Hub client finds a cache, a token or offline mode.
_HUB_VARIABLES = ("HF_", "HUGGING_FACE_")


@contextlib.contextmanager
def refusing_hub(status: int) -> Iterator[str]:
  """A loopback HTTP server answering every request (HEAD included) with `status` and
  the Hub's error header, as the Hub answers a bad token (401) or a dataset the token
  may not read (403); yields its URL."""
  class Refuse(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # pylint: disable=invalid-name
      body = b'{"error": "Invalid credentials in Authorization header"}'
      self.send_response(status)
      self.send_header("Content-Type", "application/json")
      self.send_header("X-Error-Message", "Invalid credentials in Authorization header")
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      if self.command != "HEAD":
        self.wfile.write(body)

    do_HEAD = do_POST = do_GET

    def log_message(self, *args) -> None:   # the test's output is the client's only
      del args

  with tracker_tools.serving(Refuse) as url:
    yield url


@contextlib.contextmanager
def stalling_hub() -> Iterator[tuple[str, list[float], list[str]]]:
  """A loopback HTTP server that answers the project's check (HEAD /, 200) and holds
  every other request unanswered until the block ends, as a Hub that stalls after it
  answered; yields its URL, the times of the checks and the requests held."""
  released = threading.Event()
  checks: list[float] = []
  held: list[str] = []

  class Stall(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self) -> None:  # pylint: disable=invalid-name
      if self.path == "/":
        checks.append(time.monotonic())
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()
        return
      held.append(f"{self.command} {self.path}")
      released.wait()   # no answer; the connection closes when the block ends

    do_GET = do_POST = do_HEAD

    def log_message(self, *args) -> None:
      del args

  with tracker_tools.serving(Stall) as url:
    try:
      yield url, checks, held
    finally:
      released.set()


@contextlib.contextmanager
def serving_hub() -> Iterator[tuple[str, list[str]]]:
  """A loopback Hub holding one dataset repository, `SERVED` (`SERVED_ROWS` in
  `SERVED_FILE` at commit `SERVED_SHA`): the parts of the Hub's HTTP API that `datasets`
  asks to download a repository of data files (its metadata, its file listing, file
  HEADs with the commit and ETag, the files); every other path is 404 with the Hub's
  error code. Yields its URL and the requests it answered."""
  body = "".join(json.dumps(row) + "\n" for row in SERVED_ROWS).encode()
  files = {SERVED_FILE: body}
  served: list[str] = []

  class Hub(http.server.BaseHTTPRequestHandler):
    def answer(self, status: int, content: bytes = b"", **headers: str) -> None:
      self.send_response(status)
      for name, value in headers.items():
        self.send_header(name.replace("_", "-"), value)
      self.send_header("Content-Length", str(len(content)))
      self.end_headers()
      if self.command != "HEAD":
        self.wfile.write(content)

    def do_GET(self) -> None:  # pylint: disable=invalid-name
      served.append(f"{self.command} {self.path}")
      path = self.path.split("?")[0]
      api = f"/api/datasets/{SERVED}"
      for revision in ("main", SERVED_SHA):
        name = path.removeprefix(f"/datasets/{SERVED}/resolve/{revision}/")
        if name in files:
          return self.answer(200, files[name], X_Repo_Commit=SERVED_SHA,
                             ETag=f'"{hashlib.sha1(files[name]).hexdigest()}"')
        if name != path:
          return self.answer(404, X_Error_Code="EntryNotFound", X_Repo_Commit=SERVED_SHA)
      if path in (api, f"{api}/revision/main", f"{api}/revision/{SERVED_SHA}"):
        return self.answer(200, json.dumps(
            {"id": SERVED, "sha": SERVED_SHA, "private": False,
             "siblings": [{"rfilename": name} for name in files]}).encode(),
                           Content_Type="application/json")
      if path == f"{api}/tree/{SERVED_SHA}":
        return self.answer(200, json.dumps(
            [{"type": "file", "path": name, "size": len(content),
              "oid": hashlib.sha1(content).hexdigest()}
             for name, content in files.items()]).encode(), Content_Type="application/json")
      return self.answer(404, b"{}", X_Error_Code="EntryNotFound")

    do_HEAD = do_GET

    def log_message(self, *args) -> None:
      del args

  with tracker_tools.serving(Hub) as url:
    yield url, served


@contextlib.contextmanager
def hub(kind: str) -> Iterator[str]:
  """The Hub's URL for `kind`: a closed port, a socket that accepts and never answers,
  or a server refusing with 401 or 403."""
  if kind == "closed port":
    yield f"http://127.0.0.1:{free_port()}"
  elif kind == "never answers":
    with tracker_tools.silent_server() as url:
      yield url
  else:
    with refusing_hub(int(kind.split()[-1])) as url:
      yield url


def without_hub_settings(env: dict[str, str]) -> dict[str, str]:
  """`env` less the variables through which the Hub client finds a cache, a token or
  offline mode, and the proxies."""
  return {name: value for name, value in env.items()
          if not name.startswith(_HUB_VARIABLES) and not name.lower().endswith("_proxy")}


@pytest.fixture
def tasks(tmp_path, monkeypatch) -> str:
  """An include path with two tasks whose data is on the Hub: hub_mc (`DATASET`, on no
  Hub) and hub_cached (`SERVED`, on `serving_hub`); an empty cache, no token, not
  offline, no proxy."""
  for task, dataset in (("hub_mc", DATASET), ("hub_cached", SERVED)):
    os.makedirs(tmp_path / "tasks" / task)
    (tmp_path / "tasks" / task / f"{task}.yaml").write_text(
        TASK_YAML.replace("hub_mc", task).replace(DATASET, dataset))
  for name in set(os.environ) - set(without_hub_settings(dict(os.environ))):
    monkeypatch.delenv(name)
  monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
  return str(tmp_path / "tasks")


@pytest.mark.parametrize("kind", ["closed port", "never answers"])
def test_a_hub_dataset_with_the_hub_down_or_silent_is_one_line_within_the_probe(
    kind, tasks, monkeypatch, capfd):  # pylint: disable=redefined-outer-name
  """The loader the trainer (`DownstreamEvaluation`) and `pretrain.evaluate` share: one
  error naming the Hub, the dataset and the fixes within `HUB_PROBE_S`, and nothing from
  the clients on the console. In this process: the check reads HF_ENDPOINT when it runs,
  and a client never gets to ask (huggingface_hub read its endpoint at import, so a
  refusing server is tested in a process of its own)."""
  manager = downstream.task_manager(["hub_mc"], tasks)
  capfd.readouterr()
  with hub(kind) as url:
    monkeypatch.setenv("HF_ENDPOINT", url)
    began = time.monotonic()
    with pytest.raises(UserError) as raised:
      downstream.load_tasks(manager, ["hub_mc"])
    took_s = time.monotonic() - began
  message = str(raised.value)
  assert "\n" not in message, message
  assert message.startswith("Cannot load the data of lm_eval task(s) hub_mc: the Hugging "
                            f"Face Hub at {url} (HF_ENDPOINT) does not answer "), message
  assert DATASET in message and "HF_DATASETS_OFFLINE=1" in message, message
  assert "HF_TOKEN" in message, message
  if kind == "closed port":
    assert "Connection refused" in message, message
    assert took_s <= 1, took_s
  else:
    assert f"no answer in {downstream.HUB_PROBE_S:g} s" in message, message
    assert downstream.HUB_PROBE_S - 0.1 <= took_s <= downstream.HUB_PROBE_S + 1, took_s
  assert capfd.readouterr().err == ""   # no client library's log line


@pytest.mark.slow   # one `pretrain.evaluate` process each: its imports take 5-15 s
@pytest.mark.parametrize("kind", ["never answers", "refuses 401", "refuses 403"])
def test_evaluate_with_the_hub_silent_or_refusing_prints_one_line_before_any_checkpoint(
    kind, tasks, tmp_path):  # pylint: disable=redefined-outer-name
  """The command: exit 1 with one line on stderr naming the Hub, the dataset and the
  fixes (for a refusal, huggingface_hub's status quoted), the wait for a silent Hub
  `HUB_PROBE_S` (the process's imports aside), and the workdir, which holds no
  checkpoint, never read: the data is loaded first."""
  with hub(kind) as url:
    env = dict(os.environ, PYTHONPATH=REPO, HF_ENDPOINT=url)
    if kind != "never answers":
      env["HF_TOKEN"] = "hf_" + "0" * 34   # a token the Hub does not take
    result = subprocess.run(
        [sys.executable, "-m", "pretrain.evaluate", f"--workdir={tmp_path / 'none'}",
         "--tasks=hub_mc", f"--include_path={tasks}"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 1, result.stderr
  lines = result.stderr.splitlines()
  assert len(lines) == 1, result.stderr   # the project's line; no client library's
  assert lines[0].startswith("error: Cannot load the data of lm_eval task(s) hub_mc"
                             ), result.stderr
  assert f"the Hugging Face Hub at {url} (HF_ENDPOINT)" in lines[0], result.stderr
  assert DATASET in lines[0] and "HF_DATASETS_OFFLINE=1" in lines[0], result.stderr
  if kind == "never answers":
    assert f"no answer in {downstream.HUB_PROBE_S:g} s" in lines[0], result.stderr
  else:
    assert (f"(HF_ENDPOINT): HTTP {kind.split()[-1]} (Invalid credentials in "
            "Authorization header); ") in lines[0], result.stderr
  assert not os.path.exists(tmp_path / "none")


class StalledManager:
  """An lm_eval TaskManager whose one task's data is on the Hub and whose load blocks
  until released, then logs a retry warning as huggingface_hub does (this process's
  huggingface_hub asks the endpoint of its import, so a stalled client is tested with a
  process of its own below)."""

  def __init__(self):
    self.task_index = {"hub_mc": type("Entry", (), {"cfg": {"task": "hub_mc",
                                                            "dataset_path": DATASET}})}
    self.released, self.logged = threading.Event(), threading.Event()

  def load(self, names: list[str]) -> dict:
    del names
    self.released.wait()
    logging.getLogger("huggingface_hub.utils._http").warning("Retrying in 1s [Retry 1/5].")
    self.logged.set()
    return {}


def test_a_load_past_the_bound_is_one_line_and_its_late_warnings_stay_hidden(
    tasks, monkeypatch, capfd, caplog):  # pylint: disable=redefined-outer-name,unused-argument
  """The bound on loading data from the Hub, in this process: the check answered, the
  load still running at `GRIFFIN_HUB_TIMEOUT_S` is one error then, and the warnings it
  logs afterwards, when it fails at last, reach no handler (huggingface_hub's own writes
  to the stderr of its import)."""
  manager = StalledManager()
  loggers = [logging.getLogger(name) for name in ("lm_eval", "datasets", "huggingface_hub")]
  levels = [logger.level for logger in loggers]
  monkeypatch.setenv("GRIFFIN_HUB_TIMEOUT_S", "0.5")
  try:
    with stalling_hub() as (url, checks, _):
      monkeypatch.setenv("HF_ENDPOINT", url)
      began = time.monotonic()
      with pytest.raises(UserError) as raised:
        downstream.load_tasks(manager, ["hub_mc"])
      took_s = time.monotonic() - began
    manager.released.set()
    assert manager.logged.wait(10)
  finally:
    for logger, level in zip(loggers, levels):
      logger.setLevel(level)
  assert len(checks) == 1
  assert 0.5 <= took_s <= 1.5, took_s
  assert str(raised.value).startswith(
      "Cannot load the data of lm_eval task(s) hub_mc from the Hugging Face Hub at "
      f"{url} (HF_ENDPOINT): it answered but the data had not arrived after 0.5 s "), raised
  assert capfd.readouterr().err == ""
  assert not [record for record in caplog.records if "Retrying" in record.getMessage()]


@pytest.mark.parametrize("value", ["0", "-3", "soon"])
def test_a_hub_bound_that_is_no_positive_number_is_a_usage_error(value, monkeypatch):
  monkeypatch.setenv("GRIFFIN_HUB_TIMEOUT_S", value)
  with pytest.raises(UserError) as raised:
    downstream.hub_timeout_s()
  assert raised.value.exit_code == 2
  assert str(raised.value).startswith(f"GRIFFIN_HUB_TIMEOUT_S={value!r}: give the seconds")


@pytest.mark.slow   # one `pretrain.evaluate` process: its imports take 3-15 s
def test_evaluate_with_a_hub_that_stalls_after_the_check_prints_one_line_within_the_bound(
    tasks, tmp_path):  # pylint: disable=redefined-outer-name
  """A Hub that answers the check and then holds every request: huggingface_hub would
  wait 60 s a try, six tries a file; the command gives up at `GRIFFIN_HUB_TIMEOUT_S`
  (2 s here) after the check with one line on stderr, exit 1, the workdir never read."""
  bound_s = 2
  with stalling_hub() as (url, checks, held):
    env = dict(os.environ, PYTHONPATH=REPO, HF_ENDPOINT=url,
               GRIFFIN_HUB_TIMEOUT_S=str(bound_s))
    result = subprocess.run(
        [sys.executable, "-m", "pretrain.evaluate", f"--workdir={tmp_path / 'none'}",
         "--tasks=hub_mc", f"--include_path={tasks}"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    ended = time.monotonic()
  assert result.returncode == 1, result.stderr
  lines = result.stderr.splitlines()
  assert len(lines) == 1, result.stderr   # the project's line; no client library's
  assert lines[0].startswith(
      "error: Cannot load the data of lm_eval task(s) hub_mc from the Hugging Face Hub "
      f"at {url} (HF_ENDPOINT): it answered but the data had not arrived after "
      f"{bound_s} s (GRIFFIN_HUB_TIMEOUT_S sets the bound"), result.stderr
  assert DATASET in lines[0] and "HF_DATASETS_OFFLINE=1" in lines[0], result.stderr
  assert len(checks) == 1 and held, (checks, held)   # the client asked and was held
  # From the check's answer to the process's end: the bound, then the line and the
  # process's exit (under a second idle; 6 s of headroom on a loaded machine).
  assert bound_s <= ended - checks[0] <= bound_s + 6, ended - checks[0]
  assert not os.path.exists(tmp_path / "none")


# Loads hub_cached's data as the trainer and `pretrain.evaluate` do (the trainer keeping
# its clients' records in argv[2], where given); prints how long the load took and the
# documents.
LOAD_CACHED = """
import json, sys, time
from plumbing import quiet
from pretrain.evaluation import downstream
if len(sys.argv) > 2:
  quiet.keep_client_logs(sys.argv[2])
manager = downstream.task_manager(["hub_cached"], sys.argv[1])
began = time.monotonic()
loaded = downstream.load_tasks(manager, ["hub_cached"])
print(json.dumps({"load_s": time.monotonic() - began,
                  "docs": list(loaded["tasks"]["hub_cached"].eval_docs)}))
"""


@pytest.mark.slow   # two processes of lm_eval's imports: 3-4 s each idle
def test_a_cache_filled_from_the_hub_serves_offline_mode_with_the_hub_down(
    tasks, tmp_path):  # pylint: disable=redefined-outer-name
  """The cache (HF_HOME) filled as a user fills it, by loading the task once from a Hub
  (`serving_hub`); then, with HF_ENDPOINT at a closed port and HF_DATASETS_OFFLINE=1,
  the task's documents load from it: no check, no line, no wait. Both loads print
  nothing on stderr: datasets' "Using the latest cached version" warnings are hidden,
  or, where the run keeps a client log (the trainer's `clients.log`), written there."""
  def load(url: str, *client_log: str, **settings: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", LOAD_CACHED, tasks, *client_log],
        env=dict(os.environ, PYTHONPATH=REPO, HF_ENDPOINT=url, **settings), cwd=REPO,
        capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    return json.loads(result.stdout.splitlines()[-1])

  with serving_hub() as (url, served):
    filled = load(url)
  assert f"GET /datasets/{SERVED}/resolve/{SERVED_SHA}/{SERVED_FILE}" in served, served
  assert filled["docs"] == SERVED_ROWS
  client_log = tmp_path / "clients.log"
  offline = load(f"http://127.0.0.1:{free_port()}", str(client_log), HF_DATASETS_OFFLINE="1")
  assert offline["docs"] == SERVED_ROWS
  assert "WARNING datasets" in client_log.read_text() and \
      "Using the latest cached version" in client_log.read_text(), client_log.read_text()
  assert offline["load_s"] < downstream.HUB_PROBE_S / 2, offline["load_s"]


@pytest.mark.slow   # one trainer process: 10-30 s
def test_training_with_a_hub_task_and_the_hub_down_stops_before_its_first_step(
    tasks, trainer_env, tmp_path):  # pylint: disable=redefined-outer-name
  """`TrainConfig.downstream_tasks` naming a task on the Hub, the Hub at a closed port:
  the trainer loads the tasks' data before its first step, so the run ends there with
  exit 1 and the project's one line on stderr, nothing from a client library on either
  stream, and no step taken or saved."""
  url = f"http://127.0.0.1:{free_port()}"
  workdir = tmp_path / "run"
  env = dict(without_hub_settings(trainer_env.env), HF_HOME=os.environ["HF_HOME"],
             HF_ENDPOINT=url)
  result = subprocess.run(
      trainer_env.train_command(str(workdir), "TrainConfig.downstream_tasks=('hub_mc',)",
                                f"TrainConfig.downstream_include_path='{tasks}'"),
      env=env, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 1, result.stderr[-3000:]
  lines = result.stderr.splitlines()
  assert len(lines) == 1, result.stderr[-3000:]
  assert lines[0].startswith(
      "error: Cannot load the data of lm_eval task(s) hub_mc: the Hugging Face Hub at "
      f"{url} (HF_ENDPOINT) does not answer "), lines[0]
  assert "Connection refused" in lines[0] and DATASET in lines[0], lines[0]
  for client in ("huggingface_hub", "datasets", "urllib3", "httpx", "Retrying"):
    assert client not in result.stdout, result.stdout[-3000:]
  assert read_metrics(str(workdir)) == []   # no step logged
  assert not any((workdir / "checkpoints").iterdir())   # none saved
