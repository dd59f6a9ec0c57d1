"""DataPipeline on real SeqIO tasks over tiny corpora, with real tensorstore stores."""
import collections
import concurrent.futures
import json
import os
import time

import numpy as np
import pytest
import seqio
import tensorflow as tf

from plumbing.errors import UserError
from pretrain.data import DataError, corpus_files, pipeline, sources, tasks, token_store
from pretrain.data.packing import PackedRows
from pretrain.data.vocabularies import get_vocabulary

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]


def write_corpus(directory, count=24, seed=0):
  """Files `doc<i>.txt` whose text starts with a unique marker; some are long."""
  rng = np.random.default_rng(seed)
  directory.mkdir(parents=True, exist_ok=True)
  texts = {}
  for i in range(count):
    n = int(rng.integers(2, 60)) if i % 5 else 150  # every 5th spans several rows
    text = f"<doc{i}> " + " ".join(rng.choice(WORDS, size=n))
    (directory / f"doc{i}.txt").write_text(text)
    texts[f"<doc{i}>"] = text
  (directory / "empty.txt").write_text("")
  return texts


def make_pipeline(tmp_path, pattern, **kwargs):
  defaults = dict(sequence_length=64, batch_size=8, seed=0,
                  cache_dir=str(tmp_path / "cache"))
  defaults.update(kwargs)
  fraction = defaults.pop("validation_fraction", 0.25)
  vocabulary = defaults.pop("vocabulary", None)
  task = tasks.text_files_task(train_files=pattern, validation_fraction=fraction,
                               vocabulary=vocabulary)
  return pipeline.DataPipeline(task=task, **defaults)


def segments(vocabulary, features):
  """Decoded text of every segment (document piece) in a batch of rows."""
  out = []
  for targets, seg in zip(features["targets"], features["segment_ids"]):
    for s in range(1, seg.max() + 1):
      ids = targets[seg == s].tolist()
      out.append((vocabulary.decode(ids), ids[-1] == vocabulary.eos_id))
  return out


def all_rows(store):
  return store.read(np.arange(store.num_rows))


def test_text_files_pipeline_packs_real_documents(tmp_path):
  texts = write_corpus(tmp_path / "corpus")
  data = make_pipeline(tmp_path, str(tmp_path / "corpus" / "*.txt"))
  assert data.vocab_size == 259 and isinstance(data.vocabulary, seqio.ByteVocabulary)
  batch = data.batch(0)
  assert {k: (v.shape, v.dtype.name) for k, v in batch.items()} == {
      "inputs": ((8, 64), "int32"), "targets": ((8, 64), "int32"),
      "positions": ((8, 64), "int32"), "segment_ids": ((8, 64), "int32"),
      "weights": ((8, 64), "float32")}
  # Pieces in row-major order are the split's documents in order, each ending with
  # EOS: packing loses, duplicates and reorders nothing.
  split_documents = {}
  for split, store in (("train", data.train_store),
                       ("validation", data.validation_store)):
    rows = all_rows(store)
    stream = rows["targets"][rows["segment_ids"] > 0].tolist()
    assert stream[-1] == data.vocabulary.eos_id
    documents = []
    while stream:
      end = stream.index(data.vocabulary.eos_id)
      documents.append(data.vocabulary.decode(stream[:end]))
      stream = stream[end + 1:]
    split_documents[split] = documents
    assert store.metadata["num_documents"] == len(documents)
  train, validation = split_documents["train"], split_documents["validation"]
  assert train and validation
  assert sorted(train + validation) == sorted(texts.values())  # a partition
  by_file_order = sorted(texts.values(), key=lambda t: f"doc{t[4:t.index('>')]}.txt")
  assert train == [t for t in by_file_order if t in train]
  assert data.train_store.metadata["num_tokens"] == sum(len(t) + 1 for t in train)


def test_store_is_reused_and_rebuilt_when_files_change(tmp_path):
  write_corpus(tmp_path / "corpus")
  pattern = str(tmp_path / "corpus" / "*.txt")
  first = make_pipeline(tmp_path, pattern)
  stamp = os.stat(os.path.join(first.train_store.path, "metadata.json")).st_mtime_ns
  second = make_pipeline(tmp_path, pattern)
  assert second.train_store.path == first.train_store.path
  assert os.stat(os.path.join(second.train_store.path,
                              "metadata.json")).st_mtime_ns == stamp
  for key in first.batch(3):
    np.testing.assert_array_equal(first.batch(3)[key], second.batch(3)[key])
  (tmp_path / "corpus" / "doc1.txt").write_text("<doc1> changed text")
  third = make_pipeline(tmp_path, pattern)
  assert third.train_store.path != first.train_store.path
  other_length = make_pipeline(tmp_path, pattern, sequence_length=32)
  assert other_length.train_store.path != third.train_store.path


