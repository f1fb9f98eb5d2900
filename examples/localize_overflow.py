"""Find the module where a float16 overflow starts, on the first bad step.

Trains the char-level transformer of ``train_char_lm.py`` (an unmodified
float32 Flax model) in float16 compute with a dynamic loss scale and
`jmp_lite.Telemetry` sampled every ``--telemetry-every`` steps. At step
``--inject-step`` one module's parameters are multiplied by ``--factor`` for
that step only (a weight spike, as a bad batch or a diverging layer makes
one), so its output overflows float16 and the step is skipped.

A skipped step is diagnosed at once: the same step, on the same state and
batch, is run again with telemetry on (its result is discarded), and
`PrecisionStats.first_nonfinite` names the first module, in forward order,
whose output held inf/NaN; the table shows how it spread. The script exits
with status 1 if the module it names is not the one injected.

Example:
  python examples/localize_overflow.py
  python examples/localize_overflow.py --inject-module Block_0/Dense_1 --inject-step 5
"""

from __future__ import annotations

import argparse
import sys

import _firstrun  # the standard library only: fine before the early parse

DEFAULT_MODULE = "Block_1/MultiHeadDotProductAttention_0/query"
# Seconds to compile (the training step and the diagnosing step, each with
# telemetry's probes: most of the run, and not scaled by matmul speed) and
# milliseconds per step with the defaults; they feed the time estimate. From
# a run on a 2-core avx512_bf16 EPYC at load 1.2 (68 s from the estimate to
# the summary: 50 s of it compiling), the step time converted to
# _firstrun.REFERENCE_MACHINE by its float16 matmul speed. (An older
# telemetry compiled for 226 s there.)
TIMINGS = {"f16": (60.0, 50.0)}


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=_firstrun.HelpFormatter)
  _firstrun.add_training_arguments(
      parser, steps=40, steps_help="training steps", batch_size=16,
      batch_help="sequences per step", lr=2e-3, seed_help="seed of the "
      "initialisation and the batches", corpus_bytes=1_000_000,
      corpus_help=_firstrun.CHAR_LM_CORPUS)
  parser.add_argument("--context", type=int, default=64, help="bytes per sequence")
  parser.add_argument("--inject-module", default=DEFAULT_MODULE,
                      help="path of the module whose parameters spike (wrap's paths)")
  parser.add_argument("--inject-step", type=int, default=20, help="the step they spike at")
  parser.add_argument("--factor", type=float, default=1e5,
                      help="what the module's parameters are multiplied by")
  parser.add_argument("--telemetry-every", type=int, default=50,
                      help="telemetry sampling while training")
  parser.add_argument("--out-dir", default="runs/localize_overflow",
                      help="where summary.json goes")
  parser.add_argument("--no-progress", action="store_true", help="no progress bar")
  return parser.parse_args(argv)


if __name__ == "__main__":
  parse_args()  # --help and bad flags answer before JAX is imported

_firstrun.require("tqdm")  # before the imports that need them

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jmp_lite  # noqa: E402
import jmp_lite.flax  # noqa: E402
from tqdm import tqdm  # noqa: E402
from train_char_lm import CharTransformer, batches, load_corpus  # noqa: E402


def spike(params, path: str, factor):
  """``params`` with every leaf under module ``path`` multiplied by ``factor``."""
  parts = tuple(path.split("/"))

  def scale(keys, leaf):
    names = tuple(getattr(k, "key", k) for k in keys)
    return leaf * factor.astype(leaf.dtype) if names[:len(parts)] == parts else leaf

  hits = [k for k, _ in jax.tree_util.tree_leaves_with_path(params)
          if tuple(getattr(x, "key", x) for x in k)[:len(parts)] == parts]
  if not hits:
    raise ValueError(f"no parameters under module {path!r}")
  return jax.tree_util.tree_map_with_path(scale, params)


def main(argv=None) -> dict:
  args = parse_args(argv)
  # Training stops at the first skipped step: at most --inject-step + 1 steps.
  probe = _firstrun.announce(TIMINGS, ["f16"], min(args.steps, args.inject_step + 1))
  data = load_corpus(args.corpus_bytes)
  policy = jmp_lite.get_policy("p=f32,c=f16,o=f32")
  model = jmp_lite.flax.wrap(CharTransformer(context=args.context), policy)
  params = model.init(jax.random.key(args.seed),
                      np.zeros((1, args.context), np.int32))["params"]
  state = jmp_lite.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.adam(args.lr),
      loss_scale=jmp_lite.DynamicLossScale(2.0 ** 13), policy=None)
  sampled = jmp_lite.Telemetry(every=args.telemetry_every)
  always = jmp_lite.Telemetry()

  def loss_of(params, x, y, factor):
    logits = model.apply({"params": spike(params, args.inject_module, factor)}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  train_step = jax.jit(lambda s, x, y, f: s.minimize(loss_of, x, y, f, telemetry=sampled))
  diagnose = jax.jit(lambda s, x, y, f: s.minimize(loss_of, x, y, f, telemetry=always)[1])

  rng = np.random.default_rng(args.seed)
  found = None
  bar = tqdm(range(args.steps), desc="f16", disable=args.no_progress, leave=False)
  for step in bar:
    x, y = batches(data, rng, args.batch_size, args.context)
    factor = jnp.float32(args.factor if step == args.inject_step else 1.0)
    before = state
    state, info = train_step(state, x, y, factor)
    if bool(info.skipped):
      stats = diagnose(before, x, y, factor).precision
      found = stats.first_nonfinite()
      bar.close()
      print(f"step {step}: skipped (loss scale {float(info.loss_scale):g}); "
            f"first non-finite value: {found}")
      print(stats.table())
      break
    if step % 10 == 0:
      tqdm.write(f"step {step}: loss {float(info.loss):.3f}, "
                 f"scale {float(info.loss_scale):g}")
  expected = f"{args.inject_module} (forward)"
  ok = found == expected
  print(("OK: " if ok else "MISMATCH: ") + f"injected into {args.inject_module}, "
        f"telemetry named {found}")
  summary = {"example": "localize_overflow", "injected": args.inject_module,
             "inject_step": args.inject_step, "found": found, "ok": ok, **probe}
  _firstrun.write_summary(args.out_dir, summary)
  return summary


if __name__ == "__main__":
  sys.exit(0 if main()["ok"] else 1)
