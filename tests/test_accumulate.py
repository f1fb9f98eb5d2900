"""Tests of the engine's float32-accumulating primitives (jmp_lite/_jaxpr/accumulate.py).

Oracles: ``lax.dot_general``/``lax.conv_general_dilated`` in float32 at
HIGHEST precision, JAX's own ``jax.vjp`` of them, and the StableHLO that
``jax.export`` produces for several platforms.
"""


import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_lite._jaxpr import accumulate as _accumulate
from jmp_lite.auditing import audit


def dot_general_f32(lhs, rhs, dims, precision=None):
  # Parameters as a traced `lax.dot_general` leaves them: the precision is
  # canonical there (`jax.default_matmul_precision` already applied).
  params = dict(dimension_numbers=dims, precision=precision, out_sharding=None)
  return _accumulate.bind("dot_general", lhs, rhs, params, jnp.float32)


def dot_general_cotangents(ct, lhs, rhs, dims):
  _, vjp = jax.vjp(lambda a, b: dot_general_f32(a, b, dims), lhs, rhs)
  return vjp(ct)

CASES = [
    ((64, 128), (128, 32), (((1,), (0,)), ((), ()))),
    ((128, 64), (128, 32), (((0,), (0,)), ((), ()))),
    ((8, 16, 32), (32, 24), (((2,), (0,)), ((), ()))),
    ((8, 16, 32), (8, 32, 24), (((2,), (1,)), ((0,), (0,)))),
    # Attention's layouts, which XLA's CPU runtime rejects in bf16 -> f32 as is.
    ((2, 4, 32, 64), (2, 64, 4, 32), (((2,), (3,)), ((0, 1), (0, 2)))),
    ((2, 4, 64, 64), (2, 64, 4, 32), (((2,), (1,)), ((0, 1), (0, 2)))),
    ((2, 5, 4, 8), (2, 7, 4, 8), (((3,), (3,)), ((0, 2), (0, 2)))),
    ((3, 6, 5, 4), (5, 4, 3, 2), (((2, 3), (0, 1)), ((0,), (2,)))),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("lhs_shape, rhs_shape, dims", CASES)
def test_matches_float32_dot_general(lhs_shape, rhs_shape, dims, dtype):
  k1, k2 = jax.random.split(jax.random.key(0))
  lhs = jax.random.normal(k1, lhs_shape).astype(dtype)
  rhs = jax.random.normal(k2, rhs_shape).astype(dtype)
  # The float32 reference is float32 arithmetic (a GPU's default is TF32,
  # which the float32 case would otherwise run in, on both sides).
  highest = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
  got = jax.jit(dot_general_f32, static_argnums=(2, 3))(lhs, rhs, dims, highest)
  ref = lax.dot_general(lhs.astype(jnp.float32), rhs.astype(jnp.float32), dims,
                        precision=lax.Precision.HIGHEST)
  assert got.dtype == jnp.float32 and got.shape == ref.shape
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
  # It differentiates like dot_general.
  grads = jax.grad(lambda a, b: jnp.sum(dot_general_f32(a, b, dims)), (0, 1))(lhs, rhs)
  assert [g.dtype for g in grads] == [dtype, dtype]


@pytest.mark.parametrize("lhs_shape, rhs_shape, dims", CASES)
def test_cotangents_match_jax_vjp(lhs_shape, rhs_shape, dims):
  k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
  lhs = jax.random.normal(k1, lhs_shape)
  rhs = jax.random.normal(k2, rhs_shape)
  out, vjp = jax.vjp(lambda a, b: lax.dot_general(a, b, dims), lhs, rhs)
  ct = jax.random.normal(k3, out.shape)
  ref_lhs, ref_rhs = vjp(ct)
  d_lhs, d_rhs = dot_general_cotangents(ct, lhs, rhs, dims)
  assert d_lhs.shape == lhs.shape and d_rhs.shape == rhs.shape
  np.testing.assert_allclose(d_lhs, ref_lhs, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(d_rhs, ref_rhs, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("lhs_shape, rhs_shape, dims", CASES[:5])
def test_narrow_cotangents_are_narrow_products_accumulating_in_f32(
    lhs_shape, rhs_shape, dims):
  k1, k2 = jax.random.split(jax.random.key(2))
  lhs = jax.random.normal(k1, lhs_shape).astype(jnp.bfloat16)
  rhs = jax.random.normal(k2, rhs_shape).astype(jnp.bfloat16)

  def loss(a, b):
    params = dict(dimension_numbers=dims, precision=None, out_sharding=None)
    out = _accumulate.bind("dot_general", a, b, params, jnp.bfloat16)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  report = audit(jax.grad(loss, (0, 1)), lhs, rhs)
  assert report.count(category="matmul") == 3
  assert report.count(category="matmul", operand_dtype=jnp.bfloat16,
                      accumulation=jnp.float32) == 3
  got = jax.jit(jax.grad(loss, (0, 1)))(lhs, rhs)
  f32 = lambda a, b: jnp.sum(lax.dot_general(
      a, b, dims, precision=lax.Precision.HIGHEST) ** 2)
  want = jax.grad(f32, (0, 1))(lhs.astype(jnp.float32), rhs.astype(jnp.float32))
  for g, w in zip(got, want):
    assert g.dtype == jnp.bfloat16
    np.testing.assert_allclose(g.astype(jnp.float32), w, rtol=0,
                               atol=2e-2 * float(jnp.max(jnp.abs(w))))


CONV_DIMS = lax.conv_dimension_numbers((2, 3, 9, 9), (4, 3, 3, 3),
                                       ("NCHW", "OIHW", "NCHW"))


def _conv(lhs, rhs, out_dtype):
  params = dict(window_strides=(2, 1), padding=((1, 1), (0, 0)),
                lhs_dilation=(1, 1), rhs_dilation=(1, 2),
                dimension_numbers=CONV_DIMS, feature_group_count=1,
                batch_group_count=1, precision=None, out_sharding=None)
  return _accumulate.bind("conv_general_dilated", lhs, rhs, params, out_dtype)


def test_conv_forward_backward_and_vmap_match_float32():
  k1, k2 = jax.random.split(jax.random.key(3))
  lhs = jax.random.normal(k1, (2, 3, 9, 9)).astype(jnp.bfloat16)
  rhs = jax.random.normal(k2, (4, 3, 3, 3)).astype(jnp.bfloat16)

  def ref(a, b):
    return lax.conv_general_dilated(
        a.astype(jnp.float32), b.astype(jnp.float32), (2, 1),
        ((1, 1), (0, 0)), rhs_dilation=(1, 2), dimension_numbers=CONV_DIMS,
        precision=lax.Precision.HIGHEST)

  np.testing.assert_allclose(jax.jit(_conv, static_argnums=2)(
      lhs, rhs, jnp.float32), ref(lhs, rhs), rtol=1e-5, atol=1e-4)
  loss = lambda a, b: jnp.sum(_conv(a, b, jnp.bfloat16).astype(jnp.float32)**2)
  got = jax.jit(jax.grad(loss, (0, 1)))(lhs, rhs)
  want = jax.grad(lambda a, b: jnp.sum(ref(a, b) ** 2), (0, 1))(lhs, rhs)
  for g, w in zip(got, want):
    assert g.dtype == jnp.bfloat16
    np.testing.assert_allclose(g.astype(jnp.float32), w,
                               atol=2e-2 * float(jnp.max(jnp.abs(w))))
  report = audit(jax.grad(loss, (0, 1)), lhs, rhs)
  assert report.count(category="conv") == 3
  assert report.count(category="conv", operand_dtype=jnp.bfloat16,
                      accumulation=jnp.float32) == 3
  # Per-example kernels under vmap: JAX's batching rule, rewritten.
  rhs_b = jnp.stack([rhs, -rhs])
  got = jax.vmap(lambda b: _conv(lhs, b, jnp.float32))(rhs_b)
  np.testing.assert_allclose(got[1], -ref(lhs, rhs), rtol=1e-5, atol=1e-4)
  assert audit(jax.vmap(lambda b: _conv(lhs, b, jnp.float32)), rhs_b).count(
      category="conv", accumulation=jnp.float32) == 1


def test_lowering_is_chosen_per_platform_at_export():
  """One export for CPU and CUDA: each platform gets its own dot."""
  lhs = jax.ShapeDtypeStruct((2, 5, 4, 8), jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct((2, 7, 4, 8), jnp.bfloat16)
  dims = (((3,), (3,)), ((0, 2), (0, 2)))  # attention's scores: q . k
  fun = jax.jit(lambda a, b: dot_general_f32(a, b, dims))
  exported = jax.export.export(fun, platforms=("cpu", "cuda"))(lhs, rhs)
  text = exported.mlir_module()
  # The CPU branch transposes into [batch, free, contract] and copies behind
  # an optimization barrier; the CUDA branch is the dot as written.
  assert "stablehlo.case" in text and "optimization_barrier" in text
  assert text.count("stablehlo.dot_general") == 2
  only_cuda = jax.export.export(fun, platforms=("cuda",))(lhs, rhs)
  assert "optimization_barrier" not in only_cuda.mlir_module()
  assert "transpose" not in only_cuda.mlir_module()
  k1, k2 = jax.random.split(jax.random.key(4))
  a = jax.random.normal(k1, lhs.shape).astype(jnp.bfloat16)
  b = jax.random.normal(k2, rhs.shape).astype(jnp.bfloat16)
  want = lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), dims,
                         precision=lax.Precision.HIGHEST)
  np.testing.assert_allclose(exported.call(a, b), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype, preset, dropped", [
    (jnp.float16, "F16_F16_F32", True), (jnp.bfloat16, "BF16_BF16_F32", True),
    (jnp.bfloat16, "F32_F32_F32", False)])
def test_a_preset_naming_the_default_is_dropped_for_gpus(dtype, preset, dropped):
  """NNX's float16 attention asks for ``F16_F16_F32``; XLA:GPU refused a
  decoding step's 1 x 4 by 4 x 4 batched product that carried it
  ("Unsupported dot precision algorithm: 4", an H200) and runs the same
  product without it, which is what the preset names for float16 operands
  and float32 results. A preset asking for more than the operands give stays."""
  lhs = jax.ShapeDtypeStruct((1, 1, 2, 1, 4), dtype)
  rhs = jax.ShapeDtypeStruct((1, 4, 2, 4), dtype)
  dims = (((4,), (3,)), ((0, 2), (0, 2)))
  alg = getattr(lax.DotAlgorithmPreset, preset)
  fun = jax.jit(lambda a, b: dot_general_f32(a, b, dims, precision=alg))
  text = jax.export.export(fun, platforms=("cuda",))(lhs, rhs).mlir_module()
  assert text.count("stablehlo.dot_general") == 1
  assert ("algorithm" not in text) == dropped, text
