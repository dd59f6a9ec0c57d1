"""`python -m pretrain.tokenizer` trains a usable SentencePiece model, or a byte-level BPE
`tokenizer.json` that the pipeline reads with no further settings, locally."""
import json
import subprocess
import sys

import numpy as np
import pytest
import sentencepiece as spm
import seqio

from pretrain.interchange import hf_tokenizer, tokenizer
from pretrain.data import DataError
from pretrain.data.hf_vocabulary import HfTokenizerVocabulary
from pretrain.data.vocabularies import get_vocabulary, token_byte_lengths
from test_data_corpora import write_parquet, write_zst
from tiers import slow_after_first


def write_code_corpus(directory):
  rng = np.random.default_rng(0)
  names = ["value", "index", "result", "items", "count", "total", "self"]
  directory.mkdir()
  for i in range(6):
    lines = []
    for _ in range(80):
      a, b = rng.choice(names, 2)
      lines.append(f"    {a} = {b} + {int(rng.integers(100))}  # note {i}")
    (directory / f"m{i}.py").write_text("def f():\n" + "\n".join(lines) + "\n")
  (directory / "extra.jsonl").write_text(
      json.dumps({"text": "def g(items):\n    return len(items)"}) + "\n")


def test_cli_trains_a_model_that_round_trips_text(tmp_path):
  write_code_corpus(tmp_path / "corpus")
  result = subprocess.run(
      [sys.executable, "-m", "pretrain.tokenizer",
       f"--input_glob={tmp_path}/corpus/*", "--vocab_size=320",
       f"--output={tmp_path}/out/code"],
      capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  assert f"wrote {tmp_path}/out/code.model" in result.stdout
  processor = spm.SentencePieceProcessor(model_file=f"{tmp_path}/out/code.model")
  assert 259 < processor.get_piece_size() <= 320
  assert (processor.pad_id(), processor.eos_id(), processor.unk_id(),
          processor.bos_id()) == (0, 1, 2, -1)
  # Exact round trip, indentation and unseen characters included.
  text = "def f():\n\tvalue  =  items[0]  # é 中\n    return value\n"
  assert processor.decode(processor.encode(text)) == text
  # Learned pieces compress the corpus' own text well below one id per byte.
  sample = (tmp_path / "corpus" / "m0.py").read_text()
  assert len(processor.encode(sample)) < 0.6 * len(sample.encode())
  assert (tmp_path / "out" / "code.vocab").exists()


def test_cli_errors_are_one_line(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "pretrain.tokenizer",
       f"--input_glob={tmp_path}/none/*.txt", "--vocab_size=100",
       f"--output={tmp_path}/m"], capture_output=True, text=True, timeout=60)
  assert result.returncode == 1  # a data problem: the run failed
  assert "Traceback" not in result.stderr
  assert result.stderr.strip().splitlines()[-1] == (
      f"error: --input_glob='{tmp_path}/none/*.txt' matched no files; check the "
      "path or set --input_glob='/path/to/**/*.txt'")
  (tmp_path / "blank.txt").write_text("\n  \n")
  with pytest.raises(DataError, match="hold no text"):
    tokenizer.train_sentencepiece(str(tmp_path / "blank.txt"), 100,
                                  str(tmp_path / "m"))


def test_byte_level_bpe_of_a_corpus_loads_as_the_runs_vocabulary(tmp_path):
  """A `.jsonl.zst` corpus (text in `content`) and a text-file glob (`.jsonl` lines
  included) train a tokenizer.json whose special tokens are the pipeline's: `<pad>` at
  id 0 (padding, document start), `<|endoftext|>` the EOS get_vocabulary finds itself."""
  write_code_corpus(tmp_path / "corpus")
  texts = [(tmp_path / "corpus" / f"m{i}.py").read_text() for i in range(6)]
  write_zst(tmp_path / "code.jsonl.zst", texts, field="content")
  path = tokenizer.train_byte_level_bpe(str(tmp_path / "code.jsonl.zst"), 400,
                                        str(tmp_path / "out"), text_field="content")
  assert path == str(tmp_path / "out" / "tokenizer.json")
  vocabulary = get_vocabulary(tokenizer_json=str(tmp_path / "out"))
  assert (vocabulary.pad_id, vocabulary.eos_id, vocabulary.eos_token) == (
      0, 1, "<|endoftext|>")
  assert vocabulary.tokenizer.id_to_token(0) == "<pad>"
  assert 258 < vocabulary.vocab_size <= 400
  text = "def f():\n\tvalue  =  items[0]  # é 中\n    return value\n"
  assert vocabulary.decode(vocabulary.encode(text)) == text   # exact, no UNK
  assert len(vocabulary.encode(texts[0])) < 0.5 * len(texts[0].encode())
  # The text-file glob: each .py file one document, the .jsonl file one per line.
  glob_path = tokenizer.train_byte_level_bpe(f"{tmp_path}/corpus/*", 300,
                                             str(tmp_path / "glob.json"))
  assert glob_path == str(tmp_path / "glob.json")
  assert get_vocabulary(tokenizer_json=glob_path).vocab_size == 300


