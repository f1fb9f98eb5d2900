"""Block scaling (MXFP8): a power-of-two scale per 32 values along the contraction.

Oracle: a NumPy transcription of Transformer Engine's MXFP8 recipe as its
documentation states it (TransformerEngine
docs/features/low_precision_training/mxfp8/mxfp8.rst: blocks of 32
consecutive values, ``exponent = float_to_e8m0(amax / max_norm)`` rounded
toward +inf, ``s = 2**exponent``, a rowwise copy for the forward product and
a columnwise one for the transposed use), computed in float64 where every
step is exact, with ml_dtypes for the fp8 rounding. The products of the
quantised values are exact in float64, so jmp_lite's float32 sums are
checked within float32 accumulation's bound, and bitwise where every sum is
exact. (Any ``dimension_numbers`` against JAX's own transposes:
``tests/test_fp8_matmul.py``.)
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jmp_lite import _fp8_blocks
from jmp_lite._fp8_numerics import site_carrier
from jmp_lite._jaxpr import fp8_sites as _fp8_sites

E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
MATMUL = (((1,), (0,)), ((), ()))


def np_mx(x, axis, fmt):
  """``(q, e)`` of ``x`` by blocks of 32 along ``axis``, as TE's recipe states it."""
  x = np.moveaxis(np.asarray(x, np.float64), axis, -1)
  n = x.shape[-1]
  nb = -(-n // 32)
  padded = np.zeros(x.shape[:-1] + (nb * 32,))
  padded[..., :n] = x
  blocks = padded.reshape(x.shape[:-1] + (nb, 32))
  top = float(ml_dtypes.finfo(fmt).max)
  with np.errstate(invalid="ignore", divide="ignore"):
    amax = np.max(np.abs(blocks), axis=-1)
    e = np.ceil(np.log2(amax / top))  # the smallest 2**e with amax / 2**e <= top
  ok = (amax > 0) & np.isfinite(amax)
  e = np.where(ok, np.clip(e, -127, 127), 0).astype(np.int64)
  with np.errstate(invalid="ignore"):
    scaled = blocks * np.exp2(-e)[..., None]
  q = np.where(np.isfinite(scaled), np.clip(scaled, -top, top), scaled).astype(fmt)
  q = q.reshape(x.shape[:-1] + (nb * 32,))[..., :n]
  return np.moveaxis(q, -1, axis), np.moveaxis(e, -1, axis)


def np_read(q, e, axis):
  """float64 values of ``(q, e)``."""
  full = np.repeat(np.asarray(e), 32, axis=axis)
  full = np.take(full, np.arange(q.shape[axis]), axis=axis)
  return q.astype(np.float64) * np.exp2(full)


def _values(seed, shape, spread=6):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * 2.0 ** rng.integers(-spread, spread + 1, shape)
  return x.astype(np.float32)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape, axis", [((8, 96), 1), ((70, 5), 0), ((3, 40, 7), 1)])
def test_quantize_is_tes_recipe(fmt, shape, axis):
  x = _values(0, shape)
  x.flat[0] = 448.0 * 2.0 ** 3  # an exact power of two times the max: no rounding up
  x.flat[-1] = 0.0
  q, e = _fp8_blocks.quantize(jnp.asarray(x), axis, fmt)
  want_q, want_e = np_mx(x, axis, fmt)
  assert q.dtype == fmt and q.shape == x.shape
  np.testing.assert_array_equal(np.asarray(e), want_e)
  np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_q.view(np.uint8))
  # Nothing saturates: every block's largest value is read back within
  # half an ulp of the format.
  back = np_read(np.asarray(q), np.asarray(e), axis)
  rel = np.abs(back - x)[x != 0] / np.abs(x)[x != 0]
  normal = np.abs(x)[x != 0] >= float(ml_dtypes.finfo(fmt).smallest_normal) * np.exp2(
      np.take(np.repeat(np.asarray(e), 32, axis=axis), np.arange(x.shape[axis]),
              axis=axis))[x != 0]
  assert rel[normal].max() <= 2.0 ** -(ml_dtypes.finfo(fmt).nmant + 1)