def test_killed_build_never_leaves_a_store(tmp_path):
  cache = str(tmp_path / "cache")
  rows = PackedRows(np.ones((3, 4), np.int32), np.ones((3, 4), np.int32))

  def dies_midway(writer):
    writer.append(rows)
    writer.close()
    raise KeyboardInterrupt("killed")

  with pytest.raises(KeyboardInterrupt):
    token_store.open_or_build(cache, "s-1", 4, False, dies_midway)
  assert not os.path.exists(os.path.join(cache, "s-1"))
  # A SIGKILLed build leaves its temporary directory behind: it is never opened,
  # and the next build (holding the lock) removes it.
  stale = os.path.join(cache, ".s-1.tmp-deadbeef")
  os.makedirs(os.path.join(stale, "targets"))
  store = token_store.open_or_build(
      cache, "s-1", 4, False, lambda w: (w.append(rows), {})[1])
  assert store.num_rows == 3 and not os.path.exists(stale)
  np.testing.assert_array_equal(store.read(np.array([2, 0, 2]))["targets"],
                                np.ones((3, 4)))
  assert sorted(os.listdir(cache)) == ["s-1", "s-1.lock"]


def test_concurrent_openers_build_once(tmp_path):
  cache = str(tmp_path / "cache")
  calls = []

  def slow_build(writer):
    calls.append(1)
    time.sleep(0.3)
    writer.append(PackedRows(np.full((2, 4), 7, np.int32),
                             np.ones((2, 4), np.int32)))
    return {}

  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    stores = list(pool.map(
        lambda _: token_store.open_or_build(cache, "s-2", 4, False, slow_build),
        range(3)))
  assert len(calls) == 1
  assert {s.path for s in stores} == {os.path.join(cache, "s-2")}
  assert all(s.num_rows == 2 for s in stores)


