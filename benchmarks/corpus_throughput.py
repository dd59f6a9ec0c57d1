"""Rows per second of reading and tokenizing a corpus in the formats it ships in, against
the reading libraries' own speed on the same files, measured side by side in one run.

Writes the same synthetic documents (`--rows`, about `--chars` characters each, words of
a random lexicon) as Parquet files (`--files`, row groups of `--row_group_rows`) and as
`.jsonl.zst` files, then times, one after another in this process:

- `pyarrow`: pyarrow reading the text column of the Parquet files (Arrow arrays, no
  Python objects), and the same read converted to Python strings (`pyarrow+pylist`);
- `zstd+json`: the `.jsonl.zst` files decoded by hand (zstandard's stream reader, a text
  wrapper, `json.loads` per line);
- `source`: our source (`ParquetDataSource`, `JsonlDataSource`) yielding every text;
- `tokenize/bytes`, `tokenize/spm`: the corpus task as the trainer builds its store
  (`materialize.packed_groups`: the source in tf.data, SeqIO's tokenizer and packing
  into rows of `--sequence_length`), with the byte vocabulary and with a SentencePiece
  model (`--spm_vocab`, trained on the first 2,000 documents by `python -m
  pretrain.tokenizer` in a child process, as a user trains one; 0 skips it).

The readers that load no TensorFlow run first, then the tokenizing ones. Each measure
runs `--repeats` times and keeps the fastest. Rows per second per core
divides by the process's CPU seconds (all threads, user + system), not wall seconds, so
a shared machine's load moves it less, and a reader that uses several threads is
charged for all of them; `vs baseline` is rows per CPU-second over the baseline's
(pyarrow's Arrow read for Parquet, the hand decoder for `.jsonl.zst`). Prints a Markdown
table, then one JSON line with every measure.

  nice -n 19 python benchmarks/corpus_throughput.py --rows=40000
"""
from __future__ import annotations

from plumbing import quiet
quiet.setup()  # first, before JAX or TensorFlow load: see plumbing/quiet.py
# pylint: disable=wrong-import-position
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import seqio
import zstandard
from absl import flags

from plumbing import cli
from pretrain.data import materialize, sources, tasks

flags.DEFINE_integer("rows", 40_000, "Documents in the corpus.")
flags.DEFINE_integer("chars", 2_000, "Mean characters per document.")
flags.DEFINE_integer("files", 4, "Files per format.")
flags.DEFINE_integer("row_group_rows", 2_000, "Rows per Parquet row group.")
flags.DEFINE_integer("repeats", 2, "Runs of each measure; the fastest is kept.")
flags.DEFINE_integer("sequence_length", 1024, "Packed row length when tokenizing.")
flags.DEFINE_integer("spm_vocab", 4096, "SentencePiece vocabulary size (0: skip).")
flags.DEFINE_string("workdir", None, "Where the files go (default: a fresh temporary "
                    "directory).")
FLAGS = flags.FLAGS


