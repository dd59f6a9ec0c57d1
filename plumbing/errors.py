"""The one user-facing error type, and the exit codes every command shares.

A `UserError` is a problem the user can fix (a missing Gin file, an unknown binding, an
empty corpus, a checkpoint of another model, a diverged run). Its message names the
problem and the fix; `plumbing.cli.run` prints it as one line and exits with its code
instead of showing a stack trace. Subclasses exist only where callers need to tell
cases apart (tests, the trainer's divergence stop, a failed save the trainer retries, an
unreadable checkpoint a restore skips); they never change the exit code rules:

  EXIT_FAILED (1)  the run failed: data, checkpoint, divergence, file-system problems
  EXIT_USAGE  (2)  the command line or configuration is wrong; nothing was run

A problem a command works around and goes on is one `warn` line on stderr.
"""
from __future__ import annotations

import sys
from typing import Optional

EXIT_FAILED = 1
EXIT_USAGE = 2


class UserError(Exception):
  """A failure the user can fix, reported as a message and an exit code.

  Attributes:
    exit_code: EXIT_FAILED or EXIT_USAGE.
  """

  def __init__(self, message: str, exit_code: int = EXIT_FAILED):
    super().__init__(message)
    self.exit_code = exit_code


def usage_error(message: str) -> UserError:
  """A UserError for a wrong command line or configuration (exit code 2)."""
  return UserError(message, exit_code=EXIT_USAGE)


class TrainingDivergedError(UserError):
  """The loss or gradient became NaN or infinite; the newest good checkpoint is kept."""


class CheckpointMismatchError(UserError):
  """A checkpoint's parameters do not fit the configured model."""


class CheckpointSaveError(UserError):
  """Saving checkpoint `step` failed (a full disk, a permission, the storage); callers
  retry or stop.

  Attributes:
    step: the step whose save failed.
    local: whether it was a save to the local tier.
  """

  def __init__(self, step: int, reason: str, directory: str, local: bool = False):
    tier = "local checkpoint" if local else "checkpoint"
    super().__init__(f"{tier} {step} failed: {reason} under {directory}")
    self.step = step
    self.local = local


class UnreadableCheckpointError(UserError):
  """Checkpoint `step` failed its integrity check or could not be read.

  Attributes:
    step: the step.
    tier: the name of its CheckpointTier ("persistent", "local", ...).
    kind: a short name of the problem ("size", "checksum", "missing", "manifest",
      "unreadable"), part of the name the step is set aside as.
    detail: what this process found, one line; None when another process found it.
  """

  def __init__(self, step: int, tier: str, kind: str, detail: Optional[str]):
    name = "checkpoint" if tier == "persistent" else f"{tier} checkpoint"
    super().__init__(f"{name} {step} is unreadable "
                     f"({detail or 'reported by another process'})")
    self.step = step
    self.tier = tier
    self.kind = kind
    self.detail = detail


class CheckpointSaveStop(UserError):
  """An essential tier's save failed, and failed again when retried (a storage that
  refuses, a full disk): the run stops. The trainer first saves the step it reached to
  the best-effort tiers (the local one), where a rerun resumes from it."""


class StorageOutageError(UserError):
  """Object storage has failed every write for longer than `StorageConfig.outage_s`.

  Attributes:
    down_s: seconds since the first failed write of the outage.
  """

  def __init__(self, what: str, down_s: float, outage_s: float, error: BaseException):
    super().__init__(f"{str(error).rstrip('.')}; writing {what} has failed for "
                     f"{down_s:.0f} s, longer than StorageConfig.outage_s = "
                     f"{outage_s:.0f} s")
    self.down_s = down_s


class StorageOutageStop(UserError):
  """The run stopped because its object storage did not answer for longer than
  `StorageConfig.outage_s` (after saving its best-effort tiers, the local one).

  Writes to that storage may still be in flight in threads nothing can cancel: the
  persistent tier's async save (Orbax's thread pools, the storage client retrying for
  minutes). Python joins such threads when it exits, so a process that merely returned
  would wait for the storage it is stopping because of; `plumbing.cli.run` ends the
  process at once (`os._exit`) after printing the error's line.
  """


def warn(message: str) -> None:
  """One line on stderr about a problem the command works around (a failed save it
  retries, an unreadable checkpoint it skips): the non-fatal sibling of a UserError."""
  print(f"warning: {message}", file=sys.stderr, flush=True)
