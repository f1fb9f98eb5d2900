"""Several JAX processes on one machine, for testing multi-process code on CPU.

`run_processes` starts N copies of a worker script, each with K simulated CPU
devices and a coordinator on a free loopback port, and collects what each
reported with `report_result`. The worker calls `initialize_worker` first
(both in `jmp_lite._worker`),
which joins the N processes into one JAX runtime (``jax.distributed``, with
Gloo for the collectives), so that ``jax.devices()`` lists all N * K devices
and ``jit`` over a global mesh runs real cross-process collectives.

The harness owns its children: each runs in a process group of its own, and
on a timeout, a failure of any process, or an exception in the caller, every
group is killed, so a hung collective cannot outlive the test that started it
(process groups: POSIX only). ``echo=`` shows one process's output live, for
a long run started from a script. Re-exported by `jmp_lite.testing`.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Mapping, Optional, Sequence, Union


__all__ = ("MultiProcessError", "ProcessResult", "run_processes")

# What run_processes tells each worker; initialize_worker and report_result
# read it back.
ENV_COORDINATOR = "JMP_LITE_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JMP_LITE_NUM_PROCESSES"
ENV_PROCESS_ID = "JMP_LITE_PROCESS_ID"
ENV_DEVICES = "JMP_LITE_DEVICES_PER_PROCESS"
ENV_RESULT_FILE = "JMP_LITE_RESULT_FILE"
ENV_PARENT_PID = "JMP_LITE_PARENT_PID"
ENV_COLLECTIVES = "JMP_LITE_COLLECTIVES"
_COLLECTIVES = ("gloo", "in_process")

# After one process fails, the others usually block in a collective that will
# never complete (JAX's own heartbeat notices only after 100 s): give them
# this long to exit on their own, then kill them.
_GRACE_SECONDS = 3.0
_POLL_SECONDS = 0.05
_TAIL_LINES = 40
_TAIL_CHARS = 4000
# What process 0 prints when the coordinator cannot bind its port (taken by
# someone else between our probe and its bind): retried on a fresh port.
_BIND_FAILED = re.compile(r"Failed to start RPC server|Failed to add port")
_BIND_ATTEMPTS = 3
_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


@dataclasses.dataclass(frozen=True)
class ProcessResult:
  """What one process of `run_processes` left behind.

  Attributes:
    process_id: the process's index, ``jax.process_index()`` in the worker.
    returncode: its exit status; negative if it ended by a signal (``-9``
      when `run_processes` killed it).
    stdout: everything it wrote to stdout (Gloo prints its connections here).
    stderr: everything it wrote to stderr.
    result: the value it passed to `report_result`, decoded from JSON, or
      None if it reported nothing.
  """

  process_id: int
  returncode: int
  stdout: str
  stderr: str
  result: Any = None


class MultiProcessError(RuntimeError):
  """Some process of `run_processes` failed, or they did not finish in time.

  The message names each failed or hung process and shows the tail of its
  stderr. ``results`` holds every process's `ProcessResult` (complete
  output, results of those that reported), ``timed_out`` whether the
  deadline passed.
  """

  def __init__(self, message: str, results: Sequence[ProcessResult], timed_out: bool):
    super().__init__(message)
    self.results = tuple(results)
    self.timed_out = timed_out


def _tail(text: str) -> str:
  lines = text.rstrip().splitlines()[-_TAIL_LINES:]
  tail = "\n".join(lines)[-_TAIL_CHARS:]
  return tail or "(empty)"


def _indent(text: str) -> str:
  return "\n".join("    " + line for line in text.splitlines())


def _free_port() -> int:
  """A TCP port that was free on the loopback interface a moment ago."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _command(target: Union[str, os.PathLike], args: Sequence[Any]) -> list[str]:
  if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
    raise TypeError(f"run_processes: args must be a sequence of strings, got {args!r}")
  bad = [a for a in args if isinstance(a, bool)
         or not isinstance(a, (str, int, float, os.PathLike))]
  if bad:
    raise TypeError(
        f"run_processes: args must be strings, numbers or paths, got {bad!r} in {args!r}")
  argv = [os.fspath(a) if isinstance(a, os.PathLike) else str(a) for a in args]
  if isinstance(target, os.PathLike) or (isinstance(target, str)
                                         and target.endswith(".py")):
    path = pathlib.Path(target)
    if not path.is_file():
      raise FileNotFoundError(
          f"run_processes: no worker script at {str(path)!r} (cwd {os.getcwd()!r})")
    # Absolute: the workers may run in another directory (cwd).
    return [sys.executable, str(path.resolve()), *argv]
  if isinstance(target, str) and re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", target):
    return [sys.executable, "-m", target, *argv]
  raise TypeError(
      "run_processes: target must be the path of a .py script or a module name "
      f"such as 'mypkg.worker' (run with python -m), got {target!r}")


