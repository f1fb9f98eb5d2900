"""Tests of jmp_lite.testing, and fault injection into a real training run.

The training run: a Flax Linen MLP on scikit-learn's digits, trained with
`jmp_lite.TrainState` (so `jmp_lite.optax.with_loss_scale`) while
`inject_nonfinite` poisons gradients at chosen steps, including 50 in a row,
with parameters in float32, bfloat16 and float16.
"""

import functools
import threading
import time

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from sklearn.datasets import load_digits

import jmp_lite
from jmp_lite.testing import assert_single_compile, count_compilations, inject_nonfinite
from jmp_lite.testing import assert_trees_bitwise_equal

FLOAT_DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e5m2, jnp.float8_e4m3fn]
VALUES = {"nan": np.isnan, "inf": lambda x: np.isposinf(x), "-inf": np.isneginf}


def _host(x):
  return np.asarray(x).astype(np.float32)


def _grads(dtype=jnp.float32):
  return {"dense": {"kernel": jnp.ones((3, 4), dtype), "bias": jnp.ones(4, dtype)},
          "out": jnp.full((2,), 0.5, dtype), "count": jnp.int32(3)}


# ------------------------------------------------------------ inject_nonfinite


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_inject_poisons_every_float_dtype_on_the_chosen_steps_only(dtype, value):
  grads = _grads(dtype)
  f = jax.jit(lambda g, s: inject_nonfinite(g, s, at_steps=[2, 5], value=value,
                                            leaves=["['dense']['kernel']"]))
  compiled = []  # by f only, not by the eager checks around it
  for step in range(7):
    with count_compilations() as now:
      out = f(grads, step)
    compiled += now
    chex.assert_trees_all_equal_dtypes(out, grads)
    kernel = _host(out["dense"]["kernel"]).ravel()
    if step in (2, 5):
      # float8_e4m3fn has no infinity: it gets NaN.
      check = np.isnan if dtype == jnp.float8_e4m3fn else VALUES[value]
      assert check(kernel[0]) and np.isfinite(kernel[1:]).all()
      assert not bool(jmp_lite.all_finite(out))
    else:
      assert bool(jmp_lite.all_finite(out))
      assert_trees_bitwise_equal(out["dense"]["kernel"], grads["dense"]["kernel"])
    # The other leaves are never touched.
    for name in ("out", "count"):
      assert_trees_bitwise_equal(out[name], grads[name])
  assert len(compiled) == 1  # the step is traced: one compilation for all steps


def test_inject_random_leaf_and_element_is_one_element_reproducible_and_varies():
  grads = _grads()
  key = jax.random.key(0)
  f = jax.jit(lambda g, s: inject_nonfinite(
      g, s, at_steps=list(range(40)), leaves="random", element="random", value="random",
      key=key))
  hits, kinds = set(), set()
  for step in range(40):
    out = f(grads, step)
    bad = [(jax.tree_util.keystr(p), i, v) for p, x in jax.tree_util.tree_leaves_with_path(out)
           for i, v in enumerate(_host(x).ravel()) if not np.isfinite(v)]
    assert len(bad) == 1
    hits.add(bad[0][:2])
    kinds.add("nan" if np.isnan(bad[0][2]) else ("+inf" if bad[0][2] > 0 else "-inf"))
    assert_trees_bitwise_equal(f(grads, step), out)
  assert {h[0] for h in hits} == {"['dense']['bias']", "['dense']['kernel']", "['out']"}
  assert len(hits) > 8 and kinds == {"nan", "+inf", "-inf"}


def test_inject_all_elements_predicate_and_enabled():
  grads = _grads(jnp.bfloat16)
  out = inject_nonfinite(grads, 1, at_steps=1, element="all",
                         leaves=lambda path, leaf: "dense" in path)
  assert np.isnan(_host(out["dense"]["kernel"])).all()
  assert np.isnan(_host(out["dense"]["bias"])).all()
  assert np.isfinite(_host(out["out"])).all()
  off = inject_nonfinite(grads, 1, at_steps=[1], enabled=jnp.bool_(False))
  assert bool(jmp_lite.all_finite(off))


