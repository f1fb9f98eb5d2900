"""Tests of jmp_lite.autocast (jmp_lite/autocasting.py): op lists over the jaxpr, asserted through audit.

Tolerances: a bfloat16 matmul rounds its inputs to 8 significant bits
(relative error 2**-9 each); with float32 accumulation, a block's outputs of
magnitude ~1 stay within 5e-2 absolute of float32 (observed ~1e-2), and
gradients within 5e-2 relative to their largest entry.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jmp_lite
from jmp_lite.auditing import audit
from jmp_lite.autocasting import autocast, primitive_name
from jmp_lite.testing import count_compilations
from jaxprs import equations

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)
T, D, H, F = 16, 32, 4, 64  # sequence, model width, heads, MLP width.
ATOL = 5e-2


def layer_norm(x, scale, bias):
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return (x - mean) * lax.rsqrt(var + 1e-5) * scale + bias


def attention(p, x):
  q, k, v = (jnp.reshape(x @ p[n], (T, H, D // H)) for n in ("wq", "wk", "wv"))
  logits = jnp.einsum("thd,shd->hts", q, k) / np.float32(np.sqrt(D // H))
  weights = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("hts,shd->thd", weights, v)
  return jnp.reshape(out, (T, D)) @ p["wo"]


def block(p, x):
  """A pre-norm transformer block in plain jax.numpy, x: [T, D]."""
  x = x + attention(p, layer_norm(x, p["ln1_scale"], p["ln1_bias"]))
  h = layer_norm(x, p["ln2_scale"], p["ln2_bias"]) @ p["w1"] + p["b1"]
  return x + jax.nn.gelu(h) @ p["w2"] + p["b2"]


def init_block(seed, layers=()):
  """Parameters from NumPy (nothing to compile), stacked if ``layers``."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(
      rng.standard_normal((*layers, *shape)) / np.sqrt(shape[0]), jnp.float32)
  ones = lambda n: jnp.ones((*layers, n))
  zeros = lambda n: jnp.zeros((*layers, n))
  return {
      "wq": normal(D, D), "wk": normal(D, D), "wv": normal(D, D),
      "wo": normal(D, D), "w1": normal(D, F), "b1": zeros(F),
      "w2": normal(F, D), "b2": zeros(D),
      "ln1_scale": ones(D), "ln1_bias": zeros(D),
      "ln2_scale": ones(D), "ln2_bias": zeros(D),
  }


@pytest.fixture(scope="module")
def params():
  return init_block(0)


@pytest.fixture(scope="module")
def x():
  return jnp.asarray(np.random.default_rng(1).standard_normal((T, D)),
                     jnp.float32)




def loss(p, x):
  return jnp.mean(jnp.square(block(p, x)))


# float32 references, compiled once per module.
ref_block = jax.jit(block)
ref_loss = jax.jit(loss)
ref_grad = jax.jit(jax.grad(loss))


def assert_all_matmuls_bf16_f32(report):
  matmuls = report.count(primitive="dot_general")
  assert matmuls > 0
  assert report.count(primitive="dot_general", operand_dtype=BF16,
                      accumulation=F32) == matmuls, str(report)


def test_transformer_block_matmuls_bf16_softmax_and_norm_f32(params, x):
  report = audit(autocast(block, jnp.bfloat16), params, x, policy="O1")
  assert report.count(primitive="dot_general") == 8  # q k v, 2 einsums, o, 2 MLP
  assert_all_matmuls_bf16_f32(report)
  # Softmax (max, exp, sum) and normalisation (mean, variance, rsqrt) in f32.
  for prim in ("exp", "rsqrt", "reduce_max", "reduce_sum"):
    assert report.count(primitive=prim) > 0, prim
    assert report.count(primitive=prim, operand_dtype=F32,
                        output_dtype=F32) == report.count(primitive=prim), prim
  assert report.flags == (), str(report)


def test_transformer_block_close_to_f32(params, x):
  want = ref_block(params, x)
  got = jax.jit(autocast(block, jnp.bfloat16))(params, x)
  assert got.dtype == F32
  np.testing.assert_allclose(got, want, atol=ATOL)
  # bf16 really was used: the result is not bit-identical to float32.
  assert not np.array_equal(got, want)


def test_without_autocast_matmuls_are_f32(params, x):
  report = audit(block, params, x, policy="O1")
  assert report.count(primitive="dot_general", operand_dtype=F32) == 8
  assert len(report.select(flag="f32_matmul")) == 8


@pytest.mark.parametrize("policy, dtype", [
    (jnp.bfloat16, BF16), (jnp.float16, F16), ("bf16", BF16),
    ("O1", BF16), ("O1-f16", F16), ("p=f32,c=f16,o=f32", F16),
    (jmp_lite.Policy(F32, F32, F32, autocast_dtype=F16), F16),
    (jmp_lite.Policy(F32, BF16, F32), BF16),
])
def test_compute_dtype_from_policy_or_dtype(params, x, policy, dtype):
  report = audit(autocast(block, policy), params, x)
  assert report.count(primitive="dot_general", operand_dtype=dtype,
                      accumulation=F32) == 8


