"""Tests of jmp_lite.distributed, and the 8-device checks run in a subprocess.

The checks in ``tests/_multidevice_checks.py`` need 8 simulated CPU devices,
which must be requested before JAX initialises its backend, so they run once,
in a fresh process started with ``XLA_FLAGS``; each of their test functions is
reported here as a test of its own. The rest of this module runs on the
suite's single device.
"""

import ast
import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jmp_lite
from jmp_lite import distributed

CHECKS = pathlib.Path(__file__).with_name("_multidevice_checks.py")


def _check_names():
  tree = ast.parse(CHECKS.read_text())
  return [node.name for node in tree.body
          if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]


@pytest.fixture(scope="module")
def multidevice_results(tmp_path_factory):
  """Runs the 8-device checks once; maps each test function to its outcomes."""
  report = tmp_path_factory.mktemp("multidevice") / "report.xml"
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      " --xla_force_host_platform_device_count=8").strip()
  # The checks need 8 host devices: the CPU, also on a machine with a GPU.
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", str(CHECKS), "-q", "-p", "no:cacheprovider",
       "-n", "0", f"--junitxml={report}", "-o", "junit_family=xunit1"],
      cwd=CHECKS.parent.parent, env=env, capture_output=True, text=True, timeout=600,
      check=False)
  if not report.exists():
    pytest.fail(f"the 8-device run crashed:\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}")
  results = {}
  for case in ET.parse(report).getroot().iter("testcase"):
    name = case.get("name").split("[")[0]
    outcome = "passed"
    for child in case:
      if child.tag in ("failure", "error"):
        outcome = f"{child.tag}: {child.get('message')}\n{child.text or ''}"
      elif child.tag == "skipped":
        xfail = (child.get("type") == "pytest.xfail"
                 or (child.get("message") or "").startswith("xfail"))
        outcome = "xfailed" if xfail else f"skipped: {child.get('message')}"
    results.setdefault(name, []).append((case.get("name"), outcome))
  return results, proc.stdout


@pytest.mark.parametrize("check", _check_names())
def test_on_eight_devices(multidevice_results, check):
  results, stdout = multidevice_results
  assert check in results, f"{check} did not run:\n{stdout[-3000:]}"
  bad = [(name, outcome) for name, outcome in results[check]
         if outcome not in ("passed", "xfailed")]
  assert not bad, "\n\n".join(f"{name}: {outcome}" for name, outcome in bad)


# ------------------------------------------------------------ single device


def _one_device_mesh():
  return jax.make_mesh((1,), ("data",))


def _shard_map(f, in_specs, out_specs, **kwargs):
  return jax.jit(jax.shard_map(f, mesh=_one_device_mesh(), in_specs=in_specs,
                               out_specs=out_specs, **kwargs))


def _put(x, spec):
  return jax.device_put(x, NamedSharding(_one_device_mesh(), spec))


@pytest.mark.parametrize("policy,reduce_dtype,out_dtype", [
    (None, jnp.float32, None),
    ("p=f32,c=bf16,o=f32", jnp.float32, jnp.float32),
    ("p=f32,c=bf16,o=f32,r=bf16", jnp.bfloat16, jnp.float32),
    ("p=bf16,c=bf16,o=bf16", jnp.float32, jnp.bfloat16),
])
def test_reduce_gradients_casts_to_reduce_dtype_and_back(policy, reduce_dtype, out_dtype):
  grads = {"h": jnp.ones(3, jnp.float16), "w": jnp.ones(2, jnp.float32),
           "n": jnp.arange(2, dtype=jnp.int32)}
  seen = {}

  def f(g):
    out = distributed.reduce_gradients(g, "data", policy=policy)
    seen["jaxpr"] = str(jax.make_jaxpr(
        lambda g: distributed.reduce_gradients(g, "data", policy=policy))(g))
    return out

  out = _shard_map(f, P("data"), {"h": P(), "w": P(), "n": P("data")})(
      jax.tree.map(lambda x: _put(x, P("data")), grads))
  name = np.dtype(reduce_dtype).name
  short = {"float32": "f32", "bfloat16": "bf16"}[name]
  # One all-reduce per floating leaf, in the reduce dtype; the int leaf is untouched.
  reductions = [line for line in seen["jaxpr"].splitlines() if "psum" in line]
  assert len(reductions) == 2 and all(f"{short}[" in line for line in reductions), reductions
  assert out["n"].dtype == jnp.int32
  expected = {"h": out_dtype or jnp.float16, "w": out_dtype or jnp.float32}
  assert {k: out[k].dtype for k in expected} == expected
  np.testing.assert_array_equal(np.asarray(out["w"], np.float32), np.ones(2))


def test_reduce_gradients_propagates_non_finite_values():
  g = _put(jnp.array([1.0, jnp.nan, jnp.inf]), P("data"))
  out = _shard_map(lambda g: distributed.reduce_gradients(g, "data"), P("data"), P())(g)
  assert np.isnan(out[1]) and np.isinf(out[2]) and not bool(jmp_lite.all_finite(out))


def test_mark_varying_then_reduce_gradients_is_the_gradient_of_the_mean_loss():
  w = _put(jnp.arange(3.0), P())
  x = _put(jnp.ones((4, 3)), P("data"))

  def step(w, x):
    grads = jax.grad(lambda w: jnp.mean(x @ w ** 2))(distributed.mark_varying(w, "data"))
    return distributed.reduce_gradients(grads, "data")

  out = _shard_map(step, (P(), P("data")), P())(w, x)
  np.testing.assert_allclose(out, jax.grad(lambda w: jnp.mean(x @ w ** 2))(w))


def test_mark_varying_is_a_no_op_without_check_vma():
  def f(w):
    assert distributed.mark_varying(w, "data") is w
    return w
  _shard_map(f, P(), P(), check_vma=False)(_put(jnp.ones(2), P()))


def test_reduce_gradients_rejects_gradients_already_reduced_by_jax():
  w, x = _put({"a": {"b": jnp.ones(3)}}, P()), _put(jnp.ones((2, 3)), P("data"))

  def step(w, x):
    grads = jax.grad(lambda w: jnp.mean(x @ w["a"]["b"]))(w)  # w is replicated
    return distributed.reduce_gradients(grads, "data")

  with pytest.raises(ValueError, match=r"\['a'\]\['b'\].*already reduced.*mark_varying"):
    _shard_map(step, (P(), P("data")), P())(w, x)


def test_is_replicated_everywhere():
  assert distributed.is_replicated_everywhere({"a": jnp.ones(3), "b": 1.0})
  assert distributed.is_replicated_everywhere(jmp_lite.DynamicLossScale(2.0 ** 15))


def test_reduce_gradients_needs_a_mesh_axis():
  with pytest.raises(NameError):
    distributed.reduce_gradients({"w": jnp.ones(2)}, "data")