@pytest.mark.parametrize("kwargs,error,match", [
    ({"value": 1.0}, ValueError, "value=1.0 is finite"),
    ({"value": "banana"}, ValueError, "value='banana'"),
    ({"leaves": ["['nope']"]}, ValueError, r"unknown leaf paths \[\"\['nope'\]\"\]"),
    ({"leaves": "random"}, TypeError, "needs key"),
    ({"element": "middle"}, ValueError, "element='middle'"),
    ({"at_steps": [-1]}, ValueError, r"at_steps must be >= 0.*\[-1\]"),
    ({"at_steps": [1.5]}, TypeError, r"at_steps.*\[1.5\]"),
    ({"enabled": jnp.ones(2, bool)}, TypeError, "enabled must be a boolean scalar"),
])
def test_inject_rejects_bad_arguments(kwargs, error, match):
  args = {"at_steps": [0], **kwargs}
  with pytest.raises(error, match=match):
    inject_nonfinite(_grads(), 0, **args)


def test_inject_rejects_dtypes_without_nan_or_inf():
  with pytest.raises(ValueError, match=r"\['w'\] is float4_e2m1fn, which has neither"):
    inject_nonfinite({"w": jnp.zeros(2, ml_dtypes.float4_e2m1fn)}, 0, at_steps=[0])
  with pytest.raises(ValueError, match="no floating-point leaf"):
    inject_nonfinite({"n": jnp.zeros(2, jnp.int32)}, 0, at_steps=[0])


# ------------------------------------------------ compile-count utilities


def test_assert_single_compile_accepts_a_stable_step_and_returns_the_last_output():
  state = {"w": jnp.ones(3), "count": jnp.zeros((), jnp.int32)}
  step = lambda s, x: ({"w": s["w"] * x, "count": s["count"] + 1}, jnp.sum(s["w"]))
  (state, total) = assert_single_compile(step, state, jnp.float32(2.0), n_steps=4)
  assert int(state["count"]) == 4 and float(total) == 24.0


def test_assert_single_compile_names_the_leaf_that_changes_type():
  state = {"scale": 2.0 ** 15, "count": jnp.zeros((), jnp.int32)}  # a Python float
  step = lambda s: {"scale": s["scale"] * jnp.float32(2), "count": s["count"] + 1}
  with pytest.raises(AssertionError, match=r"\['scale'\]: \(\(\), 'float32', True\) -> "
                                           r"\(\(\), 'float32', False\)"):
    assert_single_compile(step, state)


def test_assert_single_compile_detects_a_recompilation():
  calls = []

  def step(s):
    calls.append(1)
    return s + 1

  jitted = jax.jit(step)
  # A cache that is cleared forces a second compilation with the same types.
  def flaky(s):
    jitted.clear_cache() if len(calls) == 1 else None
    return jitted(s)
  flaky.lower = jitted.lower  # mark as already jitted
  with pytest.raises(AssertionError, match="compiled 1 more time"):
    assert_single_compile(flaky, jnp.zeros((), jnp.int32), n_steps=2)


def test_count_compilations():
  f = jax.jit(lambda x: x + 1)
  x = jnp.ones(2)
  with count_compilations() as compiled:
    f(x)
    f(x)
    f(jnp.ones(3, jnp.int32))
  assert len(compiled) >= 2


# ------------------------------------------------------- a real training run


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(64)(x))
    return nn.Dense(10)(x)


@functools.cache
def _digits():
  data = load_digits()
  x = (data.data / 16.0).astype(np.float32)
  y = data.target.astype(np.int32)
  return x[:1500], y[:1500], x[1500:], y[1500:]


