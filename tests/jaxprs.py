"""Walking traced programs, for tests that inspect what a step contains."""

from __future__ import annotations

import jax.extend


def equations(jaxpr):
  """Every equation of ``jaxpr`` and of the jaxprs in its equations' params
  (``pjit``, ``scan``, ``cond`` branches, ``custom_vjp_call``...)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          yield from equations(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          yield from equations(sub)
