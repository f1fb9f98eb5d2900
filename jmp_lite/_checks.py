"""Checks of `jmp_lite.optax.with_loss_scale`: its inputs, and what a step writes."""

from __future__ import annotations

import functools
import itertools
from typing import Any, Optional

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jmp_lite._dtypes import is_floating
from jmp_lite._dtypes import is_inexact
from jmp_lite import _elementwise
from jmp_lite import _exact
from jmp_lite._jaxpr import internals as _internals
from jmp_lite import _reduce


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
    # A float parameter needs a real float gradient (jax.grad gives float0
    # to integer parameters only): optax would otherwise fail inside the
    # optimizer, or return complex updates.
    if is_floating(p) and not (is_floating(g) or type(g) is float):
      complex_g = is_inexact(g)
      raise TypeError(
          f"with_loss_scale.update: gradient {jax.tree_util.keystr(path)} is "
          f"{_dtype_name(g)} but its parameter is {_dtype_name(p)}: a "
          f"{'real ' if complex_g else ''}floating parameter needs a "
          f"{'real ' if complex_g else ''}floating gradient.")


def _dtype_name(x) -> str:
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return type(x).__name__
  return "float0" if dtype == jax.dtypes.float0 else str(dtype)


# Arrays of this many elements or more are checked on a copy of the step.
#
# `with_loss_scale` computes the step once for the values it writes and, for
# these arrays, once more from the same inputs behind an
# ``optimization_barrier`` for the check. XLA can then fuse the check's
# arithmetic into its reductions, passes that read the inputs and write
# nothing, and the writes into the same loops as in an unchecked step,
# instead of writing the results out and reading them back for the check and
# for the selects. The bench's ``guard`` section (Adam on 256 M parameters in
# 100 arrays, donated, 2-core avx512_bf16 CPU): 1.38x the gradients-only
# step's time for float32 parameters and 1.30x for bfloat16 ones, against
# 2.15x and 2.40x checking the results in the same run, and XLA temporaries
# of 2.01 GiB, as without the check, against 3.25 GiB. The copy costs trace
# and compile time, about 9 ms per array on that machine (Adam over 100
# arrays: 0.60 s to trace and 1.94 s to compile, against 0.40 s and 1.24 s),
# which small arrays do not repay: their results stay in cache and their
# steps are compile-bound.
COPY_FROM = 2 ** 16


def copied(x: Any) -> bool:
  """Whether a result leaf is checked on the copy (`COPY_FROM`)."""
  return isinstance(x, jax.Array) and is_inexact(x) and np.size(x) >= COPY_FROM


def any_copied(tree: Any) -> bool:
  return any(copied(x) for x in jax.tree.leaves(tree))


def copied_from(copy: Any, results: Any) -> Any:
  """``results`` with the leaves that are `copied` taken from ``copy``."""
  return jax.tree.map(lambda c, r: c if copied(r) else r, copy, results)


def _is_finite(x):
  # What the narrow dtype holds (`_exact.widen`), not a float32 value XLA:GPU
  # may have kept in its place.
  return _elementwise.isfinite(_exact.widen(x))


def _update_ok(u, p):
  """Per element: ``u`` may be applied to ``p`` (``p + u`` stays finite where
  ``p`` is; without ``params``, ``u`` is finite)."""
  if p is None:
    return _is_finite(u)
  return lax.bitwise_or(_is_finite(_elementwise.add_rounded(p, u)),
                        lax.bitwise_not(_is_finite(p)))


def _state_ok(new, old):
  """Per element: ``new`` is finite or ``old`` was not."""
  return lax.bitwise_or(_is_finite(new), lax.bitwise_not(_is_finite(old)))


