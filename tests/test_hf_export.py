"""Hugging Face interchange, checked against transformers' own RecurrentGemma code.

For tiny Griffin, Hawk and MQA, a cut-down recurrentgemma_2b (tied, √D-scaled
embedding, soft cap) and the griffin_100m preset (16 gate blocks, 6 heads: the
`trust_remote_code` export), each test writes a step-0 checkpoint of perturbed random
weights, exports it with `pretrain.export`, and compares transformers' logits and
greedy generation with ours; then imports the export back (`pretrain.convert hf`) and
requires the very same bits. A checkpoint built by transformers itself imports too.
transformers runs with its defaults throughout (`model(ids)`, `generate`, `pipeline`,
the documented snippet (docs/interchange.md), lm_eval's `hf` backend): what they need is the export's job.
"""
import json
import os
import subprocess
import sys
from typing import Any, Sequence

import jax
import numpy as np
import pytest
import torch
import transformers

import pretrain
from model import lm
from model.config import ModelConfig
import seqio

from plumbing.errors import UserError
from pretrain.interchange import conversion as convert, hf_export as export, hf_import
from pretrain import extras, gin_config
from pretrain.evaluation import downstream, generation
from pretrain.interchange import tokenizer as tokenizer_lib
from pretrain.checkpoints.metadata import make_vocabulary
from pretrain.data.vocabularies import get_vocabulary
from trainer_helpers import (LM_EVAL_TASKS, REPO, assert_ok,  # pylint: disable=unused-import
                             storage_env, trainer_env)

TEXT = ("def items(self):\n    return [value for value in self.values() if value]\n"
        "class Tree:\n    def __init__(self, left, right):\n        self.left = left\n")
CONFIGS = {
    "griffin": ModelConfig(vocab_size=300, width=64, rnn_width=96, num_heads=2, depth=4,
                           attention_window=16),
    "hawk": ModelConfig(vocab_size=300, width=64, rnn_width=96, num_heads=2, depth=2,
                        block_pattern=("recurrent",), num_gate_blocks=4),
    "mqa": ModelConfig(vocab_size=300, width=64, num_heads=2, depth=2,
                       block_pattern=("attention",), attention_window=None),
    # recurrentgemma_2b's conventions on a small body.
    "recurrentgemma_2b_cut": ModelConfig(vocab_size=300, width=128, rnn_width=128,
                                         num_heads=4, depth=3, attention_window=24,
                                         embeddings_scale_by_sqrt_dim=True,
                                         logits_soft_cap=30.0),
}
# The griffin_100m preset itself (16 RG-LRU gate blocks over 6 heads: the
# trust_remote_code export; 12 layers, 4 scanned units), with a 512-id vocabulary and
# float32 compute (the preset trains in bfloat16).
PRESET = "griffin_100m"
# The documented transformers snippet (docs/interchange.md, "The directory loads with
# transformers alone"), run verbatim on each export; it prompts with PROMPT.
with open(os.path.join(REPO, "docs", "interchange.md"), encoding="utf-8") as _f:
  README_SNIPPET = _f.read().split("The directory loads with transformers alone", 1)[1].split(
      "```python\n", 1)[1].split("```", 1)[0]
PROMPT = "def main("
EOS = 1
# The tiny_mc documents lm_eval's `hf` backend scores. Not document 2: lm_eval's logits
# cache (on by default) computes "return se" + "lf" and document 14's "return" + " self"
# in one forward pass, then reads the shorter continuation's log-probabilities at the
# longer one's first positions (lm_eval 0.4.13, whatever the model). Five documents,
# continuations of 2 to 6 bytes, keep the test cheap.
LM_EVAL_DOCS = [0, 6, 9, 12, 14]


def preset_config(name: str) -> ModelConfig:
  gin_config.parse([os.path.join(REPO, "configs", "models", f"{name}.gin")],
                   ["VOCAB_SIZE = 512"])
  return gin_config.build_model_config().replace(dtype="float32")   # parity in float32


