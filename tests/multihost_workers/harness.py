"""Worker of tests/test_multihost.py for the harness itself: ``python harness.py MODE``.

Modes (the tests say what each one proves):

* ``echo ...``: joins the runtime, sums process-local data across processes
  and reports what it saw, its arguments included;
* ``fail_in_collective``: process 1 raises; process 0 enters a collective
  that process 1 never joins;
* ``exit CODE``: process 1 exits with CODE, process 0 with 0;
* ``hang``: each process starts a child, reports both pids, and sleeps;
* ``leave_child``: each process starts a child, reports both pids, exits 0;
* ``silent``: exits 0 and reports nothing;
* ``init_hang PIDFILE``: joins the runtime, writes its pid, and sleeps.
* ``replicas``: joins the runtime and reports what
  `jmp_lite.distributed.is_replicated_everywhere` says of a fully replicated
  array holding the same value in every process, and of one holding a
  value per process (a loss scale that diverged across hosts).

Importing this module (pytest's doctest collection does) touches no device.
"""

import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jmp_lite import distributed
from jmp_lite import testing

SLEEP = 600  # longer than any test waits: these processes must be killed


def _start_child():
  return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({SLEEP})"])


def _process_id():
  return int(os.environ["JMP_LITE_PROCESS_ID"])


def _sum_across_processes(local):
  """The sum of every process's ``local`` rows, computed on a global mesh."""
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), local)
  return jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)


def main(mode, args):
  if mode == "echo":
    process = testing.initialize_worker()
    local = np.full((jax.local_device_count(),), process + 1, np.float32)
    total = _sum_across_processes(local)
    testing.report_result({
        "process": process, "process_index": jax.process_index(),
        "process_count": jax.process_count(), "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(), "total": float(total),
        "args": args, "extra_env": os.environ.get("JMP_LITE_TEST_EXTRA"),
        "numpy": [np.float32(1.5), np.arange(3)], "nonfinite": [float("nan"), float("inf")]})
  elif mode == "fail_in_collective":
    process = testing.initialize_worker()
    if process == 1:
      raise ValueError("boom in process 1, before the collective")
    _sum_across_processes(np.ones((jax.local_device_count(),), np.float32)).block_until_ready()
    time.sleep(SLEEP)  # if the collective returned after all, hang here
  elif mode == "exit":
    if _process_id() == 1:
      print("process 1 exits with", args[0], file=sys.stderr)
      sys.exit(int(args[0]))
  elif mode in ("hang", "leave_child"):
    child = _start_child()
    testing.report_result({"worker": os.getpid(), "child": child.pid})
    if mode == "hang":
      print(f"process {_process_id()} is hanging", file=sys.stderr, flush=True)
      time.sleep(SLEEP)
  elif mode == "replicas":
    process = testing.initialize_worker()
    mesh = jax.make_mesh((jax.device_count(),), ("data",))

    def replicated(value):
      shards = [jax.device_put(np.float32(value), d) for d in jax.local_devices()]
      return jax.make_array_from_single_device_arrays((), NamedSharding(mesh, P()), shards)

    same, diverged = replicated(2.0 ** 15), replicated(2.0 ** 15 / (1 + process))
    testing.report_result({
        "same": distributed.is_replicated_everywhere({"a": same, "b": jnp.ones(3)}),
        "diverged": distributed.is_replicated_everywhere({"a": same, "b": diverged})})
  elif mode == "silent":
    pass
  elif mode == "init_hang":
    testing.initialize_worker()
    with open(args[0], "w") as f:
      f.write(str(os.getpid()))
    time.sleep(SLEEP)
  else:
    raise ValueError(f"unknown mode {mode!r}")


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2:])
