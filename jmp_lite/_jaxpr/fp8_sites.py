"""An fp8 matmul site: one ``dot_general`` on fp8 operands, and its two transposes.

`jmp_lite._jaxpr.passes.instrument` replaces a chosen ``dot_general`` (or the engine's
float32-accumulating ``jmp_dot_general``) by `matmul`, which computes what
Transformer Engine's fp8 GEMMs compute:

* forward: each operand quantised to e4m3 (`jmp_lite.fp8.quantize`: float32
  arithmetic, one rounding), one ``dot_general`` of the two fp8 arrays
  accumulating in float32, times the two dequantisation scales, rounded once
  to the equation's output dtype;
* backward: the output cotangent quantised to e5m2, and the two products of
  the transposes, e5m2 x e4m3, in the same form; the operands' own
  gradients pass straight through the quantisers.

The ``dot_general``s are written on fp8 arrays, so no compiler can fold the
quantisation away: XLA:GPU has to pick an fp8 GEMM (on GPUs with fp8 units,
``__cublas$lt$matmul$f8``), and XLA:CPU computes the same product of the same
fp8 values by converting them to float32. The pattern Flax's
``Fp8DotGeneralOp`` emits instead (``convert`` to fp8 and back, then a dot
in the compute dtype) is one XLA:GPU's default excess precision removes,
leaving a bf16 GEMM of the unquantised operands.

The backward pass keeps the fp8 operands and the scales as its residuals,
not dequantised copies: a byte per element.

The three scales come in through one float32 ``[6]`` slice of the carrier
(lhs, rhs, gradient, then the three factors ``1 / scale`` that quantise).
The operands' absolute maxima are an output of the forward pass (so a site
no gradient reaches, behind ``stop_gradient``, is measured too), and the
gradient's goes back as its scale's cotangent, in the same pass: the site is
used once per carrier row, so the cotangent is exactly the maximum, never a
sum.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
from typing import NamedTuple, Optional

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _exact
from jmp_lite import _fp8_blocks
from jmp_lite import _fp8_numerics
from jmp_lite._jaxpr import probes as _probes
from jmp_lite import _replicas

ROLES = 3  # lhs, rhs, gradient
# A site's slice of the carrier: the three scales, then their reciprocals
# (computed for every site of a step at once, `jmp_lite.fp8.reciprocal`,
# outside the differentiated function). The cotangent of the first three is
# the three maxima; of the last three, zero.
WIDTH = 2 * ROLES

MARK = "jmp_lite_fp8"  # name scope wrap opens around an fp8 module's call


# Whether a pass that places fp8 sites is tracing: a model whose policy has
# fp8 called outside one runs its matmuls at the compute dtype (the marks are
# name scopes and do nothing by themselves), which wrap warns of.
_PLACING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "jmp_lite_fp8_placing", default=False)


@contextlib.contextmanager
def placing(active: bool = True):
  """Marks the ``with`` block as traced by a pass that places fp8 sites."""
  token = _PLACING.set(active)
  try:
    yield
  finally:
    _PLACING.reset(token)


def placed() -> bool:
  """Whether the code running now is traced by a pass placing fp8 sites."""
  return _PLACING.get()


def mark(recipe: Optional[str], path: str) -> str:
  """The name scope wrap opens around a module's call when fp8 rules exist.

  The step (`jmp_lite._jaxpr.passes.plan.Fp8Selection`) reads the innermost one of a
  matmul: its recipe (or ``off``) and the module path that names the site.
  """
  return f"{MARK}={recipe or 'off'}@{path.replace('/', '.')}"


def _amax(x) -> jax.Array:
  """max |x| of the values ``x`` holds (read through `_exact.widen`: XLA:GPU
  may otherwise measure a bf16 value it kept in float32), inf if any is not
  finite. A NaN is read as inf: a maximum split across devices (a sharded
  ``jnp.max``) dropped one shard's NaN and kept the others' finite maxima,
  where one device got NaN (recorded as 0, "nothing seen"), so the state
  depended on the device layout; inf wins every maximum."""
  v = jnp.abs(_exact.widen(x))
  return jnp.max(jnp.where(jnp.isnan(v), jnp.inf, v)).astype(jnp.float32)


def _non_finite(x, contract, batch) -> jax.Array:
  """Whether each (batch..., free...) slice of ``x`` holds a NaN or inf along
  the contracted dimensions: where a product's outputs are non-finite."""
  free = [d for d in range(x.ndim) if d not in contract and d not in batch]
  bad = jnp.transpose(~jnp.isfinite(_exact.widen(x)), (*batch, *free, *contract))
  return jnp.any(bad, axis=tuple(range(len(batch) + len(free), x.ndim)))


