"""The Apache Beam pipeline that writes token stores from many workers.

For each split (a `StorePlan`), in three stages:
1. Pack: one element per input shard (`materialize.num_shards`); a worker tokenises and
   packs its shard, streaming, into a staging store `.staging/shard-NNNNN/` and then
   writes the done marker `.staging/shard-NNNNN.json` (rows, tokens, documents, the
   worker's peak RSS). A shard whose marker exists is skipped, so a re-run after a crash
   redoes only unfinished shards.
2. Assemble: once every shard is packed, the row counts give each shard's offset in the
   final arrays (shard 0's rows first, as the in-process build writes them). The final
   arrays are cut into their shard files (`token_store.rows_per_shard` rows each); one
   element per file copies its rows out of the staging stores, so every file has
   exactly one writer, and marks it done in `.done/`.
3. Commit: `metadata.json` (the manifest the trainer requires) is written last; then the
   staging data and markers are deleted. A store without the manifest is never opened.

Workers re-register the SeqIO task from the Gin files and bindings the command was given
(`register_task`), so the pipeline runs on any Beam runner whose workers have this
repository installed.
"""
from __future__ import annotations

import dataclasses
import re
import resource
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import apache_beam as beam
import numpy as np
import seqio

from plumbing import storage
from pretrain.data import kvstore, materialize, token_store

STAGING = ".staging"
DONE = ".done"


@dataclasses.dataclass(frozen=True)
class StorePlan:
  """One split's store: what to pack, and where."""
  name: str                 # the store's name (`materialize.store_name`)
  path: str                 # the store's directory or URL
  task: str
  split: str
  sequence_length: int
  max_documents: Optional[int]
  num_shards: int
  with_loss_mask: bool


def staging_path(plan: StorePlan, index: int) -> str:
  return storage.join(plan.path, STAGING, f"shard-{index:05d}")


def shard_marker_name(index: int) -> str:
  return f"{STAGING}/shard-{index:05d}.json"


def shard_markers(plan: StorePlan) -> List[Dict]:
  """Done markers of the packed input shards (fewer than `num_shards` if unfinished)."""
  names = kvstore.list_names(plan.path, f"{STAGING}/shard-")
  return [kvstore.read_json(plan.path, name) for name in names
          if re.fullmatch(rf"{STAGING}/shard-\d+\.json", name)]


def peak_rss_bytes() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


class _TaskDoFn(beam.DoFn):
  """A DoFn that needs the SeqIO task registered in its worker."""

  def __init__(self, register_task: Callable[[], str], tasks: Sequence[str]):
    super().__init__()
    self._register_task = register_task
    self._tasks = tuple(tasks)

  def setup(self):
    known = set(seqio.TaskRegistry.names()) | set(seqio.MixtureRegistry.names())
    if not known.issuperset(self._tasks):
      self._register_task()


class PackShard(_TaskDoFn):
  """(plan, shard index) -> (store name, (index, marker)) after staging the shard."""

  def process(self, element: Tuple[StorePlan, int]) -> Iterator:
    plan, index = element
    marker = kvstore.read_json(plan.path, shard_marker_name(index))
    if marker is not None:
      beam.metrics.Metrics.counter("prepare", "shards_skipped").inc()
      yield plan.name, (index, marker)
      return
    provider = materialize.get_provider(plan.task)
    writer = token_store.StoreWriter(staging_path(plan, index), plan.sequence_length,
                                     plan.with_loss_mask)
    documents = 0
    for packed, count in materialize.packed_groups(
        provider, plan.split, plan.sequence_length, plan.max_documents,
        seqio.ShardInfo(index, plan.num_shards)):
      writer.append(packed)
      documents += count
    writer.close()
    marker = {"rows": writer.num_rows, "tokens": writer.num_tokens,
              "documents": documents, "peak_rss_bytes": peak_rss_bytes()}
    kvstore.write_json(plan.path, shard_marker_name(index), marker)
    beam.metrics.Metrics.counter("prepare", "shards_packed").inc()
    yield plan.name, (index, marker)


def part_pieces(rows: Sequence[int], rows_per_part: int
                ) -> List[List[Tuple[int, int, int]]]:
  """For each part (shard file) of the final arrays, the (input shard, first staged
  row, row count) pieces that fill it, in order."""
  offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
  total = int(offsets[-1])
  parts = []
  for start in range(0, total, rows_per_part):
    end = min(start + rows_per_part, total)
    pieces = []
    shard = int(np.searchsorted(offsets, start, side="right")) - 1
    position = start
    while position < end:
      take = min(end, int(offsets[shard + 1])) - position
      if take > 0:
        pieces.append((shard, position - int(offsets[shard]), take))
      position += take
      shard += 1
    parts.append(pieces)
  return parts