BATCH = 64
CAP = 2.0 ** 10
# Scattered single faults, two in a row, then 50 in a row, then recovery.
POISONED = frozenset({3, 7, 8, 15} | set(range(20, 70)))
N_STEPS = 100


def _reference_scales(n_steps, poisoned, *, scale, period, cap, floor=1.0):
  """Plain Python: the scale used on each step (growth after `period` clean steps)."""
  scales, counter = [], 0
  for step in range(n_steps):
    scales.append(scale)
    if step in poisoned:
      counter = 0
      scale = max(floor, scale / 2)
    else:
      counter += 1
      if counter == period:
        counter = 0
        scale = min(scale * 2, cap)
  return scales


def _all_finite_host(tree):
  return all(np.isfinite(_host(x)).all() for x in jax.tree.leaves(tree)
             if jnp.issubdtype(np.asarray(x).dtype, jnp.floating))


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16, jnp.float16],
                         ids=["f32", "bf16", "f16"])
def test_training_run_skips_exactly_the_poisoned_steps(param_dtype):
  x_train, y_train, x_test, y_test = _digits()
  compute = jnp.bfloat16 if param_dtype == jnp.float32 else param_dtype
  policy = jmp_lite.Policy(param_dtype, compute, jnp.float32)
  model = MLP()
  params = model.init(jax.random.key(0), jnp.zeros((1, 64)))["params"]
  # Momentum and a step-count schedule: optimizer state that must freeze.
  schedule = lambda count: -0.1 / (1.0 + 0.01 * count.astype(jnp.float32))
  tx = optax.chain(optax.trace(decay=0.9), optax.scale_by_schedule(schedule))
  state = jmp_lite.TrainState.create(
      apply_fn=model.apply, params=params, tx=tx, policy=policy, clip_norm=5.0,
      loss_scale=jmp_lite.DynamicLossScale(jnp.float32(CAP), period=3,
                                           max_loss_scale=CAP))
  key = jax.random.key(1)

  @jax.jit
  def train_step(state, x, y, step):
    scale = state.loss_scale

    def loss_fn(params):
      logits = state.apply_fn({"params": policy.cast_to_compute(params)},
                              policy.cast_to_compute(x))
      return optax.softmax_cross_entropy_with_integer_labels(
          policy.cast_to_output(logits), y).mean()

    grads = jax.grad(lambda p: scale.scale(loss_fn(p)))(state.params)
    grads = inject_nonfinite(grads, step, at_steps=sorted(POISONED), value="random",
                             leaves="random", element="random", key=key)
    return state.apply_gradients(grads=grads, scaled=True)

  expected_scales = _reference_scales(N_STEPS, POISONED, scale=CAP, period=3, cap=CAP)
  rng = np.random.default_rng(0)
  with count_compilations() as compiled:
    for step in range(N_STEPS):
      idx = rng.integers(0, len(x_train), BATCH)
      before = state
      assert float(state.loss_scale.loss_scale) == expected_scales[step]
      state = train_step(state, x_train[idx], y_train[idx], step)
      info = state.loss_scale_state
      assert bool(info.skipped) == (step in POISONED), step
      # Nothing non-finite ever reaches the parameters or the optimizer state.
      assert _all_finite_host(state.params) and _all_finite_host(state.opt_state), step
      if step in POISONED:
        # Bitwise frozen: params, the whole inner optimizer state (momentum,
        # schedule count) and the last applied step's gradient norm.
        assert_trees_bitwise_equal(state.params, before.params, f"step {step}")
        assert_trees_bitwise_equal(info.inner_state, before.loss_scale_state.inner_state,
                              f"step {step}")
        assert_trees_bitwise_equal(info.grad_norm, before.loss_scale_state.grad_norm,
                              f"step {step}")
      else:
        with pytest.raises(AssertionError, match="differ bitwise"):
          assert_trees_bitwise_equal(state.params, before.params)  # the step moved them
      chex.assert_trees_all_equal_dtypes(state.params, before.params)
  assert len(compiled) <= 2  # the step once; the first batch's transfer at most
  assert int(state.loss_scale_state.skipped_steps) == len(POISONED)
  assert int(state.step) == N_STEPS
  # The scale went to the floor in the run of 50 and came back to the cap.
  assert min(expected_scales) == 1.0
  assert float(state.loss_scale.loss_scale) == CAP
  # And the model learned: applied steps were real steps.
  logits = model.apply({"params": policy.cast_to_compute(state.params)},
                       policy.cast_to_compute(jnp.asarray(x_test)))
  accuracy = float(jnp.mean(jnp.argmax(logits, -1) == y_test))
  assert accuracy > 0.8, accuracy


