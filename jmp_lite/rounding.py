"""Training with low-precision parameters and no float32 master copy.

Adding a small update to a bfloat16 parameter rounds it away: bfloat16 keeps 8
bits of mantissa, so ``1 + 1e-3`` is ``1``. Mixed precision avoids that with a
float32 master copy of the parameters (4 bytes each, plus float32 optimizer
moments). These transformations let parameters live in bfloat16 (or float16)
and still follow the float32 trajectory, with the standard
``optax.apply_updates``:

* `stochastic_round` rounds ``param + update`` up or down at random, with the
  probability that makes the result exact in expectation;
* `kahan_summation` keeps what rounding lost in a small compensation buffer
  and adds it back on the next step;
* `with_state_dtype` stores an optimizer's moments in a chosen dtype while
  computing each update in float32.

Both rounding transforms go last in a chain. They emit float32 updates equal to
``new_param - param``, a difference of two representable values that float32
holds exactly, so ``optax.apply_updates`` (``(p + u).astype(p.dtype)``) lands
exactly on ``new_param``. Adding a float32 update to a bfloat16 parameter uses
JAX's standard dtype promotion; under ``jax_numpy_dtype_promotion="strict"``
call ``apply_updates`` inside ``jax.numpy_dtype_promotion("standard")``.
Float32 (and wider) parameters pass through unchanged.

A pure-bfloat16 recipe (params, compute and moments in bfloat16)::

  policy = jmp_lite.get_policy("params=bfloat16,compute=bfloat16,output=float32")
  tx = jmp_lite.optax.with_loss_scale(
      optax.chain(
          jmp_lite.optax.with_state_dtype(optax.adam(1e-3), jnp.bfloat16),
          jmp_lite.optax.stochastic_round(jax.random.key(0)),  # or kahan_summation()
      ),
      jmp_lite.NoOpLossScale())
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite import _checks
from jmp_lite import _exact
from jmp_lite import _stored
from jmp_lite._stored import stored_params
from jmp_lite.policy import DTypeLike
from jmp_lite._dtypes import is_floating
from jmp_lite._dtypes import wide_dtype

__all__ = (
    "stored_params",
    "StochasticRoundState",
    "stochastic_round",
    "KahanState",
    "kahan_summation",
    "with_state_dtype",
)


def _is_low(p: Any) -> bool:
  return jnp.issubdtype(p.dtype, jnp.floating) and jnp.finfo(p.dtype).bits < 32


class StochasticRoundState(NamedTuple):
  """State of `stochastic_round`: the PRNG key of the next step.

  A typed key (``jax.random.key``) is held as its data (``uint32``,
  `jax.random.key_data`), so that every checkpointer saves it:
  ``flax.serialization.to_bytes`` refuses typed keys. A raw
  ``jax.random.PRNGKey`` is held as it is.
  """

  key: jax.Array


def _stochastic_round(x: jax.Array, dtype, key: jax.Array) -> jax.Array:
  """Rounds float32 ``x`` to ``dtype``, up or down with probability by distance.

  Every rounding is explicit (`_exact.round_to`) and the neighbour is found on
  the integer bits: XLA:GPU may otherwise keep ``x.astype(dtype)`` in float32
  (excess precision), which makes ``nearest == x``, the gap zero and the
  rounding always to nearest (biased).
  """
  near32 = _exact.round_to(x, dtype)
  # The neighbour on the other side of x (same as nearest if x is exact),
  # one step of the narrow format's bits away from nearest (a value of
  # dtype: the bitcast materialises it).
  other32 = _step_toward(near32, x, dtype)
  # In the lowest binades of bfloat16's range the gap and the distance are
  # float32 subnormals, which XLA flushes to zero (the rounding was then to
  # nearest): they are measured 2**64 times larger there, exactly.
  big = jnp.where(jnp.abs(near32) < 2.0 ** -64, jnp.float32(2.0 ** 64), jnp.float32(1))
  gap = other32 * big - near32 * big
  # Probability of `other`: distance from nearest over the gap (in [0, 1/2]).
  p_other = jnp.where(gap != 0, (x * big - near32 * big) / jnp.where(gap != 0, gap, 1.0),
                      0.0)
  u = jax.random.uniform(key, x.shape, jnp.float32)
  out = jnp.where(u < p_other, other32, near32)
  out = jnp.where(jnp.isfinite(x) & jnp.isfinite(other32), out, near32)
  return out.astype(dtype)  # exact: out holds a value of dtype


def _step_toward(v32: jax.Array, target: jax.Array, dtype) -> jax.Array:
  """The next value of ``dtype`` after ``v32`` (one of its values) toward ``target``.

  ``nextafter`` on the integer bits of the narrow format, as float32.
  """
  bits = jnp.finfo(dtype).bits
  uint = {16: jnp.uint16, 8: jnp.uint8}[bits]
  sign = 1 << (bits - 1)
  b = jax.lax.bitcast_convert_type(v32.astype(dtype), uint).astype(jnp.int32)
  up = target > v32
  negative = (b & sign) != 0
  magnitude = b & (sign - 1)
  # Away from zero: magnitude + 1; toward zero: magnitude - 1; from a zero
  # the smallest subnormal with target's sign.
  away = up != negative
  stepped = jnp.where(away, b + 1, b - 1)
  from_zero = jnp.where(up, 1, sign | 1)
  stepped = jnp.where(magnitude == 0, from_zero, stepped)
  stepped = jnp.where(target == v32, b, stepped)
  out = jax.lax.bitcast_convert_type(stepped.astype(uint), dtype)
  return out.astype(jnp.float32)


def stochastic_round(key: jax.Array) -> optax.GradientTransformation:
  """Rounds ``params + updates`` stochastically for low-precision params.

  Place it last in a chain. For each bfloat16/float16 parameter ``p`` and
  float32 update ``u`` it draws ``new = SR(p + u)``, which is one of the two
  representable neighbours of ``p + u`` with the probability that makes
  ``E[new] = p + u``, and emits ``new - p`` in float32. It never moves a value
  by more than one ulp of the parameter dtype beyond ``p + u``. The key
  advances once per step; the same key gives the same run. One exception:
  bfloat16's subnormals (below 1.2e-38) are float32's, which XLA flushes to
  zero on CPUs and GPUs, so a result there is 0, as ``optax.apply_updates``
  makes it (float16's subnormals round as any other value).

  Under ``jit`` a sharded parameter draws as the whole array would. Inside
  ``shard_map`` every device holds the same key, so the shards of a
  parameter split over a mesh axis draw the same numbers: each shard is
  still unbiased, but their roundings are correlated (and replicated
  parameters round alike on every device, as they must).

  Args:
    key: a PRNG key (``jax.random.key`` or ``PRNGKey``).

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import jmp_lite
    >>> params = {"w": jnp.ones(4096, jnp.bfloat16)}
    >>> tx = jmp_lite.optax.stochastic_round(jax.random.key(0))
    >>> updates, _ = tx.update({"w": jnp.full(4096, 1e-3)}, tx.init(params), params)
    >>> with jax.numpy_dtype_promotion("standard"):
    ...   new = optax.apply_updates(params, updates)
    >>> round(float(jnp.mean(new["w"].astype(jnp.float32))), 3)  # 1.001 on average
    1.001

  Raises:
    TypeError: if ``key`` is not a PRNG key.
  """
  typed = isinstance(key, jax.Array) and jax.dtypes.issubdtype(
      key.dtype, jax.dtypes.prng_key)
  raw = (isinstance(key, (jax.Array, np.ndarray)) and key.dtype == np.uint32
         and np.shape(key) == (2,))
  if not (typed and np.shape(key) == () or raw):
    raise TypeError(
        "stochastic_round: key must be one PRNG key (jax.random.key(0), or a "
        f"raw uint32[2] jax.random.PRNGKey(0)), got {key!r}"
        f"{'' if not hasattr(key, 'dtype') else f' ({key.dtype}{list(np.shape(key))})'}.")

  impl = jax.random.key_impl(key) if typed else None
  wrap = ((lambda data: jax.random.wrap_key_data(data, impl=impl)) if typed
          else (lambda data: data))
  unwrap = jax.random.key_data if typed else (lambda k: k)

  def init(params):
    del params
    return StochasticRoundState(key=jnp.asarray(unwrap(key)))

  def update(updates, state, params=None):
    _checks.refuse_narrow_inside_apply_if_finite(updates, "stochastic_round")
    params = _stored.params_as_stored(params, "stochastic_round")
    step_key, next_key = jax.random.split(wrap(state.key))
    treedef, paths, us, ps = _pairs(updates, params, "stochastic_round")
    keys = jax.random.split(step_key, max(len(ps), 1))

    def one(u, p, k):
      if not _is_low(p):
        return u
      p32 = _exact.widen(p)
      new = _stochastic_round(p32 + u.astype(jnp.float32), p.dtype, k)
      return new.astype(jnp.float32) - p32

    return (treedef.unflatten([one(u, p, k) for u, p, k in zip(us, ps, keys)]),
            StochasticRoundState(unwrap(next_key)))

  return optax.GradientTransformation(init, update)


class KahanState(NamedTuple):
  """State of `kahan_summation`: what rounding lost, per parameter."""

  compensation: Any


def kahan_summation(dtype: Optional[DTypeLike] = None) -> optax.GradientTransformation:
  """Kahan-compensated updates for low-precision params.

  Place it last in a chain. For each bfloat16/float16 parameter it keeps a
  compensation ``c`` (in the parameter's dtype, or ``dtype``) and does::

    y   = u + c                  # in float32
    new = round(p + y)           # to the parameter's dtype
    c   = y - (new - p)          # what the rounding lost
    emit new - p                 # float32, exact

  so that ``p + c`` follows the float32 sum of ``u``. How closely depends on
  ``c``'s dtype:

  * float32 (``kahan_summation(jnp.float32)``, 4 bytes per parameter more):
    to float32's rounding. 10,000 updates of ``1e-4`` onto a bfloat16 ``1.0``
    end at ``2.0``, the bfloat16 value nearest the exact sum.
  * the parameter's own dtype (the default, as optimi's Kahan summation
    keeps it: 2 bytes): ``c`` keeps 8 (bfloat16) or 11 (float16) significant
    bits of what each rounding lost, so each step may lose up to 2**-9
    (bfloat16) or 2**-12 (float16) of the parameter's ulp. Updates that vary
    from step to step, as gradients do, average these losses out; a long run
    of the same update far below the ulp adds them up: the 10,000 updates
    above end at ``2.03125``, 2 bfloat16 ulps above ``2.0`` (at most
    ``n / 512`` ulps, of the largest value reached, after ``n`` steps).

  The compensation keeps the dtype chosen here inside `with_state_dtype`,
  which stores the other state in its own dtype.

  Args:
    dtype: dtype of the compensation buffer (default: each parameter's dtype;
      ``jnp.float32`` to follow the float32 sum to its rounding).

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import jmp_lite
    >>> params = {"w": jnp.ones(1, jnp.bfloat16)}
    >>> tx = jmp_lite.optax.kahan_summation()
    >>> state = tx.init(params)
    >>> for _ in range(100):  # each 1e-3 alone is lost to rounding
    ...   updates, state = tx.update({"w": jnp.full(1, 1e-3)}, state, params)
    ...   with jax.numpy_dtype_promotion("standard"):
    ...     params = optax.apply_updates(params, updates)
    >>> float(params["w"][0])
    1.1015625

  Raises:
    ValueError: if ``dtype`` is not a floating dtype.
  """
  if dtype is not None:
    dtype = _floating_dtype(dtype, "kahan_summation")

  def init(params):
    params = _stored.params_as_stored(params, "kahan_summation")

    def zeros(path, p):
      if not hasattr(p, "dtype"):
        raise TypeError(f"kahan_summation: param {jax.tree_util.keystr(path)} is "
                        f"{p!r}, not an array.")
      if not _is_low(p):
        return jnp.zeros((), jnp.float32)  # placeholder: nothing to compensate
      # zeros_like: sharded as the parameter is (FSDP).
      return jnp.zeros_like(p, p.dtype if dtype is None else dtype)
    return KahanState(jax.tree_util.tree_map_with_path(zeros, params))

  def update(updates, state, params=None):
    _checks.refuse_narrow_inside_apply_if_finite(updates, "kahan_summation")
    params = _stored.params_as_stored(params, "kahan_summation")

    def one(u, p, c):
      if not _is_low(p):
        return u, c
      p32 = _exact.widen(p)
      y = u.astype(jnp.float32) + _exact.widen(c).astype(jnp.float32)
      # The rounding onto the parameter's dtype must happen for `applied` to
      # be what the parameter receives; `(p32 + y).astype(p.dtype)` read back
      # as float32 may be kept unrounded by XLA:GPU (excess precision), and
      # the compensation is then always 0.
      new32 = _exact.round_to(p32 + y, p.dtype)
      applied = new32 - p32
      # Saturated: a compensation dtype of less range than the parameter's
      # (float16 for bfloat16) would otherwise hold an inf, and every later
      # step would be skipped.
      return applied, _saturating_cast(y - applied, c.dtype)

    # Split by the updates' structure, not by `isinstance(x, tuple)`: the
    # parameters' own tuples (``(w, b)``, an Equinox MLP's layers) are tuples
    # too, and were taken for (update, compensation) pairs.
    treedef, paths, us, ps = _pairs(updates, params, "kahan_summation")
    cs = _flatten_like(treedef, state.compensation, "kahan_summation", "state")
    for where, p, c in zip(paths, ps, cs):
      if _is_low(p) and np.shape(c) != np.shape(p):
        raise ValueError(
            f"kahan_summation: the state's compensation {where} is "
            f"{jnp.dtype(c.dtype).name}{list(np.shape(c))}, its parameter "
            f"{p.dtype.name}{list(p.shape)}: the state was made for other "
            "parameters. Make it with init(params).")
    pairs = [one(u, p, c) for u, p, c in zip(us, ps, cs)]
    return (treedef.unflatten([u for u, _ in pairs]),
            KahanState(treedef.unflatten([c for _, c in pairs])))

  return optax.GradientTransformation(init, update)


def _flatten_like(treedef, tree: Any, name: str, what: str) -> list:
  """``tree``'s subtrees at the leaves of ``treedef``, or a ValueError."""
  try:
    return treedef.flatten_up_to(tree)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{name}: the {what} and the updates differ in structure: "
                     f"{e}") from None