def test_zero_and_non_finite_blocks():
  x = np.zeros((2, 64), np.float32)
  x[0, 3], x[1, 40], x[1, 41] = np.inf, 3.0, np.nan
  q, e = _fp8_blocks.quantize(jnp.asarray(x), 1, E5M2)
  np.testing.assert_array_equal(np.asarray(e), [[0, 0], [0, 0]])  # zero or non-finite
  q = np.asarray(q).astype(np.float32)
  assert np.isinf(q[0, 3]) and np.isnan(q[1, 41]) and q[1, 40] == 3.0
  assert np.all(q[0, 32:] == 0)


def _run(x, w, g, dims=MATMUL, out_dtype=np.float32):
  carrier = site_carrier([jnp.ones(3)])
  f = lambda x, w, c: _fp8_sites.matmul(x, w, c, dims, out_dtype, scaling="block")
  out, vjp, amax = jax.vjp(jax.jit(f), x, w, carrier, has_aux=True)
  dx, dw, found = vjp(g.astype(out_dtype))
  np.testing.assert_array_equal(found[:2], np.zeros(2, np.float32))  # not the cotangent's
  return out, dx, dw, found.at[:2].set(amax)  # the operands' maxima: a forward output


def _close(got, want, bound):
  got = np.asarray(got, np.float64)
  assert np.all(np.abs(got - want) <= bound + 1e-300), np.max(np.abs(got - want) - bound)


def test_a_dense_product_and_its_gradients_are_tes():
  """Forward: x by rows, w by columns, along K. d_x: g and w along N. d_w:
  x and g along M (the columnwise copies)."""
  x, w, g = _values(1, (40, 96), 3), _values(2, (96, 24), 3), _values(3, (40, 24), 3)
  out, dx, dw, found = _run(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g))
  hybrid = {"x": E4M3, "w": E4M3, "g": E5M2}

  def product(a, a_axis, fa, b, b_axis, fb):
    va = np_read(*np_mx(a, a_axis, fa), a_axis)
    vb = np_read(*np_mx(b, b_axis, fb), b_axis)
    k = va.shape[1]
    return va @ vb, (k + 1) * 2.0 ** -24 * (np.abs(va) @ np.abs(vb))

  _close(out, *product(x, 1, hybrid["x"], w, 0, hybrid["w"]))
  _close(dx, *product(g, 1, hybrid["g"], w.T, 0, hybrid["w"]))
  _close(dw, *product(x.T, 1, hybrid["x"], g, 0, hybrid["g"]))
  np.testing.assert_array_equal(np.asarray(found[:3]),
                                [np.abs(x).max(), np.abs(w).max(), np.abs(g).max()])


def test_on_a_grid_the_products_are_exact():
  rng = np.random.default_rng(4)
  x = rng.integers(-12, 13, (32, 64)).astype(np.float32)
  w = rng.integers(-12, 13, (64, 32)).astype(np.float32)
  g = rng.integers(-12, 13, (32, 32)).astype(np.float32)
  out, dx, dw, _ = _run(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g))
  read = lambda a, axis, f: np_read(*np_mx(a, axis, f), axis)
  np.testing.assert_array_equal(out, (read(x, 1, E4M3) @ read(w, 0, E4M3)).astype(np.float32))
  np.testing.assert_array_equal(dx, (read(g, 1, E5M2) @ read(w.T, 0, E4M3)).astype(np.float32))
  np.testing.assert_array_equal(dw, (read(x.T, 1, E4M3) @ read(g, 0, E5M2)).astype(np.float32))


@pytest.mark.slow  # about 12 s on 2 CPU cores: the heavy tier
def test_residuals_are_fp8_and_a_scale_a_block():
  x = jnp.asarray(_values(6, (64, 96)), jnp.bfloat16)
  w = jnp.asarray(_values(7, (96, 32)), jnp.bfloat16)
  _, vjp = jax.vjp(lambda x, w: _fp8_sites.matmul(x, w, site_carrier([jnp.ones(3)]), MATMUL,
                                                  jnp.bfloat16, scaling="block")[0], x, w)
  leaves = sorted((np.dtype(a.dtype).name, a.shape) for a in jax.tree.leaves(vjp)
                  if hasattr(a, "dtype"))
  # x by columns (along M, for d_w), w by rows (along N, for d_x).
  assert leaves == sorted([(E4M3.name, (64, 96)), (E4M3.name, (96, 32)),
                           ("int32", (2, 96)), ("int32", (96, 1))])