def written_nonfinite(updates: Any, params: Any, inner_state: Any, old_state: Any,
                      finite: jax.Array):
  """Whether the updates, the new parameters and ``inner_state`` make a value non-finite.

  What is refused is a value that was finite becoming NaN or inf. Some
  optimizers keep inf in their state on purpose (``reduce_on_plateau``'s best
  value, lbfgs's previous value before the first step), and a parameter that
  was already non-finite is not this step's doing. Without ``params``, any
  non-finite update counts.

  Two reductions per group of same-shape arrays, no branch: one for the
  state, one for the updates and the new parameters together. Where a
  parameter is finite, a non-finite update makes ``p + u`` non-finite too, so
  each element's code is 2 (the update), 1 (only ``p + u``) or 0, and the
  largest code gives both flags. The flags are combined with ``finite`` (the
  gradients'; the results are only meaningful where it holds) inside one
  fenced computation (`jmp_lite._reduce.fenced`).
  """
  is_none = lambda x: x is None
  us = jax.tree.leaves(updates, is_leaf=is_none)
  ps = [None] * len(us) if params is None else jax.tree.leaves(params, is_leaf=is_none)
  pairs = [(u, p) for u, p in zip(us, ps)
           if u is not None and is_inexact(u) and (p is None or is_inexact(p))]
  newly = lambda n, o: lax.bitwise_and(lax.bitwise_not(_is_finite(n)), _is_finite(o))
  two = lambda like: lax.full_like(like, 2, jnp.int8)

  def code(u, p):
    bad_u = lax.bitwise_not(_is_finite(u))
    if p is None:
      return _elementwise.where(bad_u, two(bad_u), 0)
    bad_p = lax.bitwise_not(_is_finite(_elementwise.add_rounded(p, u)))
    code = _elementwise.where(bad_u, two(bad_u), _elementwise.cast(bad_p, jnp.int8))
    return _elementwise.where(_is_finite(p), code, 0)

  codes = _reduce.partials(pairs, lambda pair: code(*pair), lax.max, _reduce.largest,
                           shape_of=lambda pair: np.shape(pair[0]))
  state = _reduce.partials(
      [(n, o) for n, o in zip(jax.tree.leaves(inner_state), jax.tree.leaves(old_state))
       if is_inexact(n)],
      lambda pair: newly(*pair), lax.bitwise_or, _reduce.anywhere,
      shape_of=lambda pair: np.shape(pair[0]))

  def decide(parts):
    codes, state, finite = parts
    top = functools.reduce(jnp.maximum, codes, jnp.int8(0))
    s_bad = functools.reduce(jnp.logical_or, state, jnp.array(False))
    return (top == 2) & finite, (top >= 1) & (params is not None) & finite, s_bad & finite

  return _reduce.fenced(decide, (codes, state, finite))


def written_where(applied: jax.Array, updates: Any, params: Any, inner_state: Any,
                  old_state: Any) -> tuple[list, list]:
  """Per leaf, where a step may write: ``applied``, and for a `copied` leaf,
  element by element, what `written_nonfinite` requires.

  The second condition changes nothing where the check saw the values
  written: an applied step has no refused element. For a copied leaf it
  keeps anything non-finite from being written by construction, should XLA
  round the check's copy of the step differently from the one written.
  Returns the predicates for the leaves of ``updates`` and of
  ``inner_state``, in order.
  """
  def where(ok_fn, new, old):
    if not (copied(new) and (old is None or is_inexact(old))):
      return applied
    return _elementwise.where(applied, ok_fn(new, old), False)

  is_none = lambda x: x is None
  us = jax.tree.leaves(updates, is_leaf=is_none)
  ps = [None] * len(us) if params is None else jax.tree.leaves(params, is_leaf=is_none)
  return ([where(_update_ok, u, p) for u, p in zip(us, ps)],
          [where(_state_ok, n, o) for n, o in zip(jax.tree.leaves(inner_state),
                                                 jax.tree.leaves(old_state))])


def select(pred: jax.Array, new: Any, old: Any) -> Any:
  """``jnp.where(pred, new, old)`` for one leaf; primitives for floating arrays
  (`jmp_lite._elementwise`: tracing cost), ``jnp.where`` for anything else."""
  if (isinstance(new, jax.Array) and is_inexact(new)
      and (not isinstance(old, jax.Array) or old.dtype == new.dtype)):
    return _elementwise.where(pred, new, old)
  if not isinstance(old, jax.Array) and np.ndim(old) == 0:  # -0.0 for an int update: 0
    old = jnp.full_like(new, old)
  return jnp.where(pred, new, old)


