"""Which policy each module of a wrapped Flax model gets (see `jmp_lite.flax`)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax import nnx

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
  caller's compute dtype (Haiku's ResNet example does this by hand).

  Example:
    >>> import flax.linen as nn
    >>> import jmp_lite.flax
    >>> str(jmp_lite.flax.default_rules("p=f32,c=bf16,o=f32")[nn.LayerNorm])
    'p=f32,c=f32,o=f32'
  """
  policy = get_policy(policy)
  norm = Policy(np.float32, np.float32, policy.output_dtype)
  return {cls: norm for cls in _NORM_CLASSES}


# Rules ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rules:
  """Validated rules; hashable, so a Linen wrapper can hold them as a field."""

  policy: Policy
  classes: tuple[tuple[type, Policy], ...]
  paths: tuple[tuple[re.Pattern, int, Policy], ...]  # (pattern, rank, policy)

  @classmethod
  def create(cls, policy, rules, use_defaults: bool) -> "Rules":
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
    return cls(policy, tuple(classes.items()), tuple(paths))

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
    return self.policy


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


def is_narrow_float(dtype) -> bool:
  dtype = np.dtype(dtype)
  return bool(jnp.issubdtype(dtype, jnp.floating)) and jnp.finfo(dtype).bits <= 16


def needs_rewrite(rules: Rules) -> bool:
  policies = [rules.policy, *(p for _, p in rules.classes),
              *(p for _, _, p in rules.paths)]
  return any(is_narrow_float(p.compute_dtype) for p in policies)
