"""The audit's pass: every precision-relevant equation of a jaxpr and its
bodies, with its dtypes, source line and flags (see `jmp_lite.auditing`,
which documents the categories and flags and builds the report).

Which bodies it enters is `jmp_lite._jaxpr.traverse`'s table; a loop body's
rows are marked ``in_loop``.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import jax
import numpy as np

from jmp_lite._jaxpr import accumulate as _accumulate
from jmp_lite._jaxpr import internals as _internals
from jmp_lite._jaxpr import traverse as _traverse

HALF_MATMUL = "half_matmul"
HALF_REDUCTION = "half_reduction"
HALF_EXP_LOG = "half_exp_log"
F32_MATMUL = "f32_matmul"
HALF_ALL_REDUCE = "half_all_reduce"
CONVERT_ROUND_TRIP = "convert_round_trip"
FLAGS = (HALF_MATMUL, HALF_REDUCTION, HALF_EXP_LOG, F32_MATMUL, HALF_ALL_REDUCE,
         CONVERT_ROUND_TRIP)

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
# jmp_lite's own directory: frames there are skipped for the user's.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))) + os.sep


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


def is_half(dtype) -> bool:
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
  (`jmp_lite._jaxpr.traverse`; an unknown primitive's with a warning)."""
  for region in _traverse.regions_or_warn(eqn, "audit"):
    yield region.label, region.jaxpr, region.runs in (_traverse.EACH, _traverse.WHILE)


class Auditor:
  """Walks a jaxpr and its bodies; ``rows`` holds one dict of `AuditRow`
  fields per precision-relevant equation."""

  def __init__(self, half_policy: bool, min_reduction_size: int):
    self.half_policy = half_policy
    self.min_reduction_size = min_reduction_size
    self.rows: list[dict[str, Any]] = []

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
    if (name in _SUM_LIKE and is_half(accumulation)
        and size >= self.min_reduction_size):
      flags.append(HALF_REDUCTION)
    if category == "exp_log" and any(map(is_half, outs)):
      flags.append(HALF_EXP_LOG)
    if (category in ("matmul", "conv") and self.half_policy
        and any(_is_float(d) and d.itemsize >= 4 for d in ins)):
      flags.append(F32_MATMUL)
    if name in _ALL_REDUCE and any(map(is_half, ins)):
      flags.append(HALF_ALL_REDUCE)
    self.rows.append(dict(
        primitive=name, category=category, operand_dtypes=ins,
        accumulation=accumulation, output_dtypes=outs,
        operand_shapes=tuple(tuple(v.aval.shape) for v in eqn.invars),
        reduced_size=size, source=source, path=path, in_loop=in_loop,
        flags=tuple(flags)))
