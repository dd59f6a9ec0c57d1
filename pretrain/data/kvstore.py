"""Small objects (manifests, done markers) and array locations, local or in a bucket.

Token stores are written and read through tensorstore kvstores, so one code path serves
a local directory, `gs://` and `s3://` (tensorstore's own drivers; no cloud client here).
A location is a local path or a URL that tensorstore understands (`gs://bucket/dir`,
`s3://bucket/dir`, `file:///dir`, `memory://`).
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

import tensorstore as ts


def is_url(location: str) -> bool:
  return "://" in location


def join(location: str, *names: str) -> str:
  """`location/name/...` for paths and URLs alike."""
  if not is_url(location):
    return os.path.join(location, *names)
  return "/".join([location.rstrip("/"), *names])


def spec(location: str) -> Any:
  """The tensorstore kvstore spec of a directory (a path or URL)."""
  if is_url(location):
    return location.rstrip("/") + "/"
  return {"driver": "file", "path": os.path.abspath(os.path.expanduser(location)) + "/"}


def _open(directory: str) -> ts.KvStore:
  return ts.KvStore.open(spec(directory)).result()


def read_json(directory: str, name: str) -> Optional[Dict]:
  """The JSON object `directory/name`, or None when it does not exist."""
  result = _open(directory).read(name).result()
  return json.loads(result.value) if result.state == "value" else None


def write_json(directory: str, name: str, value: Dict) -> None:
  """Writes `directory/name` in one put (atomic on object stores and local disks)."""
  data = json.dumps(value, indent=1, sort_keys=True).encode()
  _open(directory).write(name, data).result()


def list_names(directory: str, prefix: str = "") -> List[str]:
  """Keys under `directory` (recursively) that start with `prefix`."""
  store = _open(directory)
  keys = store.list(ts.KvStore.KeyRange(prefix, _after(prefix)) if prefix else None)
  return sorted(key.decode() for key in keys.result())


def delete_prefix(directory: str, prefix: str) -> None:
  """Deletes every key under `directory` starting with `prefix` (not empty)."""
  if not prefix:
    raise ValueError("refusing to delete a whole kvstore")
  _open(directory).delete_range(ts.KvStore.KeyRange(prefix, _after(prefix))).result()


def _after(prefix: str) -> str:
  """The smallest key greater than every key starting with `prefix`."""
  return prefix[:-1] + chr(ord(prefix[-1]) + 1)