def test_output_dtypes_are_those_of_fun():
  def fun(a, b, n):
    return {"f32": a @ a, "bf16": b * 2, "int": n + 1, "scalar": jnp.sum(a)}
  args = (jnp.ones((4, 4)), jnp.ones((3,), jnp.bfloat16), jnp.arange(3))
  want = jax.tree.map(lambda s: (s.shape, s.dtype), jax.eval_shape(fun, *args))
  got = jax.tree.map(lambda s: (s.shape, s.dtype),
                     jax.eval_shape(autocast(fun, jnp.bfloat16), *args))
  assert got == want


def test_outputs_that_are_not_arrays_are_returned_as_they_are():
  """Arguments that are not arrays (an Equinox model's activation functions)
  were taken, but outputs were all handed to ``make_jaxpr``: a step returning
  the updated Equinox model raised ``TypeError: ... returned a value of type
  custom_jvp``. The oracle is the function itself: the same objects, and
  its arrays."""
  def fun(w, x, act):
    return {"y": act(x @ w), "act": act, "tag": "layer", "n": x.shape[0], "none": None}
  g = autocast(fun, jnp.bfloat16)
  for rows in (2, 3, 2):  # eagerly, a cached trace's outputs follow the shapes
    w, x = jnp.ones((4, 3)), jnp.ones((rows, 4))
    got, want = g(w, x, jax.nn.relu), fun(w, x, jax.nn.relu)
    assert got["act"] is jax.nn.relu and got["tag"] == "layer" and got["none"] is None
    assert got["n"] == rows and isinstance(got["n"], int)
    assert got["y"].dtype == want["y"].dtype == jnp.float32
    np.testing.assert_array_equal(got["y"], want["y"])

  @jax.jit
  def traced(w, x):  # inside a trace (Equinox's filter_jit returns the rest)
    out = g(w, x, jax.nn.relu)
    assert out["act"] is jax.nn.relu and out["n"] == 2
    return out["y"]
  np.testing.assert_array_equal(traced(w, x), want["y"])


def test_kwargs_and_python_scalars():
  fun = lambda x, *, scale: jnp.exp(x @ x) * scale
  x = jnp.eye(3) * 0.5
  np.testing.assert_allclose(autocast(fun, jnp.bfloat16)(x, scale=2.0),
                             fun(x, scale=2.0), rtol=1e-2)


