"""Train a small character-level transformer on the Python standard library's source.

The same unmodified Flax model is trained, from the same initialisation and the
same batches, in float32, in bfloat16 compute with float32 master weights
(`jmp_lite.flax.wrap`), and in float16 compute with dynamic loss scaling. It
reports validation loss (bits per byte) and training tokens per second of each.
The corpus is the standard library's own ``.py`` files, read from disk, as
bytes; nothing is downloaded.

Before training it says what bf16 and f16 can buy on this machine and how long
the run should take (about 7 minutes with the defaults on a 2-core AVX2 CPU:
`--steps 100` for a quick look); afterwards it prints a table and writes the
full results as JSON.

Example:
  python examples/train_char_lm.py --steps 100 --policies f32,bf16
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import time

import _firstrun  # the standard library only: fine before the early parse

POLICIES = {
    "f32": "p=f32,c=f32,o=f32",
    "bf16": "p=f32,c=bf16,o=f32",
    "f16": "p=f32,c=f16,o=f32",
    "fp8": "p=f32,c=bf16,o=f32",
    "fp8_current": "p=f32,c=bf16,o=f32",
    "fp8_block": "p=f32,c=bf16,o=f32",
}
# Rules on top of a policy: fp8 puts the MLP blocks' matmuls (every Dense of
# every Block) in fp8, with delayed scaling; attention stays in bf16.
RULES = {"fp8": {r"Block_\d+/Dense_\d+": "p=f32,c=bf16,o=f32,fp8=hybrid"}}
# ... with current and with block scaling (`jmp_lite.fp8.init`'s `scaling`).
RULES["fp8_current"] = RULES["fp8_block"] = RULES["fp8"]
# Seconds to compile and milliseconds per step of each policy with the
# defaults, converted to _firstrun.REFERENCE_MACHINE by its matmul speed from
# runs on a 2-core avx512_bf16 EPYC (f32, bf16, f16: the default run of
# docs/results/char_lm.json; fp8: the README's fp8 table). f16's compile
# includes calibration and the telemetry step's probes.
TIMINGS = {"f32": (5.0, 99.0), "bf16": (5.6, 216.0), "f16": (27.0, 96.0),
           "fp8": (6.0, 265.0), "fp8_current": (6.0, 268.0),
           "fp8_block": (8.0, 680.0)}
# Per policy, beside the steps: the corpus, validation and its compilation.
OTHER_SECONDS = 10.0


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=_firstrun.HelpFormatter)
  parser.add_argument("--policies", default="f32,bf16,f16",
                      help=_firstrun.THREE_POLICIES + "; also fp8 (bf16 compute, "
                           "the MLP blocks' matmuls in fp8, delayed scaling) and "
                           "fp8_current and fp8_block (the same with current "
                           "or block scaling)")
  _firstrun.add_training_arguments(
      parser, steps=400, steps_help="training steps per policy", batch_size=32,
      batch_help="sequences per step", lr=2e-3,
      seed_help="seed of the initialisation and the batches", corpus_bytes=4_000_000,
      corpus_help=_firstrun.CHAR_LM_CORPUS)
  parser.add_argument("--context", type=int, default=64, help="bytes per sequence")
  parser.add_argument("--val-batches", type=int, default=20,
                      help="validation batches (the same ones for every policy)")
  parser.add_argument("--out-dir", default="runs/char_lm", help="where summary.json goes")
  parser.add_argument("--no-progress", action="store_true", help="no progress bars")
  _firstrun.add_precision_arguments(parser, telemetry_every=100)
  args = parser.parse_args(argv)
  args.policies = _firstrun.policy_names(parser, args.policies, POLICIES)
  return args


if __name__ == "__main__":
  # JAX and Flax take seconds to import: --help and bad flags answer first.
  parse_args()

_firstrun.require("tqdm")  # before the imports that need them

import flax.linen as nn  # noqa: E402  (imports after the early parse above)
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from tqdm import tqdm  # noqa: E402

import jmp_lite  # noqa: E402
import jmp_lite.flax  # noqa: E402


def load_corpus(max_bytes: int) -> np.ndarray:
  """The standard library's .py files, concatenated in sorted order, as bytes."""
  root = pathlib.Path(os.__file__).parent
  chunks, total = [], 0
  for path in sorted(root.glob("*.py")):
    data = path.read_bytes()
    chunks.append(data)
    total += len(data)
    if total >= max_bytes:
      break
  return np.frombuffer(b"".join(chunks)[:max_bytes], np.uint8).astype(np.int32)


class Block(nn.Module):
  heads: int

  @nn.compact
  def __call__(self, x, mask):
    h = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
    h = nn.LayerNorm()(x)
    h = nn.Dense(4 * x.shape[-1])(h)
    return x + nn.Dense(x.shape[-1])(nn.gelu(h))


class CharTransformer(nn.Module):
  """A plain float32 decoder-only transformer over bytes."""

  width: int = 128
  depth: int = 2
  heads: int = 4
  context: int = 64

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(256, self.width)(tokens)
    pos = self.param("pos", nn.initializers.normal(0.02), (self.context, self.width))
    x = x + pos[: tokens.shape[1]].astype(x.dtype)
    mask = nn.make_causal_mask(tokens)
    for _ in range(self.depth):
      x = Block(self.heads)(x, mask)
    return nn.Dense(256)(nn.LayerNorm()(x))