def _check_count(name: str, value: Any) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"run_processes: {name} must be an int >= 1, got {value!r}")
  return value


def _environment(env: Optional[Mapping[str, str]], devices: int,
                 collectives: str) -> dict[str, str]:
  out = dict(os.environ)
  if env is not None:
    bad = {k: v for k, v in env.items() if not (isinstance(k, str) and isinstance(v, str))}
    if bad:
      raise TypeError(f"run_processes: env must map strings to strings, got {bad!r}")
    out.update(env)
  # The device count is set here, once: a count inherited through XLA_FLAGS
  # (as the parent test run may have) would disagree with it.
  flags = _DEVICE_COUNT_FLAG.sub("", out.get("XLA_FLAGS", "")).split()
  out["XLA_FLAGS"] = " ".join(
      flags + [f"--xla_force_host_platform_device_count={devices}"])
  out["JAX_NUM_CPU_DEVICES"] = str(devices)
  out["JAX_PLATFORMS"] = "cpu"
  out["PYTHONUNBUFFERED"] = "1"  # a killed worker's output up to the hang is kept
  out[ENV_DEVICES] = str(devices)
  out[ENV_COLLECTIVES] = collectives
  out[ENV_PARENT_PID] = str(os.getpid())
  return out


def _kill_group(proc: subprocess.Popen) -> None:
  """SIGKILLs ``proc``'s process group: the worker and anything it started."""
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass  # the group is gone already
  if proc.poll() is None:
    proc.kill()  # it left its group (setpgid): at least the worker itself


@dataclasses.dataclass
class _Attempt:
  """How one launch ended."""

  results: list[ProcessResult]
  timed_out: bool
  failed: list[int]  # non-zero exits, in the order they were noticed
  killed: list[int]  # still running when the harness stopped waiting


class _Echo:
  """Copies what one process writes to its files on to ours, as it comes."""

  def __init__(self, workdir: pathlib.Path, process: int):
    self._streams = [
        (open(workdir / f"{name}-{process}.txt", "rb"),
         codecs.getincrementaldecoder("utf-8")(errors="replace"), name)
        for name in ("stdout", "stderr")]

  def pump(self, final: bool = False) -> None:
    for source, decoder, name in self._streams:
      text = decoder.decode(source.read(), final=final)
      if text:
        # Looked up on each call: pytest's capture and redirect_stdout swap it.
        target = getattr(sys, name)
        target.write(text)
        target.flush()

  def close(self) -> None:
    self.pump(final=True)
    for source, _, _ in self._streams:
      source.close()