def test_grad_of_autocast(params, x):
  want = ref_grad(params, x)
  got = jax.jit(jax.grad(autocast(loss, jnp.bfloat16)))(params, x)
  for path, g, w in zip(jax.tree_util.tree_leaves_with_path(got),
                        jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == F32, path
    np.testing.assert_allclose(g, w, atol=ATOL * float(jnp.max(jnp.abs(w))),
                               err_msg=str(path[0]))


def test_autocast_of_grad_runs_backward_matmuls_in_bf16(params, x):
  step = autocast(jax.value_and_grad(loss), jnp.bfloat16)
  report = audit(step, params, x, policy="O1")
  assert report.count(primitive="dot_general") == 24  # 8 forward, 16 backward
  assert_all_matmuls_bf16_f32(report)
  assert report.flags == (), str(report)
  (value, grads), want_value, want_grads = (
      jax.jit(step)(params, x), ref_loss(params, x), ref_grad(params, x))
  np.testing.assert_allclose(value, want_value, rtol=ATOL)
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(g, w, atol=ATOL * float(jnp.max(jnp.abs(w))))


def test_grad_of_autocast_is_as_good_as_autocast_of_grad(params, x):
  # The engine's primitive differentiates into half x half -> f32 products, so
  # differentiating outside autocast loses nothing: the same 8 forward and 16
  # backward matmuls as autocast(value_and_grad), none in float32.
  outside = audit(jax.grad(autocast(loss, jnp.bfloat16)), params, x,
                  policy="O1")
  inside = audit(autocast(jax.grad(loss), jnp.bfloat16), params, x,
                 policy="O1")
  for report in (outside, inside):
    assert report.count(primitive="dot_general") == 24, str(report)
    assert_all_matmuls_bf16_f32(report)
    assert report.count(flag="f32_matmul") == 0
    assert report.count(flag="half_matmul") == 0


@pytest.mark.parametrize("order", ["vmap_of_autocast", "autocast_of_vmap"])
def test_vmap(params, x, order):
  xs = jnp.stack([x, -x, 2 * x])
  batched = jax.vmap(block, in_axes=(None, 0))
  if order == "vmap_of_autocast":
    fun = jax.vmap(autocast(block, jnp.bfloat16), in_axes=(None, 0))
  else:
    fun = autocast(batched, jnp.bfloat16)
  got = jax.jit(fun)(params, xs)
  np.testing.assert_allclose(got, jax.jit(batched)(params, xs), atol=2 * ATOL)
  assert_all_matmuls_bf16_f32(audit(fun, params, xs))


def small_loss(w, x):
  return jnp.mean(jax.nn.softmax(x @ w) * jnp.arange(4.0))


def test_vmap_of_grad_of_autocast():
  w = jnp.asarray(np.random.default_rng(5).standard_normal((8, 4)), jnp.float32)
  xs = jnp.asarray(np.random.default_rng(6).standard_normal((3, 2, 8)),
                   jnp.float32)
  per_example = jax.jit(jax.vmap(jax.grad(autocast(small_loss, jnp.bfloat16)),
                                 in_axes=(None, 0)))(w, xs)
  want = jax.vmap(jax.grad(small_loss), in_axes=(None, 0))(w, xs)
  assert per_example.shape == (3, 8, 4) and per_example.dtype == F32
  np.testing.assert_allclose(per_example, want,
                             atol=ATOL * float(jnp.max(jnp.abs(want))))


def test_jit_in_either_order_compiles_once(params, x):
  jitted = jax.jit(autocast(block, jnp.bfloat16))
  with count_compilations() as compiled:
    for _ in range(3):
      jitted(params, x)
  assert len(compiled) == 1
  inner = autocast(jax.jit(block), jnp.bfloat16)
  np.testing.assert_allclose(jax.jit(inner)(params, x), ref_block(params, x),
                             atol=ATOL)
  assert_all_matmuls_bf16_f32(audit(inner, params, x))


def scan_model(stacked, x):
  y, norms = lax.scan(lambda h, p: (block(p, h), jnp.sum(jnp.square(h))),
                      x, stacked)
  return jnp.mean(jnp.square(y)) + jnp.mean(norms) * 1e-3


def test_scan_over_layers(x):
  stacked = init_block(2, layers=(2,))
  fast = autocast(scan_model, jnp.bfloat16)
  report = audit(fast, stacked, x, policy="O1")
  in_scan = report.select(primitive="dot_general", in_loop=True)
  assert len(in_scan) == 8 and all(r.path == ("scan",) for r in in_scan)
  assert_all_matmuls_bf16_f32(report)
  assert report.flags == (), str(report)
  np.testing.assert_allclose(jax.jit(fast)(stacked, x),
                             jax.jit(scan_model)(stacked, x), rtol=ATOL)


def test_grad_through_scan_over_layers(x):
  def mlp_stack(ws, x):
    return jnp.mean(lax.scan(lambda h, w: (jax.nn.gelu(h @ w), None), x, ws)[0])
  ws = init_block(3, layers=(3,))["wq"]
  want = jax.jit(jax.grad(mlp_stack))(ws, x)
  got = jax.jit(jax.grad(autocast(mlp_stack, jnp.bfloat16)))(ws, x)
  assert got.dtype == F32
  np.testing.assert_allclose(got, want,
                             atol=ATOL * float(jnp.max(jnp.abs(want))))


@jax.custom_vjp
def clipped_matmul(x, w):
  return x @ w


def _clipped_matmul_fwd(x, w):
  return x @ w, (x, w)


def _clipped_matmul_bwd(res, ct):
  x, w = res
  # A deliberately non-standard rule (gradient clipped to [-0.01, 0.01]), so
  # the test can tell it from autodiff.
  ct = jnp.clip(ct, -0.01, 0.01)
  return ct @ w.T, x.T @ ct


clipped_matmul.defvjp(_clipped_matmul_fwd, _clipped_matmul_bwd)


@jax.custom_jvp
def doubled_slope_tanh(x):
  return jnp.tanh(x)


@doubled_slope_tanh.defjvp
def _doubled_slope_tanh_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  return jnp.tanh(x), 2.0 * t


def test_custom_vjp_inside_keeps_its_rule():
  def fun(x, w):
    return jnp.sum(jnp.exp(clipped_matmul(x, w)))
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 16))
  w = jax.random.normal(jax.random.PRNGKey(1), (16, 4))
  fast = autocast(fun, jnp.bfloat16)
  report = audit(fast, x, w)
  assert report.select(primitive="dot_general")[0].path == ("custom_vjp",)
  assert_all_matmuls_bf16_f32(report)
  # The custom rule (clipping) is what differentiates it, in either order.
  want = jax.jit(jax.grad(fun, argnums=1))(x, w)
  for grad_fn in (jax.grad(fast, argnums=1),
                  autocast(jax.grad(fun, argnums=1), jnp.bfloat16)):
    got = jax.jit(grad_fn)(x, w)
    np.testing.assert_allclose(got, want, atol=ATOL * 0.01 * 8)
  assert float(jnp.max(jnp.abs(want))) <= 0.01 * 8 + 1e-6
  # The forward of the rule is autocast too when differentiated.
  grad_report = audit(jax.grad(fast, argnums=1), x, w)
  assert grad_report.count(primitive="dot_general", operand_dtype=BF16) >= 1


def test_custom_jvp_inside_keeps_its_rule():
  def fun(x, w):
    return jnp.sum(doubled_slope_tanh(x @ w))
  x, w = jnp.full((2, 3), 0.1), jnp.full((3, 2), 0.2)
  fast = autocast(fun, jnp.bfloat16)
  assert_all_matmuls_bf16_f32(audit(fast, x, w))
  np.testing.assert_allclose(jax.grad(fast, argnums=1)(x, w),
                             jnp.full((3, 2), 2 * 0.2), rtol=1e-2)
  _, tangent = jax.jvp(fast, (x, w), (jnp.zeros_like(x), jnp.ones_like(w)))
  np.testing.assert_allclose(tangent, 2 * 0.3 * 4, rtol=1e-2)


