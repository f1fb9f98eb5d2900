"""The interpreter behind `jmp_lite.autocast`: each equation in its dtype.

`eval_jaxpr` re-evaluates a jaxpr with the white/black/follow rules of
`jmp_lite.autocasting`; sub-jaxprs of control flow are rewritten with their
interface dtypes unchanged. White-listed matmuls bind the precision engine's
float32-accumulating primitives (`jmp_lite._jaxpr.accumulate`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import jax
import jax.extend as jex
import numpy as np
from jax import lax

from jmp_lite import _dtypes
from jmp_lite._jaxpr import accumulate as _accumulate
from jmp_lite._jaxpr import internals as _internals
from jmp_lite._jaxpr import rebind as _rebind
from jmp_lite._jaxpr import traverse as _traverse

_core = jex.core
# Black-listed ops that are reductions: float32 only when large.
# (max and min are exact in any dtype: black-listed, they run in float32 at any
# size, so that the softmax `x - max(x)` is computed in float32.)
_REDUCE_AXES = frozenset({"reduce_sum", "reduce_prod"})
_CUMULATIVE = frozenset({"cumsum", "cumprod", "cumlogsumexp"})
# Ops that move or copy elements without arithmetic: a float32 accumulator
# goes through them as it is (kept `_Wide`), so that a transposed or
# reshaped product (``(w @ x.T).T + b``, ``vmap(lambda v: w @ v + b)``)
# reaches a float32 consumer unrounded, like ``x @ w.T + b`` does.
_LAYOUT = frozenset({"transpose", "reshape", "broadcast_in_dim", "squeeze",
                     "expand_dims", "rev", "slice", "dynamic_slice", "copy", "copy_p"})
# Ops that must see the dtypes they were traced with.
_OPAQUE = frozenset({"bitcast_convert_type", "pure_callback", "io_callback",
                     "debug_callback", "xla_pmap"})


# ---------------------------------------------------------------------------
# Values. A white-listed op's float32 accumulator is kept as `_Wide`: it counts
# as compute dtype for the rules, and is rounded only where a consumer needs
# that dtype.


class _Wide:
  """A float32 accumulator that counts as ``dtype`` for the rules.

  A matmul's is computed when first read (``product``: its operands and
  parameters): a transpose that swaps its operands' dimensions takes the
  product of the swapped operands instead (`_transposed_product`), and the
  unswapped one is then never traced.
  """

  __slots__ = ("_value", "dtype", "product", "twin", "perm")

  def __init__(self, value, dtype, product=None):
    self._value, self.dtype, self.product = value, dtype, product
    # The same product with swapped operands, and the permutation that takes
    # the twin's value to this one's: whichever is read second is the
    # other's transpose, so that no product is computed twice.
    self.twin = self.perm = None

  @property
  def value(self):
    if self._value is None:
      (lhs, rhs), params, reduce, context = self.product
      with context():  # the matmul's own source line and name stack
        if self.twin is not None and self.twin._value is not None:
          self._value = lax.transpose(self.twin._value, self.perm)
        else:
          self._value = _accumulate.bind("dot_general", lhs, rhs, params, np.float32,
                                         reduce)
    return self._value


def _dtype(x):
  """``x``'s dtype; PRNG keys have extended dtypes, which NumPy cannot parse."""
  if isinstance(x, _Wide):
    return x.dtype
  return jax.typeof(x).dtype


def _is_float(dtype) -> bool:
  return (isinstance(dtype, np.dtype)
          and bool(jax.numpy.issubdtype(dtype, jax.numpy.floating)))


def _bits(dtype) -> int:
  return np.dtype(dtype).itemsize * 8


def _widest(dtypes: Iterable[np.dtype]) -> np.dtype:
  dtypes = set(map(np.dtype, dtypes))
  widest = max(dtypes, key=_bits)
  # bfloat16 and float16 side by side: neither holds the other.
  if sum(_bits(d) == _bits(widest) for d in dtypes) > 1:
    return np.dtype(np.float32) if _bits(widest) < 32 else widest
  return widest


def _as(x, dtype):
  """``x`` (rounded from its float32 accumulator if any) in ``dtype``."""
  if isinstance(x, _Wide):
    x = x.value
  return x if _dtype(x) == dtype else lax.convert_element_type(x, dtype)


def cast_to_aval(x, aval):
  x = _as(x, aval.dtype)
  if getattr(aval, "weak_type", False) and not jax.typeof(x).weak_type:
    x = _internals.convert_weak(x, aval.dtype)
  return x


# ---------------------------------------------------------------------------
# The interpreter.


def eval_jaxpr(jaxpr, consts, args, rules) -> list[Any]:
  return _internals.eval_jaxpr(
      jaxpr, consts, args, lambda eqn, invals: _eval_eqn(eqn, invals, rules))


_bind = _internals.bind


