"""Whether a skip decision is the same on every device of a ``shard_map``.

A replicated loss-scale state stays replicated only if every device decides
alike whether to skip a step. Inside ``shard_map`` each device computes its
own finiteness flag, so the decision must be reduced over every mesh axis
across which the gradients can differ. With ``check_vma=True`` (the default)
JAX tracks which axes a value varies over, and `check_decision` names the
axes a flag still varies over. With ``check_vma=False`` (and under ``pmap``)
nothing is tracked: a flag not reduced over every manual axis may differ, and
the replicas would then diverge without an error anywhere, so that is refused.
"""

from __future__ import annotations

from typing import Any

import jax


def aval_varying_axes(aval: Any) -> frozenset:
  """The manual mesh axes a value of type ``aval`` varies over."""
  mat = getattr(aval, "mat", None)  # jax >= 0.9
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))  # jax 0.6 to 0.8


def varying_axes(x: Any) -> frozenset:
  """The manual mesh axes ``x`` varies over (empty where JAX does not track them)."""
  return aval_varying_axes(jax.typeof(x))


def tracks_varying(axes: tuple[str, ...]) -> bool:
  """Whether JAX tracks per-device variation here (``shard_map(check_vma=True)``).

  ``axis_index`` varies over its axis by definition; under ``pmap`` and
  ``shard_map(check_vma=False)`` nothing is tracked and it reports no axes.
  """
  return all(a in varying_axes(jax.lax.axis_index(a)) for a in axes)


def manual_axes() -> tuple[str, ...]:
  """The mesh axes of the enclosing ``shard_map`` (or ``pmap``), or ()."""
  return tuple(jax.sharding.get_abstract_mesh().manual_axes)


def as_axes(axis_name: Any) -> tuple[str, ...]:
  if axis_name is None:
    return ()
  return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def uncovered(axis_name: Any) -> tuple[str, ...]:
  """The enclosing manual axes that ``axis_name`` leaves out."""
  covered = as_axes(axis_name)
  return tuple(a for a in manual_axes() if a not in covered)


def _fix(axis_name: Any, left: tuple[str, ...]) -> Any:
  """The ``axis_name`` that covers ``left`` too, as a user would write it."""
  fix = as_axes(axis_name) + left
  return fix[0] if len(fix) == 1 else fix


def check_decision(flag: jax.Array, axis_name: Any, what: str, *,
                   tracked: bool = True, untracked: bool = True) -> None:
  """Raises if ``flag`` (reduced over ``axis_name``) may differ between devices.

  Args:
    flag: the skip decision, after any reduction over ``axis_name``.
    axis_name: the axes it was reduced over (None for none).
    what: the API that takes ``axis_name``, for the message.
    tracked: whether to refuse a flag JAX types as varying (False for a flag
      only returned: where it is used, the type follows it).
    untracked: whether to refuse uncovered axes where JAX does not track
      variation (False for an API without ``axis_name`` of its own).

  Raises:
    ValueError: with ``check_vma=True``, if ``flag`` varies over a manual
      axis; with ``check_vma=False`` or under ``pmap``, if a manual axis is
      not among ``axis_name``.
  """
  left = uncovered(axis_name)
  if not left:
    return
  fix = _fix(axis_name, left)
  if tracks_varying(left):
    if not tracked:
      return
    varying = tuple(a for a in left if a in varying_axes(flag))
    if varying:
      raise ValueError(
          f"{what}: the decision to skip the step differs between the devices "
          f"of mesh axes {varying}: it was reduced over "
          f"{as_axes(axis_name) or 'no axis'} only, so a device whose gradients "
          "overflow would skip alone and the replicas of the loss scale and "
          "parameters would diverge. " + (
              f"Pass axis_name={fix!r}." if untracked else
              "Reduce it over them first, e.g. with jmp_lite.all_finite(grads, "
              f"axis_name={fix!r})."))
    return
  if not untracked:
    return
  raise ValueError(
      f"{what}: runs inside shard_map with check_vma=False (or pmap) over the "
      f"mesh axes {left}, which axis_name={axis_name!r} leaves out. JAX does "
      "not track there whether values differ between devices, so nothing "
      "would show that a device whose gradients overflow skips the step "
      "alone while the others apply it, and the replicas would diverge. "
      f"Pass axis_name={fix!r}: the decision is then reduced over every "
      "axis (one scalar all-reduce per step).")


def check_replicated_params(params: Any, axis_name: Any, what: str) -> None:
  """Raises if ``jax.grad`` inside ``shard_map`` would sum gradients of ``params``.

  A parameter replicated over a manual axis that ``axis_name`` leaves out gets
  its gradient summed across that axis by JAX itself, in the dtype it has
  where it meets per-device data (the compute dtype), and never averaged.
  With ``check_vma=False`` nothing is summed: the gradients stay per-device,
  are never averaged, and the replicas diverge.

  Raises:
    ValueError: naming the first such parameter, or the axes where JAX does
      not track variation.
  """
  left = uncovered(axis_name)
  if not left:
    return
  fix = _fix(axis_name, left)
  if not tracks_varying(left):
    raise ValueError(
        f"{what}: runs inside shard_map with check_vma=False (or pmap) over the "
        f"mesh axes {left}, which axis_name={axis_name!r} leaves out: the "
        "gradients would stay per-device, be applied unaveraged and the "
        f"replicas would diverge. Create the state with axis_name={fix!r}.")
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    if not hasattr(leaf, "dtype") or not jax.numpy.issubdtype(leaf.dtype, jax.numpy.inexact):
      continue
    replicated = tuple(a for a in left if a not in varying_axes(leaf))
    if replicated:
      raise ValueError(
          f"{what}: parameter {jax.tree_util.keystr(path) or '(root)'} is "
          f"replicated over the mesh axes {replicated} of the enclosing "
          f"shard_map, which axis_name={axis_name!r} leaves out: jax.grad "
          "would sum its gradient across them itself, in the compute dtype, "
          f"instead of averaging it. Create the state with axis_name={fix!r}.")
