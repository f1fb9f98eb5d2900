"""Op-level autocast on a plain-JAX transformer: float32 vs autocast, on digits.

The model is written in jax.numpy only (no Flax): each 8x8 scikit-learn digit
is a sequence of 8 row-tokens, embedded, passed through pre-norm transformer
blocks (a `lax.scan` over stacked layers), mean-pooled and classified.

The same training step is compiled twice:

* float32 throughout;
* ``jmp_lite.autocast(jax.value_and_grad(loss), "O1")``: every matmul
  of the forward *and* backward pass in bfloat16 with float32 accumulation;
  softmax, layer norm and the loss in float32. Parameters, gradients and the
  optimizer stay float32 (autocast returns the dtypes the step returns).

Before training it says what bf16 and f16 can buy on this machine and how long
the run should take (about half a minute on a 2-core CPU); then it prints the
audit of the autocast step (nothing flagged) and a table of the test accuracy
and step time of each run.

Usage:
  python examples/autocast_plain_jax.py
  python examples/autocast_plain_jax.py --steps 500 --dtype f16 --layers 2
"""

import argparse
import pathlib
import time

import _firstrun  # the standard library only: fine before the early parse

# Seconds to compile and milliseconds per step of each run with the defaults,
# on _firstrun.REFERENCE_MACHINE; they feed the time estimate.
TIMINGS = {"f32": (2.5, 5.7), "bf16": (3.2, 4.7), "f16": (3.5, 5.0)}


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=_firstrun.HelpFormatter)
  parser.add_argument("--steps", type=int, default=300, help="training steps per run")
  parser.add_argument("--batch-size", type=int, default=64, help="images per step")
  parser.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate")
  parser.add_argument("--width", type=int, default=32, help="model width")
  parser.add_argument("--heads", type=int, default=4, help="attention heads")
  parser.add_argument("--layers", type=int, default=2,
                      help="transformer blocks (scanned)")
  parser.add_argument("--dtype", default="bf16", choices=("bf16", "f16"),
                      help="autocast compute dtype of matmuls")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the data split, the initialisation and the batches")
  parser.add_argument("--no-audit", action="store_true",
                      help="skip printing the precision audit")
  parser.add_argument("--out-dir", type=pathlib.Path, default=None,
                      help="if given, write summary.json there")
  parser.add_argument("--no-progress", action="store_true", help="no progress bars")
  return parser.parse_args(argv)


if __name__ == "__main__":
  # JAX takes seconds to import: --help and bad flags answer first.
  parse_args()

_firstrun.require("sklearn", "tqdm")  # before the imports that need them

import jax  # noqa: E402  (imports after the early parse above)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402
from tqdm import tqdm  # noqa: E402

from jmp_lite import audit  # noqa: E402
from jmp_lite import autocast  # noqa: E402

TOKENS, TOKEN_DIM, CLASSES = 8, 8, 10


def layer_norm(x, scale, bias):
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return (x - mean) * lax.rsqrt(var + 1e-5) * scale + bias


