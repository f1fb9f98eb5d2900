"""A loss scale measured before training, instead of found by skipping steps.

Every dynamic loss scaler starts from a constant (2**15 here, up to 2**32
elsewhere) and spends its first steps overflowing and backing off. `calibrate`
measures instead: one float32 forward and backward pass of the loss on a
batch, recording every intermediate value of the forward pass and its
cotangent (the gradient of the loss with respect to it). The scaled
cotangents are what a half-precision backward pass holds, so the largest
power of two that keeps the largest of them below the compute dtype's
maximum, with ``margin`` to spare, is a scale that does not overflow on that
batch. The same pass says, per scope (a Flax module's path, a
``jax.named_scope``), how large its activations are and how many of its
cotangents would still be subnormal or flushed to zero at that scale: the
scopes to keep in float32.

Values inside ``jit``, ``remat``, ``scan``, ``cond`` and ``while`` bodies
are measured where they are computed (a scanned stack of layers: each scope
over all its iterations; a branch not taken reports zeros). Inside a
``while`` loop (which has no reverse-mode derivative) and a
``custom_jvp``/``custom_vjp`` body (whose rule, not the body, computes the
backward pass) the forward values are measured and the cotangents are those
of their outputs. ``shard_map`` and ``pmap`` bodies, whose shapes are a
device's, are measured at their outputs. Which bodies are entered is
`jmp_lite._jaxpr.traverse`'s table, shared with the other passes. A value computed only from the batch or from
``stop_gradient`` outputs (a frozen teacher) is measured on the forward
pass, and its cotangent is zero, as no gradient reaches it in training. A
value at its dtype's largest magnitude (the ``jnp.finfo(dtype).min``
attention masks with) is a fill value, not an activation, and is not
counted.

Every intermediate is held at once, so calibrate on one batch of the size
you train with, not on a larger one.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
import warnings
from typing import Any, Callable, Mapping, Union

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._jaxpr import arguments as _arguments
from jmp_lite._jaxpr.passes import calibrate as _calibrate
from jmp_lite import loss_scale as ls_lib
from jmp_lite.policy import Policy, get_policy

__all__ = ("Calibration", "ScopeStats", "calibrate")


@dataclasses.dataclass(frozen=True)
class ScopeStats:
  """What one scope's forward values and cotangents look like (float32 pass).

  Attributes:
    max_activation: largest ``|value|`` of the scope's forward outputs.
    max_cotangent: largest ``|cotangent|`` of those outputs, at loss scale 1.
    underflow: of the non-zero cotangents, the fraction that would be
      subnormal or zero in the compute dtype at the calibrated scale.
    overflow: whether a forward value exceeds the compute dtype's maximum
      divided by the margin.
  """

  max_activation: float
  max_cotangent: float
  underflow: float
  overflow: bool


@dataclasses.dataclass(frozen=True)
class Calibration:
  """What `calibrate` measured, and the loss scale it chose.

  Attributes:
    loss_scale: the largest power of two (within ``[1, max_loss_scale]``) for
      which ``loss_scale * max_cotangent * margin`` stays below the compute
      dtype's maximum; 1.0 for a compute dtype with float32's range (bf16).
    max_cotangent: the largest ``|cotangent|``, at loss scale 1, of the
      parameters and of the values computed inside a scope (a Flax module,
      a ``jax.named_scope``): what a wrapped model computes in half
      precision, not the loss around it. Of every value, for a function
      without scopes.
    compute_dtype: the dtype the scale was chosen for.
    margin: the headroom factor used.
    scopes: per-scope statistics, keyed by scope path ("" for values
      outside any scope).
    keep_float32: the scopes whose activations overflow the compute dtype or
      whose cotangents underflow more than ``underflow_threshold`` of the
      time at ``loss_scale``.
  """

  loss_scale: float
  max_cotangent: float
  compute_dtype: np.dtype
  margin: float
  scopes: Mapping[str, ScopeStats]
  keep_float32: tuple[str, ...]

  def dynamic_loss_scale(self, **kwargs) -> ls_lib.DynamicLossScale:
    """A `jmp_lite.DynamicLossScale` starting from the calibrated scale."""
    return ls_lib.DynamicLossScale(jnp.float32(self.loss_scale), **kwargs)

  def flax_rules(self, policy: Union[Policy, str] = "p=f32,c=f32,o=f32") -> dict:
    """``rules`` for `jmp_lite.flax.wrap` keeping `keep_float32` in ``policy``.

    Each kept module's submodules too. For a Linen model calibrated
    unwrapped: its scope paths start with the root module's class name,
    which wrap's paths leave out.
    """
    return {re.escape(path.split("/", 1)[1]) + "(/.*)?": policy
            for path in self.keep_float32 if "/" in path}


def _number(name: str, value: Any, *, low: float, high: float = math.inf,
            what: str) -> float:
  """``value`` as a float if it is a real number in [low, high], else a clear error."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
    raise TypeError(f"calibrate: {name} must be {what}, got {value!r} "
                    f"({type(value).__name__})")
  value = float(value)
  if not (math.isfinite(value) and low <= value <= high):
    raise ValueError(f"calibrate: {name} must be {what}, got {value!r}")
  return value


