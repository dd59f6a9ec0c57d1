"""Evaluation: what a model is scored on, during training and after it.

  loss.py            validation loss and bits per byte over batches
  downstream.py      lm-evaluation-harness tasks on live parameters
  lm_eval_backend.py the harness's LM interface over our model (the `eval` extra)
  extrapolation.py   synthetic-task accuracy at multiples of the training length
  generation.py      sampling a continuation from a prompt

Imports checkpoints and observability, never the trainer.
"""
