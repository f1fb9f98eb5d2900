"""Mixed-precision policies for unmodified Flax models, Linen and NNX.

`wrap` gives a model a `Policy` without editing the model's code:

* parameters are created and stored in ``param_dtype``;
* every module casts its floating inputs and its parameters to its own
  ``compute_dtype``, and hands its outputs back in its *caller's* compute dtype
  (the outermost module: in ``output_dtype``), so layers pass compute-dtype
  values to each other with no float32 round trips;
* every matrix multiply and convolution whose operands are 16-bit (or
  narrower) floats accumulates in float32 (``preferred_element_type``) and is
  rounded to the operand dtype once, in the forward and the backward pass;
* ``rules`` give other policies to module classes or module paths; by default
  LayerNorm, RMSNorm, BatchNorm and GroupNorm (Linen and NNX) run, and keep
  their statistics, in float32;
* other collections (``batch_stats``, RNG counters...) are never cast; state
  a module builds from what it computes (a decoding cache) is made in its
  compute dtype, as Flax's own modules of that dtype make it.

Design. The policy lives in the wrapper, never in a registry:

* Linen: the wrapper shares its scope with the model (`flax.linen.share_scope`,
  so the variables have the model's own layout) and calls it under
  `flax.linen.intercept_methods`. The interceptor, for each module method call,
  casts the arguments and runs the method on a clone of the module bound to a
  scope whose ``param`` creates parameters in ``param_dtype`` and reads them in
  ``compute_dtype``. This covers custom modules that call ``self.param``
  directly, not only layers with ``dtype``/``param_dtype`` attributes.
* NNX has no interception hook: the wrapper runs a throw-away copy of the
  module graph with the policies applied and writes the non-param state back
  (see `jmp_lite._nnx`); gradients come back in ``param_dtype``.
* Accumulation is the precision engine's (`jmp_lite.autocast` shares it):
  the call is traced once and each half-precision ``dot_general`` and
  ``conv_general_dilated`` becomes a primitive that accumulates in float32,
  wherever it sits: inside ``nn.scan``, ``nn.remat``, ``nn.vmap``,
  ``nnx.scan``, ``nnx.remat``, ``jax.checkpoint``, ``cond``, ``while`` and
  custom-derivative rules. The primitive's derivatives accumulate in float32
  too, so ``jax.grad``, ``jax.jvp``, ``jax.hessian`` and ``jax.vmap`` applied
  to the wrapped model all keep half x half -> float32 products. Injecting
  ``dot_general=`` into layers would miss ``jnp.einsum`` in attention
  (hard-coded in NNX) and matmuls in user code. The rewrite happens in the
  wrapper's own ``init``/``apply`` (Linen) or ``__call__`` (NNX): a Linen
  wrapper nested inside another module gets the casts, not the rewrite, so
  wrap the outermost model. Called eagerly, the rewritten call is compiled
  once per argument structure and cached.
* An op-level policy (``"O1"``: ``a=bf16``) applies `jmp_lite.autocast` to the
  whole call, with float32 parameters: matmuls in bfloat16 accumulating in
  float32, exp/log/normalisation in float32.

Dtypes. The policy is the authority: under `wrap`, a module's ``dtype`` and
``param_dtype`` fields (Linen dataclass fields, NNX attributes) that hold
``None`` or a floating dtype are replaced by the policy's compute and parameter
dtypes for that module, whatever the model's code passed
(``module_dtypes=True`` keeps the model's own). A carry (``(carry, x) ->
(carry, y)``, the form of ``nn.scan`` bodies and RNN cells) comes back in the
dtypes it came in, so a scan whose carry the model makes in float32 keeps it
in float32, as Flax's own bf16 cells do.

Rules. ``rules`` maps keys to policies (a `Policy` or a string for
`get_policy`). A key is a module class (matches its instances and its
subclasses' instances) or a regular expression matched with `re.fullmatch`
against the module path relative to the wrapped model, its parts joined by
``/`` (``"encoder/layers_0/attention"``; the wrapped model itself is ``""``).
The most specific matching rule wins:

1. a path rule beats any class rule;
2. among path rules, the pattern with more literal characters (characters
   that are not regex syntax) wins, then the later one in ``rules``;
3. among class rules, the most derived class wins.

User rules are added to the defaults: a user rule for ``nn.LayerNorm``
replaces that default, and ``default_rules=False`` drops them all. Modules no
rule matches use ``policy``. `policy_map` lists the outcome.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Mapping
from typing import Any, Optional

import flax.linen as nn
import jax
import numpy as np
from flax import nnx
from flax.core.scope import Scope

from jmp_lite import _dtypes
from jmp_lite._flax_rules import default_rules
from jmp_lite._flax_rules import dtype_overrides
from jmp_lite._flax_rules import fp8_scope
from jmp_lite._flax_rules import keep_carry
from jmp_lite._flax_rules import needs_rewrite
from jmp_lite._flax_rules import path_str
from jmp_lite._flax_rules import Rules
from jmp_lite._flax_rules import tap_and_cast
from jmp_lite._jaxpr import internals as _internals
from jmp_lite._jaxpr import module_scales as _module_scales
from jmp_lite._jaxpr.passes import engine as _engine
from jmp_lite._jaxpr import probes as _probes
from jmp_lite._nnx import NnxWrapper
from jmp_lite.policy import Policy

__all__ = ("wrap", "policy_map", "default_rules")

# Linen -------------------------------------------------------------------------


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

  def __init__(self, rules: Rules, root: tuple, record: Optional[dict] = None):
    self.rules = rules
    self.root = root
    self.record = record
    self.stack: list[Optional[Policy]] = []

  def __call__(self, next_fun, args, kwargs, context):
    module = context.module
    if (context.method_name == "setup"
        or isinstance(module.scope, _PolicyScope)
        or (self.stack and self.stack[-1] is None)):
      return next_fun(*args, **kwargs)
    caller = self.stack[-1] if self.stack else None
    if isinstance(module, _LinenWrapper):  # a nested wrapper has its own rules
      self.stack.append(None)
      try:
        out = next_fun(*args, **kwargs)
      finally:
        self.stack.pop()
      return caller.cast_to_compute(out) if caller else out
    path = path_str(module.path[len(self.root):])
    policy = self.rules.resolve(type(module), path)
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

  def _run_module(self, next_fun, args, kwargs, context, module, path, policy,
                  caller):
    args, kwargs = policy.cast_to_compute((args, kwargs))
    method = getattr(type(module), context.method_name, None)
    self.stack.append(policy)
    try:
      if method is None:  # a function passed as `method=`: cast only.
        out = next_fun(*args, **kwargs)
      else:
        # Not a deep clone: a submodule passed in as an attribute (a shared
        # embedding, nn.RNN's cell) stays the model's, where its variables are.
        clone = _internals.shallow_clone(module, parent=_PolicyScope(module.scope, policy, path),
                                         **self.dtypes(module, policy))
        run = getattr(clone, context.method_name)
        if _lifted(method, context):
          run = functools.partial(nn.module.wrap_method_once(context.orig_method.func), clone)
        with fp8_scope(self.rules, policy, path):
          out = run(*args, **kwargs)
    finally:
      self.stack.pop()
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

  def setup(self):
    nn.share_scope(self, self.module)

  def __call__(self, *args, **kwargs):
    with nn.intercept_methods(_LinenInterceptor(self.rules, self.scope.path)):
      return self.module(*args, **kwargs)

  def run_method(self, method, *args, **kwargs):
    """The model's ``method`` (a name, or a function of the model) under the
    rules: what ``apply(..., method=method)`` runs. A module method, so that
    ``setup`` has shared the model's scope first."""
    with nn.intercept_methods(_LinenInterceptor(self.rules, self.scope.path)):
      if isinstance(method, str):
        return getattr(self.module, method)(*args, **kwargs)
      return method(self.module, *args, **kwargs)

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
      return self._run("apply", variables, *args, **kwargs)
    except TypeError as e:
      hint = _state_dtype_hint(e, variables, self.rules.policy)
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