def _pairs(updates: Any, params: Any, name: str):
  """``(treedef, paths, updates, params)`` leaf by leaf, the updates' tree.

  Raises:
    ValueError: where the trees differ, or a leaf's shapes do (naming it).
    TypeError: for a parameter that is not an array, or a low-precision
      parameter's update that is not floating (naming it).
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(updates)
  ps = _flatten_like(treedef, params, name, "params")
  paths = [jax.tree_util.keystr(path) or "(root)" for path, _ in flat]
  for where, (_, u), p in zip(paths, flat, ps):
    if not hasattr(p, "dtype") or not hasattr(u, "dtype"):
      raise TypeError(f"{name}: {where} is {p!r} in the params and {u!r} in the "
                      "updates; both must be arrays.")
    if np.shape(u) != np.shape(p):
      raise ValueError(f"{name}: update {where} has shape {list(np.shape(u))}, "
                       f"its parameter {list(np.shape(p))}.")
    if _is_low(p) and not jnp.issubdtype(u.dtype, jnp.floating):
      raise TypeError(f"{name}: update {where} is {jnp.dtype(u.dtype).name} for a "
                      f"{p.dtype.name} parameter; updates must be floating.")
  return treedef, paths, [u for _, u in flat], ps


def _floating_dtype(dtype: DTypeLike, name: str) -> np.dtype:
  """``dtype`` as a NumPy dtype, or a ValueError naming it if it is not floating."""
  if dtype is None:
    raise ValueError(f"{name}: dtype is None; give a floating dtype such as jnp.bfloat16.")
  try:
    parsed = np.dtype(jnp.dtype(dtype))
  except TypeError as e:
    raise ValueError(f"{name}: {dtype!r} is not a dtype.") from e
  if not jnp.issubdtype(parsed, jnp.floating):
    raise ValueError(f"{name}: dtype must be floating, got {parsed.name}")
  return parsed


def _saturating_cast(x: jax.Array, dtype) -> jax.Array:
  """``x.astype(dtype)``, with finite values beyond ``dtype``'s range clipped to it.

  A float16 second moment of a gradient of 1e4 is 1e8: rounded, it would be
  inf and freeze its parameter for good; saturated, it is 65504. NaN and inf
  are kept, so that `jmp_lite.optax.with_loss_scale` still sees them and skips.
  """
  if not (jnp.issubdtype(x.dtype, jnp.floating) and jnp.issubdtype(dtype, jnp.floating)):
    return x.astype(dtype)
  limit = float(jnp.finfo(dtype).max)
  if limit >= float(jnp.finfo(x.dtype).max):
    return x.astype(dtype)
  clipped = jnp.clip(x, -limit, limit)
  return jnp.where(jnp.isfinite(x), clipped, x).astype(dtype)


def _restore(x: jax.Array, dtype) -> jax.Array:
  """A state leaf back in its stored dtype (a PRNG key as it is)."""
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return x
  return _saturating_cast(x, dtype)


def with_state_dtype(inner: optax.GradientTransformation,
                     dtype: DTypeLike) -> optax.GradientTransformationExtraArgs:
  """Stores ``inner``'s floating state (moments, traces) in ``dtype``.

  Each update upcasts the state and the incoming updates to float32, runs
  ``inner`` there, and stores the new state back in ``dtype``: the state
  that comes out has exactly the dtypes of the state that went in. The
  compensation of a `kahan_summation` inside keeps the dtype that
  transformation chose (its parameter's, or the one it was given). Scalars
  in the state (hyperparameters of ``optax.inject_hyperparams``, step sizes)
  and integer counters keep their dtypes; only arrays of rank >= 1 are
  stored in ``dtype``. Finite values beyond ``dtype``'s range are stored as
  its largest value (saturated), so a large gradient cannot make a float16
  moment infinite; NaN and inf are kept, and `with_loss_scale` skips a step
  that would store them.

  Args:
    inner: any optax transformation.
    dtype: a floating dtype, e.g. ``jnp.bfloat16``.

  Raises:
    ValueError: if ``dtype`` is not a floating dtype.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import jmp_lite
    >>> tx = jmp_lite.optax.with_state_dtype(optax.adam(1e-3), jnp.bfloat16)
    >>> state = tx.init({"w": jnp.ones(3)})
    >>> sorted({x.dtype.name for x in jax.tree.leaves(state)})
    ['bfloat16', 'int32']
  """
  dtype = _floating_dtype(dtype, "with_state_dtype")
  inner = optax.with_extra_args_support(inner)

  def store(tree):
    # A `kahan_summation` inside keeps its compensation in the dtype it was
    # given: its precision is what that transformation is about.
    return jax.tree.map(
        lambda x: x if isinstance(x, KahanState) else
        _saturating_cast(x, dtype) if is_floating(x) and x.ndim >= 1 else x,
        tree, is_leaf=lambda x: isinstance(x, KahanState))

  def widen(tree):
    return jax.tree.map(
        lambda x: x.astype(wide_dtype(x.dtype))
        if is_floating(x) else x, tree)

  def init(params):
    return store(inner.init(params))

  def update(updates, state, params=None, **extra_args):
    kept = jax.tree.map(lambda x: x.dtype, state)
    wide = None if params is None else widen(params)
    # A rounding transform inside rounds onto the parameters as given, not
    # onto their widened copies (which it would pass through unrounded).
    with (contextlib.nullcontext() if params is None else stored_params(params, wide)):
      new_updates, new_state = inner.update(widen(updates), widen(state), wide,
                                            **extra_args)
    new_state = jax.tree.map(_restore, new_state, kept)
    return new_updates, new_state

  return optax.GradientTransformationExtraArgs(init, update)
