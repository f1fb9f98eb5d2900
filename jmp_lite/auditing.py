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

from collections.abc import Callable, Iterable
from typing import Any, Optional, Union

import jax
import numpy as np

from jmp_lite._audit_report import AuditReport
from jmp_lite._audit_report import AuditRow
from jmp_lite._jaxpr import arguments as _arguments
from jmp_lite._jaxpr.passes import audit as _audit
from jmp_lite._jaxpr.passes.audit import CONVERT_ROUND_TRIP
from jmp_lite._jaxpr.passes.audit import F32_MATMUL
from jmp_lite._jaxpr.passes.audit import FLAGS
from jmp_lite._jaxpr.passes.audit import HALF_ALL_REDUCE
from jmp_lite._jaxpr.passes.audit import HALF_EXP_LOG
from jmp_lite._jaxpr.passes.audit import HALF_MATMUL
from jmp_lite._jaxpr.passes.audit import HALF_REDUCTION
from jmp_lite.policy import Policy, get_policy

__all__ = ("audit", "AuditReport", "AuditRow", "FLAGS", "HALF_MATMUL",
           "HALF_REDUCTION", "HALF_EXP_LOG", "F32_MATMUL", "HALF_ALL_REDUCE",
           "CONVERT_ROUND_TRIP", "MIN_REDUCTION_SIZE")

MIN_REDUCTION_SIZE = 16


# What is traced: every other leaf (a function, a flag, a Python number) is
# static, as `autocast` and `value_and_grad` take it.
_VALUES = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)


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
  # Leaves that are not values (an Equinox model's functions, flags) are
  # passed as they are, as `autocast` and `value_and_grad` take them.
  leaves, tree, traced = _arguments.split(args, kwargs, _VALUES)

  def traced_fun(*values):
    a, k = _arguments.refill(leaves, traced, tree, values)
    return fun(*a, **k)

  closed = jax.make_jaxpr(traced_fun, axis_env=axis_env)(*[leaves[i] for i in traced])
  half = target is not None and _audit.is_half(target)
  auditor = _audit.Auditor(half_policy=half,
                           min_reduction_size=min_reduction_size)
  auditor.walk(closed.jaxpr, (), False, "unknown")
  return AuditReport(rows=tuple(AuditRow(**row) for row in auditor.rows),
                     policy=policy)