def batches(data, rng, batch_size, context):
  starts = rng.integers(0, len(data) - context - 1, batch_size)
  idx = starts[:, None] + np.arange(context + 1)
  seq = data[idx]
  return seq[:, :-1], seq[:, 1:]


def train(name, train_data, val_data, args):
  policy = jmp_lite.get_policy(POLICIES[name])
  model = jmp_lite.flax.wrap(CharTransformer(context=args.context), policy,
                             rules=RULES.get(name))
  x0 = np.zeros((1, args.context), np.int32)
  params = model.init(jax.random.key(args.seed), x0)["params"]
  rng = np.random.default_rng(args.seed)
  first = batches(train_data, np.random.default_rng(args.seed), args.batch_size,
                  args.context)  # what the first step will see

  def f32_loss(params, x, y):
    logits = CharTransformer(context=args.context).apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  loss_scale, calibrated, telemetry = _firstrun.f16_start(policy, args, f32_loss,
                                                          params, *first)
  def loss_of(params, x, y):
    logits = model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  warmup = max(1, min(50, args.steps // 10))
  tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps))
  # fp8 metadata for each fp8 matmul the step makes, beside the loss scale.
  fp8 = (jmp_lite.fp8.init(loss_of, params, *first,
                           scaling=name[4:] if name in ("fp8_current", "fp8_block")
                           else "delayed")
         if name in RULES else None)
  state = jmp_lite.TrainState.create(apply_fn=model.apply, params=params, tx=tx,
                                     loss_scale=loss_scale, clip_norm=1.0, fp8=fp8)

  @jax.jit
  def train_step(state, x, y):
    return state.minimize(loss_of, x, y, telemetry=telemetry)

  @jax.jit
  def val_loss(params, fp8, x, y):
    # An fp8 model is evaluated with the scales it trained with (without
    # them its matmuls would run in bf16, and wrap would warn).
    logits = model.apply({"params": params}, x, fp8=fp8)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  losses, scales, times = [], [], []
  last_stats = None
  bar = tqdm(range(args.steps), desc=f"{name:>5}", disable=args.no_progress,
             dynamic_ncols=True)
  for step in bar:
    x, y = batches(train_data, rng, args.batch_size, args.context)
    start = time.perf_counter()
    state, info = train_step(state, x, y)
    losses.append(float(info.loss))  # blocks: the step is done
    times.append(time.perf_counter() - start)
    scales.append(float(info.loss_scale))
    if telemetry is not None and step % telemetry.every == 0:
      last_stats = (step, info.precision)
    if step % 10 == 0 or step == args.steps - 1:
      bar.set_postfix(loss=f"{losses[-1]:.3f}", scale=f"{scales[-1]:g}")

  val_rng = np.random.default_rng(12345)  # the same validation batches for all
  vals = [float(val_loss(state.params, state.loss_scale_state.fp8,
                         *batches(val_data, val_rng, args.batch_size, args.context)))
          for _ in range(args.val_batches)]
  steady = times[len(times) // 5:]  # leave out compilation and warm-up
  return {
      "policy": str(policy),
      "val_loss": float(np.mean(vals)),
      "val_bits_per_byte": float(np.mean(vals) / math.log(2)),
      "final_train_loss": float(np.mean(losses[-20:])),
      "tokens_per_second": args.batch_size * args.context / float(np.median(steady)),
      "compile_seconds": times[0],
      "step_ms": float(np.median(steady)) * 1e3,
      "skipped_steps": int(state.loss_scale_state.skipped_steps),
      "calibrated_loss_scale": None if calibrated is None else calibrated.loss_scale,
      "final_loss_scale": float(state.loss_scale.loss_scale),
      "losses": losses,
      "loss_scales": scales,
      "telemetry": last_stats,
  }


def main(argv=None):
  args = parse_args(argv)
  names = args.policies
  probe = _firstrun.announce(TIMINGS, names, args.steps, other_s=OTHER_SECONDS)
  data = load_corpus(args.corpus_bytes)
  split = int(len(data) * 0.9)
  results = {n: train(n, data[:split], data[split:], args) for n in names}

  ref = results.get("f32", {}).get("val_loss")
  print()
  _firstrun.table(
      ["policy", "val loss", "bits/byte", "vs f32", "tokens/s", "skipped steps",
       "compile s", "ms/step"],
      [[name, f"{r['val_loss']:.4f}", f"{r['val_bits_per_byte']:.4f}",
        f"{100 * (r['val_loss'] / ref - 1):+.2f}%" if ref else "-",
        f"{r['tokens_per_second']:,.0f}", r["skipped_steps"],
        f"{r['compile_seconds']:.1f}", f"{r['step_ms']:.0f}"]
       for name, r in results.items()])
  for name, r in results.items():
    if r["telemetry"] is not None:
      _firstrun.print_telemetry(name, *r["telemetry"])
  summary = {
      "example": "train_char_lm", "steps": args.steps, "batch_size": args.batch_size,
      "context": args.context, "seed": args.seed, "corpus_bytes": int(len(data)),
      "backend": jax.default_backend(), **probe,
      "results": {n: {k: v for k, v in r.items()
                      if k not in ("losses", "loss_scales", "telemetry")}
                  for n, r in results.items()},
  }
  print()
  _firstrun.write_summary(args.out_dir, summary)
  return summary


if __name__ == "__main__":
  main()
