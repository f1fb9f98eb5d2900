"""Checks of `jmp_lite.optax.with_loss_scale`: its inputs, and what a step writes."""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite import _exact
from jmp_lite import _reduce
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
  was already non-finite is not this step's doing. Each flag is one pass,
  with one reduction per distinct shape (`jmp_lite._reduce`) and no
  conditional: a `cond` around the rare comparison compiled its reductions
  all the same and kept XLA from fusing the check with the update.
  """
  if params is None:
    return ~ls_lib.all_finite(updates), jnp.array(False), _newly_nonfinite(
        inner_state, old_state)
  new_params = apply_updates(params, updates)
  return (_newly_nonfinite(updates, params), _newly_nonfinite(new_params, params),
          _newly_nonfinite(inner_state, old_state))


def raise_if_stalled(stalled, limit: int, updates, params, new_state, old_state) -> None:
  """Raises (from the compiled step) once ``stalled`` reaches ``limit``.

  A host callback inside a ``cond``: nothing is transferred on the steps that
  do not stall. It receives what the step would have written and names the
  arrays where a finite value became NaN or inf.
  """
  def report(count, updates, params, new_state, old_state):
    with np.errstate(all="ignore"):  # the overflow being reported
      new_params = None if params is None else jax.tree.map(
          lambda p, u: (np.asarray(p, np.float64) + np.asarray(u, np.float64)).astype(
              np.asarray(p).dtype), params, updates)
    where = []
    # Without params, any non-finite update counts (as in `written_nonfinite`).
    for label, new, old in (("updates", updates, params),
                            ("params + updates", new_params, params),
                            ("optimizer state", new_state, old_state)):
      if new is None:
        continue
      flat_new = jax.tree_util.tree_flatten_with_path(new)[0]
      olds = [None] * len(flat_new) if old is None else jax.tree.leaves(old)
      for (path, n), o in zip(flat_new, olds):
        n = np.asarray(n)
        was = True if o is None else np.isfinite(np.asarray(o))
        if n.dtype.kind in "fc" and (~np.isfinite(n) & was).any():
          where.append(f"{label} {jax.tree_util.keystr(path) or '(root)'}")
    raise FloatingPointError(
        f"with_loss_scale: {int(count)} steps in a row were skipped although the "
        "gradients were finite: what the step would write overflows, and "
        "lowering the loss scale cannot help. Non-finite: "
        f"{', '.join(where[:8]) or 'nothing (another replica)'}"
        f"{' ...' if len(where) > 8 else ''}. Lower the learning rate, clip the "
        "gradients (clip_norm=), keep these parameters in float32, or pass "
        "max_stalled_steps=None to keep skipping.")

  jax.lax.cond(stalled >= limit,
               lambda: jax.debug.callback(report, stalled, updates, params, new_state,
                                          old_state),
               lambda: None)


def _newly_nonfinite(new: Any, old: Any) -> jax.Array:
  """Whether an element of ``new`` is NaN or inf where ``old`` is finite.

  One reduction per distinct shape (`jmp_lite._reduce`). Read through
  `_exact.widen`: what the narrow dtype holds, not a float32 value XLA:GPU
  may have kept in its place.
  """
  pairs = [(n, o) for n, o in zip(jax.tree.leaves(new), jax.tree.leaves(old))
           if is_inexact(n)]
  return _reduce.any_of_pairs(
      pairs, lambda n, o: ~jnp.isfinite(_exact.widen(n)) & jnp.isfinite(_exact.widen(o)))


def is_concrete(tree: Any, numbers: bool = True) -> bool:
  """Whether every leaf is a concrete array (or a number), not a tracer.

  Extra arguments that are Python values (numbers, functions) are handed to
  the inner optimizer as they are, so they do not go through ``jax.jit``.
  """
  kinds = (jax.Array, np.ndarray, np.generic) + ((int, float, complex) if numbers else ())
  return all(isinstance(x, kinds) and not isinstance(x, jax.core.Tracer)
             for x in jax.tree.leaves(tree))


def inside_multisteps() -> bool:
  """Whether ``init`` was called, at any depth, by ``optax.MultiSteps.init``.

  MultiSteps resets its accumulator by multiplying it by zero, so one
  overflowing micro-batch leaves NaN in it for good; nothing inside the
  wrapped optimizer can undo that. MultiSteps has no hook at construction, so
  the first moment to refuse it is its ``init``, which calls ours through any
  number of chains. (`multisteps_around` refuses the state itself, wherever
  it was built.)
  """
  frame = sys._getframe(2)  # skips this function and our init
  code = optax.MultiSteps.init.__code__
  while frame is not None:
    if frame.f_code is code:
      return True
    frame = frame.f_back
  return False


def multisteps_around(opt_state: Any, is_target) -> bool:
  """Whether a leaf ``is_target`` accepts sits inside an ``optax.MultiStepsState``."""
  is_multi = lambda x: isinstance(x, optax.MultiStepsState)
  for node in jax.tree_util.tree_leaves(opt_state, is_leaf=is_multi):
    if is_multi(node) and any(
        is_target(x) for x in jax.tree_util.tree_leaves(node, is_leaf=is_target)):
      return True
  return False