def _propagate(out, amax, dimension_numbers, lhs, rhs=None):
  """``out`` with NaN wherever a non-finite value of ``lhs`` (or ``rhs``) enters.

  Quantising saturates: a finite fp8 product can come from an inf operand.
  XLA:GPU's fp8 GEMM rewrite folds the clamp of `quantize_by` into cuBLASLt,
  which saturates inf too, so on an H200 an infinite loss gave finite
  gradients and the guard applied the step (a CPU skipped it). Marking the
  outputs from the operands, which are read before quantising, keeps what a
  float matmul makes non-finite non-finite on every backend. Only when a
  maximum in ``amax`` is not finite (a `cond`): the common step pays nothing
  but the maxima it already reads, and finite results keep their bits.
  """
  def mark(out):
    (lc, rc), (lb, rb) = dimension_numbers
    bad = _non_finite(lhs, lc, lb)  # batch..., lhs free...
    n_left = bad.ndim - len(lb)
    n_right = out.ndim - len(lb) - n_left
    bad = bad.reshape(bad.shape + (1,) * n_right)
    if rhs is not None:
      right = _non_finite(rhs, rc, rb)  # batch..., rhs free...
      bad = bad | right.reshape(right.shape[:len(rb)] + (1,) * n_left
                                + right.shape[len(rb):])
    return jnp.where(bad, jnp.asarray(jnp.nan, out.dtype), out)

  return lax.cond(jnp.all(jnp.isfinite(amax)), lambda o: o, mark, out)


def _scaled_dot(a, b, dimension_numbers, scale_a, scale_b, out_sharding=None):
  """``dot_general(a, b)`` of fp8 arrays in float32, times both scales.

  One scale at a time: their product could overflow (or underflow) float32
  where the result does not.
  """
  out = lax.dot_general(a, b, dimension_numbers, preferred_element_type=jnp.float32,
                        out_sharding=out_sharding)
  return out * scale_a * scale_b


def _typed_sharding(x):
  """``x``'s sharding where its type carries one (a mesh of explicit axes,
  replicated included), else None (as `accumulate`'s cotangents read it)."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if getattr(sharding, "spec", None) is None or mesh is None or getattr(mesh, "empty", True):
    return None
  return sharding


def _before_transpose(sharding, perm):
  """The sharding of a product that ``transpose(., perm)`` turns into an
  operand of ``sharding`` (None without explicit mesh axes). Under explicit
  axes a product contracting a sharded dimension (a weight gradient, over
  the batch) must be told it: the operand's own, before the transpose."""
  if sharding is None:
    return None
  spec = tuple(sharding.spec) + (None,) * (len(perm) - len(sharding.spec))
  out = [None] * len(perm)
  for i, p in enumerate(perm):
    out[p] = spec[i]
  return sharding.update(spec=jax.sharding.PartitionSpec(*out))


def _remaining(n, *removed):
  gone = set(itertools.chain(*removed))
  return [i for i in range(n) if i not in gone]


