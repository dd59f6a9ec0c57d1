"""Which cases of a parametrised test run in the fast tier (`-m "not slow"`).

Error-path tests that each start a Python subprocess cost ~5-10 s a case on two cores.
The fast tier keeps the first case, so the path from the command line to a one-line error
stays covered in the inner loop; the full suite (CI) runs every case.
"""
from typing import Iterable, Sequence

import pytest


def slow_after_first(cases: Iterable[Sequence]) -> list:
  """`cases` for `pytest.mark.parametrize`, every case after the first marked slow."""
  return [pytest.param(*case, marks=() if index == 0 else pytest.mark.slow)
          for index, case in enumerate(cases)]
