"""Dtype policies: which dtype parameters are stored in, computed in and returned in.

A `Policy` is a frozen, hashable value (usable as a static ``jit`` argument)
with four dtypes:

* ``param_dtype``: how parameters are stored (the "master copy").
* ``compute_dtype``: what parameters and inputs are cast to for the forward pass.
* ``output_dtype``: what results are cast to on the way out.
* ``reduce_dtype``: what gradients are averaged across devices in (float32 by
  default, whatever the compute dtype, so that an all-reduce never sums in
  half precision).

and an optional ``autocast_dtype``: when set, the policy asks for op-level
autocasting (PyTorch/Paddle/MindSpore "O1": matrix multiplies in that dtype,
everything else as written) instead of casting whole parameter trees.

Casting touches floating leaves only (NumPy and JAX arrays, tracers included);
integers, bools, PRNG keys, Python scalars, NumPy scalars and any non-array
leaf pass through unchanged, as in jmp. 8-bit and smaller floating formats
(float8/float4, used for quantised weights and their scales) are also left
alone unless the target dtype is itself such a format.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Optional, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._dtype_names import dtype_name
from jmp_lite._dtype_names import dtype_to_names
from jmp_lite._dtype_names import half_dtype
from jmp_lite._dtype_names import name_to_dtype
from jmp_lite._dtype_names import parse_dtype
from jmp_lite._dtype_names import preferred_half_dtype
from jmp_lite._dtypes import is_low_bit_float
from jmp_lite._fp8_numerics import RECIPES as FP8_RECIPES

__all__ = (
    "Policy",
    "get_policy",
    "parse_dtype",
    "dtype_name",
    "dtype_to_names",
    "name_to_dtype",
    "half_dtype",
    "preferred_half_dtype",
    "cast_to_full",
    "cast_to_half",
    "PRESETS",
)

# Defined beside the other spellings of dtypes; documented and shown as here.
for _public in (dtype_name, half_dtype, parse_dtype, preferred_half_dtype):
  _public.__module__ = __name__

T = TypeVar("T")

DTypeLike = Any


def _canonical(dtype: DTypeLike, what: str) -> np.dtype:
  """Returns ``dtype`` as a floating `np.dtype`, or raises naming ``what``."""
  # `jnp.dtype(None)` is the default float and numpy parses some strings (",")
  # as record formats, raising SyntaxError.
  try:
    if dtype is None:
      raise TypeError("None is not a dtype")
    dt = np.dtype(jnp.dtype(dtype))
  except (TypeError, ValueError, SyntaxError) as e:
    raise ValueError(f"{what}: {dtype!r} is not a dtype.") from e
  if not jnp.issubdtype(dt, jnp.floating):
    raise ValueError(
        f"{what} must be a floating dtype, got {dtype!r} ({dt.name}). A policy"
        " casts floating-point values only; integer and bool leaves are never"
        " cast.")
  # JAX arrays are native-endian; '>f4' must equal (and print as) float32.
  return dt.newbyteorder("=")


def _cast_floating_to(tree: T, dtype: DTypeLike) -> T:
  dtype = np.dtype(dtype)
  target_low_bit = is_low_bit_float(dtype)

  def cast(x):
    if not isinstance(x, (np.ndarray, jax.Array)):
      return x
    if not jnp.issubdtype(x.dtype, jnp.floating):
      return x
    # A weakly typed array (from a Python scalar) is made strong too: passed
    # back into a jitted step, it would otherwise compile it a second time.
    if x.dtype == dtype and not getattr(x, "weak_type", False):
      return x
    if is_low_bit_float(x.dtype) and not target_low_bit:
      return x
    return x.astype(dtype)

  return jax.tree_util.tree_map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
  """Encapsulates casting for inputs, outputs and parameters.

  Args:
    param_dtype: dtype parameters are stored in.
    compute_dtype: dtype the forward pass runs in.
    output_dtype: dtype results are returned in.
    reduce_dtype: dtype gradients are averaged across devices in.
    autocast_dtype: if set, op-level autocasting to this dtype is requested
      (the "O1" level) and ``compute_dtype`` is what the other ops run in.
    fp8: if set, the matrix multiplies of the modules this policy governs
      under `jmp_lite.flax.wrap` run with fp8 operands and gradients
      (`jmp_lite.fp8`): ``"hybrid"`` (e4m3 operands, e5m2 gradients, the
      field's default) or ``"e4m3"`` (both e4m3).

  Raises:
    ValueError: if any dtype is not a floating dtype.

  Example:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import jmp_lite
    >>> policy = jmp_lite.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
    >>> params = {"w": jnp.ones((2, 2)), "step": jnp.zeros((), jnp.int32)}
    >>> jax.tree.map(lambda x: x.dtype.name, policy.cast_to_compute(params))
    {'step': 'int32', 'w': 'bfloat16'}
    >>> str(policy)
    'p=f32,c=bf16,o=f32'
  """

  param_dtype: np.dtype
  compute_dtype: np.dtype
  output_dtype: np.dtype
  reduce_dtype: np.dtype = np.dtype(np.float32)
  autocast_dtype: Optional[np.dtype] = None
  fp8: Optional[str] = None

  def __post_init__(self):
    for field in ("param_dtype", "compute_dtype", "output_dtype", "reduce_dtype"):
      object.__setattr__(
          self, field, _canonical(getattr(self, field), f"Policy.{field}"))
    if self.autocast_dtype is not None:
      object.__setattr__(
          self, "autocast_dtype",
          _canonical(self.autocast_dtype, "Policy.autocast_dtype"))
    if self.fp8 is not None and self.fp8 not in FP8_RECIPES:
      raise ValueError(
          f"Policy.fp8 must be None or one of {sorted(FP8_RECIPES)}, got {self.fp8!r}.")

  def cast_to_param(self, x: T) -> T:
    """Converts floating point values to the param dtype."""
    return _cast_floating_to(x, self.param_dtype)

  def cast_to_compute(self, x: T) -> T:
    """Converts floating point values to the compute dtype."""
    return _cast_floating_to(x, self.compute_dtype)

  def cast_to_output(self, x: T) -> T:
    """Converts floating point values to the output dtype."""
    return _cast_floating_to(x, self.output_dtype)

  def cast_to_reduce(self, x: T) -> T:
    """Converts floating point values to the cross-device reduction dtype."""
    return _cast_floating_to(x, self.reduce_dtype)

  def with_param_dtype(self, param_dtype: DTypeLike) -> "Policy":
    return dataclasses.replace(self, param_dtype=param_dtype)

  def with_compute_dtype(self, compute_dtype: DTypeLike) -> "Policy":
    return dataclasses.replace(self, compute_dtype=compute_dtype)

  def with_output_dtype(self, output_dtype: DTypeLike) -> "Policy":
    return dataclasses.replace(self, output_dtype=output_dtype)

  def with_reduce_dtype(self, reduce_dtype: DTypeLike) -> "Policy":
    return dataclasses.replace(self, reduce_dtype=reduce_dtype)

  def with_autocast_dtype(self, autocast_dtype: Optional[DTypeLike]) -> "Policy":
    return dataclasses.replace(self, autocast_dtype=autocast_dtype)

  def with_fp8(self, fp8: Optional[str]) -> "Policy":
    return dataclasses.replace(self, fp8=fp8)

  def __str__(self) -> str:
    parts = [f"p={dtype_name(self.param_dtype)}",
             f"c={dtype_name(self.compute_dtype)}",
             f"o={dtype_name(self.output_dtype)}"]
    if self.reduce_dtype != np.float32:
      parts.append(f"r={dtype_name(self.reduce_dtype)}")
    if self.autocast_dtype is not None:
      parts.append(f"a={dtype_name(self.autocast_dtype)}")
    if self.fp8 is not None:
      parts.append(f"fp8={self.fp8}")
    return ",".join(parts)


_KEYS = {
    "p": "param_dtype", "params": "param_dtype", "param": "param_dtype",
    "c": "compute_dtype", "compute": "compute_dtype",
    "o": "output_dtype", "output": "output_dtype",
    "r": "reduce_dtype", "reduce": "reduce_dtype",
    "a": "autocast_dtype", "autocast": "autocast_dtype",
}


_PRESET_HALF = {"": jnp.bfloat16, "-bf16": jnp.bfloat16, "-f16": jnp.float16}


def _preset(name: str) -> Optional[Policy]:
  f32 = np.dtype(np.float32)
  level, suffix = name[:2], name[2:]
  if level in ("o0", "o1", "o2", "o3") and suffix in _PRESET_HALF:
    # Not `preferred_half_dtype()`: asking for devices initialises a backend,
    # and a policy parsed at import time would then break a later
    # `jax.distributed.initialize()`. Pre-Ampere GPUs, which lack bfloat16
    # arithmetic, spell "O2-f16".
    half = np.dtype(_PRESET_HALF[suffix])
    return {
        # Everything in float32.
        "o0": Policy(f32, f32, f32),
        # float32 everywhere, with op-level autocast of matmuls to half.
        "o1": Policy(f32, f32, f32, autocast_dtype=half),
        # float32 master parameters, half precision compute, float32 output.
        "o2": Policy(f32, half, f32),
        # Parameters and compute in half precision; the output cast to
        # float32, as Apex (apex/amp/_initialize.py: output_caster, float32
        # unless cast_model_outputs says otherwise) and MindSpore
        # (_OutputTo32 around O2 and O3 networks) cast it.
        "o3": Policy(half, half, f32),
    }[level]
  # Keras' mixed policies: float32 variables, compute and layer outputs in half.
  if name == "mixed_bfloat16":
    return Policy(f32, jnp.bfloat16, jnp.bfloat16)
  if name == "mixed_float16":
    return Policy(f32, jnp.float16, jnp.float16)
  return None


PRESETS = ("O0", "O1", "O2", "O3", "mixed_bfloat16", "mixed_float16")


def get_policy(policy_name: str | Policy) -> Policy:
  """Returns a mixed precision policy parsed from a string.

  The grammar is jmp's, made tolerant of case and spaces and strict about
  mistakes:

  * a single dtype name sets all three dtypes: ``"bf16"``, ``"full"``,
    ``"half"`` (jmp's `half_dtype`);
  * comma-separated ``key=dtype`` pairs, keys ``params``/``p``,
    ``compute``/``c``, ``output``/``o``, ``reduce``/``r`` and
    ``autocast``/``a``, and ``fp8=hybrid`` (or ``fp8=e4m3``), which is not a
    dtype but an fp8 recipe (`Policy.fp8`). Params default to float32, compute follows params,
    output follows compute, reduce is float32 (``"c=bf16"`` is
    ``"p=f32,c=bf16,o=bf16"``). A key given twice is an error;
  * a preset. ``half`` below is bfloat16, or what a suffix says:
    ``"O2-bf16"``, ``"O2-f16"`` (float16 for GPUs older than Ampere, which
    lack bfloat16 arithmetic). Parsing a preset never touches a device, so
    it can run before ``jax.distributed.initialize()``:

    ==================  ==========================================  ===================
    preset              policy                                      mirrors
    ==================  ==========================================  ===================
    ``O0``              ``p=f32,c=f32,o=f32``                       Apex/MindSpore O0
    ``O1``              ``p=f32,c=f32,o=f32,a=half`` (op autocast)  Apex/MindSpore O1
    ``O2``              ``p=f32,c=half,o=f32``                      Apex/MindSpore O2
    ``O3``              ``p=half,c=half,o=f32``                     Apex/MindSpore O3
    ``mixed_bfloat16``  ``p=f32,c=bf16,o=bf16``                     Keras
    ``mixed_float16``   ``p=f32,c=f16,o=f16``                       Keras
    ==================  ==========================================  ===================

  ``str(policy)`` parses back to an equal policy. A `Policy` is returned as is.

  Raises:
    ValueError: showing the offending token and the accepted ones.

  Example:
    >>> import jmp_lite
    >>> str(jmp_lite.get_policy("Params = float32, Compute = BF16"))
    'p=f32,c=bf16,o=bf16'
  """
  if isinstance(policy_name, Policy):
    return policy_name
  if not isinstance(policy_name, str):
    raise TypeError(
        f"get_policy expects a string or a Policy, got {policy_name!r}.")
  name = "".join(policy_name.split()).lower()
  if "=" not in name:
    preset = _preset(name)
    if preset is not None:
      return preset
    try:
      dtype = parse_dtype(name)
    except ValueError as e:
      close = difflib.get_close_matches(name, [p.lower() for p in PRESETS], n=1)
      hint = (f" Did you mean '{PRESETS[[p.lower() for p in PRESETS].index(close[0])]}'?"
              if close else "")
      raise ValueError(
          f"{e} Presets: {', '.join(PRESETS)}.{hint} Mixed policies are written "
          "'params=float32,compute=bfloat16,output=float32'.") from None
    return Policy(dtype, dtype, dtype)

  given = {}
  for part in name.split(","):
    key, sep, value = part.partition("=")
    if not sep or not key or not value or "=" in value:
      raise ValueError(
          f"Malformed token '{part}' in '{policy_name}': expected key=dtype"
          + (", the pairs separated by commas ('p=f32,c=bf16,o=f32')."
             if any(c in part for c in ";:/ |") else "."))
    if key not in _KEYS and key != "fp8":
      raise ValueError(
          f"Unknown key '{key}' in '{policy_name}' should be one of "
          "'params' (p), 'compute' (c), 'output' (o), 'reduce' (r), "
          "'autocast' (a), 'fp8'.")
    field = "fp8" if key == "fp8" else _KEYS.get(key)
    if field in given:
      raise ValueError(
          f"Duplicate key '{key}' in '{policy_name}': {field} is given twice.")
    if field == "fp8":
      if value not in FP8_RECIPES:
        raise ValueError(
            f"Unknown fp8 recipe '{value}' in '{policy_name}': expected one of "
            f"{sorted(FP8_RECIPES)}.")
      given[field] = value
      continue
    given[field] = parse_dtype(value)
  param = given.get("param_dtype", np.dtype(np.float32))
  compute = given.get("compute_dtype", param)
  output = given.get("output_dtype", compute)
  return Policy(param, compute, output,
                reduce_dtype=given.get("reduce_dtype", np.dtype(np.float32)),
                autocast_dtype=given.get("autocast_dtype"), fp8=given.get("fp8"))


def cast_to_full(tree: T) -> T:
  """Ensures floating point leaves of the given tree are f32."""
  return _cast_floating_to(tree, jnp.float32)


def cast_to_half(tree: T) -> T:
  """Ensures floating point leaves of the given tree are `half_dtype`."""
  return _cast_floating_to(tree, half_dtype())
