"""Clusters: the launchers' libraries, each what its `python -m launch.<name>` command
drives, and the sweep backend that runs a study's runs on that cluster.

  common.py   the pieces every launcher shares: the command after `--`, quoting,
              environments, YAML, the restart budget
  local.py    N cooperating JAX processes on this machine, restarted after a failure
  slurm.py    the sbatch script (requeue on failure and preemption); a study as a job array
  gke.py      the JobSet manifest and its termination grace; a study as one JobSet a run
  tpu_vm.py   the remote command of every TPU VM worker; a study as queued resources

`common` sits below the sweeps' dispatch contract (`launch.sweeps.sweep_dispatch`,
`sweep_job`); the launchers above it, since their backends implement it.
"""