def perturbed_params(config, seed=0):
  """Initial parameters plus noise, so zero-initialised biases and norms count too."""
  params = lm.init_params(config, jax.random.key(seed))
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda p: np.asarray(p) + 0.05 * rng.standard_normal(p.shape).astype(np.float32),
      params)


@pytest.fixture(scope="module", params=sorted(CONFIGS) + [
    pytest.param(PRESET, marks=pytest.mark.slow)])
def exported(request, tmp_path_factory):
  """(name, config, our params, workdir, export dir, transformers model)."""
  name = request.param
  config = CONFIGS[name] if name in CONFIGS else preset_config(name)
  root = tmp_path_factory.mktemp(name)
  params = perturbed_params(config)
  workdir, output = str(root / "run"), str(root / "hf")
  convert.write_step0(workdir, config, params, make_vocabulary("byte"), 64)
  export.export(workdir, output)
  model = transformers.AutoModelForCausalLM.from_pretrained(output, dtype=torch.float32,
                                                            trust_remote_code=True).eval()
  return name, config, params, workdir, output, model


def token_rows(config, length):
  rng = np.random.default_rng(1)
  random_row = rng.integers(3, config.vocab_size, length)
  text = np.frombuffer(TEXT.encode() * 4, np.uint8)[:length].astype(np.int64) + 3
  return np.stack([random_row, text]).astype(np.int32)


def their_logits(model, tokens):
  """`model(ids)` as typed: the export's config.json sets what the defaults need."""
  with torch.no_grad():
    return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


@pytest.fixture(scope="module")
def greedy(exported) -> tuple[list[int], list[int]]:
  """(prompt ids as the export's tokenizer writes PROMPT, our 32 greedy tokens)."""
  _, config, params, _, output, _ = exported
  prompt = transformers.AutoTokenizer.from_pretrained(output, trust_remote_code=True)(
      PROMPT).input_ids
  assert prompt[0] == 0   # the document start, which attention layers must see
  return prompt, generation.generate(config, params, prompt, max_new_tokens=32,
                                     temperature=0)


def until_eos(tokens: Sequence[int], count: int) -> list[int]:
  """The first `count` tokens, cut after the first EOS (where transformers stops)."""
  tokens = list(tokens[:count])
  return tokens[:tokens.index(EOS) + 1] if EOS in tokens else tokens


def test_logits_match_transformers(exported):
  name, config, _, workdir, _, model = exported
  ours = pretrain.load(workdir)
  length = 48   # longer than every tiny window
  tokens = token_rows(config, length)
  positions = np.tile(np.arange(length, dtype=np.int32), (2, 1))
  mine = np.asarray(ours.logits(tokens, positions))
  theirs = their_logits(model, tokens)
  scale = np.abs(mine).max()
  assert np.abs(mine - theirs).max() <= 1e-4 * scale, name
  expected_class = ("GriffinForCausalLM" if name == PRESET
                    else "RecurrentGemmaForCausalLM")
  assert type(model).__name__ == expected_class


def test_greedy_generation_matches_pretrain_sample(exported, greedy):
  """Past every tiny window, with the document start in the prompt and no flag but a
  length: Hawk generates without a cache, the others with one (their config says so)."""
  name, config, _, _, _, model = exported
  prompt, ours = greedy
  with torch.no_grad():
    theirs = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                            eos_token_id=None)
  assert theirs[0, len(prompt):].tolist() == ours[:24], name
  assert model.config.use_cache == model.generation_config.use_cache == (
      "attention" in config.block_pattern)