def _restore(eqn, invals):
  """Inputs in the dtypes the equation was traced with."""
  return [cast_to_aval(x, v.aval) for x, v in zip(invals, eqn.invars)]


def _has_jaxpr_params(params) -> bool:
  def is_jaxpr(p):
    if isinstance(p, (tuple, list)):
      return any(map(is_jaxpr, p))
    return isinstance(p, (_core.Jaxpr, _core.ClosedJaxpr))
  return any(map(is_jaxpr, params.values()))


def _eval_eqn(eqn, invals, rules):
  name = eqn.primitive.name
  if name in _rebind.PRIMITIVES:
    return _higher_order(eqn, invals, rules)
  if name == "convert_element_type":
    # An explicit cast: convert straight from the float32 accumulator.
    x = invals[0].value if isinstance(invals[0], _Wide) else invals[0]
    return _bind(eqn, [x])
  if name in _OPAQUE or "callback" in name:
    return _bind(eqn, _restore(eqn, invals))
  if _has_jaxpr_params(eqn.params):
    # Bodies without a rule here run as written (the op lists do not reach
    # them; the engine still makes their matmuls accumulate in float32).
    _traverse.warn_not_entered(eqn, "autocast")
    return _bind(eqn, _restore(eqn, invals))
  if name in rules.white:
    if _asks_for_precision(eqn.params.get("precision"), rules.compute):
      return _bind(eqn, _restore(eqn, invals))
    return _white(eqn, invals, rules)
  if name in rules.black and _is_large(eqn, rules):
    return _black(eqn, invals)
  if (name == "mul" and "square" in rules.black and eqn.invars[0] is eqn.invars[1]
      and isinstance(eqn.invars[0], _internals.core.Var)):
    # ``x * x`` is a square as ``x ** 2`` is (`jnp.linalg.norm`'s, a variance
    # written by hand): a bf16/f16 product that overflows where the float32
    # one does not (torch keeps ``norm`` in float32).
    return _black(eqn, invals)
  if (name in _LAYOUT and invals and isinstance(invals[0], _Wide)
      and not any(isinstance(x, _Wide) for x in invals[1:])):
    if name == "transpose":
      swapped = _transposed_product(invals[0], eqn.params["permutation"])
      if swapped is not None:
        return swapped
    out = _bind(eqn, [invals[0].value, *invals[1:]])
    return _Wide(out, invals[0].dtype)
  return _follow(eqn, invals)


def _transposed_product(wide, perm):
  """``transpose(a @ b, perm)`` as ``b @ a`` when ``perm`` puts ``b``'s free
  dimensions before ``a``'s (a weight gradient ``(x.T @ g).T``, a product
  under ``vmap``), else None.

  A float32 transpose of the product would cost a pass over it, where the
  rounded bf16 one used to be folded into the matmul by XLA; the swapped
  product needs no transpose at all.
  """
  if wide.product is None or wide._value is not None or wide.twin is not None:
    return None  # read already (or transposed already): transpose its value
  (lhs, rhs), params, reduce, context = wide.product
  (lc, rc), (lb, rb) = params["dimension_numbers"]
  nb = len(lb)
  n_lf = np.ndim(lhs) - len(lc) - nb
  n_rf = np.ndim(rhs) - len(rc) - nb
  swap = (*range(nb), *range(nb + n_lf, nb + n_lf + n_rf), *range(nb, nb + n_lf))
  if tuple(perm) != swap:
    return None
  params = dict(params, dimension_numbers=((rc, lc), (rb, lb)))
  swapped = _Wide(None, wide.dtype, ((rhs, lhs), params, reduce, context))
  swapped.twin, swapped.perm = wide, tuple(perm)
  wide.twin, wide.perm = swapped, tuple(int(i) for i in np.argsort(perm))
  return swapped


def _asks_for_precision(precision, compute) -> bool:
  """Whether a matmul's ``precision`` asks for more than ``compute`` operands give.

  ``Precision.HIGH``/``HIGHEST`` (full float32 products: what
  ``jax.scipy.linalg.expm``, ``jnp.linalg.lstsq`` and ``pinv`` ask for, and
  what an author writes to say "not in half"), or an algorithm preset whose
  operands cannot be ``compute`` (``F32_F32_F32``, ``TF32_TF32_F32``,
  ``BF16_BF16_F32_X3``; ``F16_F16_F32`` under bfloat16). Such a matmul runs
  at the dtypes it was traced with. (expm's Pade products in float16
  overflowed to NaN.)
  """
  if isinstance(precision, lax.DotAlgorithmPreset):
    types = precision.supported_lhs_types
    return types is not None and np.dtype(compute) not in map(np.dtype, types)
  if precision is None:
    return False
  parts = precision if isinstance(precision, (tuple, list)) else (precision,)
  return any(p in (lax.Precision.HIGH, lax.Precision.HIGHEST) for p in parts)


