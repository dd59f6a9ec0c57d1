"""The one exception type of the data pipeline.

Every problem a user can fix (a glob that matches nothing, an empty corpus, a bad JSONL
line, a missing SentencePiece model, a batch that cannot be split over processes) is a
`DataError` whose message names the problem and the fix, so command-line tools can
print it as a single line instead of a stack trace.
"""


class DataError(ValueError):
  """Bad data configuration or input, with a message that says how to fix it."""