@pytest.mark.filterwarnings("ignore:Using the model-agnostic default `max_length`")
def test_readme_snippet_generate_and_pipeline_need_no_flags(exported, greedy, tmp_path,
                                                             monkeypatch, capsys):
  """The documented and the model card's snippets, `generate(ids)` and a greedy `pipeline`
  (it samples by default) run as a user types them and continue the prompt as we do.
  Before the export said `use_cache: false`, Hawk raised in transformers' cache; before
  its generation config's pad id stopped being the document start 0, `generate` masked
  that input out of every attention layer."""
  name, _, _, _, output, model = exported
  prompt, ours = greedy
  tokenizer = transformers.AutoTokenizer.from_pretrained(output, trust_remote_code=True)
  with open(os.path.join(output, "README.md"), encoding="utf-8") as f:
    card = f.read().split("```python\n", 1)[1].split("```", 1)[0]
  snippets = [(card.replace('"DIR"', repr(output)), 32)]
  remote = name == PRESET   # README.md: these load with trust_remote_code=True
  if not remote:
    snippets.append((README_SNIPPET, 16))
    (tmp_path / "workdirs").mkdir()
    (tmp_path / "workdirs" / "quickstart-hf").symlink_to(output)
    monkeypatch.chdir(tmp_path)
  for code, new_tokens in snippets:
    capsys.readouterr()
    exec(code, {})  # pylint: disable=exec-used
    assert capsys.readouterr().out == tokenizer.decode(
        prompt + until_eos(ours, new_tokens), skip_special_tokens=True) + "\n", name
  with torch.no_grad():
    theirs = model.generate(torch.tensor([prompt]))[0, len(prompt):].tolist()
  assert theirs and theirs == until_eos(ours, len(theirs)), name   # its default length
  generator = transformers.pipeline("text-generation", model=output,
                                    trust_remote_code=remote)
  text = generator(PROMPT, max_new_tokens=8, do_sample=False)[0]["generated_text"]
  assert text == tokenizer.decode(prompt + until_eos(ours, 8), skip_special_tokens=True)


@pytest.mark.slow   # fast tier under 5 min: lm_eval's hf backend per export (3-5 s)
def test_lm_evals_hf_backend_with_default_model_args_scores_like_ours(exported):
  """lm_eval's `hf` backend given only the export (`model_args="pretrained=DIR"`; the
  device is this machine's) gives each choice of a local task our backend's
  log-likelihood. (The full task, on a trained Griffin: test_lm_eval_backend.py.)"""
  name, _, _, workdir, output, _ = exported
  if name == PRESET:
    pytest.skip("the tiny Griffin covers the family; this would compile our backend "
                "for a 100M model")
  assert_lm_evals_hf_backend_scores_like_ours(workdir, output, name)


def assert_lm_evals_hf_backend_scores_like_ours(workdir: str, output: str, name: str):
  """lm_eval's `hf` backend on the export `output` of `workdir`, given only
  `pretrained=DIR`, gives each LM_EVAL_DOCS choice our backend's log-likelihood."""
  from lm_eval import evaluator  # pylint: disable=import-outside-toplevel
  manager = downstream.task_manager(["tiny_mc"], LM_EVAL_TASKS)

  def scores(**backend: Any) -> dict[int, list[float]]:
    results = evaluator.simple_evaluate(tasks=["tiny_mc"], task_manager=manager,
                                        samples={"tiny_mc": LM_EVAL_DOCS},
                                        log_samples=True, bootstrap_iters=0, **backend)
    return {sample["doc_id"]: [resp[0][0] for resp in sample["resps"]]
            for sample in results["samples"]["tiny_mc"]}

  model = pretrain.load(workdir)
  ours = scores(model=downstream.backend(model.runtime, model.params, model.vocabulary,
                                         max_length=model.sequence_length, batch_size=8))
  theirs = scores(model="hf", model_args=f"pretrained={output}", device="cpu")
  assert sorted(ours) == sorted(theirs) == LM_EVAL_DOCS
  for doc_id, choices in ours.items():
    np.testing.assert_allclose(choices, theirs[doc_id], atol=1e-4, rtol=0,
                               err_msg=f"{name} doc {doc_id}")


