"""Small JSON objects (manifests, done markers) beside token-store arrays, local or in a
bucket, through the same tensorstore kvstores as the arrays (`storage.kvstore_spec`).

A whole-object write is atomic on local disks and object stores alike, which is what
makes a manifest written last a commit.
"""
from __future__ import annotations

import json
from typing import Dict, List, Optional

import tensorstore as ts

from plumbing import storage


def _open(directory: str) -> ts.KvStore:
  return ts.KvStore.open(storage.kvstore_spec(directory)).result()


def read_json(directory: str, name: str) -> Optional[Dict]:
  """The JSON object `directory/name`, or None when it does not exist."""
  result = _open(directory).read(name).result()
  return json.loads(result.value) if result.state == "value" else None


def write_json(directory: str, name: str, value: Dict) -> None:
  data = json.dumps(value, indent=1, sort_keys=True).encode()
  _open(directory).write(name, data).result()


def list_names(directory: str, prefix: str) -> List[str]:
  """Keys under `directory` (recursively) that start with `prefix` (not empty). Filtered
  here as well: some GCS emulators ignore the listing range."""
  keys = _open(directory).list(ts.KvStore.KeyRange(prefix, _after(prefix))).result()
  return sorted(k for k in (key.decode() for key in keys) if k.startswith(prefix))


def delete_prefix(directory: str, prefix: str) -> None:
  """Deletes every key under `directory` that starts with `prefix` (not empty), one by
  one: tensorstore's gcs driver deletes a key range by listing it, and a GCS emulator
  that ignores the listing range would have it delete the whole directory (the store's
  manifest and arrays included); a single-key delete is one DELETE of that object."""
  store = _open(directory)
  for future in [store.write(key, None) for key in list_names(directory, prefix)]:
    future.result()


def _after(prefix: str) -> str:
  """The smallest key greater than every key starting with `prefix`."""
  if not prefix:
    raise ValueError("a prefix is required")
  return prefix[:-1] + chr(ord(prefix[-1]) + 1)
