"""The base of the sweep backends that submit a study's runs to a cluster's queue
(`launch.sweep --backend=slurm|gke|tpu_vm`): the flags they share and their `dispatch`.

It lives with the launchers rather than in `launch.dispatch` because its flags are the
launchers' own (`--env` as `common.parse_env_flags` reads it), and the dispatch contract
sits below every launcher.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Dict, List, Sequence

from absl import flags

from launch.clusters import common
from launch.dispatch.sweep_dispatch import (Job, Study, Submission, define_once,
                                            submit_when_ready)


@dataclasses.dataclass(frozen=True)
class ClusterBackend:
  """The base of the backends that submit to a cluster's queue: what their jobs share
  (flags of `launch.sweep`: a job name prefix, a shell line run before each run, the
  runs' environment) and `dispatch` through `submit_when_ready`; a subclass adds its
  `name`, resources, flags and `submissions` (its spec builder)."""
  job_name: str = "sweep"
  setup: str = ""
  env: Dict[str, str] = dataclasses.field(default_factory=dict)

  name: ClassVar[str]
  here: ClassVar[bool] = False

  @staticmethod
  def define_cluster_flags(tpu: bool = False) -> None:
    """--job_name, --setup, --env (and --tpu_type with `tpu`), once for all backends."""
    define_once(flags.DEFINE_string, "job_name", "sweep", "Cluster job name prefix.")
    define_once(flags.DEFINE_string, "setup", "",
                "Cluster: shell line before each run (venv, cd).")
    define_once(flags.DEFINE_multi_string, "env", [],
                "Cluster: NAME=VALUE environment of each run.")
    if tpu:
      define_once(flags.DEFINE_string, "tpu_type", None,
                  "TPU backends: the slice of each run, e.g. v5p-8.")

  @staticmethod
  def cluster_flags(values: flags.FlagValues) -> Dict[str, Any]:
    """The shared fields' values from the parsed flags."""
    return dict(job_name=values.job_name, setup=values.setup,
                env=common.parse_env_flags(values.env))

  def dispatch(self, jobs: Sequence[Job], study: Study) -> List[str]:
    return submit_when_ready(self.name, jobs, study, self.submissions)

  def submissions(self, jobs: Sequence[Job], attempt: int,
                  study_dir: str) -> List[Submission]:
    """The commands that submit `jobs` (`attempt`: a time stamp that keeps the names of
    resubmitted jobs apart; `study_dir`: where logs may go)."""
    raise NotImplementedError