def test_import_of_the_export_is_bit_identical(exported, tmp_path):
  name, config, params, _, output, _ = exported
  back = str(tmp_path / "back")
  imported = convert.convert_hf(output, back)
  if name != "hawk":   # Hawk's head count is not part of the model (no attention)
    assert imported == config
  restored = pretrain.load(back)
  same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), restored.params, params)
  assert all(jax.tree.leaves(same)), name
  assert restored.vocabulary_spec == "byte" and restored.sequence_length == 64


@pytest.mark.slow   # fast tier under 5 min: transformers builds a model (7 s); the export round trip stays fast
def test_checkpoint_built_by_transformers_imports(tmp_path):
  """A model transformers initialises and saves itself (tied, scaled, its own window
  counting) imports with its logits intact."""
  hf_config = transformers.RecurrentGemmaConfig(
      num_hidden_layers=3, vocab_size=300, hidden_size=64, intermediate_size=384,
      num_attention_heads=2, num_key_value_heads=1, lru_width=64, attention_window_size=12,
      logits_soft_cap=30.0)
  torch.manual_seed(0)
  model = transformers.RecurrentGemmaForCausalLM(hf_config).eval()
  with torch.no_grad():
    for parameter in model.parameters():   # its init zeroes biases and norms
      parameter.add_(0.05 * torch.randn_like(parameter))
  source = str(tmp_path / "theirs")
  model.save_pretrained(source)
  convert.convert_hf(source, str(tmp_path / "run"), vocab="byte")
  ours = pretrain.load(str(tmp_path / "run"))
  assert ours.config.attention_window == 11 and ours.config.embeddings_scale_by_sqrt_dim
  tokens = token_rows(ours.config, 40)
  positions = np.tile(np.arange(40, dtype=np.int32), (2, 1))
  mine = np.asarray(ours.logits(tokens, positions))
  theirs = their_logits(model, tokens)
  assert np.abs(mine - theirs).max() <= 1e-4 * np.abs(mine).max()


@pytest.mark.slow   # fast tier under 5 min: an export in bfloat16 (6 s)
def test_bfloat16_export_loads_close(tmp_path):
  config = CONFIGS["griffin"]
  workdir = str(tmp_path / "run")
  convert.write_step0(workdir, config, perturbed_params(config), make_vocabulary("byte"), 64)
  export.export(workdir, str(tmp_path / "hf"), dtype="bfloat16")
  model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
  assert model.dtype == torch.bfloat16
  tokens = token_rows(config, 32)
  mine = np.asarray(pretrain.load(workdir).logits(
      tokens, np.tile(np.arange(32, dtype=np.int32), (2, 1))))
  with torch.no_grad():
    theirs = model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
  assert np.abs(mine - theirs).max() <= 0.05 * np.abs(mine).max()


def test_hub_cache_entry_imports_its_main_snapshot(tmp_path):
  """`--checkpoint` may name a hub cache entry: refs/main picks the snapshot."""
  config = CONFIGS["mqa"]
  params = perturbed_params(config)
  output = str(tmp_path / "hf")
  convert.write_step0(str(tmp_path / "source"), config, params, make_vocabulary("byte"), 64)
  export.export(str(tmp_path / "source"), output)
  entry = tmp_path / "models--someone--tiny-mqa"
  (entry / "refs").mkdir(parents=True)
  (entry / "refs" / "main").write_text("abc123")
  (entry / "snapshots").mkdir()
  os.symlink(output, entry / "snapshots" / "abc123")
  assert convert.convert_hf(str(entry), str(tmp_path / "run")) == config
  restored = pretrain.load(str(tmp_path / "run"))
  assert all(jax.tree.leaves(jax.tree.map(
      lambda a, b: np.array_equal(np.asarray(a), b), restored.params, params)))


def test_a_missing_extra_is_one_line_naming_pip():
  with pytest.raises(UserError, match=r'pip install -e "\.\[hf\]" \(missing: '
                                      r'no_such_module\)') as raised:
    extras.require("no_such_module", extra="hf", purpose="export to Hugging Face")
  assert "\n" not in str(raised.value)


