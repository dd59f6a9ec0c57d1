"""Downstream tasks of EleutherAI's lm-evaluation-harness, scored by our JAX model.

`pretrain.evaluate --tasks=...` runs `lm_eval.simple_evaluate` on a checkpoint and
prints lm_eval's own table; `TrainConfig.downstream_tasks` runs the same tasks on a
training run's live parameters (`DownstreamEvaluation`), as `downstream/<task>/<metric>`
metrics. The model is `pretrain.evaluation.lm_eval_backend.JaxLM`.

lm_eval is optional (the `eval` extra), so it is imported on first use, after
`require_lm_eval` has turned its absence into one line saying how to install it
(`pretrain.extras`); the commands and the trainer import this module for free.

Tasks are lm_eval's, or YAML tasks in an include path (`TaskManager(include_path=...)`,
as lm_eval's `--include_path`). Indexing lm_eval's ~15,000 built-in task configs takes
about 8 s, so when every requested name is a task of the include path the built-ins are
not indexed. Nothing here reaches the network for a local task: datasets' download
counter (a request to the Hub per dataset load) is switched off unless the environment
sets HF_UPDATE_DOWNLOAD_COUNTS; tasks hosted on the Hub download (and cache) their data
as in lm_eval, and HF_DATASETS_OFFLINE=1 makes them use the cache only.

The Hugging Face Hub is an outside service (docs/contracts.md, "Outside services"). When
a requested task's dataset is on the Hub and the cache is not forced (no
HF_DATASETS_OFFLINE / HF_HUB_OFFLINE), `check_hub` first opens one connection to the Hub
(`HF_ENDPOINT`, else huggingface.co) and waits for its first byte, at most
`HUB_PROBE_S` in all: `datasets` would otherwise retry a refused connection for about 23
s (huggingface_hub's backoff, no setting for it) and wait out its timeouts on a Hub that
accepts and never answers (a minute and more), its retry warnings on the console. A Hub
that does not answer, or that refuses (401, 403), is one line naming the Hub, the
dataset and the fixes (`HF_DATASETS_OFFLINE=1` with a filled cache, `HF_TOKEN`,
`HF_ENDPOINT`), before any checkpoint loads. huggingface_hub's per-request timeouts
(HF_HUB_ETAG_TIMEOUT, HF_HUB_DOWNLOAD_TIMEOUT) default to `HUB_REQUEST_TIMEOUT_S` where
unset. They do not bound a Hub that answers the check and then stalls: huggingface_hub
asks again with a fixed 60 s timeout and retries that five times with backoff: 3 s (its
agent registry) + 10 + 6 x 60 s + 23 s of backoff, about 6.5 minutes for the first file
alone (its first five tries measured against a loopback Hub). So the data of such tasks loads in a thread of its own, waited for at
most `hub_timeout_s()` (`GRIFFIN_HUB_TIMEOUT_S`, else `HUB_LOAD_S`), and then that is
the line. `quiet` hides datasets' and huggingface_hub's warnings too (their handlers
write to the stderr of their import, which redirect_stderr does not reach): offline,
datasets warns twice that it uses the cache.
"""
from __future__ import annotations

import contextlib
import difflib
import io
import json
import logging
import os
import socket
import ssl
import threading
import time
import urllib.parse
from typing import Any, Iterator, Mapping, Optional, Sequence

from plumbing import environment
from plumbing import quiet as quiet_logs
from plumbing.errors import UserError, usage_error
from pretrain import extras
from pretrain.observability.metrics import DOWNSTREAM_PREFIX
from pretrain.runtime import Runtime