def _lhs_transpose(dimension_numbers, x_ndim, y_ndim, swap_ans=False):
  """The dimension numbers and permutation of ``dot_general``'s lhs transpose.

  Transcribed from JAX's ``_dot_general_transpose_lhs``
  (jax/_src/lax/lax.py, jax 0.10.2): the cotangent of ``x`` in
  ``dot_general(x, y)`` is ``transpose(dot_general(g, y, dims), perm)``.
  Returns ``(dims, perm)``.
  """
  (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
  x_kept = _remaining(x_ndim, x_contract, x_batch)
  y_kept = _remaining(y_ndim, y_contract, y_batch)
  nb = len(x_batch)
  ans_batch = list(range(nb))
  if swap_ans:  # the answer's axes: batch, y's kept, x's kept
    ans_y = list(range(nb, nb + len(y_kept)))
  else:  # batch, x's kept, y's kept
    ans_y = list(range(nb + len(x_kept), nb + len(x_kept) + len(y_kept)))
  dims = ((tuple(ans_y), tuple(y_kept)), (tuple(ans_batch), tuple(y_batch)))
  x_contract_by_y = [int(x_contract[i]) for i in np.argsort(np.asarray(y_contract, int))]
  unsorted = list(x_batch) + x_kept + x_contract_by_y
  return dims, tuple(int(i) for i in np.argsort(unsorted))


def _transposes(dimension_numbers, lhs_ndim, rhs_ndim):
  """``((dims, perm) of the lhs cotangent, (dims, perm) of the rhs one)``:
  each is ``transpose(dot_general(g, other operand, dims), perm)``."""
  (lc, rc), (lb, rb) = dimension_numbers
  return (_lhs_transpose(dimension_numbers, lhs_ndim, rhs_ndim),
          _lhs_transpose(((rc, lc), (rb, lb)), rhs_ndim, lhs_ndim, swap_ans=True))


class _Static(NamedTuple):
  """What a site's derivative rules know statically (hashable)."""
  dimension_numbers: tuple
  out_dtype: np.dtype
  lhs: jax.ShapeDtypeStruct  # shape and dtype of each operand
  rhs: jax.ShapeDtypeStruct
  forward: np.dtype  # the operands' fp8 format
  backward: np.dtype  # the gradient's
  axes: tuple  # the manual axes the carrier varies over
  scaling: str
  # Explicit mesh axes: each operand's sharding and the product's, else None.
  shardings: tuple = (None, None, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _matmul(lhs, rhs, carrier, amax, static):
  return _forward(lhs, rhs, carrier, amax, static, need_lhs=False, need_rhs=False)[0]


def _matmul_fwd(lhs, rhs, carrier, amax, static):
  # Symbolic zeros: an operand nothing differentiates (a model's input, a
  # frozen weight) needs no cotangent, so the other operand's fp8 copy,
  # which only that cotangent reads, is not kept.
  return _forward(lhs.value, rhs.value, carrier.value, amax.value, static,
                  need_lhs=lhs.perturbed, need_rhs=rhs.perturbed)


def _forward(lhs, rhs, carrier, amax, static, *, need_lhs, need_rhs):
  """The product, and the residuals the wanted cotangents need (``amax``:
  the two operands' absolute maxima)."""
  if static.scaling == "block":
    out, residuals = _blocks_fwd(lhs, rhs, static, need_lhs, need_rhs)
    return _propagate(out, amax, static.dimension_numbers, lhs, rhs), residuals
  if static.scaling == "current":  # this step's maxima decide (the carrier's are not read)
    factors, scales = _fp8_numerics.current_scaling(amax, static.forward)
  else:
    scales, factors = carrier[:2], carrier[ROLES:ROLES + 2]
  q_lhs = _fp8_numerics.quantize_by(lhs, static.forward, factors[0])
  q_rhs = _fp8_numerics.quantize_by(rhs, static.forward, factors[1])
  out = _scaled_dot(q_lhs, q_rhs, static.dimension_numbers, scales[0], scales[1],
                    static.shardings[2])
  # The gradient's scale and factor, for the backward pass (unused when current).
  g_meta = jnp.stack([carrier[2], carrier[ROLES + 2]])
  out = _propagate(out, amax, static.dimension_numbers, lhs, rhs)
  return out.astype(static.out_dtype), (q_lhs if need_rhs else None,
                                        q_rhs if need_lhs else None, scales, g_meta)


def _matmul_bwd(static, residuals, g):
  if isinstance(g, jax.custom_derivatives.SymbolicZero):
    g = jnp.zeros(g.shape, g.dtype)
  amax_g = _amax(g)
  if static.scaling == "block":
    d_lhs, d_rhs = _blocks_bwd(static, residuals, g, amax_g)
  else:
    q_lhs, q_rhs, scales, g_meta = residuals
    if static.scaling == "current":
      factor, scale = _fp8_numerics.current_scaling(amax_g[None], static.backward)
      factor, scale = factor[0], scale[0]
    else:
      scale, factor = g_meta[0], g_meta[1]
    q_g = _fp8_numerics.quantize_by(g, static.backward, factor)
    (dims_l, perm_l), (dims_r, perm_r) = _transposes(
        static.dimension_numbers, static.lhs.ndim, static.rhs.ndim)
    at_l, at_r = (_before_transpose(sh, perm) for sh, perm in
                  zip(static.shardings[:2], (perm_l, perm_r)))
    d_lhs = None if q_rhs is None else lax.transpose(_propagate(
        _scaled_dot(q_g, q_rhs, dims_l, scale, scales[1], at_l), amax_g, dims_l, g), perm_l)
    d_rhs = None if q_lhs is None else lax.transpose(_propagate(
        _scaled_dot(q_g, q_lhs, dims_r, scale, scales[0], at_r), amax_g, dims_r, g), perm_r)
  found = _probes._varying(
      jnp.zeros((WIDTH,), jnp.float32).at[ROLES - 1].set(amax_g), static.axes)
  return (None if d_lhs is None else d_lhs.astype(static.lhs.dtype),
          None if d_rhs is None else d_rhs.astype(static.rhs.dtype), found, None)


def _blocks_fwd(lhs, rhs, static, need_lhs, need_rhs):
  """Block scaling: each operand quantised along the forward contraction, and
  once more along the contraction of the backward product it enters (its
  residual, a byte an element and a scale a block)."""
  a_axis, b_axis = _fp8_blocks.axes(static.dimension_numbers)
  q_lhs, e_lhs = _fp8_blocks.quantize(lhs, a_axis, static.forward)
  q_rhs, e_rhs = _fp8_blocks.quantize(rhs, b_axis, static.forward)
  out = _fp8_blocks.dot(q_lhs, e_lhs, a_axis, q_rhs, e_rhs, b_axis,
                        static.dimension_numbers, static.shardings[2]).astype(static.out_dtype)
  (dims_l, _), (dims_r, _) = _transposes(static.dimension_numbers, lhs.ndim, rhs.ndim)
  _, rhs_axis = _fp8_blocks.axes(dims_l)  # d_lhs contracts g with rhs
  _, lhs_axis = _fp8_blocks.axes(dims_r)  # d_rhs contracts g with lhs
  return out, (_fp8_blocks.quantize(lhs, lhs_axis, static.forward) if need_rhs else None,
               _fp8_blocks.quantize(rhs, rhs_axis, static.forward) if need_lhs else None)


def _blocks_bwd(static, residuals, g, amax_g):
  lhs_copy, rhs_copy = residuals
  (dims_l, perm_l), (dims_r, perm_r) = _transposes(static.dimension_numbers,
                                                   static.lhs.ndim, static.rhs.ndim)

  def transpose(copy, dims, perm, sharding):
    """One operand's gradient: ``g`` block-quantised along the product's
    contraction with the other operand's kept copy."""
    if copy is None:
      return None
    g_axis, copy_axis = _fp8_blocks.axes(dims)
    q_g, e_g = _fp8_blocks.quantize(g, g_axis, static.backward)
    product = _fp8_blocks.dot(q_g, e_g, g_axis, *copy, copy_axis, dims,
                              _before_transpose(sharding, perm))
    return lax.transpose(_propagate(product, amax_g, dims, g), perm)

  return (transpose(rhs_copy, dims_l, perm_l, static.shardings[0]),
          transpose(lhs_copy, dims_r, perm_r, static.shardings[1]))


_matmul.defvjp(_matmul_fwd, _matmul_bwd, symbolic_zeros=True)


def matmul(lhs, rhs, carrier, dimension_numbers, out_dtype,
           forward=_fp8_numerics.FORMATS["e4m3"], backward=_fp8_numerics.FORMATS["e5m2"],
           scaling="delayed", out_sharding=None) -> tuple[jax.Array, jax.Array]:
  """``dot_general(lhs, rhs, dimension_numbers)`` as an fp8 GEMM, in ``out_dtype``.

  Returns ``(product, amax)``: ``amax`` float32 ``[2]``, the operands'
  absolute maxima (typed varying like ``carrier`` under ``shard_map``).

  Args:
    lhs, rhs: the operands, in the compute dtype.
    carrier: float32 ``[6]``: the lhs, rhs and gradient dequantisation
      scales, then their reciprocals (`jmp_lite._fp8_numerics.site_carrier`); the cotangent is
      the gradient's absolute maximum in the third place, zeros elsewhere.
    dimension_numbers: ``dot_general``'s.
    out_dtype: the product's dtype (the equation's).
    out_sharding: the product's sharding under explicit mesh axes (the
      equation's ``out_sharding``; the cotangents take their operands').
    forward, backward: the fp8 formats of the operands and of the gradient.
    scaling: ``"delayed"`` (the carrier's scales), ``"current"`` (each
      tensor's scale from its own maximum, `jmp_lite._fp8_numerics.current_scaling`)
      or ``"block"`` (a power-of-two scale per 32 values along the
      contraction, `jmp_lite._fp8_blocks`).
  """
  axes = tuple(sorted(_replicas.varying_axes(carrier)))
  dimension_numbers = tuple(tuple(tuple(int(i) for i in d) for d in pair)
                            for pair in dimension_numbers)
  static = _Static(dimension_numbers, np.dtype(out_dtype),
                   jax.ShapeDtypeStruct(lhs.shape, lhs.dtype),
                   jax.ShapeDtypeStruct(rhs.shape, rhs.dtype),
                   np.dtype(forward), np.dtype(backward), axes, scaling,
                   (_typed_sharding(lhs), _typed_sharding(rhs), out_sharding))
  amax = jax.lax.stop_gradient(jnp.stack([_amax(lhs), _amax(rhs)]))
  return _matmul(lhs, rhs, carrier, amax, static), _probes._varying(amax, axes)