def test_sharded_weights_load(tmp_path):
  state = {"a": np.ones((4, 4), np.float32), "b": np.zeros(8, np.float32),
           "c": np.full((2, 2), 3, np.float32)}
  names = export.write_weights(state, str(tmp_path), max_shard_bytes=64)
  assert names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
  read = hf_import.read_weights(str(tmp_path))
  assert sorted(read) == ["a", "b", "c"] and read["c"][1, 1] == 3


def test_unexportable_models_and_outputs_are_one_line(tmp_path):
  config = ModelConfig(vocab_size=300, width=64, num_heads=1, depth=2,
                       block_pattern=("gateloop",), rnn_width=64)
  workdir = str(tmp_path / "gateloop")
  convert.write_step0(workdir, config, lm.init_params(config, jax.random.key(0)),
                      make_vocabulary("byte"), 64)
  with pytest.raises(UserError, match="GateLoop blocks have no transformers"):
    export.export(workdir, str(tmp_path / "out"))
  (tmp_path / "full").mkdir()
  (tmp_path / "full" / "x").write_text("keep me")
  with pytest.raises(UserError, match="is not empty"):
    export.export(workdir, str(tmp_path / "full"))
  assert (tmp_path / "full" / "x").read_text() == "keep me"


@pytest.mark.slow
def test_export_command_from_a_bucket_workdir(gcs_bucket, trainer_env, tmp_path):
  """The README's export of a gs:// workdir, then from_pretrained and generate."""
  config = CONFIGS["griffin"]
  workdir = f"{gcs_bucket}/hf-export-run"
  convert.write_step0(workdir, config, perturbed_params(config), make_vocabulary("byte"), 64)
  output = str(tmp_path / "hf")
  result = subprocess.run(
      [sys.executable, "-m", "pretrain.export", f"--workdir={workdir}", f"--output={output}"],
      env=storage_env(trainer_env.env), cwd=REPO, capture_output=True, text=True, timeout=300)
  assert_ok(result)
  assert result.stderr == ""
  assert "Exported" in result.stdout
  with open(os.path.join(output, "config.json")) as f:
    assert json.load(f)["attention_window_size"] == 17
  card = open(os.path.join(output, "README.md")).read()
  assert "step 0" in card and "library_name: transformers" in card
  model = transformers.AutoModelForCausalLM.from_pretrained(output)
  tokenizer = transformers.AutoTokenizer.from_pretrained(output)
  ids = tokenizer("def ", return_tensors="pt").input_ids
  assert ids[0, 0] == 0   # the document-start input
  generated = model.generate(ids, max_new_tokens=8, do_sample=False)
  assert generated.shape == (1, ids.shape[1] + 8)


def test_sentencepiece_vocabulary_exports_id_for_id(tmp_path):
  """A run's own SentencePiece model becomes a fast tokenizer with the same ids (after
  the document-start 0) and decodings, and comes back on import."""
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  (corpus / "a.txt").write_text(TEXT * 20 + "import os\nprint(1234, 'héllo ✓')\n" * 10)
  model_file = tokenizer_lib.train_sentencepiece(str(corpus / "*.txt"), 300,
                                                 str(tmp_path / "spm"))
  vocabulary = seqio.SentencePieceVocabulary(model_file)
  config = CONFIGS["hawk"].replace(vocab_size=320)
  workdir = str(tmp_path / "run")
  convert.write_step0(workdir, config, perturbed_params(config), vocabulary, 64)
  export.export(workdir, str(tmp_path / "hf"))
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
  for text in (TEXT, "  two  spaces\n\n\tand tabs 12345 ✓ 日本", "x"):
    ids = list(vocabulary.encode(text))
    assert tokenizer(text).input_ids == [0] + ids
    assert tokenizer.decode([0] + ids, skip_special_tokens=True) == vocabulary.decode(ids)
  convert.convert_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
  assert pretrain.load(str(tmp_path / "back")).vocabulary_spec.startswith("sentencepiece:")