# lm_eval's default seed of few-shot sampling (`simple_evaluate(fewshot_random_seed)`).
FEWSHOT_SEED = 1234
# The most a check that the Hub answers waits (connection and first byte of the reply).
HUB_PROBE_S = 5.0
# huggingface_hub's per-request timeouts (its own defaults too), set where unset.
HUB_REQUEST_TIMEOUT_S = 10
# The most the data of tasks on the Hub may take to load once the Hub has answered the
# check. Most of lm_eval's datasets are megabytes; a large one on a slow link needs more
# (`GRIFFIN_HUB_TIMEOUT_S`), and what it downloaded stays in the cache for the next try.
HUB_LOAD_S = 300.0
HUB_TIMEOUT_ENV = "GRIFFIN_HUB_TIMEOUT_S"
# The loggers `quiet` keeps off the console: lm_eval's, and those of the clients it
# loads data with, which go to the run's client log where it keeps one.
_QUIET_LOGGERS = ("lm_eval", "datasets", "huggingface_hub")
_HUB_CLIENT_LOGGERS = ("datasets", "huggingface_hub")
_HUB_TIMEOUTS = ("HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT")
_OFFLINE = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
# `datasets`' packaged builders: a task naming one reads local files (`data_files`).
_LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas", "imagefolder",
                   "audiofolder", "webdataset", "sql", "xml")


def require_lm_eval() -> None:
  """Raises a one-line usage error naming the `eval` extra when lm_eval is not
  installed; else switches off datasets' download counter, before lm_eval first imports
  datasets."""
  extras.require("lm_eval", extra="eval", purpose="run lm-evaluation-harness tasks")
  os.environ.setdefault("HF_UPDATE_DOWNLOAD_COUNTS", "0")
  for name in _HUB_TIMEOUTS:
    os.environ.setdefault(name, str(HUB_REQUEST_TIMEOUT_S))


def _offline() -> bool:
  """Whether `datasets` is told to use its cache only."""
  return any(os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")
             for name in _OFFLINE)


def _hub_endpoint() -> str:
  """The Hub huggingface_hub talks to (HF_ENDPOINT, else huggingface.co)."""
  return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def hub_datasets(manager: Any, names: Sequence[str]) -> list[str]:
  """The Hub datasets the tasks `names` would download: each task's `dataset_path`,
  unless its data is local (`custom_dataset`, a directory, one of `datasets`' builders
  of local files). A group or tag counts as its own name (its tasks are lm_eval's, whose
  data is on the Hub)."""
  found = []
  for name in names:
    entry = manager.task_index.get(name)
    config = (entry.cfg or {}) if entry is not None else {}
    if config.get("group") or "task" not in config or isinstance(config["task"], list):
      found.append(name)
      continue
    path = config.get("dataset_path")
    if (config.get("custom_dataset") or not path or path in _LOCAL_BUILDERS
        or os.path.exists(path)):
      continue
    found.append(path)
  return found


def hub_timeout_s() -> float:
  """The bound on loading tasks' data from the Hub: `GRIFFIN_HUB_TIMEOUT_S` when set,
  else `HUB_LOAD_S`.

  Raises:
    UserError: the variable is not a positive number (exit code 2).
  """
  return environment.positive_seconds(
      HUB_TIMEOUT_ENV, HUB_LOAD_S,
      "the data of lm_eval tasks may take to load from the Hugging Face Hub")


def _hub_hint(datasets: Sequence[str]) -> str:
  """What a line about the Hub says to check."""
  return (f"dataset(s) {', '.join(datasets)}: check HF_ENDPOINT and the network, "
          "HF_TOKEN for a gated or private dataset, or set HF_DATASETS_OFFLINE=1 to read "
          "them from a filled cache (HF_HOME)")