def _launch_once(command, n, env, timeout, cwd, workdir, port, echo) -> _Attempt:
  procs, files = [], []
  echoed = None
  timed_out = False
  failed: list[int] = []
  killed: list[int] = []
  try:
    for i in range(n):
      penv = dict(env)
      penv[ENV_NUM_PROCESSES] = str(n)
      penv[ENV_PROCESS_ID] = str(i)
      penv[ENV_COORDINATOR] = f"127.0.0.1:{port}"
      penv[ENV_RESULT_FILE] = str(workdir / f"result-{i}.json")
      out = open(workdir / f"stdout-{i}.txt", "wb")
      err = open(workdir / f"stderr-{i}.txt", "wb")
      files += [out, err]
      # Files, not pipes: a chatty worker cannot block on a full pipe while
      # nobody reads it. A session of its own, so killpg reaches its children.
      procs.append(subprocess.Popen(
          command, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=penv,
          cwd=cwd, start_new_session=True))
      if i == echo:
        echoed = _Echo(workdir, i)
    deadline = time.monotonic() + timeout
    first_failure = None
    while True:
      codes = [p.poll() for p in procs]
      failed += [i for i, c in enumerate(codes) if c not in (None, 0) and i not in failed]
      if all(c is not None for c in codes):
        break
      now = time.monotonic()
      if failed and first_failure is None:
        first_failure = now
      if first_failure is not None and now - first_failure > _GRACE_SECONDS:
        break
      if now > deadline:
        timed_out = True
        break
      if echoed is not None:
        echoed.pump()
      time.sleep(_POLL_SECONDS)
  finally:
    killed += [i for i, p in enumerate(procs) if p.poll() is None]
    failed += [i for i, p in enumerate(procs)
               if p.returncode not in (None, 0) and i not in failed]
    for p in procs:
      # Every group, finished or not: a worker that exited may have left
      # children behind.
      _kill_group(p)
    for p in procs:
      p.wait()
    for f in files:
      f.close()
    if echoed is not None:
      echoed.close()

  results = []
  for i, p in enumerate(procs):
    result_file = workdir / f"result-{i}.json"
    result = None
    if result_file.exists():
      result = json.loads(result_file.read_text())
    results.append(ProcessResult(
        process_id=i, returncode=p.returncode,
        stdout=(workdir / f"stdout-{i}.txt").read_text(errors="replace"),
        stderr=(workdir / f"stderr-{i}.txt").read_text(errors="replace"),
        result=result))
  return _Attempt(results, timed_out, failed, killed)


def _exit_status(returncode: int) -> str:
  if returncode < 0:
    try:
      return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
      return f"killed by signal {-returncode}"
  return f"exit code {returncode}"


def _failure_message(command, attempt: _Attempt, timeout) -> str:
  results, failed, killed = attempt.results, attempt.failed, attempt.killed
  head = f"run_processes({' '.join(command)!r}, {len(results)} processes):"
  if failed:
    first = failed[0]
    head += (f" process {first} failed first "
             f"({_exit_status(results[first].returncode)}).")
    if failed[1:]:
      head += f" Then process(es) {failed[1:]} failed too."
  else:
    head += f" did not finish within timeout={timeout:g} s."
  if killed and attempt.timed_out:
    head += f" Killed process(es) {killed}, still running at the deadline."
  elif killed:
    head += (f" Killed process(es) {killed}, still running {_GRACE_SECONDS:g} s "
             "later (likely waiting in a collective for the failed one).")
  parts = [head]
  for i in failed + killed:
    r = results[i]
    if i in failed:
      status = _exit_status(r.returncode)
    elif attempt.timed_out:
      status = "hung, killed at the deadline"
    else:
      status = "killed after another process failed"
    parts.append(f"--- process {i} ({status}); stderr tail:\n{_indent(_tail(r.stderr))}")
  return "\n".join(parts)