@pytest.mark.slow
def test_tokenizer_json_vocabulary_exports_id_for_id_and_lm_eval_agrees(tmp_path):
  """A run on a byte-level BPE `tokenizer.json` (`pretrain.tokenizer`'s, trained here):
  the export's tokenizer gives training's ids after the document-start 0 (its `<pad>`,
  named BOS and pad), lm_eval's `hf` backend scores the local task as ours does, and
  import reads the tokenizer back with its EOS."""
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  (corpus / "a.txt").write_text(TEXT * 20 + "import os\nprint(1234, 'héllo ✓')\n" * 10)
  vocabulary = get_vocabulary(tokenizer_json=tokenizer_lib.train_byte_level_bpe(
      str(corpus / "*.txt"), 300, str(tmp_path / "bpe")))
  config = CONFIGS["mqa"]
  workdir, output = str(tmp_path / "run"), str(tmp_path / "hf")
  convert.write_step0(workdir, config, perturbed_params(config), vocabulary, 64)
  export.export(workdir, output)
  tokenizer = transformers.AutoTokenizer.from_pretrained(output)
  for text in (TEXT, "  two  spaces\n\n\tand tabs 12345 ✓ 日本", "x"):
    ids = list(vocabulary.encode(text))
    assert tokenizer(text).input_ids == [0] + ids
    assert tokenizer.decode([0] + ids, skip_special_tokens=True) == text
  assert (tokenizer.bos_token, tokenizer.pad_token_id, tokenizer.eos_token_id) == (
      "<pad>", 0, vocabulary.eos_id)
  assert_lm_evals_hf_backend_scores_like_ours(workdir, output, "byte-level BPE")
  convert.convert_hf(output, str(tmp_path / "back"))
  restored = pretrain.load(str(tmp_path / "back"))
  assert restored.vocabulary_spec.startswith("tokenizer.json:")
  assert restored.vocabulary.eos_token == "<|endoftext|>"
  assert restored.vocabulary.encode(TEXT) == vocabulary.encode(TEXT)


def test_a_tokenizer_json_whose_id_0_is_text_exports_its_ids_and_eos(tmp_path):
  """GPT-2's layout: id 0 is "!", the EOS comes after the merges (here named `<|stop|>`,
  which only `get_vocabulary.eos_token` makes the EOS). The export still starts every
  text with id 0 but names no BOS (a named one would become special and be cut out of
  texts: "!!" would no longer encode as training did), config.json's EOS is the
  tokenizer's, and import takes the EOS tokenizer_config.json names."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel
  bpe = Tokenizer(models.BPE())
  bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = decoders.ByteLevel()
  bpe.train_from_iterator([TEXT.replace(":", "!!")] * 20, trainers.BpeTrainer(
      vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False))
  bpe.add_special_tokens(["<|stop|>"])
  (tmp_path / "bpe").mkdir()
  bpe.save(str(tmp_path / "bpe" / "tokenizer.json"))
  vocabulary = get_vocabulary(tokenizer_json=str(tmp_path / "bpe"), eos_token="<|stop|>")
  assert bpe.id_to_token(0) == "!" and bpe.token_to_id("!!") is not None
  assert vocabulary.eos_id == 300
  config = CONFIGS["hawk"].replace(vocab_size=320)
  workdir, output = str(tmp_path / "run"), str(tmp_path / "hf")
  convert.write_step0(workdir, config, perturbed_params(config), vocabulary, 64)
  export.export(workdir, output)
  tokenizer = transformers.AutoTokenizer.from_pretrained(output)
  text = "def items(self)!! return 1 ✓!"
  assert tokenizer(text).input_ids == [0] + vocabulary.encode(text)
  assert tokenizer.bos_token is None and tokenizer.eos_token_id == 300
  with open(os.path.join(output, "config.json")) as f:
    assert json.load(f)["eos_token_id"] == 300
  convert.convert_hf(output, str(tmp_path / "back"))
  assert pretrain.load(str(tmp_path / "back")).vocabulary.eos_id == 300
