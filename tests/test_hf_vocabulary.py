"""A Hugging Face `tokenizer.json` as the run's vocabulary: its ids and special tokens,
the refusal of one without EOS, the token store's cache key, the checkpoint metadata
that keeps it, the bytes each token stands for (bits per byte). The tokenizers are
small ones (byte-level BPEs mostly) trained here with `tokenizers` (nothing is
downloaded). A run that trains on one and samples with it is docs/data.md's
(tests/test_readme.py, test_corpus_training_commands_run_verbatim)."""
import json
import os
import random

import numpy as np
import pytest
from tokenizers import (AddedToken, Tokenizer, decoders, models, pre_tokenizers,
                        trainers)

from pretrain.checkpoints.metadata import make_vocabulary, vocabulary_spec
from pretrain.data import materialize, pipeline, tasks
from pretrain.data.errors import DataError
from pretrain.data.vocabularies import get_vocabulary, token_byte_lengths
from test_data_corpora import write_zst

WORDS = ("the quick brown fox jumps over lazy dog def return class self import for "
         "while print value items").split()
SPECIALS = ("<pad>", "<|endoftext|>")
# Characters of the byte-length texts: multi-byte ones, an emoji with a joiner, runs of
# whitespace and newlines.
PIECES = list("abcdefghij xyz") + ["é", "中", "😀", "👩‍👧", "ß", "\n", "\n\n", "   ", "\t",
                                    "\r\n"]


def texts(count=200, seed=0):
  rng = random.Random(seed)
  return [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(count)]


def train_bpe(directory, vocab_size=300, special_tokens=SPECIALS):
  """A byte-level BPE (GPT-2 style) trained on a few hundred words; returns its path."""
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train_from_iterator(texts(), trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(special_tokens),
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, "tokenizer.json")
  tokenizer.save(path)
  return path


def test_ids_round_trip_and_special_tokens_map_onto_eos_and_padding(tmp_path):
  path = train_bpe(tmp_path / "bpe")
  vocabulary = get_vocabulary(tokenizer_json=str(tmp_path / "bpe"))   # the directory
  assert vocabulary == get_vocabulary(tokenizer_json=path)            # or the file
  reference = Tokenizer.from_file(path)
  assert vocabulary.vocab_size == 300
  assert vocabulary.eos_id == reference.token_to_id("<|endoftext|>") == 1
  assert vocabulary.pad_id == 0 and vocabulary.unk_id is None
  text = "the quick brown fox, héllo\n  print(value)"
  ids = vocabulary.encode(text)
  assert ids == reference.encode(text, add_special_tokens=False).ids   # no BOS added
  assert vocabulary.decode(ids) == text
  assert vocabulary.decode(ids + [vocabulary.eos_id] + ids) == text  # up to EOS
  batched = vocabulary.encode_tf(np.array([text, "dog"])).to_list()
  assert batched == [ids, vocabulary.encode("dog")]


def test_a_tokenizer_without_end_of_text_is_refused_or_told_its_eos(tmp_path):
  path = train_bpe(tmp_path / "plain", special_tokens=("<pad>", "<stop>"))
  with pytest.raises(DataError, match=r"has no end-of-text special token .*set "
                     r"get_vocabulary\.eos_token"):
    get_vocabulary(tokenizer_json=path)
  assert get_vocabulary(tokenizer_json=path, eos_token="<stop>").eos_id == 1
  with pytest.raises(DataError, match="has no token '<end>' to use as EOS"):
    get_vocabulary(tokenizer_json=path, eos_token="<end>")
  with pytest.raises(DataError, match="neither a tokenizer.json file nor a directory"):
    get_vocabulary(tokenizer_json=str(tmp_path / "missing"))


def test_the_store_name_keys_on_the_tokenizer_content(tmp_path):
  write_zst(tmp_path / "c.jsonl.zst", texts(20))
  names = []
  for vocabulary in (None, get_vocabulary(tokenizer_json=train_bpe(tmp_path / "a")),
                     get_vocabulary(tokenizer_json=train_bpe(tmp_path / "b", 280))):
    task = tasks.corpus_task(files=str(tmp_path / "c.jsonl.zst"), vocabulary=vocabulary,
                             name="same_name")
    names.append(materialize.store_name(materialize.get_provider(task), "train", 32, None))
  assert len(set(names)) == 3


def test_the_store_holds_the_tokenizer_ids_and_checkpoints_keep_it(tmp_path):
  documents = texts(20)
  write_zst(tmp_path / "c.jsonl.zst", documents)
  vocabulary = get_vocabulary(tokenizer_json=train_bpe(tmp_path / "bpe"))
  task = tasks.corpus_task(files=str(tmp_path / "c.jsonl.zst"), vocabulary=vocabulary)
  data = pipeline.DataPipeline(task=task, sequence_length=64, batch_size=2,
                               cache_dir=str(tmp_path / "cache"))
  rows = data.train_store.read(np.arange(data.num_train_rows))
  stored = rows["targets"][rows["segment_ids"] > 0]
  expected = np.concatenate([ids + [1] for ids in vocabulary.encode_batch(documents)])
  np.testing.assert_array_equal(stored, expected)

  spec = vocabulary_spec(vocabulary, str(tmp_path / "workdir"))
  assert spec == f"tokenizer.json:{vocabulary.digest}:<|endoftext|>"
  assert os.listdir(tmp_path / "workdir" / "vocabulary") == [
      f"{vocabulary.digest}.tokenizer.json"]
  assert make_vocabulary(spec, str(tmp_path / "workdir")) == vocabulary


