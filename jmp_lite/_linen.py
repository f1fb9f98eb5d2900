"""Linen models under a policy: the Linen half of `jmp_lite.flax.wrap`.

The wrapper shares its scope with the model (`flax.linen.share_scope`, so the
variables have the model's own layout) and calls it under
`flax.linen.intercept_methods`. The interceptor, for each module method call,
casts the arguments and runs the method on a clone of the module bound to a
scope whose ``param`` creates parameters in ``param_dtype`` and reads them in
``compute_dtype``. A Linen model held by an NNX model
(`flax.nnx.bridge.ToNNX`) runs under the same wrapper (`jmp_lite._nnx`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
from typing import Any, Optional

import flax.linen as nn
from flax.core.scope import Scope

from jmp_lite._flax_rules import dtype_overrides
from jmp_lite._flax_rules import fp8_scope
from jmp_lite._flax_rules import keep_carry
from jmp_lite._flax_rules import needs_rewrite
from jmp_lite._flax_rules import path_str
from jmp_lite._flax_rules import Rules
from jmp_lite._flax_rules import state_dtype_hint
from jmp_lite._flax_rules import tap_and_cast
from jmp_lite._flax_rules import variable_paths
from jmp_lite._flax_rules import warn_if_fp8_unplaced
from jmp_lite._flax_rules import warn_unmatched
from jmp_lite._flax_rules import warn_if_bridged
from jmp_lite._jaxpr import internals as _internals
from jmp_lite._jaxpr import module_scales as _module_scales
from jmp_lite._jaxpr.passes import engine as _engine
from jmp_lite._jaxpr import probes as _probes
from jmp_lite.policy import Policy


# Where `jmp_lite.flax.policy_map` collects the policies of Linen modules run
# by a wrapper it does not call itself (one inside an NNX model's
# `flax.nnx.bridge.ToNNX`): path -> policy, or None.
_RECORD: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar(
    "jmp_lite_policy_record", default=None)


@contextlib.contextmanager
def recording(record: dict):
  """Records into ``record`` the policy of every Linen module run by a
  wrapper in the ``with`` block."""
  token = _RECORD.set(record)
  try:
    yield record
  finally:
    _RECORD.reset(token)


class _PolicyScope(Scope):
  """A view of a module's scope that applies a policy to its parameters.

  Same variables, RNG counters and path as the scope it mirrors (as
  `Scope.rewound` builds it); children pushed from it are plain scopes.
  """

  def __init__(self, scope: Scope, policy: Policy, path: str = ""):
    args, kwargs = _internals.scope_init_args(scope)
    super().__init__(*args, **kwargs)
    self.rng_counters = scope.rng_counters
    self.jmp_policy = policy
    self.jmp_path = path

  def param(self, name, init_fn, *init_args, unbox=True, **init_kwargs):
    policy = self.jmp_policy

    def init_in_param_dtype(*args, **kwargs):
      return policy.cast_to_param(init_fn(*args, **kwargs))

    value = super().param(name, init_in_param_dtype, *init_args, unbox=unbox,
                          **init_kwargs)
    # In a telemetry trace: the parameter (seen in the compute dtype) and
    # its cotangent, the weight gradient.
    path = f"{self.jmp_path}/{name}" if self.jmp_path else name
    # Under a per-module loss scale, its weight gradient leaves the module's
    # scale for the global one here, in the parameter dtype.
    value = _module_scales.param(value)
    return policy.cast_to_compute(_probes.tap(value, path, view=policy.compute_dtype))


def _lifted(method, context) -> bool:
  """Whether ``method`` is a lifted transform of the function being run.

  A method decorated with a lifted transform (``nn.scan``, ``nn.remat``,
  ``nn.jit``... on the method itself, as Flax's SST-2 LSTM classifier
  does) is not intercepted itself: the transform calls the method's body
  on a module of its own, and that call is. Calling the clone's method
  would apply the transform a second time, nested in itself (a scan over
  already-sliced inputs), so the clone runs the body that was intercepted.
  Relies on Flax's method wrappers (``wrap_method_once``) keeping the
  function they wrap as ``__wrapped__`` (``functools.wraps``), and on
  ``InterceptorContext.orig_method`` being that function bound to the module.
  """
  return getattr(method, "__wrapped__", None) is not getattr(
      context.orig_method, "func", None)


class _LinenInterceptor:
  """Applies the rules to every module method called under it.

  Holds the policies of the modules running now (per call, not global): a
  module's outputs go back in its caller's compute dtype.
  """

  def __init__(self, rules: Rules, root: tuple, record: Optional[dict] = None,
               prefix: tuple = (), scope_root=None):
    self.rules = rules
    self.root = root
    self.prefix = prefix
    self.record = record
    # The root scope of the wrapped model's variables, and the paths of the
    # modules running now: a module applied on its own inside the model
    # (GPT-2's tied head: ``self.lm_head.apply({"params": ...}, h)``) has a
    # root scope of its own and the path (); it is named as its caller's
    # child, not as the model (whose row it was merged into).
    self.scope_root = scope_root
    self.paths: list[str] = []
    # (type, name) of each module on the stack: a lifted transform's copy of
    # the running module is that module, not its child.
    self.owners: list[tuple] = []
    self.seen: dict[str, Policy] = {}  # every module called under it: its policy
    self.stack: list[Optional[Policy]] = []
    # The clones methods ran on, alive as long as the call: a submodule a
    # method returns (``model._get_encoder_module()``, as Hugging Face's
    # encode/decode do) holds its parent weakly, and once the clone was
    # collected a shared module it refers to (a tied embedding) looked
    # unbound and was adopted again under the wrong path.
    self.clones: list[nn.Module] = []
    # id(clone) -> the interceptors outside this one, set aside while the
    # clone's method is entered (they ran for the call it re-runs).
    self.outside: dict[int, list] = {}

  def __call__(self, next_fun, args, kwargs, context):
    module = context.module
    if isinstance(module.scope, _PolicyScope):
      outside = self.outside.pop(id(module), None)
      if outside is None:
        return next_fun(*args, **kwargs)
      with _internals.interceptors_restored(outside):
        return next_fun(*args, **kwargs)
    if self.stack and self.stack[-1] is None or _internals.in_setup_check(module):
      # Under a nested wrapper, or Flax's abstract setup check (not a call
      # of the model: it named a module where no variables are).
      return next_fun(*args, **kwargs)
    if context.method_name == "setup":
      return self._setup(next_fun, args, kwargs, module)
    caller = self.stack[-1] if self.stack else None
    if isinstance(module, _LinenWrapper):  # a nested wrapper has its own rules
      self.stack.append(None)
      try:
        out = next_fun(*args, **kwargs)
      finally:
        self.stack.pop()
      return caller.cast_to_compute(out) if caller else out
    path = self._path(module)
    policy = self.rules.resolve(type(module), path)
    self.seen.setdefault(path, policy)
    if self.record is not None:
      self.record.setdefault(path, policy)
    given = args
    with _module_scales.module(path) as convert:
      if convert is not None:  # a per-module loss scale's region (in the
        # caller's dtypes, outside the casts)
        args, kwargs = convert[0]((args, kwargs))
      out = self._run_module(next_fun, args, kwargs, context, module, path,
                             policy, caller)
      if convert is not None:
        out = convert[1](out)
    return keep_carry(given, out)

  def _setup(self, next_fun, args, kwargs, module):
    """A module's ``setup``, with the parameters it makes (an ``nn.Embed``'s
    table, a ``cls_token``) created in ``param_dtype`` and read in the
    compute dtype, as a compact method's are.

    Flax runs ``setup`` on the module itself, before the interceptor sees
    the method that needed it; the clone a method then runs on shares what
    ``setup`` assigned.
    """
    if module.scope is None or isinstance(module, _LinenWrapper):
      return next_fun(*args, **kwargs)
    path = self._path(module)
    policy = self.rules.resolve(type(module), path)
    with _internals.scope_swapped(module, _PolicyScope(module.scope, policy, path)):
      return next_fun(*args, **kwargs)

  def _path(self, module) -> str:
    """The module's path from the wrapped model's root."""
    root = None if module.scope is None else module.scope.root
    if self.scope_root is None and not self.paths:
      self.scope_root = root  # the outermost module's
    if (self.paths and module.name and root is not None and root is not self.scope_root
        and not self._lifted_full_path(module)):
      # A scope of its own: a module applied on its own inside the model (a
      # tied head's ``lm_head.apply``) is its caller's child, and so is each
      # module a lifted function (``nn.cond``, ``nn.scan`` of a function) makes;
      # the copy such a function is given of the module calling it is that
      # module.
      if self.owners and self.owners[-1] == (type(module), module.name):
        return self.paths[-1]
      return "/".join(p for p in (self.paths[-1], module.name) if p)
    return path_str(self.prefix + tuple(module.path[len(self.root):]))

  def _lifted_full_path(self, module) -> bool:
    """Whether ``module`` runs in a lifted scope (``nn.scan``, ``nn.vmap``,
    ``nn.remat``) that keeps its place in the model: Flax gives such a scope
    the whole path of the variables it holds. ``nn.RNN(cell)`` scans a cell
    made by its caller, whose variables are the caller's (``SimpleCell_0``,
    not ``RNN_0/SimpleCell_0``): named by the call stack, a rule for the
    cell's path matched no module and its matmuls stayed in the model's
    policy. A module applied on its own (a tied head's ``.apply``) has a
    root of path () instead, its modules' paths relative to it."""
    path, base = tuple(module.path), tuple(module.scope.root.path)
    return (bool(base) and path[:len(base)] == base
            and len(path) > len(self.root) and path[:len(self.root)] == tuple(self.root))

  def _run_module(self, next_fun, args, kwargs, context, module, path, policy,
                  caller):
    warn_if_bridged(module, path, policy)
    args, kwargs = policy.cast_to_compute((args, kwargs))
    method = getattr(type(module), context.method_name, None)
    self.stack.append(policy)
    self.paths.append(path)
    self.owners.append((type(module), module.name))
    try:
      if method is None:  # a function passed as `method=`: cast only.
        out = next_fun(*args, **kwargs)
      else:
        # Not a deep clone: a submodule passed in as an attribute (a shared
        # embedding, nn.RNN's cell) stays the model's, where its variables are.
        clone = _internals.shallow_clone(module, parent=_PolicyScope(module.scope, policy, path),
                                         **self.dtypes(module, policy))
        self.clones.append(clone)
        run = getattr(clone, context.method_name)
        if _lifted(method, context):
          run = functools.partial(nn.module.wrap_method_once(context.orig_method.func), clone)
        with fp8_scope(self.rules, policy, path), \
            _internals.interceptors_inside(self) as outside:
          self.outside[id(clone)] = outside
          try:
            out = run(*args, **kwargs)
          finally:
            self.outside.pop(id(clone), None)
    finally:
      self.stack.pop()
      self.paths.pop()
      self.owners.pop()
    # In a telemetry trace: the module's output as it computed it. The
    # model's own output is marked after its cast to the output dtype, so that
    # the backward pass's cast of the loss's cotangent back to the compute
    # dtype, where it can underflow entirely, is measured (`_probes.tap`).
    return tap_and_cast(out, path, caller, policy)


  def dtypes(self, module, policy: Policy) -> dict:
    """The policy's dtypes for the module's own ``dtype``/``param_dtype``."""
    if self.rules.module_dtypes:
      return {}
    names = {f.name for f in dataclasses.fields(module)}
    return dtype_overrides(module, policy, names)


class _LinenWrapper(nn.Module):
  """A Linen model run under a policy. Build it with `wrap`."""

  module: nn.Module
  rules: Rules
  # Where the model sits in an NNX model that holds it (`flax.nnx.bridge.ToNNX`):
  # the rules see its modules' paths from the NNX model's root.
  prefix: tuple = ()

  def setup(self):
    nn.share_scope(self, self.module)

  def _interceptor(self):
    return _LinenInterceptor(self.rules, self.scope.path, _RECORD.get(),
                             prefix=self.prefix, scope_root=self.scope.root)

  def __call__(self, *args, **kwargs):
    interceptor = self._interceptor()
    with nn.intercept_methods(interceptor):
      out = self.module(*args, **kwargs)
    self._check_rules(interceptor)
    return out

  def run_method(self, method, *args, **kwargs):
    """The model's ``method`` (a name, or a function of the model) under the
    rules: what ``apply(..., method=method)`` runs. A module method, so that
    ``setup`` has shared the model's scope first."""
    interceptor = self._interceptor()
    with nn.intercept_methods(interceptor):
      if isinstance(method, str):
        out = getattr(self.module, method)(*args, **kwargs)
      else:
        out = method(self.module, *args, **kwargs)
    self._check_rules(interceptor)
    return out

  def _check_rules(self, interceptor) -> None:
    """Warns for path rules that match no module: none called by this call
    and none holding variables (a method that runs part of the model sees
    the rest in its variables). Inside an NNX model (``prefix``), the NNX
    wrapper, which sees both halves, checks."""
    if self.rules.paths and not self.prefix:
      warn_unmatched(self.rules, set(interceptor.seen) | variable_paths(self.variables))

  @nn.nowrap
  def init_with_output(self, rngs, *args, **kwargs):
    return self._run("init_with_output", rngs, *args, **kwargs)

  @nn.nowrap
  def apply(self, variables, *args, fp8=None, **kwargs):
    """`flax.linen.Module.apply` under the rules. ``fp8``: an
    `jmp_lite.fp8.Fp8State` from training, whose scales the fp8 matmuls then
    run with (inference; `jmp_lite.fp8.forward`)."""
    try:
      if fp8 is not None:
        from jmp_lite._jaxpr.passes import instrument as _instrument  # pylint: disable=g-import-not-at-top
        return _instrument.forward(lambda v, *a, **k: self._run("apply", v, *a, **k),
                                   fp8, variables, *args, **kwargs)
      warn_if_fp8_unplaced(self.rules)
      return self._run("apply", variables, *args, **kwargs)
    except TypeError as e:
      hint = state_dtype_hint(e, variables, self.rules.policy)
      if hint is None:
        raise
      raise TypeError(f"{e}\n\n{hint}") from e

  @nn.nowrap
  def _run(self, entry: str, *args, **kwargs):
    """`nn.Module`'s ``entry`` (``apply``...) of the wrapper: autocast whole
    (O1), through the engine (a half compute dtype somewhere), or as it is.
    (Not ``method``: that is the keyword ``apply`` forwards.)"""
    kwargs = _forward_method(kwargs)
    policy = self.rules.policy
    if policy.autocast_dtype is not None:
      run = _linen_autocast(policy, entry)
    elif needs_rewrite(self.rules):
      run = _linen_engine(entry, policy.reduce_dtype)
    else:
      run = getattr(nn.Module, entry)
    return run(self, *args, **kwargs)


@dataclasses.dataclass(frozen=True)
class _Forward:
  """``method=`` of the wrapped model, run under the wrapper's rules.

  Frozen, so equal methods make equal cache keys for the engine.
  """
  method: Any  # a method name, or a function taking the model first

  def __call__(self, wrapper, *args, **kwargs):
    return wrapper.run_method(self.method, *args, **kwargs)


def _forward_method(kwargs):
  """Points ``init``/``apply``'s ``method=`` at the wrapped model's method."""
  method = kwargs.get("method")
  if method is None or method == "__call__" or isinstance(method, _Forward):
    return kwargs
  if inspect.ismethod(method) and isinstance(method.__self__, nn.Module):
    method = method.__func__  # `model.encode`: the function, on our model
  return {**kwargs, "method": _Forward(method)}


@functools.cache
def _linen_engine(method: str, reduce_dtype):
  """The engine's rewrite of ``init_with_output`` or ``apply``.

  ``apply`` is cached per (wrapper, argument structure) inside: the wrapper
  is a static argument (Linen modules hash by value), so repeated eager calls
  run one compiled step instead of tracing again. ``init_with_output`` is not:
  called eagerly it runs equation by equation, as the plain model's ``init``
  does, so that the initialisers' arithmetic is not fused into one
  computation (where XLA:GPU contracts multiply-adds into FMAs and the
  parameters differ from the model's in the last bit).
  """
  fun = getattr(nn.Module, method)
  return _engine.accumulate(lambda m, *a, **k: fun(m, *a, **k),
                            reduce_dtype=reduce_dtype, cache=method == "apply")


@functools.cache
def _linen_autocast(policy: Policy, method: str):
  """Op-level autocast (O1) of ``init_with_output`` or ``apply``, per policy."""
  from jmp_lite.autocasting import autocast  # pylint: disable=g-import-not-at-top
  fun = getattr(nn.Module, method)
  return autocast(lambda m, *a, **k: fun(m, *a, **k), policy)
