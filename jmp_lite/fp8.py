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
from jmp_lite._fp8_numerics import FORMATS
from jmp_lite._fp8_numerics import _format
from jmp_lite._fp8_numerics import _check_compute_dtype
from jmp_lite._fp8_numerics import _next_scales
from jmp_lite._fp8_numerics import dequantize
from jmp_lite._fp8_numerics import qdq
from jmp_lite._fp8_numerics import quantize
from jmp_lite._fp8_numerics import quantize_by
from jmp_lite._fp8_numerics import reciprocal

__all__ = ("DelayedScaling", "FORMATS", "Fp8State", "MatmulMeta", "dequantize",
           "forward", "init", "qdq", "quantize", "quantize_by", "reciprocal", "restore")

_ALGORITHMS = ("max", "most_recent")
_SCALINGS = ("delayed", "current")

for _f in (dequantize, qdq, quantize, quantize_by, reciprocal):
  _f.__module__ = __name__  # documented here, defined in jmp_lite._fp8_numerics


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

    ``1 / ((max / amax) / 2**margin)``, kept as it is while the chosen amax
    is zero (nothing seen yet) or not finite (Flax's ``compute_scale``, TE's
    ``update_fp8_metas``). Both divisions are correctly rounded on every
    backend (TE divides with ``__fdiv_rn`` for the same reason), and the
    factor is clamped to ``[2**-126, 2**126]``: an amax of 1e-36 gives a
    factor float32 cannot hold, where Flax's scale becomes 0 and every
    quantised value NaN.
    """
    return _next_scales([self])[0]

  def qdq(self, x: jax.Array, compute_dtype: Any = None) -> tuple[jax.Array, "DelayedScaling"]:
    """``x`` quantised with the delayed scale and read back, and the new state.

    The scale comes from the history of earlier steps; this step's amax
    joins the history for the next ones. ``compute_dtype`` is accepted for
    Flax's signature: quantisation is float32 arithmetic (`quantize`).
    """
    scale = self.next_scale()
    _check_compute_dtype(compute_dtype)
    y = qdq(x, self.dtype, scale)
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
    return _update_all([self], [amax])[0]


def _update_all(metas: list, amaxes: list) -> list:
  """`DelayedScaling.update` of each meta with its amax, the scales together."""
  rolled = []
  for meta, amax in zip(metas, amaxes):
    amax = jnp.asarray(amax, jnp.float32)
    amax = jnp.where(jnp.isfinite(amax), amax, 0.0)
    rolled.append(_struct.replace_fields(
        meta, amax_history=_roll_in(meta.amax_history, amax)))
  return [_struct.replace_fields(m, scale=s) for m, s in zip(rolled, _next_scales(rolled))]


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
    return _commit_all([self])[0]

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
    scaling: ``"delayed"`` or ``"current"`` (static; see `init`).
  """

  sites: dict
  version: jax.Array = dataclasses.field(
      default_factory=lambda: jnp.asarray(SCHEMA_VERSION, jnp.int32))
  select: Optional[str] = _struct.static_field(default=None)
  recipe: str = _struct.static_field(default="hybrid")
  scaling: str = _struct.static_field(default="delayed")

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
    """Every site's `MatmulMeta.commit`, with one scale computation for all."""
    names = list(self.sites)
    return _struct.replace_fields(
        self, sites=dict(zip(names, _commit_all([self.sites[k] for k in names]))))

  def rescale_gradients(self, factor: jax.Array) -> "Fp8State":
    return _struct.replace_fields(
        self, sites={k: m.rescale_gradient(factor) for k, m in self.sites.items()})


def _commit_all(metas: list) -> list:
  """`MatmulMeta.commit` of each, the scales of every tensor computed together."""
  tensors = [t for m in metas for t in (m.lhs, m.rhs, m.grad)]
  amaxes = [m.observed[..., i] for m in metas for i in range(3)]
  new = _update_all(tensors, amaxes)
  return [MatmulMeta(lhs=new[3 * i], rhs=new[3 * i + 1], grad=new[3 * i + 2],
                     observed=jnp.zeros_like(m.observed)) for i, m in enumerate(metas)]


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
         scaling: str = "delayed", **kwargs: Any) -> Fp8State:
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
    scaling: ``"delayed"`` (the default: each tensor quantised with the
      scale its history asks for) or ``"current"`` (Transformer Engine's
      ``Float8CurrentScaling``: with the scale of this step's own maximum,
      ``max / amax``; no history is read, a division more per tensor per
      step). The state records the maxima either way.
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
  if scaling not in _SCALINGS:
    raise ValueError(f"scaling must be one of {_SCALINGS}, got {scaling!r}")
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
      select=select, recipe=recipe, scaling=scaling)


def forward(fun: Any, state: Fp8State) -> Any:
  """``fun`` with its fp8 matmuls run with ``state``'s scales: inference.

  The matmuls are chosen as the training step chose them, and each computes
  what the training step's forward computes, so for the same inputs and
  state the output is the training forward's, bitwise. The scales are read,
  never updated. Under `jmp_lite.flax.wrap`, ``wrapped.apply(variables, x,
  fp8=state)`` (Linen) and ``wrapped(x, fp8=state)`` (NNX) do this.

  Args:
    fun: the function, e.g. a model's forward pass.
    state: the `Fp8State` of training (`jmp_lite.TrainState`'s
      ``loss_scale_state.fp8``, or restored from a checkpoint).

  Returns:
    A function with ``fun``'s signature.

  Raises:
    TypeError: if ``state`` is not an `Fp8State`.
    ValueError: if ``fun``'s fp8 matmuls are not the state's (names, formats
      or layers).

  Example:
    >>> import jax.numpy as jnp
    >>> import jmp_lite.fp8 as fp8
    >>> def mlp(w, x):
    ...   with jax.named_scope("mlp"):
    ...     return jnp.tanh(x @ w)
    >>> w, x = jnp.ones((4, 8)), jnp.full((3, 4), 0.1)
    >>> state = fp8.init(lambda w, x: mlp(w, x).sum(), w, x, select="mlp")
    >>> fp8.forward(mlp, state)(w, x).shape
    (3, 8)
  """
  from jmp_lite import _instrument  # pylint: disable=import-outside-toplevel

  def run(*args, **kwargs):
    return _instrument.forward(fun, state, *args, **kwargs)

  return run


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
