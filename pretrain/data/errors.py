"""The error type of the data pipeline.

Every problem a user can fix (a glob that matches nothing, an empty corpus, a bad JSONL
line, a missing SentencePiece model, a batch that cannot be split over processes) is a
`DataError` whose message names the problem and the fix. It is a `UserError`, so the
command-line tools print it as a single line (exit code 1) instead of a stack trace.
"""
from plumbing.errors import UserError


class DataError(UserError):
  """Bad data configuration or input, with a message that says how to fix it."""
