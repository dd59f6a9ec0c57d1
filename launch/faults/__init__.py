"""Fault injection: trainings killed and their storage failed on purpose.

  chaos.py           a run under a plan of kills, torn checkpoints, a full disk and
                     bucket outages, compared with an undisturbed reference
  storage_faults.py  a small disk, a cuttable TCP proxy, the emulator's process
  gcs_emulator.py    a local GCS server (the `test` extra), patched where it differs

Imports nothing else of `launch`; the commands start `launch.local` and
`launch.gcs_emulator` as processes.
"""
