"""orbax checkpoints of a sharded `jmp_lite.TrainState`, written and read by several processes.

The worker, ``multihost_workers/checkpoint.py``, trains ``fsdp.py``'s model
(bf16 compute, adam, dynamic loss scale; parameters and adam's moments
sharded over a ("data", "model") mesh) for ``N_STEPS`` steps, with an inf in
the batch at the steps of ``POISONED``. It runs

* uninterrupted, on 2 processes x 4 devices, every process saving the state
  with orbax before step ``STOP`` (saving only reads the state);
* from that checkpoint to the end, in fresh processes, restored from an
  abstract target onto the restoring run's mesh: on 2 x 4, on 1 process x 8
  devices (with Gloo collectives, as test_multihost.py's reference runs:
  bitwise comparable), and on 1 process x 2 devices with a 1 x 2 mesh (the
  sharded leaves cut into other blocks).

The steps are chosen so that at ``STOP`` the loss scale, its growth counter,
the skip counter and adam's counter all differ from their initial values, and
the poisoned steps skip both before and after it: a checkpoint missing any
part of the state resumes differently.

Each launch costs seconds, so each runs once per session, shared by the tests
that read it, also across pytest-xdist workers (`_once_per_session`).
"""

import fcntl
import json
import pathlib

import numpy as np
import orbax.checkpoint as ocp
import pytest

from jmp_lite.testing import MultiProcessError, run_processes

# The heavy tier (several processes joined over Gloo): `pytest -m slow`.
pytestmark = pytest.mark.slow

WORKER = pathlib.Path(__file__).with_name("multihost_workers") / "checkpoint.py"
N_STEPS, STOP = 10, 6  # the worker's
POISONED = {1: (40, 3), 2: (7, 1), 7: (50, 0)}  # the worker's: step -> (row, column)
TIMEOUT = 240  # seconds per launch: a hang fails the test instead of blocking CI
TRAJECTORY = ("losses", "scales", "skipped")
# What the loss-scale state and the counters are at STOP: none is initial.
AT_STOP = {"step": 6, "loss_scale": 2.0 ** 14, "counter": 1, "skipped_steps": 2,
           "adam_count": 4}
INITIAL = {"step": 0, "loss_scale": 2.0 ** 15, "counter": 0, "skipped_steps": 0,
           "adam_count": 0}
STATE_NUMBERS = tuple(AT_STOP)

_SESSION_CACHE = {}


def _once_per_session(request, tmp_path_factory, key, produce):
  """``produce()`` (JSON), computed once per session, across xdist workers too.

  As in test_multihost.py: under xdist the workers share the parent of their
  temporary directories; the first to arrive computes and writes the value
  under a lock, the others wait for it and read it. One lock for all of this
  module's launches: each keeps this machine's cores busy by itself, and two
  at a time only run slower. A launch that failed is not retried by every
  test that needs it: they all fail with its message.
  """
  key = f"checkpoint-{key}"
  if key not in _SESSION_CACHE:
    _SESSION_CACHE[key] = _produce_once(request, tmp_path_factory, key, produce)
  outcome = _SESSION_CACHE[key]
  if "error" in outcome:
    pytest.fail(f"{key} failed (in the first test that needed it):\n{outcome['error']}",
                pytrace=False)
  return outcome["value"]


