"""fp8 quantisation with delayed scaling: per-tensor metadata as a typed pytree.

A tensor is quantised to an fp8 format as ``q = clip(x / scale, ±max)`` cast
to the format, and read back as ``q * scale`` (Flax's ``fp8_ops`` and
Transformer Engine use the same convention, with TE's ``scale`` being our
``1 / scale``). *Delayed* scaling chooses ``scale`` from a history of the
tensor's absolute maxima in earlier steps, so the quantisation does not wait
for this step's maximum: `DelayedScaling.qdq` computes the new scale from the
history, quantises with it, and records this step's maximum, in one pass.

fp8 training: a policy with ``fp8="hybrid"`` (``"p=f32,c=bf16,o=f32,fp8=hybrid"``)
puts the matmuls of the modules it governs under `jmp_lite.flax.wrap` in fp8
(``select=`` picks plain-JAX matmuls by name scope). `init` traces the step
and gives each such matmul a `MatmulMeta` in one `Fp8State`, which lives
beside the loss scale (`jmp_lite.TrainState.create` ``fp8=``) and is updated
by the step from the maxima measured in the same pass (`jmp_lite._fp8_sites`).
`restore` migrates checkpoints across history lengths and schema versions.
Checked bitwise against Flax's own ``flax.linen.fp8_ops`` (``tests/test_fp8.py``,
``tests/test_fp8_training.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _struct

__all__ = ("DelayedScaling", "FORMATS", "Fp8State", "MatmulMeta", "dequantize",
           "init", "qdq", "quantize", "restore")

# The formats of the "hybrid" recipe: e4m3 (more precision) for forward
# values, e5m2 (more range) for gradients.
FORMATS = {"e4m3": np.dtype(jnp.float8_e4m3fn), "e5m2": np.dtype(jnp.float8_e5m2)}
_ALGORITHMS = ("max", "most_recent")


def _format(dtype: Any) -> np.dtype:
  if isinstance(dtype, str) and dtype in FORMATS:
    return FORMATS[dtype]
  try:
    dt = np.dtype(dtype)
  except TypeError as e:
    kind = ValueError if isinstance(dtype, str) else TypeError
    raise kind(f"not an fp8 format: {dtype!r}; use one of {sorted(FORMATS)}") from e
  if dt not in FORMATS.values():
    raise ValueError(f"not an fp8 format: {dtype!r}; use one of {sorted(FORMATS)} "
                     f"({', '.join(d.name for d in FORMATS.values())})")
  return dt


def quantize(x: jax.Array, dtype: Any, scale: jax.Array,
             compute_dtype: Any = None) -> jax.Array:
  """``x / scale``, saturated to the format's range, in fp8 ``dtype``.

  Non-finite values stay non-finite, so that an overflow upstream still
  reaches the finiteness check.

  Args:
    x: the values.
    dtype: an fp8 format (``"e4m3"``, ``"e5m2"`` or the dtype).
    scale: the dequantisation scale (a scalar).
    compute_dtype: the dtype of the division and clipping (default ``x``'s).
  """
  dtype = _format(dtype)
  compute_dtype = x.dtype if compute_dtype is None else np.dtype(compute_dtype)
  top = jnp.asarray(jnp.finfo(dtype).max, compute_dtype)
  x = x.astype(compute_dtype)
  scaled = x / scale.astype(compute_dtype)
  # Finite values saturate; inf and NaN stay non-finite (inf, or NaN in
  # e4m3fn, which has no inf). Flax's fp8_ops clips them too, which turns an
  # overflowed (scaled) gradient into a finite one: the finiteness check
  # then passes, the step applies garbage and the loss scale never backs off.
  return jnp.where(jnp.isfinite(x), jnp.clip(scaled, -top, top), scaled).astype(dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
  """``q * scale`` in ``dtype``."""
  return q.astype(dtype) * scale.astype(dtype)


def qdq(x: jax.Array, dtype: Any, scale: jax.Array) -> jax.Array:
  """``x`` quantised to ``dtype`` and read back, in ``x``'s dtype.

  Flax's ``fp8_ops.qdq`` with the compute dtype being ``x``'s own.
  """
  return dequantize(quantize(x, dtype, scale), scale, x.dtype)


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
  """One tensor's fp8 metadata: its amax history and its scale.

  Args:
    amax_history: float32 ``[history_length]``, most recent first (then the
      older ones from the end backwards, as Flax and TE roll it).
    scale: float32 scalar, the dequantisation scale.
    dtype: the fp8 format (static).
    margin: the new scale leaves ``2 ** margin`` of headroom (static).
    algorithm: ``"max"`` (the history's maximum, the field's default) or
      ``"most_recent"`` (static).

  Example:
    >>> import jax.numpy as jnp
    >>> import jmp_lite.fp8 as fp8
    >>> meta = fp8.DelayedScaling.create("e4m3", history_length=4)
    >>> y, meta = meta.qdq(jnp.array([1.0, -896.0]))  # scale 1: saturates at 448
    >>> y.tolist(), meta.amax_history.tolist()
    ([1.0, -448.0], [896.0, 0.0, 0.0, 0.0])
    >>> y, meta = meta.qdq(jnp.array([1.0, -896.0]))  # scale from history: 896 / 448
    >>> y.tolist(), float(meta.scale)
    ([1.0, -896.0], 2.0)
  """

  amax_history: jax.Array
  scale: jax.Array
  dtype: np.dtype = _struct.static_field(default=FORMATS["e4m3"])
  margin: int = _struct.static_field(default=0)
  algorithm: str = _struct.static_field(default="max")

  @classmethod
  def create(cls, dtype: Any = "e4m3", *, history_length: int = 1024,
             margin: int = 0, algorithm: str = "max") -> "DelayedScaling":
    """Fresh metadata: an all-zero history and a scale of 1.

    Raises:
      ValueError: for an unknown format or algorithm, a history length < 1,
        or a negative margin.
    """
    if isinstance(history_length, bool) or not isinstance(history_length, int) \
        or history_length < 1:
      raise ValueError(f"history_length must be an int >= 1, got {history_length!r}")
    if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
      raise ValueError(f"margin must be an int >= 0, got {margin!r}")
    if algorithm not in _ALGORITHMS:
      raise ValueError(f"algorithm must be one of {_ALGORITHMS}, got {algorithm!r}")
    return cls(amax_history=jnp.zeros((history_length,), jnp.float32),
               scale=jnp.ones((), jnp.float32), dtype=_format(dtype),
               margin=margin, algorithm=algorithm)

  def next_scale(self) -> jax.Array:
    """The scale the history asks for; the current one where it has no answer.

    ``max / amax / 2**margin`` inverted, kept as it is while the chosen amax
    is zero (nothing seen yet) or not finite (Flax's ``compute_scale``, TE's
    ``update_fp8_metas``).
    """
    amax = (jnp.max(self.amax_history, axis=-1) if self.algorithm == "max"
            else self.amax_history[..., 0])
    top = jnp.float32(jnp.finfo(self.dtype).max)
    inverse = 1.0 / self.scale
    sf = (top / amax) / (2.0 ** self.margin)
    sf = jnp.where(amax > 0.0, sf, inverse)
    sf = jnp.where(jnp.isfinite(amax), sf, inverse)
    return 1.0 / sf

  def qdq(self, x: jax.Array, compute_dtype: Any = None) -> tuple[jax.Array, "DelayedScaling"]:
    """``x`` quantised with the delayed scale and read back, and the new state.

    The scale comes from the history of earlier steps; this step's amax
    joins the history for the next ones.
    """
    scale = self.next_scale()
    y = dequantize(quantize(x, self.dtype, scale, compute_dtype), scale, x.dtype)
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    return y, _struct.replace_fields(self, amax_history=_roll_in(self.amax_history, amax),
                                     scale=scale)

  def update(self, amax: jax.Array) -> "DelayedScaling":
    """``amax`` (this step's absolute maximum) recorded, and the next scale.

    The scale the next step quantises with is `next_scale` of the history
    that includes ``amax``: the scale `qdq` would use on the next step.
    A non-finite ``amax`` (an overflowing step's gradient) is recorded as 0,
    "nothing seen": under the ``"max"`` algorithm Flax and Transformer
    Engine keep an inf for ``history_length`` steps and freeze the scale that
    long.
    """
    amax = jnp.asarray(amax, jnp.float32)
    amax = jnp.where(jnp.isfinite(amax), amax, 0.0)
    new = _struct.replace_fields(self, amax_history=_roll_in(self.amax_history, amax))
    return _struct.replace_fields(new, scale=new.next_scale())


def _roll_in(history: jax.Array, amax: jax.Array) -> jax.Array:
  """Flax's ``compute_amax_history`` along the last axis (leading axes: layers)."""
  return jnp.roll(history, -1, axis=-1).at[..., 0].set(amax)


_struct.register_state(DelayedScaling)


# The state of a step's fp8 matmuls -------------------------------------------------

SCHEMA_VERSION = 1
@dataclasses.dataclass(frozen=True)
class MatmulMeta:
  """One fp8 matmul's metadata: its operands' and its output gradient's.

  In a scanned stack each field has a leading axis per scan (a row per
  layer).

  Args:
    lhs, rhs: the operands' `DelayedScaling`.
    grad: the output cotangent's `DelayedScaling`.
    observed: float32 ``[..., 3]``: the largest lhs, rhs and gradient
      absolute maxima seen since the last `commit` (micro-batches and
      devices are reduced into it by maximum).
  """

  lhs: DelayedScaling
  rhs: DelayedScaling
  grad: DelayedScaling
  observed: jax.Array

  @classmethod
  def create(cls, shape: tuple[int, ...] = (), recipe: tuple[Any, Any] = ("e4m3", "e5m2"),
             *, history_length: int = 1024, margin: int = 0,
             algorithm: str = "max") -> "MatmulMeta":
    """Fresh metadata for a site with leading ``shape`` (one row per layer).

    ``recipe``: the operands' and the gradient's fp8 formats.
    """
    def one(dtype):
      d = DelayedScaling.create(dtype, history_length=history_length, margin=margin,
                                algorithm=algorithm)
      return _struct.replace_fields(
          d, amax_history=jnp.zeros((*shape, history_length), jnp.float32),
          scale=jnp.ones(shape, jnp.float32))

    forward, backward = recipe
    return cls(lhs=one(forward), rhs=one(forward), grad=one(backward),
               observed=jnp.zeros((*shape, 3), jnp.float32))

  def scales(self) -> jax.Array:
    """float32 ``[..., 3]``: the lhs, rhs and gradient scales to quantise with."""
    return jnp.stack([self.lhs.scale, self.rhs.scale, self.grad.scale], axis=-1)

  def observe(self, amax: jax.Array) -> "MatmulMeta":
    """``amax`` (``[..., 3]``) max-reduced into `observed`; non-finite ones as 0."""
    amax = jnp.where(jnp.isfinite(amax), amax, 0.0).astype(jnp.float32)
    return _struct.replace_fields(self, observed=jnp.maximum(self.observed, amax))

  def commit(self) -> "MatmulMeta":
    """`observed` recorded in each history (`DelayedScaling.update`), then reset."""
    o = self.observed
    return MatmulMeta(lhs=self.lhs.update(o[..., 0]), rhs=self.rhs.update(o[..., 1]),
                      grad=self.grad.update(o[..., 2]), observed=jnp.zeros_like(o))

  def rescale_gradient(self, factor: jax.Array) -> "MatmulMeta":
    """The gradient's history and scale times ``factor``.

    Cotangents carry the loss scale: when it changes by ``factor`` the next
    step's gradient amax does too, and a history of the old ones would give
    a scale ``factor`` off for up to ``history_length`` steps (too coarse
    after a backoff, saturating after a growth).
    """
    factor = jnp.asarray(factor, jnp.float32)
    grad = _struct.replace_fields(self.grad, amax_history=self.grad.amax_history * factor,
                                  scale=self.grad.scale * factor)
    return _struct.replace_fields(self, grad=grad)


@dataclasses.dataclass(frozen=True)
class Fp8State:
  """The fp8 metadata of every fp8 matmul of a step, keyed by site name.

  Made by `init`, kept beside the loss scale (`jmp_lite.optax.with_loss_scale`
  ``fp8=``, `jmp_lite.TrainState.create` ``fp8=``), and read by the step
  (`jmp_lite.TrainState.minimize`, `jmp_lite.value_and_grad`). It is
  metadata, not a parameter: never unscaled, never given to the optimizer,
  not part of the finiteness check, and reduced by maximum.

  Args:
    sites: site name -> `MatmulMeta`, in the order the forward pass meets them.
    version: int32 scalar, the schema version. A leaf, so that checkpoints
      record it for `restore`.
    select, recipe: which matmuls are fp8 and, with ``select``, their
      formats (static; see `init`).
  """

  sites: dict
  version: jax.Array = dataclasses.field(
      default_factory=lambda: jnp.asarray(SCHEMA_VERSION, jnp.int32))
  select: Optional[str] = _struct.static_field(default=None)
  recipe: str = _struct.static_field(default="hybrid")

  @property
  def history_length(self) -> int:
    return next(iter(self.sites.values())).lhs.amax_history.shape[-1] if self.sites else 0

  def scales(self) -> dict:
    return {k: m.scales() for k, m in self.sites.items()}

  def observe(self, amax: dict) -> "Fp8State":
    """Each site's ``[..., 3]`` maxima (from one micro-batch) max-reduced in."""
    _same_sites(self.sites, amax)
    return _struct.replace_fields(
        self, sites={k: m.observe(amax[k]) for k, m in self.sites.items()})

  def commit(self) -> "Fp8State":
    return _struct.replace_fields(
        self, sites={k: m.commit() for k, m in self.sites.items()})

  def rescale_gradients(self, factor: jax.Array) -> "Fp8State":
    return _struct.replace_fields(
        self, sites={k: m.rescale_gradient(factor) for k, m in self.sites.items()})


def _same_sites(sites: dict, other: dict) -> None:
  if set(sites) != set(other):
    missing = sorted(set(sites) - set(other))
    extra = sorted(set(other) - set(sites))
    raise ValueError(
        "The step's fp8 matmuls are not those of its fp8 state: "
        f"{'missing ' + str(missing) if missing else ''}"
        f"{'; ' if missing and extra else ''}{'new ' + str(extra) if extra else ''}. "
        "Make the state with jmp_lite.fp8.init on the same loss function.")


_struct.register_state(MatmulMeta)
_struct.register_state(Fp8State)


def init(fun: Any, *args: Any, argnums: Any = 0, has_aux: bool = False,
         policy: Any = None, select: Optional[str] = None, recipe: str = "hybrid",
         history_length: int = 1024, margin: int = 0, algorithm: str = "max",
         **kwargs: Any) -> Fp8State:
  """The fp8 state of the step that differentiates ``fun(*args, **kwargs)``.

  Traces ``fun`` once (abstractly, nothing runs) as `jmp_lite.TrainState.minimize`
  and `jmp_lite.value_and_grad` will, finds its fp8 matmuls and gives each
  fresh metadata: all-zero histories and scales of 1, a row per layer for a
  matmul inside ``scan``.

  Args:
    fun: the loss function, as the step will be given it.
    *args: example arguments (arrays or ``jax.ShapeDtypeStruct``s are fine).
    argnums, has_aux, policy: as the step will be given them.
    select: which matmuls: None for those of the modules a policy with
      ``fp8`` governs under `jmp_lite.flax.wrap`; or a regular expression
      matched with `re.fullmatch` against each matmul's name-scope path
      (``jax.named_scope``, Flax module names), ``".*"`` for all.
    recipe: with ``select``: ``"hybrid"`` (e4m3 operands, e5m2 gradients) or
      ``"e4m3"``. Under wrap each module's policy says.
    history_length, margin, algorithm: as for `DelayedScaling.create`.
    **kwargs: keyword arguments of ``fun``.

  Raises:
    ValueError: if no matmul is selected, or for a bad option.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import jmp_lite
    >>> def loss_fn(w, x):
    ...   with jax.named_scope("mlp"):
    ...     return jnp.mean(jnp.tanh(x @ w["a"]) @ w["b"])
    >>> w = {"a": jnp.ones((4, 8)), "b": jnp.ones((8, 2))}
    >>> state = jmp_lite.fp8.init(loss_fn, w, jnp.ones((3, 4)), select="mlp",
    ...                           history_length=16)
    >>> list(state.sites), state.history_length
    (['mlp', 'mlp#2'], 16)
  """
  from jmp_lite import _instrument  # pylint: disable=import-outside-toplevel
  from jmp_lite import _scaled_grad  # pylint: disable=import-outside-toplevel
  from jmp_lite.policy import FP8_RECIPES  # pylint: disable=import-outside-toplevel
  if recipe not in FP8_RECIPES:
    raise ValueError(f"recipe must be one of {sorted(FP8_RECIPES)}, got {recipe!r}")
  if select is not None and not isinstance(select, str):
    raise TypeError(f"select must be None or a regular expression string, got {select!r}")
  DelayedScaling.create(history_length=history_length, margin=margin,
                        algorithm=algorithm)  # checks the options
  found = _scaled_grad.fp8_sites(
      fun, args, kwargs, argnums=argnums, has_aux=has_aux, policy=policy,
      selection=_instrument.Fp8Selection(select, recipe))
  if not found:
    raise ValueError(
        "jmp_lite.fp8.init: no fp8 matmul in this step: " + (
            "no module's policy has fp8 (wrap the model with a rule such as "
            "{nn.Dense: 'p=f32,c=bf16,o=f32,fp8=hybrid'}, or pass select=)"
            if select is None else f"no matmul's name-scope path matches {select!r}"))
  return Fp8State(
      sites={name: MatmulMeta.create(shape, formats, history_length=history_length,
                                     margin=margin, algorithm=algorithm)
             for name, shape, formats in found},
      select=select, recipe=recipe)


def restore(raw: Any, target: Any) -> Any:
  """``target`` filled from a checkpoint restored without a target.

  For a checkpoint whose fp8 metadata no longer fits the state it is restored
  into: a new history length (the newest entries are kept, in order, and a
  longer history is padded with zeros, "nothing seen") or an older schema
  version. ``raw`` is what ``orbax.checkpoint`` returns when restoring with no
  target (nested dicts and lists of arrays); ``target`` is the state to
  restore into, concrete or abstract (``jax.eval_shape``), holding
  `Fp8State` anywhere (a `jmp_lite.TrainState`, its ``opt_state``...).
  Every other leaf is taken as saved, checked against ``target``'s shape and
  converted to its dtype.

  Raises:
    ValueError: a leaf missing or of another shape, a checkpoint of a newer
      schema, or fp8 sites that differ (names or layers), naming the path.

  Example:
    >>> import jax.numpy as jnp
    >>> import jmp_lite.fp8 as fp8
    >>> old = fp8.Fp8State({"mlp": fp8.MatmulMeta.create(history_length=4)})
    >>> old = old.observe({"mlp": jnp.array([1.0, 2.0, 3.0])}).commit()
    >>> raw = {"sites": {"mlp": {"lhs": {"amax_history": old.sites["mlp"].lhs.amax_history,
    ...                                  "scale": old.sites["mlp"].lhs.scale},
    ...        "rhs": {"amax_history": old.sites["mlp"].rhs.amax_history,
    ...                "scale": old.sites["mlp"].rhs.scale},
    ...        "grad": {"amax_history": old.sites["mlp"].grad.amax_history,
    ...                 "scale": old.sites["mlp"].grad.scale},
    ...        "observed": old.sites["mlp"].observed}}, "version": old.version}
    >>> new = fp8.Fp8State({"mlp": fp8.MatmulMeta.create(history_length=2)})
    >>> fp8.restore(raw, new).sites["mlp"].grad.amax_history.tolist()
    [3.0, 0.0]
  """
  from jmp_lite import _fp8_checkpoint  # pylint: disable=import-outside-toplevel
  return _fp8_checkpoint.restore(raw, target)
