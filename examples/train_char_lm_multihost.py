"""Train the char-LM in bf16 with FSDP across processes: locally or on a cluster.

The model, corpus and optimizer are those of `train_char_lm.py`, trained with
the policy "p=f32,c=bf16,o=f32" (bf16 compute, float32 master weights) by a
`jmp_lite.TrainState` with a dynamic loss scale, under ``jax.jit`` over a
("data",) mesh of every process's devices. The batch is split over "data" by
rows, and so is every weight matrix and its adam moments, along its largest
dimension (FSDP: each device holds 1/N of the parameters and optimizer
state); small leaves (biases, LayerNorm scales) and the loss-scale state are
replicated. Each process builds only its own rows of each global batch
(deterministic from ``--seed`` and the step) and feeds them with
``jax.make_array_from_process_local_data``. Only process 0 prints.

Three ways to run the same training code:

* locally (the default): the script starts itself as ``--processes``
  processes of ``--devices-per-process`` simulated CPU devices each, joined
  through a coordinator on 127.0.0.1 with Gloo collectives
  (`jmp_lite.testing.run_processes`), and shows process 0's output live;
  ``--processes 1`` runs in this process instead (XLA's own collectives).
* on a cluster: the same command on every host, with ``--coordinator-address
  HOST:PORT --num-processes N --process-id I`` (``jax.distributed.initialize``),
  or with ``--cluster`` where ``jax.distributed.initialize()`` finds them by
  itself (SLURM, Open MPI, Cloud TPU, ...). Each process then uses the
  devices JAX finds on its host.
* as a worker of `jmp_lite.testing.run_processes` (how the local mode runs
  it).

Process 0 prints the layout, the mesh and every parameter's sharding, a
progress line every ``--log-every`` steps (loss, loss scale, tokens/s), and
a summary with the validation loss in bits per byte; it writes summary.json.
(The ``[Gloo] Rank ...`` lines are Gloo's own, written as it connects.) A run
is reproducible across layouts: 2 processes of 4 devices and 1 of 8, both
with Gloo (``--num-processes 1`` with a local coordinator), give bitwise the
same losses; ``--processes 1`` sums in another order and agrees to ~1e-4.
With the defaults it takes about 3.5 minutes on a 2-core AVX2 CPU, where
Gloo's all-gathers cost more than the model (``--steps 20`` for a look).

Examples:
  python examples/train_char_lm_multihost.py --processes 2 --devices-per-process 4
  python examples/train_char_lm_multihost.py --coordinator-address 10.0.0.1:1234 \\
      --num-processes 2 --process-id 0    # on host 0; --process-id 1 on host 1
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
import zlib

import _firstrun  # the standard library only: fine before the early parse

POLICY = "p=f32,c=bf16,o=f32"
# Seconds to start the processes and compile, and milliseconds per step, with
# the defaults, scaled to _firstrun.REFERENCE_MACHINE from a run on a 2-core
# avx512_bf16 EPYC (33 s, 763 ms a step at load average 4). They feed the time
# estimate, which scales steps by matmul speed: rough here, where Gloo's
# collectives between the processes take much of each step.
TIMINGS = {"bf16": (30.0, 1700.0)}
# Set by jmp_lite.testing.run_processes in the processes it starts (the
# harness's ENV_PROCESS_ID; jmp_lite is not imported yet, it imports JAX).
WORKER_ENV = "JMP_LITE_PROCESS_ID"
# Leaves smaller than this are replicated: splitting a bias or an attention
# head's bias saves nothing and adds a gather of a few hundred bytes.
MIN_SHARDED = 4096
MODES = {"worker": "started by jmp_lite.testing.run_processes, Gloo collectives",
         "single": "one process, XLA's own collectives",
         "cluster": "one process of a cluster, jax.distributed"}


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0], formatter_class=_firstrun.HelpFormatter,
      epilog="Cluster flags select the cluster mode; without them the script "
             "runs locally.")
  local = parser.add_argument_group("local run (the default)")
  local.add_argument("--processes", type=int, default=2,
                     help="processes to start on this machine (1: run in this process)")
  local.add_argument("--devices-per-process", type=int, default=None,
                     help="simulated CPU devices per process (local default 4; on a "
                          "cluster, only for CPU hosts)")
  local.add_argument("--timeout", type=float, default=3600,
                     help="seconds before a local multi-process run is killed")
  cluster = parser.add_argument_group("cluster run (one process per host)")
  cluster.add_argument("--coordinator-address", default=None,
                       help="HOST:PORT of process 0's coordinator")
  cluster.add_argument("--num-processes", type=int, default=None,
                       help="processes in the cluster")
  cluster.add_argument("--process-id", type=int, default=None,
                       help="this process's index, 0 to --num-processes - 1")
  cluster.add_argument("--cluster", action="store_true",
                       help="let jax.distributed.initialize() find the flags above "
                            "(SLURM, Open MPI, Cloud TPU)")
  train = parser.add_argument_group("training")
  _firstrun.add_training_arguments(
      train, steps=200, steps_help="training steps", batch_size=32,
      batch_help="sequences per step, all processes together (a multiple of the "
                 "device count)", lr=2e-3,
      seed_help="seed of the initialisation and the batches", corpus_bytes=4_000_000,
      corpus_help=_firstrun.CHAR_LM_CORPUS)
  train.add_argument("--context", type=int, default=64, help="bytes per sequence")
  train.add_argument("--val-batches", type=int, default=20, help="validation batches")
  train.add_argument("--log-every", type=int, default=10,
                     help="steps between progress lines (0: none)")
  train.add_argument("--out-dir", default="runs/char_lm_multihost",
                     help="where process 0 writes summary.json")
  args = parser.parse_args(argv)
  args.mode = _mode(args)
  for name in ("processes", "steps", "batch_size", "context", "val_batches"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1")
  if args.devices_per_process is not None and args.devices_per_process < 1:
    parser.error("--devices-per-process must be >= 1")
  if args.mode in ("launch", "single"):
    args.devices_per_process = args.devices_per_process or 4
    devices = args.processes * args.devices_per_process
    if args.batch_size % devices:
      parser.error(f"--batch-size {args.batch_size} does not split over {devices} "
                   "devices")
  if (args.process_id is not None and args.num_processes is not None
      and not 0 <= args.process_id < args.num_processes):
    parser.error("--process-id must be in [0, --num-processes)")
  return args


def _mode(args) -> str:
  if WORKER_ENV in os.environ:
    return "worker"
  if args.cluster or any(v is not None for v in (
      args.coordinator_address, args.num_processes, args.process_id)):
    return "cluster"
  return "single" if args.processes == 1 else "launch"


if __name__ == "__main__":
  # JAX and Flax take seconds to import: --help and bad flags answer first.
  parse_args()

_firstrun.require("tqdm")  # before the imports that need them

import jax  # noqa: E402  (imports after the early parse above)
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import jmp_lite  # noqa: E402
import jmp_lite.flax  # noqa: E402
import jmp_lite.hardware  # noqa: E402
import jmp_lite.testing  # noqa: E402
import train_char_lm as char_lm  # noqa: E402  (the model and the corpus)


def launch(args, argv) -> dict:
  """Starts this script as ``args.processes`` local processes; echoes process 0."""
  _firstrun.announce(TIMINGS, ["bf16"], args.steps,
                     what=f"training ({args.processes} processes)")
  print(f"Starting {args.processes} processes × {args.devices_per_process} CPU "
        "devices on this machine (coordinator on 127.0.0.1, Gloo collectives); "
        "process 0's output follows.\n", flush=True)
  try:
    results = jmp_lite.testing.run_processes(
        os.path.abspath(__file__), num_processes=args.processes,
        devices_per_process=args.devices_per_process, timeout=args.timeout,
        args=sys.argv[1:] if argv is None else argv, echo=0)
  except jmp_lite.testing.MultiProcessError as e:
    sys.exit(f"\n{e}")
  # Every process computed the same losses (they are global values): a check
  # that the processes really trained one model together.
  losses = [r.result["losses"] for r in results]
  if any(l != losses[0] for l in losses):
    sys.exit("the processes disagree on the loss trajectory")
  print(f"All {len(results)} processes saw the same {len(losses[0])} losses.")
  return results[0].result


def join(args) -> None:
  """Sets up this process's devices and, unless alone, the distributed runtime."""
  if args.mode == "worker":
    jmp_lite.testing.initialize_worker()
    return
  if args.devices_per_process is not None:  # CPU devices only; no-op elsewhere
    jax.config.update("jax_num_cpu_devices", args.devices_per_process)
  if args.mode == "single":
    jax.config.update("jax_platforms", "cpu")  # as the local multi-process run
    return
  # Without Gloo, CPU devices cannot all-reduce across processes; GPUs and
  # TPUs use their own collectives and ignore this.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=args.coordinator_address,
                             num_processes=args.num_processes,
                             process_id=args.process_id)


