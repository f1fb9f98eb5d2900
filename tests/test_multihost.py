"""Tests of the multi-process harness, and of data parallelism across processes.

The harness is `jmp_lite.testing.run_processes`; the workers it starts here
are in ``multihost_workers/``. Data parallelism: ``data_parallel.py`` trains
the same model three ways (`jmp_lite.TrainState`, `jmp_lite.value_and_grad`
by hand, `jmp_lite.optax.with_loss_scale` by hand) under ``jit`` over a
global ("data",) mesh of 8 CPU devices, run as 2 processes of 4 devices,
each feeding only its own rows of every batch. Two of the batches hold an inf in
rows that only one of the processes feeds. The runs are compared with the
same worker run as 1 process of 8 devices:

* with Gloo collectives, as in the 2-process run: bitwise identical;
* with XLA's in-process collectives (a plain single process): the same
  loss-scale trajectory and skips, values equal up to the order of the
  all-reduce sums (Gloo's ring sums each chunk starting from a different
  device; XLA's in-process all-reduce sums in device order).

Nothing here needs a GPU or a network: the processes talk over 127.0.0.1.

Each launch costs seconds (JAX import, distributed startup, compilation), so
each runs once per session, shared by the tests that read it, also across
pytest-xdist workers (see `_once_per_session`).
"""

import fcntl
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from jmp_lite.testing import MultiProcessError, ProcessResult, run_processes

# The heavy tier (several processes joined over Gloo): `pytest -m slow`.
pytestmark = pytest.mark.slow

WORKERS = pathlib.Path(__file__).with_name("multihost_workers")
HARNESS = WORKERS / "harness.py"
DATA_PARALLEL = WORKERS / "data_parallel.py"
FLOWS = ("train_state", "value_and_grad", "with_loss_scale", "shard_map_train_state",
         "shard_map_by_hand")
# step -> (row, column) of the inf in the global batch; the worker's POISONED.
POISONED = {3: (45, 2), 6: (10, 7)}
TIMEOUT = 240  # seconds per launch: a hang fails the test instead of blocking CI


def _gone(pid, wait=10.0):
  """Whether process ``pid`` has exited (a zombie counts), polling up to ``wait`` s."""
  deadline = time.monotonic() + wait
  while True:
    try:
      status = pathlib.Path(f"/proc/{pid}/status").read_text()
      alive = "\nState:\tZ" not in status
    except FileNotFoundError:
      alive = False
    except OSError:  # no /proc: ask the kernel
      try:
        os.kill(pid, 0)
        alive = True
      except ProcessLookupError:
        alive = False
    if not alive:
      return True
    if time.monotonic() > deadline:
      return False
    time.sleep(0.1)


_SESSION_CACHE = {}