def _state_dtype_hint(error, variables, policy: Policy) -> Optional[str]:
  """What to do when a model's own state meets a value computed under the
  policy in an operation that takes one dtype (``lax.dynamic_update_slice``
  writing a decoding cache): None when the error is another, or no
  collection but the parameters holds a float dtype other than the
  compute dtype."""
  if "requires arguments to have the same dtypes" not in str(error):
    return None
  compute = np.dtype(policy.compute_dtype)
  found = {}
  if isinstance(variables, Mapping):
    for collection, tree in variables.items():
      if collection == "params":
        continue
      for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if _dtypes.is_floating(leaf) and np.dtype(leaf.dtype) != compute:
          found.setdefault(collection, (jax.tree_util.keystr(path), leaf.dtype))
  if not found:
    return None
  where = "; ".join(f"{c!r}: {p} is {d}" for c, (p, d) in found.items())
  return (
      f"jmp_lite.flax.wrap: the variables passed to apply hold floats other "
      f"than the compute dtype {compute} outside 'params' ({where}). Under "
      f"wrap a module computes in its policy's compute dtype, and state it "
      f"builds from what it computes (a decoding cache's keys and values) is "
      f"made in that dtype by the wrapped model's init, as Flax's own "
      f"{compute} modules make it. Make that collection with the wrapped "
      f"model's init (wrapped.init(...)[collection]) or cast it to {compute}.")


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


# Public API --------------------------------------------------------------------


