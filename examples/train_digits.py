"""Train a small CNN on scikit-learn's digits under several precision policies.

The same unmodified Flax model is trained, from the same initialisation and the
same batches, under each policy:

  f32          float32 everywhere (the reference).
  bf16         float32 master params, bfloat16 compute (`jmp_lite.flax.wrap`).
  f16          float32 master params, float16 compute, dynamic loss scaling.
  pure_f16     float16 params and compute (O3 on a float16 GPU), plain Adam,
               dynamic loss scaling: `with_loss_scale` keeps Adam in float32.
  pure_bf16    bfloat16 params and Adam moments, round-to-nearest updates.
  pure_bf16_sr     ... with stochastic rounding of the updates.
  pure_bf16_kahan  ... with Kahan-compensated updates.

It prints the test accuracy and skipped steps of each, writes a PNG of the
training loss per policy and of the loss scale over steps, and a JSON summary.
The data ships with scikit-learn (1,797 8x8 images); nothing is downloaded.

Example:
  python examples/train_digits.py --steps 600 --policies f32,bf16,f16
  python examples/train_digits.py --policies f32,f16,pure_f16
"""

from __future__ import annotations

import argparse
import json
import os
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from tqdm import tqdm

import jmp_lite
import jmp_lite.flax

POLICIES = {
    "f32": "p=f32,c=f32,o=f32",
    "bf16": "p=f32,c=bf16,o=f32",
    "f16": "p=f32,c=f16,o=f32",
    "pure_f16": "p=f16,c=f16,o=f32",
    "pure_bf16": "p=bf16,c=bf16,o=f32",
    "pure_bf16_sr": "p=bf16,c=bf16,o=f32",
    "pure_bf16_kahan": "p=bf16,c=bf16,o=f32",
}


class CNN(nn.Module):
  """A plain float32 Flax model: jmp_lite changes its precision from outside."""

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(32, (3, 3))(x)
    x = nn.relu(nn.LayerNorm()(x))
    x = nn.Conv(64, (3, 3))(x)
    x = nn.relu(nn.LayerNorm()(x))
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(256)(x))
    return nn.Dense(10)(x)


def load_data(seed: int, test_fraction: float = 0.2):
  digits = load_digits()
  x = (digits.images / 16.0).astype(np.float32)[..., None]
  y = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(y))
  n_test = int(len(y) * test_fraction)
  test, train = order[:n_test], order[n_test:]
  return (x[train], y[train]), (x[test], y[test])


def make_optimizer(name: str, lr: float, steps: int, seed: int):
  schedule = optax.cosine_decay_schedule(lr, steps)
  if not name.startswith("pure_bf16"):
    return optax.adam(schedule)
  # Pure bf16: moments stored in bf16 too; updates computed in f32.
  tx = [jmp_lite.optax.with_state_dtype(optax.adam(schedule), jnp.bfloat16)]
  if name == "pure_bf16_sr":
    tx.append(jmp_lite.optax.stochastic_round(jax.random.key(seed + 1)))
  elif name == "pure_bf16_kahan":
    tx.append(jmp_lite.optax.kahan_summation())
  return optax.chain(*tx)


