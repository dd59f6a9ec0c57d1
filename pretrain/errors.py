"""The one user-facing error type, and the exit codes every command shares.

A `UserError` is a problem the user can fix (a missing Gin file, an unknown binding, an
empty corpus, a checkpoint of another model, a diverged run). Its message names the
problem and the fix; `pretrain.cli.run` prints it as one line and exits with its code
instead of showing a stack trace. Subclasses exist only where callers need to tell
cases apart (tests, the trainer's divergence stop); they never change the exit code
rules:

  EXIT_FAILED (1)  the run failed: data, checkpoint, divergence, file-system problems
  EXIT_USAGE  (2)  the command line or configuration is wrong; nothing was run
"""
from __future__ import annotations

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
