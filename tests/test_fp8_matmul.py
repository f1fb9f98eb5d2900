"""The fp8 matmul: one fp8 ``dot_general`` forward, two backward, fp8 residuals.

Oracle: a NumPy/ml_dtypes transcription of Transformer Engine's delayed-
scaling GEMM, not jmp_lite's code. TE quantises with its ``scale`` (our
``1 / scale``): ``fp8 = convert(x * scale)``, saturating
(transformer_engine/common/util/cast_kernels.cuh), and its GEMM computes
``D = scale_inv_A * scale_inv_B * (A_fp8 @ B_fp8)`` accumulating in float32
(cuBLASLt's ``CUBLASLT_MATMUL_DESC_A_SCALE_POINTER`` and ``B_SCALE``;
transformer_engine/common/gemm/cublaslt_gemm.cu). The backward products are
the same GEMM with the e5m2 output gradient as one operand. The products of
fp8 values are exact in float64, so the oracle's sums are exact and
jmp_lite's are checked against them within float32 accumulation's bound;
inputs on a grid of small integers with power-of-two scales make every
float32 sum exact, and there the results are checked bitwise.
"""

import jax
from jax import lax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from excess_precision import excess_precision
from jmp_lite._fp8_numerics import site_carrier
from jmp_lite._jaxpr import fp8_sites as _fp8_sites

E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
MATMUL = (((1,), (0,)), ((), ()))  # [M, K] x [K, N]
LIMIT = np.float32(2.0 ** 126)


def np_quantize(x, fmt, scale):
  """TE's cast with our scale: ``x * (1 / scale)`` in float32, saturated."""
  x = np.asarray(x).astype(np.float32)
  inv = np.float32(1) / np.clip(np.float32(scale), 1 / LIMIT, LIMIT)
  top = np.float32(ml_dtypes.finfo(fmt).max)
  with np.errstate(over="ignore", invalid="ignore"):
    y = x * inv
  return np.where(np.isfinite(x), np.clip(y, -top, top), y).astype(fmt)


def np_gemm(a, b, scale_a, scale_b):
  """float64 ``(a @ b) * scale_a * scale_b`` of fp8 ``a``, ``b``, and its error bound."""
  a64, b64 = a.astype(np.float64), b.astype(np.float64)
  s = np.float64(scale_a) * np.float64(scale_b)
  exact = (a64 @ b64) * s
  # float32 accumulation of K terms, then two roundings by the scales.
  bound = (a.shape[-1] + 2) * 2.0 ** -24 * (np.abs(a64) @ np.abs(b64)) * s
  return exact, bound


def _close(got, exact, bound, out_dtype):
  got = np.asarray(got).astype(np.float64)
  ulp = float(ml_dtypes.finfo(out_dtype).eps) / 2  # the final rounding
  assert np.all(np.abs(got - exact) <= bound + ulp * np.abs(exact) + 1e-300), (
      np.max(np.abs(got - exact) - bound - ulp * np.abs(exact)))


def _operands(seed, m=16, k=48, n=24, dtype=np.float32, grid=False, g_scale=1.0):
  rng = np.random.default_rng(seed)
  if grid:
    x = rng.integers(-12, 13, (m, k)).astype(np.float32)
    w = rng.integers(-12, 13, (k, n)).astype(np.float32)
    g = rng.integers(-12, 13, (m, n)).astype(np.float32)
  else:
    x = rng.standard_normal((m, k)).astype(np.float32) * 3
    w = rng.standard_normal((k, n)).astype(np.float32) / 5
    g = rng.standard_normal((m, n)).astype(np.float32) / 7 * np.float32(g_scale)
  # Values every compute dtype holds alike: rounded to bfloat16, then to
  # float16 (exact, or fewer bits in float16's subnormal range).
  x, w, g = (a.astype(ml_dtypes.bfloat16).astype(np.float16).astype(np.float32)
             for a in (x, w, g))
  for a in (x, w, g):
    assert np.array_equal(a.astype(ml_dtypes.bfloat16).astype(np.float32), a)
  return (jnp.asarray(a, dtype) for a in (x, w, g))