def _produce_once(request, tmp_path_factory, key, produce):
  def attempt():
    try:
      return {"value": produce()}
    except MultiProcessError as e:
      return {"error": str(e)}

  if not hasattr(request.config, "workerinput"):  # not under xdist
    return attempt()
  root = tmp_path_factory.getbasetemp().parent
  path = root / f"multihost-{key}.json"
  with open(root / "multihost-checkpoint.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not path.exists():
      path.write_text(json.dumps(attempt()))
    return json.loads(path.read_text())


def _launch(*args, num_processes, devices_per_process):
  return [r.result for r in run_processes(
      WORKER, num_processes=num_processes, devices_per_process=devices_per_process,
      args=args, timeout=TIMEOUT)]


@pytest.fixture
def full(request, tmp_path_factory):
  """The uninterrupted run on 2 x 4, saved at STOP: the directory and the reports."""
  def produce():
    directory = tmp_path_factory.mktemp("checkpoint")
    return {"directory": str(directory),
            "reports": _launch("full", directory, num_processes=2, devices_per_process=4)}
  return _once_per_session(request, tmp_path_factory, "full-2x4", produce)


def _resumed(request, tmp_path_factory, full, n, k, *mesh):
  key = f"resume-{n}x{k}" + "".join(f"-{m}" for m in mesh)
  return _once_per_session(request, tmp_path_factory, key, lambda: _launch(
      "resume", full["directory"], *mesh, num_processes=n, devices_per_process=k))


@pytest.fixture
def resumed_2x4(request, tmp_path_factory, full):
  """Restored in 2 fresh processes of 4 devices: one report per process."""
  return _resumed(request, tmp_path_factory, full, 2, 4)


@pytest.fixture
def resumed_1x8(request, tmp_path_factory, full):
  """Restored in 1 process of 8 devices, with Gloo collectives as on 2 x 4."""
  return _resumed(request, tmp_path_factory, full, 1, 8)[0]


@pytest.fixture
def resumed_1x2(request, tmp_path_factory, full):
  """Restored in 1 process of 2 devices, onto a 1 x 2 ("data", "model") mesh."""
  return _resumed(request, tmp_path_factory, full, 1, 2, "1x2")[0]


def _tail(report):
  """The part of the uninterrupted run's trajectory a resumed run repeats."""
  return {key: report[key][STOP:] for key in TRAJECTORY}


def _numbers(described):
  return {key: described[key] for key in STATE_NUMBERS}


def test_the_stop_falls_where_every_part_of_the_state_matters(full):
  reference = full["reports"][0]
  # Skips and loss-scale changes on both sides of the stop ...
  skipped = [step for step, s in enumerate(reference["skipped"]) if s]
  assert skipped == sorted(POISONED) and min(skipped) < STOP < max(skipped)
  scales = reference["scales"]
  assert len(set(scales[:STOP])) > 1 and len(set(scales[STOP:])) > 1, scales
  # ... and at the stop, the loss scale, its growth counter, the skip counter
  # and adam's counter (applied steps, not calls) all differ from their
  # initial values: a checkpoint that dropped or reset any of them would
  # change the resumed trajectory or the final state.
  assert _numbers(reference["saved"]) == AT_STOP
  assert all(AT_STOP[key] != INITIAL[key] for key in STATE_NUMBERS)


def test_every_process_saved_its_own_shards(full):
  directory = pathlib.Path(full["directory"], "state")
  # Finalised (orbax's own test: a commit marker on newer orbax versions,
  # no temporary suffix on older ones).
  assert ocp.path.step.is_checkpoint_finalized(directory)
  # orbax's OCDBT layout: one key-value store per process that wrote arrays.
  assert sorted(p.name for p in directory.glob("ocdbt.process_*")) == [
      "ocdbt.process_0", "ocdbt.process_1"]


def test_stopped_and_resumed_on_2x4_equals_the_uninterrupted_run_bitwise(
    full, resumed_2x4):
  for reference, resumed in zip(full["reports"], resumed_2x4):
    assert resumed["steps"] == list(range(STOP, N_STEPS))
    # Losses are floats decoded from JSON: == is bitwise (none is NaN).
    assert {key: resumed[key] for key in TRAJECTORY} == _tail(reference)
    assert resumed["final"]["params_digest"] == reference["final"]["params_digest"]
    assert resumed["final"]["opt_state_digest"] == reference["final"]["opt_state_digest"]
    assert resumed["final"]["leaf_digests"] == reference["final"]["leaf_digests"]
    assert _numbers(resumed["final"]) == _numbers(reference["final"])
    # The restored state has the live state's avals and shardings: the step
    # compiled once, as in the uninterrupted run.
    assert resumed["final"]["leaves"] == reference["final"]["leaves"]
    assert resumed["compiles"] == reference["compiles"] == 1


@pytest.mark.parametrize("layout", ["2x4", "1x8", "1x2"])
def test_the_restored_state_is_the_saved_one_bit_for_bit_and_dtype_for_dtype(
    full, resumed_2x4, resumed_1x8, resumed_1x2, layout):
  resumed = {"2x4": resumed_2x4[0], "1x8": resumed_1x8, "1x2": resumed_1x2}[layout]
  saved, restored = full["reports"][0]["saved"], resumed["restored"]
  assert restored["leaf_digests"] == saved["leaf_digests"]
  assert _numbers(restored) == AT_STOP
  saved_dtypes = {name: leaf["dtype"] for name, leaf in saved["leaves"].items()}
  restored_dtypes = {name: leaf["dtype"] for name, leaf in restored["leaves"].items()}
  # What orbax wrote, and what it read back, in each leaf's own dtype.
  assert resumed["stored_dtypes"] == saved_dtypes
  assert restored_dtypes == saved_dtypes
  assert not any(leaf["weak_type"] for leaf in restored["leaves"].values())
  assert {name: dtype for name, dtype in saved_dtypes.items()
          if name.startswith("params/")} == {
              "params/w1": "float32", "params/b1": "float32", "params/w2": "float32"}
  assert {name.rpartition("/")[2]: dtype for name, dtype in saved_dtypes.items()
          if name.startswith("opt_state/loss_scale/")} == {
              "loss_scale": "float32", "counter": "int32", "period": "int32",
              "factor": "float32", "min_loss_scale": "float32",
              "max_loss_scale": "float32", "hysteresis": "int32",
              "hysteresis_left": "int32", "consecutive_hysteresis": "bool"}
  for name, dtype in (("step", "int32"), ("opt_state/inner_state/0/count", "int32"),
                      ("opt_state/skipped", "bool"), ("opt_state/skipped_steps", "int32"),
                      ("opt_state/grad_norm", "float32"), ("opt_state/mini_step", "int32"),
                      ("opt_state/nonfinite/grads", "bool")):
    assert saved_dtypes[name] == dtype, name


def test_a_checkpoint_of_2x4_continues_on_1x8_bitwise(full, resumed_1x8):
  assert (resumed_1x8["process_count"], resumed_1x8["device_count"]) == (1, 8)
  reference = full["reports"][0]
  assert {key: resumed_1x8[key] for key in TRAJECTORY} == _tail(reference)
  assert resumed_1x8["final"]["params_digest"] == reference["final"]["params_digest"]
  assert resumed_1x8["final"]["opt_state_digest"] == reference["final"]["opt_state_digest"]
  assert resumed_1x8["final"]["leaf_digests"] == reference["final"]["leaf_digests"]
  assert resumed_1x8["final"]["leaves"] == reference["final"]["leaves"]
  assert resumed_1x8["compiles"] == 1


def test_a_checkpoint_of_2x4_is_resharded_onto_a_1x2_mesh(full, resumed_1x2):
  reference = full["reports"][0]
  saved, restored = reference["saved"]["leaves"], resumed_1x2["restored"]["leaves"]
  assert saved["params/w1"]["mesh"] == {"data": 4, "model": 2}
  assert restored["params/w1"]["mesh"] == {"data": 1, "model": 2}
  # The sharded leaves are cut differently: w1 and its moments (16, 64) were
  # (4, 32) blocks, now (16, 32); w2 (64, 8) was (32, 2), now (32, 8).
  for name in ("params/w1", "opt_state/inner_state/0/mu/w1",
               "opt_state/inner_state/0/nu/w1"):
    assert (saved[name]["shard_shape"], restored[name]["shard_shape"]) == (
        [4, 32], [16, 32]), name
  assert (saved["params/w2"]["shard_shape"], restored["params/w2"]["shard_shape"]) == (
      [32, 2], [32, 8])
  # Another mesh sums in another order: the decisions are exact, the losses
  # as close as float32 sums in another order allow.
  tail = _tail(reference)
  assert resumed_1x2["scales"] == tail["scales"]
  assert resumed_1x2["skipped"] == tail["skipped"]
  np.testing.assert_allclose(resumed_1x2["losses"], tail["losses"], rtol=1e-5)
  assert _numbers(resumed_1x2["final"]) == _numbers(reference["final"])
  assert resumed_1x2["compiles"] == 1


def test_every_process_reports_the_same(full, resumed_2x4):
  for reports in (full["reports"], resumed_2x4):
    assert [r["process_index"] for r in reports] == [0, 1]
    assert [(r["process_count"], r["device_count"]) for r in reports] == [(2, 8)] * 2
    p0, p1 = ({k: v for k, v in r.items() if k != "process_index"} for r in reports)
    assert p0 == p1


@pytest.mark.parametrize("length", [16, 8])
def test_fp8_restore_runs_across_processes_onto_the_targets_shardings(tmp_path, length):
  """`jmp_lite.fp8.restore` on 2 processes x 2 devices: it read every leaf
  with NumPy, which cannot read other processes' shards (RuntimeError), and
  placed what it could on one device. Now each leaf is on the target's
  sharding, the parameters as saved, and both processes agree."""
  worker = WORKER.with_name("fp8_restore.py")
  results = [r.result for r in run_processes(
      worker, num_processes=2, devices_per_process=2, args=[str(tmp_path), str(length)],
      timeout=TIMEOUT)]
  assert results[0] == results[1], results
  got = results[0]
  assert got["same_shardings"] and got["w1_shards"] == 4, got
  assert got["params_restored"] == got["params_saved"]
  assert got["history_length"] == length
