"""Clusters: the launchers' libraries, each what its `python -m launch.<name>` command
drives, and the sweep backend that runs a study's runs on that cluster.

  common.py   the pieces every launcher shares: the command after `--`, quoting,
              environments, YAML, the restart budget
  cluster_backend.py  the base of the sweep backends that submit to a cluster's queue
  local.py    N cooperating JAX processes on this machine, restarted after a failure
  slurm.py    the sbatch script (requeue on failure and preemption); a study as a job array
  gke.py      the JobSet manifest and its termination grace; a study as one JobSet a run
  tpu_vm.py   the remote command of every TPU VM worker; a study as queued resources

The backends implement the dispatch contract (`launch.dispatch`), the wing below this
one; the study that runs on them (`launch.sweeps`) sits above.
"""