def _once_per_session(request, tmp_path_factory, key, produce):
  """``produce()`` (JSON), computed once per session, across xdist workers too.

  Under xdist the workers share the parent of their temporary directories;
  the first to arrive computes and writes the value under a lock, the others
  wait for it and read it.
  """
  cache = _SESSION_CACHE
  if key in cache:
    return cache[key]
  if not hasattr(request.config, "workerinput"):  # not under xdist
    cache[key] = produce()
    return cache[key]
  root = tmp_path_factory.getbasetemp().parent
  path = root / f"multihost-{key}.json"
  with open(root / f"multihost-{key}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not path.exists():
      path.write_text(json.dumps(produce()))
    cache[key] = json.loads(path.read_text())
  return cache[key]


# -------------------------------------------------------------- the harness


def test_workers_join_one_runtime_and_report_results():
  results = run_processes(HARNESS, num_processes=2, devices_per_process=2,
                          args=["echo", "a b", 7], env={"JMP_LITE_TEST_EXTRA": "x"},
                          timeout=TIMEOUT)
  assert [type(r) for r in results] == [ProcessResult] * 2
  for i, r in enumerate(results):
    assert r.process_id == i and r.returncode == 0
    out = r.result
    assert out["process"] == out["process_index"] == i
    assert (out["process_count"], out["device_count"], out["local_device_count"]) == (2, 4, 2)
    # A real cross-process reduction: 2 devices of 1.0 and 2 of 2.0.
    assert out["total"] == 6.0
    assert out["args"] == ["a b", "7"] and out["extra_env"] == "x"
    assert out["numpy"] == [1.5, [0, 1, 2]]
    assert np.isnan(out["nonfinite"][0]) and out["nonfinite"][1] == np.inf


def test_is_replicated_everywhere_compares_across_processes():
  """Each process compared only its own devices' shards: a fully replicated
  scale holding 32768 in one process and 16384 in the other read as
  replicated in both."""
  results = run_processes(HARNESS, num_processes=2, devices_per_process=2,
                          args=["replicas"], timeout=TIMEOUT)
  assert [(r.result["same"], r.result["diverged"]) for r in results] == [(True, False)] * 2


def test_one_process_by_module_name_overrides_an_inherited_device_count():
  # The parent's XLA_FLAGS asks for 8 devices; devices_per_process wins.
  results = run_processes("harness", num_processes=1, devices_per_process=3,
                          args=["echo"], cwd=WORKERS, collectives="in_process",
                          env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
                          timeout=TIMEOUT)
  out = results[0].result
  assert (out["process_count"], out["device_count"], out["total"]) == (1, 3, 3.0)


def test_a_coordinator_port_taken_in_the_meantime_is_retried(monkeypatch):
  # Another program binds the port between the harness's probe and the
  # coordinator's bind: process 0 fails, and the run starts again elsewhere.
  from jmp_lite import _launch
  taken = socket.socket()
  taken.bind(("127.0.0.1", 0))
  taken.listen()
  ports = [taken.getsockname()[1]]
  free_port = _launch._free_port
  monkeypatch.setattr(_launch, "_free_port",
                      lambda: ports.pop() if ports else free_port())
  try:
    results = run_processes(HARNESS, num_processes=2, devices_per_process=1,
                            args=["echo"], timeout=TIMEOUT)
  finally:
    taken.close()
  assert not ports  # the taken port was tried first
  assert [r.result["total"] for r in results] == [3.0, 3.0]


def test_a_failing_process_is_named_with_its_stderr_and_the_others_are_stopped():
  start = time.monotonic()
  with pytest.raises(MultiProcessError) as info:
    run_processes(HARNESS, num_processes=2, devices_per_process=2,
                  args=["fail_in_collective"], timeout=TIMEOUT)
  error = info.value
  message = str(error)
  assert "harness.py fail_in_collective', 2 processes): process 1 failed first (exit code 1)." in message
  assert "--- process 1 (exit code 1); stderr tail:" in message
  assert "ValueError: boom in process 1, before the collective" in message
  assert not error.timed_out
  assert error.results[1].returncode == 1
  # Process 0 waited in a collective that process 1 never joined: killed
  # after a grace period, or failed by itself when its peer vanished.
  assert error.results[0].returncode != 0
  assert "--- process 0 (" in message
  # Well before JAX's own timeouts (heartbeat 100 s, shutdown barrier 300 s).
  assert time.monotonic() - start < 60


def test_a_non_zero_exit_code_fails_the_run():
  with pytest.raises(MultiProcessError) as info:
    run_processes(HARNESS, num_processes=2, args=["exit", 3], timeout=TIMEOUT)
  message = str(info.value)
  assert "harness.py exit 3', 2 processes): process 1 failed first (exit code 3)." in message
  assert "--- process 1 (exit code 3); stderr tail:\n    process 1 exits with 3" in message
  assert "--- process 0" not in message  # it succeeded
  assert [r.returncode for r in info.value.results] == [0, 3]


def test_a_hang_is_killed_at_the_deadline_with_the_children_it_started():
  start = time.monotonic()
  with pytest.raises(MultiProcessError) as info:
    run_processes(HARNESS, num_processes=2, devices_per_process=1, args=["hang"],
                  timeout=10)
  elapsed = time.monotonic() - start
  error = info.value
  message = str(error)
  assert error.timed_out and 10 <= elapsed < 30
  assert ("harness.py hang', 2 processes): did not finish within timeout=10 s. "
          "Killed process(es) [0, 1], still running at the deadline.") in message
  for i in (0, 1):
    assert f"--- process {i} (hung, killed at the deadline); stderr tail:" in message
    assert f"process {i} is hanging" in message
  # What the processes reported before hanging is kept; nothing they
  # started survives them.
  for r in error.results:
    assert r.returncode == -signal.SIGKILL
    assert r.result is not None, f"process {r.process_id} did not start in 10 s:\n{r.stderr}"
    assert _gone(r.result["worker"]) and _gone(r.result["child"]), r.result


def test_children_left_behind_by_a_successful_run_are_killed():
  results = run_processes(HARNESS, num_processes=2, devices_per_process=1,
                          args=["leave_child"], timeout=TIMEOUT)
  for r in results:
    assert r.returncode == 0
    assert _gone(r.result["child"]), r.result


def test_a_worker_that_reports_nothing_has_result_none(tmp_path):
  # Also: a relative script path is this process's, whatever the workers' cwd.
  results = run_processes(os.path.relpath(HARNESS), num_processes=2,
                          devices_per_process=1, args=["silent"], cwd=tmp_path,
                          timeout=TIMEOUT)
  assert [(r.returncode, r.result) for r in results] == [(0, None), (0, None)]


def test_workers_do_not_outlive_a_killed_launcher(tmp_path):
  # run_processes cannot clean up after its own SIGKILL: initialize_worker's
  # watchdog does.
  pid_file = tmp_path / "worker.pid"
  launcher = subprocess.Popen(
      [sys.executable, "-c",
       "import sys; from jmp_lite.testing import run_processes; "
       "run_processes(sys.argv[1], num_processes=1, devices_per_process=1, "
       "args=['init_hang', sys.argv[2]], timeout=600)", str(HARNESS), str(pid_file)],
      # Its temporary directory, left behind by the SIGKILL, lands in tmp_path.
      env={**os.environ, "TMPDIR": str(tmp_path)},
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  worker = None
  try:
    deadline = time.monotonic() + 120
    while not pid_file.exists() or not pid_file.read_text():
      assert launcher.poll() is None, launcher.stderr.read().decode()
      assert time.monotonic() < deadline, "the worker did not start"
      time.sleep(0.1)
    worker = int(pid_file.read_text())
    launcher.kill()
    launcher.wait()
    assert _gone(worker, wait=15.0)
  finally:
    launcher.kill()
    launcher.wait()
    launcher.stderr.close()
    if worker is not None:
      try:
        os.killpg(worker, signal.SIGKILL)  # the worker leads its own group
      except ProcessLookupError:
        pass


# ---------------------------------------------------- data parallel training


def _launch(**kwargs):
  return [r.result for r in run_processes(DATA_PARALLEL, timeout=TIMEOUT, **kwargs)]


@pytest.fixture
def two_processes(request, tmp_path_factory):
  """The worker's reports from 2 processes x 4 devices."""
  return _once_per_session(request, tmp_path_factory, "2x4", lambda: _launch(
      num_processes=2, devices_per_process=4))


@pytest.fixture
def one_process(request, tmp_path_factory):
  """The same run in 1 process x 8 devices, with Gloo collectives."""
  return _once_per_session(request, tmp_path_factory, "1x8", lambda: _launch(
      num_processes=1, devices_per_process=8))[0]


@pytest.fixture
def one_plain_process(request, tmp_path_factory):
  """The same run in 1 process x 8 devices, with XLA's in-process collectives."""
  return _once_per_session(request, tmp_path_factory, "1x8-in-process", lambda: _launch(
      num_processes=1, devices_per_process=8, collectives="in_process"))[0]


def _floats(hex_bytes):
  return np.frombuffer(bytes.fromhex(hex_bytes), np.float32)


def test_each_process_feeds_only_its_own_rows(two_processes):
  p0, p1 = two_processes
  for i, p in enumerate((p0, p1)):
    assert (p["process_index"], p["process_count"]) == (i, 2)
    assert (p["device_count"], p["local_device_count"]) == (8, 4)
  assert p0["local_rows"] == list(range(32)) and p1["local_rows"] == list(range(32, 64))
  # Each poisoned row is fed by one process only.
  assert p0["locally_poisoned"] == [6] and p1["locally_poisoned"] == [3]
  assert {int(k): tuple(v) for k, v in p0["poisoned"].items()} == POISONED


@pytest.mark.parametrize("flow", FLOWS)
def test_an_overflow_in_one_process_rows_skips_the_step_everywhere(two_processes, flow):
  for p in two_processes:
    run = p["flows"][flow]
    skipped = [step for step, s in enumerate(run["skipped"]) if s]
    assert skipped == sorted(POISONED), (p["process_index"], run["skipped"])
    assert run["skipped_steps"] == len(POISONED)
    # The scale backed off after each skip and grew in between.
    scales = run["scales"]
    for step in POISONED:
      assert scales[step + 1] == scales[step] / 2, scales
    assert max(scales) > scales[0], scales


@pytest.mark.parametrize("flow", FLOWS)
def test_processes_agree_bitwise(two_processes, flow):
  p0, p1 = (p["flows"][flow] for p in two_processes)
  # Losses are floats decoded from JSON: == on them is bitwise, but for NaN.
  assert np.array_equal(p0["losses"], p1["losses"], equal_nan=True)
  assert p0["scales"] == p1["scales"] and p0["skipped"] == p1["skipped"]
  assert p0["params"] == p1["params"]
  assert p0["params_digest"] == p1["params_digest"]
  assert p0["opt_state_digest"] == p1["opt_state_digest"]
  assert p0["replicated_locally"] and p1["replicated_locally"]


@pytest.mark.parametrize("flow", FLOWS)
def test_matches_one_process_bitwise_with_the_same_collectives(
    two_processes, one_process, flow):
  ours, reference = two_processes[0]["flows"][flow], one_process["flows"][flow]
  assert np.array_equal(ours["losses"], reference["losses"], equal_nan=True)
  assert ours["scales"] == reference["scales"]
  assert ours["skipped"] == reference["skipped"]
  assert ours["params"] == reference["params"]
  assert ours["opt_state_digest"] == reference["opt_state_digest"]


@pytest.mark.parametrize("flow", FLOWS)
def test_matches_a_plain_one_process_run_up_to_summation_order(
    two_processes, one_plain_process, flow):
  ours, reference = two_processes[0]["flows"][flow], one_plain_process["flows"][flow]
  # The decisions are exactly the same ...
  assert ours["scales"] == reference["scales"]
  assert ours["skipped"] == reference["skipped"]
  # ... the values only as close as sums in another order allow (float32
  # partial sums for the engine's flows, float16 ones for with_loss_scale,
  # whose step casts and calls jax.grad itself); measured here: losses 6e-5
  # relative, parameters 1.1e-4 apart.
  np.testing.assert_allclose(ours["losses"], reference["losses"], rtol=5e-4)
  for name in ours["params"]:
    np.testing.assert_allclose(_floats(ours["params"][name]),
                               _floats(reference["params"][name]), rtol=0, atol=1e-3)


def test_under_shard_map_a_forgotten_axis_name_or_mark_varying_is_refused_everywhere(
    two_processes):
  # Each would let the replicas diverge silently (or sum gradients twice);
  # every process refuses at trace time, before a collective could hang.
  p0, p1 = (p["refusals"] for p in two_processes)
  assert p0 == p1
  assert re.match(r"with_loss_scale: runs inside shard_map with check_vma=False .*"
                  r"\('data',\).*Pass axis_name='data'", p0["forgot_axis_name"])
  assert re.match(r"reduce_gradients: gradient \['b1'\] \(float32\[32\]\) was already "
                  r"summed over 'data' by JAX, in float16.*mark_varying",
                  p0["forgot_mark_varying"])


@pytest.mark.parametrize("flow", FLOWS)
def test_each_step_compiles_once(two_processes, one_process, flow):
  for p in (*two_processes, one_process):
    assert p["flows"][flow]["compiles"] == 1


# ------------------------------------------------- FSDP-style sharding (2 x 4)

FSDP = WORKERS / "fsdp.py"
FSDP_POISONED = {2: (40, 3), 5: (7, 1)}  # the worker's POISONED


@pytest.fixture
def fsdp_two(request, tmp_path_factory):
  return _once_per_session(request, tmp_path_factory, "fsdp-2x4", lambda: [
      r.result for r in run_processes(FSDP, num_processes=2, devices_per_process=4,
                                      timeout=TIMEOUT)])


@pytest.fixture
def fsdp_one(request, tmp_path_factory):
  return _once_per_session(request, tmp_path_factory, "fsdp-1x8", lambda: [
      r.result for r in run_processes(FSDP, num_processes=1, devices_per_process=8,
                                      timeout=TIMEOUT)])[0]


def test_fsdp_shards_params_and_optimizer_state_and_replicates_the_loss_scale(fsdp_two):
  for p in fsdp_two:
    assert p["param_specs"] == {"['w1']": "P('data', 'model')", "['b1']": "P('model',)",
                                "['w2']": "P('model', 'data')"}
    moments = {k: v for k, v in p["opt_state_specs"].items() if ".mu" in k or ".nu" in k}
    assert len(moments) == 6
    for key, spec in moments.items():
      assert spec == p["param_specs"][key[key.rindex("['"):]], (key, spec)
    assert p["loss_scale_replicated"] and p["scalars_replicated"]
    assert p["compiles"] == 1


def test_fsdp_an_overflow_in_one_process_rows_skips_everywhere(fsdp_two):
  assert fsdp_two[0]["local_rows"] == list(range(32))
  for p in fsdp_two:
    assert [i for i, s in enumerate(p["skipped"]) if s] == sorted(FSDP_POISONED)
    for step in FSDP_POISONED:
      assert p["scales"][step + 1] == p["scales"][step] / 2


def test_fsdp_processes_agree_and_match_one_process_bitwise(fsdp_two, fsdp_one):
  for p in fsdp_two:
    for key in ("losses", "scales", "skipped", "params_digest", "opt_state_digest"):
      assert p[key] == fsdp_one[key], key


def _reductions(ops):
  return [op for op in ops if op[0] in ("all-reduce", "reduce-scatter") and op[2]]


def test_fsdp_gradients_are_reduced_in_the_policy_reduce_dtype(fsdp_two):
  ops = fsdp_two[0]["collectives"]
  f32, bf16, plain = (_reductions(ops[k]) for k in ("f32", "bf16", "plain"))
  # Every array reduction (gradients, and the row-parallel layer's forward
  # partial sums) in the policy's reduce dtype: float32 by default ...
  assert f32 and {op[1] for op in f32} == {"float32"}, f32
  # ... bfloat16 when the policy asks, as a step that casts and calls
  # jax.grad itself gets whatever the policy says.
  assert {op[1] for op in bf16} == {"bfloat16"}, bf16
  assert {op[1] for op in plain} == {"bfloat16"}, plain
  # The same reductions, twice the bytes: the measured cost of float32.
  assert len(f32) == len(bf16)
  assert sum(op[3] for op in f32) == 2 * sum(op[3] for op in bf16)
  # Parameters are gathered in the compute dtype, after their cast.
  gathers = [op for op in ops["f32"] if op[0] == "all-gather"]
  assert gathers and {op[1] for op in gathers} == {"bfloat16"}, gathers