def test_bad_corpora_for_a_byte_level_bpe_are_one_line(tmp_path):
  (tmp_path / "blank.txt").write_text("\n  \n")
  with pytest.raises(DataError, match="blank.txt' hold no text; point --input_glob"):
    tokenizer.train_byte_level_bpe(str(tmp_path / "blank.txt"), 300, str(tmp_path / "m"))
  write_parquet(tmp_path / "empty.parquet", ["", "  "])
  with pytest.raises(DataError, match="hold no text"):
    tokenizer.train_byte_level_bpe(str(tmp_path / "empty.parquet"), 300, str(tmp_path / "m"))
  write_parquet(tmp_path / "web.parquet", ["some text"], field="body")
  with pytest.raises(DataError, match=r"has no column 'text' \(it has: id, body\); set "
                     "--text_field to the column"):
    tokenizer.train_byte_level_bpe(str(tmp_path / "web.parquet"), 300, str(tmp_path / "m"))
  (tmp_path / "bad").mkdir()
  (tmp_path / "bad" / "part-0.parquet").write_bytes(b"not parquet")
  with pytest.raises(DataError, match=r"is not a readable Parquet file .*; replace or "
                     r"delete that shard$"):
    tokenizer.train_byte_level_bpe(str(tmp_path / "bad"), 300, str(tmp_path / "m"))
  assert not (tmp_path / "m").exists()


def test_byte_lengths_of_the_byte_vocabulary():
  """Special ids 0..2 and ids past 258 stand for no text; every byte id for one byte."""
  vocabulary = seqio.ByteVocabulary()
  lengths = token_byte_lengths(vocabulary, 262)   # a model a little wider than 259 ids
  assert lengths.shape == (262,) and lengths.dtype == np.int32
  assert lengths[:3].tolist() == [0, 0, 0] and lengths[259:].tolist() == [0, 0, 0]
  assert np.all(lengths[3:259] == 1)
  text = "def f():\n\treturn 'é 中'\n"
  assert lengths[vocabulary.encode(text)].sum() == len(text.encode())
  assert token_byte_lengths(seqio.PassThroughVocabulary(18), 18) is None


def test_byte_lengths_of_a_sentencepiece_model(tmp_path):
  """Learned pieces count their text's bytes ('▁' a space), byte-fallback pieces one,
  control and unknown pieces and extra ids none; over an encoded text the sum is the
  text's UTF-8 length plus the one dummy-prefix space SentencePiece adds. The model as
  a tokenizer.json (the export's, Llama 2's layout: '▁' and byte-fallback decoders, the
  special tokens added ones) counts the same."""
  write_code_corpus(tmp_path / "corpus")
  vocabulary = get_vocabulary(tokenizer.train_sentencepiece(
      f"{tmp_path}/corpus/*", 320, str(tmp_path / "code")))
  processor = vocabulary.tokenizer
  pieces = processor.get_piece_size()
  lengths = token_byte_lengths(vocabulary, pieces + 4)
  assert lengths[:3].tolist() == [0, 0, 0]            # pad, EOS, UNK
  assert lengths[pieces:].tolist() == [0, 0, 0, 0]
  assert lengths[processor.piece_to_id("<0xC3>")] == 1
  assert lengths[processor.piece_to_id("▁note")] == len(" note")   # a learned piece
  text = "def f():\n\tvalue  =  items[0]  # é 中\n    return value\n"
  ids = vocabulary.encode(text)
  assert any(lengths[i] > 1 for i in ids) and any(processor.is_byte(i) for i in ids)
  assert lengths[ids].sum() == len(text.encode()) + 1
  exported = hf_tokenizer.build(vocabulary, 64).backend_tokenizer.to_str().encode()
  as_json = HfTokenizerVocabulary(exported)
  np.testing.assert_array_equal(token_byte_lengths(as_json, pieces + 4), lengths)


@pytest.mark.parametrize("args, fragment", slow_after_first([
    (["--input_glob=x", "--vocab_size=4", "--output=m"], "--vocab_size"),
    (["--input_glob=x", "--vocab_size=100", "--output=m", "--model_type=word"],
     "--model_type"),
    (["--input_glob=x", "--vocab_size=100"], "--output"),
    (["--input_glob=x", "--vocab_size=100", "--output=m", "extra"], "Unexpected arguments"),
    (["--input_glob=x", "--vocab_size=100", "--output=m", "--model_type=byte_level_bpe"],
     "--vocab_size=100 is too small for a byte-level BPE"),
]))
def test_bad_flag_value_is_one_line_and_exit_code_2(tmp_path, args, fragment):
  result = subprocess.run([sys.executable, "-m", "pretrain.tokenizer", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
  assert result.returncode == 2, result.stderr
  assert "Traceback" not in result.stderr, result.stderr
  errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1 and fragment in errors[0], result.stderr
  assert not (tmp_path / "m.model").exists()
