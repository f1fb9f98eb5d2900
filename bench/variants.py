"""The ways of running a model that the ``steps`` and ``memory`` sections compare.

A `Variant` turns a `models.Workload` into ``loss(params, x, y) -> f32
scalar``, where ``params`` is the workload's float32 parameter tree. Every
variant computes the same function (same parameters, same data), only the
precision and the way of getting it differ.

Registration point: append to `VARIANTS` with `register` (or edit the
`jmp_lite_wrap` slot below). ``compare_to`` names a variant this one should be
within 2% of (jmp_lite's overhead against the same step written by hand); the
``steps`` section turns it into a target line. ``platforms`` limits a variant
to the plans of some platforms (the TF32 baseline exists on GPUs only);
`active` gives the variants of a run's plan.
"""

from __future__ import annotations

import dataclasses
import contextlib
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from bench import models

LossFn = Callable  # (params, x, y) -> float32 scalar


@dataclasses.dataclass(frozen=True)
class Variant:
  """One way of running a workload.

  Attributes:
    name: key in tables and JSON.
    label: what the table shows.
    make_loss: workload -> loss function, or None when this variant cannot run
      (the table then shows ``unavailable`` and the reason).
    unavailable: why ``make_loss`` may return None.
    compare_to: name of the variant whose step time this one should match
      within 2% (None: no overhead target).
    value_and_grad: how the step differentiates the loss (``jax.value_and_grad``
      unless the variant transforms the whole differentiated function).
    precision: a ``jax.default_matmul_precision`` under which the variant's
      step is traced and compiled ("highest": float32 matmuls really in
      float32; "tensorfloat32": TF32 allowed), or None.
    platforms: the plans' platforms in which the variant runs (None: all).
    in_memory: whether the ``memory`` section lists it (a variant that only
      changes the matmul precision keeps the same residuals).
  """

  name: str
  label: str
  make_loss: Callable[[models.Workload], Optional[LossFn]]
  unavailable: str = ""
  compare_to: Optional[str] = None
  value_and_grad: Callable = jax.value_and_grad
  precision: Optional[str] = None
  platforms: Optional[tuple[str, ...]] = None
  in_memory: bool = True

  def precision_scope(self):
    """The context to trace and compile this variant's step in."""
    if self.precision is None:
      return contextlib.nullcontext()
    return jax.default_matmul_precision(self.precision)


def _f32(w: models.Workload) -> LossFn:
  def loss(params, x, y):
    return models.cross_entropy(w.apply(params, x), y)
  return loss


def _flax_bf16(w: models.Workload) -> LossFn:
  """Every layer's ``dtype=jnp.bfloat16``, parameters float32: Flax's own way."""
  def loss(params, x, y):
    return models.cross_entropy(w.apply(params, x, dtype=jnp.bfloat16), y)
  return loss


def _jmp_policy(w: models.Workload) -> LossFn:
  """jmp 0.0.4 as its README shows: cast params and inputs, run, cast output."""
  import jmp  # the library jmp_lite replaces, from the package registry

  policy = jmp.get_policy("p=f32,c=bf16,o=f32")

  def loss(params, x, y):
    params, x = policy.cast_to_compute((params, x))
    logits = policy.cast_to_output(w.apply(params, x))
    return models.cross_entropy(logits, y)
  return loss


def _hand(ops_name: str) -> Callable[[models.Workload], LossFn]:
  ops = models.HAND_OPS[ops_name]

  def make(w: models.Workload) -> LossFn:
    def loss(params, x, y):
      return models.cross_entropy(w.hand_apply(params, x, ops), y)
    return loss
  return make


def _jmp_lite_wrap(w: models.Workload) -> LossFn:
  """jmp_lite's bf16 policy through ``jmp_lite.flax.wrap`` on the unmodified model."""
  import jmp_lite
  import jmp_lite.flax

  module = jmp_lite.flax.wrap(w.module(None), jmp_lite.get_policy("p=f32,c=bf16,o=f32"))

  def loss(params, x, y):
    return models.cross_entropy(module.apply({"params": params}, x), y)
  return loss


def _jmp_lite_autocast(w: models.Workload) -> LossFn:
  """``jmp_lite.autocast`` (op lists over the jaxpr) on the unmodified f32 model.

  The whole differentiated step is autocast (see ``_autocast_value_and_grad``),
  so that the backward matmuls are rewritten too.
  """
  return _f32(w)


def _autocast_value_and_grad(loss_fn):
  import jmp_lite
  return jmp_lite.autocast(jax.value_and_grad(loss_fn), jnp.bfloat16)


VARIANTS: list[Variant] = [
    # The baseline: float32 matmuls at "highest" precision, which on a GPU
    # means no TF32 (on a CPU every float32 matmul is float32 anyway).
    Variant("f32", "f32", _f32, precision="highest"),
    # What a GPU user gets from float32 with TF32 allowed (Ampere and newer
    # tensor cores): the other baseline mixed precision has to beat there.
    Variant("f32_tf32", "f32, TF32 allowed", _f32, precision="tensorfloat32",
            platforms=("gpu",), in_memory=False),
    Variant("flax_bf16", "Flax dtype=bf16 (naive)", _flax_bf16),
    Variant("jmp", "jmp 0.0.4 Policy p=f32,c=bf16,o=f32", _jmp_policy),
    Variant("hand_bf16", "hand-written bf16, f32 acc (autodiff bwd)",
            _hand("autodiff")),
    Variant("hand_bf16_vjp", "hand-written bf16, f32 acc (custom_vjp bwd)",
            _hand("custom_vjp")),
    Variant("jmp_lite_wrap", "jmp_lite wrap p=f32,c=bf16,o=f32", _jmp_lite_wrap,
            compare_to="hand_bf16_vjp"),
    Variant("jmp_lite_autocast", "jmp_lite autocast(value_and_grad) bf16",
            _jmp_lite_autocast, value_and_grad=_autocast_value_and_grad),
]


def register(variant: Variant, *, replace: bool = False) -> None:
  """Adds a variant (or replaces the one of the same name with ``replace``)."""
  names = [v.name for v in VARIANTS]
  if variant.name in names:
    if not replace:
      raise ValueError(f"Variant {variant.name!r} is already registered.")
    VARIANTS[names.index(variant.name)] = variant
  else:
    VARIANTS.append(variant)


def active(ctx) -> list[Variant]:
  """The variants of the run's plan (``ctx.platform``), in registry order."""
  return [v for v in VARIANTS if v.platforms is None or ctx.platform in v.platforms]


def get(name: str) -> Variant:
  for v in VARIANTS:
    if v.name == name:
      return v
  raise KeyError(f"No variant {name!r}; registered: {[v.name for v in VARIANTS]}")
