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
rule matches use ``policy``. `policy_map` lists the outcome. A path rule
that matches no module of the model (a misspelt path) is reported with an
`UnmatchedRuleWarning` naming the closest paths: for Linen when the model
is traced (``init``/``apply``: the modules it calls and those holding
variables), for NNX by `wrap`.
"""

from __future__ import annotations

from collections.abc import Mapping
import reprlib
from typing import Optional

import flax.linen as nn
import jax
from flax import nnx

from jmp_lite import _struct
from jmp_lite._flax_rules import default_rules
from jmp_lite._flax_rules import Rules
from jmp_lite._flax_rules import UnmatchedRuleWarning
from jmp_lite._flax_rules import variable_paths
from jmp_lite._flax_rules import warn_unmatched
from jmp_lite._linen import _LinenInterceptor
from jmp_lite._linen import _LinenWrapper
from jmp_lite._nnx import NnxWrapper
from jmp_lite.policy import Policy

# Flax is loaded: jmp_lite's states serialise with flax.serialization too.
_struct.register_serialization()

__all__ = ("wrap", "policy_map", "default_rules", "UnmatchedRuleWarning")

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
  if isinstance(module, (_LinenWrapper, NnxWrapper)):
    raise ValueError(
        f"wrap: the model is already wrapped (policy {module.rules.policy}); "
        "wrap the model itself, wrap(wrapped.module, ...), with the rules it "
        "should run under.")
  if isinstance(module, nn.Module):
    return _LinenWrapper(module, parsed)
  if isinstance(module, nnx.Module):
    return NnxWrapper(module, parsed)
  # A short repr: an nnx.State or an optimizer prints its every array.
  raise TypeError(
      f"wrap expects a flax.linen.Module or a flax.nnx.Module, got "
      f"{reprlib.repr(module)} ({type(module).__module__}.{type(module).__qualname__}).")


def policy_map(wrapped, *args, rngs=None, **kwargs) -> dict[str, Policy]:
  """Which policy applies to which module of a wrapped model.

  Args:
    wrapped: a model returned by `wrap`.
    *args: example inputs (only shapes and dtypes are used: the model is
      traced with `jax.eval_shape`). Needed for Linen; for NNX, whose
      modules exist already, only to list the Linen modules held through
      `flax.nnx.bridge.ToNNX` (without inputs, such a model is one row).
    rngs: for Linen, the ``init`` RNGs (default: ``params`` and ``dropout``).
    **kwargs: keyword arguments of the model's ``__call__``, as ``*args``.

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
    del rngs
    return wrapped.policy_map(*args, **kwargs)
  if not isinstance(wrapped, _LinenWrapper):
    raise TypeError(
        f"policy_map expects a model returned by jmp_lite.flax.wrap, got "
        f"{wrapped!r} ({type(wrapped).__name__}).")
  if rngs is None:
    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
  record: dict[str, Policy] = {}
  interceptor = _LinenInterceptor(wrapped.rules, (), record)
  with nn.intercept_methods(interceptor):
    variables = jax.eval_shape(lambda: wrapped.module.init(rngs, *args, **kwargs))
  if wrapped.rules.paths:  # the listing is where a misspelt rule is looked for
    warn_unmatched(wrapped.rules, set(interceptor.seen) | variable_paths(variables))
  return record
