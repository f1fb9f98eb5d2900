"""The state of a step's fp8 matmuls: `MatmulMeta` per matmul, in one `Fp8State`.

Typed pytrees (`jmp_lite._struct`), documented and re-exported by
`jmp_lite.fp8`. They live here, below the passes that read and write them
(`jmp_lite._jaxpr.passes.instrument`, `jmp_lite._fp8_checkpoint`, `jmp_lite.optax`), so
that none of those imports the public module that imports them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jmp_lite._fp8_numerics import _update_all
from jmp_lite._fp8_numerics import DelayedScaling
from jmp_lite import _struct


# The layout of `Fp8State` in a checkpoint; `jmp_lite.fp8.restore` migrates
# older ones.
SCHEMA_VERSION = 2  # 2: `Fp8State.grad_loss_scale`


@dataclasses.dataclass(frozen=True)
class MatmulMeta:
  """One fp8 matmul's metadata: its operands' and its output gradient's.

  In a scanned stack of layers each field has a leading axis per scan (a
  row per layer); a matmul in a loop over time (its weights closed over, as
  in ``nn.RNN``) has one state for all the loop's iterations (their largest
  maxima), whatever the trip count.

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
    grad_loss_scale: float32 scalar, the loss scale the gradient histories
      and scales were measured under (cotangents carry it); 0 until a step
      has run. A step under another loss scale first multiplies them by the
      ratio (`follow_loss_scale`), so a state stays right whoever changes
      the loss scale: `jmp_lite.TrainState`, or the user between calls of
      `jmp_lite.value_and_grad`.
    select, recipe: which matmuls are fp8 and, with ``select``, their
      formats (static; see `init`).
    scaling: ``"delayed"``, ``"current"`` or ``"block"`` (static; see `init`).
  """

  sites: dict
  version: jax.Array = dataclasses.field(
      default_factory=lambda: jnp.asarray(SCHEMA_VERSION, jnp.int32))
  grad_loss_scale: jax.Array = dataclasses.field(
      default_factory=lambda: jnp.zeros((), jnp.float32))
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
    same_sites(self.sites, amax)
    return _struct.replace_fields(
        self, sites={k: m.observe(amax[k]) for k, m in self.sites.items()})

  def commit(self) -> "Fp8State":
    """Every site's `MatmulMeta.commit`, with one scale computation for all."""
    names = list(self.sites)
    return _struct.replace_fields(
        self, sites=dict(zip(names, _commit_all([self.sites[k] for k in names]))))

  def rescale_gradients(self, factor: jax.Array) -> "Fp8State":
    """Every gradient history and scale (and `grad_loss_scale`) times ``factor``."""
    factor = jnp.asarray(factor, jnp.float32)
    return _struct.replace_fields(
        self, sites={k: m.rescale_gradient(factor) for k, m in self.sites.items()},
        grad_loss_scale=self.grad_loss_scale * factor)

  def follow_loss_scale(self, loss_scale: jax.Array) -> "Fp8State":
    """The state in units of ``loss_scale``: gradient histories and scales
    times ``loss_scale / grad_loss_scale`` (a state no step has measured
    yet takes ``loss_scale`` as it is).

    Cotangents carry the loss scale: when it changes by a factor, the next
    step's gradient maxima do too, and a history of the old ones would give
    a scale that factor off for up to ``history_length`` steps (saturating
    e5m2 after a growth, too coarse after a backoff).
    """
    loss_scale = jnp.asarray(loss_scale, jnp.float32)
    factor = jnp.where(self.grad_loss_scale > 0,
                       loss_scale / jnp.where(self.grad_loss_scale > 0,
                                              self.grad_loss_scale, 1.0), 1.0)
    return _struct.replace_fields(self.rescale_gradients(factor),
                                  grad_loss_scale=loss_scale)


def _commit_all(metas: list) -> list:
  """`MatmulMeta.commit` of each, the scales of every tensor computed together."""
  tensors = [t for m in metas for t in (m.lhs, m.rhs, m.grad)]
  amaxes = [m.observed[..., i] for m in metas for i in range(3)]
  new = _update_all(tensors, amaxes)
  return [MatmulMeta(lhs=new[3 * i], rhs=new[3 * i + 1], grad=new[3 * i + 2],
                     observed=jnp.zeros_like(m.observed)) for i, m in enumerate(metas)]


def same_sites(sites: dict, other: dict) -> None:
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