def random_texts(count=100, seed=0):
  """Texts of random PIECES, then words."""
  rng = random.Random(seed)
  return ["".join(rng.choice(PIECES) for _ in range(rng.randrange(60))) +
          rng.choice(texts(5)) for _ in range(count)]


def train_metaspace_bpe(directory):
  """A BPE on SentencePiece's '▁' word marker (Mistral's layout): a '▁' is prepended
  to each text not starting with a space, so its tokens stand for one byte more."""
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
  tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
  tokenizer.train_from_iterator(texts(), trainers.BpeTrainer(
      vocab_size=300, special_tokens=list(SPECIALS),
      initial_alphabet=[c for piece in PIECES for c in piece]))
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, "tokenizer.json")
  tokenizer.save(path)
  return path


@pytest.mark.parametrize("train, prefix", [(train_bpe, 0), (train_metaspace_bpe, 1)])
def test_token_byte_lengths_sum_to_the_texts_utf8_length(tmp_path, train, prefix):
  """Byte-level tokens count the raw bytes their characters stand for, '▁' tokens their
  text with '▁' a space; special tokens and ids past the tokenizer count none, a
  non-special added token its text."""
  tokenizer = Tokenizer.from_file(train(tmp_path / "tokenizer"))
  tokenizer.add_tokens([AddedToken(" déjà vu", special=False)])
  tokenizer.add_special_tokens(["<|im_start|>"])
  tokenizer.save(str(tmp_path / "tokenizer.json"))
  vocabulary = get_vocabulary(tokenizer_json=str(tmp_path / "tokenizer.json"))
  lengths = token_byte_lengths(vocabulary, vocabulary.vocab_size + 8)
  assert lengths.shape == (vocabulary.vocab_size + 8,) and lengths.dtype == np.int32
  special = [tokenizer.token_to_id(t) for t in SPECIALS + ("<|im_start|>",)]
  assert lengths[special].tolist() == [0, 0, 0]
  assert lengths[vocabulary.vocab_size:].tolist() == [0] * 8
  assert tokenizer.token_to_id(" déjà vu") in vocabulary.encode("x déjà vu  \n")
  for text in random_texts() + ["x déjà vu  \n", "😀"]:
    ids = vocabulary.encode(text)
    dummy_prefix = prefix if not text.startswith(" ") else 0
    assert lengths[ids].sum() == len(text.encode()) + dummy_prefix, (text, ids)


def test_the_unknown_token_counts_no_bytes_even_when_not_special(tmp_path):
  """The model's UNK stands for text it could not encode, whose bytes are lost; it
  counts none even where the file does not list it among its special tokens."""
  tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
  tokenizer.decoder = decoders.Metaspace()
  tokenizer.train_from_iterator(texts(), trainers.BpeTrainer(
      vocab_size=100, special_tokens=[*SPECIALS, "<unk>"]))
  config = json.loads(tokenizer.to_str())
  config["added_tokens"] = [t for t in config["added_tokens"] if t["content"] != "<unk>"]
  (tmp_path / "tokenizer.json").write_text(json.dumps(config))
  vocabulary = get_vocabulary(tokenizer_json=str(tmp_path / "tokenizer.json"))
  assert vocabulary.tokenizer.get_added_tokens_decoder().keys() == {0, 1}
  unknown = vocabulary.tokenizer.token_to_id("<unk>")
  ids = vocabulary.encode("fox ∑")
  lengths = token_byte_lengths(vocabulary, vocabulary.vocab_size)
  assert unknown in ids and lengths[unknown] == 0
  assert lengths[ids].sum() == len(" fox ")   # the dummy prefix, not the '∑'


def test_tokens_that_are_no_text_have_no_byte_lengths(tmp_path):
  """WordPiece drops the text's whitespace and marks word continuations with '##',
  and a tokenizer without a decoder joins its tokens with spaces: no byte count."""
  wordpiece = Tokenizer(models.WordPiece(unk_token="<unk>"))
  wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
  wordpiece.decoder = decoders.WordPiece()
  wordpiece.train_from_iterator(texts(), trainers.WordPieceTrainer(
      vocab_size=100, special_tokens=["<unk>", *SPECIALS]))
  wordpiece.save(str(tmp_path / "wordpiece.json"))
  bare = Tokenizer.from_file(train_bpe(tmp_path / "bare"))
  bare.decoder = None
  bare.save(str(tmp_path / "bare.json"))
  for name in ("wordpiece.json", "bare.json"):
    vocabulary = get_vocabulary(tokenizer_json=str(tmp_path / name))
    assert token_byte_lengths(vocabulary, vocabulary.vocab_size) is None
