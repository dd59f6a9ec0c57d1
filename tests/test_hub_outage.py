"""The Hugging Face Hub as an outside service (docs/contracts.md, "Outside services"):
lm_eval tasks whose dataset is on the Hub and not in the cache, with the Hub (a real
socket or HTTP server on loopback, `HF_ENDPOINT`) down, silent or refusing, cost one line
naming the Hub, the dataset and the fixes, within `downstream.HUB_PROBE_S`, and no
client library's log line on the console; `pretrain.evaluate` says it before it loads
any checkpoint. Without the project's check, huggingface_hub retried a refused
connection for 23 s, its retry warnings on the console."""
import contextlib
import http.server
import os
import subprocess
import sys
import time
from typing import Iterator

import pytest

from plumbing.errors import UserError
from pretrain.evaluation import downstream
from storage_servers import free_port
from trainer_helpers import REPO
import tracker_tools

DATASET = "nobody/not-in-the-cache"
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


@pytest.fixture
def tasks(tmp_path, monkeypatch) -> str:
  """An include path with one task whose data is on the Hub, an empty cache, no token,
  not offline, no proxy."""
  os.makedirs(tmp_path / "tasks" / "hub_mc")
  (tmp_path / "tasks" / "hub_mc" / "hub_mc.yaml").write_text(TASK_YAML)
  for name in list(os.environ):
    if name.startswith(_HUB_VARIABLES) or name.lower().endswith("_proxy"):
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