def run_processes(
    target: Union[str, os.PathLike],
    *,
    num_processes: int = 2,
    devices_per_process: int = 4,
    args: Sequence[Any] = (),
    timeout: float = 240.0,
    env: Optional[Mapping[str, str]] = None,
    cwd: Optional[Union[str, os.PathLike]] = None,
    collectives: str = "gloo",
    echo: Optional[int] = None,
) -> list[ProcessResult]:
  """Runs ``num_processes`` copies of a worker as one multi-process JAX program.

  Each process is ``python target *args`` (or ``python -m target *args`` for
  a module name) with ``devices_per_process`` CPU devices, in a process group
  of its own. The worker calls `initialize_worker` before using JAX, which
  connects the processes through a coordinator on a free loopback port, and
  may send back one JSON-serialisable value with `report_result`.

  All processes are waited for together. If one fails, the others get a few
  seconds to finish, then are killed (they are typically blocked in a
  collective that will never complete); at the deadline every process still
  running is killed. Either way every process group is killed before this
  returns or raises, also on an exception or interrupt in the caller, so no
  worker or child of a worker outlives the call.

  Args:
    target: the path of a ``.py`` script, or a module name run with ``-m``.
    num_processes: how many processes (1 is the reference run: the same
      devices in one process, see ``collectives``).
    devices_per_process: simulated CPU devices per process (each process
      gets ``JAX_NUM_CPU_DEVICES`` and ``JAX_PLATFORMS=cpu``).
    args: command-line arguments for the worker, the same for every process.
    timeout: seconds for the whole run, startup included.
    env: extra environment variables, on top of this process's; the
      variables above and the ``JMP_LITE_*`` ones are set by the harness.
    cwd: working directory of the workers (default: this process's).
    collectives: how devices all-reduce. ``"gloo"`` (the default): through
      Gloo, also with ``num_processes=1``, so that a run in one process
      sums in the same order as the same run split across processes and
      gives bitwise the same results. ``"in_process"`` (only with
      ``num_processes=1``): XLA's own CPU collectives, those of a plain
      single process, which sum in device order, so results may differ from
      a Gloo run in the last bits of every sum.
    echo: the index of a process whose stdout and stderr are copied to this
      process's ``sys.stdout`` and ``sys.stderr`` as they are written (within
      a poll interval, 50 ms), for live progress from one process of a long
      run; they are kept in its `ProcessResult` too. Default: none.

  Returns:
    One `ProcessResult` per process, in process order, all with
    ``returncode == 0``.

  Raises:
    MultiProcessError: if a process exited with a non-zero status or the
      run exceeded ``timeout``; the message names each failed or hung
      process with the tail of its stderr.
    FileNotFoundError: if the script does not exist.
    TypeError, ValueError: for malformed arguments.

  Example:
    >>> import pathlib, tempfile
    >>> from jmp_lite.testing import run_processes
    >>> WORKER = '''
    ... from jmp_lite.testing import initialize_worker, report_result
    ... initialize_worker()  # before any JAX computation
    ... import jax, jax.numpy as jnp
    ... from jax.sharding import NamedSharding, PartitionSpec as P
    ... mesh = jax.make_mesh((jax.device_count(),), ("data",))
    ... x = jax.make_array_from_process_local_data(  # 2 rows per process
    ...     NamedSharding(mesh, P("data")), jnp.full((2,), jax.process_index() + 1.0))
    ... total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
    ... report_result({"devices": jax.device_count(), "total": float(total)})
    ... '''
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...   script = pathlib.Path(tmp, "worker.py")
    ...   _ = script.write_text(WORKER)
    ...   results = run_processes(script, num_processes=2, devices_per_process=2)
    >>> [r.result for r in results]
    [{'devices': 4, 'total': 6.0}, {'devices': 4, 'total': 6.0}]
  """
  command = _command(target, args)
  n = _check_count("num_processes", num_processes)
  devices = _check_count("devices_per_process", devices_per_process)
  if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
      or not timeout > 0):
    raise ValueError(f"run_processes: timeout must be a number of seconds > 0, got {timeout!r}")
  if collectives not in _COLLECTIVES:
    raise ValueError(
        f"run_processes: collectives must be one of {_COLLECTIVES}, got {collectives!r}")
  if collectives == "in_process" and n > 1:
    raise ValueError(
        f"run_processes: collectives='in_process' needs num_processes=1, got {n}: "
        "processes communicate through Gloo.")
  if echo is not None and (isinstance(echo, bool) or not isinstance(echo, int)
                           or not 0 <= echo < n):
    raise ValueError(
        f"run_processes: echo must be None or a process index in [0, {n}), got {echo!r}")
  base_env = _environment(env, devices, collectives)
  start = time.monotonic()
  with tempfile.TemporaryDirectory(prefix="jmp_lite_processes_") as tmp:
    for attempt in range(_BIND_ATTEMPTS):
      workdir = pathlib.Path(tmp, f"attempt-{attempt}")
      workdir.mkdir()
      remaining = timeout - (time.monotonic() - start)
      outcome = _launch_once(
          command, n, base_env, max(remaining, 0.0), cwd, workdir, _free_port(),
          echo)
      first = outcome.results[0]
      lost_port = (collectives == "gloo" and first.returncode != 0
                   and _BIND_FAILED.search(first.stderr))
      if not (lost_port and attempt + 1 < _BIND_ATTEMPTS):
        break
  if outcome.failed or outcome.killed:
    raise MultiProcessError(_failure_message(command, outcome, timeout),
                            outcome.results, outcome.timed_out)
  return outcome.results
