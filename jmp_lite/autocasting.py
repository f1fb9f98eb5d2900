"""Op-level autocast: PyTorch/Paddle/MindSpore "O1" for any JAX function.

`autocast` traces a function to a jaxpr and evaluates that jaxpr again with
each equation's dtypes chosen by three rules:

* **white list** (run in the compute dtype): floating operands are cast to the
  compute dtype (bfloat16 by default) and the op accumulates in float32 through
  ``preferred_element_type``. The result counts as compute dtype for the rules
  below, but autocast keeps the float32 accumulator and hands it unrounded to a
  consumer that runs in float32 (a bias add, a softmax): autocast itself never
  rounds a value to half precision and back. (``dot_general`` operands are
  also put in the canonical ``[batch, free, contract] x [batch, contract,
  free]`` layout: XLA folds the transposes, and XLA:CPU rejects some other
  layouts of a bf16 x bf16 -> f32 dot at run time.)
* **black list** (run in float32): floating operands narrower than float32 are
  upcast; the result is float32. Reductions are black-listed only when they
  are *large*: when they combine at least ``min_reduction_size`` elements
  (default 16) into each output. bfloat16 keeps 8 significant bits, so a
  running sum of 16 similar terms is already 16x a term and keeps only 4 bits
  of each new one; smaller sums and products stay in their input dtype.
  ``reduce_max`` is exact in any dtype and runs in float32 at every size, so
  that softmax's ``x - max(x)`` is a float32 subtraction.
* **everything else** follows its widest floating input. Scalars (literals,
  rank-0 operands next to arrays) and weakly typed operands do not vote, as
  Python scalars do not in JAX's promotion; an op whose floating operands had
  different dtypes in the original program keeps those dtypes.

Default lists, next to the lists they mirror: PyTorch's CUDA autocast op
reference, and MindSpore 2.3's ``auto_mixed_precision`` built-in lists (its
white list is what ``amp_level="O1"`` casts; its black list is what ``"O2"``
keeps in float32; MindSpore O1 has no per-op float32 list, so ops outside the
white list run as written):

====================  ======================================  ==============================
jaxpr primitives      PyTorch ``torch.autocast``              MindSpore
====================  ======================================  ==============================
**white**
dot_general           matmul, mm, bmm, addmm, linear...       MatMul, BatchMatMul, nn.Dense
conv_general_dilated  conv1d/2d/3d, conv_transpose1d/2d/3d    nn.Conv1d/2d/3d and Transpose
**black**
exp, exp2, expm1      exp, expm1                              --
log, log1p            log, log10, log2, log1p                 --
pow                   pow                                     --
rsqrt                 rsqrt, layer_norm, group_norm, norm     nn.LayerNorm, nn.BatchNorm*d
logistic              binary_cross_entropy_with_logits        --
erf_inv               erfinv                                  --
acos, asin, cosh,     acos, asin, cosh, sinh, tan             --
sinh, tan
reduce_sum, _prod     sum, prod                               --
reduce_max            softmax, log_softmax                    --
cumsum, cumprod,      cumsum, cumprod                         --
cumlogsumexp
psum, reduce_scatter  (FSDP's ``reduce_dtype``)               --
====================  ======================================  ==============================

Softmax, log-softmax, logsumexp and layer/RMS normalisation are built from
these pieces in JAX, so they run in float32 as a whole: ``reduce_max``,
``exp``, ``reduce_sum``, ``log`` and ``rsqrt`` are black, and the ``sub`` and
``div`` between them follow their (now float32) inputs.

Custom lists follow Paddle's ``custom_white_list``/``custom_black_list``: they
are added to the defaults, and naming an op in one list removes it from the
other.

Structure and composition:

* The rewrite runs on the precision engine shared with `jmp_lite.flax.wrap`:
  white-listed matmuls and convolutions become the engine's float32-
  accumulating primitives, whose derivatives accumulate in float32 too. So
  ``jax.grad(autocast(f))`` runs its backward matmuls on half x half operands
  like ``autocast(jax.grad(f))`` does, and ``jax.jvp``, ``jax.hessian`` and
  ``jax.vmap`` of an autocast function compose the same way.
* ``jit``/``pjit`` calls are inlined; ``checkpoint`` (``remat2``) is rebuilt
  around the rewritten body with the same policy.
* ``scan``, ``while``, ``cond``, ``shard_map``, ``custom_jvp_call`` and
  ``custom_vjp_call`` bodies are rewritten with their interface dtypes
  unchanged (loop carries keep their dtype), so a custom derivative rule still
  sees the dtypes it was written for. The custom rules themselves (a custom
  JVP, a custom VJP's backward) keep their dtypes, and their half-precision
  matmuls accumulate in float32.
* Other primitives that carry jaxprs get their original input dtypes back
  and run as written, with the engine's float32 accumulation inside; what the
  engine cannot see into is reported (``strict=True`` makes it an error).
* PRNG keys and other non-numeric values pass through untouched, so dropout
  works under autocast.
* The autocast function returns exactly the dtypes ``fun`` returns, so it is a
  drop-in replacement. Called outside any transformation it runs compiled and
  cached by argument structure, so repeated calls do not trace again.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable
from typing import Any, Optional

import jax
import jax.extend as jex
import numpy as np
from jax import lax

from jmp_lite import _accumulate
from jmp_lite import _engine
from jmp_lite import _internals
from jmp_lite.oplists import CUMULATIVE as _CUMULATIVE
from jmp_lite.oplists import DEFAULT_BLACK_LIST
from jmp_lite.oplists import DEFAULT_WHITE_LIST
from jmp_lite.oplists import MIN_REDUCTION_SIZE
from jmp_lite.oplists import PrimitiveLike
from jmp_lite.oplists import REDUCE_AXES as _REDUCE_AXES
from jmp_lite.oplists import primitive_name
from jmp_lite.policy import Policy, get_policy

__all__ = ("autocast", "primitive_name", "DEFAULT_WHITE_LIST",
           "DEFAULT_BLACK_LIST", "MIN_REDUCTION_SIZE")

_core = jex.core
# Ops that must see the dtypes they were traced with.
_OPAQUE = frozenset({"bitcast_convert_type", "pure_callback", "io_callback",
                     "debug_callback", "xla_pmap"})

@dataclasses.dataclass(frozen=True)
class _Rules:
  compute: np.dtype
  white: frozenset[str]
  black: frozenset[str]
  min_reduction_size: int


def _compute_dtype(policy_or_dtype) -> np.dtype:
  if isinstance(policy_or_dtype, str):
    policy_or_dtype = get_policy(policy_or_dtype)
  if isinstance(policy_or_dtype, Policy):
    p = policy_or_dtype
    return p.autocast_dtype if p.autocast_dtype is not None else p.compute_dtype
  try:
    dtype = np.dtype(jax.numpy.dtype(policy_or_dtype))
  except TypeError as e:
    raise TypeError(f"autocast expects a Policy, a policy string or a dtype,"
                    f" got {policy_or_dtype!r}.") from e
  if not jax.numpy.issubdtype(dtype, jax.numpy.floating):
    raise ValueError(f"autocast needs a floating compute dtype, got {dtype}.")
  return dtype


def _make_rules(policy_or_dtype, white_list, black_list, min_reduction_size):
  white_extra = frozenset(map(primitive_name, white_list or ()))
  black_extra = frozenset(map(primitive_name, black_list or ()))
  both = white_extra & black_extra
  if both:
    raise ValueError(f"{sorted(both)} given in both white_list and black_list.")
  if min_reduction_size < 1:
    raise ValueError(f"min_reduction_size must be >= 1, got"
                     f" {min_reduction_size}.")
  return _Rules(
      compute=_compute_dtype(policy_or_dtype),
      white=(DEFAULT_WHITE_LIST - black_extra) | white_extra,
      black=(DEFAULT_BLACK_LIST - white_extra) | black_extra,
      min_reduction_size=min_reduction_size)


def autocast(fun: Callable[..., Any],
             policy_or_dtype: Any,
             *,
             white_list: Optional[Iterable[PrimitiveLike]] = None,
             black_list: Optional[Iterable[PrimitiveLike]] = None,
             min_reduction_size: int = MIN_REDUCTION_SIZE,
             strict: bool = False) -> Callable[..., Any]:
  """Returns ``fun`` with per-op precision: matmuls in half, fragile ops in f32.

  See the module docstring for the rules and the default lists.

  Args:
    fun: a function of arrays (pytrees of arrays and Python scalars; bind other
      arguments with `functools.partial`).
    policy_or_dtype: the compute dtype of white-listed ops: a dtype, a
      `Policy` (its ``autocast_dtype`` if set, else its ``compute_dtype``) or a
      string `jmp_lite.get_policy` parses (``"O1"``, ``"bf16"``).
    white_list: extra ops to run in the compute dtype, by primitive name,
      `Primitive` or ``jax.lax`` function. They are removed from the black list.
    black_list: extra ops to run in float32; removed from the white list.
    min_reduction_size: black-listed reductions combining fewer elements than
      this into each output follow their input dtype instead.
    strict: raise `jmp_lite.UncoveredMatmulError` instead of warning when a
      computation the engine cannot see into (a primitive JAX does not
      define, an FFI call) takes half-precision operands.

  Returns:
    A function with ``fun``'s signature and output dtypes.

  Raises:
    ValueError: for an unknown op name, an op in both lists, or a non-floating
      dtype.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> def layer(w, x):
    ...   return jax.nn.softmax(x @ w)
    >>> w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
    >>> fast = autocast(layer, jnp.bfloat16)
    >>> fast(w, x).dtype
    dtype('float32')
    >>> from jmp_lite.auditing import audit
    >>> report = audit(fast, w, x)
    >>> report.count(primitive="dot_general", operand_dtype=jnp.bfloat16,
    ...              accumulation=jnp.float32)
    1
    >>> report.count(primitive="exp", operand_dtype=jnp.float32)
    1
  """
  rules = _make_rules(policy_or_dtype, white_list, black_list,
                      min_reduction_size)

  @functools.wraps(fun)
  def interpreted(*args, **kwargs):
    # Array leaves are traced; other leaves (a Flax module, flags) are passed
    # as they are.
    leaves, in_tree = jax.tree_util.tree_flatten((args, kwargs))
    traced = [i for i, x in enumerate(leaves)
              if isinstance(x, (jax.Array, np.ndarray))]
    flat = [leaves[i] for i in traced]
    out_trees = []

    def flat_fun(*flat_args):
      full = list(leaves)
      for i, x in zip(traced, flat_args):
        full[i] = x
      a, k = jax.tree_util.tree_unflatten(in_tree, full)
      out, out_tree = jax.tree_util.tree_flatten(fun(*a, **k))
      out_trees.append(out_tree)
      return out

    closed = jax.make_jaxpr(flat_fun)(*flat)
    outs = _eval_jaxpr(closed.jaxpr, closed.consts, flat, rules)
    outs = [_cast_to_aval(x, a) for x, a in zip(outs, closed.out_avals)]
    return jax.tree_util.tree_unflatten(out_trees[-1], outs)

  # The engine traces the interpreted function once per argument structure
  # and gives every matmul the interpreter leaves narrow (custom rules,
  # opaque bodies) float32 accumulation.
  return _engine.accumulate(interpreted, strict=strict)


# ---------------------------------------------------------------------------
# Values. A white-listed op's float32 accumulator is kept as `_Wide`: it counts
# as compute dtype for the rules, and is rounded only where a consumer needs
# that dtype.


class _Wide:
  __slots__ = ("value", "dtype")

  def __init__(self, value, dtype):
    self.value, self.dtype = value, dtype


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


def _cast_to_aval(x, aval):
  x = _as(x, aval.dtype)
  if getattr(aval, "weak_type", False) and not jax.typeof(x).weak_type:
    x = _internals.convert_weak(x, aval.dtype)
  return x


# ---------------------------------------------------------------------------
# The interpreter.


def _eval_jaxpr(jaxpr, consts, args, rules: _Rules) -> list[Any]:
  return _internals.eval_jaxpr(
      jaxpr, consts, args, lambda eqn, invals: _eval_eqn(eqn, invals, rules))


_bind = _internals.bind


def _restore(eqn, invals):
  """Inputs in the dtypes the equation was traced with."""
  return [_cast_to_aval(x, v.aval) for x, v in zip(invals, eqn.invars)]


def _has_jaxpr_params(params) -> bool:
  def is_jaxpr(p):
    if isinstance(p, (tuple, list)):
      return any(map(is_jaxpr, p))
    return isinstance(p, (_core.Jaxpr, _core.ClosedJaxpr))
  return any(map(is_jaxpr, params.values()))


def _eval_eqn(eqn, invals, rules: _Rules):
  name = eqn.primitive.name
  if name in _HIGHER_ORDER:
    return _HIGHER_ORDER[name](eqn, invals, rules)
  if name == "convert_element_type":
    # An explicit cast: convert straight from the float32 accumulator.
    x = invals[0].value if isinstance(invals[0], _Wide) else invals[0]
    return _bind(eqn, [x])
  if (name in _OPAQUE or "callback" in name
      or _has_jaxpr_params(eqn.params)):
    return _bind(eqn, _restore(eqn, invals))
  if name in rules.white:
    return _white(eqn, invals, rules)
  if name in rules.black and _is_large(eqn, rules):
    return _black(eqn, invals)
  return _follow(eqn, invals)


def _float_positions(eqn) -> list[int]:
  return [i for i, v in enumerate(eqn.invars) if _is_float(v.aval.dtype)]


def _white(eqn, invals, rules: _Rules):
  floats = _float_positions(eqn)
  orig = [eqn.invars[i].aval.dtype for i in floats]
  if not floats or any(_bits(d) <= 8 for d in orig):
    # Integer or fp8 (quantised) arithmetic keeps its dtypes; the engine gives
    # an fp8 product float32 accumulation, as `wrap` does.
    return _follow(eqn, invals)
  vals = [_as(x, rules.compute) if i in floats else x
          for i, x in enumerate(invals)]
  params = eqn.params
  accumulates = "preferred_element_type" in params
  name = eqn.primitive.name
  if (name in _accumulate.BY_BASE and len(vals) == 2
      and _accumulate.is_narrow_float(rules.compute)):
    # The engine's primitive: float32 accumulation here and in derivatives.
    out = _accumulate.bind(name, *vals, params, np.float32)
    return _Wide(out, rules.compute)
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


def _is_large(eqn, rules: _Rules) -> bool:
  name = eqn.primitive.name
  shape = eqn.invars[0].aval.shape if eqn.invars else ()
  if name in _REDUCE_AXES:
    size = math.prod(shape[a] for a in eqn.params["axes"])
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
# Sub-jaxprs.


def _trace(fn, avals) -> tuple[Any, list[Any]]:
  """Traces ``fn`` at ``avals``; returns a const-free ClosedJaxpr and consts.

  Constants the trace captured become leading inputs of the jaxpr.
  """
  specs = [jax.ShapeDtypeStruct(a.shape, a.dtype,
                                weak_type=getattr(a, "weak_type", False))
           for a in avals]
  closed = jax.make_jaxpr(fn)(*specs)
  if not closed.consts:
    return closed, []
  jaxpr = _internals.constvars_to_invars(closed)
  return _core.ClosedJaxpr(jaxpr, ()), list(closed.consts)


def _rewrite_closed(closed, rules: _Rules):
  """``closed`` autocast inside, with its input and output types unchanged."""
  def fn(*args):
    outs = _eval_jaxpr(closed.jaxpr, closed.consts, args, rules)
    return [_cast_to_aval(x, a) for x, a in zip(outs, closed.out_avals)]
  return _trace(fn, closed.in_avals)


def _inline(eqn, invals, rules):
  closed = eqn.params["jaxpr" if "jaxpr" in eqn.params else "call_jaxpr"]
  return _eval_jaxpr(closed.jaxpr, closed.consts, invals, rules)


def _remat(eqn, invals, rules):
  jaxpr = eqn.params["jaxpr"]
  vals = [_as(x, _dtype(x)) for x in invals]

  def fn(*args):
    outs = _eval_jaxpr(jaxpr, (), args, rules)
    return [_as(x, _dtype(x)) for x in outs]

  new, consts = _trace(fn, [jax.typeof(x) for x in vals])
  return _bind(eqn, [*consts, *vals], dict(eqn.params, jaxpr=new.jaxpr))


def _scan(eqn, invals, rules):
  new, consts = _rewrite_closed(eqn.params["jaxpr"], rules)
  params = dict(eqn.params, jaxpr=new,
                num_consts=eqn.params["num_consts"] + len(consts))
  return _bind(eqn, [*consts, *_restore(eqn, invals)], params)


def _while(eqn, invals, rules):
  p = eqn.params
  cond, cond_consts = _rewrite_closed(p["cond_jaxpr"], rules)
  body, body_consts = _rewrite_closed(p["body_jaxpr"], rules)
  vals = _restore(eqn, invals)
  cn, bn = p["cond_nconsts"], p["body_nconsts"]
  vals = [*cond_consts, *vals[:cn], *body_consts, *vals[cn:]]
  params = dict(p, cond_jaxpr=cond, body_jaxpr=body,
                cond_nconsts=cn + len(cond_consts),
                body_nconsts=bn + len(body_consts))
  return _bind(eqn, vals, params)


def _cond(eqn, invals, rules):
  rewritten = [_rewrite_closed(b, rules) for b in eqn.params["branches"]]
  extra = [c for _, consts in rewritten for c in consts]
  if extra:
    # Every branch must take the same operands: give each all the constants.
    branches, start = [], 0
    for new, consts in rewritten:
      def fn(*args, new=new, lo=start, hi=start + len(consts)):
        return _core.jaxpr_as_fun(new)(*args[lo:hi], *args[len(extra):])
      closed, more = _trace(fn, [jax.typeof(c) for c in extra]
                            + list(new.in_avals[len(consts):]))
      assert not more, "constants of a branch were hoisted already"
      branches.append(closed)
      start += len(consts)
  else:
    branches = [new for new, _ in rewritten]
  vals = _restore(eqn, invals)
  return _bind(eqn, [vals[0], *extra, *vals[1:]],
               dict(eqn.params, branches=tuple(branches)))


def _custom_jvp(eqn, invals, rules):
  new, consts = _rewrite_closed(eqn.params["call_jaxpr"], rules)
  params = dict(eqn.params, call_jaxpr=new,
                num_consts=eqn.params["num_consts"] + len(consts))
  return _bind(eqn, [*consts, *_restore(eqn, invals)], params)


def _custom_vjp(eqn, invals, rules):
  new, consts = _rewrite_closed(eqn.params["call_jaxpr"], rules)
  thunk = eqn.params["fwd_jaxpr_thunk"]

  def fwd_jaxpr_thunk(*zeros):
    jaxpr, fwd_consts = thunk.call_wrapped(*zeros)
    fwd, hoisted = _rewrite_closed(_core.ClosedJaxpr(jaxpr, fwd_consts), rules)
    return _internals.invars_to_constvars(fwd.jaxpr, len(hoisted)), hoisted

  params = dict(
      eqn.params, call_jaxpr=new,
      num_consts=eqn.params["num_consts"] + len(consts),
      fwd_jaxpr_thunk=_internals.wrap_fun(fwd_jaxpr_thunk, thunk))
  return _bind(eqn, [*consts, *_restore(eqn, invals)], params)


def _shard_map(eqn, invals, rules):
  """The body autocast per shard, through the public `jax.shard_map`."""
  body = eqn.params["jaxpr"]

  def fn(*args):
    outs = _eval_jaxpr(body, (), args, rules)
    return [_cast_to_aval(x, v.aval) for x, v in zip(outs, body.outvars)]

  return _internals.shard_map_call(eqn, fn, _restore(eqn, invals))


_HIGHER_ORDER = {
    "jit": _inline,
    "pjit": _inline,
    "closed_call": _inline,
    "remat2": _remat,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
    "custom_jvp_call": _custom_jvp,
    "custom_vjp_call": _custom_vjp,
    "shard_map": _shard_map,
}
