"""Op-level autocast: PyTorch/Paddle/MindSpore "O1" for any JAX function.

`autocast` traces a function to a jaxpr and evaluates that jaxpr again with
each equation's dtypes chosen by three rules:

* **white list** (run in the compute dtype): floating operands are cast to the
  compute dtype (bfloat16 by default) and the op accumulates in float32 through
  ``preferred_element_type``. The result counts as compute dtype for the rules
  below, but autocast keeps the float32 accumulator and hands it unrounded to a
  consumer that runs in float32 (a bias add, a softmax): autocast itself never
  rounds a value to half precision and back. Layout ops between them
  (transpose, reshape, broadcast, slice) carry the accumulator as it is, and
  a transpose that swaps a product's operand dimensions (``(w @ x.T).T``, a
  weight gradient ``(g.T @ x).T``, a matmul under ``vmap``) is computed as
  the product of the swapped operands. (``dot_general`` operands are
  also put in the canonical ``[batch, free, contract] x [batch, contract,
  free]`` layout: XLA folds the transposes, and XLA:CPU rejects some other
  layouts of a bf16 x bf16 -> f32 dot at run time.) A matmul or convolution
  that asks for precision runs at the dtypes it was traced with:
  ``precision=Precision.HIGH`` or ``HIGHEST``, or an algorithm preset whose
  operands cannot be the compute dtype (``F32_F32_F32``; ``F16_F16_F32``
  under bfloat16). Its author asked for full products, as
  ``jax.scipy.linalg.expm`` (whose float16 Pade products overflow),
  ``jnp.linalg.pinv`` and ``lstsq`` do.
* **black list** (run in float32): floating operands narrower than float32 are
  upcast; the result is float32. Reductions are black-listed only when they
  are *large*: when they combine at least ``min_reduction_size`` elements
  (default 16) into each output. bfloat16 keeps 8 significant bits, so a
  running sum of 16 similar terms is already 16x a term and keeps only 4 bits
  of each new one; smaller sums and products stay in their input dtype.
  ``reduce_max`` is exact in any dtype and runs in float32 at every size, so
  that softmax's ``x - max(x)`` is a float32 subtraction.
* **everything else** follows its widest floating input. Scalars (literals,
  rank-0 operands next to arrays) and weakly typed operands do not vote, as
  Python scalars do not in JAX's promotion; an op whose floating operands had
  different dtypes in the original program keeps those dtypes.

Default lists, next to the lists they mirror: PyTorch's CUDA autocast op
reference, and MindSpore 2.3's ``auto_mixed_precision`` built-in lists (its
white list is what ``amp_level="O1"`` casts; its black list is what ``"O2"``
keeps in float32; MindSpore O1 has no per-op float32 list, so ops outside the
white list run as written):

====================  ======================================  ==============================
jaxpr primitives      PyTorch ``torch.autocast``              MindSpore
====================  ======================================  ==============================
**white**
dot_general           matmul, mm, bmm, addmm, linear...       MatMul, BatchMatMul, nn.Dense
conv_general_dilated  conv1d/2d/3d, conv_transpose1d/2d/3d    nn.Conv1d/2d/3d and Transpose
**black**
exp, exp2, expm1      exp, expm1                              --
log, log1p            log, log10, log2, log1p                 --
pow, integer_pow,     pow (``x ** 2``; float16's range ends   --
square, ``x * x``     at 65504, so a square overflows from
                      256), norm, normalize
rsqrt                 rsqrt, layer_norm, group_norm           nn.LayerNorm, nn.BatchNorm*d
logistic              binary_cross_entropy_with_logits        --
erf_inv               erfinv                                  --
acos, asin, cosh,     acos, asin, cosh, sinh, tan             --
sinh, tan
reduce_sum, _prod,    sum, prod, avg_pool                     --
reduce_window_sum
reduce_max            softmax, log_softmax                    --
cumsum, cumprod,      cumsum, cumprod                         --
cumlogsumexp
psum, reduce_scatter  (FSDP's ``reduce_dtype``)               --
lu, qr, svd, eigh,    linalg_*, fft_* (its CPU list; they     --
fft, cholesky,        have no half kernels in JAX either)
triangular_solve...
complex, conj         (complex values: complex64 and up)      --
random_gamma          (sampling is not autocast)              --
====================  ======================================  ==============================

Softmax, log-softmax, logsumexp, norms and layer/RMS normalisation are built
from these pieces in JAX, so they run in float32 as a whole: ``reduce_max``,
``exp``, ``reduce_sum``, ``log``, ``rsqrt`` and a value times itself (the
``mul`` of ``jnp.linalg.norm``) are black, and the ``sub`` and ``div``
between them follow their (now float32) inputs. Over fewer than
``min_reduction_size`` features a normalisation's sums are small
reductions and follow their input, and so does the normalisation (torch
keeps ``layer_norm`` in float32 at every size).

Custom lists follow Paddle's ``custom_white_list``/``custom_black_list``: they
are added to the defaults, and naming an op in one list removes it from the
other.

Structure and composition:

* The rewrite runs on the precision engine shared with `jmp_lite.flax.wrap`:
  white-listed matmuls and convolutions become the engine's float32-
  accumulating primitives, whose derivatives accumulate in float32 too. So
  ``jax.grad(autocast(f))`` runs its backward matmuls on half x half operands
  like ``autocast(jax.grad(f))`` does, and ``jax.jvp``, ``jax.hessian`` and
  ``jax.vmap`` of an autocast function compose the same way.
* ``jit``/``pjit`` calls are inlined; ``checkpoint`` (``remat2``) is rebuilt
  around the rewritten body with the same policy. A policy that names
  matmuls (``dots_saveable``) sees the engine's primitive as the
  ``dot_general`` it replaces, inside or around the autocast function; a
  product handed to a float32 consumer is kept as autocast computes it, in
  float32.
* ``scan``, ``while``, ``cond``, ``shard_map``, ``custom_jvp_call`` and
  ``custom_vjp_call`` bodies are rewritten with their interface dtypes
  unchanged (loop carries keep their dtype), so a custom derivative rule still
  sees the dtypes it was written for. The custom rules themselves (a custom
  JVP, a custom VJP's backward) keep their dtypes, and their half-precision
  matmuls accumulate in float32.
* Other primitives that carry jaxprs get their original input dtypes back
  and run as written, with the engine's float32 accumulation inside; what the
  engine cannot see into is reported (``strict=True`` makes it an error).
* PRNG keys and other non-numeric values pass through untouched, so dropout
  works under autocast.
* The autocast function returns exactly the dtypes ``fun`` returns, so it is a
  drop-in replacement. Called outside any transformation it runs compiled and
  cached by argument structure, so repeated calls do not trace again.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from typing import Any, Optional

import jax
import numpy as np

from jmp_lite._jaxpr import accumulate as _accumulate
from jmp_lite._jaxpr import arguments as _arguments
from jmp_lite._jaxpr.passes import autocast as _autocast
from jmp_lite._jaxpr.passes import engine as _engine
from jmp_lite.oplists import DEFAULT_BLACK_LIST
from jmp_lite.oplists import DEFAULT_WHITE_LIST
from jmp_lite.oplists import MIN_REDUCTION_SIZE
from jmp_lite.oplists import primitive_name
from jmp_lite.oplists import PrimitiveLike
from jmp_lite.policy import Policy, get_policy

__all__ = ("autocast", "primitive_name", "DEFAULT_WHITE_LIST",
           "DEFAULT_BLACK_LIST", "MIN_REDUCTION_SIZE")


@dataclasses.dataclass(frozen=True)
class _Rules:
  compute: np.dtype
  white: frozenset[str]
  black: frozenset[str]
  min_reduction_size: int
  # What partial sums of a product split across devices are reduced in:
  # the policy's ``reduce_dtype``; None (a bare dtype given) is float32.
  reduce: Optional[np.dtype] = None


def _compute_dtype(policy_or_dtype) -> np.dtype:
  if isinstance(policy_or_dtype, str):
    policy_or_dtype = get_policy(policy_or_dtype)
  if isinstance(policy_or_dtype, Policy):
    p = policy_or_dtype
    return p.autocast_dtype if p.autocast_dtype is not None else p.compute_dtype
  if policy_or_dtype is None:  # np.dtype(None) is float64
    raise TypeError("autocast expects a Policy, a policy string or a dtype,"
                    " got None.")
  try:
    dtype = np.dtype(jax.numpy.dtype(policy_or_dtype))
  except TypeError as e:
    raise TypeError(f"autocast expects a Policy, a policy string or a dtype,"
                    f" got {policy_or_dtype!r}.") from e
  if not jax.numpy.issubdtype(dtype, jax.numpy.floating):
    raise ValueError(f"autocast needs a floating compute dtype, got {dtype}.")
  return dtype


def _names(ops, which: str) -> frozenset[str]:
  if isinstance(ops, (str, bytes)) or callable(ops):
    # A string is a collection of characters: "exp" read as "e", "x", "p".
    raise TypeError(f"{which} must be a collection of ops, got {ops!r}; write"
                    f" [{ops!r}].")
  return frozenset(map(primitive_name, ops or ()))


def _make_rules(policy_or_dtype, white_list, black_list, min_reduction_size):
  white_extra = _names(white_list, "white_list")
  black_extra = _names(black_list, "black_list")
  both = white_extra & black_extra
  if both:
    raise ValueError(f"{sorted(both)} given in both white_list and black_list.")
  if (isinstance(min_reduction_size, (bool, np.bool_))
      or not isinstance(min_reduction_size, (int, np.integer))):
    raise TypeError(f"min_reduction_size must be a whole number >= 1, got"
                    f" {min_reduction_size!r}.")
  if min_reduction_size < 1:
    raise ValueError(f"min_reduction_size must be >= 1, got"
                     f" {min_reduction_size}.")
  if isinstance(policy_or_dtype, str):
    policy_or_dtype = get_policy(policy_or_dtype)
  reduce = (policy_or_dtype.reduce_dtype
            if isinstance(policy_or_dtype, Policy) else None)
  return _Rules(
      compute=_compute_dtype(policy_or_dtype),
      white=(DEFAULT_WHITE_LIST - black_extra) | white_extra,
      black=(DEFAULT_BLACK_LIST - white_extra) | black_extra,
      min_reduction_size=min_reduction_size,
      reduce=_accumulate.narrow_reduce_dtype(reduce))


def autocast(fun: Callable[..., Any],
             policy_or_dtype: Any,
             *,
             white_list: Optional[Iterable[PrimitiveLike]] = None,
             black_list: Optional[Iterable[PrimitiveLike]] = None,
             min_reduction_size: int = MIN_REDUCTION_SIZE,
             strict: bool = False) -> Callable[..., Any]:
  """Returns ``fun`` with per-op precision: matmuls in half, fragile ops in f32.

  See the module docstring for the rules and the default lists.

  Args:
    fun: a function of arrays (pytrees of arrays and Python scalars; bind other
      arguments with `functools.partial`).
    policy_or_dtype: the compute dtype of white-listed ops: a dtype, a
      `Policy` (its ``autocast_dtype`` if set, else its ``compute_dtype``) or a
      string `jmp_lite.get_policy` parses (``"O1"``, ``"bf16"``).
    white_list: extra ops to run in the compute dtype, by primitive name,
      `Primitive` or ``jax.lax`` function. They are removed from the black list.
    black_list: extra ops to run in float32; removed from the white list.
    min_reduction_size: black-listed reductions combining fewer elements than
      this into each output follow their input dtype instead.
    strict: raise `jmp_lite.UncoveredMatmulError` instead of warning when a
      computation the engine cannot see into (a primitive JAX does not
      define, an FFI call) takes half-precision operands.

  Returns:
    A function with ``fun``'s signature and output dtypes.

  Raises:
    ValueError: for an unknown op name, an op in both lists, or a non-floating
      dtype.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> def layer(w, x):
    ...   return jax.nn.softmax(x @ w)
    >>> w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
    >>> fast = autocast(layer, jnp.bfloat16)
    >>> fast(w, x).dtype
    dtype('float32')
    >>> from jmp_lite.auditing import audit
    >>> report = audit(fast, w, x)
    >>> report.count(primitive="dot_general", operand_dtype=jnp.bfloat16,
    ...              accumulation=jnp.float32)
    1
    >>> report.count(primitive="exp", operand_dtype=jnp.float32)
    1
  """
  rules = _make_rules(policy_or_dtype, white_list, black_list,
                      min_reduction_size)

  fun_name = getattr(fun, "__name__", "the function")

  @functools.wraps(fun)
  def interpreted(*args, **kwargs):
    # Array leaves are traced; other leaves (a Flax module, flags) are passed
    # as they are.
    leaves, in_tree, traced = _arguments.split(args, kwargs)
    flat = [leaves[i] for i in traced]
    split = {}

    def flat_fun(*flat_args):
      a, k = _arguments.refill(leaves, traced, in_tree, flat_args)
      # Output leaves that are not arrays (an Equinox model's activation
      # functions, flags) are returned as they are, as the arguments' are.
      arrays, split["static"], split["tree"] = _arguments.outputs(
          fun(*a, **k), f"autocast({fun_name})")
      return arrays

    closed = jax.make_jaxpr(flat_fun)(*flat)
    outs = _autocast.eval_jaxpr(closed.jaxpr, closed.consts, flat, rules)
    outs = [_autocast.cast_to_aval(x, a) for x, a in zip(outs, closed.out_avals)]
    return _arguments.rejoin(split["tree"], split["static"], outs)

  # The engine traces the interpreted function once per argument structure
  # and gives every matmul the interpreter leaves narrow (custom rules,
  # opaque bodies) float32 accumulation.
  # (No moved downcasts: the interpreter has placed every cast by its lists
  # already, and its reductions run in float32.)
  return _engine.accumulate(interpreted, strict=strict,
                            reduce_dtype=rules.reduce, sink=False)