def _measured(amax, cotangent):
  """The three maxima a site measured: the operands' from its forward
  output, the gradient's from its carrier's cotangent (zeros elsewhere)."""
  zeros = np.zeros(2, np.float32)
  np.testing.assert_array_equal(np.asarray(cotangent)[:2], zeros)  # forward: not here
  np.testing.assert_array_equal(np.asarray(cotangent)[3:], np.zeros(3, np.float32))  # factors
  return jnp.concatenate([amax, cotangent[2:3]])


def _run(x, w, g, scales, out_dtype, dims=MATMUL, scaling="delayed"):
  """The site's product, both cotangents and the maxima it measured."""
  carrier = site_carrier([jnp.asarray(scales, jnp.float32)])
  f = lambda x, w, c: _fp8_sites.matmul(x, w, c, dims, out_dtype, scaling=scaling)
  out, vjp, amax = jax.vjp(jax.jit(f), x, w, carrier, has_aux=True)
  dx, dw, found = vjp(g.astype(out_dtype))
  return out, dx, dw, _measured(amax, found)


SCALES = [(1.0, 1.0, 1.0), (0.037, 2.6e-4, 3.1e-3), (8.0, 0.25, 2.0 ** -10)]


@pytest.mark.parametrize("scales", SCALES, ids=["ones", "uneven", "pow2"])
@pytest.mark.parametrize("out_dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_forward_and_backward_are_tes_gemm(scales, out_dtype):
  x, w, g = _operands(0)
  out, dx, dw, found = _run(x, w, g, scales, out_dtype)
  sx, sw, sg = scales
  qx, qw = np_quantize(x, E4M3, sx), np_quantize(w, E4M3, sw)
  qg = np_quantize(np.asarray(g.astype(out_dtype)), E5M2, sg)
  assert out.dtype == np.dtype(out_dtype)
  _close(out, *np_gemm(qx, qw, sx, sw), out_dtype)
  _close(dx, *np_gemm(qg, qw.T, sg, sw), np.float32)
  _close(dw, *np_gemm(qx.T, qg, sx, sg), np.float32)
  assert dx.dtype == x.dtype and dw.dtype == w.dtype
  # The carrier's cotangent: the three absolute maxima, exactly.
  want = [np.abs(np.asarray(a, np.float32)).max() for a in (x, w, g.astype(out_dtype))]
  np.testing.assert_array_equal(np.asarray(found), np.float32(want))


def test_on_a_grid_the_products_are_exact():
  """Small integers, power-of-two scales: every float32 sum is exact."""
  x, w, g = _operands(1, grid=True)
  scales = (2.0, 0.5, 4.0)
  out, dx, dw, _ = _run(x, w, g, scales, np.float32)
  qx, qw, qg = (np_quantize(a, f, s) for a, f, s in
                ((x, E4M3, 2.0), (w, E4M3, 0.5), (g, E5M2, 4.0)))
  for got, (exact, _) in ((out, np_gemm(qx, qw, 2.0, 0.5)),
                          (dx, np_gemm(qg, qw.T, 4.0, 0.5)),
                          (dw, np_gemm(qx.T, qg, 2.0, 4.0))):
    np.testing.assert_array_equal(np.asarray(got), exact.astype(np.float32))


@pytest.mark.parametrize("dims, shapes", [
    ((((2,), (1,)), ((0,), (0,))), ((3, 5, 8), (3, 8, 4))),  # batched, as attention
    ((((0, 2), (2, 1)), ((), ())), ((8, 3, 5), (6, 5, 8))),  # two contractions
    ((((1,), (2,)), ((0,), (1,))), ((2, 5, 3, 7), (4, 2, 5))),  # batch not leading
    ((((2,), (1,)), ((0,), (0,))), ((3, 5, 40), (3, 40, 4))),  # a contraction over 32
    ((((1,), (0,)), ((), ())), ((7, 1), (1, 9))),  # an outer product's transposes
])
@pytest.mark.parametrize("scaling", ["delayed", "block"])
def test_any_dimension_numbers_transpose_like_jax(dims, shapes, scaling):
  """Oracle: JAX's own transposes of ``dot_general`` on the quantised values.

  With integer operands in [-8, 8] the fp8 values are the operands: with
  delayed scales of 1, and with block scales of 1 (every block's maximum is
  below both formats' largest power of two). So the fp8 site computes what
  ``jax.vjp`` of a float32 ``dot_general`` computes.
  """
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.integers(-8, 9, shapes[0]), jnp.bfloat16)
  w = jnp.asarray(rng.integers(-8, 9, shapes[1]), jnp.bfloat16)
  ref = lambda a, b: lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
  want, ref_vjp = jax.vjp(ref, x.astype(jnp.float32), w.astype(jnp.float32))
  g = jnp.asarray(rng.integers(-8, 9, want.shape), jnp.float32)
  out, dx, dw, _ = _run(x, w, g, (1.0, 1.0, 1.0), np.float32, dims, scaling)
  np.testing.assert_array_equal(out, want)
  for got, exp in zip((dx, dw), ref_vjp(g)):
    np.testing.assert_array_equal(got.astype(jnp.float32), exp)