def check_hub(manager: Any, names: Sequence[str]) -> None:
  """Fails in one line, within `HUB_PROBE_S`, when a task's dataset is on the Hub, the
  cache is not forced, and the Hub (`HF_ENDPOINT`) does not answer: one connection and
  the first byte of the reply to a HEAD request, instead of huggingface_hub's retries.
  Skipped behind an HTTP(S) proxy, which may be the only route to the Hub.

  Raises:
    UserError: the Hub is unreachable or silent (naming it, the datasets and the fixes).
  """
  proxies = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")
  if _offline() or any(os.environ.get(name) for name in proxies):
    return
  datasets = hub_datasets(manager, names)
  if not datasets:
    return
  endpoint = _hub_endpoint()
  parsed = urllib.parse.urlsplit(endpoint)
  tls = parsed.scheme == "https"
  host, port = parsed.hostname or "", parsed.port or (443 if tls else 80)
  deadline = time.monotonic() + HUB_PROBE_S
  try:
    with socket.create_connection((host, port), timeout=HUB_PROBE_S) as connection:
      connection.settimeout(max(deadline - time.monotonic(), 0.01))
      if tls:   # the handshake is the answer; the certificate is the client's to check
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        context.wrap_socket(connection, server_hostname=host).close()
      else:
        connection.sendall(f"HEAD / HTTP/1.1\r\nHost: {host}\r\nConnection: close"
                           "\r\n\r\n".encode("ascii"))
        connection.recv(1)
  except OSError as error:
    reason = (f"no answer in {HUB_PROBE_S:g} s" if isinstance(error, TimeoutError)
              else error.strerror or str(error))
    raise UserError(f"Cannot load the data of lm_eval task(s) {', '.join(names)}: the "
                    f"Hugging Face Hub at {endpoint} (HF_ENDPOINT) does not answer "
                    f"({host}:{port}: {reason}); {_hub_hint(datasets)}") from None


