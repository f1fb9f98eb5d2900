"""Loss scaling: the state machines, `all_finite` and `select_tree`.

Every loss scale is a frozen dataclass registered as a pytree whose fields are
all array leaves of a fixed dtype (float32 scales and factors, int32 counters):
no weak types, no Python scalars and no per-value static fields, so a jitted
step that takes and returns a loss scale compiles once however the scale
changes, and every field survives ``jit``, ``tree_map``, ``lax.scan`` and
checkpointing (jmp drops ``min_loss_scale`` and keeps ``StaticLossScale``'s
value in the treedef, which recompiles for each value).

Values are checked and converted once, when the user constructs a loss scale;
unflattening (inside ``jit``, after ``tree_map``) does not re-run the checks.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _exact
from jmp_lite import _reduce
from jmp_lite import _replicas
from jmp_lite import _scaling
from jmp_lite import _struct
from jmp_lite._dtypes import is_inexact

__all__ = (
    "LossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "DynamicLossScale",
    "all_finite",
    "select_tree",
    "AxisName",
)

T = TypeVar("T")
AxisName = _scaling.AxisName

_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).tiny)


@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
  """No-op loss scale does nothing.

  Example:
    >>> import jmp_lite
    >>> ls = jmp_lite.NoOpLossScale()
    >>> ls.scale(2.0)
    2.0
  """

  @property
  def loss_scale(self) -> jax.Array:
    return jnp.ones((), jnp.float32)

  def scale(self, tree: T) -> T:
    return tree

  def unscale(self, tree: T) -> T:
    return tree

  def adjust(self, grads_finite: jax.Array) -> "NoOpLossScale":
    _scaling.check_flag(grads_finite, "NoOpLossScale.adjust(grads_finite)")
    return self


@dataclasses.dataclass(frozen=True)
class StaticLossScale:
  """Scales and unscales by a fixed constant.

  Unlike jmp, the scale is a float32 array leaf rather than part of the
  treedef, so changing its value does not recompile a jitted step.

  Args:
    loss_scale: a positive finite number.

  Example:
    >>> import jax.numpy as jnp
    >>> import jmp_lite
    >>> ls = jmp_lite.StaticLossScale(128.0)
    >>> float(ls.unscale(ls.scale(jnp.float32(3.0))))
    3.0
  """

  loss_scale: jax.Array

  def __post_init__(self):
    scale, host = _struct.as_scalar(self.loss_scale, jnp.float32, "loss_scale")
    _struct.check_positive_finite(host, "StaticLossScale.loss_scale", normal=True)
    object.__setattr__(self, "loss_scale", scale)

  def scale(self, tree: T) -> T:
    return _scaling.multiply(tree, self.loss_scale)

  def unscale(self, tree: T) -> T:
    return _scaling.unscaled(tree, self.loss_scale)

  def adjust(self, grads_finite: jax.Array) -> "StaticLossScale":
    _scaling.check_flag(grads_finite, "StaticLossScale.adjust(grads_finite)")
    return self


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
  """Dynamic loss scale, with jmp's fields and semantics plus a cap and hysteresis.

  Dynamic loss scaling looks for the largest scale that keeps gradients
  finite: it grows the scale by ``factor`` after ``period`` consecutive finite
  steps, and divides it by ``factor`` when gradients overflow. With
  ``hysteresis=h`` (DeepSpeed, Megatron) the first ``h - 1`` overflows leave
  the scale alone; they are still reported non-finite and the caller still
  skips them. ``hysteresis=1`` (the default) is jmp::

      loss_scale = 2 ** 15; counter = 0; left = hysteresis
      for step in range(num_steps):
        grads = unscale(grad(scale(loss)))
        if all_finite(grads):
          counter += 1
          if consecutive_hysteresis:
            left = hysteresis
          if counter == period:
            counter = 0; left = hysteresis
            if isfinite(loss_scale * factor):
              loss_scale = min(loss_scale * factor, max_loss_scale)
        else:
          counter = 0
          if left > 1:
            left -= 1
          else:
            loss_scale = max(min_loss_scale, loss_scale / factor, tiny_f32)

  Which finite steps refill the tolerance is DeepSpeed's
  ``consecutive_hysteresis`` flag:

  * ``False`` (the default, as in Megatron-LM's ``DynamicGradScaler`` and
    DeepSpeed's default config): only a growth of the scale refills it, so
    ``h`` overflows within one growth period back off even with finite steps
    between them;
  * ``True`` (DeepSpeed's ``consecutive_hysteresis=True``, Paddle's
    ``decr_every_n_nan_or_inf``): every finite step refills it, so only ``h``
    overflows *in a row* back off.

  Once the tolerance is used up, every further overflow backs off until it is
  refilled. The scale never reaches zero: below ``min_loss_scale`` (which may
  be 0 or below 1, as in Flax) the smallest normal float32 is the floor.

  Args:
    loss_scale: initial scale, positive and finite (2**15 is common).
    counter: finite steps since the last change (int32).
    period: finite steps between growths (>= 1).
    factor: growth and backoff factor (> 1).
    min_loss_scale: floor (>= 0 and <= ``loss_scale``; default 1).
    max_loss_scale: cap (>= ``loss_scale``; default: the largest float32).
    hysteresis: overflows tolerated before backing off (>= 1).
    hysteresis_left: overflows left before the next backoff, in
      ``[1, hysteresis]`` (state; defaults to ``hysteresis``).
    consecutive_hysteresis: whether every finite step refills
      ``hysteresis_left`` (see above; default False).

  Example:
    >>> import jax.numpy as jnp
    >>> import jmp_lite
    >>> ls = jmp_lite.DynamicLossScale(jnp.float32(2 ** 15), period=2)
    >>> ls = ls.adjust(jnp.bool_(False))
    >>> float(ls.loss_scale)
    16384.0
    >>> ls = ls.adjust(jnp.bool_(True)).adjust(jnp.bool_(True))
    >>> float(ls.loss_scale)
    32768.0
  """

  loss_scale: jax.Array
  counter: jax.Array = 0
  period: jax.Array = 2000
  factor: jax.Array = 2
  min_loss_scale: jax.Array = 1.0
  max_loss_scale: jax.Array = dataclasses.field(default=_F32_MAX, kw_only=True)
  hysteresis: jax.Array = dataclasses.field(default=1, kw_only=True)
  hysteresis_left: jax.Array = dataclasses.field(default=None, kw_only=True)
  consecutive_hysteresis: jax.Array = dataclasses.field(default=False, kw_only=True)

  def __post_init__(self):
    name = "DynamicLossScale"
    scale, s = _struct.as_scalar(self.loss_scale, jnp.float32, "loss_scale",
                          warn_non_floating=True)
    _struct.check_positive_finite(s, f"{name}.loss_scale", normal=True)
    counter, c = _struct.as_scalar(self.counter, jnp.int32, "counter")
    if c is not None and c < 0:
      raise ValueError(f"{name}.counter must be >= 0, got {self.counter!r}")
    period, p = _struct.as_scalar(self.period, jnp.int32, "period")
    if p is not None and p < 1:
      raise ValueError(f"{name}.period must be >= 1, got {self.period!r}")
    factor, f = _struct.as_scalar(self.factor, jnp.float32, "factor")
    if f is not None and not (np.isfinite(f) and f > 1):
      raise ValueError(f"{name}.factor must be finite and > 1, got {self.factor!r}")
    min_scale, lo = _struct.as_scalar(self.min_loss_scale, jnp.float32,
                               "min_loss_scale", warn_non_floating=True)
    _struct.check_positive_finite(lo, f"{name}.min_loss_scale", allow_zero=True)
    max_scale, hi = _struct.as_scalar(self.max_loss_scale, jnp.float32, "max_loss_scale")
    _struct.check_positive_finite(hi, f"{name}.max_loss_scale")
    if lo is not None and hi is not None and lo > hi:
      raise ValueError(
          f"{name}: min_loss_scale={lo} is larger than max_loss_scale={hi}")
    if s is not None and lo is not None and lo > s:
      raise ValueError(
          f"{name}: min_loss_scale={self.min_loss_scale!r} is larger than "
          f"loss_scale={self.loss_scale!r}; pass min_loss_scale <= "
          f"{self.loss_scale!r} to start below the default floor of 1.")
    if s is not None and hi is not None and s > hi:
      raise ValueError(
          f"{name}: loss_scale={self.loss_scale!r} is larger than "
          f"max_loss_scale={self.max_loss_scale!r}.")
    hysteresis, h = _struct.as_scalar(self.hysteresis, jnp.int32, "hysteresis")
    if h is not None and h < 1:
      raise ValueError(f"{name}.hysteresis must be >= 1, got {self.hysteresis!r}")
    left = hysteresis if self.hysteresis_left is None else self.hysteresis_left
    left, l = _struct.as_scalar(left, jnp.int32, "hysteresis_left")
    if l is not None and h is not None and not 1 <= l <= h:
      raise ValueError(
          f"{name}.hysteresis_left must be in [1, hysteresis={h}], got "
          f"{self.hysteresis_left!r}")
    consecutive = self.consecutive_hysteresis
    if not (isinstance(consecutive, (bool, np.bool_, jax.Array, np.ndarray))
            and np.shape(consecutive) == ()
            and getattr(consecutive, "dtype", np.dtype(bool)) == np.bool_):
      raise TypeError(
          f"{name}.consecutive_hysteresis must be a bool, got {consecutive!r}")
    consecutive = jnp.asarray(consecutive, jnp.bool_)
    for field, value in (("loss_scale", scale), ("counter", counter),
                         ("period", period), ("factor", factor),
                         ("min_loss_scale", min_scale),
                         ("max_loss_scale", max_scale),
                         ("hysteresis", hysteresis), ("hysteresis_left", left),
                         ("consecutive_hysteresis", consecutive)):
      object.__setattr__(self, field, value)

  def scale(self, tree: T) -> T:
    return _scaling.multiply(tree, self.loss_scale)

  def unscale(self, tree: T) -> T:
    return _scaling.unscaled(tree, self.loss_scale)

  def _grown(self) -> jax.Array:
    """The scale times ``factor``, capped at ``max_loss_scale`` (kept if inf)."""
    scale = self.loss_scale.astype(jnp.float32)
    grown = scale * self.factor
    return jnp.where(jnp.isfinite(grown), jnp.minimum(grown, self.max_loss_scale), scale)

  def _shrunk(self) -> jax.Array:
    """The scale over ``factor``, at least ``min_loss_scale`` and normal."""
    # Correctly rounded on every backend: XLA:GPU's float32 division is not.
    return jnp.maximum(jnp.maximum(self.min_loss_scale,
                                   _exact.divide(self.loss_scale.astype(jnp.float32),
                                                 self.factor)),
                       jnp.float32(_F32_TINY))

  def adjust(self, grads_finite: jax.Array) -> "DynamicLossScale":
    """Returns the next state dependent on whether grads are finite."""
    finite = _scaling.check_flag(grads_finite, "DynamicLossScale.adjust(grads_finite)")
    # Under shard_map(check_vma=True) a flag that differs between devices
    # would make the replicated scale diverge; reduce it with axis_name.
    _replicas.check_decision(finite, None, "DynamicLossScale.adjust",
                             untracked=False)
    scale = self.loss_scale.astype(jnp.float32)
    grown, shrunk = self._grown(), self._shrunk()
    grow_now = self.counter >= self.period - 1
    back_off = self.hysteresis_left <= 1
    new_scale = jnp.where(finite, jnp.where(grow_now, grown, scale),
                          jnp.where(back_off, shrunk, scale))
    refill = finite & (grow_now | self.consecutive_hysteresis)
    left = jnp.where(finite, self.hysteresis_left,
                     jnp.maximum(self.hysteresis_left - 1, 1))
    return _struct.replace_fields(
        self,
        loss_scale=new_scale,
        counter=jnp.where(finite & ~grow_now, self.counter + 1, 0),
        hysteresis_left=jnp.where(refill, self.hysteresis, left),
    )


for _cls in (NoOpLossScale, StaticLossScale, DynamicLossScale):
  _struct.register_state(_cls)

LossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]


def all_finite(tree: Any, *, axis_name: AxisName = None) -> jax.Array:
  """Returns a scalar bool: whether every floating leaf of ``tree`` is finite.

  NaN, +inf and -inf in any floating dtype (float64 to float8), or in either
  part of a complex number, make it False; integer and other non-floating leaves are ignored; an empty tree is True.

  One exact pass: ``x * 0`` is 0 for every finite element and NaN for an inf
  or NaN, and its float32 sum is NaN exactly when a leaf holds one (a plain
  sum can also overflow from large finite values). Leaves of the same shape
  are combined element by element before they are reduced, so the check
  compiles to one reduction per distinct shape (`jmp_lite._reduce`). The
  tempting ``max(abs(x)) < inf`` is wrong on XLA's CPU backend, whose max
  ignores NaN. Narrow leaves are read as their format holds them, also where
  XLA:GPU keeps them in float32 (`jmp_lite._exact.widen`).

  Args:
    tree: any pytree.
    axis_name: under ``shard_map``/``pmap``, the mesh axis name (or names) to
      reduce the decision over, so that every replica agrees.

  Example:
    >>> import jax.numpy as jnp
    >>> import jmp_lite
    >>> bool(jmp_lite.all_finite({"a": jnp.ones(3), "b": jnp.array([jnp.nan])}))
    False
  """
  axis_name = _scaling.check_axis_name(axis_name, "all_finite")
  # Python floats count, as in jmp (where `jnp.isfinite(float("nan"))` is False).
  leaves = [jnp.asarray(x) if isinstance(x, float) else x
            for x in jax.tree_util.tree_leaves(tree)]
  leaves = [x for x in leaves if is_inexact(x)]
  finite = jnp.isfinite(_reduce.sum_of(leaves, _exact.times_zero, jnp.float32))
  if axis_name is not None:
    bad = jax.lax.psum((~finite).astype(jnp.int32), axis_name)
    finite = bad == 0
  return finite


def select_tree(pred: jax.Array, a: T, b: T) -> T:
  """Selects a pytree based on the given predicate: ``a`` if ``pred`` else ``b``.

  Leaves that are not arrays or numbers (an Equinox model's activation
  functions) are kept if they are the same object in ``a`` and ``b``, and a
  Python number equal in both stays that number (an Equinox field that
  ``eqx.filter_jit`` keeps static); selecting arrays or differing numbers
  gives arrays, as in jmp.

  Raises:
    ValueError: if ``pred`` is not a boolean scalar.
    ValueError: if ``a`` and ``b`` differ in structure, or a leaf differs in
      shape or dtype (the message names its path).
    TypeError: if a leaf that is not an array differs between ``a`` and ``b``.
  """
  pred = _scaling.check_flag(pred, "select_tree(pred)")
  a_leaves, a_def = jax.tree_util.tree_flatten_with_path(a)
  b_leaves, b_def = jax.tree_util.tree_flatten_with_path(b)
  if a_def != b_def:
    keystr = jax.tree_util.keystr
    a_paths = [keystr(p) or "(root)" for p, _ in a_leaves] + ["(nothing)"]
    b_paths = [keystr(p) or "(root)" for p, _ in b_leaves] + ["(nothing)"]
    where = next(((p, q) for p, q in zip(a_paths, b_paths) if p != q), None)
    where = (f" at leaf {where[0]} in a, {where[1]} in b" if where
             else " (same leaf paths, different node types)")
    raise ValueError(
        f"select_tree: the two trees differ in structure{where}:\n"
        f"  a: {a_def}\n  b: {b_def}")
  out = []
  for (path, x), (_, y) in zip(a_leaves, b_leaves):
    if isinstance(x, (bool, int, float, complex)) and type(x) is type(y) and repr(x) == repr(y):
      # The same Python number in both (an Equinox model's static field, a
      # dropout rate): kept a number, as `eqx.filter_jit` keeps it static.
      # (By repr: -0.0 and 0.0 differ, and NaN is itself.)
      out.append(x)
      continue
    if not all(isinstance(v, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))
               for v in (x, y)):
      # A model's own non-array leaves (an Equinox activation function): the
      # same object in both trees is kept; anything else cannot be selected.
      if x is y:
        out.append(x)
        continue
      raise TypeError(
          f"select_tree: leaf {jax.tree_util.keystr(path)} is {x!r} in a and {y!r} "
          "in b: only arrays and numbers can be selected (a leaf that is not one "
          "must be the same object in both trees).")
    sx, sy = jax.eval_shape(lambda: x), jax.eval_shape(lambda: y)
    if (sx.shape, sx.dtype) != (sy.shape, sy.dtype):
      raise ValueError(
          f"select_tree: leaf {jax.tree_util.keystr(path)} is "
          f"{sx.dtype}{list(sx.shape)} in a but {sy.dtype}{list(sy.shape)} in b.")
    out.append(jax.lax.select(pred, x, y))
  return jax.tree_util.tree_unflatten(a_def, out)