def test_while_cond_and_checkpoint(params, x):
  def fun(p, x):
    h = lax.while_loop(lambda c: c[0] < 2,
                       lambda c: (c[0] + 1, jnp.tanh(c[1] @ p["wq"])), (0, x))[1]
    h = lax.cond(jnp.sum(h) > 0, lambda h: h @ p["wk"], lambda h: -h, h)
    return jax.checkpoint(lambda h: jax.nn.softmax(h @ p["wv"]))(h)
  fast = autocast(fun, jnp.bfloat16)
  report = audit(fast, params, x)
  paths = {r.path for r in report.select(primitive="dot_general")}
  assert paths == {("while.body",), ("cond.branch1",), ("checkpoint",)}
  assert_all_matmuls_bf16_f32(report)
  assert report.select(primitive="exp")[0].output_dtypes == (F32,)
  np.testing.assert_allclose(jax.jit(fast)(params, x),
                             jax.jit(fun)(params, x), atol=1e-2)
  grad = jax.grad(lambda p: jnp.sum(autocast(
      lambda p, x: jax.checkpoint(lambda h: jnp.tanh(h @ p["wv"]))(x),
      jnp.bfloat16)(p, x)))(params)
  assert grad["wv"].dtype == F32


def test_custom_white_and_black_lists():
  def fun(x, w):
    return jnp.tanh(x @ w) + jnp.exp(x @ w)
  x, w = jnp.ones((4, 8)), jnp.ones((8, 4)) * 0.1
  default = audit(autocast(fun, jnp.bfloat16), x, w)
  assert default.select(primitive="exp")[0].output_dtypes == (F32,)
  # Paddle semantics: naming exp in the white list takes it off the black list.
  custom = audit(autocast(fun, jnp.bfloat16, white_list=[lax.exp]), x, w)
  assert custom.select(primitive="exp")[0].output_dtypes == (BF16,)
  # And a black-listed matmul runs in float32.
  black = audit(autocast(fun, jnp.bfloat16, black_list=["dot_general"]), x, w)
  assert black.count(primitive="dot_general", operand_dtype=F32) == 2
  tanh_white = jax.make_jaxpr(autocast(fun, jnp.bfloat16,
                                       white_list=["tanh"]))(x, w)
  tanh_eqn = next(e for e in tanh_white.eqns if e.primitive.name == "tanh")
  assert tanh_eqn.outvars[0].aval.dtype == BF16


def test_lists_accept_names_primitives_and_lax_functions():
  assert primitive_name("exp") == "exp"
  assert primitive_name(lax.exp) == "exp"
  assert primitive_name(lax.dot_general) == "dot_general"
  assert primitive_name(lax.conv) == "conv_general_dilated"
  assert primitive_name(lax.reduce_sum) == "reduce_sum"
  assert primitive_name(lax.cumsum) == "cumsum"
  assert primitive_name(jax.extend.core.primitives.logistic_p) == "logistic"


@pytest.mark.parametrize("bad, match", [
    ("expp", "close matches: .*'exp'"),
    (jnp.sum, "Cannot map"),
    (lambda x: x, "Cannot map"),
])
def test_bad_list_entries_are_rejected(bad, match):
  with pytest.raises(ValueError, match=match):
    autocast(jnp.sin, jnp.bfloat16, white_list=[bad])


def test_op_in_both_lists_is_rejected():
  with pytest.raises(ValueError, match="both"):
    autocast(jnp.sin, jnp.bfloat16, white_list=["exp"], black_list=[lax.exp])


def test_non_floating_dtype_is_rejected():
  with pytest.raises(ValueError, match="floating"):
    autocast(jnp.sin, jnp.int8)


def test_small_reductions_follow_large_ones_are_f32():
  def fun(a):
    h = a @ a  # bf16 (nominally) under autocast.
    return lax.reduce_sum(h, axes=(0,)), lax.reduce_sum(h[:4], axes=(0,))
  a = jnp.ones((32, 32))
  report = audit(autocast(fun, jnp.bfloat16), a)
  sums = report.select(primitive="reduce_sum")
  assert [(r.reduced_size, r.accumulation) for r in sums] == [(32, F32),
                                                             (4, BF16)]
  report = audit(autocast(fun, jnp.bfloat16, min_reduction_size=2), a)
  assert report.count(primitive="reduce_sum", accumulation=F32) == 2


def test_scalars_do_not_upcast_half_precision():
  fun = lambda a: (a @ a) * 2.0 + jnp.float32(1.0)
  jaxpr = jax.make_jaxpr(autocast(fun, jnp.bfloat16))(jnp.ones((4, 4)))
  mul = next(e for e in jaxpr.eqns if e.primitive.name == "mul")
  assert mul.outvars[0].aval.dtype == BF16


def test_bias_add_uses_the_f32_accumulator_without_round_trip():
  fun = lambda x, w, b: x @ w + b
  jaxpr = jax.make_jaxpr(autocast(fun, jnp.bfloat16))(
      jnp.ones((2, 4)), jnp.ones((4, 3)), jnp.ones((3,)))
  converts = [e for e in jaxpr.eqns if e.primitive.name == "convert_element_type"]
  assert [e.params["new_dtype"] for e in converts] == [BF16, BF16]
  add = next(e for e in jaxpr.eqns if e.primitive.name == "add")
  assert add.outvars[0].aval.dtype == F32


