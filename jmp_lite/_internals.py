"""Every use of JAX internals in jmp_lite, each with what it relies on.

The rest of the library uses JAX's public API only. What lives here is what a
precision rewrite cannot do without: defining primitives (their JVP, transpose,
batching and lowering rules), editing jaxpr equations in place, the parameter
names of higher-order primitives, and the user frames of a source location.
`tests/test_internals.py` checks each item against the installed JAX, and fails
when JAX has a higher-order primitive this module does not know.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Callable

import jax
import jax.extend as jex
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir

core = jex.core
Primitive = jex.core.Primitive
# `jax.extend.core.DropVar` from JAX 0.10 on; JAX 0.9 has it in `jax.core` only
# (where 0.10 deprecates it).
DropVar = getattr(jex.core, "DropVar", None) or jax.core.DropVar

# --- Defining primitives ------------------------------------------------------
# The protocol of "Writing custom JAX primitives" (JAX docs): rule tables in
# `jax.interpreters.{ad,batching,mlir}`, which JAX re-exports for this purpose.


def abstract_eval(prim, *avals, **params):
  """``prim``'s output aval and effects at ``avals``.

  Relies on `Primitive.abstract_eval` returning ``(aval, effects)`` for
  single-result primitives (the rule `def_abstract_eval` installs does).
  """
  return prim.abstract_eval(*avals, **params)


def define_bilinear(prim, lhs_transpose, rhs_transpose) -> None:
  """JVP ``prim(dx, y) + prim(x, dy)``; transposes ``rule(ct, x, y, **params)``.

  Relies on `jax.interpreters.ad.defbilinear`; the rules read only ``x.aval``
  (``x`` is an undefined primal or a gradient accumulator).
  """
  ad.defbilinear(prim, lhs_transpose, rhs_transpose)


def define_batching(prim, rule) -> None:
  """``rule(args, dims, **params) -> (out, out_dim)`` (dims: int or None).

  Relies on the `jax.interpreters.batching.primitive_batchers` table, whose
  rules see unbatched dimensions as None.
  """
  batching.primitive_batchers[prim] = rule


def define_lowering(prim, fun: Callable[..., Any], platform=None) -> None:
  """Lowers ``prim`` by tracing ``fun(*args, **params)`` (for ``platform``).

  Relies on `jax.interpreters.mlir.lower_fun` and `register_lowering`: a rule
  for one platform wins over the default one, and a computation lowered for
  several platforms gets a per-platform switch (as `lax.platform_dependent`).
  """
  mlir.register_lowering(prim, mlir.lower_fun(fun, multiple_results=False),
                         platform=platform)


def define_partitioned_lowering(prim, fun: Callable[..., Any], platform) -> None:
  """Like `define_lowering`, with ``fun(*args, partitioned=..., **params)``.

  ``partitioned`` says whether XLA's SPMD partitioner will split the
  computation across devices on dimensions the program did not make manual
  (``jit`` over several devices). Relies on the lowering context's
  ``module_context.axis_context``: a ``ShardingContext`` with
  ``num_devices``, or (inside ``shard_map``) an ``SPMDAxisContext`` with a
  ``mesh`` and its ``manual_axes``. Anything else is one device.
  """
  def rule(ctx, *args, **params):
    axes = ctx.module_context.axis_context
    if hasattr(axes, "num_devices"):
      partitioned = axes.num_devices > 1
    elif hasattr(axes, "manual_axes") and hasattr(axes, "mesh"):
      partitioned = any(size > 1 for name, size in axes.mesh.shape.items()
                        if name not in axes.manual_axes)
    else:
      partitioned = False
    lowered = mlir.lower_fun(functools.partial(fun, partitioned=partitioned),
                             multiple_results=False)
    return lowered(ctx, *args, **params)
  mlir.register_lowering(prim, rule, platform=platform)


def define_remat_as(prim, as_base: Callable[[dict], tuple[Any, dict]]) -> None:
  """Remat policies decide about ``prim`` as about the op it stands for.

  ``jax.checkpoint(f, policy=...)`` asks ``policy(prim, *avals, **params)``
  about each equation of ``f`` whose inputs are known; JAX's own policies
  test ``prim is dot_general_p`` (``dots_saveable`` and its kin in
  jax/_src/ad_checkpoint.py). The policy is asked about ``as_base(params) ->
  (base_prim, base_params)`` instead, wherever the ``checkpoint`` is: outside
  a wrapped function as well as inside it.

  Relies on `partial_eval.partial_eval_jaxpr_custom_rules`, the table remat's
  partial evaluation consults before its first-order default, with rules
  ``rule(saveable, unks_in, inst_in, eqn) -> (known_eqn, staged_eqn,
  unks_out, inst_out, residuals)``, and on `ensure_enum`, `SaveableType` and
  `Offloadable`. The rule transcribes that default (the first-order branch
  of `_partial_eval_jaxpr_custom_cached` in
  jax/_src/interpreters/partial_eval.py, JAX 0.10.2), but for offloading:
  a rule returns one equation each side and cannot add the two copies an
  offload needs, so an ``Offloadable`` answer recomputes, with a warning.
  """
  from jax._src.interpreters import partial_eval as pe  # pylint: disable=g-import-not-at-top

  def rule(saveable, unks_in, inst_in, eqn):
    n = len(eqn.outvars)
    # Known inputs the staged (backward) copy reads become residuals.
    needed = [v for v, inst in zip(eqn.invars, inst_in)
              if not inst and not isinstance(v, core.Literal)]
    if any(unks_in):
      return None, eqn, [True] * n, [True] * n, needed
    base, params = as_base(eqn.params)
    policy = pe.ensure_enum(saveable(base, *[v.aval for v in eqn.invars],
                                     **params))
    if eqn.effects or isinstance(policy, pe.SaveableType):
      return eqn, None, [False] * n, [False] * n, []
    if isinstance(policy, pe.Offloadable):
      import warnings  # pylint: disable=g-import-not-at-top
      warnings.warn(
          f"the remat policy asks to offload a {base.name} that jmp_lite "
          f"computes as {prim.name}; it is recomputed instead (offloading "
          "the engine's matmuls is not supported)", UserWarning, stacklevel=2)
    return eqn, eqn, [False] * n, [True] * n, needed

  pe.partial_eval_jaxpr_custom_rules[prim] = rule
  _OWN_REMAT_RULES.add(prim.name)


# Primitives of jmp_lite given a remat rule above: first-order, not counted by
# `higher_order_primitives`.
_OWN_REMAT_RULES: set[str] = set()


def base_transpose(prim):
  """JAX's transpose rule of ``prim``: ``rule(ct, x, y, **params)``.

  Relies on `jax.interpreters.ad.primitive_transposes`; an operand that is a
  gradient accumulator (``jax.grad``'s newer path) is passed to it as an
  `UndefinedPrimal` of the same aval, which the rule reads ``.aval`` from.
  """
  rule = ad.primitive_transposes[prim]

  def transpose(ct, x, y, **params):
    x = ad.UndefinedPrimal(x.aval) if hasattr(x, "aval") and not isinstance(
        x, jax.Array) and not ad.is_undefined_primal(x) else x
    y = ad.UndefinedPrimal(y.aval) if hasattr(y, "aval") and not isinstance(
        y, jax.Array) and not ad.is_undefined_primal(y) else y
    return rule(ct, x, y, **params)
  return transpose


# --- Editing jaxprs -----------------------------------------------------------
# `JaxprEqn.replace` and `Jaxpr.replace` (dataclass-style copies): a rewrite that
# keeps every input and output type swaps equations without re-tracing.


def replace_eqn(eqn, primitive, params):
  return eqn.replace(primitive=primitive, params=params)


def replace_eqns(jaxpr, eqns):
  return jaxpr.replace(eqns=eqns)


def rewire(eqn, invars, outvars):
  """``eqn`` reading ``invars`` and writing ``outvars`` (same avals)."""
  return eqn.replace(invars=list(invars), outvars=list(outvars))


def new_var(aval):
  """A fresh jaxpr variable of type ``aval``.

  Relies on `jax.extend.core.Var` taking the aval as its one required
  argument (JAX 0.7 onwards; older versions took a suffix first).
  """
  return core.Var(aval)


def closed(jaxpr, consts):
  return core.ClosedJaxpr(jaxpr, consts)


@contextlib.contextmanager
def eqn_context(eqn):
  """Re-creates ``eqn``'s source line, name stack and compute context.

  Relies on `JaxprEqn.source_info` (traceback, name_stack) and `JaxprEqn.ctx`
  (its ``manager`` re-enters the equation's compute context).
  """
  info = jex.source_info_util
  name_stack = info.current_name_stack() + eqn.source_info.name_stack
  with info.user_context(eqn.source_info.traceback, name_stack=name_stack), \
      eqn.ctx.manager:
    yield


def eval_jaxpr(jaxpr, consts, args, eval_eqn) -> list[Any]:
  """Evaluates ``jaxpr`` on ``args``, computing each equation with ``eval_eqn``.

  ``eval_eqn(eqn, invals)`` returns what ``eqn``'s bind would. Each equation
  runs in its own source and name-stack context (`eqn_context`), so rewritten
  equations keep the user's line for `jmp_lite.audit`. Relies on `Literal.val`
  and `DropVar`.
  """
  env: dict[Any, Any] = {}

  def read(v):
    return v.val if isinstance(v, core.Literal) else env[v]

  for v, x in zip(jaxpr.constvars, consts):
    env[v] = x
  for v, x in zip(jaxpr.invars, args):
    env[v] = x
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    with eqn_context(eqn):
      outs = eval_eqn(eqn, invals)
    if not eqn.primitive.multiple_results:
      outs = [outs]
    for v, x in zip(eqn.outvars, outs):
      if not isinstance(v, DropVar):
        env[v] = x
  return [read(v) for v in jaxpr.outvars]


def shard_map_call(eqn, body: Callable[..., Any], args):
  """Runs ``body`` per shard as ``eqn`` (a ``shard_map``) runs its jaxpr.

  Relies on the params `jax.shard_map` records: ``mesh``, ``in_specs``,
  ``out_specs``, ``check_vma`` and ``newly_manual_axes`` (its ``axis_names``).
  """
  p = eqn.params
  kwargs = dict(mesh=p["mesh"], in_specs=p["in_specs"],
                out_specs=p["out_specs"], check_vma=p["check_vma"])
  if "newly_manual_axes" in p:
    kwargs["axis_names"] = p["newly_manual_axes"]
  return list(jax.shard_map(lambda *a: tuple(body(*a)), **kwargs)(*args))


def bind(eqn, vals, params=None):
  """Binds ``eqn``'s primitive to ``vals`` (with ``params``, default its own).

  Relies on `Primitive.get_bind_params`, which turns a jaxpr equation's params
  back into ``bind`` arguments (closed jaxprs into thunks, for some
  primitives). Its return type changed in jax 0.9.2 (a tuple of subfuns and
  params before, params only since); both are accepted.
  """
  params = eqn.params if params is None else params
  bind_params = eqn.primitive.get_bind_params(params)
  if isinstance(bind_params, tuple):  # jax < 0.9.2: (subfuns, params).
    subfuns, bind_params = bind_params
    return eqn.primitive.bind(*subfuns, *vals, **bind_params)
  return eqn.primitive.bind(*vals, **bind_params)


def constvars_to_invars(closed_jaxpr):
  """A const-free jaxpr taking ``closed_jaxpr``'s constants as leading inputs.

  Relies on `partial_eval.convert_constvars_jaxpr`.
  """
  from jax._src.interpreters import partial_eval as pe  # pylint: disable=g-import-not-at-top
  return pe.convert_constvars_jaxpr(closed_jaxpr.jaxpr)


def invars_to_constvars(jaxpr, n: int):
  """``jaxpr`` with its first ``n`` inputs turned into constants.

  Relies on `partial_eval.convert_invars_to_constvars` (the form a custom
  VJP's forward thunk returns). JAX 0.11 removed it: there a jaxpr's
  constants are its leading inputs (`core.eval_jaxpr` binds ``[*consts,
  *args]`` to ``all_invars``, jax/_src/core.py at commit cec06d1), so the
  first ``n`` inputs already take them and ``jaxpr`` is returned as it is.
  """
  from jax._src.interpreters import partial_eval as pe  # pylint: disable=g-import-not-at-top
  convert = getattr(pe, "convert_invars_to_constvars", None)
  return jaxpr if convert is None else convert(jaxpr, n)


def convert_weak(x, dtype):
  """``x`` in ``dtype``, weakly typed (as a Python scalar would be).

  Relies on `jax._src.lax.lax._convert_element_type`'s ``weak_type`` argument;
  the public `lax.convert_element_type` always makes strong types.
  """
  from jax._src.lax import lax as lax_internal  # pylint: disable=g-import-not-at-top
  return lax_internal._convert_element_type(x, dtype, weak_type=True)  # pylint: disable=protected-access


def user_frames(eqn):
  """The frames of ``eqn``'s traceback outside JAX, innermost first.

  Relies on `jax._src.source_info_util.user_frames` and
  `SourceInfo.traceback`.
  """
  from jax._src import source_info_util  # pylint: disable=g-import-not-at-top
  return list(source_info_util.user_frames(eqn.source_info.traceback))


# --- How a traced value was computed ------------------------------------------
# For `jmp_lite._provenance`, which finds a gradient JAX's autodiff already
# summed across devices, even after later per-device operations.


def producer(x):
  """``(eqn, output_index)`` of the equation that computed ``x``, or None.

  None for anything but a value traced to a jaxpr (``jit``, ``shard_map``)
  that an equation of the current trace produced (arguments, constants).
  Relies on `DynamicJaxprTracer.parent`, the `TracingEqn` that bound it, with
  ``in_tracers``, ``outvars``, ``primitive``, ``params`` and ``source_info``
  like a `JaxprEqn`, and on ``DynamicJaxprTracer.val`` being its out var.
  """
  eqn = getattr(x, "parent", None)
  if eqn is None or not hasattr(eqn, "in_tracers"):
    return None
  val = getattr(x, "val", None)
  for i, v in enumerate(eqn.outvars):
    if v is val:
      return eqn, i
  return None


def eqn_inputs(eqn) -> list[Any]:
  """The operands of a traced equation (tracers) or a jaxpr equation (vars)."""
  return list(eqn.in_tracers) if hasattr(eqn, "in_tracers") else list(eqn.invars)


def transposed(eqn) -> bool:
  """Whether autodiff's transposition (the backward pass) emitted ``eqn``.

  Relies on `jax.interpreters.ad.backward_pass` binding every transposed
  equation under ``source_info_util.transform_name_stack("transpose")``, so
  that its ``source_info.name_stack`` prints as ``transpose(jvp(...))``.
  """
  return "transpose(" in str(eqn.source_info.name_stack)


# --- Higher-order primitives --------------------------------------------------
# Parameters holding functions rather than jaxprs, by primitive: what each
# returns when called, so that a rewrite can reach inside.

# custom_jvp_call: `jvp_jaxpr_fun.call_wrapped(*zeros) -> (jaxpr, consts,
# out_zeros)`; custom_vjp_call: `fwd_jaxpr_thunk.call_wrapped(*zeros) ->
# (jaxpr, consts)` and `bwd.call_wrapped(*residuals, *cotangents) -> cts`.
JVP_THUNK = ("custom_jvp_call", "jvp_jaxpr_fun")
FWD_THUNK = ("custom_vjp_call", "fwd_jaxpr_thunk")
BWD_FUN = ("custom_vjp_call", "bwd")

# How a loop's operands split. `while`: ``cond_nconsts`` constants of the
# condition, ``body_nconsts`` of the body, then the carry (every JAX this
# library has met). `scan`: constants, carry, then the scanned ``xs``, given
# by ``num_consts`` and ``num_carry`` up to JAX 0.10, and from JAX 0.11 by
# one flat tree ``ft_in`` of those three groups (`jax._src.flattree`, read in
# jax/_src/lax/control_flow/loops.py at commit cec06d1 of jax-ml/jax). Every
# reader goes through these two functions, so a new layout is met here once.
# Primitives whose body takes leading constants counted by ``num_consts``:
# `custom_jvp_call`, `custom_vjp_call`, `remat_opt` (unchanged in JAX 0.11).


def scan_split(params) -> tuple[int, int]:
  """``(constants, carry)``: how many of a scan's operands are which."""
  if "num_consts" in params:
    return int(params["num_consts"]), int(params["num_carry"])
  if "ft_in" in params:
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)
  raise NotImplementedError(
      "jmp_lite does not know how this JAX's scan splits its operands "
      f"(params {sorted(params)}); see jmp_lite/_internals.py")


def with_more_consts(name: str, params, n: int) -> dict:
  """``params`` of a ``name`` equation whose body takes ``n`` more leading
  constants (constants a rewrite of the body hoisted)."""
  if "num_consts" in params:
    return {**params, "num_consts": params["num_consts"] + n}
  if name == "scan" and "ft_in" in params:
    from jax._src import flattree as ft  # pylint: disable=g-import-not-at-top
    consts, carry, xs = params["ft_in"].unpack()
    return {**params, "ft_in": ft.pack((ft.nones(len(consts) + n), carry, xs))}
  raise NotImplementedError(
      f"jmp_lite does not know how this JAX's {name} counts its constants "
      f"(params {sorted(params)}); see jmp_lite/_internals.py")


# Primitives that carry jaxprs or functions in their params, as of the
# installed JAX. The rewrite handles a jaxpr in any primitive's params
# generically (rewritten in place, types unchanged); the functions it reaches
# into are the thunks above. `higher_order_primitives` finds the primitives that
# register the rules only higher-order primitives need, and the inventory test
# fails when one is missing here: it must be looked at before it is trusted.
KNOWN_HIGHER_ORDER = frozenset({
    "call", "closed_call", "core_call", "jit", "pjit", "remat2", "remat_opt",
    "scan", "while", "cond", "custom_jvp_call", "custom_vjp_call", "custom_lin",
    "shard_map", "xla_pmap", "linear_call", "custom_transpose_call",
    "call_hi_primitive", "core_map", "run_state"})
# First-order primitives with one of those rules (typechecks of dynamic
# shapes, references and printing).
_FIRST_ORDER_WITH_RULES = frozenset({
    "broadcast_in_dim", "dynamic_slice", "iota", "reshape", "addupdate", "get",
    "swap", "new_ref", "free_ref", "debug_print", "debug_callback"})


def higher_order_primitives() -> frozenset[str]:
  """Names of the primitives JAX gives higher-order rules, loaded so far.

  Relies on `partial_eval.dce_rules`, `partial_eval.partial_eval_jaxpr_custom_
  rules` and `core.custom_typechecks`, tables JAX fills for primitives whose
  params hold jaxprs, and on the `CallPrimitive` class where it exists.
  """
  from jax._src import core as core_internal  # pylint: disable=g-import-not-at-top
  from jax._src.interpreters import partial_eval as pe  # pylint: disable=g-import-not-at-top
  names = {p.name for table in (pe.dce_rules, pe.partial_eval_jaxpr_custom_rules,
                                core_internal.custom_typechecks)
           for p in table}
  # JAX 0.11 dropped the class; its call primitives have the rules above.
  call = getattr(core_internal, "CallPrimitive", None)
  if call is not None:
    names |= {p.name for p in all_primitives().values() if isinstance(p, call)}
  return frozenset(names - _FIRST_ORDER_WITH_RULES - _OWN_REMAT_RULES)


def wrap_fun(fun: Callable[..., Any], like) -> Any:
  """``fun`` as a `WrappedFun` with the debug info of ``like``."""
  return jex.linear_util.wrap_init(fun, debug_info=like.debug_info)


def is_wrapped_fun(x) -> bool:
  return isinstance(x, jex.linear_util.WrappedFun)


def all_primitives() -> dict[str, Any]:
  """Every `Primitive` instance defined in the JAX modules imported so far.

  Relies on primitives being module-level globals of ``jax._src`` modules.
  """
  found = {}
  for name, module in list(sys.modules.items()):
    if not (name == "jax" or name.startswith(("jax.", "jaxlib."))):
      continue
    for value in list(vars(module).values()):
      if isinstance(value, Primitive):
        found.setdefault(value.name, value)
  return found


# --- Flax's and Python's private API ------------------------------------------


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
