"""Train a small CNN on scikit-learn's digits under several precision policies.

The same unmodified Flax model is trained, from the same initialisation and the
same batches, under each policy:

  f32          float32 everywhere (the reference).
  bf16         float32 master params, bfloat16 compute (`jmp_lite.flax.wrap`).
  f16          float32 master params, float16 compute, dynamic loss scaling.
  f16_underflow  ... whose loss scale also grows when telemetry measures
               underflowing cotangents (`jmp_lite.UnderflowAwareLossScale`).
  f16_als      ... with Graphcore's automatic loss scaling: halved when more
               than 1e-7 of the cotangents sit in the top 1/16 of the range,
               doubled otherwise, every step (`jmp_lite.AutomaticLossScale`).
  fp8          bf16 compute, with the Dense layers' matmuls in fp8 (e4m3
               operands, e5m2 gradients, delayed scaling; `jmp_lite.fp8`).
               Emulated on a CPU: it shows accuracy, not speed.
  fp8_current  ... with current scaling: each tensor's scale from its own
               maximum in the same step (Transformer Engine's recipe).
  fp8_block    ... with block scaling (MXFP8): a power-of-two scale per 32
               values along each matmul's contraction.
  pure_f16     float16 params and compute (O3 on a float16 GPU), plain Adam,
               dynamic loss scaling: `with_loss_scale` keeps Adam in float32.
  pure_bf16    bfloat16 params and Adam moments, round-to-nearest updates.
  pure_bf16_sr     ... with stochastic rounding of the updates.
  pure_bf16_kahan  ... with Kahan-compensated updates.

By default it runs f32, bf16 and f16 (about a minute of training on a 2-core
CPU); `--all-policies` runs every one of them. Before training it says what bf16 and
f16 can buy on this machine and how long the run should take; afterwards it
prints a table (test accuracy, skipped steps, memory, compile time, step time)
and writes a PNG of the training loss and of the loss scale, and the full
results as JSON. The data ships with scikit-learn (1,797 8x8 images); nothing
is downloaded.

Example:
  python examples/train_digits.py
  python examples/train_digits.py --all-policies
  python examples/train_digits.py --policies f32,f16,pure_f16 --steps 300
"""

from __future__ import annotations

import argparse
import os
import time

import _firstrun  # the standard library only: fine before the early parse

# name: (policy, what it is), in the order of the table and the plot.
POLICIES = {
    "f32": ("p=f32,c=f32,o=f32", "float32 throughout (the reference)"),
    "bf16": ("p=f32,c=bf16,o=f32", "bf16 compute, f32 master params"),
    "f16": ("p=f32,c=f16,o=f32", "f16 compute, f32 master params, dynamic loss scale"),
    "f16_underflow": ("p=f32,c=f16,o=f32", "f16 with an underflow-aware loss scale"),
    "f16_als": ("p=f32,c=f16,o=f32", "f16 with Graphcore's automatic loss scaling"),
    "fp8": ("p=f32,c=bf16,o=f32,fp8=hybrid",
            "bf16 compute, Dense matmuls in fp8 with delayed scaling"),
    "fp8_current": ("p=f32,c=bf16,o=f32,fp8=hybrid",
                    "fp8 with current scaling (each tensor's own maximum, this step)"),
    "fp8_block": ("p=f32,c=bf16,o=f32,fp8=hybrid",
                  "fp8 with block scaling (MXFP8: a power-of-two scale per 32 values)"),
    "pure_f16": ("p=f16,c=f16,o=f32", "f16 params and compute, dynamic loss scale"),
    "pure_bf16": ("p=bf16,c=bf16,o=f32", "bf16 params and Adam moments, round to nearest"),
    "pure_bf16_sr": ("p=bf16,c=bf16,o=f32", "pure_bf16 + stochastic rounding of updates"),
    "pure_bf16_kahan": ("p=bf16,c=bf16,o=f32", "pure_bf16 + Kahan-compensated updates"),
}
DEFAULT_POLICIES = "f32,bf16,f16"
# Seconds to compile and milliseconds per step of each policy with the
# defaults, on _firstrun.REFERENCE_MACHINE; they feed the time estimate.
TIMINGS = {"f32": (3.5, 16.7), "bf16": (4.2, 17.5), "f16": (3.7, 15.8),
           "f16_underflow": (7.0, 17.0), "f16_als": (7.0, 19.0), "fp8": (6.0, 20.0),
           "fp8_current": (6.5, 21.0), "fp8_block": (7.0, 24.0),
           "pure_f16": (4.0, 17.0), "pure_bf16": (4.2, 18.0),
           "pure_bf16_sr": (4.5, 20.0), "pure_bf16_kahan": (4.5, 20.0)}