def test_integer_and_fp8_matmuls_are_left_alone():
  def fun(i, f8, w8):
    return i @ i, lax.dot_general(f8, w8, (((1,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32)
  args = (jnp.ones((2, 2), jnp.int32), jnp.ones((2, 2), jnp.float8_e4m3fn),
          jnp.ones((2, 2), jnp.float8_e4m3fn))
  report = audit(autocast(fun, jnp.bfloat16), *args)
  assert [r.operand_dtypes for r in report.select(primitive="dot_general")] == [
      (np.dtype(jnp.int32),) * 2, (np.dtype(jnp.float8_e4m3fn),) * 2]


def test_bf16_inputs_get_f32_exp_and_bf16_outputs():
  fun = lambda x: jax.nn.softmax(x, axis=-1)
  x = jnp.linspace(-3, 3, 64, dtype=jnp.bfloat16).reshape(2, 32)
  fast = autocast(fun, jnp.bfloat16)
  assert fast(x).dtype == BF16
  assert audit(fast, x).select(primitive="exp")[0].operand_dtypes == (F32,)
  np.testing.assert_allclose(fast(x).astype(F32),
                             jax.nn.softmax(x.astype(F32)), atol=4e-3)


def test_functools_wraps_keeps_name():
  assert autocast(block, jnp.bfloat16).__name__ == "block"
  assert autocast(functools.partial(block), jnp.bfloat16) is not None


def test_convolution_is_white_listed():
  def conv(x, k):
    return jnp.mean(jax.nn.relu(lax.conv(x, k, (1, 1), "SAME")))
  x, k = jnp.ones((2, 3, 8, 8)), jnp.ones((4, 3, 3, 3)) * 0.1
  report = audit(autocast(conv, jnp.bfloat16), x, k)
  (row,) = report.select(category="conv")
  assert row.operand_dtypes == (BF16, BF16) and row.accumulation == F32
  np.testing.assert_allclose(autocast(conv, jnp.bfloat16)(x, k), conv(x, k),
                             rtol=1e-2)


LINALG = {
    "inv": (lambda a: jnp.linalg.inv(a), {"lu", "triangular_solve"}),
    "rfft": (lambda a: jnp.abs(jnp.fft.rfft(a)), {"fft"}),
    "qr": (lambda a: jnp.linalg.qr(a)[1], {"qr", "householder_product"}),
    "svd": (lambda a: jnp.linalg.svd(a, compute_uv=False), {"svd"}),
    "eigh": (lambda a: jnp.linalg.eigh(a @ a.T)[0], {"eigh"}),
    "cholesky": (lambda a: jnp.linalg.cholesky(a @ a.T + 8 * jnp.eye(8)), {"cholesky"}),
}


@pytest.mark.parametrize("name", LINALG)
def test_linear_algebra_and_ffts_on_a_matmul_run_in_float32(name):
  """A matmul's bf16 result fed to linalg or an FFT (no half kernels: XLA
  refused to compile it) is upcast, as torch's CPU autocast keeps linalg_*
  and fft_* in float32. Oracle: the float32 function."""
  op, prims = LINALG[name]
  fun = lambda x, w: op(x @ w)  # pylint: disable=unnecessary-lambda-assignment
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(8, 8)), jnp.float32)
  w = jnp.eye(8, dtype=jnp.float32) + 0.01 * jnp.asarray(rng.normal(size=(8, 8)), jnp.float32)
  out = jax.jit(autocast(fun, jnp.bfloat16))(x, w)
  np.testing.assert_allclose(out, fun(x, w), rtol=0.1, atol=0.1 * float(jnp.abs(fun(x, w)).max()))
  closed = jax.make_jaxpr(autocast(fun, jnp.bfloat16))(x, w)
  found = {e.primitive.name: e for e in equations(closed.jaxpr) if e.primitive.name in prims}
  assert found, sorted({e.primitive.name for e in equations(closed.jaxpr)})
  for eqn in found.values():
    assert all(v.aval.dtype in (F32, jnp.complex64) for v in eqn.invars
               if jnp.issubdtype(v.aval.dtype, jnp.inexact)), eqn
  # The matmuls themselves (x @ w, and a @ a.T where there is one) in bf16.
  assert audit(autocast(fun, jnp.bfloat16), x, w).count(
      primitive="dot_general", operand_dtype="bf16", accumulation="f32") == audit(
          fun, x, w).count(primitive="dot_general")


def _matmul_input():
  rng = np.random.default_rng(1)
  return (jnp.asarray(rng.normal(size=(4, 6)), jnp.float32),
          jnp.asarray(rng.normal(size=(6, 8)) / 4, jnp.float32))


@pytest.mark.usefixtures("standard_promotion")  # x + 1j
@pytest.mark.parametrize("name", ["complex_times_real", "lax_complex", "conj"])
def test_complex_values_keep_their_parts(name):
  """A complex x real matmul lost its imaginary part (the real operand went
  to bf16, the product to a float32 output); ``lax.complex`` and ``conj`` of
  a matmul's bf16 result were refused by JAX. Oracle: the float32 function."""
  fun = {"complex_times_real": lambda x, w: (x + 1j) @ w,
         "lax_complex": lambda x, w: lax.complex(x @ w, 2 * (x @ w)) * 1j,
         "conj": lambda x, w: lax.conj(x @ w)}[name]
  x, w = _matmul_input()
  ref = fun(x, w)
  for dtype in (jnp.bfloat16, jnp.float16):
    out = jax.jit(autocast(fun, dtype))(x, w)
    assert out.dtype == ref.dtype
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2 * float(jnp.abs(ref).max()))


