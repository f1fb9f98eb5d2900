"""Re-evaluating a jaxpr equation by equation, with a rule per equation.

Shared by `jmp_lite.flax` (float32 accumulation of half-precision matmuls)
and `jmp_lite.autocast` (op lists). Rewritten equations keep the user's source
line and name stack, so `jmp_lite.audit` reports where an op came from.
"""

from __future__ import annotations

from typing import Any, Callable

import jax.extend as jex

_core = jex.core
_source_info = jex.source_info_util

EvalEqn = Callable[[Any, list], Any]  # (eqn, invals) -> what eqn's bind returns


def eval_jaxpr(jaxpr, consts, args, eval_eqn: EvalEqn) -> list[Any]:
  """Evaluates ``jaxpr`` on ``args``, computing each equation with ``eval_eqn``."""
  env: dict[Any, Any] = {}

  def read(v):
    return v.val if isinstance(v, _core.Literal) else env[v]

  for v, x in zip(jaxpr.constvars, consts):
    env[v] = x
  for v, x in zip(jaxpr.invars, args):
    env[v] = x
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    name_stack = _source_info.current_name_stack() + eqn.source_info.name_stack
    with _source_info.user_context(eqn.source_info.traceback,
                                   name_stack=name_stack), eqn.ctx.manager:
      outs = eval_eqn(eqn, invals)
    if not eqn.primitive.multiple_results:
      outs = [outs]
    for v, x in zip(eqn.outvars, outs):
      if not isinstance(v, _core.DropVar):
        env[v] = x
  return [read(v) for v in jaxpr.outvars]


def bind(eqn, vals, params=None):
  """Binds ``eqn``'s primitive to ``vals`` (with ``params``, default its own)."""
  params = eqn.params if params is None else params
  return eqn.primitive.bind(*vals, **eqn.primitive.get_bind_params(params))
