"""Train a published-style Flax encoder-decoder under precision policies, unmodified.

`examples/seq2seq_model.py` is a Transformer encoder-decoder written as the Flax
WMT example is: a config with ``dtype=float32`` passed to every layer, one
``nn.Embed`` shared by encoder, decoder and the tied output projection
(``attend``), dropout, no mixed-precision code and no jmp_lite import. This
script trains that file as it is under each policy, by wrapping it with
`jmp_lite.flax.wrap`, and shows that:

* the wrapped model's ``init`` builds exactly the variable tree of the plain
  model (same paths, shapes, dtypes and values; one embedding table), so
  checkpoints stay interchangeable;
* the policy overrides the layers' own ``dtype=float32``: a precision audit of
  one forward call counts how many matmuls run in 16 bits with float32
  accumulation (`jmp_lite.audit`);
* training with `jmp_lite.TrainState` (dynamic loss scaling for float16)
  reaches the float32 validation loss and accuracy.

Data: the Python standard library's own ``.py`` files, read from disk in
sorted order, as bytes; files are split into training and held-out files.
The task: given a 32-byte window of source, produce the next 16 bytes (the
decoder is trained with teacher forcing). Nothing is downloaded.

Before training it says what bf16 and f16 can buy on this machine and how long
the run should take (about 3 minutes with the defaults on a 2-core AVX2 CPU).

Example:
  python examples/train_seq2seq.py
  python examples/train_seq2seq.py --steps 1000 --policies f32,bf16
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import pathlib
import sys
import time

import _firstrun  # the standard library only: fine before the early parse

POLICIES = {
    "f32": "f32",
    "bf16": "p=f32,c=bf16,o=f32",
    "f16": "p=f32,c=f16,o=f32",
}
# Seconds to compile and milliseconds per step of each policy with the
# defaults; they feed the time estimate. The steps were measured on
# _firstrun.REFERENCE_MACHINE; the compile times (not scaled by matmul speed)
# on a 2-core avx512_bf16 EPYC at load 1.2, where the run took 82 s from the
# estimate to the summary. (An older engine compiled for 35-45 s.)
TIMINGS = {"f32": (12.0, 47.0), "bf16": (12.0, 73.0), "f16": (13.0, 61.0)}


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=_firstrun.HelpFormatter)
  parser.add_argument("--policies", default="f32,bf16,f16",
                      help=_firstrun.THREE_POLICIES)
  _firstrun.add_training_arguments(
      parser, steps=300, steps_help="training steps per policy", batch_size=32,
      batch_help="windows per step", lr=3e-3,
      seed_help="seed of the initialisation, the batches and dropout",
      corpus_bytes=2_000_000, corpus_help="bytes of standard-library source to read")
  parser.add_argument("--out-dir", default="runs/seq2seq", help="where summary.json goes")
  parser.add_argument("--no-progress", action="store_true", help="no progress bars")
  args = parser.parse_args(argv)
  args.policies = _firstrun.policy_names(parser, args.policies, POLICIES)
  return args


if __name__ == "__main__":
  # JAX and Flax take seconds to import: --help and bad flags answer first.
  parse_args()

_firstrun.require("tqdm")  # before the imports that need them

import jax  # noqa: E402  (imports after the early parse above)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from tqdm import tqdm  # noqa: E402

import jmp_lite  # noqa: E402
import jmp_lite.flax  # noqa: E402

# The model file sits next to this script and is imported as it is.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from seq2seq_model import Config, Seq2Seq  # noqa: E402

SRC_LEN, TGT_LEN = 32, 16
BOS = 256  # bytes are 0..255; one extra token starts the decoder input
VOCAB = 257
VAL_WINDOWS = 1024
VAL_BATCH = 256


def load_corpus(max_bytes: int, val_every: int = 10):
  """Standard-library source as bytes, split by file: (train, val) windows.

  Returns, for each split, the concatenated bytes and the start offsets of
  every window of ``SRC_LEN + TGT_LEN`` bytes that lies inside one file (so
  no window mixes two files).
  """
  root = pathlib.Path(os.__file__).parent
  splits = {"train": ([], []), "val": ([], [])}
  sizes = {"train": 0, "val": 0}
  total, span = 0, SRC_LEN + TGT_LEN
  for i, path in enumerate(sorted(root.glob("*.py"))):
    if total >= max_bytes:
      break
    data = path.read_bytes()[: max_bytes - total]
    total += len(data)
    # Every tenth file is held out: validation text the model never saw.
    name = "val" if i % val_every == val_every // 2 else "train"
    chunks, starts = splits[name]
    if len(data) >= span:
      starts.append(sizes[name] + np.arange(len(data) - span + 1))
    chunks.append(data)
    sizes[name] += len(data)
  out = {}
  for name, (chunks, starts) in splits.items():
    if not starts:
      raise SystemExit(f"--corpus-bytes {max_bytes} leaves no {name} windows")
    out[name] = (np.frombuffer(b"".join(chunks), np.uint8).astype(np.int32),
                 np.concatenate(starts))
  return out, total


def make_batch(data, starts):
  """(src, decoder input, decoder target) for windows starting at ``starts``."""
  seq = data[starts[:, None] + np.arange(SRC_LEN + TGT_LEN)]
  src, tgt = seq[:, :SRC_LEN], seq[:, SRC_LEN:]
  tgt_in = np.concatenate([np.full((len(seq), 1), BOS, np.int32), tgt[:, :-1]], 1)
  return src, tgt_in, tgt


def tree_layout(variables):
  return {jax.tree_util.keystr(path): (leaf.shape, str(leaf.dtype))
          for path, leaf in jax.tree_util.tree_leaves_with_path(variables)}


def check_same_variables(plain, wrapped, key, src, tgt_in):
  """The wrapper must build the plain model's variables, one embedding table."""
  mixed = jax.jit(functools.partial(wrapped.init, train=False))(key, src, tgt_in)
  assert tree_layout(plain) == tree_layout(mixed), "variable trees differ"
  same_values = all(bool(jnp.array_equal(a, b)) for a, b in
                    zip(jax.tree.leaves(plain), jax.tree.leaves(mixed)))
  tables = [k for k in tree_layout(mixed["params"]) if k.endswith("['embedding']")]
  assert len(tables) == 1, f"expected one shared embedding table, got {tables}"
  n = sum(x.size for x in jax.tree.leaves(mixed["params"]))
  print(f"  variables: wrap(model).init == model.init: {len(tree_layout(mixed))} "
        f"arrays, {n:,} params, same paths/shapes/dtypes"
        f"{', same values' if same_values else ''}; 1 embedding table {tables[0]}")
  return mixed["params"], len(tables)