def test_a_float_times_int8_matmul_keeps_its_dtypes_and_gradient():
  """The int8 operand's dtype was the cotangent's in the backward product:
  the gradient came back truncated to integers. Oracle: jax.grad of the
  float32 function, bit for bit (the product runs as written)."""
  y = jnp.asarray(np.random.default_rng(0).normal(size=(4, 8)), jnp.float32)
  q = jnp.asarray(np.random.default_rng(1).integers(-3, 4, (3, 8)), jnp.int8)
  f = lambda y: jnp.sum(lax.dot_general(y, q, (((1,), (1,)), ((), ()))) ** 2)  # pylint: disable=unnecessary-lambda-assignment
  np.testing.assert_array_equal(jax.grad(autocast(f, jnp.bfloat16))(y), jax.grad(f)(y))


def test_a_large_pooling_window_sums_in_float32():
  """``reduce_window_sum`` over a 64 x 16 window (a global average pool)
  summed in bf16 and gave 512 for 1024 ones; small windows stay in their
  dtype, as small reductions do."""
  x, w = jnp.ones((64, 8), jnp.float32), jnp.eye(8, 16, dtype=jnp.float32) + 1
  pool = lambda x, w, window: lax.reduce_window(  # pylint: disable=unnecessary-lambda-assignment
      (x @ w) / 9, 0.0, lax.add, window, (1, 1), "VALID")
  big = jax.jit(autocast(lambda x, w: pool(x, w, (64, 16)), jnp.bfloat16))(x, w)
  # Each term is a bf16 quotient (8/9 rounds to 0.890625: the sum is 968)
  # or, where XLA:CPU keeps the quotient in float32, the float32 one
  # (967.11); a bf16 sum stalls near 512.
  np.testing.assert_allclose(big, pool(x, w, (64, 16)), rtol=2.0 ** -8)
  report = audit(autocast(lambda x, w: pool(x, w, (2, 2)), jnp.bfloat16), x, w)
  assert not report.count(primitive="reduce_window_sum", operand_dtype="f32")


def test_gamma_sampling_runs_in_float32():
  """Gamma, beta and Dirichlet draws on a matmul's bf16 result ran their
  rejection sampling in bf16. Oracle: the float32 function on the same
  (bf16-rounded) concentrations and key, draw for draw."""
  x, w = _matmul_input()
  key = jax.random.key(0)
  draw = lambda a: jax.random.gamma(key, a)  # pylint: disable=unnecessary-lambda-assignment
  out = jax.jit(autocast(lambda x, w: draw(jnp.exp(x @ w) + 0.5), jnp.bfloat16))(x, w)
  alpha = jnp.exp((x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32)) + 0.5
  np.testing.assert_allclose(out, draw(alpha), rtol=2e-2)
  assert out.dtype == jnp.float32


@pytest.mark.usefixtures("standard_promotion")  # x / True
def test_python_numbers_of_equal_value_are_different_arguments():
  """1 and 1.0 (and 0.0 and -0.0) are equal dictionary keys: the second call
  ran the first one's trace (an int32 result for a float, inf for -inf)."""
  f = lambda x, s: (x @ x.T / s, jnp.asarray(s) * 3)  # pylint: disable=unnecessary-lambda-assignment
  x = jnp.ones((2, 2))
  g = autocast(f, jnp.bfloat16)
  for s in (1, 1.0, True, 0.0, -0.0):
    got, want = g(x, s), f(x, s)
    assert [a.dtype for a in got] == [a.dtype for a in want], s
    np.testing.assert_array_equal(got[0], want[0])


def test_expm_of_a_matmul_keeps_its_highest_precision_products():
  """``jax.scipy.linalg.expm`` asks for ``Precision.HIGHEST`` products; run in
  float16 they overflowed (the gradient came back NaN) and in bfloat16 the
  result was 43% off. A product that asks for full precision runs at its
  traced dtypes. Oracle: jax.grad of the float32 function."""
  a = jnp.ones((8, 8), jnp.float32) * 0.1 + jnp.eye(8)
  b = jnp.eye(8, dtype=jnp.float32) * 2 + 0.1
  f = lambda a, b: jnp.sum(jax.scipy.linalg.expm(a @ b))  # pylint: disable=unnecessary-lambda-assignment
  ref = jax.grad(f)(a, b)
  for dtype, short in ((jnp.bfloat16, "bf16"), (jnp.float16, "f16")):
    got = jax.jit(jax.grad(autocast(f, dtype)))(a, b)
    np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2 * float(jnp.abs(ref).max()))
    # a @ b itself still runs in half.
    assert audit(autocast(f, dtype), a, b).count(
        primitive="dot_general", operand_dtype=short) == 1


