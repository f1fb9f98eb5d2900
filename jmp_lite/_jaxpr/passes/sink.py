"""Downcasts moved past data movement, so that gradients are summed wide.

A policy casts a float32 parameter to the compute dtype and the model then
moves the narrow copy around before any arithmetic: a bias is broadcast over
the batch, an embedding table is gathered from, a kernel is reshaped. Each of
those ops transposes to a sum in the backward pass (``reduce_sum`` for a
broadcast, a scatter-add for a gather), and autodiff runs that sum in the
dtype the op ran in: the narrow one. Under ``jit`` with a sharded batch the
sum spans devices, and XLA's partitioner all-reduces its partial sums in that
dtype, whatever the policy's ``reduce_dtype`` says.

A downcast value passed into a ``jit`` call (``jnp.take`` is one) is passed
wide instead, and downcast at the top of the call's body, where the same
rewrite continues. A call that only returns its arguments (a telemetry
mark) is passed the wide value and downcast after it, where the rewrite
continues outside.

Elementwise ops broadcast size-1 dimensions themselves (``h + b[None]``) and
sum them back in their transpose, in their dtype: a downcast operand that
such an op broadcasts gets the broadcast made explicit, then moved past it.

Moving the downcast after the op (``convert(broadcast(w))`` for
``broadcast(convert(w))``) computes the same array, bit for bit: these ops
copy values without arithmetic. Its transpose is the sum in float32, then one
rounding; the partial sums cross devices in float32. The cost is the op's own
output in float32 when XLA does not fuse the convert into its consumer.

A narrow input of the jaxpr that no downcast made (a parameter stored in
bf16, ``p=bf16``), or a reshape of one, that a broadcast or a gather sums
in the backward pass gets an exact upcast first (``convert(w, float32)``),
and then the same rewrite: its gradient too is summed in float32 and
rounded once (a bf16 bias over 8,192 rows, each cotangent 100 / 32,768,
summed to 29.375 in bf16 against 25). Narrow values the jaxpr computes
(activations) are left as they are, and so are broadcasts that sum fewer
than `SUMMED_FROM` elements per result, as autocast leaves small reductions.
"""

from __future__ import annotations

import numpy as np

from jax import lax

from jmp_lite import _dtypes
from jmp_lite._jaxpr import internals as _internals
from jmp_lite._jaxpr import rebind as _rebind
from jmp_lite._jaxpr import traverse as _traverse

# Ops whose result is a selection or a copy of their first operand's values,
# whatever its dtype: the other operands (a gather's indices) are integers,
# and no parameter names a floating dtype. Broadcasts and gathers transpose to
# sums; reshapes (row-major bitcasts) are passed through on the way to one.
# Not transposes: XLA:CPU would run the downcast into a transposed layout,
# which its bf16 dot kernels refuse, and their transposes sum nothing.
MOVES = frozenset({
    "broadcast_in_dim", "gather", "reshape", "squeeze", "expand_dims"})
# A narrow value no downcast made is upcast for a broadcast that sums at least
# this many elements per value: autocast's `jmp_lite.oplists.MIN_REDUCTION_SIZE`
# (a public module, which the engine does not import; a test holds them equal).
SUMMED_FROM = 16
# Calls whose body sees its arguments as they are (``jnp.take`` is one): a
# downcast argument becomes a wide one, downcast at the top of the body.
CALLS = _rebind.CALLS
# Elementwise ops that broadcast size-1 dimensions of an operand implicitly.
BROADCASTING = frozenset({"add", "sub", "mul", "div", "max", "min", "add_any"})


def _is_var(v) -> bool:
  return isinstance(v, _internals.core.Var) and not isinstance(
      v, _internals.DropVar)