# Seconds per policy outside its training steps (evaluation, calibration,
# their compilations): the estimate's "in all" and --help's ratio count them.
OTHER_S = 6.0


def _all_policies_ratio() -> float:
  """How much longer --all-policies takes than the default, from TIMINGS."""
  def seconds(names):  # what the estimate "in all" counts
    return sum(TIMINGS[n][0] + 600 * TIMINGS[n][1] / 1e3 + OTHER_S for n in names)
  return seconds(POLICIES) / seconds(DEFAULT_POLICIES.split(","))


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0], formatter_class=_firstrun.HelpFormatter,
      epilog="policies: " + "; ".join(f"{n} = {d}" for n, (_, d) in POLICIES.items()))
  parser.add_argument("--policies", default=DEFAULT_POLICIES,
                      help=f"comma-separated policy names (all: {', '.join(POLICIES)})")
  parser.add_argument("--all-policies", action="store_true",
                      help=f"run every policy ({len(POLICIES)} against the default's "
                           f"{len(DEFAULT_POLICIES.split(','))}: about "
                           f"{_all_policies_ratio():.1f}x its time on the reference "
                           "machine; the estimate printed before training is for this one)")
  parser.add_argument("--steps", type=int, default=600, help="training steps per policy")
  parser.add_argument("--batch-size", type=int, default=64, help="images per step")
  parser.add_argument("--lr", type=float, default=3e-3,
                      help="Adam's peak learning rate (cosine decay to 0)")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the data split, the initialisation and the batches")
  parser.add_argument("--out-dir", default="runs/digits",
                      help="where digits.png and summary.json go")
  parser.add_argument("--no-progress", action="store_true", help="no progress bars")
  _firstrun.add_precision_arguments(parser, telemetry_every=100)
  args = parser.parse_args(argv)
  args.policies = (list(POLICIES) if args.all_policies else
                   _firstrun.policy_names(parser, args.policies, POLICIES))
  return args


if __name__ == "__main__":
  # JAX and Flax take seconds to import: --help and bad flags answer first.
  parse_args()

_firstrun.require("sklearn", "tqdm", "matplotlib")  # before the imports that need them

import flax.linen as nn  # noqa: E402  (imports after the early parse above)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from tqdm import tqdm  # noqa: E402