class PlanParts(beam.DoFn):
  """(store name, shard markers) -> one element per part of the final arrays, after
  creating those arrays at their final size."""

  def __init__(self, plans: Dict[str, StorePlan]):
    super().__init__()
    self._plans = plans

  def process(self, element) -> Iterator:
    name, indexed = element
    plan = self._plans[name]
    markers = dict(indexed)
    rows = [markers[i]["rows"] for i in range(plan.num_shards)]
    per_part = token_store.rows_per_shard(plan.sequence_length)
    if sum(rows):  # an empty split has nothing to commit; `prepare` reports it
      token_store.create_arrays(plan.path, plan.sequence_length, plan.with_loss_mask,
                                sum(rows))
    for part, pieces in enumerate(part_pieces(rows, per_part)):
      yield name, (part, part * per_part, pieces)


class WritePart(beam.DoFn):
  """Copies one part's rows from the staging stores into the final arrays."""

  def __init__(self, plans: Dict[str, StorePlan]):
    super().__init__()
    self._plans = plans

  def process(self, element) -> Iterator:
    name, (part, start, pieces) = element
    plan = self._plans[name]
    marker = f"{DONE}/part-{part:08d}.json"
    if kvstore.read_json(plan.path, marker) is None:
      names = list(token_store.array_dtypes(plan.with_loss_mask))
      final = token_store.open_arrays(plan.path, names)
      position = start
      for shard, first, count in pieces:
        staged = token_store.open_arrays(staging_path(plan, shard), names)
        for array_name in names:
          data = staged[array_name][first:first + count].read().result()
          final[array_name][position:position + count].write(data).result()
        position += count
      kvstore.write_json(plan.path, marker, {"rows": position - start})
    yield name, part


class Commit(beam.DoFn):
  """Writes the manifest once every part is written, then removes the staging data."""

  def __init__(self, plans: Dict[str, StorePlan]):
    super().__init__()
    self._plans = plans

  def process(self, element) -> Iterator:
    name, _ = element
    plan = self._plans[name]
    markers = shard_markers(plan)
    manifest = manifest_of(plan, markers)
    kvstore.write_json(plan.path, token_store.METADATA, manifest)
    kvstore.delete_prefix(plan.path, STAGING + "/")
    kvstore.delete_prefix(plan.path, DONE + "/")
    yield name


def manifest_of(plan: StorePlan, markers: List[Dict]) -> Dict:
  """The store's metadata.json: the fields the in-process build writes, plus how it was
  prepared."""
  return {
      "format": token_store.FORMAT_VERSION,
      "num_rows": sum(m["rows"] for m in markers),
      "num_tokens": sum(m["tokens"] for m in markers),
      "num_documents": sum(m["documents"] for m in markers),
      "sequence_length": plan.sequence_length,
      "arrays": sorted(token_store.array_dtypes(plan.with_loss_mask)),
      "task": plan.task,
      "split": plan.split,
      "num_shards": plan.num_shards,
      "prepared_by": {"runner": "apache_beam",
                      "peak_worker_rss_bytes": max(m["peak_rss_bytes"] for m in markers)},
  }


def build(root: beam.Pipeline, plans: Sequence[StorePlan],
          register_task: Callable[[], str]) -> None:
  """Adds the pack / assemble / commit stages for `plans` to the pipeline `root`."""
  by_name = {plan.name: plan for plan in plans}
  tasks = sorted({plan.task for plan in plans})
  packed = (root
            | "Shards" >> beam.Create([(plan, i) for plan in plans
                                       for i in range(plan.num_shards)])
            | "SpreadShards" >> beam.Reshuffle()
            | "Pack" >> beam.ParDo(PackShard(register_task, tasks))
            | "GroupShards" >> beam.GroupByKey())
  (packed
   | "PlanParts" >> beam.ParDo(PlanParts(by_name))
   | "SpreadParts" >> beam.Reshuffle()
   | "WriteParts" >> beam.ParDo(WritePart(by_name))
   | "GroupParts" >> beam.GroupByKey()
   | "Commit" >> beam.ParDo(Commit(by_name)))