def synthetic_documents(rows: int, chars: int, seed: int = 0) -> List[str]:
  """Documents of Zipf-distributed words from a random lexicon, lengths log-normal."""
  rng = np.random.default_rng(seed)
  letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
  lexicon = ["".join(rng.choice(letters, size=int(n))) for n in rng.integers(2, 10, 5000)]
  words = np.array(lexicon)[np.minimum(rng.zipf(1.3, size=100_000), len(lexicon)) - 1]
  lengths = np.clip(rng.lognormal(np.log(chars / 6) - 0.5, 1.0, rows), 1,
                    len(words) // 2).astype(int)
  starts = rng.integers(0, len(words) - lengths)
  return [" ".join(words[start:start + n]) for start, n in zip(starts, lengths)]


def write_corpus(root: str, texts: List[str], files: int, row_group_rows: int) -> None:
  """`root/parquet/part-i.parquet` and `root/zst/part-i.jsonl.zst`, the same rows."""
  os.makedirs(os.path.join(root, "parquet"), exist_ok=True)
  os.makedirs(os.path.join(root, "zst"), exist_ok=True)
  for i, part in enumerate(np.array_split(np.arange(len(texts)), files)):
    chunk = [texts[j] for j in part]
    pq.write_table(pa.table({"id": part, "text": chunk}),
                   os.path.join(root, "parquet", f"part-{i}.parquet"),
                   row_group_size=row_group_rows)
    lines = "".join(json.dumps({"id": int(j), "text": t}) + "\n" for j, t in zip(part, chunk))
    with open(os.path.join(root, "zst", f"part-{i}.jsonl.zst"), "wb") as f:
      f.write(zstandard.ZstdCompressor(level=3).compress(lines.encode()))


def timed(count: Callable[[], int], repeats: int) -> Dict[str, float]:
  """The fastest of `repeats` runs of `count` (which returns the rows it read)."""
  best = None
  for _ in range(repeats):
    wall, cpu = time.perf_counter(), time.process_time()
    rows = count()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if best is None or cpu < best["cpu_s"]:
      best = {"rows": rows, "wall_s": wall, "cpu_s": cpu}
  best["rows_per_s"] = best["rows"] / best["wall_s"]
  best["rows_per_cpu_s"] = best["rows"] / best["cpu_s"]
  return best


def pyarrow_rows(root: str, as_python: bool) -> int:
  rows = 0
  for name in sorted(os.listdir(os.path.join(root, "parquet"))):
    parquet = pq.ParquetFile(os.path.join(root, "parquet", name))
    for batch in parquet.iter_batches(columns=["text"], use_threads=False):
      rows += len(batch.column(0).to_pylist()) if as_python else batch.num_rows
  return rows


def zstd_json_rows(root: str) -> int:
  rows = 0
  for name in sorted(os.listdir(os.path.join(root, "zst"))):
    with open(os.path.join(root, "zst", name), "rb") as raw:
      reader = zstandard.ZstdDecompressor().stream_reader(raw)
      for line in io.TextIOWrapper(reader, encoding="utf-8"):
        rows += isinstance(json.loads(line)["text"], str)
  return rows


def source_rows(source: sources.ShardedTextSource) -> int:
  return sum(1 for _ in source.split_texts(sources.TRAIN))


def tokenized_rows(task: str, sequence_length: int) -> int:
  """Documents through the trainer's store build (every input shard, in order)."""
  provider = materialize.get_provider(task)
  shards = materialize.num_shards(provider, "train")
  return sum(count for index in range(shards)
             for _, count in materialize.packed_groups(
                 provider, "train", sequence_length,
                 shard=seqio.ShardInfo(index, shards)))


def measure(root: str, spm_model: str | None) -> List[Dict]:
  """Every measure of the module docstring, as rows of the table (by format)."""
  repeats, length = FLAGS.repeats, FLAGS.sequence_length
  locations = {"parquet": os.path.join(root, "parquet"),
               "jsonl.zst": os.path.join(root, "zst")}
  readers = {
      "parquet": [("pyarrow", lambda: pyarrow_rows(root, False)),
                  ("pyarrow+pylist", lambda: pyarrow_rows(root, True)),
                  ("source", lambda: source_rows(
                      sources.ParquetDataSource(locations["parquet"])))],
      "jsonl.zst": [("zstd+json", lambda: zstd_json_rows(root)),
                    ("source", lambda: source_rows(
                        sources.JsonlDataSource(locations["jsonl.zst"])))]}
  vocabularies = {"bytes": seqio.ByteVocabulary()}
  if spm_model:
    vocabularies["spm"] = seqio.SentencePieceVocabulary(spm_model)
  measured = {fmt: [(name, timed(count, repeats)) for name, count in counts]
              for fmt, counts in readers.items()}
  for fmt, location in locations.items():
    for name, vocabulary in vocabularies.items():
      task = tasks.corpus_task(location, vocabulary=vocabulary)
      measured[fmt].append((f"tokenize/{name}",
                            timed(lambda: tokenized_rows(task, length), repeats)))
  results = []
  for fmt, rows in measured.items():
    base = rows[0][1]["rows_per_cpu_s"]   # the library's own reader
    for reader_name, result in rows:
      results.append({"format": fmt, "reader": reader_name, **result,
                      "vs_baseline": result["rows_per_cpu_s"] / base})
  return results


def main(_) -> None:
  root = FLAGS.workdir or tempfile.mkdtemp(prefix="corpus_throughput_")
  texts = synthetic_documents(FLAGS.rows, FLAGS.chars)
  write_corpus(root, texts, FLAGS.files, FLAGS.row_group_rows)
  spm_model = None
  if FLAGS.spm_vocab:
    sample = os.path.join(root, "spm_sample.txt")
    with open(sample, "w", encoding="utf-8") as f:
      f.write("\n".join(texts[:2000]))
    spm_model = os.path.join(root, "spm.model")
    subprocess.run([sys.executable, "-m", "pretrain.tokenizer", f"--input_glob={sample}",
                    f"--vocab_size={FLAGS.spm_vocab}", f"--output={spm_model}"],
                   check=True, capture_output=True)
  results = measure(root, spm_model)
  mb = sum(len(t.encode()) for t in texts) / 1e6
  print(f"{FLAGS.rows} documents, {mb:.1f} MB of text, {FLAGS.files} files per format, "
        f"{os.cpu_count()} cores")
  print("| format | reader | rows | wall s | CPU s | rows/s | rows/s/core | vs baseline |")
  print("|---|---|---|---|---|---|---|---|")
  for r in results:
    print(f"| {r['format']} | {r['reader']} | {r['rows']} | {r['wall_s']:.2f} | "
          f"{r['cpu_s']:.2f} | {r['rows_per_s']:,.0f} | {r['rows_per_cpu_s']:,.0f} | "
          f"{r['vs_baseline']:.3f} |")
  print(json.dumps({"rows": FLAGS.rows, "text_mb": mb, "results": results}))


if __name__ == "__main__":
  cli.run(main)