def block(x, p, heads):
  """One pre-norm transformer block; x: [batch, tokens, width]."""
  b, t, d = x.shape
  h = layer_norm(x, p["ln1_scale"], p["ln1_bias"])
  q, k, v = (jnp.reshape(h @ p[n], (b, t, heads, d // heads))
             for n in ("wq", "wk", "wv"))
  logits = jnp.einsum("bthd,bshd->bhts", q, k) / np.float32(np.sqrt(d // heads))
  attn = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(logits, axis=-1), v)
  x = x + jnp.reshape(attn, (b, t, d)) @ p["wo"]
  h = layer_norm(x, p["ln2_scale"], p["ln2_bias"])
  return x + jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def model(params, images, heads):
  x = jnp.reshape(images, (-1, TOKENS, TOKEN_DIM)) @ params["embed"]
  x = x + params["pos"]
  x, _ = lax.scan(lambda x, p: (block(x, p, heads), None), x, params["blocks"])
  return jnp.mean(x, axis=1) @ params["head"]


def loss_fn(params, images, labels, heads):
  logp = jax.nn.log_softmax(model(params, images, heads))
  return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


def init(seed, width, layers):
  rng = np.random.default_rng(seed)
  def normal(*shape, fan_in=None):
    fan_in = fan_in or shape[-2]
    return jnp.asarray(rng.standard_normal(shape) / np.sqrt(fan_in), jnp.float32)
  stack = (layers,)
  return {
      "embed": normal(TOKEN_DIM, width),
      "pos": normal(TOKENS, width, fan_in=1) * 0.02,
      "head": normal(width, CLASSES),
      "blocks": {
          "wq": normal(*stack, width, width), "wk": normal(*stack, width, width),
          "wv": normal(*stack, width, width), "wo": normal(*stack, width, width),
          "w1": normal(*stack, width, 4 * width),
          "b1": jnp.zeros((*stack, 4 * width)),
          "w2": normal(*stack, 4 * width, width),
          "b2": jnp.zeros((*stack, width)),
          "ln1_scale": jnp.ones((*stack, width)),
          "ln1_bias": jnp.zeros((*stack, width)),
          "ln2_scale": jnp.ones((*stack, width)),
          "ln2_bias": jnp.zeros((*stack, width)),
      },
  }


def train(name, value_and_grad, data, args):
  x_train, y_train, x_test, y_test = data
  optimizer = optax.adam(args.lr)
  params = init(args.seed, args.width, args.layers)
  opt_state = optimizer.init(params)

  @jax.jit
  def step(params, opt_state, images, labels):
    loss, grads = value_and_grad(params, images, labels)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  predict = jax.jit(lambda p, x: jnp.argmax(model(p, x, args.heads), -1))
  rng = np.random.default_rng(args.seed)
  start = time.perf_counter()
  params, opt_state, loss = step(params, opt_state, x_train[:args.batch_size],
                                 y_train[:args.batch_size])
  loss.block_until_ready()
  compile_time = time.perf_counter() - start
  start = time.perf_counter()
  # The first step (compiling) ran above: the bar counts every step.
  bar = tqdm(range(1, args.steps), desc=f"{name:>9}", disable=args.no_progress,
             dynamic_ncols=True, initial=1, total=args.steps)
  for i in bar:
    idx = rng.integers(0, len(x_train), args.batch_size)
    params, opt_state, loss = step(params, opt_state, x_train[idx],
                                   y_train[idx])
    if i % 25 == 0:  # reading the loss waits for the step: not every step
      bar.set_postfix(loss=f"{float(loss):.4f}")
  loss.block_until_ready()
  step_ms = 1e3 * (time.perf_counter() - start) / max(args.steps - 1, 1)
  accuracy = float(np.mean(np.asarray(predict(params, x_test)) == y_test))
  dtypes = {str(leaf.dtype) for leaf in jax.tree.leaves(params)}
  return {"test_accuracy": accuracy, "final_loss": float(loss),
          "step_ms": step_ms, "compile_s": compile_time,
          "param_dtypes": "/".join(sorted(dtypes))}


def main(argv=None):
  args = parse_args(argv)
  probe = _firstrun.announce(TIMINGS, ["f32", args.dtype], args.steps)

  digits = load_digits()
  images = (digits.data / 16.0).astype(np.float32)
  x_train, x_test, y_train, y_test = train_test_split(
      images, digits.target.astype(np.int32), test_size=0.25,
      random_state=args.seed)
  data = (x_train, y_train, x_test, y_test)

  def loss(params, images, labels):
    return loss_fn(params, images, labels, args.heads)

  f32_step = jax.value_and_grad(loss)
  autocast_step = autocast(jax.value_and_grad(loss), args.dtype)

  if not args.no_audit:
    report = audit(autocast_step, init(args.seed, args.width, args.layers),
                   x_train[:args.batch_size], y_train[:args.batch_size],
                   policy=f"p=f32,c=f32,o=f32,a={args.dtype}")
    matmuls = report.count(primitive="dot_general")
    half = report.count(primitive="dot_general", operand_dtype=args.dtype,
                        accumulation=jnp.float32)
    print(f"audit of the autocast step: {half}/{matmuls} matmuls in"
          f" {args.dtype} with f32 accumulation, {len(report.flags)} flagged")
    for (prim, sig), n in report.summary().items():
      if prim != "convert_element_type":
        print(f"  {prim:<14} {sig:<12} x{n}")

  results = {"float32": train("float32", f32_step, data, args),
             "autocast": train("autocast", autocast_step, data, args)}
  print()
  _firstrun.table(
      ["run", "test acc", "final loss", "ms/step", "compile s", "param dtypes"],
      [[name, f"{r['test_accuracy']:.3f}", f"{r['final_loss']:.4f}",
        f"{r['step_ms']:.2f}", f"{r['compile_s']:.1f}", r["param_dtypes"]]
       for name, r in results.items()])
  if args.out_dir is not None:
    print()
    _firstrun.write_summary(args.out_dir, {
        "args": {k: str(v) for k, v in vars(args).items()}, **probe,
        "results": results})
  return results


if __name__ == "__main__":
  main()