@pytest.mark.parametrize("precision, operands", [
    (None, BF16), (lax.Precision.DEFAULT, BF16), (lax.Precision.HIGHEST, F32),
    ((lax.Precision.DEFAULT, lax.Precision.HIGH), F32),
    (lax.DotAlgorithmPreset.F32_F32_F32, F32), (lax.DotAlgorithmPreset.BF16_BF16_F32, BF16),
    (lax.DotAlgorithmPreset.F16_F16_F32, F32)])
def test_a_matmul_that_asks_for_precision_runs_as_written(precision, operands):
  """What the author asked for with ``precision=`` is kept: HIGH/HIGHEST and
  presets whose operands cannot be bfloat16 leave the product at its traced
  (float32) dtypes; the default, and a bf16 preset, run in bf16."""
  x, w = _matmul_input()
  f = lambda x, w: jnp.tanh(jnp.dot(x, w, precision=precision))  # pylint: disable=unnecessary-lambda-assignment
  closed = jax.make_jaxpr(autocast(f, jnp.bfloat16))(x, w)
  dots = [e for e in equations(closed.jaxpr) if "dot_general" in e.primitive.name]
  assert dots and all(v.aval.dtype == operands for e in dots for v in e.invars), dots


@pytest.mark.parametrize("square", [lambda y: y ** 2, jnp.square, lambda y: y ** 3])
def test_powers_of_a_float16_matmul_run_in_float32(square):
  """``(x @ w) ** 2`` (a squared error) in float16 overflowed to inf from
  |x @ w| = 256; torch.autocast runs ``pow`` in float32, and so do
  ``integer_pow`` and ``square`` here. Oracle: the float32 function."""
  x = jnp.full((4, 8), 100.0, jnp.float32)  # x @ w - 1 = 299
  w = jnp.eye(8, dtype=jnp.float32) + 0.25
  f = lambda x, w: jnp.mean(square(x @ w - 1.0))  # pylint: disable=unnecessary-lambda-assignment
  got = jax.jit(autocast(f, jnp.float16))(x, w)
  np.testing.assert_allclose(got, f(x, w), rtol=2e-3)
  g = jax.jit(jax.grad(autocast(f, jnp.float16)))(x, w)
  np.testing.assert_allclose(g, jax.grad(f)(x, w), rtol=2e-2)


def test_solve_on_bf16_operands_runs():
  """``custom_linear_solve`` keeps its jaxprs in a named tuple, which the
  engine rebuilt from a list (TypeError: missing 'vecmat', 'solve' and
  'transpose_solve'). Oracle: float32 ``jnp.linalg.solve`` of the same
  bf16-rounded operands, to bf16's rounding."""
  rng = np.random.default_rng(0)
  a = jnp.asarray(rng.normal(size=(6, 6)) + 4 * np.eye(6), jnp.bfloat16)
  b = jnp.asarray(rng.normal(size=(6,)), jnp.bfloat16)
  try:
    jax.make_jaxpr(jnp.linalg.solve)(a, b)
  except TypeError as e:  # JAX 0.11's lu: "lu does not accept dtype bfloat16"
    pytest.skip(f"this JAX refuses the function itself at trace time: {e}")
  got = autocast(jnp.linalg.solve, jnp.bfloat16)(a, b)
  want = jnp.linalg.solve(a.astype(jnp.float32), b.astype(jnp.float32))
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(got.astype(jnp.float32), want, rtol=0, atol=2e-2)


@pytest.mark.usefixtures("standard_promotion")  # bf16 x float32 scalar
def test_numpy_scalars_of_equal_value_are_different_arguments():
  """np.int32(2) == np.float32(2) and np.float32(0.0) == np.float32(-0.0):
  as cache keys, the second call ran the first one's trace (bf16 for a
  float32 product, inf for -inf). Oracle: the function itself."""
  x = jnp.ones((4,), jnp.bfloat16)
  f = lambda x, s: (x * s, jnp.ones(2) / s)  # pylint: disable=unnecessary-lambda-assignment
  g = autocast(f, jnp.bfloat16)
  for s in (np.int32(2), np.float32(2), np.float32(0.0), np.float32(-0.0)):
    got, want = g(x, s), f(x, s)
    assert [a.dtype for a in got] == [a.dtype for a in want], s
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("form", ["plain", "transposed", "vmap", "reshaped"])
def test_a_moved_product_reaches_a_float32_consumer_unrounded(form):
  """A transpose or reshape between a matmul and its bias add rounded the
  float32 accumulator to bf16 and back (error 3e-2 instead of 5e-7), though
  autocast hands the accumulator to float32 consumers as it is. Oracle:
  float64 products of the bf16-rounded operands."""
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  w, x = jax.random.normal(k1, (16, 8)), jax.random.normal(k2, (32, 8))
  b = jax.random.normal(k3, (16,)) * 0.01
  f = {"plain": lambda w, b, x: x @ w.T + b,
       "transposed": lambda w, b, x: (w @ x.T).T + b,
       "vmap": lambda w, b, x: jax.vmap(lambda v: w @ v + b)(x),  # an Equinox Linear
       "reshaped": lambda w, b, x: (x @ w.T).reshape(32, 4, 4).reshape(32, 16) + b}[form]
  rounded = lambda a: np.asarray(a.astype(jnp.bfloat16), np.float64)  # pylint: disable=unnecessary-lambda-assignment
  want = rounded(x) @ rounded(w).T + np.asarray(b, np.float64)
  got = np.asarray(jax.jit(autocast(f, jnp.bfloat16))(w, b, x), np.float64)
  assert np.max(np.abs(got - want)) < 1e-5