@pytest.mark.parametrize("scales", [(1.5e-5, 1.0, 1.5e-5), (3.0e-39, 2.0 ** 126, 1e-30)],
                         ids=["below-1/65504", "at-the-limits"])
def test_every_compute_dtype_gives_the_same_fp8_values(scales):
  """bf16, f16 and f32 operands holding the same values give the same results.

  The first scales are the float16 failure: quantising in float16 computes
  ``x * (1 / s)`` with ``1 / 1.5e-5`` past float16's range (NaN and a
  gradient 2.6x off in training); the second are clamped to the normal range.
  """
  results = {}
  for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
    # small cotangents, as a loss weighted 0.01 gives
    x, w, g = _operands(3, dtype=dtype, g_scale=2.0 ** -7)
    results[dtype] = _run(x, w, g, scales, np.float32)
  f32 = results[jnp.float32]
  for dtype, (out, dx, dw, found) in results.items():
    assert np.all(np.isfinite(np.asarray(out))) and np.all(np.isfinite(np.asarray(found)))
    np.testing.assert_array_equal(out, f32[0])
    np.testing.assert_array_equal(found, f32[3])
    # The cotangents are the same float32 values, rounded once to the operand's dtype.
    np.testing.assert_array_equal(dx, f32[1].astype(dtype))
    np.testing.assert_array_equal(dw, f32[2].astype(dtype))
    assert np.isfinite(np.asarray(dx, np.float32)).all()


def test_non_finite_values_stay_non_finite():
  x, w, g = _operands(4)
  x = x.at[0, 0].set(jnp.inf)
  out, dx, dw, found = _run(x, w, g, (1.0, 1.0, 1.0), np.float32)
  assert not np.isfinite(np.asarray(out)[0]).any()  # e4m3fn has no inf: NaN
  assert np.isfinite(np.asarray(out)[1:]).all()
  assert np.isinf(np.asarray(found)[0])
  x, w, g = _operands(4)
  _, dx, dw, _ = _run(x, w, g.at[1, 2].set(jnp.nan), (1.0, 1.0, 1.0), np.float32)
  assert not np.isfinite(np.asarray(dx)).all() and not np.isfinite(np.asarray(dw)).all()


def test_residuals_are_the_fp8_operands():
  """The backward pass keeps a byte per operand element, not dequantised copies."""
  x, w, _ = _operands(5, dtype=jnp.bfloat16)
  carrier = site_carrier([jnp.ones(3, jnp.float32)])
  _, vjp = jax.vjp(lambda x, w, c: _fp8_sites.matmul(x, w, c, MATMUL, jnp.bfloat16)[0],
                   x, w, carrier)
  residuals = [a for a in jax.tree.leaves(vjp) if hasattr(a, "dtype")]
  big = sorted((np.dtype(a.dtype).name, a.shape) for a in residuals if a.size > 3)
  assert big == sorted([(E4M3.name, x.shape), (E4M3.name, w.shape)])


def _stack(params, x, dot):
  for w in params:
    x = dot(x, w)
  return jnp.mean(x.astype(jnp.float32) ** 2)


def _residual_bytes(loss, params, x):
  _, vjp = jax.vjp(jax.jit(loss), params, x)
  return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(vjp) if hasattr(a, "dtype"))


