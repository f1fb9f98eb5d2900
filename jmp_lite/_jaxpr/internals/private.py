"""Flax's and Python's private API, each use with what it relies on.

`jmp_lite._jaxpr.internals` re-exports everything here.
"""

from __future__ import annotations

import contextlib
import sys
import types


def scope_init_args(scope) -> tuple[tuple, dict]:
  """``(args, kwargs)`` of `flax.core.scope.Scope` for a scope that mirrors
  ``scope``: the same variables, RNGs, name, mutability, parent, path, debug
  path and flags. Relies on `Scope._variables`, which is what `Scope.rewound`
  passes (flax/core/scope.py)."""
  return ((scope._variables, scope.rngs, scope.name, scope.mutable,  # pylint: disable=protected-access
           scope.parent),
          dict(path=scope.path, debug_path=scope.debug_path, flags=scope.flags))


def shallow_clone(module, **overrides):
  """``module.clone(**overrides)`` that keeps the submodules passed to it as
  attributes (a shared embedding) as they are, where their variables live.
  Relies on `Module.clone`'s private ``_deep_clone`` argument
  (flax/linen/module.py)."""
  return module.clone(_deep_clone=False, **overrides)


def in_setup_check(module) -> bool:
  """Whether ``module`` runs in Flax's abstract check of a submodule's
  ``setup`` (``Module._validate_setup``: an identity method on a clone bound
  to a ``TestScope``, evaluated with `jax.eval_shape`), not in the model.
  ``nn.RNN`` runs it on its cell. Relies on that scope's class being
  ``flax.linen.module.TestScope`` (flax/linen/module.py)."""
  from flax.linen import module as linen_module  # pylint: disable=g-import-not-at-top
  scope = module.scope
  return scope is not None and isinstance(scope.root, linen_module.TestScope)


@contextlib.contextmanager
def scope_swapped(module, scope):
  """``module`` bound to ``scope`` for the duration (a Linen module's
  ``setup``, so that the parameters it makes go through ``scope``). Relies on
  `flax.linen.Module` holding its scope as the instance attribute ``scope``,
  read by ``self.param`` on every call, and set past ``Module.__setattr__``
  (which refuses writes outside ``setup``)."""
  old = module.scope
  object.__setattr__(module, "scope", scope)
  try:
    yield module
  finally:
    object.__setattr__(module, "scope", old)


@contextlib.contextmanager
def interceptors_inside(interceptor):
  """Flax's method-interceptor stack without the interceptors outside
  ``interceptor`` (pushed before it) for the duration; yields them.

  They have run for the call ``interceptor`` handles, which it re-runs on a
  clone of the module (`flax.linen.Module.clone`): entering the clone's
  method goes through the stack again, and a user's interceptor outside the
  wrapper saw (and edited) each call twice. Relies on
  ``flax.linen.module._global_interceptor_stack._storage``, the
  thread-local list of `nn.intercept_methods`' interceptors, outermost first
  (flax 0.12, flax/linen/module.py: ``ThreadLocalStack``)."""
  from flax.linen import module as linen_module  # pylint: disable=g-import-not-at-top
  stack = linen_module._global_interceptor_stack._storage  # pylint: disable=protected-access
  at = next(i for i, x in enumerate(stack) if x is interceptor)
  outside = stack[:at]
  del stack[:at]
  try:
    yield outside
  finally:
    stack[:0] = outside


@contextlib.contextmanager
def interceptors_restored(outside):
  """Puts back the interceptors `interceptors_inside` took away, for the
  duration: the clone's method body, whose submodule calls every
  interceptor sees once."""
  from flax.linen import module as linen_module  # pylint: disable=g-import-not-at-top
  stack = linen_module._global_interceptor_stack._storage  # pylint: disable=protected-access
  stack[:0] = outside
  try:
    yield
  finally:
    del stack[:len(outside)]


def called_from(code, skip: int) -> bool:
  """Whether a frame running ``code`` (a function's ``__code__``) is on the
  call stack above the caller's ``skip`` callers. Relies on
  `sys._getframe` (CPython)."""
  frame = sys._getframe(skip + 2)  # pylint: disable=protected-access
  while frame is not None:
    if frame.f_code is code:
      return True
    frame = frame.f_back
  return False


def nested_code(factory, name: str):
  """The code of the function named ``name`` defined inside ``factory`` (the
  ``init`` closure of ``optax.apply_if_finite``), or None. Relies on CPython
  keeping a nested function's code among its parent's ``co_consts``, and on
  the factory naming the closure so."""
  code = getattr(factory, "__code__", None)
  for const in code.co_consts if code is not None else ():
    if isinstance(const, types.CodeType) and const.co_name == name:
      return const
  return None


def set_attributes(node, **attributes) -> None:
  """Sets ``attributes`` on an NNX module as plain instance attributes.

  Used on the throw-away copy `jmp_lite.flax` runs a wrapped NNX model as:
  its policies and dtype fields. Relies on `nnx.Module` keeping attributes
  in the instance ``__dict__`` and reading them back from there, and skips
  `nnx.Object.__setattr__`, which would register the values in the graph
  and refuses writes from inside a transform's trace.
  """
  for name, value in attributes.items():
    object.__setattr__(node, name, value)


# The name of the one attribute `jmp_lite.flax` sets on each module of the
# copy it runs a wrapped NNX model as (its policy, path, ...). Relies on
# `flax.nnx.bridge.ToNNX.__call__` skipping instance attributes prefixed
# ``to_nnx__`` when it reads a Linen module's variables from ``vars(self)``:
# any other attribute of a ToNNX node is taken for a variable, and one that
# is not a Variable raises "Cannot infer collection name" (flax 0.12,
# flax/nnx/bridge/wrappers.py).
OWN_ATTRIBUTE = "to_nnx__jmp_lite"


def swap_class(node, cls) -> None:
  """Makes ``node`` an instance of ``cls``, a subclass of its own class
  that only overrides ``__call__``. Relies on the same as `set_attributes`,
  and on `nnx.Module` subclasses sharing one instance layout (no
  ``__slots__``), which lets Python assign ``__class__``."""
  object.__setattr__(node, "__class__", cls)