# ------------------------------------------- the multi-process harness's API
# What needs no process; tests/test_multihost.py launches processes.


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(target="no/such/worker.py"), FileNotFoundError, "no worker script at"),
    (dict(target="not a module"), TypeError, "path of a .py script or a module name"),
    (dict(target=3), TypeError, "path of a .py script or a module name"),
    (dict(num_processes=0), ValueError, "num_processes must be an int >= 1"),
    (dict(devices_per_process=True), ValueError, "devices_per_process must be an int"),
    (dict(timeout=0), ValueError, "timeout must be a number of seconds > 0"),
    (dict(args="echo"), TypeError, "args must be a sequence of strings"),
    (dict(args=["echo", None]), TypeError, r"got \[None\] in"),
    (dict(env={"A": 1}), TypeError, "env must map strings to strings"),
    (dict(collectives="mpi"), ValueError, "collectives must be one of"),
    (dict(collectives="in_process", num_processes=2), ValueError,
     "collectives='in_process' needs num_processes=1, got 2"),
    (dict(echo=2), ValueError, r"echo must be None or a process index in \[0, 2\), got 2"),
    (dict(echo=True), ValueError, "echo must be None or a process index"),
])
def test_run_processes_rejects_bad_arguments_before_starting_anything(kwargs, error, match):
  kwargs = {"target": "mypkg.worker", **kwargs}
  with pytest.raises(error, match=match):
    jmp_lite.testing.run_processes(**kwargs)


@pytest.mark.parametrize("call", [
    lambda: jmp_lite.testing.initialize_worker(),
    lambda: jmp_lite.testing.report_result({"loss": 1.0}),
])
def test_worker_functions_refuse_to_run_outside_a_worker(call, monkeypatch):
  for name in ("JMP_LITE_NUM_PROCESSES", "JMP_LITE_RESULT_FILE"):
    monkeypatch.delenv(name, raising=False)
  with pytest.raises(RuntimeError, match="started by jmp_lite.testing.run_processes"):
    call()


def test_report_result_writes_json_with_numpy_values_and_non_finite_floats(
    tmp_path, monkeypatch):
  import json
  path = tmp_path / "result.json"
  monkeypatch.setenv("JMP_LITE_RESULT_FILE", str(path))
  jmp_lite.testing.report_result({"first": 1})
  jmp_lite.testing.report_result(
      {"scale": np.float32(2.0) ** 15, "params": np.arange(3, dtype=np.int32),
       "loss": float("nan")})
  out = json.loads(path.read_text())  # the last report wins
  assert out["scale"] == 32768.0 and out["params"] == [0, 1, 2] and np.isnan(out["loss"])
  assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # nothing left aside
  with pytest.raises(TypeError, match="report_result: object is not JSON-serialisable"):
    jmp_lite.testing.report_result({"oops": object()})


# Needs no JAX: the harness starts any script, and this one never joins.
_ECHO_WORKER = """
import os, pathlib, sys, time
me = os.environ["JMP_LITE_PROCESS_ID"]
print(f"out {me}: waiting", flush=True)
print(f"err {me}: \u00e9", file=sys.stderr, flush=True)
go = pathlib.Path(sys.argv[1])
deadline = time.monotonic() + 60
while not go.exists() and time.monotonic() < deadline:
  time.sleep(0.02)
print(f"out {me}: done", flush=True)
"""


