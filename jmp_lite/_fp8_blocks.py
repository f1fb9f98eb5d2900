"""Block scaling (MXFP8): one power-of-two scale per 32 values along the contraction.

Transformer Engine's ``MXFP8BlockScaling`` recipe and the OCP Microscaling
(MX) format: a tensor is cut into blocks of 32 consecutive values along the
dimension a product contracts, and each block gets a scale ``2**e`` (an E8M0
value), the smallest power of two with ``amax(block) / 2**e <= max`` of the
fp8 format ("``float_to_e8m0(amax / max_norm)``, rounded toward +inf",
TransformerEngine docs/features/low_precision_training/mxfp8/mxfp8.rst), so
that no value saturates. The values are then ``x / 2**e`` rounded once to the
fp8 format. A tensor used in two products along different dimensions (an
operand in the forward pass and in a weight or input gradient) is quantised
once for each, from its own values: TE's "rowwise" and "columnwise" copies.

Here ``e`` is computed from the bits, exactly (TE multiplies ``amax`` by a
rounded ``1 / max``, which can round an exact power of two up), and clamped
to E8M0's range [-127, 127]. A block whose maximum is 0 or not finite gets
``e = 0``; its inf and NaN stay non-finite.

A dimension whose size is not a multiple of 32 ends in a shorter block. The
product multiplies the blocks' values, read back exactly in float32 (an fp8
value times a power of two), accumulating in float32: no GPU before
Blackwell has MX matrix units, and XLA:CPU has none, so block scaling is
emulated there with the numbers an MX GEMM computes.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _exact

BLOCK = 32
_E8M0 = (-127, 127)


def _exponents(amax: jax.Array, dtype) -> jax.Array:
  """int32 ``e``: the smallest with ``amax <= max(dtype) * 2**e``, in E8M0's range.

  With ``amax = m * 2**E`` and ``max = mm * 2**Em`` (``m``, ``mm`` in [0.5,
  1)): ``e = E - Em``, plus one where ``m > mm``. 0 where ``amax`` is 0 or
  not finite.
  """
  mm, em = np.frexp(np.float32(jnp.finfo(dtype).max))
  m, e = _exact.frexp(amax)
  e = e - int(em) + (m > np.float32(mm)).astype(jnp.int32)
  e = jnp.clip(e, *_E8M0)
  return jnp.where((amax > 0) & jnp.isfinite(amax), e, 0)


def quantize(x: jax.Array, axis, dtype) -> tuple[jax.Array, jax.Array]:
  """``(q, e)``: ``x`` in fp8 ``dtype`` by blocks of 32 along ``axis``, and
  the blocks' int32 exponents (``axis`` holding one per block).

  ``axis`` None (a product that contracts nothing): blocks of the flattened
  values; ``e`` then has one axis.
  """
  x32 = _exact.widen(jnp.asarray(x)).astype(jnp.float32)
  if axis is None:
    q, e = quantize(x32.reshape(-1), 0, dtype)
    return q.reshape(x32.shape), e
  axis = axis % x32.ndim
  n = x32.shape[axis]
  blocks = -(-n // BLOCK)
  pad = [(0, 0)] * x32.ndim
  pad[axis] = (0, blocks * BLOCK - n)
  shaped = jnp.pad(x32, pad).reshape(
      *x32.shape[:axis], blocks, BLOCK, *x32.shape[axis + 1:])
  e = _exponents(jnp.max(jnp.abs(shaped), axis=axis + 1, keepdims=True), dtype)
  top = np.float32(jnp.finfo(dtype).max)
  scaled = _exact.ldexp(shaped, -e, jnp.float32)
  # Finite values cannot exceed the format's range (the exponent rounds up);
  # the clip only keeps the float32 rounding of a block's maximum inside it.
  scaled = jnp.where(jnp.isfinite(scaled), jnp.clip(scaled, -top, top), scaled)
  # Rounded explicitly (`_exact.round_to`): the product reads these values
  # back in float32, a convert round trip XLA:GPU removes otherwise (on an
  # H200 the gradient's e5m2 rounding vanished).
  q = _exact.round_to(scaled, dtype).astype(dtype).reshape(
      *x32.shape[:axis], blocks * BLOCK, *x32.shape[axis + 1:])
  q = lax.slice_in_dim(q, 0, n, axis=axis)
  return q, jnp.squeeze(e, axis + 1)


def dequantize(q: jax.Array, e: jax.Array, axis) -> jax.Array:
  """``q`` times its blocks' ``2**e``, exactly, in float32 (``axis`` as
  `quantize` was given it)."""
  if axis is None:
    return dequantize(q.reshape(-1), e, 0).reshape(q.shape)
  axis = axis % q.ndim
  n = q.shape[axis]
  full = jnp.repeat(e, BLOCK, axis=axis, total_repeat_length=e.shape[axis] * BLOCK)
  full = lax.slice_in_dim(full, 0, n, axis=axis)
  return _exact.ldexp(q.astype(jnp.float32), full, jnp.float32)


def axes(dimension_numbers) -> tuple:
  """The axes of the two operands that blocks run along: the last pair of
  contracting dimensions (None, None where nothing is contracted)."""
  (a_contract, b_contract), _ = dimension_numbers
  if not a_contract:
    return None, None
  return a_contract[-1], b_contract[-1]


def dot(qa, ea, a_axis, qb, eb, b_axis, dimension_numbers, out_sharding=None) -> jax.Array:
  """float32 ``dot_general`` of two block-quantised operands.

  The operands are read back in float32: an fp8 value times a power of two
  has at most 4 significant bits, so the values are exact in float32, in
  TF32 (what a GPU's default float32 precision multiplies) and in bf16; a
  float32 dot is the one every XLA backend takes in any layout (XLA:CPU
  refuses some bf16 x bf16 -> float32 layouts at run time).
  """
  return lax.dot_general(dequantize(qa, ea, a_axis), dequantize(qb, eb, b_axis),
                         dimension_numbers, preferred_element_type=jnp.float32,
                         out_sharding=out_sharding)
