"""SeqIO tasks: the definition of every corpus (source + preprocessors + vocabulary).

Tasks are registered by Gin-configurable functions that return the registered name,
so a config can write `DataPipeline.task = @text_files_task()` and the pipeline can
equally take any other registered SeqIO task or mixture by name.

Every language-modelling task here has one output feature, `targets`: the document's
tokens followed by EOS. Empty documents are dropped.

`corpus_task` registers a Parquet, JSONL (plain, gzip, zstd) or `datasets`-directory
corpus (`pretrain.data.sources`); `mixture` (pretrain/data/mixing.py) weights several.

TFDS tasks (need the dataset downloaded, or `tfds_data_dir` pointing at a copy):
- `c4_en`: C4 English (`c4/en`), one web page per document; splits train/validation.
- `wikitext103`: WikiText-103 raw (`wikitext/wikitext-103-raw-v1`); TFDS yields one
  line per example, so lines are joined back into whole articles (an article starts
  at a ` = Title = ` line) before tokenising; splits train/validation/test.
Both are registered with the byte vocabulary when the pipeline first looks a task up
(`register_default_tasks`); `c4_task(vocabulary=...)` and
`wikitext103_task(vocabulary=...)` register variants for other vocabularies.
"""
from __future__ import annotations

import functools
import hashlib
import json
from typing import Mapping, Optional, Sequence

from etils import epy
import gin

from pretrain.data import corpus_files
from pretrain.data import hf_vocabulary
from pretrain.data.vocabularies import short_vocabulary_name, vocabulary_fingerprint

# SeqIO and TensorFlow load on first use (about 6 s): commands that only parse
# configs, print help or plan memory never touch them.
with epy.lazy_imports():
  import seqio
  import tensorflow as tf
  from pretrain.data import sources  # defines a seqio.DataSource subclass

C4_TFDS_NAME = "c4/en:3.1.0"
WIKITEXT103_TFDS_NAME = "wikitext/wikitext-103-raw-v1:1.0.0"
# A level-1 WikiText heading (" = Title = "); level-2+ headings have "= =".
_WIKITEXT_TITLE = r"\s*= [^=](.*[^=])? =\s*"


