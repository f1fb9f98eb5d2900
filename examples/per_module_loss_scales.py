"""Compare loss scales on models whose modules' gradients lie far apart.

Each model is trained from the same initialisation on the same batches of
scikit-learn's digits (float32 master parameters, float16 compute), once per
loss scale, and once in float32 (the reference):

  dynamic          `jmp_lite.DynamicLossScale`: one scale, grows every 2000
                   finite steps, backs off on overflow.
  underflow_aware  `jmp_lite.UnderflowAwareLossScale`: also grows when
                   telemetry measures underflowing cotangents.
  automatic        `jmp_lite.AutomaticLossScale`: Graphcore's rule, by the
                   share of cotangents near the top of the range.
  per_module       `jmp_lite.ModuleLossScale`: a scale for each module
                   (Zhao et al., 2019, adaptive loss scaling).

The models (both unmodified Flax Linen code):

  three_heads   an MLP trunk with a classifier head (mean cross-entropy), a
                reconstruction head (summed squared error: large gradients)
                and a parity head whose loss is weighted 2**-20 (tiny ones):
                weight gradients 2**32 apart.
  deep_sigmoid  eight sigmoid blocks (vanishing gradients: each block's
                gradient about 4x smaller than the next one's): 2**17 apart.

Underflow is measured against the float32 gradient of the same parameters
and batch every `--measure-every` steps: the share of its non-zero elements
that lie below float16's smallest normal at the scale the step holds them
(the global scale, or the scale of the innermost scaled module the weight
belongs to): values that float16 makes subnormal or flushes to zero.

It prints a table, and writes every row to ``--out-dir``/summary.json.

Example:
  python examples/per_module_loss_scales.py
  python examples/per_module_loss_scales.py --model deep_sigmoid --steps 3000
"""

from __future__ import annotations

import argparse
import time

import _firstrun  # the standard library only: fine before JAX loads

MODELS = ("three_heads", "deep_sigmoid")
VARIANTS = ("float32", "dynamic", "underflow_aware", "automatic", "per_module")
POLICY = "p=f32,c=f16,o=f32"
# Seconds to compile and milliseconds per step (the underflow measurements
# included) with the defaults, per variant. Measured on a 2-core
# avx512_bf16 EPYC (class A), not on _firstrun.REFERENCE_MACHINE: the
# estimate scales them by that machine's float32 matmul speed (the bench's
# probe there: bench/results/guard-compile.md); on an AVX2-only machine it
# may come out short.
TIMINGS = {"float32": (1.5, 2.0), "dynamic": (1.5, 1.3), "underflow_aware": (4.0, 3.5),
           "automatic": (4.0, 3.6), "per_module": (3.0, 3.0)}
REFERENCE = ("2-core AMD EPYC with avx512_bf16 (class A), JAX 0.10.2", {"float32": 175.6})


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=_firstrun.HelpFormatter)
  parser.add_argument("--model", default="three_heads", choices=MODELS,
                      help="three_heads: weight gradients 2**32 apart; "
                      "deep_sigmoid: eight sigmoid blocks, 2**17 apart")
  parser.add_argument("--steps", type=int, default=1500, help="training steps")
  parser.add_argument("--batch-size", type=int, default=128, help="digits per step")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the data split, the initialisation and the batches")
  parser.add_argument("--measure-every", type=int, default=25,
                      help="steps between underflow measurements")
  parser.add_argument("--variants", default=",".join(VARIANTS),
                      help=f"comma-separated, from {', '.join(VARIANTS)}")
  parser.add_argument("--out-dir", default="runs/per_module_loss_scales",
                      help="where summary.json goes")
  parser.add_argument("--no-progress", action="store_true", help="no progress bar")
  args = parser.parse_args(argv)
  args.variants = _firstrun.policy_names(parser, args.variants, VARIANTS)
  return args


if __name__ == "__main__":
  parse_args()  # --help and bad flags answer before JAX is imported

_firstrun.require("sklearn", "tqdm")  # before the imports that need them

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from tqdm import tqdm  # noqa: E402

import jmp_lite  # noqa: E402
import jmp_lite.flax  # noqa: E402

PARITY_WEIGHT = 2.0 ** -20
F16_TINY = float(jnp.finfo(jnp.float16).smallest_normal)


class ThreeHeads(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(64)(x))
    h = nn.relu(nn.Dense(64)(h))
    return (nn.Dense(10, name="classes")(h), nn.Dense(2, name="parity")(h),
            nn.Dense(64, name="reconstruction")(h))


class SigmoidBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.sigmoid(nn.Dense(32)(x))


class DeepSigmoid(nn.Module):
  depth: int = 8

  @nn.compact
  def __call__(self, x):
    x = nn.sigmoid(nn.Dense(32)(x))
    for _ in range(self.depth):
      x = SigmoidBlock()(x)
    return nn.Dense(10, name="classes")(x)


def _ce(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), labels).mean()


def make(name):
  """``(model, loss(apply, params, x, y), learning rate)``."""
  if name == "three_heads":
    def loss(apply, params, x, y):
      classes, parity, reconstruction = apply(params, x)
      return (_ce(classes, y) + PARITY_WEIGHT * _ce(parity, y % 2)
              + jnp.sum((reconstruction.astype(jnp.float32) - x) ** 2))
    return ThreeHeads(), loss, 1e-3

  def loss(apply, params, x, y):
    return _ce(apply(params, x), y)
  return DeepSigmoid(), loss, 3e-3