def test_a_dense_stack_keeps_half_the_bf16_residuals():
  """4 x Dense 512, batch 128, without activations (whose residuals do not
  depend on the matmuls' format): the bf16 step keeps bf16 operands, the fp8
  one fp8 operands and four float32 scalars a layer (three scales and the
  gradient's factor; the operands' maxima are forward outputs, not kept)."""
  rng = np.random.default_rng(6)
  params = [jnp.asarray(rng.standard_normal((512, 512)) / 23, jnp.float32) for _ in range(4)]
  x = jnp.asarray(rng.standard_normal((128, 512)), jnp.float32)
  bf16 = lambda a, w: lax.dot_general(
      a.astype(jnp.bfloat16), w.astype(jnp.bfloat16), MATMUL,
      preferred_element_type=jnp.float32).astype(jnp.bfloat16)
  carrier = site_carrier([jnp.ones(3, jnp.float32)])
  fp8 = lambda a, w: _fp8_sites.matmul(a.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                                       carrier, MATMUL, jnp.bfloat16)[0]
  ours = _residual_bytes(lambda p, x: _stack(p, x, fp8), params, x)
  theirs = _residual_bytes(lambda p, x: _stack(p, x, bf16), params, x)
  last = 128 * 512 * 4  # the float32 output the loss squares, in both
  assert ours - last == (theirs - last) // 2 + 4 * (3 + 1) * 4, (ours, theirs)


def test_the_quantisation_survives_excess_precision():
  """Operands rounded to bf16 by the program, read under XLA:GPU's license.

  The emulator keeps narrow values in float32 where the license allows; the
  fp8 site must still quantise, and measure, the bf16 values the program
  computed: the same maxima bitwise, the same products up to the order of
  float32 operations (XLA may fold the two scale multiplications).
  """
  x, w, g = _operands(7)

  def f(x, w, c):
    a = (x * 1.001).astype(jnp.bfloat16)  # a rounding XLA:GPU may skip
    out, vjp, amax = jax.vjp(lambda c: _fp8_sites.matmul(a, w.astype(jnp.bfloat16), c,
                                                         MATMUL, jnp.float32), c, has_aux=True)
    return out, jnp.concatenate([amax, vjp(g)[0][2:]])

  c = site_carrier([jnp.asarray([0.02, 0.003, 1.0])])
  out, found = excess_precision(f)(x, w, c)
  want_out, want_found = jax.jit(f)(x, w, c)
  np.testing.assert_array_equal(found, want_found)
  np.testing.assert_allclose(out, want_out, rtol=2 ** -22)
  a = np.asarray((x * 1.001).astype(jnp.bfloat16), np.float32)
  assert float(found[0]) == np.abs(a).max()
  np.testing.assert_array_equal(found[3:], np.zeros(3, np.float32))


# Current scaling: each tensor's scale from its own maximum, this step ------------


def np_current(x, fmt):
  """TE's ``compute_scale_from_amax`` (recipe_common.cuh at 01c24fe) in NumPy:
  ``factor = max / amax`` in float32, 1 where amax is 0 or not finite;
  ``(quantised x, dequantisation scale 1 / factor)``."""
  x = np.asarray(x).astype(np.float32)
  amax = np.float32(np.abs(x).max())
  top = np.float32(ml_dtypes.finfo(fmt).max)
  factor = top / amax if (amax > 0 and np.isfinite(amax)) else np.float32(1)
  factor = np.clip(np.float32(factor), 1 / LIMIT, LIMIT)
  q = np.clip(x * factor, -top, top).astype(fmt)
  return q, np.float32(1) / factor


@pytest.mark.parametrize("amplitude", [1.0, 3e4, 1e-3])
def test_current_scaling_is_tes(amplitude):
  x, w, g = _operands(8)
  x = x * np.float32(amplitude)
  carrier = site_carrier([jnp.asarray([7.0, 7.0, 7.0])])  # not read
  f = lambda x, w, c: _fp8_sites.matmul(x, w, c, MATMUL, jnp.float32, scaling="current")
  out, vjp, amax = jax.vjp(jax.jit(f), x, w, carrier, has_aux=True)
  dx, dw, found = vjp(g)
  found = _measured(amax, found)
  qx, sx = np_current(x, E4M3)
  qw, sw = np_current(w, E4M3)
  qg, sg = np_current(g, E5M2)
  # Each tensor fills its format: its largest value quantises to the max.
  assert float(np.abs(qx.astype(np.float32)).max()) == 448.0
  _close(out, *np_gemm(qx, qw, sx, sw), np.float32)
  _close(dx, *np_gemm(qg, qw.T, sg, sw), np.float32)
  _close(dw, *np_gemm(qx.T, qg, sx, sg), np.float32)
  want = [np.abs(np.asarray(a, np.float32)).max() for a in (x, w, g)]
  np.testing.assert_array_equal(np.asarray(found[:3]), np.float32(want))


