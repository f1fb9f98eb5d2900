"""The precision engine: float32 accumulation for every narrow matmul of a function.

`accumulate` traces a function once, rewrites its jaxpr and evaluates the
result. The rewrite swaps each ``dot_general`` and ``conv_general_dilated``
whose two operands share a 16-bit (or fp8) dtype and that does not already
accumulate wider for the float32-accumulating primitive of `_accumulate`,
with the same output type. Because no type changes, the rewrite reaches every
place an equation can sit without knowing what the enclosing primitive does:

* any jaxpr in any primitive's params (``jit``, ``scan``, ``while``, ``cond``,
  ``remat``, ``shard_map``, ``custom_jvp_call``, ``custom_vjp_call``, Flax's
  lifted transforms, which lower to these) is rewritten in place;
* the functions JAX keeps instead of jaxprs are wrapped: a custom JVP rule's
  jaxpr thunk, a custom VJP's forward thunk and its backward function.

What the engine cannot see into is reported (`UncoveredMatmulWarning`, or an
error with ``strict=True``): primitives JAX does not define (a user's own, or
an FFI call) with narrow floating operands, and kernels (``pallas_call``)
whose matmuls accumulate narrow.

Transformations applied outside (``grad``, ``jvp``, ``vmap``, ``hessian``)
compose: they transform the primitive, whose rules keep float32 accumulation.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import jax
import jax.extend as jex
import numpy as np

from jmp_lite import _dtypes
from jmp_lite._jaxpr import accumulate as _accumulate
from jmp_lite._jaxpr import arguments as _arguments
from jmp_lite._jaxpr import internals as _internals
from jmp_lite._jaxpr import module_scales as _module_scales
from jmp_lite._jaxpr.passes import islands as _islands
from jmp_lite._jaxpr.passes import sink as _sink
from jmp_lite._jaxpr import probes as _probes


class UncoveredMatmulWarning(UserWarning):
  """A computation the engine cannot see into may multiply narrow floats."""


class UncoveredMatmulError(ValueError):
  """Raised instead of `UncoveredMatmulWarning` with ``strict=True``."""


# Primitives whose bodies must run as written: kernels are lowered by their own
# compilers, which do not know the engine's primitives.
_KERNELS = frozenset({"pallas_call", "core_map", "mosaic_gpu_call",
                      "triton_kernel_call"})
# JAX primitives that run code JAX cannot see.
_OPAQUE = frozenset({"ffi_call", "custom_call", "custom_partitioning"})


def _accumulates_wide(eqn) -> bool:
  """A bfloat16 x bfloat16 product already asking for a float32 result.

  Flax's NNX attention writes its logits so (``preferred_element_type``).
  Left as it is, its derivative is JAX's: float32 cotangent x bf16
  operand, a float32 matmul in the backward pass. As the engine's primitive
  its transposes are bf16 products accumulating in float32, like every
  other matmul of the step (torch.autocast's rule too): the float32
  cotangent is rounded to bfloat16, whose range is float32's. A float16
  one could overflow there (a cotangent above 65504), so float16 products
  keep JAX's rule; fp8 operands are left alone (their scaling is the fp8
  recipe's).
  """
  if eqn.primitive.name not in _accumulate.BY_BASE or len(eqn.invars) != 2:
    return False
  lhs, rhs = (np.dtype(v.aval.dtype) for v in eqn.invars)
  pref = eqn.params.get("preferred_element_type")
  return (lhs == rhs == np.dtype(jax.numpy.bfloat16)
          and pref is not None and np.dtype(pref) == _accumulate.F32)


def _refused_on_cpu(eqn) -> bool:
  """A half x half dot whose algorithm preset XLA:CPU cannot compile.

  It accumulates wide already; the engine's primitive runs it with the
  default algorithm on CPU and with the preset elsewhere.
  """
  return (eqn.primitive.name == "dot_general" and len(eqn.invars) == 2
          and _dtypes.is_narrow_float(eqn.invars[0].aval.dtype)
          and _accumulate.cpu_refuses(eqn.params.get("precision")))


def _source(eqn) -> str:
  frames = _internals.user_frames(eqn)
  if not frames:
    return "unknown source"
  f = frames[0]
  return f"{f.file_name}:{f.start_line} ({f.function_name})"


class _Rewriter:
  """One rewrite: a memo of rewritten jaxprs and how to report gaps."""

  def __init__(self, strict: bool, islands: bool = True, reduce_dtype=None,
               sink: bool = True):
    self.strict = strict
    self.islands = islands
    self.reduce_dtype = _accumulate.narrow_reduce_dtype(reduce_dtype)
    self.sink = sink
    self.memo: dict[int, Any] = {}
    self.known = None

  def report(self, eqn, why: str):
    msg = (f"jmp_lite cannot make {eqn.primitive.name!r} at {_source(eqn)}"
           f" accumulate in float32: {why}")
    if self.strict:
      raise UncoveredMatmulError(msg)
    warnings.warn(msg, UncoveredMatmulWarning, stacklevel=4)

  def jaxpr(self, jaxpr):
    key = id(jaxpr)
    if key not in self.memo:
      eqns = [self.eqn(e) for e in jaxpr.eqns]
      if self.sink and self.reduce_dtype is None:
        # Gradients summed by data movement's transposes (a bias's, an
        # embedding's) are summed, and reduced across devices, wide.
        eqns = _sink.sink(eqns, set(jaxpr.invars) | set(jaxpr.constvars))
      if self.islands:
        eqns = _islands.isolate(eqns, jaxpr.outvars)
      changed = len(eqns) != len(jaxpr.eqns) or any(
          a is not b for a, b in zip(eqns, jaxpr.eqns))
      self.memo[key] = (jaxpr, _internals.replace_eqns(jaxpr, eqns)
                        if changed else jaxpr)
    return self.memo[key][1]

  def closed(self, closed):
    new = self.jaxpr(closed.jaxpr)
    return closed if new is closed.jaxpr else _internals.closed(
        new, closed.consts)

  def eqn(self, eqn):
    name = eqn.primitive.name
    if _accumulate.is_narrow_matmul(eqn) or _refused_on_cpu(eqn) or _accumulates_wide(eqn):
      out = np.dtype(eqn.outvars[0].aval.dtype)
      params = dict(eqn.params, preferred_element_type=_accumulate.F32,
                    out_dtype=out, reduce_dtype=self.reduce_dtype)
      return _internals.replace_eqn(eqn, _accumulate.BY_BASE[name], params)
    if name in _KERNELS:
      self.check_kernel(eqn)
      return eqn
    if name in _OPAQUE or not self.is_known(eqn.primitive):
      if any(_dtypes.is_narrow_float(v.aval.dtype)
             for v in eqn.invars if hasattr(v.aval, "dtype")):
        self.report(eqn, "it is opaque to JAX (its lowering is its own) and"
                    " takes narrow floating operands.")
      return eqn
    params = {k: self.param(eqn, k, v) for k, v in eqn.params.items()}
    if all(params[k] is eqn.params[k] for k in params):
      return eqn
    return _internals.replace_eqn(eqn, eqn.primitive, params)

  def is_known(self, prim) -> bool:
    if prim in _accumulate.BASE:
      return True
    if self.known is None or prim.name not in self.known:
      self.known = _internals.all_primitives()
    return self.known.get(prim.name) is prim

  def param(self, eqn, key, value):
    if isinstance(value, jex.core.ClosedJaxpr):
      return self.closed(value)
    if isinstance(value, jex.core.Jaxpr):
      return self.jaxpr(value)
    if isinstance(value, (tuple, list)) and any(
        isinstance(v, (jex.core.ClosedJaxpr, jex.core.Jaxpr)) for v in value):
      new = [self.param(eqn, key, v) for v in value]
      if all(a is b for a, b in zip(new, value)):
        return value
      # A named tuple (custom_linear_solve's jaxprs) takes its fields one by one.
      return type(value)(*new) if hasattr(value, "_fields") else type(value)(new)
    where = (eqn.primitive.name, key)
    if where == _internals.JVP_THUNK:
      return self.thunk(value, lambda jaxpr, consts, zeros: (
          self.jaxpr(jaxpr), consts, zeros))
    if where == _internals.FWD_THUNK:
      return self.thunk(value, lambda jaxpr, consts: (self.jaxpr(jaxpr), consts))
    if where == _internals.BWD_FUN:
      strict = self.strict
      # A backward rule is not differentiated again (as a rule): nothing
      # to gain from recomputing its wide islands.
      return _internals.wrap_fun(
          lambda *args: accumulate(value.call_wrapped, strict=strict,
                                   cache=False, islands=False)(*args), value)
    return value

  def thunk(self, thunk, rewrite_result):
    return _internals.wrap_fun(
        lambda *args: rewrite_result(*thunk.call_wrapped(*args)), thunk)

  def check_kernel(self, eqn):
    """Reports a kernel whose own matmuls accumulate narrow."""
    def narrow(jaxpr):
      for e in jaxpr.eqns:
        if _accumulate.is_narrow_matmul(e):
          return True
        for v in e.params.values():
          for sub in v if isinstance(v, (tuple, list)) else (v,):
            sub = getattr(sub, "jaxpr", sub)
            if isinstance(sub, jex.core.Jaxpr) and narrow(sub):
              return True
      return False
    for value in eqn.params.values():
      sub = getattr(value, "jaxpr", value)
      if isinstance(sub, jex.core.Jaxpr) and narrow(sub):
        self.report(eqn, "it is a kernel with a narrow matmul, which its own"
                    " compiler lowers.")
        return


def _freeze(x):
  """A hashable stand-in for a static argument (Linen's ``mutable=[...]``)."""
  if isinstance(x, (list, tuple)):
    return (type(x).__name__, tuple(map(_freeze, x)))
  if isinstance(x, dict):
    return ("dict", tuple((k, _freeze(v)) for k, v in x.items()))
  if isinstance(x, (bool, int, float, complex)):
    # 1, 1.0 and True are equal keys, and so are 0.0 and -0.0; the traces
    # they give are not (int32 against float32, inf against -inf).
    return (type(x).__name__, repr(x))
  if isinstance(x, np.generic):  # np.int32(2) == np.float32(2), 0.0 == -0.0
    return (x.dtype.str, x.tobytes())
  return x


def _signature(arrays) -> tuple:
  """What a jitted function's trace is specialised on, of its array arguments
  (NumPy's float64 traces as float32: the dtype the trace sees)."""
  return tuple((x.shape, jax.dtypes.canonicalize_dtype(x.dtype, allow_extended_dtype=True),
                getattr(x, "weak_type", False)) for x in arrays)


def rewrite(closed, *, strict: bool = False, islands: bool = True,
            reduce_dtype=None, sink: bool = True):
  """``closed`` (a `ClosedJaxpr`) with every narrow matmul accumulating in f32.

  With ``islands``, float32 stretches of the narrow computation (norms) are
  also recomputed in the backward pass rather than saved (`_islands`).
  ``reduce_dtype``: what partial sums of a product whose contraction XLA
  splits across devices are reduced in (`jmp_lite._jaxpr.accumulate`).
  """
  return _Rewriter(strict, islands, reduce_dtype, sink).closed(closed)


# The name of the computation an eager call of `accumulate(fun)` compiles.
ENGINE_JIT_NAME = "jmp_lite_engine"


def accumulate(fun: Callable[..., Any], *, strict: bool = False,
               cache: bool = True, islands: bool = True,
               reduce_dtype=None, sink: bool = True) -> Callable[..., Any]:
  """``fun`` with every narrow matmul accumulating in float32, everywhere.

  Partial sums of a product that XLA's partitioner splits across devices (a
  weight gradient under ``jit`` with a sharded batch) are reduced in float32,
  or in ``reduce_dtype`` where it is the product's narrow result dtype.

  Array leaves of the arguments are traced; other leaves (flags, names) are
  passed as Python values, and so are non-array outputs (symbolic zeros).
  Called outside any transformation, the rewritten function runs compiled and
  is cached per argument structure and static values, so repeated eager
  calls do not trace again. With ``cache=False`` an eager call evaluates the
  rewritten jaxpr equation by equation instead, as the function itself runs
  eagerly (no fusion across its operations).
  """
  jitted: dict[Any, tuple[Callable[..., Any], dict]] = {}
  name = getattr(fun, "__name__", "the function")

  def run(dynamic, leaves, traced, treedef):
    def flat_fun(*dynamic):
      a, k = _arguments.refill(leaves, traced, treedef, dynamic)
      return fun(*a, **k)

    split = {}

    def split_out(*dynamic):
      arrays, split["static"], split["tree"] = _arguments.outputs(flat_fun(*dynamic), name)
      return arrays

    closed = rewrite(jax.make_jaxpr(split_out)(*dynamic), strict=strict,
                     islands=islands, reduce_dtype=reduce_dtype, sink=sink)
    # Evaluated eagerly (``cache=False``), a constant output is a literal.
    arrays = map(_internals.as_output, jex.core.jaxpr_as_fun(closed)(*dynamic),
                 closed.out_avals)
    return _arguments.rejoin(split["tree"], split["static"], arrays)

  @functools.wraps(fun)
  def rewritten(*args, **kwargs):
    leaves, treedef, traced = _arguments.split(args, kwargs)
    dynamic = [leaves[i] for i in traced]
    # In a probe trace the marks `fun` makes must be made again (a cached
    # trace holds the marks of the trace it was made in): a model without
    # parameters, called on concrete inputs inside a telemetry step. So must
    # a per-module loss scale's conversions, which read the step's scales.
    if (not cache or _probes.tapping_active() or _module_scales.is_active()
        or any(_internals.is_tracer(x) for x in dynamic)):
      return run(dynamic, leaves, traced, treedef)
    static = tuple(None if i in traced else _freeze(x)
                   for i, x in enumerate(leaves))
    try:
      key = (treedef, static)
      hash(key)
    except TypeError:  # unhashable static arguments: trace every call.
      return run(dynamic, leaves, traced, treedef)
    if key not in jitted:
      # The cached function closes over the static leaves only: holding the
      # first call's arrays would keep them alive as long as ``fun``.
      skeleton = [None if i in traced else x for i, x in enumerate(leaves)]
      # Output leaves that are not arrays (an Equinox model's functions)
      # cannot leave a jitted function: kept here, by the arguments' types,
      # as they are made when it traces.
      statics = {}

      def compiled(*d):
        arrays, static, out_tree = _arguments.outputs(
            run(list(d), skeleton, traced, treedef), name)
        statics[_signature(d)] = (out_tree, static)
        return arrays
      # Named, so that compilation logs (and tests) can tell it apart.
      compiled.__name__ = compiled.__qualname__ = ENGINE_JIT_NAME
      jitted[key] = (jax.jit(compiled), statics)
    call, statics = jitted[key]
    arrays = call(*dynamic)
    out_tree, static = statics[_signature(dynamic)]
    return _arguments.rejoin(out_tree, static, arrays)

  return rewritten
