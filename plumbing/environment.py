"""Bounds that a user sets through the environment.

Outside services (the Hub, the schedulers) get their waits bounded by seconds that a user
may need to raise for a slow link or a busy cluster without editing a Gin file: one
environment variable each, read here so that every bound refuses the same bad values
with the same kind of message.
"""

import os

from plumbing.errors import usage_error


def positive_seconds(name: str, default: float, what: str) -> float:
  """Seconds from environment variable `name` when it is set, else `default`.

  Args:
    name: the variable, e.g. `GRIFFIN_SCHEDULER_TIMEOUT_S`.
    default: the bound where the variable is unset or empty.
    what: what the seconds bound, completing "give the seconds ..." in the error.

  Raises:
    UserError: the variable is not a positive number (exit code 2).
  """
  text = os.environ.get(name, "").strip()
  if not text:
    return default
  try:
    value = float(text)
  except ValueError:
    value = 0.0
  if not value > 0:
    raise usage_error(f"{name}={text!r}: give the seconds {what}, a positive number")
  return value
