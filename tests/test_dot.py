"""Tests of jmp_lite._dot.dot_general_f32 against float32 dot_general."""


import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_lite._dot import dot_general_cotangents, dot_general_f32

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
  got = jax.jit(dot_general_f32, static_argnums=2)(lhs, rhs, dims)
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