def audit_forward(wrapped, params, src, tgt_in, policy):
  """Counts matmuls by dtype in one traced forward call (nothing runs)."""
  report = jmp_lite.audit(
      lambda p, s, t: wrapped.apply({"params": p}, s, t, train=False),
      params, src, tgt_in, policy=policy)
  total = report.count(category="matmul")
  half = {d: report.count(category="matmul", operand_dtype=d, accumulation=jnp.float32)
          for d in ("bf16", "f16")}
  n_half = sum(half.values())
  f32 = report.count(category="matmul", operand_dtype="f32")
  kind = {"bfloat16": "bf16", "float16": "f16"}.get(
      np.dtype(policy.compute_dtype).name, "16-bit")
  # Flax's attention takes its softmax in the module's dtype, so under a
  # 16-bit policy the audit flags those exps (half_exp_log): as Flax does it.
  flags = sorted({f for r in report.flags for f in r.flags})
  print(f"  audit: {n_half} of {total} matmuls {kind}x{kind}->f32, {f32} f32xf32->f32 "
        f"(the model passes dtype=float32 to every layer); "
        f"{len(report.flags)} ops flagged {flags}")
  return n_half, total


def train(name, model, plain_variables, data, args):
  policy = jmp_lite.get_policy(POLICIES[name])
  print(f"{name}: policy {policy}")
  wrapped = jmp_lite.flax.wrap(model, policy)  # the model itself is untouched
  (train_data, train_starts), (val_data, val_starts) = data["train"], data["val"]
  src0, tgt_in0, _ = make_batch(train_data, train_starts[:2])
  params, n_tables = check_same_variables(
      plain_variables, wrapped, jax.random.key(args.seed), src0, tgt_in0)
  n_half, n_matmuls = audit_forward(wrapped, params, src0, tgt_in0, policy)

  # float16's range is narrow: scale the loss, dynamically. bf16 has f32's.
  loss_scale = (jmp_lite.DynamicLossScale(2.0 ** 15, period=200)
                if policy.compute_dtype == jnp.float16 else jmp_lite.NoOpLossScale())
  warmup = max(1, min(50, args.steps // 10))
  tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps),
                   weight_decay=1e-4)
  # No `policy=` here: the wrapper casts each layer's parameters itself (and
  # keeps LayerNorm's in float32); TrainState casting them all to bf16 first
  # would round LayerNorm's too.
  state = jmp_lite.TrainState.create(apply_fn=wrapped.apply, params=params, tx=tx,
                                     loss_scale=loss_scale, clip_norm=1.0)

  def loss_fn(params, src, tgt_in, tgt, key):
    logits = wrapped.apply({"params": params}, src, tgt_in, train=True,
                           rngs={"dropout": key})
    return optax.softmax_cross_entropy_with_integer_labels(logits, tgt).mean()

  @jax.jit
  def train_step(state, src, tgt_in, tgt, key):
    return state.minimize(loss_fn, src, tgt_in, tgt, key)

  @jax.jit
  def evaluate(params, src, tgt_in, tgt):
    logits = wrapped.apply({"params": params}, src, tgt_in, train=False)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, tgt).sum()
    return loss, jnp.sum(jnp.argmax(logits, -1) == tgt)

  # Same batches and dropout masks for every policy.
  rng = np.random.default_rng(args.seed)
  key = jax.random.key(args.seed + 1)
  losses, times = [], []
  bar = tqdm(range(args.steps), desc=f"{name:>5}", disable=args.no_progress,
             dynamic_ncols=True)
  for step in bar:
    batch = make_batch(train_data, rng.choice(train_starts, args.batch_size))
    start = time.perf_counter()
    state, info = train_step(state, *batch, jax.random.fold_in(key, step))
    losses.append(float(info.loss))  # blocks: the step is done
    times.append(time.perf_counter() - start)
    if step % 20 == 0 or step == args.steps - 1:
      bar.set_postfix(loss=f"{losses[-1]:.3f}", scale=f"{float(info.loss_scale):g}")

  # The same held-out windows for every policy.
  val_idx = np.random.default_rng(12345).choice(
      val_starts, VAL_WINDOWS, replace=len(val_starts) < VAL_WINDOWS)
  total_loss = correct = 0.0
  for i in range(0, VAL_WINDOWS, VAL_BATCH):
    loss, hits = evaluate(state.params, *make_batch(val_data, val_idx[i:i + VAL_BATCH]))
    total_loss += float(loss)
    correct += int(hits)
  steady = times[len(times) // 5:] or times  # leave out compilation and warm-up
  return {
      "policy": str(policy),
      "val_loss": total_loss / (VAL_WINDOWS * TGT_LEN),
      "val_token_accuracy": correct / (VAL_WINDOWS * TGT_LEN),
      "final_train_loss": float(np.mean(losses[-20:])),
      "steps": args.steps,
      "skipped_steps": int(state.loss_scale_state.skipped_steps),
      "final_loss_scale": float(state.loss_scale.loss_scale),
      "ms_per_step": 1000 * float(np.median(steady)),
      "compile_seconds": times[0],
      "matmuls_half_f32": n_half,
      "matmuls_total": n_matmuls,
      "shared_embeddings": n_tables,
  }


def main(argv=None):
  args = parse_args(argv)
  names = args.policies
  probe = _firstrun.announce(TIMINGS, names, args.steps)
  data, corpus_bytes = load_corpus(args.corpus_bytes)
  print(f"corpus: {corpus_bytes:,} bytes of {pathlib.Path(os.__file__).parent}/*.py; "
        f"{len(data['train'][1]):,} training and {len(data['val'][1]):,} held-out "
        f"windows ({SRC_LEN} bytes -> next {TGT_LEN})")
  model = Seq2Seq(Config(vocab_size=VOCAB, max_len=max(SRC_LEN, TGT_LEN)))
  # The plain model's own variables, to compare each wrapper's init against.
  src0, tgt_in0, _ = make_batch(data["train"][0], data["train"][1][:2])
  plain = jax.jit(functools.partial(model.init, train=False))(
      jax.random.key(args.seed), src0, tgt_in0)
  results = {n: train(n, model, plain, data, args) for n in names}

  uniform = math.log(VOCAB)
  print()
  _firstrun.table(
      ["policy", "val loss", "val acc", "skipped steps", "compile s", "ms/step",
       "16-bit matmuls (f32 acc)"],
      [[name, f"{r['val_loss']:.4f}", f"{r['val_token_accuracy']:.4f}",
        r["skipped_steps"], f"{r['compile_seconds']:.1f}", f"{r['ms_per_step']:.1f}",
        f"{r['matmuls_half_f32']} of {r['matmuls_total']}"]
       for name, r in results.items()])
  print(f"(uniform guess: loss ln({VOCAB}) = {uniform:.3f}, accuracy {1 / VOCAB:.4f})")
  summary = {
      "example": "train_seq2seq", "steps": args.steps, "batch_size": args.batch_size,
      "seed": args.seed, "lr": args.lr, "corpus_bytes": corpus_bytes,
      "vocab_size": VOCAB, "src_len": SRC_LEN, "tgt_len": TGT_LEN,
      "backend": jax.default_backend(), **probe, "results": results,
  }
  print()
  _firstrun.write_summary(args.out_dir, summary)
  return summary


if __name__ == "__main__":
  main()
