"""A static precision audit: what dtypes a step really runs its numerics in.

`audit` traces a function with ``jax.make_jaxpr`` (nothing is computed or
compiled) and lists every precision-relevant equation, including those inside
``scan``/``while``/``cond`` bodies, custom derivatives, checkpoints and
``shard_map``:

========== ==================================================================
category   primitives
========== ==================================================================
matmul     ``dot_general``, ``ragged_dot_general``
conv       ``conv_general_dilated``
reduction  ``reduce_sum``/``_prod``/``_max``/``_min``, ``cumsum``/``cumprod``/
           ``cumlogsumexp``/``cummax``/``cummin``, ``reduce_window_sum``
exp_log    ``exp``, ``exp2``, ``expm1``, ``log``, ``log1p``, ``logistic``,
           ``pow``, ``rsqrt``, ``erf_inv``
collective ``psum``, ``reduce_scatter``, ``all_gather``, ``all_to_all``,
           ``ppermute``, ``pmax``, ``pmin`` (and their variants)
convert    ``convert_element_type`` that changes a floating dtype
========== ==================================================================

The engine's float32-accumulating matmuls (``jmp_dot_general``,
``jmp_conv_general_dilated`` in a jaxpr) are reported under the name of the op
they compute (``dot_general``), with float32 accumulation.

Each row has the operand, accumulation and output dtypes, the user source line
and the sub-jaxpr path, and the flags of likely mistakes it shows:

* ``half_reduction``: a sum, product or cumulative sum accumulating in 16 bits
  over at least ``min_reduction_size`` (16) elements per output.
* ``half_exp_log``: an exp/log-family op (softmax, log-softmax, logsumexp,
  normalisation's ``rsqrt``) producing 16-bit results.
* ``half_matmul``: a matmul or convolution of 16-bit (or fp8) operands that
  accumulates in their own dtype (``bf16 x bf16 -> bf16``): what the engine
  behind `jmp_lite.flax.wrap` and `jmp_lite.autocast` rewrites, so a row with
  this flag under either shows a gap.
* ``f32_matmul``: a matmul or convolution with a 32/64-bit operand (so it runs
  at that width) while ``policy`` asks for 16-bit compute (its
  ``autocast_dtype``, else its ``compute_dtype``). Only with ``policy=``.
* ``half_all_reduce``: a ``psum``/``reduce_scatter`` of 16-bit values: every
  device's rounding error is summed (jax-ml/jax#27496).
* ``convert_round_trip``: ``x: a -> b -> a`` inside a loop body, paid on every
  iteration (and lossy when ``b`` is narrower).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any, Optional, Union

import jax
import numpy as np

from jmp_lite import _accumulate
from jmp_lite import _internals
from jmp_lite import _traverse

from jmp_lite._audit_report import CONVERT_ROUND_TRIP
from jmp_lite._audit_report import F32_MATMUL
from jmp_lite._audit_report import FLAGS
from jmp_lite._audit_report import HALF_ALL_REDUCE
from jmp_lite._audit_report import HALF_EXP_LOG
from jmp_lite._audit_report import HALF_MATMUL
from jmp_lite._audit_report import HALF_REDUCTION
from jmp_lite._audit_report import AuditReport
from jmp_lite._audit_report import AuditRow
from jmp_lite.policy import Policy, get_policy

__all__ = ("audit", "AuditReport", "AuditRow", "FLAGS", "HALF_MATMUL",
           "HALF_REDUCTION", "HALF_EXP_LOG", "F32_MATMUL", "HALF_ALL_REDUCE",
           "CONVERT_ROUND_TRIP", "MIN_REDUCTION_SIZE")

MIN_REDUCTION_SIZE = 16

_MATMUL = frozenset({"dot_general", "ragged_dot_general"})
_CONV = frozenset({"conv_general_dilated"})
_REDUCE_AXES = frozenset({"reduce_sum", "reduce_prod", "reduce_max",
                          "reduce_min"})
_CUMULATIVE = frozenset({"cumsum", "cumprod", "cumlogsumexp", "cummax",
                         "cummin"})
_SUM_LIKE = frozenset({"reduce_sum", "reduce_prod", "cumsum", "cumprod",
                       "cumlogsumexp", "reduce_window_sum"})
_EXP_LOG = frozenset({"exp", "exp2", "expm1", "log", "log1p", "logistic",
                      "pow", "rsqrt", "erf_inv"})
_ALL_REDUCE = frozenset({
    "psum", "psum_invariant", "reduce_scatter", "unreduced_psum",
    "unreduced_reduce_scatter", "psum_start", "psum_invariant_start",
    "reduce_scatter_start", "unreduced_psum_start",
    "unreduced_reduce_scatter_start"})
_COLLECTIVE = _ALL_REDUCE | frozenset({
    "pmax", "pmin", "all_gather", "all_gather_invariant",
    "all_gather_reduced", "all_to_all", "ragged_all_to_all", "ppermute",
    "pbroadcast", "all_gather_start", "all_to_all_start", "ppermute_start"})
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep

DTypeLike = Any


def _category(name: str) -> Optional[str]:
  name = _base_name(name)
  if name in _MATMUL:
    return "matmul"
  if name in _CONV:
    return "conv"
  if name in _REDUCE_AXES or name in _CUMULATIVE or name == "reduce_window_sum":
    return "reduction"
  if name in _EXP_LOG:
    return "exp_log"
  if name in _COLLECTIVE:
    return "collective"
  if name == "convert_element_type":
    return "convert"
  return None


def _base_name(name: str) -> str:
  """The op an engine primitive computes (``jmp_dot_general`` -> dot_general)."""
  for prim, base in _accumulate.BASE.items():
    if name == prim.name:
      return base.name
  return name


def _is_float(dtype) -> bool:
  return bool(jax.numpy.issubdtype(dtype, jax.numpy.floating))


def _is_half(dtype) -> bool:
  return _is_float(dtype) and np.dtype(dtype).itemsize == 2


def _is_narrow(dtype) -> bool:
  return _is_float(dtype) and np.dtype(dtype).itemsize <= 2


def _source(eqn) -> Optional[str]:
  frames = _internals.user_frames(eqn)
  # jmp_lite's own frames (autocast, policy casts) say less than the caller's.
  frame = next((f for f in frames
                if not os.path.abspath(f.file_name).startswith(_PACKAGE_DIR)),
               frames[0] if frames else None)
  if frame is None:
    return None
  return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"


def _reduced_size(eqn) -> Optional[int]:
  name = eqn.primitive.name
  shape = eqn.invars[0].aval.shape
  if name in _REDUCE_AXES:
    return int(np.prod([shape[a] for a in eqn.params["axes"]], dtype=int))
  if name in _CUMULATIVE:
    return int(shape[eqn.params["axis"]])
  if name == "reduce_window_sum":
    return int(np.prod(eqn.params["window_dimensions"], dtype=int))
  return None


def _subjaxprs(eqn):
  """Yields (label, jaxpr, is_loop_body) for each jaxpr ``eqn`` runs
  (`jmp_lite._traverse`; an unknown primitive's with a warning)."""
  for region in _traverse.regions_or_warn(eqn, "audit"):
    yield region.label, region.jaxpr, region.runs in (_traverse.EACH, _traverse.WHILE)


class _Auditor:

  def __init__(self, half_policy: bool, min_reduction_size: int):
    self.half_policy = half_policy
    self.min_reduction_size = min_reduction_size
    self.rows: list[AuditRow] = []

  def walk(self, jaxpr, path: tuple[str, ...], in_loop: bool, source: str):
    converted_from: dict[Any, np.dtype] = {}  # var -> dtype before a convert
    for eqn in jaxpr.eqns:
      # Equations traced inside library code (jax.nn...) have no user frame:
      # show the user line that called into it.
      eqn_source = _source(eqn) or source
      category = _category(eqn.primitive.name)
      if category == "convert":
        src, dst = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
        if src != dst and (_is_float(src) or _is_float(dst)):
          before = converted_from.get(eqn.invars[0])
          round_trip = (in_loop and before is not None and before == dst
                        and _is_float(src))
          self.add(eqn, category, path, in_loop, eqn_source,
                   (CONVERT_ROUND_TRIP,) if round_trip else ())
          converted_from[eqn.outvars[0]] = src
      elif category is not None:
        self.add(eqn, category, path, in_loop, eqn_source, ())
      for label, sub, loop in _subjaxprs(eqn):
        self.walk(sub, path + ((label,) if label else ()), in_loop or loop,
                  eqn_source)

  def add(self, eqn, category, path, in_loop, source, flags):
    name = _base_name(eqn.primitive.name)
    ins = tuple(np.dtype(v.aval.dtype) for v in eqn.invars)
    outs = tuple(np.dtype(v.aval.dtype) for v in eqn.outvars)
    accumulation = None
    if category in ("matmul", "conv"):
      pref = eqn.params.get("preferred_element_type")
      accumulation = np.dtype(pref) if pref is not None else outs[0]
    elif category == "reduction":
      accumulation = outs[0]
    size = _reduced_size(eqn) if category == "reduction" else None
    flags = list(flags)
    if (category in ("matmul", "conv") and any(map(_is_narrow, ins))
        and _is_narrow(accumulation)):
      flags.append(HALF_MATMUL)
    if (name in _SUM_LIKE and _is_half(accumulation)
        and size >= self.min_reduction_size):
      flags.append(HALF_REDUCTION)
    if category == "exp_log" and any(map(_is_half, outs)):
      flags.append(HALF_EXP_LOG)
    if (category in ("matmul", "conv") and self.half_policy
        and any(_is_float(d) and d.itemsize >= 4 for d in ins)):
      flags.append(F32_MATMUL)
    if name in _ALL_REDUCE and any(map(_is_half, ins)):
      flags.append(HALF_ALL_REDUCE)
    self.rows.append(AuditRow(
        primitive=name, category=category, operand_dtypes=ins,
        accumulation=accumulation, output_dtypes=outs,
        operand_shapes=tuple(tuple(v.aval.shape) for v in eqn.invars),
        reduced_size=size, source=source, path=path, in_loop=in_loop,
        flags=tuple(flags)))


def audit(fun: Callable[..., Any], *args,
          policy: Union[Policy, str, None] = None,
          axis_env: Optional[Iterable[tuple[str, int]]] = None,
          min_reduction_size: int = MIN_REDUCTION_SIZE,
          **kwargs) -> AuditReport:
  """Traces ``fun(*args, **kwargs)`` (without running it) and audits its dtypes.

  Args:
    fun: any traceable function: a loss, ``jax.grad`` of one, a jitted train
      step, an `jmp_lite.autocast` function.
    *args: arrays or ``jax.ShapeDtypeStruct`` s (only shapes and dtypes are
      used).
    policy: the policy the step is meant to follow (a `Policy` or a string
      `jmp_lite.get_policy` parses). If its ``autocast_dtype`` (else its
      ``compute_dtype``) is 16-bit, wide matmuls are flagged.
    axis_env: ``(name, size)`` pairs for collectives over named axes outside a
      ``shard_map`` (as in ``jax.make_jaxpr``).
    min_reduction_size: smallest number of elements per output for which a
      16-bit sum is flagged.
    **kwargs: keyword arguments of ``fun``.

  Returns:
    An `AuditReport`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> def loss(w, x):
    ...   logits = x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)
    ...   logp = jax.nn.log_softmax(logits)
    ...   return -jnp.mean(logp.astype(jnp.float32)) + jnp.mean(x @ w)
    >>> w = jax.ShapeDtypeStruct((64, 10), jnp.float32)
    >>> x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
    >>> report = audit(loss, w, x, policy="p=f32,c=bf16,o=f32")
    >>> report.count(primitive="dot_general", operand_dtype=jnp.bfloat16,
    ...              accumulation=jnp.bfloat16)
    1
    >>> [(row.primitive, row.flags) for row in report.flags]
    [('dot_general', ('half_matmul',)), ('exp', ('half_exp_log',)), ('log', ('half_exp_log',)), ('dot_general', ('f32_matmul',))]
    >>> report.summary()[("dot_general", "f32->f32")]
    1
  """
  if policy is not None:
    policy = get_policy(policy)
  target = None
  if policy is not None:
    target = (policy.autocast_dtype if policy.autocast_dtype is not None
              else policy.compute_dtype)
  closed = jax.make_jaxpr(fun, axis_env=axis_env)(*args, **kwargs)
  auditor = _Auditor(half_policy=target is not None and _is_half(target),
                     min_reduction_size=min_reduction_size)
  auditor.walk(closed.jaxpr, (), False, "unknown")
  return AuditReport(rows=tuple(auditor.rows), policy=policy)
