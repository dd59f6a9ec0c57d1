"""A local GCS emulator for tests and for `launch.chaos --gcs_emulator`: a real HTTP

The library of `python -m launch.gcs_emulator` (launch/gcs_emulator.py, whose docstring is the
command's manual; its flags and main are there).
"""
from __future__ import annotations

import re
from typing import Optional

BUCKET = "bucket"


def environment(endpoint: str) -> dict[str, str]:
  """The variables that point gcsfs, google-cloud-storage and tensorstore at `endpoint`."""
  return {
      "STORAGE_EMULATOR_HOST": endpoint,       # gcsfs and google-cloud-storage
      "TENSORSTORE_GCS_HTTP_URL": endpoint,    # tensorstore's gcs kvstore
      "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",  # tensorstore: no credential lookup
      "FSSPEC_GCS_TOKEN": "anon",              # gcsfs (in subprocesses): no credential lookup
      # google-auth never probes a metadata server off this machine.
      "NO_GCE_CHECK": "True",
      "GCE_METADATA_HOST": "127.0.0.1:9",
      "GCE_METADATA_IP": "127.0.0.1:9",
      # gcsfs's zonal/HNS probe speaks gRPC to the real service; the emulator has none.
      "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
  }


def serve(port: int, data_dir: Optional[str] = None) -> None:
  """Runs gcp-storage-emulator on `port` until killed, in memory or with its objects
  under `data_dir`, with the generation headers of real GCS.

  Its media downloads omit `x-goog-generation`, which GCS sends and tensorstore reads to
  make conditional writes (Orbax's OCDBT manifests); without it every read looks like
  generation 0 and the next conditional write fails as 'Malformed StorageGeneration'.
  The wrapper adds the object's generation headers to each successful download.

  It lists within `startOffset`/`endOffset` as GCS does (`ls` below).

  It also serves suffix byte ranges (`Range: bytes=-N`, the last N bytes), as GCS does
  with HTTP 206 and a `Content-Range`: the emulator serves `bytes=A-B` and `bytes=A-` but
  answers a suffix range with the whole object, and tensorstore reads the index at the
  end of each zarr3 shard with one ("byte range [-132, ?) was ignored by server"). The
  suffix is rewritten to the equivalent `bytes=A-` before the emulator sees it.
  """
  # An optional dependency (the `test` extra): imported only where an emulator runs.
  from gcp_storage_emulator import server as emulator  # pylint: disable=import-outside-toplevel
  from gcp_storage_emulator.handlers import objects  # pylint: disable=import-outside-toplevel
  plain_download = objects.download

  def serve_suffix_range(request, store) -> None:
    suffix = re.fullmatch(r"\s*bytes=-(\d+)\s*", request.get_header("range", "") or "")
    if not suffix:
      return
    try:
      size = len(store.get_file(request.params["bucket_name"], request.params["object_id"]))
    except objects.NotFound:
      return  # the emulator answers 404 itself
    headers = request._request_handler.headers  # pylint: disable=protected-access
    headers.replace_header("Range", f"bytes={max(0, size - int(suffix[1]))}-")

  def download(request, response, store, *args, **kwargs):
    serve_suffix_range(request, store)
    plain_download(request, response, store, *args, **kwargs)
    if response.status in (200, 206):
      obj = store.get_file_obj(request.params["bucket_name"], request.params["object_id"])
      response["x-goog-generation"] = str(obj["generation"])
      response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))

  plain_ls = objects.ls

  def ls(request, response, store, *args, **kwargs):
    """Lists as GCS does, within [startOffset, endOffset): tensorstore lists a key range
    with these parameters (not `prefix`) and strips its path from every returned name,
    and the emulator ignores them. Then any shorter name elsewhere in the bucket made
    tensorstore's C++ abort the process (`basic_string_view::substr`: seen in CI as a
    `pretrain.data.prepare` child dying with SIGABRT once other tests had written to the
    session's bucket)."""
    start, end = (request.query.get(name, [None])[0] for name in ("startOffset", "endOffset"))
    if start is None and end is None:
      return plain_ls(request, response, store, *args, **kwargs)
    in_range = lambda name: (start is None or name >= start) and (end is None or name < end)

    class RangedStore:  # the store, listing only the range (a proxy: requests run in threads)
      def __getattr__(self, name):
        return getattr(store, name)

      def get_file_list(self, *list_args, **list_kwargs):
        files, prefixes = store.get_file_list(*list_args, **list_kwargs)
        return [f for f in files if in_range(f["name"])], [p for p in prefixes if in_range(p)]

    return plain_ls(request, response, RangedStore(), *args, **kwargs)

  objects.download = download  # `objects.get` (?alt=media) calls it through the module
  replaced = {plain_download: download, plain_ls: ls}
  emulator.HANDLERS = tuple(
      (pattern, {method: replaced.get(handler, handler) for method, handler in handlers.items()})
      for pattern, handlers in emulator.HANDLERS)
  server = emulator.create_server("127.0.0.1", port, in_memory=data_dir is None,
                                  default_bucket=BUCKET, data_dir=data_dir)
  server.run()