def _http_status(error: BaseException) -> Optional[str]:
  """"HTTP <status> (<the Hub's X-Error-Message>)" of the first HTTP answer among the
  causes of `error`: `datasets` reports a 403 as a file not found, the status three
  causes down."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    if isinstance(status, int):
      words = response.headers.get("X-Error-Message") if response.headers else None
      return f"HTTP {status}" + (f" ({words})" if words else "")
    error = error.__cause__ or error.__context__
  return None


def _data_error(names: Sequence[str], error: OSError, manager: Any = None) -> UserError:
  """One line for task data that cannot be read or downloaded; for data on the Hub
  (not offline), naming the Hub and the fixes."""
  lines = [line for line in str(error).strip().splitlines() if line.strip()]
  text = lines[0] if lines else repr(error)
  datasets = hub_datasets(manager, names) if manager is not None else []
  if datasets and not _offline():
    status = _http_status(error)
    return UserError(f"Cannot load the data of lm_eval task(s) {', '.join(names)} from "
                     f"the Hugging Face Hub at {_hub_endpoint()} (HF_ENDPOINT): "
                     f"{status or text}; {_hub_hint(datasets)}")
  return UserError(f"Cannot load the data of lm_eval task(s) {', '.join(names)}: {text}")


def _load_within(manager: Any, names: Sequence[str], bound_s: float
                 ) -> Optional[dict[str, Any]]:
  """`manager.load(names)` in a daemon thread, waited for at most `bound_s`; None when
  it has not ended by then. A thread cannot be stopped: a load given up on is left to
  end (or to die with the process), its outcome dropped."""
  outcome: dict[str, Any] = {}

  def load() -> None:
    try:
      outcome["loaded"] = manager.load(list(names))
    except BaseException as error:  # pylint: disable=broad-exception-caught
      outcome["error"] = error      # raised in the caller's thread, or dropped if late

  thread = threading.Thread(target=load, name="lm_eval task data", daemon=True)
  thread.start()
  thread.join(bound_s)
  if thread.is_alive():
    return None
  if "error" in outcome:
    raise outcome["error"]
  return outcome["loaded"]


def load_tasks(manager: Any, names: Sequence[str], *, verbose: bool = False
               ) -> dict[str, Any]:
  """lm_eval's `manager.load(names)` ({"tasks", "groups", "group_map"}), their data
  downloaded or read, after `check_hub`; lm_eval's and the Hub clients' output hidden
  (`quiet`) unless `verbose`. Data on the Hub (not offline) must load within
  `hub_timeout_s()`; past it the load is left behind with the clients' warnings hidden
  for good (unless `verbose`): it may go on retrying for minutes.

  Raises:
    UserError: the Hub does not answer, refuses or stalls, or the data cannot be read.
  """
  check_hub(manager, names)
  datasets = [] if _offline() else hub_datasets(manager, names)
  bound_s = hub_timeout_s() if datasets else None
  try:
    with contextlib.nullcontext() if verbose else quiet():
      loaded = (manager.load(list(names)) if bound_s is None
                else _load_within(manager, names, bound_s))
  except OSError as error:
    raise _data_error(names, error, manager) from None
  if loaded is None:
    if not verbose:   # the load left behind retries on: not a word of it after the line
      for name in _hidden_loggers():
        logging.getLogger(name).setLevel(logging.ERROR)
    raise UserError(f"Cannot load the data of lm_eval task(s) {', '.join(names)} from the "
                    f"Hugging Face Hub at {_hub_endpoint()} (HF_ENDPOINT): it answered but "
                    f"the data had not arrived after {bound_s:g} s ({HUB_TIMEOUT_ENV} "
                    f"sets the bound; raise it for a large dataset or a slow link); "
                    f"{_hub_hint(datasets)}")
  return loaded


def top_level(loaded: Mapping[str, Any]) -> list[Any]:
  """The tasks and groups of `load_tasks`' result that are no group's member: what
  `simple_evaluate` takes to evaluate them without loading them again."""
  members = {child for children in loaded["group_map"].values() for child in children}
  return [item for name, item in [*loaded["groups"].items(), *loaded["tasks"].items()]
          if name not in members]


def task_manager(names: Sequence[str], include_path: Optional[str] = None) -> Any:
  """lm_eval's TaskManager for `names`, after checking that it knows each of them.

  Raises:
    UserError: lm_eval is missing, the include path does not exist, or a name is no
      task, group or tag (exit code 2, naming the nearest known names).
  """
  require_lm_eval()
  from lm_eval.tasks import TaskManager  # pylint: disable=g-import-not-at-top
  if not names:
    raise usage_error("No downstream task given")
  if include_path:
    if not os.path.isdir(include_path):
      raise usage_error(f"The task include path {include_path} is not a directory")
    local = TaskManager(include_path=include_path, include_defaults=False)
    if set(names) <= set(local.all_subtasks):
      return local
  manager = TaskManager(include_path=include_path)
  known = manager.all_tasks
  for name in names:
    if name not in known:
      near = difflib.get_close_matches(name, known, n=3)
      hint = f"; did you mean {', '.join(near)}?" if near else ""
      where = f" or in {include_path}" if include_path else ""
      raise usage_error(f"Unknown lm_eval task {name!r}: not one of lm_eval's tasks"
                        f"{where}{hint}")
  return manager


def backend(runtime: Runtime, params: Any, vocabulary: Any, *, max_length: int,
            batch_size: int, progress: bool = False) -> Any:
  """A `pretrain.evaluation.lm_eval_backend.JaxLM` (imported here: it subclasses lm_eval's LM)."""
  require_lm_eval()
  from pretrain.evaluation.lm_eval_backend import JaxLM  # pylint: disable=g-import-not-at-top
  return JaxLM(runtime, params, vocabulary, max_length=max_length, batch_size=batch_size,
               progress=progress)


def simple_evaluate(lm: Any, names: Sequence[Any], manager: Any, *,
                    num_fewshot: Optional[int] = None, limit: Optional[int] = None
                    ) -> dict[str, Any]:
  """lm_eval's `simple_evaluate` of `lm` on the tasks (names, or `top_level` of
  `load_tasks`, already loaded): its results dictionary."""
  from lm_eval import evaluator  # pylint: disable=g-import-not-at-top
  if any(isinstance(name, str) for name in names):
    check_hub(manager, [name for name in names if isinstance(name, str)])
  try:
    return evaluator.simple_evaluate(model=lm, tasks=list(names), task_manager=manager,
                                     num_fewshot=num_fewshot, limit=limit,
                                     batch_size=lm.batch_size, log_samples=False)
  except OSError as error:  # a dataset that cannot be downloaded or read
    named = all(isinstance(name, str) for name in names)
    raise _data_error([str(name) for name in names], error,
                      manager if named else None) from None


def results_table(results: Mapping[str, Any]) -> str:
  """lm_eval's own Markdown tables of the results (tasks, then groups if any)."""
  from lm_eval import utils  # pylint: disable=g-import-not-at-top
  tables = [utils.make_table(results)]
  if results.get("groups"):
    tables.append(utils.make_table(results, "groups"))
  return "\n".join(tables)


def results_json(results: Mapping[str, Any]) -> str:
  """The results as lm_eval's command line writes them."""
  from lm_eval import utils  # pylint: disable=g-import-not-at-top
  return json.dumps(results, indent=2, default=utils.handle_non_serializable,
                    ensure_ascii=False) + "\n"


def metric_values(results: Mapping[str, Any]) -> dict[str, float]:
  """{'downstream/<task>/<metric>': value} of every numeric metric of every task and
  group; a metric of a filter other than lm_eval's "none" is '<metric>/<filter>'."""
  values = {}
  for task, metrics in results.get("results", {}).items():
    for key, value in metrics.items():
      metric, _, filter_name = key.partition(",")
      if (not filter_name or metric.endswith("_stderr") or isinstance(value, bool)
          or not isinstance(value, (int, float))):
        continue
      suffix = "" if filter_name == "none" else f"/{filter_name}"
      values[f"{DOWNSTREAM_PREFIX}{task}/{metric}{suffix}"] = float(value)
  return values


def _hidden_loggers() -> tuple[str, ...]:
  """The loggers to hide below ERROR: all of `_QUIET_LOGGERS`, less the Hub clients'
  where the run keeps a client log, which then receives their records instead (the
  trainer's `clients.log`)."""
  if quiet_logs.route_to_client_log(_HUB_CLIENT_LOGGERS):
    return tuple(name for name in _QUIET_LOGGERS if name not in _HUB_CLIENT_LOGGERS)
  return _QUIET_LOGGERS


@contextlib.contextmanager
def quiet() -> Iterator[None]:
  """Hides lm_eval's, datasets' and huggingface_hub's log lines below ERROR (the latter
  two go to the run's client log instead where it keeps one) and the progress bars (tqdm on stderr, which no setting turns off once imported): the training
  console gets one line per evaluation instead, the command line our own progress lines
  and lm_eval's table (`--verbose` shows them all). Exceptions still propagate; our
  progress lines write to the real stderr."""
  loggers = [logging.getLogger(name) for name in _hidden_loggers()]
  levels = [logger.level for logger in loggers]
  for logger in loggers:
    logger.setLevel(logging.ERROR)
  try:
    with contextlib.redirect_stderr(io.StringIO()):
      yield
  finally:
    for logger, level in zip(loggers, levels):
      logger.setLevel(level)


class DownstreamEvaluation:
  """The downstream tasks of a training run, evaluated on its live parameters.

  The tasks (and their datasets) load once, at construction, so an unknown name or an
  unreachable dataset stops the run before its first step; each call then runs lm_eval's
  evaluator on the given parameters with the same few-shot examples every time. On
  several hosts every process calls it (the backend's batches span all of them) and all
  get the same values.
  """

  def __init__(self, names: Sequence[str], runtime: Runtime, vocabulary: Any, *,
               max_length: int, batch_size: int, include_path: Optional[str] = None,
               limit: Optional[int] = None):
    manager = task_manager(names, include_path)
    self._tasks = load_tasks(manager, names)
    for task in self._tasks["tasks"].values():
      if task.get_config("num_fewshot") is None:
        task.set_config(key="num_fewshot", value=0)
    self._limit = limit
    self._lm = backend(runtime, None, vocabulary, max_length=max_length,
                       batch_size=batch_size)

  def __call__(self, params: Any) -> dict[str, float]:
    """`metric_values` of `params` on the tasks."""
    from lm_eval import evaluator  # pylint: disable=g-import-not-at-top
    self._lm.params = params
    for task in self._tasks["tasks"].values():
      task.set_fewshot_seed(seed=FEWSHOT_SEED)
    try:
      with quiet():
        results = evaluator.evaluate(lm=self._lm, task_dict=self._tasks, limit=self._limit,
                                     bootstrap_iters=0, log_samples=False)
    finally:
      self._lm.params = None
    return metric_values(results)
