"""Data shared by the multi-process workers: poisoned batches and MLP weights."""

import numpy as np


def batches(n_steps, batch, d_in, d_out, poisoned):
  """Random global batches with an inf at ``poisoned[step] = (row, column)``."""
  rng = np.random.default_rng(0)
  xs = rng.standard_normal((n_steps, batch, d_in)).astype(np.float32)
  ys = rng.standard_normal((n_steps, batch, d_out)).astype(np.float32)
  for step, (row, col) in poisoned.items():
    xs[step, row, col] = np.inf
  return xs, ys


def mlp_params(d_in, d_hidden, d_out, w2_scale=4):
  rng = np.random.default_rng(1)
  return {"w1": (rng.standard_normal((d_in, d_hidden)) / 4).astype(np.float32),
          "b1": (rng.standard_normal((d_hidden,)) / 4).astype(np.float32),
          "w2": (rng.standard_normal((d_hidden, d_out)) / w2_scale).astype(np.float32)}