def sink(eqns: list, inputs=frozenset()) -> list:
  """``eqns`` with each downcast of a wider float moved past the moves reading it.

  A downcast stays where it is for its other readers (XLA drops it if none
  is left); each move of its result is rewired to read the wide value, and a
  downcast of the move's result takes the move's place.
  """
  wide_of = {}  # narrow var -> (its wide source, the downcast that made it)
  # Narrow inputs (parameters), and what size-keeping moves make of them.
  stored = {v for v in inputs if _is_var(v)}
  out = []

  def move(eqn, invars):
    """``eqn`` (a move of a downcast value) on the wide value, then a downcast."""
    wide, downcast = wide_of[eqn.invars[0]]
    narrow_out = eqn.outvars[0]
    wide_out = _internals.new_var(narrow_out.aval.update(
        dtype=wide.aval.dtype, weak_type=False))
    out.append(_internals.rewire(eqn, [wide, *invars[1:]], [wide_out]))
    # The downcast's own ``sharding`` is for its old shape; the new one keeps
    # what the move's output has.
    moved = _internals.replace_eqn(
        _internals.rewire(downcast, [wide_out], [narrow_out]),
        downcast.primitive, dict(downcast.params, sharding=None))
    out.append(moved)
    wide_of[narrow_out] = (wide_out, moved)

  def widen(v, at) -> None:
    """An exact upcast of narrow ``v``, which no downcast made, put before
    ``at`` (the op that reads it); the moves reading ``v`` then read it."""
    f32 = np.dtype(np.float32)
    cast = lambda src, dst, dtype: _internals.replace_eqn(
        _internals.rewire(at, [src], [dst]), lax.convert_element_type_p,
        {"new_dtype": dtype, "weak_type": False, "sharding": None})
    wide = _internals.new_var(v.aval.update(dtype=f32, weak_type=False))
    out.append(cast(v, wide, f32))
    # The template `move` downcasts with (never emitted itself).
    wide_of[v] = (wide, cast(wide, v, np.dtype(v.aval.dtype)))

  def summed(v, shape=None) -> bool:
    """Whether ``v``, a narrow input no downcast made, is broadcast to
    ``shape`` over at least `SUMMED_FROM` elements per value (None:
    gathered from, which sums any repeated index). A symbolic dimension
    (shape-polymorphic export) counts as large."""
    if not (_is_var(v) and v in stored and v not in wide_of
            and _dtypes.is_narrow_float(v.aval.dtype)):
      return False
    if shape is None:
      return True
    dims = (*shape, *v.aval.shape)
    if not all(isinstance(d, (int, np.integer)) for d in dims):
      return True
    return np.prod(shape) >= SUMMED_FROM * max(np.prod(v.aval.shape), 1)

  def into_call(eqn):
    """``eqn`` (a ``jit`` call) taking the wide values, its body downcasting."""
    (region,) = _traverse.regions(eqn)
    inner = region.jaxpr
    invars, outer, prelude = list(inner.invars), list(eqn.invars), []
    for i, v in enumerate(eqn.invars):
      if _is_var(v) and v in wide_of:
        wide, downcast = wide_of[v]
        w = _internals.new_var(invars[i].aval.update(
            dtype=wide.aval.dtype, weak_type=False))
        prelude.append(_internals.replace_eqn(
            _internals.rewire(downcast, [w], [invars[i]]), downcast.primitive,
            dict(downcast.params, sharding=None)))
        invars[i], outer[i] = w, wide
    if not prelude:
      return eqn
    body = inner.replace(invars=invars, eqns=sink(prelude + list(inner.eqns),
                                                  set(inner.invars) | set(inner.constvars)))
    return _rebind.with_body(eqn, body, region.consts, outer, eqn.outvars)

  def through_identity(eqn):
    """A ``jit`` call that returns its arguments (a telemetry mark,
    `_probes.tap`) passed downcast values.

    It takes the wide values and the downcasts follow it, so that the moves
    after it still see them: marking a value must not change the step (a
    mark reports in the dtype it was made in). Moving the downcast into the
    body instead, as for other calls, would leave it before those moves.
    """
    (region,) = _traverse.regions(eqn)
    inner = region.jaxpr
    if inner.eqns or list(inner.outvars) != list(inner.invars):
      return False
    invars, outvars, after = list(eqn.invars), list(eqn.outvars), []
    for i, v in enumerate(eqn.invars):
      if _is_var(v) and v in wide_of and _is_var(outvars[i]):
        wide, downcast = wide_of[v]
        w = _internals.new_var(outvars[i].aval.update(
            dtype=wide.aval.dtype, weak_type=False))
        moved = _internals.replace_eqn(
            _internals.rewire(downcast, [w], [outvars[i]]), downcast.primitive,
            dict(downcast.params, sharding=None))
        after.append(moved)
        wide_of[outvars[i]] = (w, moved)
        invars[i], outvars[i] = wide, w
    if not after:
      return False
    body_vars = [_internals.new_var(v.aval) for v in outvars]
    body = inner.replace(invars=body_vars, outvars=body_vars)
    out.append(_rebind.with_body(eqn, body, region.consts, invars, outvars))
    out.extend(after)
    return True

  for eqn in eqns:
    name = eqn.primitive.name
    if name in CALLS:
      if through_identity(eqn):
        continue
      out.append(into_call(eqn))
      continue
    if name in BROADCASTING and len(eqn.outvars) == 1:
      shape = tuple(eqn.outvars[0].aval.shape)
      invars = list(eqn.invars)
      for i, v in enumerate(invars):
        if summed(v, shape) and len(v.aval.shape) == len(shape):
          widen(v, eqn)
        if (_is_var(v) and v in wide_of and tuple(v.aval.shape) != shape
            and len(v.aval.shape) == len(shape)):
          # Sharded as the result is: on a mesh of explicit axes a
          # replicated full-size operand makes the backward pass gather the
          # whole batch of cotangents onto every device.
          sharding = _internals.explicit_sharding(eqn.outvars[0].aval)
          full = _internals.new_var(v.aval.update(shape=shape) if sharding is None
                                    else v.aval.update(shape=shape, sharding=sharding))
          broadcast = _internals.replace_eqn(
              _internals.rewire(eqn, [v], [full]), lax.broadcast_in_dim_p,
              {"shape": shape, "broadcast_dimensions": tuple(range(len(shape))),
               "sharding": sharding})
          move(broadcast, [v])
          invars[i] = full
      if invars != list(eqn.invars):
        eqn = _internals.rewire(eqn, invars, eqn.outvars)
    if name == "convert_element_type":
      src, dst = eqn.invars[0], eqn.outvars[0]
      if (_is_var(src) and _is_var(dst)
          and _dtypes.is_narrow_float(dst.aval.dtype)
          and np.issubdtype(src.aval.dtype, np.floating)
          and np.dtype(src.aval.dtype).itemsize > np.dtype(dst.aval.dtype).itemsize):
        wide_of[dst] = (src, eqn)
    elif name in MOVES and len(eqn.outvars) == 1 and (
        summed(eqn.invars[0], eqn.outvars[0].aval.shape) if name == "broadcast_in_dim"
        else name == "gather" and summed(eqn.invars[0])):
      widen(eqn.invars[0], eqn)
      move(eqn, eqn.invars)
      continue
    elif (name in MOVES and eqn.invars and _is_var(eqn.invars[0])
          and eqn.invars[0] in wide_of and len(eqn.outvars) == 1
          and _is_var(eqn.outvars[0])):
      move(eqn, eqn.invars)
      continue
    elif (name in MOVES and name != "gather" and eqn.invars
          and _is_var(eqn.invars[0]) and eqn.invars[0] in stored):
      stored.update(v for v in eqn.outvars if _is_var(v))
    out.append(eqn)
  return out