def calibrate(
    loss_fn: Callable[..., Any],
    params: Any,
    *args: Any,
    policy: Union[Policy, str],
    margin: float = 8.0,
    underflow_threshold: float = 0.5,
    max_loss_scale: float = 2.0 ** 24,
    **kwargs: Any,
) -> Calibration:
  """Measures a float32 forward and backward pass; returns a loss scale for ``policy``.

  Args:
    loss_fn: ``loss_fn(params, *args, **kwargs)`` returning a scalar loss
      (or ``(loss, aux)``), computing in float32: the model unwrapped, or
      wrapped with a float32 policy. An NNX model opens no name scopes of
      its own: wrapped (``jmp_lite.flax.wrap(model, "p=f32,c=f32,o=f32")``)
      each module's call opens its path, and the scopes are its modules.
    params: the parameters (differentiated, as in training).
    *args: the rest of ``loss_fn``'s arguments: one training batch.
    policy: the policy to train with; its compute dtype sets the range.
    margin: headroom: the largest scaled cotangent is kept below the compute
      dtype's maximum divided by ``margin``, because cotangents change from
      batch to batch and grow in training. The default, 8 (three doublings),
      is what pure float16 digits (``examples/train_digits.py``) needs to
      skip no step at the start; 4 skips one there.
    underflow_threshold: a scope whose non-zero cotangents underflow more
      often than this at the chosen scale is suggested for float32.
    max_loss_scale: the largest scale returned.
    **kwargs: keyword arguments of ``loss_fn``.

  Returns:
    A `Calibration`.

  Raises:
    TypeError: if ``margin``, ``underflow_threshold`` or ``max_loss_scale`` is
      not a real number (NumPy scalars are).
    ValueError: if ``margin`` or ``max_loss_scale`` is not a finite number
      >= 1, ``underflow_threshold`` is outside [0, 1], or the float32 pass is
      not finite (the model overflows float32 itself, or the batch holds
      NaN/inf).

  Warns:
    UserWarning: if the largest cotangent exceeds the compute dtype's
      maximum / ``margin`` even at loss scale 1 (the smallest returned): the
      half-precision backward pass overflows there at any loss scale. The
      warning names the scopes.

  Example:
    >>> import jax.numpy as jnp
    >>> import jmp_lite
    >>> loss = lambda w, x: jnp.sum((x @ w) ** 2)
    >>> cal = jmp_lite.calibrate(loss, jnp.full((4, 4), 30.0), jnp.ones((2, 4)),
    ...                          policy="p=f32,c=f16,o=f32")
    >>> # The weight gradient is the largest cotangent: 2 rows * 2 * (4 * 30).
    >>> # 65504 / (8 * 480) = 17.1: the largest power of two below is 16.
    >>> cal.max_cotangent, cal.loss_scale
    (480.0, 16.0)
  """
  policy = get_policy(policy)
  margin = _number("margin", margin, low=1.0, what="a finite number >= 1")
  underflow_threshold = _number("underflow_threshold", underflow_threshold, low=0.0,
                                high=1.0, what="a number in [0, 1]")
  max_loss_scale = _number("max_loss_scale", max_loss_scale, low=1.0,
                           what="a finite number >= 1")
  compute = np.dtype(policy.compute_dtype)
  info = jnp.finfo(compute)

  # Array leaves of the batch are traced; the others (``train=False``, a
  # name, None) reach loss_fn as the Python values they are.
  leaves, treedef, traced = _arguments.split(args, kwargs, (*_arguments.ARRAYS, np.generic))
  arrays = [leaves[i] for i in traced]

  def fun(p, arrays):
    a, k = _arguments.refill(leaves, traced, treedef, arrays)
    return loss_fn(p, *a, **k)

  closed = jax.make_jaxpr(fun)(params, arrays)
  jaxpr = closed.jaxpr
  # Every floating output of every equation, in the bodies of jit, remat,
  # scan and cond too, gets a zero added to it: the gradient with respect to
  # that zero is the value's cotangent.
  # (Not a value computed only from the batch, or through stop_gradient: no
  # gradient reaches it in training. Nor one inside a while loop or a custom
  # rule's body: measured, not differentiated.)
  flat_in = jax.tree_util.tree_leaves((params, arrays))
  n_params = len(jax.tree_util.tree_leaves(params))
  points = _calibrate.points(jaxpr, dead=[False] * n_params + [True] * (len(flat_in) - n_params))
  zeros = [jnp.zeros(shape, dtype) if live else None for _, shape, dtype, _, live in points]

  def run(perturb, diff_in, rest_in):
    out, seen = _calibrate.evaluate(jaxpr, closed.consts, [*diff_in, *rest_in], (),
                          {k: z for (k, *_), z in zip(points, perturb)})
    values = [seen[k] for k, *_ in points]
    return out[0].astype(jnp.float32), values

  diff_in, rest_in = flat_in[:n_params], flat_in[n_params:]
  (loss, act_max), (cts, grads) = jax.jit(jax.value_and_grad(run, argnums=(0, 1),
                                                              has_aux=True))(
      zeros, diff_in, rest_in)
  # A value no gradient reaches has a zero cotangent.
  cts = [np.zeros(shape, np.float32) if c is None else np.asarray(c, np.float32)
         for c, (_, shape, *_) in zip(cts, points)]
  grads = [np.asarray(g, np.float32) for g in grads
           if jnp.issubdtype(jnp.asarray(g).dtype, jnp.floating)]
  act_max = [float(a) for a in act_max]
  every = [*cts, *grads]
  if not (np.isfinite(float(loss)) and all(np.isfinite(c).all() for c in every)
          and all(math.isfinite(a) for a in act_max)):
    raise ValueError(
        "calibrate: the float32 pass is not finite (loss "
        f"{float(loss)!r}): check the batch for NaN/inf and that loss_fn computes "
        "in float32.")
  # What a half-precision pass holds: a Flax model's (or named scope's)
  # values and the parameter gradients. Outside every scope (the loss around
  # a model, in the output dtype) only when nothing is scoped.
  scope_of = [scope for _, _, _, scope, _ in points]
  scoped = [k for k, scope in enumerate(scope_of) if scope]
  half = [cts[k] for k in (scoped or range(len(points)))] + grads
  max_ct = max((float(np.max(np.abs(c))) for c in half if c.size), default=0.0)

  if info.max >= jnp.finfo(jnp.float32).max / 2 or max_ct == 0.0:
    scale = 1.0 if info.max >= jnp.finfo(jnp.float32).max / 2 else float(max_loss_scale)
  else:
    scale = 2.0 ** math.floor(math.log2(float(info.max) / (margin * max_ct)))
    scale = float(min(max(scale, 1.0), max_loss_scale))

  tiny = float(info.smallest_normal)
  per_scope: dict[str, list] = {}
  for k, scope in enumerate(scope_of):
    c = np.abs(cts[k])
    nonzero = c[c != 0]
    entry = per_scope.setdefault(scope, [0.0, 0.0, 0, 0])
    entry[0] = max(entry[0], act_max[k])
    entry[1] = max(entry[1], float(c.max()) if c.size else 0.0)
    entry[2] += int(np.count_nonzero(nonzero * scale < tiny))
    entry[3] += int(nonzero.size)
  scopes = {
      name: ScopeStats(max_activation=a, max_cotangent=m,
                       underflow=(u / n) if n else 0.0,
                       overflow=a > float(info.max) / margin)
      for name, (a, m, u, n) in sorted(per_scope.items())}
  keep = tuple(name for name, s in scopes.items()
               if name and (s.overflow or s.underflow > underflow_threshold))
  if max_ct * scale > float(info.max) / margin:
    # Even the smallest scale (1) leaves no headroom: the half-precision
    # backward pass will overflow there, whatever the loss scale does.
    over = sorted(name or "(outside every scope)" for name, s in scopes.items()
                  if s.max_cotangent * scale > float(info.max) / margin)
    warnings.warn(
        f"calibrate: the largest cotangent, {max_ct:g}, exceeds {compute.name}'s "
        f"maximum ({float(info.max):g}) / margin ({margin:g}) at loss scale "
        f"{scale:g}, the smallest this returns: the {compute.name} backward pass "
        f"overflows there at any loss scale. Scopes: {', '.join(over[:8]) or 'the parameter gradients'}"
        f"{' ...' if len(over) > 8 else ''}. Compute them in float32 "
        "(jmp_lite.flax.wrap(rules=...)), or scale the loss down in loss_fn.",
        UserWarning, stacklevel=2)
  return Calibration(loss_scale=scale, max_cotangent=max_ct, compute_dtype=compute,
                     margin=float(margin), scopes=scopes, keep_float32=keep)