def spec_for(shape, n_data: int) -> P:
  """FSDP: a matrix's largest dimension over "data"; small leaves replicated."""
  if len(shape) < 2 or math.prod(shape) < MIN_SHARDED:
    return P()
  dim = max(range(len(shape)), key=lambda d: (shape[d] % n_data == 0, shape[d]))
  if shape[dim] % n_data:
    return P()  # nothing divides: replicated (printed with the rest)
  return P(*[("data" if d == dim else None) for d in range(len(shape))])


def train(args) -> dict:
  """Trains on the global mesh; every process runs this, only process 0 prints."""
  first = jax.process_index() == 0
  say = print if first else (lambda *a, **k: None)
  devices, n_proc = jax.device_count(), jax.process_count()
  if args.batch_size % devices:
    raise SystemExit(f"--batch-size {args.batch_size} does not split over {devices} devices")
  mesh = jax.make_mesh((devices,), ("data",), axis_types=(AxisType.Auto,))
  replicated, by_rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  hardware = jmp_lite.hardware.describe()
  if args.mode == "cluster":  # elsewhere the estimate before training said it
    say(hardware.advice())
  say(f"\nlayout: {n_proc} process{'es' * (n_proc > 1)} × "
      f"{jax.local_device_count()} {jax.default_backend().upper()} devices = "
      f"{devices} devices ({MODES[args.mode]}); mesh {dict(mesh.shape)}; global batch "
      f"{args.batch_size} = {args.batch_size // n_proc} rows per process")

  data = char_lm.load_corpus(args.corpus_bytes)
  if n_proc > 1:  # every host must read the same bytes (the same Python)
    multihost_utils.assert_equal(np.uint32(zlib.crc32(data.tobytes())),
                                 "the corpus differs between processes")
  split = int(len(data) * 0.9)
  train_data, val_data = data[:split], data[split:]

  policy = jmp_lite.get_policy(POLICY)
  model = jmp_lite.flax.wrap(char_lm.CharTransformer(context=args.context), policy)
  warmup = max(1, min(50, args.steps // 10))
  tx = optax.adamw(optax.warmup_cosine_decay_schedule(
      0.0, args.lr, warmup, max(args.steps, warmup + 1)))  # --steps 1 too

  def make_state():
    params = model.init(jax.random.key(args.seed),
                        np.zeros((1, args.context), np.int32))["params"]
    return jmp_lite.TrainState.create(
        apply_fn=model.apply, params=params, tx=tx, clip_norm=1.0,
        loss_scale=jmp_lite.DynamicLossScale(2.0 ** 15, period=200))

  # By shape: adam's moments are sharded like their parameters, the
  # loss-scale state and the counters (scalars) are replicated. Initialised
  # under jit straight into the shards: no process ever holds the whole
  # state (and one compiled init beats Flax's op-by-op one).
  shardings = jax.tree.map(lambda leaf: NamedSharding(mesh, spec_for(leaf.shape, devices)),
                           jax.eval_shape(make_state))
  state = jax.jit(make_state, out_shardings=shardings)()
  state_bytes, device_bytes = _state_bytes(state)
  if first:
    _print_shardings(state.params, devices)
    print(f"train state (params, adam's moments, loss scale): {device_bytes:,} bytes "
          f"per device of {state_bytes:,}")

  def loss_of(params, x, y):
    logits = model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  step_fn = jax.jit(lambda s, x, y: s.minimize(loss_of, x, y),
                    out_shardings=(shardings, replicated))
  val_fn = jax.jit(loss_of, out_shardings=replicated)

  # This process's rows of every global batch: those of its devices' shards.
  shape = (args.batch_size, args.context)
  rows = np.unique(np.concatenate([np.arange(args.batch_size)[index[0]] for index in
                                   by_rows.addressable_devices_indices_map(shape).values()]))

  def feed(source, key):
    """The global batch ``key`` of ``source``, of which this process builds its rows."""
    starts = np.random.default_rng(key).integers(0, len(source) - args.context - 1,
                                                 args.batch_size)[rows]
    seq = source[starts[:, None] + np.arange(args.context + 1)]
    return [jax.make_array_from_process_local_data(by_rows, np.ascontiguousarray(part),
                                                   shape)
            for part in (seq[:, :-1], seq[:, 1:])]

  say(f"\nprocess 0 feeds rows {rows[0]}-{rows[-1]} of each batch; training "
      f"{args.steps} steps with policy {POLICY}:", flush=True)
  losses, scales, times, skipped = [], [], [], 0
  last_log = time.perf_counter()
  for step in range(args.steps):
    start = time.perf_counter()
    state, info = step_fn(state, *feed(train_data, [args.seed, step]))
    losses.append(float(info.loss))  # blocks: the step is done
    scales.append(float(info.loss_scale))
    skipped += bool(info.skipped)
    times.append(time.perf_counter() - start)
    if args.log_every and (step % args.log_every == 0 or step == args.steps - 1):
      # Wall time since the last line, batch building and feeding included.
      now, since = time.perf_counter(), step % args.log_every or args.log_every
      speed = (f"compiled in {times[0]:.1f} s" if step == 0 else
               f"{_tokens(args, since) / (now - last_log):,.0f} tokens/s")
      say(f"step {step:5d}  loss {losses[-1]:.4f}  loss scale {scales[-1]:g}  {speed}",
          flush=True)
      last_log = now

  vals = [float(val_fn(state.params, *feed(val_data, [12345, i])))
          for i in range(args.val_batches)]
  # Leaves out compilation and warm-up (with --steps 1, there is nothing else).
  steady = float(np.median(times[max(1, len(times) // 5):] or times))
  val_loss = float(np.mean(vals))
  summary = {
      "example": "train_char_lm_multihost", "mode": args.mode, "policy": POLICY,
      "compute_dtype": str(np.dtype(policy.compute_dtype)),
      "param_dtype": str(np.dtype(policy.param_dtype)),
      "processes": n_proc, "local_devices": jax.local_device_count(),
      "devices": devices, "mesh": dict(mesh.shape),
      "mesh_processes": sorted({d.process_index for d in mesh.devices.flat}),
      "param_specs": {jax.tree_util.keystr(path): str(leaf.sharding.spec)
                      for path, leaf in jax.tree_util.tree_leaves_with_path(state.params)},
      "steps": args.steps, "batch_size": args.batch_size, "context": args.context,
      "seed": args.seed, "corpus_bytes": int(len(data)),
      "backend": jax.default_backend(), "hardware": hardware.headline(),
      "val_loss": val_loss, "val_bits_per_byte": val_loss / math.log(2),
      "final_train_loss": float(np.mean(losses[-20:])),
      "tokens_per_second": _tokens(args, 1) / steady, "step_ms": steady * 1e3,
      "compile_seconds": times[0], "skipped_steps": skipped,
      "state_bytes": state_bytes, "state_bytes_per_device": device_bytes,
      "final_loss_scale": scales[-1], "losses": losses, "loss_scales": scales,
  }
  say()
  if first:
    _firstrun.table(["", "value"], [
        ["validation loss, bits per byte", f"{summary['val_bits_per_byte']:.4f}"],
        ["training loss (last 20 steps), bits per byte",
         f"{summary['final_train_loss'] / math.log(2):.4f}"],
        ["tokens/s (median step)", summary["tokens_per_second"]],
        ["ms/step", f"{summary['step_ms']:.0f}"],
        ["skipped steps, final loss scale", f"{skipped}, {scales[-1]:g}"]])
    print()
    _firstrun.write_summary(args.out_dir, summary)
  if args.mode == "worker":
    jmp_lite.testing.report_result({"losses": losses, "val_loss": val_loss})
  return summary


def _tokens(args, steps: int) -> int:
  return steps * args.batch_size * args.context


def _print_shardings(params, n_data: int) -> None:
  """A row per parameter (one for all blocks): shape, spec, what one device holds."""
  rows = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    name = re.sub(r"^Block_\d+", "Block_*", jax.tree_util.keystr(
        path, simple=True, separator="/")).replace("MultiHeadDotProductAttention", "Attention")
    rows[name] = [name, "x".join(map(str, leaf.shape)), str(leaf.sharding.spec),
                  "x".join(map(str, leaf.sharding.shard_shape(leaf.shape)))]
  print(f"\nparameters (float32; adam's moments alike) over {n_data} devices:")
  _firstrun.table(["parameter", "shape", "spec", "per device"], rows.values())


def _state_bytes(state) -> tuple[int, int]:
  """Bytes of the whole train state, and of what one device holds of it."""
  leaves = [leaf for leaf in jax.tree.leaves(state) if hasattr(leaf, "sharding")]
  total = sum(leaf.nbytes for leaf in leaves)
  per_device = sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
                   for leaf in leaves)
  return total, per_device


def main(argv=None):
  args = parse_args(argv)
  if args.mode == "launch":
    return launch(args, argv)
  join(args)  # before JAX starts its backend (the announcement's probe does)
  if args.mode == "single":
    _firstrun.announce(TIMINGS, ["bf16"], args.steps)
  return train(args)


if __name__ == "__main__":
  main()