def test_resume_and_process_sharding(tmp_path):
  write_corpus(tmp_path / "corpus", count=40)
  pattern = str(tmp_path / "corpus" / "*.txt")
  single = make_pipeline(tmp_path, pattern, sequence_length=32, seed=5)
  n = single.num_train_rows
  assert n > 20
  for process_count in (2, 4):
    parts = [make_pipeline(tmp_path, pattern, sequence_length=32, seed=5,
                           process_index=p, process_count=process_count)
             for p in range(process_count)]
    for step in (0, 7, 31):
      whole = single.batch(step)
      for key in whole:
        np.testing.assert_array_equal(
            np.concatenate([p.batch(step)[key] for p in parts]), whole[key])
  # One epoch of the stream holds every stored row exactly once.
  steps = -(-n // 8) + 1
  stream = np.concatenate([single.batch(s)["targets"] for s in range(steps)])[:n]
  stored = single.train_store.read(np.arange(n))
  stored_targets = np.where(stored["segment_ids"] > 0, stored["targets"], 0)
  as_keys = lambda a: collections.Counter(r.tobytes() for r in a)
  assert as_keys(stream) == as_keys(stored_targets)
  # Another seed, another order.
  reseeded = make_pipeline(tmp_path, pattern, sequence_length=32, seed=6)
  assert not np.array_equal(reseeded.batch(0)["targets"], single.batch(0)["targets"])


def test_validation_batches_are_deterministic_and_padded(tmp_path):
  write_corpus(tmp_path / "corpus", count=30)
  pattern = str(tmp_path / "corpus" / "*.txt")
  data = make_pipeline(tmp_path, pattern, sequence_length=32, batch_size=4,
                       validation_fraction=0.4)
  batches = list(data.validation_batches())
  assert len(batches) == -(-data.validation_store.num_rows // 4)
  assert sum(b["weights"].sum() for b in batches) == (
      data.validation_store.metadata["num_tokens"])
  again = list(data.validation_batches(max_batches=2))
  assert len(again) == 2
  np.testing.assert_array_equal(again[1]["targets"], batches[1]["targets"])
  halves = [list(make_pipeline(tmp_path, pattern, sequence_length=32, batch_size=4,
                               validation_fraction=0.4, process_index=p,
                               process_count=2).validation_batches())
            for p in range(2)]
  assert len(halves[0]) == len(halves[1]) == len(batches)
  for b, h0, h1 in zip(batches, *halves):
    np.testing.assert_array_equal(
        np.concatenate([h0["weights"], h1["weights"]]), b["weights"])


def test_jsonl_documents(tmp_path):
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  lines = [json.dumps({"text": f"<line{i}> " + "words " * (i % 7), "id": i})
           for i in range(40)]
  (corpus / "a.jsonl").write_text("\n".join(lines[:25]) + "\n\n")
  (corpus / "b.jsonl").write_text("\n".join(lines[25:]))
  data = make_pipeline(tmp_path, str(corpus / "*.jsonl"), sequence_length=128)
  total = (data.train_store.metadata["num_documents"]
           + data.validation_store.metadata["num_documents"])
  assert total == 40
  decoded = [t for t, _ in segments(
      data.vocabulary, data.batch(0))]
  assert all(t.startswith("<line") for t in decoded)

  # JSONL is streamed line by line; the documents of each split and input shard are
  # the ones a whole-file read gives: file and line order, every n-th for a shard.
  source = sources.TextFilesDataSource(str(corpus / "*.jsonl"), validation_fraction=0.25)
  keyed = [(f"{name}:{i}", json.loads(line)["text"])
           for name, part in (("a.jsonl", lines[:25]), ("b.jsonl", lines[25:]))
           for i, line in enumerate(part)]
  flags = corpus_files.assign_validation([key for key, _ in keyed], 0.25)
  for split, held_out in ((sources.TRAIN, False), (sources.VALIDATION, True)):
    expected = [text for (_, text), flag in zip(keyed, flags) if flag == held_out]
    for shard in (None, seqio.ShardInfo(0, 3), seqio.ShardInfo(2, 3)):
      got = [example["text"].numpy().decode() for example in
             source.get_dataset(split, shuffle=False, shard_info=shard)]
      assert got == (expected if shard is None else expected[shard.index::3])


def test_prefix_lm_task_weights_only_targets(tmp_path):
  vocabulary = seqio.ByteVocabulary()

  def dataset_fn(split, shuffle_files, seed=None):
    del split, shuffle_files, seed
    return tf.data.Dataset.from_tensor_slices({
        "inputs": [f"question {i}?" for i in range(12)],
        "targets": [f"answer {i}" for i in range(12)]})

  name = "test_prefix_lm_task"
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  seqio.TaskRegistry.add(
      name, source=seqio.FunctionDataSource(dataset_fn, splits=["train"]),
      preprocessors=[seqio.preprocessors.tokenize, seqio.preprocessors.append_eos],
      output_features={
          "inputs": seqio.Feature(vocabulary, add_eos=False),
          "targets": seqio.Feature(vocabulary, add_eos=True)})
  data = pipeline.DataPipeline(task=name, sequence_length=32, batch_size=4,
                               cache_dir=str(tmp_path / "cache"))
  batch = data.batch(0)
  for targets, weights, seg in zip(batch["targets"], batch["weights"],
                                   batch["segment_ids"]):
    for s in range(1, seg.max() + 1):
      ids, w = targets[seg == s], weights[seg == s]
      text = vocabulary.decode(ids.tolist())
      prompt = text[:text.index("?") + 1]
      assert text.startswith("question ") and text[len(prompt):].startswith("answer")
      assert np.all(w[:len(prompt)] == 0) and np.all(w[len(prompt):] == 1)
      assert ids[-1] == vocabulary.eos_id
  with pytest.raises(DataError, match="no 'validation' split"):
    next(data.validation_batches())


def test_loss_mask_feature_sets_weights(tmp_path):
  vocabulary = seqio.PassThroughVocabulary(10)
  documents = [np.arange(3, 3 + n, dtype=np.int32) % 7 + 3 for n in (5, 9, 3, 12)]
  masks = [np.arange(len(d), dtype=np.int32) % 2 for d in documents]

  def dataset_fn(split, shuffle_files, seed=None):
    del split, shuffle_files, seed
    return tf.data.Dataset.from_generator(
        lambda: ({"targets": d, "loss_mask": m} for d, m in zip(documents, masks)),
        output_signature={k: tf.TensorSpec([None], tf.int32)
                          for k in ("targets", "loss_mask")})

  name = "test_loss_mask_task"
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  seqio.TaskRegistry.add(
      name, source=seqio.FunctionDataSource(dataset_fn, splits=["train"]),
      preprocessors=[], output_features={
          "targets": seqio.Feature(vocabulary, add_eos=False),
          "loss_mask": seqio.Feature(seqio.PassThroughVocabulary(2), add_eos=False)})
  data = pipeline.DataPipeline(task=name, sequence_length=8, batch_size=4,
                               cache_dir=str(tmp_path / "cache"))
  rows = data.train_store.read(np.arange(data.num_train_rows))
  real = rows["segment_ids"] > 0
  np.testing.assert_array_equal(rows["targets"][real], np.concatenate(documents))
  from pretrain.data.packing import features_from_rows
  weights = features_from_rows(**rows)["weights"]
  np.testing.assert_array_equal(weights[real], np.concatenate(masks))
  assert weights[~real].sum() == 0


def test_documents_of_one_static_length(tmp_path):
  """A source whose documents all share one static shape still packs (dense batches)."""
  vocabulary = seqio.PassThroughVocabulary(10)
  documents = [np.full([4], i % 7 + 3, np.int32) for i in range(6)]

  def dataset_fn(split, shuffle_files, seed=None):
    del split, shuffle_files, seed
    return tf.data.Dataset.from_tensor_slices({"targets": np.stack(documents)})

  name = "test_static_length_task"
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  seqio.TaskRegistry.add(
      name, source=seqio.FunctionDataSource(dataset_fn, splits=["train"]),
      preprocessors=[], output_features={"targets": seqio.Feature(vocabulary, add_eos=False)})
  data = pipeline.DataPipeline(task=name, sequence_length=8, batch_size=2,
                               cache_dir=str(tmp_path / "cache"))
  rows = data.train_store.read(np.arange(data.num_train_rows))
  real = rows["segment_ids"] > 0
  np.testing.assert_array_equal(rows["targets"][real], np.concatenate(documents))


def test_mixture_of_text_tasks(tmp_path):
  write_corpus(tmp_path / "a", count=6, seed=1)
  write_corpus(tmp_path / "b", count=6, seed=2)
  names = [tasks.text_files_task(train_files=str(tmp_path / d / "*.txt"),
                                 validation_fraction=0.0) for d in "ab"]
  if "test_mixture" in seqio.MixtureRegistry.names():
    seqio.MixtureRegistry.remove("test_mixture")
  seqio.MixtureRegistry.add("test_mixture", [(names[0], 1.0), (names[1], 1.0)])
  data = pipeline.DataPipeline(task="test_mixture", sequence_length=64,
                               batch_size=2, cache_dir=str(tmp_path / "cache"))
  # One pass ends when the first task runs out (SeqIO's mixture semantics).
  assert 6 <= data.train_store.metadata["num_documents"] < 12
  capped = pipeline.DataPipeline(task="test_mixture", sequence_length=64,
                                 batch_size=2, cache_dir=str(tmp_path / "cache"),
                                 max_train_documents=30)
  assert capped.train_store.metadata["num_documents"] == 30


def test_sentencepiece_vocabulary(tmp_path):
  from pretrain.interchange import tokenizer
  texts = write_corpus(tmp_path / "corpus")
  model = tokenizer.train_sentencepiece(str(tmp_path / "corpus" / "*.txt"), 300,
                                        str(tmp_path / "spm"))
  vocabulary = get_vocabulary(model)
  data = make_pipeline(tmp_path, str(tmp_path / "corpus" / "*.txt"),
                       vocabulary=vocabulary)
  assert data.vocab_size == vocabulary.vocab_size <= 300
  whole = "".join(texts.values())
  for text, _ in segments(data.vocabulary, data.batch(0)):
    assert text.strip() in whole


def test_clear_errors(tmp_path):
  with pytest.raises(DataError, match=r"TRAIN_FILES glob '.*nothing/\*\.txt' "
                     r"matched no files; check the path or set --gin_param="):
    make_pipeline(tmp_path, str(tmp_path / "nothing" / "*.txt"))
  empty = tmp_path / "empty"
  empty.mkdir()
  for i in range(3):
    (empty / f"{i}.txt").write_text("")
  with pytest.raises(DataError, match="has no tokens"):
    make_pipeline(tmp_path, str(empty / "*.txt"), validation_fraction=0.0)
  bad = tmp_path / "bad"
  bad.mkdir()
  (bad / "x.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
  with pytest.raises(DataError, match=r"x\.jsonl:2 has no string 'text' field"):
    make_pipeline(tmp_path, str(bad / "*.jsonl"))
  (bad / "x.jsonl").write_text('{"text": "fine"}\nnot json\n')
  with pytest.raises(DataError, match=r"x\.jsonl:2 is not valid JSON"):
    make_pipeline(tmp_path, str(bad / "*.jsonl"))
  with pytest.raises(DataError, match="SentencePiece model '/no/such.model' does "
                     "not exist"):
    get_vocabulary("/no/such.model")
  write_corpus(tmp_path / "corpus", count=4)
  with pytest.raises(DataError, match="BATCH_SIZE=6 is not divisible by the 4"):
    make_pipeline(tmp_path, str(tmp_path / "corpus" / "*.txt"), batch_size=6,
                  process_count=4)
  with pytest.raises(DataError, match="no SeqIO task or mixture named 'nope'"):
    pipeline.DataPipeline(task="nope", sequence_length=8, batch_size=1,
                          cache_dir=str(tmp_path / "cache"))
  assert issubclass(DataError, UserError)
  assert not any(".tmp-" in name for name in os.listdir(tmp_path / "cache"))
