"""Tests of jmp_lite.audit (jmp_lite/auditing.py): planted precision mistakes are flagged, one each."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jmp_lite
from jmp_lite import auditing as audit_lib
from jmp_lite.auditing import audit
from jmp_lite.autocasting import autocast

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
B, D, C = 8, 32, 16  # batch, width, classes

PARAMS = {"w1": jax.ShapeDtypeStruct((D, D), jnp.float32),
          "w2": jax.ShapeDtypeStruct((D, C), jnp.float32)}
X = jax.ShapeDtypeStruct((B, D), jnp.float32)


def bad_step(params, x):
  """A mixed-precision forward pass with one of each mistake."""
  # Mistake 0: a bf16 matmul accumulating in bf16.
  h = x.astype(jnp.bfloat16) @ params["w1"].astype(jnp.bfloat16)  # PLANT:half_matmul
  # Mistake 1: a large sum accumulated in bf16.
  norm = lax.reduce_sum(h * h, axes=(1,))                      # PLANT:half_reduction
  # Mistake 2: softmax hand-written in bf16.
  e = jnp.exp(h - jnp.max(h, axis=-1, keepdims=True))          # PLANT:half_exp_log
  p = e / jnp.sum(e.astype(jnp.float32), axis=-1, keepdims=True).astype(e.dtype)
  # Mistake 3: the head's matmul left in float32.
  logits = p.astype(jnp.float32) @ params["w2"]                # PLANT:f32_matmul
  # Mistake 4: a round trip through bf16 on every loop iteration.
  def body(c, _):
    c = c.astype(jnp.bfloat16).astype(jnp.float32)             # PLANT:convert_round_trip
    return jnp.tanh(c), None
  logits, _ = lax.scan(body, logits, None, length=3)
  return jnp.mean(logits) + jnp.mean(norm.astype(jnp.float32))


def all_reduce_step(x):
  # Mistake 5: a gradient all-reduce in bf16.
  return lax.psum(x.astype(jnp.bfloat16), "batch")             # PLANT:half_all_reduce


def planted_lines(fun):
  import inspect  # pylint: disable=import-outside-toplevel
  lines, start = inspect.getsourcelines(fun)
  return {line.split("# PLANT:")[1].strip(): start + i
          for i, line in enumerate(lines) if "# PLANT:" in line}


def test_each_planted_mistake_is_flagged_once_at_its_line():
  report = audit(bad_step, PARAMS, X, policy="p=f32,c=bf16,o=f32")
  planted = planted_lines(bad_step)
  assert {f for row in report.flags for f in row.flags} == set(planted)
  for flag, line in planted.items():
    rows = report.select(flag=flag)
    assert len(rows) == 1, (flag, str(report))
    assert rows[0].source.split(" ")[0].endswith(f"test_auditing.py:{line}"), (
        flag, rows[0].source)
  assert len(report.flags) == len(planted)


def test_half_all_reduce_is_flagged():
  x = jax.ShapeDtypeStruct((B, D), jnp.float32)
  report = audit(all_reduce_step, x, axis_env=[("batch", 4)])
  (row,) = report.flags
  assert row.primitive == "psum" and row.flags == ("half_all_reduce",)
  assert row.category == "collective"
  line = planted_lines(all_reduce_step)["half_all_reduce"]
  assert f"test_auditing.py:{line}" in row.source
  # The same all-reduce in float32, and a bf16 all-gather, are fine.
  fine = audit(lambda x: (lax.psum(x, "batch"),
                          lax.all_gather(x.astype(jnp.bfloat16), "batch")),
               x, axis_env=[("batch", 4)])
  assert fine.flags == () and fine.count(category="collective") == 2


def test_half_all_reduce_inside_shard_map():
  mesh = jax.make_mesh((1,), ("d",))
  step = jax.shard_map(all_reduce_step_d, mesh=mesh,
                       in_specs=jax.P(), out_specs=jax.P())
  report = audit(step, X)
  (row,) = report.flags
  assert row.path == ("shard_map",) and row.flags == ("half_all_reduce",)


def all_reduce_step_d(x):
  return lax.psum(x.astype(jnp.bfloat16), "d")


def clean_loss(params, x):
  """The model of `bad_step`, written plainly (autocast picks the dtypes)."""
  h = jax.nn.gelu(x @ params["w1"])
  h = jax.nn.softmax(h, axis=-1)
  h, _ = lax.scan(lambda c, _: (jnp.tanh(c @ params["w1"]), None), h, None,
                  length=3)
  logits = h @ params["w2"]
  labels = jnp.arange(B) % C
  logp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


def test_clean_step_has_no_flags():
  step = autocast(jax.value_and_grad(clean_loss), "O1")
  report = audit(step, PARAMS, X, policy="O1")
  assert report.flags == (), str(report)
  matmuls = report.count(primitive="dot_general")
  assert matmuls == report.count(primitive="dot_general", operand_dtype=BF16,
                                 accumulation=F32) > 0
  # The same step without autocast runs every matmul in float32: flagged.
  plain = audit(jax.value_and_grad(clean_loss), PARAMS, X, policy="O1")
  assert len(plain.select(flag="f32_matmul")) == matmuls
  # ...which is what an all-f32 policy asks for.
  assert audit(jax.value_and_grad(clean_loss), PARAMS, X,
               policy="O0").flags == ()


def test_audit_never_runs_the_function():
  def explode(x):
    jax.debug.callback(lambda: pytest.fail("audit ran the function"))
    return jnp.exp(x)
  report = audit(jax.jit(explode), jnp.ones((2, 2)))
  assert report.count(primitive="exp") == 1


def test_paths_and_loops():
  def fun(x):
    y = lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.exp(c[1])),
                       (0, x))[1]
    z = lax.cond(jnp.sum(y) > 0, jnp.log, jnp.log1p, y)
    w = jax.checkpoint(lambda v: jnp.exp(v))(z)
    return lax.scan(lambda c, _: (lax.cond(c[0, 0] > 0, jnp.exp, jnp.expm1, c),
                                  None), w, None, length=2)[0]
  report = audit(fun, jax.ShapeDtypeStruct((4, 4), jnp.float32))
  where = {(r.primitive, r.path, r.in_loop) for r in report.rows
           if r.category == "exp_log"}
  assert where == {
      ("exp", ("while.body",), True),
      ("log", ("cond.branch1",), False),
      ("log1p", ("cond.branch0",), False),
      ("exp", ("checkpoint",), False),
      ("exp", ("scan", "cond.branch1"), True),
      ("expm1", ("scan", "cond.branch0"), True),
  }


def test_round_trip_outside_a_loop_is_not_flagged():
  fun = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
  report = audit(fun, jnp.ones((3,)))
  assert report.count(category="convert") == 2 and report.flags == ()


def test_rows_are_frozen_data_and_report_is_queryable():
  report = audit(bad_step, PARAMS, X)
  row = report.select(primitive="dot_general")[0]
  assert row.operand_dtypes == (BF16, BF16)
  assert row.accumulation == BF16 and row.output_dtypes == (BF16,)
  assert row.operand_shapes == ((B, D), (D, D))
  assert row.category == "matmul" and row.path == () and not row.in_loop
  with pytest.raises(dataclasses.FrozenInstanceError):
    row.primitive = "x"
  # No policy: the float32 head matmul is not a mistake.
  assert report.count(flag="f32_matmul") == 0
  assert report.count(primitive="dot_general", operand_dtype=F32) == 1
  assert report.count(primitive=("dot_general", "exp")) == 3
  assert report.select(category="reduction", accumulation=BF16)[0].reduced_size == D
  with pytest.raises(ValueError, match="Unknown flag"):
    report.select(flag="typo")
  summary = report.summary()
  assert summary[("dot_general", "bf16->bf16")] == 1
  assert summary[("dot_general", "f32->f32")] == 1
  assert sum(summary.values()) == len(report.rows)


def test_str_is_a_readable_table():
  text = str(audit(bad_step, PARAMS, X, policy="p=f32,c=bf16,o=f32"))
  lines = text.splitlines()
  assert lines[0].startswith("precision audit (policy p=f32,c=bf16,o=f32):")
  assert "5 flagged" in lines[0]
  assert lines[1].split() == ["#", "primitive", "operands", "acc", "out",
                              "where", "source", "flags"]
  assert any("dot_general" in l and "bf16,bf16" in l for l in lines)
  assert any("scan" in l and "convert_round_trip" in l for l in lines)
  assert "summary:" in lines


def test_policy_accepts_strings_and_policies():
  half = jmp_lite.Policy(F32, F32, F32, autocast_dtype=BF16)
  for policy in ("O1", half, "p=f32,c=bf16,o=f32"):
    assert audit(bad_step, PARAMS, X, policy=policy).count(flag="f32_matmul") == 1
  assert audit(bad_step, PARAMS, X, policy="O0").count(flag="f32_matmul") == 0


def test_flag_names_are_exported():
  assert audit_lib.FLAGS == ("half_matmul", "half_reduction", "half_exp_log",
                             "f32_matmul",
                             "half_all_reduce", "convert_round_trip")


def test_arguments_that_are_not_values_reach_the_function_as_they_are():
  """An Equinox model holds its activation among its leaves, which
  ``make_jaxpr`` refuses (``TypeError: ... is not a valid JAX type``) where
  ``autocast`` and ``value_and_grad`` take it. Oracle: the jaxpr of the same
  function with the activation closed over."""
  def fun(layer, x):
    y = layer["act"](x @ layer["w"].astype(jnp.bfloat16))
    return y * 0.5 if layer["training"] else y  # a Python flag (eqx's Dropout)
  layer = {"w": jnp.ones((4, 3)), "act": jax.nn.relu, "name": "dense", "training": False}
  x = jnp.ones((2, 4), jnp.bfloat16)
  report = audit(fun, layer, x)
  want = audit(lambda w, x: fun({"w": w, "act": jax.nn.relu, "training": False}, x),
               layer["w"], x)
  assert report.rows == want.rows
  assert report.count(primitive="dot_general", operand_dtype=jnp.bfloat16) == 1