def _float_positions(eqn) -> list[int]:
  return [i for i, v in enumerate(eqn.invars) if _is_float(v.aval.dtype)]


def _white(eqn, invals, rules):
  floats = _float_positions(eqn)
  orig = [eqn.invars[i].aval.dtype for i in floats]
  if len(floats) < len(eqn.invars) or not floats or any(_bits(d) <= 8 for d in orig):
    # Integer, complex or fp8 (quantised) operands, alone or beside a real
    # float one, keep their dtypes (a half x int8 product would differentiate
    # through an int8 cotangent, and a complex x half one lose its imaginary
    # part); the engine gives an fp8 product float32 accumulation, as `wrap`
    # does.
    return _follow(eqn, invals)
  vals = [_as(x, rules.compute) if i in floats else x
          for i, x in enumerate(invals)]
  params = eqn.params
  accumulates = "preferred_element_type" in params
  name = eqn.primitive.name
  if (name in _accumulate.BY_BASE and len(vals) == 2
      and _dtypes.is_narrow_float(rules.compute)):
    # The engine's primitive: float32 accumulation here and in derivatives.
    if name == "dot_general":  # traced when read (`_Wide`), in this context
      return _Wide(None, rules.compute, (tuple(vals), params, rules.reduce,
                                         _internals.context_here(eqn)))
    return _Wide(_accumulate.bind(name, *vals, params, np.float32, rules.reduce),
                 rules.compute)
  if accumulates:
    acc = _widest([np.dtype(np.float32), *orig])
    params = dict(params, preferred_element_type=acc)
  out = _bind(eqn, vals, params)

  def label(y):
    if accumulates and _is_float(_dtype(y)):
      return _Wide(y, rules.compute)
    return y

  if eqn.primitive.multiple_results:
    return [label(y) for y in out]
  return label(out)


def _is_large(eqn, rules) -> bool:
  name = eqn.primitive.name
  shape = eqn.invars[0].aval.shape if eqn.invars else ()
  if name in _REDUCE_AXES:
    size = math.prod(shape[a] for a in eqn.params["axes"])
  elif name == "reduce_window_sum":  # pooling: the window's size
    size = math.prod(eqn.params["window_dimensions"])
  elif name in _CUMULATIVE:
    size = shape[eqn.params["axis"]]
  else:
    return True
  return size >= rules.min_reduction_size


def _black(eqn, invals):
  floats = _float_positions(eqn)
  orig = {eqn.invars[i].aval.dtype for i in floats}
  current = [_dtype(invals[i]) for i in floats]
  f32 = np.dtype(np.float32)
  if len(orig) == 1:
    target = _widest([f32, *current])
    targets = {i: target for i in floats}
  else:  # e.g. a psum of several differently typed operands.
    targets = {i: _widest([f32, d]) for i, d in zip(floats, current)}
  vals = [_as(x, targets[i]) if i in targets else x
          for i, x in enumerate(invals)]
  return _bind(eqn, vals)


def _follow(eqn, invals):
  floats = _float_positions(eqn)
  current = {i: _dtype(invals[i]) for i in floats}
  orig = {i: eqn.invars[i].aval.dtype for i in floats}
  if current == orig or len(set(orig.values())) != 1:
    return _bind(eqn, _restore(eqn, invals))
  ranked = [i for i in floats if eqn.invars[i].aval.ndim > 0]

  def votes(i):
    v = eqn.invars[i]
    weak = (isinstance(v, _core.Literal) or v.aval.weak_type
            or (ranked and v.aval.ndim == 0))
    return not weak

  voters = [current[i] for i in floats if votes(i)] or list(current.values())
  target = _widest(voters)
  vals = [_as(x, target) if i in current else x for i, x in enumerate(invals)]
  return _bind(eqn, vals)


# ---------------------------------------------------------------------------
# Sub-jaxprs: rewritten with these rules and bound again by `rebind`, which
# knows each primitive's constants. Their interface dtypes stay as traced,
# except where a call is inlined and a checkpoint's body is traced at its
# operands' dtypes (`rebind.FREE_TYPED`).


def _body(name, rules):
  """`rebind`'s ``body``: a closed jaxpr evaluated with ``rules``."""
  def body(closed):
    def fn(*args):
      outs = eval_jaxpr(closed.jaxpr, closed.consts, args, rules)
      if name == "remat2":
        return [_as(x, _dtype(x)) for x in outs]
      if name in _rebind.FREE_TYPED:
        return outs
      return [cast_to_aval(x, a) for x, a in zip(outs, closed.out_avals)]
    return fn
  return body


def _higher_order(eqn, invals, rules):
  name = eqn.primitive.name
  if name == "remat2":
    vals = [_as(x, _dtype(x)) for x in invals]
  elif name in _rebind.FREE_TYPED:
    vals = invals
  else:
    vals = _restore(eqn, invals)
  return _rebind.rebind(eqn, vals, _body(name, rules))
