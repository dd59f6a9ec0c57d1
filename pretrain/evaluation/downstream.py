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
"""
from __future__ import annotations

import contextlib
import difflib
import io
import json
import logging
import os
from typing import Any, Iterator, Mapping, Optional, Sequence

from plumbing.errors import UserError, usage_error
from pretrain import extras
from pretrain.observability.metrics import DOWNSTREAM_PREFIX
from pretrain.runtime import Runtime

# lm_eval's default seed of few-shot sampling (`simple_evaluate(fewshot_random_seed)`).
FEWSHOT_SEED = 1234


def require_lm_eval() -> None:
  """Raises a one-line usage error naming the `eval` extra when lm_eval is not
  installed; else switches off datasets' download counter, before lm_eval first imports
  datasets."""
  extras.require("lm_eval", extra="eval", purpose="run lm-evaluation-harness tasks")
  os.environ.setdefault("HF_UPDATE_DOWNLOAD_COUNTS", "0")


def _data_error(names: Sequence[str], error: OSError) -> UserError:
  """One line for task data that cannot be read or downloaded."""
  lines = str(error).strip().splitlines()
  return UserError(f"Cannot load the data of lm_eval task(s) {', '.join(names)}: "
                   f"{lines[0] if lines else repr(error)}")


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


def simple_evaluate(lm: Any, names: Sequence[str], manager: Any, *,
                    num_fewshot: Optional[int] = None, limit: Optional[int] = None
                    ) -> dict[str, Any]:
  """lm_eval's `simple_evaluate` of `lm` on the tasks: its results dictionary."""
  from lm_eval import evaluator  # pylint: disable=g-import-not-at-top
  try:
    return evaluator.simple_evaluate(model=lm, tasks=list(names), task_manager=manager,
                                     num_fewshot=num_fewshot, limit=limit,
                                     batch_size=lm.batch_size, log_samples=False)
  except OSError as error:  # a dataset that cannot be downloaded or read
    raise _data_error(names, error) from None


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


@contextlib.contextmanager
def quiet() -> Iterator[None]:
  """Hides lm_eval's log lines and progress bars (tqdm on stderr, which no setting turns
  off once imported): the training console gets one line per evaluation instead, the
  command line our own progress lines and lm_eval's table (`--verbose` shows them all).
  Exceptions still propagate; our progress lines write to the real stderr."""
  logger = logging.getLogger("lm_eval")
  level = logger.level
  logger.setLevel(logging.ERROR)
  try:
    with contextlib.redirect_stderr(io.StringIO()):
      yield
  finally:
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
    try:
      with quiet():
        self._tasks = manager.load(list(names))
    except OSError as error:
      raise _data_error(names, error) from None
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