def test_run_processes_echoes_one_process_live_and_keeps_its_output(tmp_path, capsys):
  script, go = tmp_path / "worker.py", tmp_path / "go"
  script.write_text(_ECHO_WORKER)
  results = []
  thread = threading.Thread(target=lambda: results.extend(jmp_lite.testing.run_processes(
      script, num_processes=2, args=[go], echo=1, timeout=60)))
  thread.start()
  out, err, deadline = "", "", time.monotonic() + 30

  def read():
    nonlocal out, err
    captured = capsys.readouterr()
    out, err = out + captured.out, err + captured.err

  # Live: process 1's first line arrives while it still waits for "go".
  while "out 1: waiting" not in out and time.monotonic() < deadline:
    read()
    time.sleep(0.02)
  assert "out 1: done" not in out
  go.touch()
  thread.join()
  read()
  assert out == "out 1: waiting\nout 1: done\n"  # process 1 only, in full
  assert err == "err 1: \u00e9\n"
  assert [r.stdout for r in results] == [f"out {i}: waiting\nout {i}: done\n"
                                         for i in (0, 1)]


def test_process_results_are_frozen_and_errors_are_runtime_errors():
  result = jmp_lite.testing.ProcessResult(
      process_id=0, returncode=0, stdout="", stderr="", result={"a": 1})
  with pytest.raises(AttributeError):
    result.returncode = 1  # dataclasses.FrozenInstanceError
  error = jmp_lite.testing.MultiProcessError("boom", [result], timed_out=True)
  assert isinstance(error, RuntimeError)
  assert error.results == (result,) and error.timed_out


@pytest.mark.parametrize("a, b, match", [
    # What value equality would let through.
    ({"w": jnp.array([0.0])}, {"w": jnp.array([-0.0])}, r"\['w'\]: differ bitwise at 1 of 1"),
    ([np.array([np.nan], np.float32)],
     [np.array([np.nan], np.float32).view(np.uint32) + 1],  # another NaN payload...
     r"\[0\]: float32\[1\] vs uint32\[1\]"),             # ...as integers: dtype differs
    ([np.frombuffer(np.array([0x7FC00000], np.uint32).tobytes(), np.float32)],
     [np.frombuffer(np.array([0x7FC00001], np.uint32).tobytes(), np.float32)],
     r"\[0\]: differ bitwise"),
    ({"w": jnp.zeros(2, jnp.bfloat16)}, {"w": jnp.zeros(2, jnp.float16)},
     r"\['w'\]: bfloat16\[2\] vs float16\[2\]"),
    ({"w": jnp.zeros(2)}, {"w": jnp.zeros(3)}, r"float32\[2\] vs float32\[3\]"),
    ({"w": jnp.zeros(2)}, {"v": jnp.zeros(2)}, "tree structures differ"),
    ([jax.random.key(0)], [jax.random.key(1)], r"\[0\]: differ bitwise"),
])
def test_assert_trees_bitwise_equal_catches_what_value_equality_misses(a, b, match):
  with pytest.raises(AssertionError, match=match):
    assert_trees_bitwise_equal(a, b, None)
  assert_trees_bitwise_equal(a, a)
  assert_trees_bitwise_equal(b, b)



def test_bitwise_equal_compares_a_models_own_leaves_that_are_not_arrays():
  """On an Equinox model (its activation function a leaf) the identical
  model raised "Cannot change data-type for array of references"."""
  model = {"act": jax.nn.relu, "name": "mlp", "w": jnp.ones(2)}
  assert_trees_bitwise_equal(model, dict(model))
  with pytest.raises(AssertionError, match=r"\['act'\]: .* vs <function gelu"):
    assert_trees_bitwise_equal(model, {**model, "act": jax.nn.gelu})