def test_current_scaling_of_zeros_and_non_finite_values():
  x, w, g = _operands(9)
  f = lambda x, w: _fp8_sites.matmul(x, w, site_carrier([jnp.ones(3)]), MATMUL, jnp.float32,
                                     scaling="current")[0]
  out = jax.jit(f)(jnp.zeros_like(x), w)  # amax 0: factor 1, a zero product
  np.testing.assert_array_equal(np.asarray(out), np.zeros(out.shape, np.float32))
  out = jax.jit(f)(x.at[0, 0].set(jnp.inf), w)  # amax inf: factor 1, inf kept
  assert not np.isfinite(np.asarray(out)[0]).any()
  assert np.isfinite(np.asarray(out)[1:]).all()


# Block scaling's case compiles the MXFP8 path twice (about 30 s): the heavy tier.
@pytest.mark.parametrize("scaling", ["delayed", "current",
                                     pytest.param("block", marks=pytest.mark.slow)])
def test_an_operand_nothing_differentiates_costs_no_residual(scaling):
  """A model's input needs no cotangent: the kernel's fp8 copy, which only
  that cotangent reads, is not kept, and the weight gradient is unchanged."""
  x, w, g = _operands(10, m=32, k=64, n=32)
  carrier = site_carrier([jnp.asarray([0.05, 0.003, 0.01])])
  f = lambda x, w: _fp8_sites.matmul(x, w, carrier, MATMUL, jnp.float32, scaling=scaling)[0]
  _, vjp_w = jax.vjp(lambda w: f(x, w), w)
  _, vjp_both = jax.vjp(f, x, w)
  fp8 = lambda vjp: sorted(a.shape for a in jax.tree.leaves(vjp)
                           if hasattr(a, "dtype") and a.dtype == E4M3)
  assert fp8(vjp_w) == [x.shape] and fp8(vjp_both) == sorted([x.shape, w.shape])
  np.testing.assert_array_equal(vjp_w(g)[0], vjp_both(g)[1])


# (Block scaling quantises through _fp8_blocks, which this does not replace.)
@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_non_finite_inputs_stay_non_finite_where_quantising_saturates_them(
    scaling, monkeypatch):
  """XLA:GPU folds the quantising clamp into cuBLASLt's fp8 GEMM, which
  saturates inf as well (an H200 turned an infinite loss into finite
  gradients). Emulated here by a quantiser that saturates everything: the
  rows and columns a float matmul makes non-finite are still non-finite."""
  from jmp_lite import _fp8_numerics

  def saturating(x, dtype, factor):
    top = np.float32(jnp.finfo(dtype).max)
    scaled = jnp.asarray(x, jnp.float32) * factor
    return jnp.clip(jnp.nan_to_num(scaled, posinf=top, neginf=-top), -top, top).astype(dtype)

  monkeypatch.setattr(_fp8_numerics, "quantize_by", saturating)
  x, w, g = _operands(4)
  out, _, _, _ = _run(x.at[2, 5].set(jnp.inf), w, g, (1.0, 1.0, 1.0), np.float32,
                      scaling=scaling)
  rows = ~np.isfinite(np.asarray(out))
  # Oracle: a float32 matmul of the same operands.
  np.testing.assert_array_equal(rows, ~np.isfinite(np.asarray(x.at[2, 5].set(jnp.inf)) @ w))
  _, dx, dw, _ = _run(x, w, g.at[1, 3].set(-jnp.inf), (1.0, 1.0, 1.0), np.float32,
                      scaling=scaling)
  g_bad = np.asarray(g.at[1, 3].set(-jnp.inf))
  with np.errstate(invalid="ignore"):
    np.testing.assert_array_equal(~np.isfinite(np.asarray(dx)), ~np.isfinite(g_bad @ w.T))
    np.testing.assert_array_equal(~np.isfinite(np.asarray(dw)), ~np.isfinite(x.T @ g_bad))
