"""XLA:GPU's excess precision, emulated on any backend: an adversary for tests.

Under ``--xla_allow_excess_precision=true`` (XLA's default) the compiler may
keep any bfloat16/float16 value the program computes in float32: it removes
``convert`` round trips and computes narrow elementwise ops and reductions in
float32. XLA:CPU happens not to, so a CPU suite cannot see code that relies on
a rounding actually happening; on an H100 such code broke the guard, Kahan
summation and stochastic rounding.

`excess_precision(fun)` runs ``fun`` equation by equation the way the license
allows at its most hostile: every narrow float value stays in float32 unless
something must materialise it in its own format (a matmul or convolution
operand, a bitcast, a loop or branch boundary, a result of ``fun``). What the
program rounds explicitly with ``reduce_precision`` on a float32 value is
kept, as XLA keeps it. Code correct under this emulation is correct under any
choice XLA:GPU makes within the license.

``jax.make_jaxpr``, the equations of the jaxpr it returns
(``eqn.primitive.bind``, ``eqn.params``) and the library's evaluator of them
(`jmp_lite._jaxpr.internals.eval_jaxpr`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._jaxpr import internals as _internals

# XLA:GPU's SimplifyFPConversions folds convert chains of any float types:
# an fp8 round trip read back in float32 vanished on an H200 too.
NARROW = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16),
          np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))

# Ops XLA computes per element, or moves values without arithmetic: with a
# narrow operand kept wide, they run in float32 and their narrow results stay
# float32 (float normalisation, and fusion without the round trip).
_WIDE_OK = frozenset({
    "abs", "acos", "add", "asin", "atan", "atan2", "cbrt", "ceil", "clamp",
    "concatenate", "copy", "copy_p", "cos", "cosh", "div", "eq", "erf", "erf_inv",
    "erfc", "exp", "exp2", "expand_dims", "expm1", "floor", "ge", "gt",
    "integer_pow", "is_finite", "le", "log", "log1p", "logistic", "lt", "max",
    "min", "mul", "ne", "neg", "nextafter", "pad", "pow", "reduce_max",
    "reduce_min", "reduce_sum", "reduce_prod", "rem", "reshape", "rev", "round",
    "rsqrt", "select_n", "sign", "sin", "sinh", "slice", "sqrt", "square",
    "squeeze", "sub", "tan", "tanh", "transpose", "broadcast_in_dim",
    "dynamic_slice", "dynamic_update_slice", "gather", "argmax", "argmin",
    "sort", "cumsum", "cummax", "cummin", "reduce_precision",
})
# Calls XLA inlines: values flow through them as they are.
_INLINED = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr",
            "core_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
            "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
            "remat": "jaxpr", "checkpoint": "jaxpr"}


def _is_narrow(aval) -> bool:
  dtype = getattr(aval, "dtype", None)
  return dtype is not None and any(dtype == d for d in NARROW)


def _materialise(x, aval):
  """The value in the dtype its variable has: a real rounding."""
  if _is_narrow(aval) and np.dtype(x.dtype) != np.dtype(aval.dtype):
    return jax.jit(lambda v: v.astype(aval.dtype))(x)
  return x


def _eqn(eqn, invals):
  """What ``eqn`` gives under the emulated excess precision (as its bind would)."""
  name = eqn.primitive.name
  in_avals = [v.aval for v in eqn.invars]
  if name == "convert_element_type":
    x, = invals
    new = np.dtype(eqn.params["new_dtype"])
    if new in NARROW and np.dtype(x.dtype) == np.float32:
      return x  # the rounding may be skipped: keep float32
    if np.dtype(x.dtype) == np.float32 and _is_narrow(in_avals[0]) and new == np.float32:
      return x  # the round trip removed
    return eqn.primitive.bind(_materialise(x, in_avals[0]), **eqn.params)
  if name in _INLINED and _INLINED[name] in eqn.params:
    inner = eqn.params[_INLINED[name]]
    outs = (_run(inner.jaxpr, inner.consts, invals) if hasattr(inner, "jaxpr")
            else _run(inner, (), invals))
    return outs if eqn.primitive.multiple_results else outs[0]
  if name in _WIDE_OK and any(_is_narrow(a) and np.dtype(x.dtype) == np.float32
                              for x, a in zip(invals, in_avals)):
    wide = [x.astype(jnp.float32) if _is_narrow(a) else x for x, a in zip(invals, in_avals)]
    return eqn.primitive.bind(*wide, **eqn.params)
  return eqn.primitive.bind(*[_materialise(x, a) for x, a in zip(invals, in_avals)],
                            **eqn.params)


def _run(jaxpr, consts, args):
  # The library's own equation-by-equation evaluator, with `_eqn` per equation.
  return _internals.eval_jaxpr(jaxpr, consts, args, _eqn)


def excess_precision(fun):
  """``fun``, run as XLA:GPU may run it under excess precision (see module doc).

  Returns what ``fun`` returns, each narrow result rounded to its dtype once
  at the end (as a program output is).
  """
  def run(*args, **kwargs):
    closed, shape = jax.make_jaxpr(fun, return_shape=True)(*args, **kwargs)
    flat = jax.tree.leaves((args, kwargs))
    outs = _run(closed.jaxpr, closed.consts, flat)
    outs = [_materialise(x, v.aval) for x, v in zip(outs, closed.jaxpr.outvars)]
    return jax.tree.unflatten(jax.tree.structure(shape), outs)
  return run