import jmp_lite  # noqa: E402
import jmp_lite.flax  # noqa: E402


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
  policy = jmp_lite.get_policy(POLICIES[name][0])
  model = jmp_lite.flax.wrap(CNN(), policy)
  params = model.init(jax.random.key(args.seed), x_train[:1])["params"]
  # f16 has a narrow range: scale the loss, dynamically, from a measured
  # start. bf16 has f32's range.
  first = np.random.default_rng(args.seed).integers(0, len(y_train), args.batch_size)
  f32_loss = lambda p, x, y: optax.softmax_cross_entropy_with_integer_labels(
      CNN().apply({"params": p}, x), y).mean()
  loss_scale, calibrated, telemetry = _firstrun.f16_start(
      policy, args, f32_loss, params, x_train[first], y_train[first],
      kind={"f16_underflow": "underflow", "f16_als": "automatic"}.get(name, "dynamic"))
  def loss_fn(params, x, y):
    logits = model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  # fp8: the metadata (amax histories and scales) of each fp8 matmul the
  # step makes, found by tracing it; it lives beside the loss scale.
  fp8 = (jmp_lite.fp8.init(loss_fn, params, x_train[first], y_train[first],
                           scaling=name[4:] if name in ("fp8_current", "fp8_block")
                           else "delayed")
         if policy.fp8 else None)
  state = jmp_lite.TrainState.create(
      apply_fn=model.apply, params=params, loss_scale=loss_scale, fp8=fp8,
      tx=make_optimizer(name, args.lr, args.steps, args.seed))

  @jax.jit
  def train_step(state, x, y):
    return state.minimize(loss_fn, x, y, telemetry=telemetry)

  @jax.jit
  def accuracy(params, fp8, x, y):
    # An fp8 model is evaluated with the scales it trained with (without
    # them its matmuls would run in bf16, and wrap would warn).
    return jnp.mean(jnp.argmax(model.apply({"params": params}, x, fp8=fp8), -1) == y)

  rng = np.random.default_rng(args.seed)
  losses, scales = [], []
  bar = tqdm(range(args.steps), desc=f"{name:>15}", disable=args.no_progress,
             dynamic_ncols=True)
  times = []
  last_stats, underflow = None, []
  for step in bar:
    idx = rng.integers(0, len(y_train), args.batch_size)
    start = time.perf_counter()
    state, info = train_step(state, x_train[idx], y_train[idx])
    losses.append(float(info.loss))  # waits for the step
    times.append(time.perf_counter() - start)
    scales.append(float(info.loss_scale))
    if telemetry is not None and step % telemetry.every == 0:
      last_stats = (step, info.precision)
      underflow.append((step, float(info.precision.cotangent_underflow)))
    if step % 20 == 0 or step == args.steps - 1:
      bar.set_postfix(loss=f"{losses[-1]:.4f}", scale=f"{scales[-1]:g}")
  ls_state = state.loss_scale_state
  leaves = jax.tree.leaves(state.params)
  return {
      "policy": str(policy),
      "calibrated_loss_scale": None if calibrated is None else calibrated.loss_scale,
      "test_accuracy": float(accuracy(state.params, state.loss_scale_state.fp8, x_test, y_test)),
      "final_train_loss": float(np.mean(losses[-20:])),
      "skipped_steps": int(ls_state.skipped_steps),
      "final_loss_scale": float(ls_state.loss_scale.loss_scale),
      "param_bytes": int(sum(x.nbytes for x in leaves)),
      "opt_state_bytes": int(sum(x.nbytes for x in jax.tree.leaves(state.opt_state))),
      "seconds": float(sum(times)),
      # The first step compiles; the others show the step's own speed.
      "compile_seconds": times[0],
      "step_ms": float(np.median(times[1:]) * 1e3) if len(times) > 1 else float("nan"),
      "losses": losses,
      "loss_scales": scales,
      "telemetry": last_stats,
      "cotangent_underflow": underflow,
  }


def _scale_changes(result) -> list:
  """``[step, loss scale]`` at the start and wherever the scale changed; the
  final scale (after the last step) closes the list."""
  scales = list(result["loss_scales"]) + [result["final_loss_scale"]]
  return [[0, scales[0]]] + [[i, b] for i, (a, b) in enumerate(zip(scales, scales[1:]), 1)
                             if a != b]


def _power_of_two(value: float) -> str:
  """``2^k`` for a power of two, else the number."""
  k = np.log2(value)
  return f"$2^{{{k:.0f}}}$" if k == round(k) else f"{value:g}"