def test_weight_gradients_of_autocast_grad_are_not_rounded_to_half():
  """``autocast(jax.grad(f))``: JAX computes a weight gradient as ``(g.T @
  x).T``; the transpose rounded the float32 product to bf16 (and XLA then
  transposed it in bf16), so the gradient returned in float32 carried bf16's
  rounding. The transpose is now the product of the swapped operands, with
  no transpose left in the program. Oracle: the column sums of the
  bf16-rounded inputs in float64, which ``d sum(x @ w) / dw`` is."""
  x = jax.random.normal(jax.random.key(0), (64, 8))
  w = jnp.ones((8, 4))
  grad = autocast(jax.grad(lambda w, x: jnp.sum(x @ w)), jnp.bfloat16)
  got = np.asarray(jax.jit(grad)(w, x), np.float64)
  col = np.asarray(x.astype(jnp.bfloat16), np.float64).sum(axis=0)
  np.testing.assert_allclose(got, np.repeat(col[:, None], 4, axis=1), rtol=1e-6, atol=1e-6)
  closed = jax.make_jaxpr(grad)(w, x)
  assert not [e for e in equations(closed.jaxpr) if e.primitive.name == "transpose"]


def test_a_product_keeps_its_own_source_line_and_scope():
  """A product is traced when first read (so that a transpose can take the
  swapped one instead); it must still carry its own source line and name
  scope, not its reader's: the audit, telemetry and fp8 sites name it by
  them. Oracle: the plain function's jaxpr."""
  def proj(x, w):
    with jax.named_scope("proj"):
      return x @ w

  def f(x, w):
    y = proj(x, w)
    with jax.named_scope("consumer"):
      return jnp.tanh(y).sum()

  x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
  want = [str(e.source_info.name_stack) for e in jax.make_jaxpr(f)(x, w).jaxpr.eqns
          if e.primitive.name == "dot_general"]
  got = [str(e.source_info.name_stack) for e in equations(
      jax.make_jaxpr(autocast(f, jnp.bfloat16))(x, w).jaxpr) if "dot_general" in e.primitive.name]
  assert got == want == ["proj"]
  (row,) = audit(autocast(f, jnp.bfloat16), x, w).select(category="matmul")
  assert row.source.endswith(".proj)")


def test_a_norm_squares_in_float32():
  """``jnp.linalg.norm`` is ``sqrt(sum(x * x))``: the square, a ``mul`` of a
  value by itself, followed its float16 input and overflowed (rows of 300
  over 64 features: inf, and ``y / |y|`` 0), where torch's autocast keeps
  ``norm`` and ``normalize`` in float32. Oracle: the float32 function."""
  def fun(w, x):
    y = x @ w
    return jnp.linalg.norm(y, axis=-1), y / jnp.linalg.norm(y, axis=-1, keepdims=True)
  w, x = jnp.eye(64), jnp.full((2, 64), 300.0)
  (norm, unit), (norm32, unit32) = autocast(fun, jnp.float16)(w, x), fun(w, x)
  np.testing.assert_allclose(norm, norm32, rtol=1e-3)
  np.testing.assert_allclose(unit, unit32, rtol=1e-3)
  squares = [e for e in equations(jax.make_jaxpr(autocast(fun, jnp.float16))(w, x).jaxpr)
             if e.primitive.name == "mul" and e.invars[0] is e.invars[1]]
  assert squares and all(v.aval.dtype == jnp.float32 for e in squares for v in e.invars)


def test_numpy_float64_and_int64_arguments_run_eagerly():
  """The cached eager trace keys its outputs by the arguments' types: NumPy's
  float64 (and int64 tokens) trace as float32 (int32), and the lookup by the
  arrays' own dtype raised ``KeyError``. Oracle: the function under
  ``jax.jit``, which traces them so."""
  f = lambda w, x, ids: (jnp.tanh(x @ w), ids + 1)
  g = autocast(f, jnp.bfloat16)
  w, x, ids = np.ones((4, 3)), np.ones((2, 4)), np.array([[1, 2]])
  for _ in range(2):
    got, want = g(w, x, ids), jax.jit(f)(w, x, ids)
    assert [a.dtype for a in got] == [a.dtype for a in want] == [jnp.float32, jnp.int32]
    np.testing.assert_allclose(got[0], want[0], rtol=1e-2)


def test_an_output_that_is_not_a_pytree_of_arrays_is_refused():
  """An object holding arrays that is not a pytree came back holding a
  tracer (``UnexpectedTracerError`` at its first use); ``jax.jit`` refuses
  it with a TypeError, and so does autocast now."""
  class Out:
    def __init__(self, y):
      self.y = y
  g = autocast(lambda w, x: Out(jnp.tanh(x @ w)), jnp.bfloat16)
  with pytest.raises(TypeError, match="Out, which is not a valid JAX type"):
    g(jnp.ones((4, 3)), jnp.ones((2, 4)))
