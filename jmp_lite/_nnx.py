"""NNX models under a policy: the NNX half of `jmp_lite.flax.wrap`.

NNX has no interception hook. The wrapper rebuilds a throw-away copy of the
module graph on every call (`flax.nnx.split`/`flax.nnx.merge`, cheap under
``jit``), casts the copy's parameters, gives each copied module a subclass
whose ``__call__`` casts at the boundary, runs it, and writes the non-param
state (batch statistics, RNG counts) back in its stored dtype. The user's
objects are never re-classed, and gradients flow through the casts to the
stored parameters, so they come back in ``param_dtype``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Optional

import jax
import numpy as np
from flax import nnx
from flax.nnx import bridge

from jmp_lite._flax_rules import dtype_overrides
from jmp_lite._flax_rules import fp8_scope
from jmp_lite._flax_rules import keep_carry
from jmp_lite._flax_rules import needs_rewrite
from jmp_lite._flax_rules import path_str
from jmp_lite._flax_rules import Rules
from jmp_lite._flax_rules import state_dtype_hint
from jmp_lite._flax_rules import tap_and_cast
from jmp_lite._flax_rules import warn_if_fp8_unplaced
from jmp_lite._flax_rules import warn_unmatched
from jmp_lite._jaxpr import internals as _internals
from jmp_lite._jaxpr.passes import engine as _engine
from jmp_lite._jaxpr import probes as _probes
from jmp_lite._linen import _LinenWrapper
from jmp_lite._linen import recording
from jmp_lite.policy import Policy

@functools.cache
def _casting_class(cls: type) -> type:
  """A subclass of ``cls`` whose ``__call__`` casts at the module boundary.

  Only instances in `NnxWrapper`'s throw-away copies get it. The cache is a
  memo of derived classes, not state.
  """

  def __call__(self, *args, **kwargs):
    policy, stack, path, scope = getattr(self, _internals.OWN_ATTRIBUTE)
    # The calling module's (policy, path), if a wrapped module called this one.
    caller, outer = stack[-1] if stack else (None, None)
    given = args
    args, kwargs = policy.cast_to_compute((args, kwargs))
    stack.append((policy, path))
    try:
      with jax.named_scope(_scope_name(self, path, outer)), scope():
        out = cls.__call__(self, *args, **kwargs)
    finally:
      stack.pop()
    # In a telemetry trace only (see `tap_and_cast`).
    out = tap_and_cast(out, path, caller, policy)
    return keep_carry(given, out)

  return type(cls.__name__, (cls,), {"__call__": __call__,
                                     "__module__": cls.__module__,
                                     "__qualname__": cls.__qualname__})


def _scope_name(module, path: str, outer) -> str:
  """The name scope a module's call opens: its path from the calling module's.

  Linen modules open one per module (``MLP/dense0``); NNX modules open none,
  so a trace of an NNX model (what `jmp_lite.calibrate` reads, and XLA's op names)
  had no module paths. The root opens its class name, as Linen's does, and
  each module its path relative to the module that called it (``layers/0``
  for an entry of a list attribute); a module called from outside its
  parent's call opens its whole path.
  """
  if not path:
    return type(module).__name__
  if outer and path.startswith(outer + "/"):
    return path[len(outer) + 1:]
  return path


class NnxWrapper(nnx.Module):
  """An NNX model run under a policy. Build it with `wrap`."""

  def __init__(self, module: nnx.Module, rules: Rules):
    policies = _policies(rules, module)
    if any(_converts(policies, path, variable)
           for path, variable in nnx.iter_graph(module)):
      # The caller's model is never changed: parameters stored in another
      # dtype than the policy's are converted in a copy, which the wrapper
      # holds (and trains).
      module = nnx.clone(module)
      for path, variable in nnx.iter_graph(module):
        if _converts(policies, path, variable):
          variable.set_value(_owner(policies, path).cast_to_param(
              variable.get_value()))
    self.module = module
    self.rules = rules
    paths = _module_paths(module)
    if rules.paths and paths is not None:
      warn_unmatched(rules, paths)

  def policy_map(self, *args, **kwargs) -> dict[str, Policy]:
    """`jmp_lite.flax.policy_map` of this model: its modules' policies, and,
    given inputs, those of the Linen modules its `flax.nnx.bridge.ToNNX`
    hold (known only by running them: traced with `jax.eval_shape`)."""
    out = {path_str(path): policy
           for path, policy in _policies(self.rules, self.module).items()}
    bridges = {path_str(path) for path, node in nnx.iter_graph(self.module)
               if isinstance(node, bridge.ToNNX)}
    if not bridges or not (args or kwargs):
      return out
    graphdef, state = nnx.split(self.module)
    with recording({}) as record:
      jax.eval_shape(lambda s: _nnx_run_as_written(
          self.rules, graphdef, s, *args, **kwargs)[0], state)
    merged = {}
    for path, policy in out.items():  # each bridge's Linen modules in its place
      if path in bridges:
        inside = {k: v for k, v in record.items()
                  if k == path or k.startswith(path + "/")}
        merged.update(inside or {path: policy})
      else:
        merged[path] = policy
    return merged

  def __call__(self, *args, fp8=None, **kwargs):
    """The model's call under the rules. ``fp8``: an `jmp_lite.fp8.Fp8State`
    from training, whose scales the fp8 matmuls then run with (inference;
    `jmp_lite.fp8.forward`)."""
    graphdef, state = nnx.split(self.module)
    policy = self.rules.policy
    if policy.autocast_dtype is not None:
      run = _nnx_autocast(policy)
    elif needs_rewrite(self.rules):
      run = _nnx_run(policy.reduce_dtype)
    else:
      run = _nnx_run_as_written
    if fp8 is not None:
      from jmp_lite._jaxpr.passes import instrument as _instrument  # pylint: disable=g-import-not-at-top
      out, updates = _instrument.forward(run, fp8, self.rules, graphdef, state,
                                         *args, params=(2,), **kwargs)
    else:
      warn_if_fp8_unplaced(self.rules)
      try:
        out, updates = run(self.rules, graphdef, state, *args, **kwargs)
      except TypeError as e:
        hint = state_dtype_hint(e, _by_variable_type(state), policy, nnx_model=True)
        if hint is None:
          raise
        raise TypeError(f"{e}\n\n{hint}") from e
    # Write back only what the call changed (an eval-mode call under a plain
    # JAX transformation changes nothing, and may not mutate), in the stored
    # dtype: statistics are never downcast.
    stored = dict(nnx.to_flat_state(nnx.state(self.module, nnx.Not(nnx.Param))))
    changed = []
    for path, variable in nnx.to_flat_state(updates):
      if path not in stored:  # made by the call (``sow``): kept as it is
        changed.append((path, variable))
        continue
      new, old = variable.get_value(), stored[path].get_value()
      if new is old:
        continue
      if hasattr(old, "dtype") and new.dtype != old.dtype:
        variable.set_value(new.astype(old.dtype))
      changed.append((path, variable))
    if changed:
      nnx.update(self.module, nnx.from_flat_state(changed))
    return out


def _by_variable_type(state) -> dict[str, dict[str, Any]]:
  """An NNX state's values grouped by Variable type (``Cache``...), by path."""
  out: dict[str, dict[str, Any]] = {}
  for path, variable in nnx.to_flat_state(state):
    out.setdefault(type(variable).__name__, {})["/".join(map(str, path))] = (
        variable.get_value())
  return out


def _module_paths(module) -> Optional[set[str]]:
  """The paths rules can match in an NNX model: its modules', and those of
  the Linen modules with variables inside its `flax.nnx.bridge.ToNNX`
  (nested mappings there). None when a ``ToNNX`` holds no variables yet
  (not initialised: its modules are unknown)."""
  graph = [(tuple(path), node) for path, node in nnx.iter_graph(module)]
  bridges = [path for path, node in graph if isinstance(node, bridge.ToNNX)]
  paths = {path_str(path) for path, node in graph if isinstance(node, nnx.Module)}
  for b in bridges:
    # The bridge's own attributes (``to_nnx__rngs``, NNX's ``_pytree__``
    # bookkeeping) are not the Linen model's.
    inside = [(path, node) for path, node in graph
              if len(path) > len(b) and path[:len(b)] == b and not any(
                  str(part).startswith(("to_nnx__", "_pytree__"))
                  for part in path[len(b):])]
    if not any(isinstance(node, nnx.Variable) for _, node in inside):
      return None
    paths.update(path_str(path) for path, node in inside
                 if isinstance(node, Mapping))
  return paths


def _policies(rules: Rules, module) -> dict[tuple, Policy]:
  return {tuple(path): rules.resolve(type(m), path_str(path))
          for path, m in nnx.iter_modules(module)}


def _nnx_run_as_written(rules: Rules, graphdef, state, *args, **kwargs):
  """Runs a throw-away copy of the model with the policies applied."""
  # A copy of its own: merged without copying, the model's Variables are the
  # stored ones, and casting them (below) wrote the compute dtype into the
  # stored parameters (a float32 policy then also mutated them from inside
  # a plain JAX transformation, which NNX refuses).
  copy = nnx.merge(graphdef, state, copy=True)
  policies = _policies(rules, copy)
  stack = []
  # Linen models held through `flax.nnx.bridge.ToNNX` run under a Linen
  # wrapper with the same rules (its paths seen from this model's root),
  # which casts their parameters per module (norms in float32). Under
  # op-level autocast no module casts: they run as written.
  bridges = [] if rules.policy.autocast_dtype is not None else [
      tuple(path) for path, node in nnx.iter_graph(copy)
      if isinstance(node, bridge.ToNNX)]
  for path, node in list(nnx.iter_graph(copy)):
    if any(tuple(path[:len(b)]) == b for b in bridges):
      if isinstance(node, bridge.ToNNX):
        _internals.set_attributes(node, to_nnx__module=_LinenWrapper(
            node.to_nnx__module, rules, prefix=tuple(map(str, path))))
      if isinstance(node, nnx.Param):
        continue  # cast by the Linen wrapper, module by module
    if isinstance(node, nnx.Param):
      policy = _owner(policies, path)
      # Tapped in a telemetry trace (seen in the compute dtype): its
      # cotangent is the weight gradient.
      node.set_value(policy.cast_to_compute(_probes.tap(
          node.get_value(), path_str(path), view=policy.compute_dtype)))
    elif isinstance(node, nnx.Module):
      policy = policies[tuple(path)]
      if not rules.module_dtypes:
        _internals.set_attributes(
            node, **dtype_overrides(node, policy, vars(node)))
      _internals.set_attributes(node, **{_internals.OWN_ATTRIBUTE: (
          policy, stack, path_str(path),
          functools.partial(fp8_scope, rules, policy, path_str(path)))})
      if type(node).__call__ is not nnx.Module.__call__:
        _internals.swap_class(node, _casting_class(type(node)))
  out = copy(*args, **kwargs)
  return out, nnx.state(copy, nnx.Not(nnx.Param))


@functools.cache
def _nnx_run(reduce_dtype):
  """The engine's rewrite, cached per (rules, graph structure, argument
  structure) inside: see `jmp_lite._linen._linen_engine`."""
  return _engine.accumulate(_nnx_run_as_written, reduce_dtype=reduce_dtype)


@functools.cache
def _nnx_autocast(policy):
  from jmp_lite.autocasting import autocast  # pylint: disable=g-import-not-at-top
  return autocast(_nnx_run_as_written, policy)


def _owner(policies: dict[tuple, Policy], path) -> Policy:
  """The policy of the innermost module whose path is a prefix of ``path``."""
  path = tuple(path)
  for n in range(len(path) - 1, -1, -1):
    if path[:n] in policies:
      return policies[path[:n]]
  raise AssertionError(f"No module owns {path}.")



def _converts(policies, path, variable) -> bool:
  """Whether ``variable`` is a floating `nnx.Param` not in its ``param_dtype``."""
  if not isinstance(variable, nnx.Param):
    return False
  dtype = getattr(variable.get_value(), "dtype", None)
  return (dtype is not None and np.issubdtype(dtype, np.floating)
          and np.dtype(dtype) != np.dtype(_owner(policies, path).param_dtype))