def _copy(apply, inputs: tuple) -> Optional[tuple]:
  """``apply(*inputs)`` computed a second time, behind an ``optimization_barrier``
  (see `COPY_FROM`); None where it has side effects.

  A second copy of a callback (``jax.debug.print`` in the inner optimizer)
  would run twice a step, so such a step is checked on its results.
  """
  closed, out_shape = jax.make_jaxpr(apply, return_shape=True)(*inputs)
  if closed.effects:
    return None
  leaves = jax.tree.leaves(inputs)
  at = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
  for i, x in zip(at, jax.lax.optimization_barrier([leaves[i] for i in at])):
    leaves[i] = x
  outs = jex.core.jaxpr_as_fun(closed)(*leaves)
  return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def checked_values(apply, inputs: tuple, updates: Any, inner_state: Any) -> tuple:
  """What `written_nonfinite` reads: ``updates`` and ``inner_state``, those
  computed by ``apply(*inputs)``, with their `copied` leaves taken from a
  second computation of the step (`COPY_FROM`), where there is one."""
  if not any_copied((updates, inner_state)):
    return updates, inner_state
  copy = _copy(apply, inputs)
  if copy is None:
    return updates, inner_state
  return copied_from(copy[0], updates), copied_from(copy[1], inner_state)


def select_written(applied: jax.Array, updates: Any, params: Any, inner_state: Any,
                   old_state: Any, per_element: bool) -> tuple:
  """What a step writes: ``updates`` where ``applied`` (``-0.0`` elsewhere),
  ``inner_state`` where ``applied`` (``old_state`` elsewhere); with
  ``per_element``, a `copied` leaf also element by element (`written_where`)."""
  if per_element:
    u_where, s_where = written_where(applied, updates, params, inner_state, old_state)
  else:
    u_where = s_where = itertools.repeat(applied)
  u_leaves, u_tree = jax.tree.flatten(updates, is_leaf=lambda x: x is None)
  updates = u_tree.unflatten(u if u is None else select(w, u, -0.0)
                             for u, w in zip(u_leaves, u_where))
  s_leaves, s_tree = jax.tree.flatten(inner_state)
  return updates, s_tree.unflatten(
      select(w, n, o) for n, o, w in zip(s_leaves, jax.tree.leaves(old_state), s_where))


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


def is_concrete(tree: Any, numbers: bool = True) -> bool:
  """Whether every leaf is a concrete array (or a number), not a tracer.

  Extra arguments that are Python values (numbers, functions) are handed to
  the inner optimizer as they are, so they do not go through ``jax.jit``.
  """
  kinds = (jax.Array, np.ndarray, np.generic) + ((int, float, complex) if numbers else ())
  return all(isinstance(x, kinds) and not _internals.is_tracer(x)
             for x in jax.tree.leaves(tree))


def refuse_wrappers_around() -> None:
  """Raises if ``with_loss_scale``'s ``init`` runs inside a wrapper that
  undoes what it does (`inside_multisteps`, `inside_apply_if_finite`)."""
  if inside_multisteps():
    raise ValueError(
        "with_loss_scale inside optax.MultiSteps: MultiSteps keeps a NaN "
        "from one overflowing micro-batch in its accumulator for good. Use "
        "with_loss_scale(..., accumulate_steps=k) instead.")
  if inside_apply_if_finite():
    raise ValueError(
        "with_loss_scale inside optax.apply_if_finite: apply_if_finite checks "
        "the scaled gradients and, on an overflow, keeps its old state, the "
        "loss scale's included, so the scale never backs off. with_loss_scale "
        "already skips non-finite steps; use it alone (max_stalled_steps= "
        "stops a run that skips too many in a row).")


def inside_multisteps() -> bool:
  """Whether ``init`` was called, at any depth, by ``optax.MultiSteps.init``.

  MultiSteps resets its accumulator by multiplying it by zero, so one
  overflowing micro-batch leaves NaN in it for good; nothing inside the
  wrapped optimizer can undo that. MultiSteps has no hook at construction, so
  the first moment to refuse it is its ``init``, which calls ours through any
  number of chains. (`multisteps_around` refuses the state itself, wherever
  it was built.)
  """
  # Above our init, which called this.
  return _internals.called_from(optax.MultiSteps.init.__code__, skip=1)


def inside_apply_if_finite() -> bool:
  """Whether ``init`` was called, at any depth, by ``optax.apply_if_finite``'s.

  apply_if_finite checks the gradients it is given, the scaled ones, and on
  an overflow keeps the state it had, the guard's included: the loss scale
  never backs off and the step is not counted as skipped (float16
  parameters fail in its ``cond`` instead, the guard's updates being
  float32).
  """
  code = _internals.nested_code(optax.apply_if_finite, "init")
  return code is not None and _internals.called_from(code, skip=1)