def plot(results, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  # Only policies whose loss scale moved get a panel line: a scale fixed at 1
  # (bf16, f32: no scaling) carries no information.
  scaled = {n: r for n, r in results.items() if len(set(r["loss_scales"])) > 1}
  measured = {n: r for n, r in results.items() if r["cotangent_underflow"]}
  panels = 1 + bool(scaled) + bool(measured)
  fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.8), squeeze=False)
  ax1 = axes[0, 0]
  for name, r in results.items():
    loss = np.convolve(r["losses"], np.ones(10) / 10, mode="valid")
    ax1.plot(loss, label=f"{name}: {POLICIES[name][1]} (test acc {r['test_accuracy']:.3f})")
  ax1.set(title="Training loss (moving average of 10 steps)", xlabel="step",
          ylabel="cross-entropy", yscale="log")
  ax1.legend(fontsize=7)
  if scaled:
    ax2 = axes[0, 1]
    levels, last = set(), 0
    for name, r in scaled.items():
      # The scale each step used, then the one after the last step: the run
      # ends at its final scale (the one the table prints).
      ys = list(r["loss_scales"]) + [r["final_loss_scale"]]
      (line,) = ax2.step(range(len(ys)), ys, where="post",
                         label=f"{name}: {r['skipped_steps']} steps skipped")
      # A change after the last step is a jump on the frame's edge: a dot
      # marks the final scale, so the run visibly ends there.
      ax2.plot([len(ys) - 1], [ys[-1]], "o", color=line.get_color(), ms=4)
      levels |= set(ys)
      last = max(last, len(ys) - 1)
    ax2.set(title="Dynamic loss scale (policies without scaling stay at 1: not shown; "
                  "dot: the scale after the last step)",
            xlabel="step", ylabel="loss scale", xlim=(0, last * 1.02))
    # The scale moves by factors of two: a log2 axis with a tick at every
    # level the runs reached, labelled as powers of two.
    ax2.set_yscale("log", base=2)
    ax2.set_yticks(sorted(levels), [_power_of_two(v) for v in sorted(levels)])
    ax2.minorticks_off()
    ax2.set_ylim(min(levels) / 1.5, max(levels) * 1.5)  # the top level off the frame
    ax2.title.set_fontsize(9)
    ax2.legend(fontsize=7)
  if measured:
    ax3 = axes[0, panels - 1]
    for name, r in measured.items():
      steps, shares = zip(*r["cotangent_underflow"])
      ax3.plot(steps, np.asarray(shares) * 100, marker=".", label=name)
    ax3.set(title="f16 cotangents below the smallest normal (jmp_lite.Telemetry)",
            xlabel="step", ylabel="% of non-zero cotangents", ylim=(0, None))
    ax3.title.set_fontsize(9)
    ax3.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None):
  args = parse_args(argv)
  names = args.policies
  # Beside the steps, each policy evaluates, calibrates (f16) and compiles
  # both: 58 s in all for the default's 39 s of steps on a 2-core
  # avx512_bf16 EPYC, 6 s a policy (imports and the plot included).
  probe = _firstrun.announce(TIMINGS, names, args.steps, other_s=OTHER_S)
  data = load_data(args.seed)
  results = {name: train(name, data, args) for name in names}
  os.makedirs(args.out_dir, exist_ok=True)
  plot_path = os.path.join(args.out_dir, "digits.png")
  plot(results, plot_path)

  print()
  _firstrun.table(
      ["policy", "test acc", "skipped steps", "final loss scale", "params+Adam KiB",
       "compile s", "ms/step"],
      [[name, f"{r['test_accuracy']:.4f}", r["skipped_steps"], r["final_loss_scale"],
        f"{(r['param_bytes'] + r['opt_state_bytes']) / 1024:,.0f}",
        f"{r['compile_seconds']:.1f}", f"{r['step_ms']:.1f}"]
       for name, r in results.items()])
  for name, r in results.items():
    if r["skipped_steps"] or len(set(r["loss_scales"])) > 1:
      changes = [f"{i}: {v:g}" for i, v in _scale_changes(r)]
      if len(changes) > 14:  # a scale that moves every step (f16_als)
        changes = changes[:8] + [f"… ({len(changes) - 12} more)"] + changes[-4:]
      print(f"{name} loss scale by step: " + ", ".join(changes))
  for name, r in results.items():
    if r["telemetry"] is not None:
      _firstrun.print_telemetry(name, *r["telemetry"])
  summary = {
      "example": "train_digits", "steps": args.steps, "batch_size": args.batch_size,
      "seed": args.seed, "lr": args.lr, "backend": jax.default_backend(), **probe,
      "results": {n: {**{k: v for k, v in r.items()
                         if k not in ("losses", "loss_scales", "telemetry")},
                      "description": POLICIES[n][1],
                      "loss_scale_changes": _scale_changes(r)}
                  for n, r in results.items()},
      "plot": plot_path,
  }
  print(f"\nplot: {plot_path}")
  _firstrun.write_summary(args.out_dir, summary)
  return summary


if __name__ == "__main__":
  main()
