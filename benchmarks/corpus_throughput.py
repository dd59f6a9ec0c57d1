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
- `tokenize/bytes`, `tokenize/spm`, `tokenize/bpe32k`, ...: the corpus task as the
  trainer builds its store (`materialize.packed_groups`: the source in tf.data, the
  vocabulary's tokenizer and packing into rows of `--sequence_length`), with the byte
  vocabulary, a SentencePiece model (`--spm_vocab`) and byte-level BPE `tokenizer.json`s
  (`--bpe_vocabs`), each trained on the first `--train_documents` documents by `python
  -m pretrain.tokenizer` in a child process, as a user trains one (0 or empty skips);
- `encode/<vocabulary>` (format `text`): the same documents tokenized by the vocabulary
  alone, already in memory and in batches where the library has a batch API (a
  `tokenizer.json`'s `encode_batch`, SentencePiece's list input), with no reading,
  tf.data or packing. Its CPU seconds over the store build's say what bounds the build
  (the `bound by` line under the table).

The readers that load no TensorFlow run first, then the tokenizing ones. Each measure
runs `--repeats` times and keeps the fastest. Rows per second per core
divides by the process's CPU seconds (all threads, user + system), not wall seconds, so
a shared machine's load moves it less, and a reader that uses several threads is
charged for all of them; MB/s/core is the same for the documents' UTF-8 bytes; `vs
baseline` is rows per CPU-second over the baseline's (pyarrow's Arrow read for Parquet,
the hand decoder for `.jsonl.zst`, the byte vocabulary for `encode`). Prints a Markdown
table, what bounds each store build, then one JSON line with every measure.

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
from pretrain.data import vocabularies as vocabularies_lib

flags.DEFINE_integer("rows", 40_000, "Documents in the corpus.")
flags.DEFINE_integer("chars", 2_000, "Mean characters per document.")
flags.DEFINE_integer("files", 4, "Files per format.")
flags.DEFINE_integer("row_group_rows", 2_000, "Rows per Parquet row group.")
flags.DEFINE_integer("repeats", 2, "Runs of each measure; the fastest is kept.")
flags.DEFINE_integer("sequence_length", 1024, "Packed row length when tokenizing.")
flags.DEFINE_integer("spm_vocab", 4096, "SentencePiece vocabulary size (0: skip).")
flags.DEFINE_list("bpe_vocabs", ["32768", "131072"], "Byte-level BPE vocabulary sizes "
                  "(empty: none).")
flags.DEFINE_integer("train_documents", 4000, "Documents the vocabularies are trained on.")
flags.DEFINE_integer("lexicon", 500_000, "Words of the synthetic documents' lexicon.")
flags.DEFINE_float("zipf", 1.1, "Zipf exponent of the words' frequencies. With the "
                   "default lexicon, 4,000 documents hold enough distinct words for a "
                   "byte-level BPE to learn about 128K tokens.")
flags.DEFINE_string("workdir", None, "Where the files go (default: a fresh temporary "
                    "directory).")
FLAGS = flags.FLAGS


def synthetic_documents(rows: int, chars: int, lexicon_size: int = 5000,
                        zipf: float = 1.3, seed: int = 0) -> List[str]:
  """Documents of Zipf-distributed words from a random lexicon, lengths log-normal."""
  rng = np.random.default_rng(seed)
  letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
  lengths = rng.integers(2, 10, lexicon_size)
  lexicon = ["".join(word) for word in
             np.split(rng.choice(letters, size=int(lengths.sum())), np.cumsum(lengths)[:-1])]
  words = np.array(lexicon)[np.minimum(rng.zipf(zipf, size=1_000_000), len(lexicon)) - 1]
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


def encoded_rows(vocabulary: seqio.Vocabulary, texts: List[str], batch: int = 256) -> int:
  """Documents tokenized by `vocabulary` alone (module docstring, `encode/`)."""
  if hasattr(vocabulary, "encode_batch"):              # a tokenizer.json
    for start in range(0, len(texts), batch):
      vocabulary.encode_batch(texts[start:start + batch])
  elif isinstance(vocabulary, seqio.SentencePieceVocabulary):
    for start in range(0, len(texts), batch):
      vocabulary.tokenizer.EncodeAsIds(texts[start:start + batch])
  else:
    for text in texts:
      vocabulary.encode(text)
  return len(texts)


def trained_vocabularies(root: str, texts: List[str]) -> Dict[str, seqio.Vocabulary]:
  """The byte vocabulary and those `python -m pretrain.tokenizer` trains, by name."""
  vocabularies = {"bytes": seqio.ByteVocabulary()}
  sample = os.path.join(root, "vocabulary_sample.txt")
  with open(sample, "w", encoding="utf-8") as f:
    f.write("\n".join(texts[:FLAGS.train_documents]))
  def train(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pretrain.tokenizer", f"--input_glob={sample}",
                    *args], check=True, capture_output=True)
  if FLAGS.spm_vocab:
    model = os.path.join(root, "spm.model")
    train(f"--vocab_size={FLAGS.spm_vocab}", f"--output={model}")
    vocabularies["spm"] = seqio.SentencePieceVocabulary(model)
  for size in map(int, FLAGS.bpe_vocabs):
    directory = os.path.join(root, f"bpe{size}")
    train("--model_type=byte_level_bpe", f"--vocab_size={size}", f"--output={directory}")
    vocabularies[f"bpe{size // 1024}k" if size >= 1024 else f"bpe{size}"] = (
        vocabularies_lib.get_vocabulary(tokenizer_json=directory))
  return vocabularies


def measure(root: str, texts: List[str],
            vocabularies: Dict[str, seqio.Vocabulary]) -> List[Dict]:
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
  measured = {fmt: [(name, timed(count, repeats)) for name, count in counts]
              for fmt, counts in readers.items()}
  measured["text"] = [(f"encode/{name}", timed(lambda: encoded_rows(vocabulary, texts),
                                               repeats))
                      for name, vocabulary in vocabularies.items()]
  for fmt, location in locations.items():
    for name, vocabulary in vocabularies.items():
      task = tasks.corpus_task(location, vocabulary=vocabulary)
      measured[fmt].append((f"tokenize/{name}",
                            timed(lambda: tokenized_rows(task, length), repeats)))
  mb = sum(len(t.encode()) for t in texts) / 1e6
  results = []
  for fmt, rows in measured.items():
    base = rows[0][1]["rows_per_cpu_s"]   # the library's own reader, or bytes
    for reader_name, result in rows:
      results.append({"format": fmt, "reader": reader_name, **result,
                      "mb_per_cpu_s": mb / result["cpu_s"] if result["cpu_s"] else 0.0,
                      "vs_baseline": result["rows_per_cpu_s"] / base})
  return results


def bounds(results: List[Dict]) -> List[str]:
  """For each store build, the share of its CPU time the tokenizer alone takes."""
  encode = {r["reader"].split("/", 1)[1]: r["cpu_s"] for r in results
            if r["reader"].startswith("encode/")}
  lines = []
  for r in results:
    if r["reader"].startswith("tokenize/"):
      name = r["reader"].split("/", 1)[1]
      share = encode[name] / r["cpu_s"]
      what = ("tokenizing" if share >= 0.5 else
              "reading, tf.data and packing (the tokenizer is not)")
      lines.append(f"bound by: {r['format']} {name}: the tokenizer alone is {share:.0%} of "
                   f"the store build's CPU time: {what}")
  return lines


def main(_) -> None:
  root = FLAGS.workdir or tempfile.mkdtemp(prefix="corpus_throughput_")
  texts = synthetic_documents(FLAGS.rows, FLAGS.chars, FLAGS.lexicon, FLAGS.zipf)
  write_corpus(root, texts, FLAGS.files, FLAGS.row_group_rows)
  vocabularies = trained_vocabularies(root, texts)
  results = measure(root, texts, vocabularies)
  mb = sum(len(t.encode()) for t in texts) / 1e6
  sizes = ", ".join(f"{name} {vocabulary.vocab_size:,}"
                    for name, vocabulary in vocabularies.items())
  print(f"{FLAGS.rows} documents, {mb:.1f} MB of text, {FLAGS.files} files per format, "
        f"{os.cpu_count()} cores; vocabulary sizes: {sizes}")
  print("| format | reader | rows | wall s | CPU s | rows/s | rows/s/core | MB/s/core | "
        "vs baseline |")
  print("|---|---|---|---|---|---|---|---|---|")
  for r in results:
    print(f"| {r['format']} | {r['reader']} | {r['rows']} | {r['wall_s']:.2f} | "
          f"{r['cpu_s']:.2f} | {r['rows_per_s']:,.0f} | {r['rows_per_cpu_s']:,.0f} | "
          f"{r['mb_per_cpu_s']:.2f} | {r['vs_baseline']:.3f} |")
  print("\n".join(bounds(results)))
  print(json.dumps({"rows": FLAGS.rows, "text_mb": mb, "results": results,
                    "vocab_sizes": {name: vocabulary.vocab_size
                                    for name, vocabulary in vocabularies.items()}}))


if __name__ == "__main__":
  cli.run(main)