def refuse_narrow_inside_apply_if_finite(updates: Any, name: str) -> None:
  """Raises a clear error where optax's would be obscure: a rounding
  transform (emitting float32 updates, `jmp_lite.rounding`) inside
  ``optax.apply_if_finite`` given 16-bit updates, whose skip branch returns
  zeros in the 16-bit dtype (``cond branches must have equal output
  types``)."""
  narrow = [x for x in jax.tree.leaves(updates)
            if is_floating(x) and np.dtype(x.dtype).itemsize == 2]
  code = _internals.nested_code(optax.apply_if_finite, "update")
  if narrow and code is not None and _internals.called_from(code, skip=1):
    raise ValueError(
        f"{name} inside optax.apply_if_finite with {np.dtype(narrow[0].dtype)} "
        f"updates: {name} emits float32 updates, and apply_if_finite's skip "
        "branch returns zeros in the updates' dtype, which its cond refuses. "
        "Put apply_if_finite inside (optax.chain(optax.apply_if_finite(opt, k), "
        f"{name}(...))), give it float32 gradients, or use "
        "jmp_lite.optax.with_loss_scale, which skips non-finite steps itself.")


def multisteps_around(opt_state: Any, is_target) -> bool:
  """Whether a leaf ``is_target`` accepts sits inside an ``optax.MultiStepsState``."""
  is_multi = lambda x: isinstance(x, optax.MultiStepsState)
  for node in jax.tree_util.tree_leaves(opt_state, is_leaf=is_multi):
    if is_multi(node) and any(
        is_target(x) for x in jax.tree_util.tree_leaves(node, is_leaf=is_target)):
      return True
  return False


def inner_blind_to_dtypes(init, params: Any, copies: Any, inner_state: Any) -> None:
  """Refuses an inner optimizer that chooses parameters by their dtype.

  The guard runs ``init`` on ``copies`` (16-bit floats as float32), so a
  choice by dtype (an ``optax.multi_transform`` label or ``optax.masked``
  mask reading ``x.dtype == jnp.bfloat16``: "Kahan for the bf16 leaves")
  sees no 16-bit leaf and silently selects nothing. Such a choice shows as
  a state of another structure for the leaves in their stored dtypes
  (traced only, `jax.eval_shape`).
  """
  # Leaf by leaf on the tree's structure (a None parameter, which Equinox's
  # filtered models hold, has a None copy); a non-array leaf has no dtype.
  narrow = jax.tree.leaves(jax.tree.map(
      lambda p, c: (c is not None and hasattr(c, "dtype") and hasattr(p, "dtype")
                    and np.dtype(c.dtype) != np.dtype(p.dtype)),
      params, copies, is_leaf=lambda x: x is None))
  if not any(narrow):
    return
  as_stored = jax.tree.map(lambda p, c: None if c is None else p, params, copies,
                           is_leaf=lambda x: x is None)
  try:
    stored_state = jax.eval_shape(init, as_stored)
  except Exception:  # pylint: disable=broad-except
    return  # it cannot run on them at all: nothing to compare
  if jax.tree.structure(stored_state) != jax.tree.structure(inner_state):
    raise ValueError(
        "with_loss_scale: the inner optimizer's state has another structure for "
        "the parameters in their stored dtypes than for the float32 copies of "
        "16-bit parameters it runs on: it chooses parameters by dtype (an "
        "optax.multi_transform label or optax.masked mask reading x.dtype?). "
        "Under the guard every floating parameter it sees is float32, so that "
        "choice would select none of them. Compute the labels or mask once from "
        "the stored parameters and pass them as a tree: "
        "optax.multi_transform(transforms, label_fn(params)).")


def loss_scale_hint(value: Any) -> str:
  """What to say of a loss scale that is not jmp_lite's: jmp's own classes
  share the names (``import jmp_lite as jmp`` gives jmp_lite's)."""
  module = type(value).__module__ or ""
  if module == "jmp" or module.startswith("jmp."):
    return (f" That is jmp's {type(value).__name__}: use jmp_lite's "
            f"(jmp_lite.{type(value).__name__}, or `import jmp_lite as jmp`), "
            "whose state compiles once and skips non-finite steps.")
  return ""

