"""An fp8 matmul site: the matmul's operands and its output cotangent quantised.

`jmp_lite._instrument` puts a chosen ``dot_general`` (or the engine's
float32-accumulating ``jmp_dot_general``) between three quantisers, the
structure of Flax's ``Fp8DotGeneralOp`` (``flax/linen/fp8_ops.py``, Flax
0.12.8: ``in_qdq`` on each operand, ``out_qdq`` on the output):

* each operand is quantised to e4m3 with its delayed scale and read back in
  its own dtype (the compute dtype), and its gradient passes straight through;
* the product is the original equation, re-bound: it accumulates in float32
  under the engine and its output is in the compute dtype;
* the output's cotangent is quantised to e5m2 with its delayed scale and read
  back before it reaches the product's transposes.

XLA's GPU compiler turns ``convert(fp8) * scale`` feeding a ``dot`` into one
fp8 GEMM with the scales as its operands (the pattern Flax's and
Transformer Engine's JAX layers rely on), so on a GPU with fp8 units this is
the native fp8 matmul; on other backends it runs as written, emulated.

The three scales come in through one float32 ``[3]`` slice of the carrier
(lhs, rhs, gradient), and each tensor's absolute maximum goes back as that
slice's cotangent, in the same pass: the site is used once per carrier row,
so the cotangent is exactly the maximum, never a sum.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _probes
from jmp_lite import _replicas
from jmp_lite import fp8 as fp8_lib

WIDTH = 3  # lhs, rhs, gradient

MARK = "jmp_lite_fp8"  # name scope wrap opens around an fp8 module's call


def mark(recipe: Optional[str], path: str) -> str:
  """The name scope wrap opens around a module's call when fp8 rules exist.

  The step (`jmp_lite._instrument.Fp8Selection`) reads the innermost one of a
  matmul: its recipe (or ``off``) and the module path that names the site.
  """
  return f"{MARK}={recipe or 'off'}@{path.replace('/', '.')}"




def _amax(x) -> jax.Array:
  return jnp.max(jnp.abs(x)).astype(jnp.float32)


def _cotangent(amax, slot, axes):
  """``amax`` in slot ``slot`` of a zero ``[3]``, typed like the carrier."""
  return _probes._varying(jnp.zeros((WIDTH,), jnp.float32).at[slot].set(amax), axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _in_qdq(x, carrier, slot, dtype, axes):
  return fp8_lib.qdq(x, dtype, carrier[slot])


def _in_qdq_fwd(x, carrier, slot, dtype, axes):
  return _in_qdq(x, carrier, slot, dtype, axes), _amax(x)


def _in_qdq_bwd(slot, dtype, axes, amax, g):
  del dtype
  return g, _cotangent(amax, slot, axes)


_in_qdq.defvjp(_in_qdq_fwd, _in_qdq_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _out_qdq(y, carrier, dtype, axes):
  return y


def _out_qdq_fwd(y, carrier, dtype, axes):
  return y, carrier[2]


def _out_qdq_bwd(dtype, axes, scale, g):
  return fp8_lib.qdq(g, dtype, scale), _cotangent(_amax(g), 2, axes)


_out_qdq.defvjp(_out_qdq_fwd, _out_qdq_bwd)


def matmul(bind, lhs, rhs, carrier, forward=fp8_lib.FORMATS["e4m3"],
           backward=fp8_lib.FORMATS["e5m2"]):
  """``bind(lhs, rhs)`` with fp8 operands and an fp8 output cotangent.

  Args:
    bind: computes the product of the (dequantised) operands.
    lhs, rhs: the operands, in the compute dtype.
    carrier: float32 ``[3]``: the lhs, rhs and gradient dequantisation
      scales; its cotangent is their three absolute maxima.
    forward, backward: the fp8 formats of the operands and of the gradient.
  """
  axes = tuple(sorted(_replicas.varying_axes(carrier)))
  forward, backward = np.dtype(forward), np.dtype(backward)
  q_lhs = _in_qdq(lhs, carrier, 0, forward, axes)
  q_rhs = _in_qdq(rhs, carrier, 1, forward, axes)
  return _out_qdq(bind(q_lhs, q_rhs), carrier, backward, axes)
