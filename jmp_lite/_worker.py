"""The worker side of `jmp_lite._launch`: join the runtime, report a result.

A script started by `run_processes` calls `initialize_worker` before anything
else touches JAX's backend, and `report_result` to send back what it found.
Re-exported by `jmp_lite.testing`.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import sys
import threading
import time
from typing import Any

import jax

from jmp_lite._launch import ENV_COLLECTIVES
from jmp_lite._launch import ENV_COORDINATOR
from jmp_lite._launch import ENV_DEVICES
from jmp_lite._launch import ENV_NUM_PROCESSES
from jmp_lite._launch import ENV_PARENT_PID
from jmp_lite._launch import ENV_PROCESS_ID
from jmp_lite._launch import ENV_RESULT_FILE

__all__ = ("initialize_worker", "report_result")



def _worker_env(name: str) -> str:
  value = os.environ.get(name)
  if value is None:
    raise RuntimeError(
        f"{name} is not set: this function is for worker processes started by "
        "jmp_lite.testing.run_processes.")
  return value


def _watch_parent(parent_pid: int) -> None:
  """Kills this worker's process group once the launching process is gone.

  `run_processes` kills its children itself; this covers the one case it
  cannot, its own death (e.g. a test runner killed with SIGKILL), which would
  otherwise leave workers blocked in a collective forever.
  """
  while True:
    time.sleep(1.0)
    if os.getppid() != parent_pid:
      os.killpg(os.getpgrp(), signal.SIGKILL)


def _exit_on_uncaught(print_exception):
  """An excepthook that prints the exception, then ends the process at once.

  A normal exit runs JAX's atexit shutdown, a barrier that waits for every
  other process (minutes, if one of them waits in a collective for this
  one); a failed worker should fail now.
  """
  def hook(kind, value, traceback):
    print_exception(kind, value, traceback)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)

  return hook


def initialize_worker() -> int:
  """Joins this worker to the others `run_processes` started; returns its index.

  Call it first thing in a worker script, before any JAX computation (the
  device count and the collectives are fixed when JAX creates its CPU
  backend). It sets ``jax_num_cpu_devices`` and, unless `run_processes` was
  given ``collectives="in_process"``, calls ``jax.distributed.initialize``
  with the coordinator it chose (on 127.0.0.1), which makes the CPU devices
  all-reduce through Gloo, even in a single process. Afterwards
  ``jax.devices()`` lists every process's devices, ``jax.local_devices()``
  this process's, and ``jit`` over a mesh of all of them communicates across
  processes. Gloo listens on the address this machine's host name resolves
  to.

  An uncaught exception then ends the worker at once with status 1, after
  printing it: a normal exit would first wait in JAX's shutdown barrier for
  the other processes, which may be waiting in a collective for this one.

  Returns:
    This process's index, equal to ``jax.process_index()``.

  Raises:
    RuntimeError: outside a worker of `run_processes`, or if JAX's backend
      was initialised already (something computed before this call).
  """
  n = int(_worker_env(ENV_NUM_PROCESSES))
  process_id = int(_worker_env(ENV_PROCESS_ID))
  devices = int(_worker_env(ENV_DEVICES))
  # Installed first: a failed jax.distributed.initialize (say, the port was
  # taken) otherwise ends in a crash of JAX's atexit shutdown.
  sys.excepthook = _exit_on_uncaught(sys.excepthook)
  try:
    jax.config.update("jax_num_cpu_devices", devices)
  except RuntimeError as e:
    raise RuntimeError(
        "initialize_worker: JAX's backend is already initialised, so the device "
        f"count can no longer be set to {devices}: call initialize_worker() before "
        "any JAX computation (creating an array counts).") from e
  if _worker_env(ENV_COLLECTIVES) == "gloo":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    address = _worker_env(ENV_COORDINATOR)
    # Bound to loopback, not JAX's default of every interface ([::]).
    jax.distributed.initialize(
        coordinator_address=address, num_processes=n, process_id=process_id,
        coordinator_bind_address=address)
  parent = os.environ.get(ENV_PARENT_PID)
  # Only in a session of run_processes's making: the group it kills is then
  # this worker's own, never, say, a shell's job run by hand with a copied
  # environment.
  if parent is not None and os.getsid(0) == os.getpid():
    threading.Thread(target=_watch_parent, args=(int(parent),), daemon=True,
                     name="jmp_lite-watch-parent").start()
  return process_id


def _to_json(value: Any) -> Any:
  """``json.dumps`` hook: NumPy scalars and arrays as Python numbers and lists."""
  if hasattr(value, "tolist") and hasattr(value, "dtype"):
    return value.tolist()
  raise TypeError(
      f"report_result: {type(value).__name__} is not JSON-serialisable ({value!r:.80}); "
      "report numbers, strings, bools, None, lists and dicts (NumPy values are "
      "converted; fetch a jax.Array's local data first).")


def report_result(value: Any) -> None:
  """Sends ``value`` from a worker to `run_processes` (``ProcessResult.result``).

  ``value`` is encoded as JSON (NaN and infinities included; NumPy scalars
  and arrays become numbers and lists). A later call replaces an earlier one.

  Raises:
    RuntimeError: outside a worker of `run_processes`.
    TypeError: if ``value`` cannot be encoded.
  """
  path = pathlib.Path(_worker_env(ENV_RESULT_FILE))
  text = json.dumps(value, default=_to_json)
  # Written aside and renamed: the harness never reads half a result.
  partial = path.with_name(path.name + ".partial")
  partial.write_text(text)
  os.replace(partial, path)
