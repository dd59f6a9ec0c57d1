"""Interchange: models and vocabularies in and out of other formats.

  hf_export.py          a run as a Hugging Face model directory
  hf_import.py          a transformers checkpoint's weights as our parameters
  conversion.py         a RecurrentGemma or transformers checkpoint as a step-0 run
  hf_tokenizer.py       our vocabularies as Hugging Face tokenizers
  tokenizer.py          training a SentencePiece vocabulary on a corpus
  safetensors_writer.py safetensors files without torch
  hf_remote/            the remote code an exported Griffin model may need

Imports checkpoints (to read and write runs), never the trainer.
"""
