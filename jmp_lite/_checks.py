"""Checks of `jmp_lite.optax.with_loss_scale`: its inputs, and what a step writes."""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite import _exact
from jmp_lite import loss_scale as ls_lib
from jmp_lite._unscale import apply_updates
from jmp_lite._dtypes import is_inexact


def grads_match_params(grads: Any, params: Any) -> None:
  """Raises ValueError naming the first gradient whose shape differs from its parameter's."""
  g_leaves, g_def = jax.tree_util.tree_flatten_with_path(grads)
  p_leaves, p_def = jax.tree_util.tree_flatten_with_path(params)
  if g_def != p_def:
    keystr = jax.tree_util.keystr
    g_paths = {keystr(k) for k, _ in g_leaves}
    p_paths = {keystr(k) for k, _ in p_leaves}
    raise ValueError(
        "with_loss_scale.update: the gradients and the parameters differ in "
        f"structure: parameters without a gradient {sorted(p_paths - g_paths)}, "
        f"gradients without a parameter {sorted(g_paths - p_paths)}.\n"
        f"  grads:  {g_def}\n  params: {p_def}")
  p_leaves = [p for _, p in p_leaves]
  for (path, g), p in zip(g_leaves, p_leaves):
    if np.shape(g) != np.shape(p):
      raise ValueError(
          f"with_loss_scale.update: gradient {jax.tree_util.keystr(path)} has shape "
          f"{np.shape(g)} but its parameter has shape {np.shape(p)}.")


def written_nonfinite(updates: Any, params: Any, inner_state: Any, old_state: Any):
  """Whether the updates, the new parameters and ``inner_state`` make a value non-finite.

  What is refused is a value that was finite becoming NaN or inf. Some
  optimizers keep inf in their state on purpose (``reduce_on_plateau``'s best
  value, lbfgs's previous value before the first step), and a parameter that
  was already non-finite is not this step's doing. In the common case this is
  one reduction over what the step writes: when all of it is finite there is
  nothing to compare. Only otherwise are the new values compared with the old
  ones, element by element.
  """
  new_params = None if params is None else apply_updates(params, updates)
  ok = ls_lib.all_finite((updates if params is None else new_params, inner_state))

  # `ok & ~ok` is False and varies over shard_map axes as `ok` does (every
  # input of `ok`): both branches' flags then have the same type.
  false = ok & ~ok

  def which():
    if params is None:
      u_bad, p_bad = ~ls_lib.all_finite(updates), false
    else:
      u_bad = _newly_nonfinite(updates, params)
      p_bad = _newly_nonfinite(new_params, params)
    return tuple(f | false for f in (u_bad, p_bad, _newly_nonfinite(inner_state, old_state)))

  return jax.lax.cond(ok, lambda: (false, false, false), which)


def _newly_nonfinite(new: Any, old: Any) -> jax.Array:
  """Whether an element of ``new`` is NaN or inf where ``old`` is finite."""
  # Read through `_exact.widen`: what the narrow dtype holds, not a float32
  # value XLA:GPU may have kept in its place.
  bad = [jnp.any(~jnp.isfinite(_exact.widen(n)) & jnp.isfinite(_exact.widen(o)))
         for n, o in zip(jax.tree.leaves(new), jax.tree.leaves(old)) if is_inexact(n)]
  return jnp.any(jnp.stack(bad)) if bad else jnp.array(False)


def is_concrete(tree: Any, numbers: bool = True) -> bool:
  """Whether every leaf is a concrete array (or a number), not a tracer.

  Extra arguments that are Python values (numbers, functions) are handed to
  the inner optimizer as they are, so they do not go through ``jax.jit``.
  """
  kinds = (jax.Array, np.ndarray, np.generic) + ((int, float, complex) if numbers else ())
  return all(isinstance(x, kinds) and not isinstance(x, jax.core.Tracer)
             for x in jax.tree.leaves(tree))


def inside_multisteps() -> bool:
  """Whether ``init`` was called by ``optax.MultiSteps.init``.

  MultiSteps resets its accumulator by multiplying it by zero, so one
  overflowing micro-batch leaves NaN in it for good; nothing inside the
  wrapped optimizer can undo that. MultiSteps has no hook at construction, so
  the first moment to refuse it is its ``init``, which calls ours directly or
  through a chain or two (hence a few frames up).
  """
  frame = sys._getframe(2)  # skips this function and our init
  for _ in range(3):
    if frame is None:
      return False
    if isinstance(frame.f_locals.get("self"), optax.MultiSteps):
      return True
    frame = frame.f_back
  return False
