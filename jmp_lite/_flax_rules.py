"""Which policy each module of a wrapped Flax model gets (see `jmp_lite.flax`)."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import inspect
import os
import re
import warnings
from collections.abc import Mapping
from typing import Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import bridge

from jmp_lite import _dtypes
from jmp_lite._dtypes import is_narrow_float
from jmp_lite._jaxpr import fp8_sites as _fp8_sites
from jmp_lite._jaxpr import probes as _probes
from jmp_lite.policy import get_policy
from jmp_lite.policy import Policy

_NORM_CLASSES = (
    nn.LayerNorm, nn.RMSNorm, nn.BatchNorm, nn.GroupNorm,
    nnx.LayerNorm, nnx.RMSNorm, nnx.BatchNorm, nnx.GroupNorm,
)
_REGEX_SYNTAX = set(".^$*+?{}[]|()\\")


def default_rules(policy: Policy | str) -> dict[type, Policy]:
  """The rules `wrap` adds unless ``default_rules=False``.

  Normalisation layers keep parameters and statistics in float32, compute in
  float32 and, like every inner module, hand their outputs back in their
  caller's compute dtype (Haiku's ResNet example does this by hand). These
  are Flax's own norm classes; with the defaults on, a model's own norm
  classes get the same policy by their name (`is_norm_class`: ending in
  ``Norm`` or ``Normalization``) unless a rule of the user's matches them.

  Example:
    >>> import flax.linen as nn
    >>> import jmp_lite.flax
    >>> str(jmp_lite.flax.default_rules("p=f32,c=bf16,o=f32")[nn.LayerNorm])
    'p=f32,c=f32,o=f32'
  """
  norm = _norm_policy(get_policy(policy))
  return {cls: norm for cls in _NORM_CLASSES}


def _norm_policy(policy: Policy) -> Policy:
  return Policy(np.float32, np.float32, policy.output_dtype)


def is_norm_class(cls: type) -> bool:
  """Whether a module class is a normalisation layer by its name.

  A class (or a base class) whose name ends in ``Norm`` or
  ``Normalization``: ``RMSNorm``, ``T5LayerNorm``, ``ScaleNorm``,
  ``BatchNormalization``, written in a model's own file.
  """
  return any(c.__name__.endswith(("Norm", "Normalization"))
             for c in cls.__mro__)


# Rules ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rules:
  """Validated rules; hashable, so a Linen wrapper can hold them as a field."""

  policy: Policy
  classes: tuple[tuple[type, Policy], ...]
  paths: tuple[tuple[re.Pattern, int, Policy], ...]  # (pattern, rank, policy)
  module_dtypes: bool = False  # whether modules' own dtype fields win
  norm: Policy | None = None  # for user norm classes (`is_norm_class`)

  @classmethod
  def create(cls, policy, rules, use_defaults: bool,
             module_dtypes: bool = False) -> "Rules":
    policy = to_policy(policy, "policy")
    if rules is None:
      rules = {}
    if not isinstance(rules, Mapping):
      raise TypeError(
          f"rules must be a mapping from module classes or path regexes to "
          f"policies, got {rules!r}.")
    classes = dict(default_rules(policy)) if use_defaults else {}
    paths = []
    for i, (key, value) in enumerate(rules.items()):
      rule_policy = to_policy(value, f"rules[{key!r}]")
      if isinstance(key, type):
        if not issubclass(key, (nn.Module, nnx.Module)):
          raise TypeError(
              f"Rule key {key!r} is a class but not a flax.linen.Module or "
              "flax.nnx.Module subclass.")
        classes[key] = rule_policy
      elif isinstance(key, str):
        try:
          pattern = re.compile(key)
        except re.error as e:
          raise ValueError(
              f"Rule key {key!r} is not a valid regular expression: {e}.") from None
        literal = sum(ch not in _REGEX_SYNTAX for ch in key)
        paths.append((pattern, (literal, i), rule_policy))
      else:
        raise TypeError(
            f"Rule key {key!r} ({type(key).__name__}) must be a module class or "
            "a regular expression over module paths, e.g. nn.LayerNorm or "
            "'encoder/.*/attention'.")
    if not isinstance(module_dtypes, bool):
      raise TypeError(
          f"module_dtypes must be True or False, got {module_dtypes!r}.")
    norm = _norm_policy(policy) if use_defaults else None
    return cls(policy, tuple(classes.items()), tuple(paths), module_dtypes,
               norm)

  def resolve(self, module_type: type, path: str) -> Policy:
    """The policy of the most specific rule matching (see module docstring)."""
    best = None
    for pattern, rank, policy in self.paths:
      if pattern.fullmatch(path) and (best is None or rank >= best[0]):
        best = (rank, policy)
    if best is not None:
      return best[1]
    mro = module_type.__mro__
    matches = [(mro.index(c), p) for c, p in self.classes if c in mro]
    if matches:
      return min(matches, key=lambda m: m[0])[1]
    if self.norm is not None and is_norm_class(module_type):
      return self.norm
    return self.policy


class UnmatchedRuleWarning(UserWarning):
  """A path rule given to `jmp_lite.flax.wrap` matches no module of the model."""


def warn_unmatched(rules: Rules, paths) -> None:
  """Warns for each path rule that matches none of ``paths``.

  A misspelt rule (``"encoder/layer_0/attention"`` for
  ``"encoder/layers_0/attention"``) otherwise leaves that module at the
  model's policy with nothing said: the user believes it runs in float32.
  ``paths``: the model's module paths, as the rules see them.
  """
  paths = sorted(set(paths))
  for pattern, _, policy in rules.paths:
    if any(pattern.fullmatch(p) for p in paths):
      continue
    close = difflib.get_close_matches(pattern.pattern, paths, n=3)
    hint = f" Closest paths: {', '.join(map(repr, close))}." if close else ""
    warnings.warn(
        f"jmp_lite.flax.wrap: the path rule {pattern.pattern!r} (policy "
        f"{policy}) matches no module of the model, so it applies to nothing. "
        "Rules match a module's whole path relative to the wrapped model, its "
        "parts joined by '/' (re.fullmatch); jmp_lite.flax.policy_map lists "
        f"them.{hint}", UnmatchedRuleWarning, stacklevel=_user_stacklevel())


# Frames of these libraries (and the standard library's wrappers they call
# through) are skipped when a warning names its line: the rules are checked
# deep inside Flax's apply, under JAX's tracing.
_LIBRARIES = tuple(os.path.dirname(m.__file__) + os.sep
                   for m in (jax, flax)) + (os.path.dirname(__file__) + os.sep,
                                            contextlib.__file__, functools.__file__)


def _user_stacklevel() -> int:
  """``stacklevel`` for a ``warnings.warn`` in the caller of this function
  that names the first frame outside jmp_lite, Flax and JAX (the user's
  ``init``/``apply``)."""
  level, frame = 1, inspect.currentframe().f_back
  while frame is not None and frame.f_code.co_filename.startswith(_LIBRARIES):
    frame, level = frame.f_back, level + 1
  return level


def variable_paths(variables) -> set[str]:
  """The module paths of a Linen model's variables (collection -> tree):
  every nested mapping in a collection is a module's (``""`` the model's)."""
  out = {""}

  def walk(node, parts):
    for key, value in node.items():
      if isinstance(value, Mapping):
        out.add("/".join(parts + (str(key),)))
        walk(value, parts + (str(key),))

  for tree in variables.values():
    if isinstance(tree, Mapping):
      walk(tree, ())
  return out


def to_policy(value, what: str) -> Policy:
  if isinstance(value, Policy):
    return value
  if isinstance(value, str):
    try:
      return get_policy(value)
    except ValueError as e:
      raise ValueError(f"{what}: {e}") from None
  raise TypeError(
      f"{what} must be a jmp_lite.Policy or a policy string such as "
      f"'p=f32,c=bf16,o=f32', got {value!r}.")


def path_str(parts) -> str:
  return "/".join(str(p) for p in parts)


def needs_rewrite(rules: Rules) -> bool:
  policies = [rules.policy, *(p for _, p in rules.classes),
              *(p for _, _, p in rules.paths)]
  return any(is_narrow_float(p.compute_dtype) for p in policies)


def has_fp8(rules: Rules) -> bool:
  """Whether any policy of ``rules`` runs matmuls in fp8."""
  return bool(_fp8_recipes(rules))


def _fp8_recipes(rules: Rules) -> list[str]:
  policies = [rules.policy, *(p for _, p in rules.classes),
              *(p for _, _, p in rules.paths)]
  return sorted({p.fp8 for p in policies if p.fp8 is not None})


def warn_if_fp8_unplaced(rules: Rules) -> None:
  """Warns that a model whose rules give modules fp8 matmuls is called
  where no fp8 state is: its matmuls then run at the compute dtype."""
  if has_fp8(rules) and not _fp8_sites.placed():
    warnings.warn(
        f"jmp_lite.flax.wrap: the rules give modules fp8 matmuls "
        f"(fp8={', '.join(_fp8_recipes(rules))}), but the model is called "
        "without an fp8 state, so they run in their policy's compute dtype "
        "(bf16 for 'p=f32,c=bf16,fp8=hybrid'). Train with "
        "jmp_lite.TrainState.create(..., fp8=jmp_lite.fp8.init(...)) or "
        "jmp_lite.value_and_grad(...)(..., fp8=state), and infer with "
        "apply(..., fp8=state) (Linen) or model(..., fp8=state) (NNX).",
        UserWarning, stacklevel=_user_stacklevel())


def fp8_scope(rules: Rules, policy: Policy, path: str):
  """The name scope that tells the step which matmuls are fp8 (or a no-op)."""
  if not has_fp8(rules):
    return contextlib.nullcontext()
  return jax.named_scope(_fp8_sites.mark(policy.fp8, path))


def _holds(wide, narrow) -> bool:
  """Whether float dtype ``wide`` holds every value of ``narrow`` (a cast
  to it is exact): more significand bits and a range that covers it."""
  w, n = jnp.finfo(wide), jnp.finfo(narrow)
  return w.nmant >= n.nmant and w.maxexp >= n.maxexp and w.minexp <= n.minexp


def tap_and_cast(out, path: str, caller, policy: Policy):
  """A wrapped module's ``out``, marked for telemetry (`_probes.tap`) and
  cast for its caller (``caller``'s compute dtype) or, for the model itself,
  to the policy's output dtype.

  A submodule's output is marked as it computed it. The model's output is
  marked after its cast to the output dtype where that cast is exact (to a
  dtype holding every value of the computed one), with the dtypes it was
  computed in as the view: its statistics are the same, and its cotangent
  is measured before the backward pass casts it back to the compute dtype,
  so that a loss cotangent that cast flushes to zero counts as underflow
  rather than as zeros. If any leaf's cast rounds (float32 to bfloat16,
  float16 to bfloat16), the output is marked before the cast, as computed.
  """
  if caller:
    return caller.cast_to_compute(_probes.tap(out, path))
  held = [getattr(x, "dtype", None) for x in jax.tree_util.tree_leaves(out)]
  wide = np.dtype(policy.output_dtype)
  if any(d is not None and jnp.issubdtype(d, jnp.floating)
         and not _holds(wide, d) for d in held):
    # A cast that rounds (c=f32,o=bf16; float16 <-> bfloat16): the output is
    # measured as computed, for every leaf.
    return policy.cast_to_output(_probes.tap(out, path))
  return _probes.tap(policy.cast_to_output(out), path, view=held, cast_back=True)


def keep_carry(args, out):
  """``out`` with its carry back in the dtypes the carry came in.

  Flax's recurrences (``nn.scan``, ``nn.RNN`` and its cells, ``nnx.scan``,
  ``nnx.RNN``) call a module as ``(carry, x) -> (carry, y)``, and a scan
  needs the carry it returns to have the type it was given. A carry the
  model creates in float32 (``initialize_carry`` makes zeros in
  ``param_dtype``) is computed on in the module's compute dtype, then handed
  back in float32, as Flax's own bf16 cells keep it: the recurrent state
  accumulates in the dtype the model wrote it in. When ``out[0]`` has the
  tree structure and shapes of ``args[0]``, its floating leaves take
  ``args[0]``'s dtypes; anything else is returned as it is.
  """
  if not args or not isinstance(out, (tuple, list)) or not out:
    return out
  carry, new = args[0], out[0]
  leaves, tree = jax.tree.flatten(carry)
  new_leaves, new_tree = jax.tree.flatten(new)
  if tree != new_tree or not all(
      np.shape(a) == np.shape(b) for a, b in zip(leaves, new_leaves)):
    return out
  restored = jax.tree.unflatten(tree, [
      b.astype(a.dtype) if _floating(a) and _floating(b)
      and a.dtype != b.dtype else b for a, b in zip(leaves, new_leaves)])
  items = (restored, *out[1:])
  return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)


def _floating(x) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


# The fields Flax's layers (and models written in their style) take their
# dtypes from: `promote_dtype(..., dtype=self.dtype)` in every layer, and
# `param_dtype` in every initializer (and `initialize_carry`).
_DTYPE_FIELDS = (("dtype", "compute_dtype"), ("param_dtype", "param_dtype"))


def dtype_overrides(module, policy: Policy, names) -> dict:
  """The policy's dtypes for ``module``'s dtype fields, by field name.

  Only fields the module has (``names``) and that hold ``None`` or a floating
  dtype: a field named ``dtype`` that holds an integer dtype (an index, a
  token id) is something else and keeps its value.
  """
  out = {}
  for field, attr in _DTYPE_FIELDS:
    if field not in names:
      continue
    value = getattr(module, field, None)
    if value is None or _floating_dtype(value):
      out[field] = np.dtype(getattr(policy, attr))
  return out


def _floating_dtype(value) -> bool:
  try:
    return bool(jnp.issubdtype(np.dtype(value), jnp.floating))
  except TypeError:
    return False


def warn_if_bridged(module, path: str, policy: Policy) -> None:
  """Warns that ``module``, an NNX module held through
  `flax.nnx.bridge.ToLinen`, runs as its own code says: the Linen wrapper
  casts its inputs but does not enter it."""
  if isinstance(module, bridge.ToLinen) and is_narrow_float(policy.compute_dtype):
    name = getattr(module.nnx_class, "__name__", module.nnx_class)
    warnings.warn(
        f"jmp_lite.flax.wrap: {path or 'the model'} is an NNX module held "
        f"through flax.nnx.bridge.ToLinen ({name}), which wrap does not "
        f"enter: it gets its inputs in {np.dtype(policy.compute_dtype)} and "
        "runs at the dtypes its own code gives (float32 parameters make its "
        "matmuls float32). Give the NNX module the policy's dtype=, or wrap "
        "the NNX model itself.", UserWarning, stacklevel=3)


def state_dtype_hint(error, variables, policy: Policy, nnx_model: bool = False) -> Optional[str]:
  """What to do when a model's own state meets a value computed under the
  policy in an operation that takes one dtype (``lax.dynamic_update_slice``
  writing a decoding cache): None when the error is another, or no
  collection but the parameters holds a float dtype other than the
  compute dtype. ``variables``: collection (an NNX model's: Variable type)
  -> tree."""
  if "requires arguments to have the same dtypes" not in str(error):
    return None
  compute = np.dtype(policy.compute_dtype)
  found = {}
  if isinstance(variables, Mapping):
    for collection, tree in variables.items():
      if collection in ("params", "Param"):
        continue
      for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if _dtypes.is_floating(leaf) and np.dtype(leaf.dtype) != compute:
          found.setdefault(collection, (jax.tree_util.keystr(path), leaf.dtype))
  if not found:
    return None
  where = "; ".join(f"{c!r}: {p} is {d}" for c, (p, d) in found.items())
  made = (f"Make it in {compute} (a decoding cache: "
          f"model.init_cache(shape, dtype={compute.name}))." if nnx_model else
          f"Make that collection with the wrapped model's init "
          f"(wrapped.init(...)[collection]) or cast it to {compute}.")
  return (
      f"jmp_lite.flax.wrap: the model's state holds floats other than the "
      f"compute dtype {compute} outside its parameters ({where}). Under "
      f"wrap a module computes in its policy's compute dtype, and state it "
      f"builds from what it computes (a decoding cache's keys and values) is "
      f"made in that dtype, as Flax's own {compute} modules make it. {made}")
