"""Reading, editing and evaluating jaxprs, and the parameters of higher-order
primitives, through JAX's internals: each function says what it relies on.

`jmp_lite._jaxpr.internals` re-exports everything here.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np

from jmp_lite._jaxpr.internals import rules

core = jex.core
Primitive = jex.core.Primitive
# `jax.extend.core.DropVar` from JAX 0.10 on; JAX 0.9 has it in `jax.core` only
# (where 0.10 deprecates it).
DropVar = getattr(jex.core, "DropVar", None) or jax.core.DropVar


# --- Editing jaxprs -----------------------------------------------------------
# `JaxprEqn.replace` and `Jaxpr.replace` (dataclass-style copies): a rewrite that
# keeps every input and output type swaps equations without re-tracing.


def is_tracer(x) -> bool:
  """Whether ``x`` is a value being traced, not a concrete one. Relies on
  `jax.core.Tracer` being the class of every traced value (jax/core.py)."""
  return isinstance(x, jax.core.Tracer)


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


def explicit_sharding(aval):
  """``aval``'s sharding where it names a mesh axis (a mesh of explicit
  axes puts shardings in types), else None.

  Relies on `ShapedArray.sharding` (a `NamedSharding` over an abstract mesh,
  JAX 0.6 onwards), the same object `jax.typeof(x).sharding` returns.
  """
  sharding = getattr(aval, "sharding", None)
  spec = getattr(sharding, "spec", None)
  return sharding if spec and any(s is not None for s in spec) else None


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


def context_here(eqn):
  """A function that re-enters, later, the context ``eqn`` is evaluated in
  now (inside `eqn_context`): its source line, the name stack as it stands
  and its compute context. For a value traced lazily, when first read,
  under whatever context its reader runs in. Relies on what `eqn_context`
  relies on."""
  info = jex.source_info_util
  name_stack = info.current_name_stack()

  @contextlib.contextmanager
  def again():
    with info.user_context(eqn.source_info.traceback, name_stack=name_stack), \
        eqn.ctx.manager:
      yield
  return again


def eval_jaxpr(jaxpr, consts, args, eval_eqn) -> list[Any]:
  """Evaluates ``jaxpr`` on ``args``, computing each equation with ``eval_eqn``.

  ``eval_eqn(eqn, invals)`` returns what ``eqn``'s bind would. Each equation
  runs in its own source and name-stack context (`eqn_context`), so rewritten
  equations keep the user's line for `jmp_lite.audit`. Relies on `Literal.val`
  and `DropVar`. An output the jaxpr holds as a constant comes back as the
  `jax.Array` that ``jax.jit`` would return (`as_output`).
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
  return [as_output(read(v), v.aval) for v in jaxpr.outvars]


def as_output(x, aval):
  """``x`` as a program output: a `jax.Array` (or tracer) of type ``aval``.

  A literal output (``jnp.array(0, jnp.uint32)`` as a Flax cache index) is
  JAX's own subclass of a NumPy array or a Python scalar (`Literal.val`, also
  what `jax.extend.core.jaxpr_as_fun` returns for it), with no ``sharding``
  or ``block_until_ready``, and a second jit cache entry wherever it is
  passed in place of an array. Made an array of ``aval``'s dtype and weak
  type, as ``jax.jit`` returns it.
  """
  if isinstance(x, jax.Array) or not isinstance(
      x, (np.ndarray, np.generic, bool, int, float, complex)):
    return x
  if getattr(aval, "weak_type", False):
    return convert_weak(np.asarray(x), aval.dtype)
  return jnp.asarray(x, dtype=aval.dtype)


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
# For `jmp_lite._jaxpr.passes.provenance`, which finds a gradient JAX's autodiff already
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
      f"(params {sorted(params)}); see jmp_lite/_jaxpr/internals/")


def with_more_consts(name: str, params, n: int) -> dict:
  """``params`` of a ``name`` equation whose body takes ``n`` more leading
  constants (constants a rewrite of the body hoisted).

  A ``custom_vjp_call``'s forward rule may return some of its operands as
  residuals without computing them: ``out_trees()`` returns ``(out_tree,
  res_tree, input_fwds)``, whose ``input_fwds`` index the equation's
  operands, and the JVP rule reads them as ``primals_in[f]``
  (jax/_src/interpreters/ad.py, ``process_custom_vjp_call``, JAX 0.10.2).
  Constants put in front move every operand by ``n``, so those indices move
  too; unshifted, the residual was a hoisted constant and the gradient wrong.
  """
  if "num_consts" in params:
    params = {**params, "num_consts": params["num_consts"] + n}
    if "linear" in params:  # scan up to JAX 0.9: one flag per operand
      params["linear"] = (False,) * n + tuple(params["linear"])
    if name == "custom_vjp_call" and n and "out_trees" in params:
      params["out_trees"] = _forwards_shifted(params["out_trees"], n)
    return params
  if name == "scan" and "ft_in" in params:
    from jax._src import flattree as ft  # pylint: disable=g-import-not-at-top
    consts, carry, xs = params["ft_in"].unpack()
    return {**params, "ft_in": ft.pack((ft.nones(len(consts) + n), carry, xs))}
  raise NotImplementedError(
      f"jmp_lite does not know how this JAX's {name} counts its constants "
      f"(params {sorted(params)}); see jmp_lite/_jaxpr/internals/")


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
  return frozenset(names - _FIRST_ORDER_WITH_RULES - rules.OWN_REMAT_RULES)


def _forwards_shifted(out_trees: Callable[[], tuple], n: int) -> Callable[[], tuple]:
  """``out_trees`` (see `with_more_consts`) with its operand indices moved by ``n``."""
  def shifted():
    trees = out_trees()
    if len(trees) != 3:  # no forwarded residuals in this JAX
      return trees
    out_tree, res_tree, fwds = trees
    return out_tree, res_tree, [None if f is None else f + n for f in fwds]
  return shifted


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


