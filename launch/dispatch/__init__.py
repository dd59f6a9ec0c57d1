"""Dispatch: the contract between a study and the backends that run its runs, below both
the cluster launchers (whose modules each define their cluster's backend) and the
sweeps (which design, execute and collect a study).

  sweep_dispatch.py  the backends' registry, the jobs and submissions they get, and the
                     runs' states read from their directories
  sweep_job.py       the wrapper every run starts through, recording how it ended
  scheduler.py       the scheduler's commands (sbatch, squeue, kubectl, gcloud), each
                     given up after a bound with one line
"""
