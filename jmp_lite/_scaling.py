"""The arithmetic every loss scale shares, and the checks of its arguments.

Multiplying a tree by float32 factors in a width that cannot overflow,
dividing by a scale through two normal factors, and refusing predicates and
axis names that are not what `jmp_lite.loss_scale`'s functions take. Private:
`loss_scale`, `optax`, `training` and `distributed` use them.
"""

from __future__ import annotations

from typing import Any, Sequence, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _exact
from jmp_lite._dtypes import is_inexact
from jmp_lite._dtypes import is_low_bit_float
from jmp_lite._dtypes import wide_dtype

T = TypeVar("T")
AxisName = Union[str, Sequence[str], None]


class FlagError(ValueError, AssertionError):
  """A predicate that is not a boolean scalar.

  A ValueError, and also an AssertionError because jmp raises one there.
  """


def check_flag(flag: Any, what: str) -> jax.Array:
  """Returns ``flag`` as a bool array, or raises if it is not a boolean scalar."""
  if isinstance(flag, (bool, np.bool_)):
    return jnp.asarray(flag)
  dtype = getattr(flag, "dtype", None)
  shape = getattr(flag, "shape", None)
  if shape != () or dtype != jnp.bool_:
    # Not the value's repr: a gradient tree passed by mistake prints every array.
    leaves = jax.tree.leaves(flag)
    what_it_is = (f"{type(flag).__name__} with shape={shape} dtype={dtype}"
                  if shape is not None else
                  f"{type(flag).__name__} of {len(leaves)} leaves")
    raise FlagError(
        f"{what}: expected boolean scalar, got {what_it_is}. Reduce it first, "
        "e.g. with jmp_lite.all_finite(grads).")
  return flag


def multiply(tree: T, *factors: jax.Array) -> T:
  """Multiplies floating and complex leaves by float32 ``factors``, in order.

  The product is formed and returned in float32 (float64 for float64,
  complex for complex leaves), as jmp's ``x * loss_scale`` with its float32
  scale promotes: a float16 loss of 4 scaled by 2**15 is 131072, which
  float16 would hold as inf, and an unscaled float16 gradient would lose
  what falls below float16's normals. fp8 leaves (quantisation metadata,
  not gradients of the loss) are left as they are.
  """
  def mul(x):
    if isinstance(x, (int, float)) and not isinstance(x, bool):
      for f in factors:
        x = x * f
      return x
    if not is_inexact(x) or is_low_bit_float(x.dtype):
      return x
    x = jnp.asarray(x)
    wide = wide_dtype(x.dtype)
    out = x.astype(wide)
    for f in factors:
      out = out * f.astype(wide)
    return out

  return jax.tree_util.tree_map(mul, tree)


def unscaled(tree: T, loss_scale: jax.Array) -> T:
  """``tree / loss_scale``, by two normal factors: ``1 / loss_scale`` is
  subnormal above ``2**126``, where XLA flushes it to 0 (and every gradient
  with it). The same as one multiplication by ``1 / loss_scale`` below."""
  m, e = _exact.reciprocal_factor(loss_scale.astype(jnp.float32))
  # Behind a barrier: where the scale is a constant of a jitted function (a
  # scale closed over), XLA's algebraic simplifier would fold ``(g * a) * b``
  # into ``g * (a * b)``, and ``a * b`` is the subnormal factor again.
  pair = jax.lax.optimization_barrier(_exact.normal_pair(m, e, jnp.float32))
  return multiply(tree, *pair)


def check_axis_name(axis_name: AxisName, what: str) -> AxisName:
  """Returns ``axis_name`` (None, a name, or a tuple of names), or raises showing it."""
  if axis_name is None:
    return None
  axes = (axis_name,) if isinstance(axis_name, str) else axis_name
  if (not isinstance(axes, (tuple, list)) or not axes
      or not all(isinstance(a, str) and a for a in axes)):
    raise TypeError(
        f"{what}: axis_name must be a mesh axis name or a tuple of them, got "
        f"{axis_name!r}.")
  return axes[0] if len(axes) == 1 else tuple(axes)
