"""Which cases of a parametrised test run in the fast tier (`-m "not slow"`).

Error-path tests that each start a Python subprocess cost ~5-10 s a case on two cores.
The fast tier keeps the first case, so the path from the command line to a one-line error
stays covered in the inner loop; the full suite (CI) runs every case.
"""
from typing import Any, Callable, Iterable, Optional, Sequence

import pytest


def slow_after_first(cases: Iterable[Sequence],
                     group: Optional[Callable[[Sequence], Any]] = None) -> list:
  """`cases` for `pytest.mark.parametrize`, every case after the first marked slow; with
  `group`, the first case of each group (e.g. of each command) stays fast."""
  seen = set()
  params = []
  for case in cases:
    key = group(case) if group else None
    params.append(pytest.param(*case, marks=pytest.mark.slow if key in seen else ()))
    seen.add(key)
  return params