def loss_scale(variant, wrapped, example):
  low = dict(min_loss_scale=2.0 ** -24)  # room below 1 for large gradients
  if variant == "dynamic":
    return jmp_lite.DynamicLossScale(2.0 ** 15, **low)
  if variant == "underflow_aware":
    return jmp_lite.UnderflowAwareLossScale(2.0 ** 15, **low)
  if variant == "automatic":
    return jmp_lite.AutomaticLossScale(2.0 ** 15, **low)
  if variant == "per_module":
    return jmp_lite.ModuleLossScale.create(wrapped, example, loss_scale=2.0 ** 15, **low)
  return None


def held_scales(params, ls):
  """Per parameter leaf, the scale its weight gradient is held at in float16."""
  paths = getattr(ls, "paths", ())
  scales = np.asarray(getattr(ls, "module_scales", np.zeros(0)))
  global_scale = float(ls.loss_scale)

  def one(keypath, _):
    module = "/".join(str(k.key) for k in keypath[1:-1])  # drop "params", name
    owners = [i for i, p in enumerate(paths)
              if module == p or module.startswith(p + "/")]
    if not owners:
      return global_scale
    return float(scales[max(owners, key=lambda i: len(paths[i]))])
  return jax.tree_util.tree_map_with_path(one, params)


def underflow_share(grads32, scales) -> float:
  """Share of non-zero float32 gradient elements below float16's smallest
  normal at the scale they are held at."""
  under = total = 0
  for g, s in zip(jax.tree.leaves(grads32), jax.tree.leaves(scales)):
    g = np.abs(np.asarray(g))
    nonzero = g > 0
    under += int(np.sum(nonzero & (g * s < F16_TINY)))
    total += int(np.sum(nonzero))
  return under / max(total, 1)


def train(args, variant, data):
  base, loss, lr = make(args.model)
  xtr, ytr, xte, yte = data
  wrapped = base if variant == "float32" else jmp_lite.flax.wrap(base, POLICY)
  params = base.init(jax.random.key(args.seed), xtr[:2])
  ls = loss_scale(variant, wrapped, xtr[:2])
  state = jmp_lite.TrainState.create(apply_fn=wrapped.apply, params=params,
                                     tx=optax.adam(lr), loss_scale=ls)
  reads = getattr(type(ls), "MEASURES", ())
  telemetry = jmp_lite.Telemetry() if reads and "modules" not in reads else None

  @jax.jit
  def step(state, x, y):
    return state.minimize(lambda p: loss(wrapped.apply, p, x, y), telemetry=telemetry)

  grad32 = jax.jit(jax.grad(lambda p, x, y: loss(base.apply, p, x, y)))
  rng = np.random.RandomState(args.seed + 1)
  shares, skipped, start = [], 0, time.time()
  order = []
  for i in tqdm(range(args.steps), desc=variant, disable=args.no_progress,
                leave=False):
    if len(order) < args.batch_size:
      order = list(rng.permutation(len(xtr)))
    idx, order = order[:args.batch_size], order[args.batch_size:]
    x, y = xtr[idx], ytr[idx]
    if ls is not None and i % args.measure_every == 0:
      shares.append(underflow_share(grad32(state.params, x, y),
                                    held_scales(state.params, state.loss_scale)))
    state, info = step(state, x, y)
    skipped += int(info.skipped)
  outputs = base.apply(state.params, xte)
  classes = outputs[0] if isinstance(outputs, tuple) else outputs
  row = {
      "loss scale": variant,
      "skipped": skipped,
      "underflow share": float(np.mean(shares)) if shares else 0.0,
      "final train loss": float(loss(base.apply, state.params, xtr, ytr)),
      "test accuracy": float(np.mean(np.argmax(np.asarray(classes), -1) == yte)),
      "seconds": round(time.time() - start, 1),
  }
  if isinstance(outputs, tuple):
    row["parity accuracy"] = float(np.mean(np.argmax(np.asarray(outputs[1]), -1)
                                           == yte % 2))
  return row


def main(argv=None) -> dict:
  args = parse_args(argv)
  probe = _firstrun.announce(TIMINGS, args.variants, args.steps, reference=REFERENCE)
  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  perm = np.random.RandomState(args.seed).permutation(len(x))
  x, y = x[perm], digits.target[perm]
  data = (x[:1500], y[:1500], x[1500:], y[1500:])
  rows = []
  for variant in args.variants:
    rows.append(train(args, variant, data))
    print(f"{variant}: {rows[-1]}", flush=True)
  header = list(rows[0])
  print(f"\n{args.model}, {args.steps} steps, batch {args.batch_size}, {POLICY}:")
  _firstrun.table(header, [[r.get(h, "") for h in header] for r in rows])
  summary = {"model": args.model, "steps": args.steps, "batch_size": args.batch_size,
             "seed": args.seed, "policy": POLICY, "rows": rows, **probe}
  _firstrun.write_summary(args.out_dir, summary)
  return summary


if __name__ == "__main__":
  main()