def drop_empty_targets(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """Drops documents with no tokens, so they never become EOS-only documents."""
  return dataset.filter(lambda ex: tf.size(ex["targets"]) > 0)


_TOKENIZE_BATCH = 256  # documents per `encode_batch` call of a tokenizer.json


def tokenize_targets(dataset: tf.data.Dataset,
                     output_features: Mapping[str, seqio.Feature]) -> tf.data.Dataset:
  """`targets` text -> ids. A `tokenizer.json` vocabulary encodes 256 documents per call
  (its Rust threads, not one Python call per document); others as SeqIO does."""
  vocabulary = output_features["targets"].vocabulary
  if not isinstance(vocabulary, hf_vocabulary.HfTokenizerVocabulary):
    return seqio.preprocessors.tokenize(dataset, output_features,
                                        copy_pretokenized=False)
  return (dataset.batch(_TOKENIZE_BATCH)
          .map(lambda ex: {"targets": vocabulary.encode_tf(ex["targets"])})
          .unbatch())


def language_modeling_preprocessors(text_key: str = "text"):
  """text -> tokenised `targets` without empty documents -> EOS appended."""
  return [
      functools.partial(seqio.preprocessors.rekey, key_map={"targets": text_key}),
      tokenize_targets,
      drop_empty_targets,
      seqio.preprocessors.append_eos,
  ]


def language_modeling_features(vocabulary: seqio.Vocabulary):
  return {"targets": seqio.Feature(vocabulary, add_eos=True, dtype=tf.int32)}


def _register(task: seqio.Task) -> str:
  """Registers `task`, replacing an earlier task of the same name."""
  if task.name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(task.name)
  seqio.TaskRegistry.add_provider(task.name, task)
  return task.name


@gin.configurable
def text_files_task(train_files: str = gin.REQUIRED,
                    validation_fraction: float = 0.02,
                    exclude: Sequence[str] = corpus_files.DEFAULT_EXCLUDE,
                    vocabulary: Optional[seqio.Vocabulary] = None,
                    name: Optional[str] = None,
                    shard_bytes: int = corpus_files.DEFAULT_SHARD_BYTES) -> str:
  """Registers a task over the files matching a glob; returns its name.

  Args:
    train_files: glob (recursive `**`, `{stdlib}` placeholder); one document per
      file, or per line for `.jsonl` files with a `text` field.
    validation_fraction: expected fraction of documents held out as the
      `validation` split, chosen by a hash of each document's path (0 = no split).
    exclude: globs of paths to skip (by default installed packages and caches).
    vocabulary: defaults to bytes.
    name: task name; by default derived from the other arguments.
    shard_bytes: text per input shard; shards are packed separately (each padded at
      its end) and are the unit of work of `python -m pretrain.data.prepare`.
  """
  vocabulary = vocabulary or seqio.ByteVocabulary()
  if name is None:
    key = json.dumps([train_files, validation_fraction, list(exclude),
                      vocabulary_fingerprint(vocabulary), shard_bytes])
    name = (f"text_files_{short_vocabulary_name(vocabulary)}_"
            f"{hashlib.sha256(key.encode()).hexdigest()[:10]}")
  source = sources.TextFilesDataSource(train_files, validation_fraction, exclude,
                                       shard_bytes)
  return _register(seqio.Task(
      name, source=source,
      preprocessors=language_modeling_preprocessors(),
      output_features=language_modeling_features(vocabulary),
      shuffle_buffer_size=None))


@gin.configurable
def corpus_task(files: str = gin.REQUIRED,
                text_field: str = "text",
                format: Optional[str] = None,  # pylint: disable=redefined-builtin
                validation_fraction: float = 0.0,
                skip_bad_shards: bool = False,
                hf_split: str = "train",
                shard_bytes: int = corpus_files.PARQUET_SHARD_BYTES,
                vocabulary: Optional[seqio.Vocabulary] = None,
                name: Optional[str] = None) -> str:
  """Registers a task over a corpus in the format it ships in; returns its name.

  Args:
    files: a glob, a directory of shards or one file, local or `gs://` / `s3://`:
      Parquet (`*.parquet`), JSON lines (`*.jsonl`, `*.jsonl.gz`, `*.jsonl.zst`) or a
      `datasets` `save_to_disk` directory.
    text_field: the column (Parquet, Arrow) or field (JSONL) holding each document.
    format: `parquet`, `jsonl` or `hf_dataset`; by default told from `files`.
    validation_fraction: expected fraction of documents held out as the `validation`
      split, by a hash of each document's file and row (0 = no split).
    skip_bad_shards: warn about unreadable shards and train without them, instead of
      stopping with an error naming the first one.
    hf_split: the split of a `DatasetDict` directory.
    shard_bytes: Parquet: text per input shard (whole row groups, 256 MiB by default; a
      large file is read by several `prepare` workers). JSONL and Arrow files are one
      shard each.
    vocabulary: defaults to bytes.
    name: task name; by default derived from the other arguments.

  Scope it to name several corpora in one config (`web/corpus_task.files = ...`), e.g.
  for `mixture` (pretrain/data/mixing.py).
  """
  vocabulary = vocabulary or seqio.ByteVocabulary()
  fmt = format or sources.detect_format(files)
  scope = gin.current_scope_str()
  flag = f"{scope}/corpus_task.files" if scope else "corpus_task.files"
  kwargs = ({"hf_split": hf_split} if fmt == "hf_dataset" else
            {"shard_bytes": shard_bytes} if fmt == "parquet" else {})
  source = sources.source_for(fmt)(files, text_field, validation_fraction,
                                   skip_bad_shards, flag=flag, **kwargs)
  if name is None:
    key = json.dumps([files, text_field, fmt, validation_fraction, skip_bad_shards,
                      hf_split, shard_bytes, vocabulary_fingerprint(vocabulary)])
    name = (f"corpus_{fmt}_{short_vocabulary_name(vocabulary)}_"
            f"{hashlib.sha256(key.encode()).hexdigest()[:10]}")
  return _register(seqio.Task(
      name, source=source,
      preprocessors=language_modeling_preprocessors(),
      output_features=language_modeling_features(vocabulary),
      shuffle_buffer_size=None))


def join_wikitext_articles(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """Joins TFDS WikiText's one-line examples into one example per article.

  Lines are accumulated until the next level-1 title line; a sentinel title appended
  to the stream flushes the last article. Blank lines are kept (they separate
  paragraphs in the raw text).
  """
  sentinel = tf.data.Dataset.from_tensors({"text": tf.constant(" = = = \n")})
  lines = dataset.map(lambda ex: {"text": ex["text"]}).concatenate(sentinel)
  is_sentinel = lambda text: tf.equal(text, " = = = \n")

  def step(article, example):
    line = example["text"]
    line = tf.cond(tf.strings.regex_full_match(line, ".*\n"),
                   lambda: line, lambda: line + "\n")
    starts_article = tf.logical_or(
        tf.strings.regex_full_match(line, _WIKITEXT_TITLE),
        is_sentinel(example["text"]))
    emit = tf.logical_and(starts_article,
                          tf.strings.length(tf.strings.strip(article)) > 0)
    new_article = tf.where(starts_article, line, article + line)
    return new_article, {"emit": emit, "text": article}

  return (lines.scan(tf.constant(""), step)
          .filter(lambda ex: ex["emit"])
          .map(lambda ex: {"text": ex["text"]}))


def _tfds_task(base_name: str, tfds_name: str, splits: Sequence[str],
               vocabulary: Optional[seqio.Vocabulary],
               tfds_data_dir: Optional[str], extra_preprocessors=()) -> str:
  vocabulary = vocabulary or seqio.ByteVocabulary()
  suffix = short_vocabulary_name(vocabulary)
  name = base_name if suffix == "bytes" else f"{base_name}_{suffix}"
  source = seqio.TfdsDataSource(
      tfds_name, splits={s: s for s in splits}, tfds_data_dir=tfds_data_dir)
  return _register(seqio.Task(
      name, source=source,
      preprocessors=list(extra_preprocessors) + language_modeling_preprocessors(),
      output_features=language_modeling_features(vocabulary),
      shuffle_buffer_size=None))


@gin.configurable
def c4_task(vocabulary: Optional[seqio.Vocabulary] = None,
            tfds_name: str = C4_TFDS_NAME,
            tfds_data_dir: Optional[str] = None) -> str:
  """Registers C4 English (`c4_en`, or `c4_en_<vocab>`); returns its name."""
  return _tfds_task("c4_en", tfds_name, ("train", "validation"), vocabulary,
                    tfds_data_dir)


@gin.configurable
def wikitext103_task(vocabulary: Optional[seqio.Vocabulary] = None,
                     tfds_name: str = WIKITEXT103_TFDS_NAME,
                     tfds_data_dir: Optional[str] = None) -> str:
  """Registers WikiText-103 raw (`wikitext103[_<vocab>]`); returns its name."""
  return _tfds_task("wikitext103", tfds_name, ("train", "validation", "test"),
                    vocabulary, tfds_data_dir,
                    extra_preprocessors=[join_wikitext_articles])


def register_default_tasks() -> None:
  """Registers `c4_en` and `wikitext103` with the byte vocabulary, once.

  The data pipeline calls this before it looks a task up, rather than this module on
  import, so that importing the Gin configurables does not load TensorFlow.
  """
  if "c4_en" not in seqio.TaskRegistry.names():
    _tfds_task("c4_en", C4_TFDS_NAME, ("train", "validation"), None, None)
  if "wikitext103" not in seqio.TaskRegistry.names():
    _tfds_task("wikitext103", WIKITEXT103_TFDS_NAME, ("train", "validation", "test"), None,
               None, extra_preprocessors=[join_wikitext_articles])
