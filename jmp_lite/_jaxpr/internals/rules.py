"""Defining jmp_lite's primitives: their JVP, transpose, batching, lowering
and remat rules, through the rule tables JAX keeps for them.

The protocol of "Writing custom JAX primitives" (JAX docs): rule tables in
`jax.interpreters.{ad,batching,mlir}`, which JAX re-exports for this purpose,
and two tables of ``jax._src`` (remat's partial evaluation) named below.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.extend as jex
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir

core = jex.core


def abstract_eval(prim, *avals, **params):
  """``prim``'s output aval and effects at ``avals``.

  Relies on `Primitive.abstract_eval` returning ``(aval, effects)`` for
  single-result primitives (the rule `def_abstract_eval` installs does).
  """
  return prim.abstract_eval(*avals, **params)


def define_bilinear(prim, lhs_transpose, rhs_transpose) -> None:
  """JVP ``prim(dx, y) + prim(x, dy)``; transposes ``rule(ct, x, y, **params)``.

  Relies on `jax.interpreters.ad.defbilinear`; the rules read only ``x.aval``
  (``x`` is an undefined primal or a gradient accumulator).
  """
  ad.defbilinear(prim, lhs_transpose, rhs_transpose)


def define_batching(prim, rule) -> None:
  """``rule(args, dims, **params) -> (out, out_dim)`` (dims: int or None).

  Relies on the `jax.interpreters.batching.primitive_batchers` table, whose
  rules see unbatched dimensions as None.
  """
  batching.primitive_batchers[prim] = rule


def define_lowering(prim, fun: Callable[..., Any], platform=None) -> None:
  """Lowers ``prim`` by tracing ``fun(*args, **params)`` (for ``platform``).

  Relies on `jax.interpreters.mlir.lower_fun` and `register_lowering`: a rule
  for one platform wins over the default one, and a computation lowered for
  several platforms gets a per-platform switch (as `lax.platform_dependent`).
  """
  mlir.register_lowering(prim, mlir.lower_fun(fun, multiple_results=False),
                         platform=platform)


def define_partitioned_lowering(prim, fun: Callable[..., Any], platform) -> None:
  """Like `define_lowering`, with ``fun(*args, partitioned=..., **params)``.

  ``partitioned`` says whether XLA's SPMD partitioner will split the
  computation across devices on dimensions the program did not make manual
  (``jit`` over several devices). Relies on the lowering context's
  ``module_context.axis_context``: a ``ShardingContext`` with
  ``num_devices``, or (inside ``shard_map``) an ``SPMDAxisContext`` with a
  ``mesh`` and its ``manual_axes``. Anything else is one device.
  """
  def rule(ctx, *args, **params):
    axes = ctx.module_context.axis_context
    if hasattr(axes, "num_devices"):
      partitioned = axes.num_devices > 1
    elif hasattr(axes, "manual_axes") and hasattr(axes, "mesh"):
      partitioned = any(size > 1 for name, size in axes.mesh.shape.items()
                        if name not in axes.manual_axes)
    else:
      partitioned = False
    lowered = mlir.lower_fun(functools.partial(fun, partitioned=partitioned),
                             multiple_results=False)
    return lowered(ctx, *args, **params)
  mlir.register_lowering(prim, rule, platform=platform)


def define_remat_as(prim, as_base: Callable[[dict], tuple[Any, dict]]) -> None:
  """Remat policies decide about ``prim`` as about the op it stands for.

  ``jax.checkpoint(f, policy=...)`` asks ``policy(prim, *avals, **params)``
  about each equation of ``f`` whose inputs are known; JAX's own policies
  test ``prim is dot_general_p`` (``dots_saveable`` and its kin in
  jax/_src/ad_checkpoint.py). The policy is asked about ``as_base(params) ->
  (base_prim, base_params)`` instead, wherever the ``checkpoint`` is: outside
  a wrapped function as well as inside it.

  Relies on `partial_eval.partial_eval_jaxpr_custom_rules`, the table remat's
  partial evaluation consults before its first-order default, with rules
  ``rule(saveable, unks_in, inst_in, eqn) -> (known_eqn, staged_eqn,
  unks_out, inst_out, residuals)``, and on `ensure_enum`, `SaveableType` and
  `Offloadable`. The rule transcribes that default (the first-order branch
  of `_partial_eval_jaxpr_custom_cached` in
  jax/_src/interpreters/partial_eval.py, JAX 0.10.2), but for offloading:
  a rule returns one equation each side and cannot add the two copies an
  offload needs, so an ``Offloadable`` answer recomputes, with a warning.
  """
  from jax._src.interpreters import partial_eval as pe  # pylint: disable=g-import-not-at-top

  def rule(saveable, unks_in, inst_in, eqn):
    n = len(eqn.outvars)
    # Known inputs the staged (backward) copy reads become residuals.
    needed = [v for v, inst in zip(eqn.invars, inst_in)
              if not inst and not isinstance(v, core.Literal)]
    if any(unks_in):
      return None, eqn, [True] * n, [True] * n, needed
    base, params = as_base(eqn.params)
    policy = pe.ensure_enum(saveable(base, *[v.aval for v in eqn.invars],
                                     **params))
    if eqn.effects or isinstance(policy, pe.SaveableType):
      return eqn, None, [False] * n, [False] * n, []
    if isinstance(policy, pe.Offloadable):
      import warnings  # pylint: disable=g-import-not-at-top
      warnings.warn(
          f"the remat policy asks to offload a {base.name} that jmp_lite "
          f"computes as {prim.name}; it is recomputed instead (offloading "
          "the engine's matmuls is not supported)", UserWarning, stacklevel=2)
    return eqn, eqn, [False] * n, [True] * n, needed

  pe.partial_eval_jaxpr_custom_rules[prim] = rule
  OWN_REMAT_RULES.add(prim.name)


# Primitives of jmp_lite given a remat rule above: first-order, not counted by
# `higher_order_primitives`.
OWN_REMAT_RULES: set[str] = set()


def base_transpose(prim):
  """JAX's transpose rule of ``prim``: ``rule(ct, x, y, **params)``.

  Relies on `jax.interpreters.ad.primitive_transposes`; an operand that is a
  gradient accumulator (``jax.grad``'s newer path) is passed to it as an
  `UndefinedPrimal` of the same aval, which the rule reads ``.aval`` from.
  """
  rule = ad.primitive_transposes[prim]

  def transpose(ct, x, y, **params):
    x = ad.UndefinedPrimal(x.aval) if hasattr(x, "aval") and not isinstance(
        x, jax.Array) and not ad.is_undefined_primal(x) else x
    y = ad.UndefinedPrimal(y.aval) if hasattr(y, "aval") and not isinstance(
        y, jax.Array) and not ad.is_undefined_primal(y) else y
    return rule(ct, x, y, **params)
  return transpose