def wrap(module, policy: Policy | str, *, rules: Optional[Mapping] = None,
         default_rules: bool = True, module_dtypes: bool = False):
  """Runs a Flax model under a mixed-precision policy, with no change to its code.

  See the module docstring for what the policy does and how rules are chosen.

  Args:
    module: a `flax.linen.Module` or a `flax.nnx.Module`.
    policy: a `Policy`, or a string `get_policy` parses (``"p=f32,c=bf16,o=f32"``).
    rules: optional mapping from module classes or path regexes to policies
      (`Policy` or string), e.g. ``{"encoder/.*/attention": "f32"}``.
    default_rules: whether to add `default_rules` (normalisation in float32).
    module_dtypes: whether a module's own ``dtype``/``param_dtype`` fields
      (``nn.Dense(..., dtype=jnp.float32)``, a config's default) win over the
      policy. By default the policy (or the module's rule) decides, as a
      Keras mixed-precision policy overrides its layers' dtypes: published
      models pass ``dtype=float32`` to every layer, and honouring it would
      leave them in float32. To keep one module in float32, give it a rule.

  Returns:
    For Linen, a module with the same ``init``/``apply`` (variables keep the
    model's layout). For NNX, a module calling ``module``: it shares
    ``module``'s parameters when they are stored in the policy's
    ``param_dtype``; otherwise it holds a converted copy (`flax.nnx.clone`)
    and ``module`` is left as it was. Train the wrapper.

  Raises:
    TypeError: if ``module`` is not a Flax module, or a rule key or policy has
      the wrong type.
    ValueError: for an invalid regex or policy string, or a rule whose policy
      asks for op-level autocast (``"O1"`` applies to the whole model).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import jmp_lite.flax
    >>> model = jmp_lite.flax.wrap(nn.Dense(3), "p=f32,c=bf16,o=f32")
    >>> x = jnp.ones((2, 4))
    >>> variables = model.init(jax.random.key(0), x)
    >>> variables["params"]["kernel"].dtype, model.apply(variables, x).dtype
    (dtype('float32'), dtype('float32'))
  """
  parsed = Rules.create(policy, rules, default_rules, module_dtypes)
  inner = [p for _, p in parsed.classes] + [p for _, _, p in parsed.paths]
  if any(p.autocast_dtype is not None for p in inner):
    # Op-level autocast rewrites the whole traced call; a module's share of
    # it has no boundary in the jaxpr.
    raise ValueError(
        "Op-level autocast (O1) applies to a whole model: give it as wrap's "
        "policy, not in rules (got rules "
        f"{ {str(k): str(v) for k, v in (rules or {}).items()} }).")
  if isinstance(module, nn.Module):
    return _LinenWrapper(module, parsed)
  if isinstance(module, nnx.Module):
    return NnxWrapper(module, parsed)
  raise TypeError(
      f"wrap expects a flax.linen.Module or a flax.nnx.Module, got {module!r} "
      f"({type(module).__name__}).")


def policy_map(wrapped, *args, rngs=None, **kwargs) -> dict[str, Policy]:
  """Which policy applies to which module of a wrapped model.

  Args:
    wrapped: a model returned by `wrap`.
    *args: for Linen, example inputs (only shapes and dtypes are used: the
      model is traced with `jax.eval_shape`); ignored for NNX, whose modules
      exist already.
    rngs: for Linen, the ``init`` RNGs (default: ``params`` and ``dropout``).
    **kwargs: for Linen, keyword arguments of the model's ``__call__``.

  Returns:
    A dict from module path (``""`` for the model itself) to `Policy`, in
    call order (Linen) or graph order (NNX).

  Example:
    >>> import jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import jmp_lite.flax
    >>> class MLP(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return nn.Dense(2)(nn.LayerNorm()(x))
    >>> model = jmp_lite.flax.wrap(MLP(), "p=f32,c=bf16,o=f32")
    >>> {k: str(v) for k, v in jmp_lite.flax.policy_map(model, jnp.ones((1, 3))).items()}
    {'': 'p=f32,c=bf16,o=f32', 'LayerNorm_0': 'p=f32,c=f32,o=f32', 'Dense_0': 'p=f32,c=bf16,o=f32'}
  """
  if isinstance(wrapped, NnxWrapper):
    del args, rngs, kwargs
    return {path_str(path): policy
            for path, policy in wrapped._policies(wrapped.module).items()}  # pylint: disable=protected-access
  if not isinstance(wrapped, _LinenWrapper):
    raise TypeError(
        f"policy_map expects a model returned by jmp_lite.flax.wrap, got "
        f"{wrapped!r} ({type(wrapped).__name__}).")
  if rngs is None:
    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
  record: dict[str, Policy] = {}
  with nn.intercept_methods(_LinenInterceptor(wrapped.rules, (), record)):
    jax.eval_shape(lambda: wrapped.module.init(rngs, *args, **kwargs))
  return record