def train(name, data, args):
  (x_train, y_train), (x_test, y_test) = data
  policy = jmp_lite.get_policy(POLICIES[name])
  model = jmp_lite.flax.wrap(CNN(), policy)
  params = model.init(jax.random.key(args.seed), x_train[:1])["params"]
  # f16 has a narrow range: scale the loss, dynamically. bf16 has f32's range.
  loss_scale = (jmp_lite.DynamicLossScale(2.0 ** 15, period=200)
                if policy.compute_dtype == jnp.float16 else jmp_lite.NoOpLossScale())
  state = jmp_lite.TrainState.create(
      apply_fn=model.apply, params=params, loss_scale=loss_scale,
      tx=make_optimizer(name, args.lr, args.steps, args.seed))

  @jax.jit
  def train_step(state, x, y):
    def loss_fn(params):
      logits = state.apply_fn({"params": params}, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return state.minimize(loss_fn)

  @jax.jit
  def accuracy(params, x, y):
    return jnp.mean(jnp.argmax(model.apply({"params": params}, x), -1) == y)

  rng = np.random.default_rng(args.seed)
  losses, scales = [], []
  bar = tqdm(range(args.steps), desc=f"{name:>15}", disable=args.no_progress,
             dynamic_ncols=True)
  start = time.perf_counter()
  for step in bar:
    idx = rng.integers(0, len(y_train), args.batch_size)
    state, info = train_step(state, x_train[idx], y_train[idx])
    losses.append(float(info.loss))
    scales.append(float(info.loss_scale))
    if step % 20 == 0 or step == args.steps - 1:
      bar.set_postfix(loss=f"{losses[-1]:.4f}", scale=f"{scales[-1]:g}")
  seconds = time.perf_counter() - start
  ls_state = state.loss_scale_state
  leaves = jax.tree.leaves(state.params)
  return {
      "policy": str(policy),
      "test_accuracy": float(accuracy(state.params, x_test, y_test)),
      "final_train_loss": float(np.mean(losses[-20:])),
      "skipped_steps": int(ls_state.skipped_steps),
      "final_loss_scale": float(ls_state.loss_scale.loss_scale),
      "param_bytes": int(sum(x.nbytes for x in leaves)),
      "opt_state_bytes": int(sum(x.nbytes for x in jax.tree.leaves(state.opt_state))),
      "seconds": seconds,
      "losses": losses,
      "loss_scales": scales,
  }


def plot(results, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
  for name, r in results.items():
    loss = np.convolve(r["losses"], np.ones(10) / 10, mode="valid")
    ax1.plot(loss, label=f"{name} (test acc {r['test_accuracy']:.3f})")
    ax2.plot(r["loss_scales"], label=name)
  ax1.set(title="Training loss (moving average of 10 steps)", xlabel="step",
          ylabel="cross-entropy", yscale="log")
  ax2.set(title="Loss scale", xlabel="step", ylabel="scale", yscale="log")
  ax1.legend()
  ax2.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--policies", default="f32,bf16,f16,pure_bf16,pure_bf16_sr,pure_bf16_kahan",
                      help=f"comma-separated, from {', '.join(POLICIES)}")
  parser.add_argument("--steps", type=int, default=800)
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out-dir", default="runs/digits",
                      help="where the PNG plot and the JSON summary go")
  parser.add_argument("--no-progress", action="store_true", help="no progress bars")
  args = parser.parse_args(argv)
  names = [n.strip() for n in args.policies.split(",") if n.strip()]
  unknown = [n for n in names if n not in POLICIES]
  if unknown:
    parser.error(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")

  data = load_data(args.seed)
  results = {name: train(name, data, args) for name in names}
  os.makedirs(args.out_dir, exist_ok=True)
  plot(results, os.path.join(args.out_dir, "digits.png"))

  print(f"\n{'policy':>16}  {'test acc':>8}  {'skipped':>7}  {'final scale':>11}  "
        f"{'params+opt KiB':>14}  {'seconds':>7}")
  for name, r in results.items():
    kib = (r["param_bytes"] + r["opt_state_bytes"]) / 1024
    print(f"{name:>16}  {r['test_accuracy']:8.4f}  {r['skipped_steps']:7d}  "
          f"{r['final_loss_scale']:11g}  {kib:14.1f}  {r['seconds']:7.1f}")
  for name, r in results.items():
    if r["skipped_steps"] or len(set(r["loss_scales"])) > 1:
      changes = [(0, r["loss_scales"][0])] + [
          (i, b) for i, (a, b) in enumerate(zip(r["loss_scales"], r["loss_scales"][1:]), 1)
          if a != b]
      print(f"{name} loss scale by step: " + ", ".join(f"{i}: {v:g}" for i, v in changes))
  summary = {
      "example": "train_digits", "steps": args.steps, "batch_size": args.batch_size,
      "seed": args.seed, "lr": args.lr, "backend": jax.default_backend(),
      "results": {n: {k: v for k, v in r.items() if k not in ("losses", "loss_scales")}
                  for n, r in results.items()},
      "plot": os.path.join(args.out_dir, "digits.png"),
  }
  with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  print(json.dumps(summary["results"]))
  print(f"plot: {summary['plot']}  summary: {os.path.join(args.out_dir, 'summary.json')}")
  return summary


if __name__ == "__main__":
  main()
