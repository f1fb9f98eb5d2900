"""Narrow-float matmuls and convolutions that accumulate in float32, as primitives.

``jmp_dot_general`` and ``jmp_conv_general_dilated`` compute what
``convert_element_type(op(lhs, rhs, preferred_element_type=float32), out_dtype)``
computes: 16-bit (or fp8) operands, a float32 accumulator, rounded once to
``out_dtype`` (the operands' dtype, or float32 for a consumer that wants the
accumulator). Their parameters are the wrapped op's own plus ``out_dtype`` and
``reduce_dtype``.

``reduce_dtype`` decides what crosses devices when XLA's partitioner splits a
product's contraction (a weight gradient under data parallelism, a row-parallel
layer): each device's partial sum leaves its product in the product's result
dtype and is all-reduced (or reduce-scattered) in it. So the partial sums are
float32, and are rounded once after the reduction, unless ``reduce_dtype``
names a narrower dtype equal to ``out_dtype``: then the product emits
``out_dtype`` and the reduction runs in it, at half the bytes. On one device
the two lowerings give the same numbers on XLA's backends, whose 16-bit dots
accumulate in float32 internally.

Why primitives, not a ``custom_vjp``: a primitive keeps its precision through
every transformation applied *outside* the rewrite. Its JVP and transpose are
the same primitive on tangents and cotangents, so ``jax.grad``, ``jax.jvp``,
``jax.hessian`` and ``jax.linear_transpose`` of a rewritten function all run
half x half -> float32 products; ``vmap`` moves the batch into the product;
``jit``, ``scan``, ``remat`` and ``shard_map`` stage it like any other op.

Lowering is decided per platform when the computation is lowered, not when it
is traced, so a step exported for several platforms is right on each:

* CPU: operands go into the ``[batch, free, contract] x [batch, contract,
  free]`` layout (XLA:CPU rejects some batched bf16 x bf16 -> f32 layouts at
  run time, and its fast bf16 kernels need row-major operands: see
  `_cpu_dot`).
* other platforms (GPU, TPU): the op as written with
  ``preferred_element_type=float32``; their matrix units accumulate in float32
  natively and take any layout.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _dtypes
from jmp_lite._jaxpr import internals as _internals

F32 = np.dtype(np.float32)

dot_p = _internals.Primitive("jmp_dot_general")
conv_p = _internals.Primitive("jmp_conv_general_dilated")
BASE = {dot_p: lax.dot_general_p, conv_p: lax.conv_general_dilated_p}
BY_BASE = {base.name: p for p, base in BASE.items()}


def bind(base_name: str, lhs, rhs, params, out_dtype, reduce_dtype=None):
  """``base(lhs, rhs, **params)`` accumulating in float32, out in ``out_dtype``.

  ``reduce_dtype``: see the module docstring; None (or float32) keeps partial
  sums in float32.
  """
  prim = BY_BASE[base_name]
  params = dict(params, preferred_element_type=F32)
  lhs, rhs = _match_vma(lhs, rhs)
  return prim.bind(lhs, rhs, out_dtype=np.dtype(out_dtype),
                   reduce_dtype=narrow_reduce_dtype(reduce_dtype), **params)


def narrow_reduce_dtype(dtype):
  """``dtype`` if partial sums should be rounded to it, else None (float32)."""
  if dtype is None:
    return None
  dtype = np.dtype(dtype)
  return dtype if dtype.itemsize < F32.itemsize else None


def _base_params(params):
  """The wrapped op's parameters: the engine's own removed."""
  return {k: v for k, v in params.items()
          if k not in ("out_dtype", "reduce_dtype")}


def _partial_sum_dtype(out_dtype, reduce_dtype):
  """The dtype a product's partial sums leave it in (see the module docstring)."""
  if reduce_dtype is not None and np.dtype(reduce_dtype) == np.dtype(out_dtype):
    return np.dtype(out_dtype)
  return F32


def _match_vma(lhs, rhs):
  """Operands varying over the same manual axes (inside ``shard_map``)."""
  lv = getattr(jax.typeof(lhs), "vma", frozenset())
  rv = getattr(jax.typeof(rhs), "vma", frozenset())
  if lv == rv:
    return lhs, rhs
  if rv - lv:
    lhs = lax.pcast(lhs, tuple(sorted(rv - lv)), to="varying")
  if lv - rv:
    rhs = lax.pcast(rhs, tuple(sorted(lv - rv)), to="varying")
  return lhs, rhs


# --- Semantics ------------------------------------------------------------------


def _abstract_eval(prim):
  def rule(lhs, rhs, *, out_dtype, reduce_dtype, **params):
    del reduce_dtype
    out, effects = _internals.abstract_eval(BASE[prim], lhs, rhs, **params)
    return out.update(dtype=np.dtype(out_dtype), weak_type=False), effects
  return rule


# Presets naming XLA's default for 16-bit operands of their type and float32
# results, dropped: XLA:GPU has no kernel for some (NNX's float16 decoding).
_DEFAULT_16BIT = {"F16_F16_F32": np.float16, "BF16_BF16_F32": jnp.bfloat16}


def _reference(prim, lhs, rhs, *, out_dtype, reduce_dtype, **params):
  """What ``prim`` computes, as written: the lowering on other platforms."""
  params["preferred_element_type"] = _partial_sum_dtype(out_dtype, reduce_dtype)
  precision = params.get("precision")
  if (prim is dot_p and isinstance(precision, lax.DotAlgorithmPreset)
      and params["preferred_element_type"] == F32
      and lhs.dtype == rhs.dtype == _DEFAULT_16BIT.get(precision.name)):
    params["precision"] = None
  return lax.convert_element_type(BASE[prim].bind(lhs, rhs, **params),
                                  out_dtype)


@functools.lru_cache(maxsize=256)
def _compiled(prim, items):
  params = dict(items)
  return jax.jit(lambda lhs, rhs: prim.bind(lhs, rhs, **params))


def _impl(prim):
  def impl(lhs, rhs, **params):
    # Eager calls compile the op through its per-platform lowering.
    return _compiled(prim, tuple(sorted(params.items())))(lhs, rhs)
  return impl


for _p in BASE:
  _p.def_effectful_abstract_eval(_abstract_eval(_p))
  _p.def_impl(_impl(_p))
  _internals.define_lowering(_p, functools.partial(_reference, _p))
  # `jax.checkpoint(..., policy=dots_saveable)` saves these as it would the
  # ops they replace, whether it wraps the rewrite or sits inside it.
  _internals.define_remat_as(_p, lambda params, _p=_p: (BASE[_p],
                                                        _base_params(params)))


# --- CPU lowering of dots --------------------------------------------------------


def canonicalize(lhs, rhs, dimension_numbers, partitioned=False):
  """Returns ``(lhs, rhs, dimension_numbers)`` in XLA:CPU's native layouts.

  ``lhs`` becomes ``[batch, free, contract]``; ``rhs`` stays as it is if it is
  already ``[batch, contract, free]`` or ``[batch, free, contract]`` (``x @ w``
  and ``g @ w.T``), and becomes ``[batch, contract, free]`` otherwise. The
  result is the same array: ``dot_general`` orders its output batch, lhs free,
  rhs free whatever the operand layouts.
  """
  (lc, rc), (lb, rb) = dimension_numbers
  lf = [d for d in range(np.ndim(lhs)) if d not in lc and d not in lb]
  rf = [d for d in range(np.ndim(rhs)) if d not in rc and d not in rb]
  nb, nf, nc, nrf = len(lb), len(lf), len(lc), len(rf)
  l_perm = (*lb, *lf, *lc)
  r_nn, r_nt = (*rb, *rc, *rf), (*rb, *rf, *rc)
  identity = tuple(range(np.ndim(rhs)))
  if r_nt == identity and r_nn != identity:
    r_perm, r_contract = r_nt, tuple(range(nb + nrf, nb + nrf + nc))
  else:
    r_perm, r_contract = r_nn, tuple(range(nb, nb + nc))
  dims = ((tuple(range(nb + nf, nb + nf + nc)), r_contract),
          (tuple(range(nb)), tuple(range(nb))))
  if dims == ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))):
    return lhs, rhs, dimension_numbers
  # A partitioned operand is left to XLA's partitioner: flattening a
  # batch-sharded activation would make it all-gather the whole batch.
  keep = (lambda x: x) if partitioned else _materialize
  if l_perm != tuple(range(len(l_perm))):
    lhs = keep(lax.transpose(lhs, l_perm))
  if r_perm != identity:
    rhs = keep(lax.transpose(rhs, r_perm))
  return lhs, rhs, dims


def _materialize(x):
  """``x`` copied into row-major order.

  XLA folds a transpose into the dot's operand layout, and XLA:CPU runs a
  bf16 dot whose operand is not row-major (a weight gradient ``x.T @ g``) as
  a float32 dot: the fast kernels only take row-major operands. Flattening
  behind an optimization barrier forces the copy, which costs one pass over
  the operand and buys the bf16 kernel. A sharded operand is left to XLA's
  partitioner (flattening it would need an output sharding).
  """
  if _internals.explicit_sharding(jax.typeof(x)) is not None:
    return x
  return lax.optimization_barrier(x.reshape(-1)).reshape(x.shape)


# The algorithm presets JAX lowers on CPU (`_handle_dot_precision` in
# jax/_src/lax/lax.py refuses the others at lowering time).
_CPU_PRESETS = frozenset({"DEFAULT", "F16_F16_F16", "F32_F32_F32",
                          "F64_F64_F64", "BF16_BF16_F32", "BF16_BF16_F32_X3",
                          "BF16_BF16_F32_X6"})


def cpu_refuses(precision) -> bool:
  """Whether XLA:CPU has no kernel for the dot algorithm ``precision`` names
  (``F16_F16_F32``: ``jax.nn.dot_product_attention``'s on float16 queries)."""
  return (isinstance(precision, lax.DotAlgorithmPreset)
          and precision.name not in _CPU_PRESETS)


def _cpu_dot(lhs, rhs, *, partitioned, out_dtype, reduce_dtype,
             dimension_numbers, precision, preferred_element_type, out_sharding):
  if cpu_refuses(precision):  # F16_F16_F32: the default with float32 results
    precision = None
  del preferred_element_type  # float32, or narrower by ``reduce_dtype``
  given = lhs
  lhs, rhs, dims = canonicalize(lhs, rhs, dimension_numbers, partitioned)
  if lhs is given and not partitioned:
    # Canonical, but maybe a transpose XLA would fold into the dot (an
    # Equinox Linear's cotangent): XLA:CPU has no bf16 x bf16 -> f32 kernel
    # for an lhs contracting its first dimension. Free if row-major already.
    lhs = _materialize(lhs)
  out = lax.dot_general(lhs, rhs, dims, precision=precision,
                        preferred_element_type=_partial_sum_dtype(
                            out_dtype, reduce_dtype),
                        out_sharding=out_sharding)
  if not partitioned and np.dtype(out_dtype).itemsize > np.dtype(lhs.dtype).itemsize:
    # A wide result, which a transpose may read: XLA folds ``transpose(dot(a,
    # b))`` into ``dot(b, a)``, in a layout XLA:CPU cannot run in bf16 either.
    out = lax.optimization_barrier(out)
  return lax.convert_element_type(out, out_dtype)


_internals.define_partitioned_lowering(dot_p, _cpu_dot, platform="cpu")


# --- Dots: transposes and batching ---------------------------------------------------


def _free(ndim, contract, batch):
  return [d for d in range(ndim) if d not in contract and d not in batch]


def _dot_cotangent(side):
  """The transpose rule for operand ``side`` (0: lhs, 1: rhs) of a dot.

  The cotangent ``ct`` has the dot's output layout: batch, lhs free, rhs free.
  The rule is one dot of ``ct`` with the known operand ``k`` that contracts
  ``k``'s free dimensions; the lhs cotangent is ``ct . k`` (``g @ wᵀ``), the
  rhs one ``k . ct`` (``xᵀ @ g``, the weight gradient), so each comes out
  with its batch dimensions first, in the operand's order otherwise.
  """
  def rule(ct, x, y, *, out_dtype, reduce_dtype, dimension_numbers, precision,
           preferred_element_type, out_sharding):
    del out_dtype, preferred_element_type, out_sharding
    (lc, rc), (lb, rb) = dimension_numbers
    u, k = (x, y) if side == 0 else (y, x)
    (uc, kc), (ub, kb) = ((lc, rc), (lb, rb)) if side == 0 else ((rc, lc),
                                                                 (rb, lb))
    u_aval = u.aval
    uf, kf = _free(u_aval.ndim, uc, ub), _free(np.ndim(k), kc, kb)
    nb, nlf = len(ub), len(uf if side == 0 else kf)  # lhs's free dims
    ct_b = tuple(range(nb))
    ct_kf = (tuple(range(nb + nlf, np.ndim(ct))) if side == 0
             else tuple(range(nb, nb + nlf)))
    # Output positions of u's dimensions: batch first, then the free
    # dimensions of the dot's lhs, then of its rhs (k's contracted ones,
    # in increasing order).
    free_at, contracted_at = (nb, nb + len(uf)) if side == 0 else (
        nb + len(kc), nb)
    sorted_kc = sorted(kc)
    where = {d: i for i, d in enumerate(ub)}
    where.update({d: free_at + j for j, d in enumerate(uf)})
    where.update({d_u: contracted_at + sorted_kc.index(d_k)
                  for d_u, d_k in zip(uc, kc)})
    ct = lax.convert_element_type(ct, k.dtype)
    operands, dims = ((ct, k), ((ct_kf, tuple(kf)), (ct_b, tuple(kb)))) if (
        side == 0) else ((k, ct), ((tuple(kf), ct_kf), (tuple(kb), ct_b)))
    out = bind("dot_general", *operands, dict(
        dimension_numbers=dims, precision=precision,
        out_sharding=_sharding_at(u_aval, where)), u_aval.dtype, reduce_dtype)
    perm = tuple(where[d] for d in range(u_aval.ndim))
    return out if perm == tuple(range(len(perm))) else lax.transpose(out, perm)
  return rule


def _sharding_at(aval, where):
  """The sharding of a cotangent as its dot produces it, or None.

  Under explicit mesh axes a dot that contracts a sharded dimension (a weight
  gradient contracts the sharded batch) must be told its output's sharding:
  the operand's own, with dimension ``d`` at position ``where[d]``.
  """
  sharding = getattr(aval, "sharding", None)
  spec = getattr(sharding, "spec", None)
  mesh = getattr(sharding, "mesh", None)
  if spec is None or mesh is None or getattr(mesh, "empty", True):
    return None
  spec = tuple(spec) + (None,) * (aval.ndim - len(spec))
  out = [None] * aval.ndim
  for d, pos in where.items():
    out[pos] = spec[d]
  return sharding.update(spec=jax.sharding.PartitionSpec(*out))


def _dot_batch(args, dims, *, dimension_numbers, out_sharding, **params):
  """Moves each batch dimension into the product: nothing is broadcast."""
  (lhs, rhs), (ld, rd) = args, dims
  (lc, rc), (lb, rb) = dimension_numbers
  up = lambda ds: tuple(d + 1 for d in ds)
  if ld is not None:
    lhs = jnp.moveaxis(lhs, ld, 0)
  if rd is not None:
    rhs = jnp.moveaxis(rhs, rd, 0)
  if ld is not None and rd is not None:
    new = ((up(lc), up(rc)), ((0, *up(lb)), (0, *up(rb))))
    out_dim = 0
  elif ld is not None:
    new = ((up(lc), rc), (up(lb), rb))
    out_dim = len(lb)
  else:
    new = ((lc, up(rc)), (lb, up(rb)))
    out_dim = len(lb) + np.ndim(lhs) - len(lc) - len(lb)
  if out_sharding is not None:
    spec = list(out_sharding.spec)
    spec.insert(out_dim, None)
    out_sharding = out_sharding.update(spec=jax.sharding.PartitionSpec(*spec))
  lhs, rhs = _match_vma(lhs, rhs)
  out = dot_p.bind(lhs, rhs, dimension_numbers=new, out_sharding=out_sharding,
                   **params)
  return out, out_dim


_internals.define_bilinear(dot_p, _dot_cotangent(0), _dot_cotangent(1))
_internals.define_batching(dot_p, _dot_batch)


# --- Convolutions: JAX's own rules, rewritten ---------------------------------------
# A convolution's transposes and batching rule are themselves convolutions
# (flipped kernels, dilations, feature groups): JAX's rules for the narrow
# convolution, traced and rewritten, accumulate in float32 like the original.


def _narrow(params):
  return dict(_base_params(params), preferred_element_type=None)


def _conv_transpose(side):
  def rule(ct, x, y, *, out_dtype, **params):
    del out_dtype
    reduce_dtype = params["reduce_dtype"]
    base = _internals.base_transpose(lax.conv_general_dilated_p)
    undefined = x if side == 0 else y
    dtype = undefined.aval.dtype
    ct = lax.convert_element_type(ct, dtype)

    def narrow(ct, known):
      operands = (undefined, known) if side == 0 else (known, undefined)
      return base(ct, *operands, **_narrow(params))[side]

    return _rewritten(narrow, ct, y if side == 0 else x,
                      reduce_dtype=reduce_dtype)
  return rule


def _conv_batch(args, dims, *, out_dtype, **params):
  def narrow(lhs, rhs):
    return jax.vmap(
        lambda a, b: lax.conv_general_dilated_p.bind(a, b, **_narrow(params)),
        in_axes=dims)(lhs, rhs)
  return _rewritten(narrow, *args, out_dtype=out_dtype,
                    reduce_dtype=params["reduce_dtype"]), 0


def is_narrow_matmul(eqn) -> bool:
  """Whether ``eqn`` is a half x half product that does not accumulate wider."""
  if eqn.primitive.name not in BY_BASE or len(eqn.invars) != 2:
    return False
  lhs, rhs = (np.dtype(v.aval.dtype) for v in eqn.invars)
  pref = eqn.params.get("preferred_element_type")
  return (lhs == rhs and _dtypes.is_narrow_float(lhs)
          and (pref is None or np.dtype(pref) == lhs))


def _rewritten(fun, *args, out_dtype=None, reduce_dtype=None):
  """``fun`` (lax code on narrow operands) with its products accumulating in f32.

  With ``out_dtype``, each product's result is produced in ``out_dtype``
  instead of rounded to the operands' dtype, and what follows it (the
  reshapes and transposes of a batching rule, which work in any dtype) runs
  on that: a float32 result stays unrounded.
  """
  closed = jax.make_jaxpr(fun)(*args)

  def eval_eqn(eqn, invals):
    if is_narrow_matmul(eqn):
      dtype = out_dtype or eqn.outvars[0].aval.dtype
      params = {k: v for k, v in eqn.params.items()
                if k != "preferred_element_type"}
      return bind(eqn.primitive.name, *invals, params, dtype, reduce_dtype)
    return _internals.bind(eqn, invals)

  out, = _internals.eval_jaxpr(closed.jaxpr, closed.consts, args, eval_eqn)
  return out if out_dtype is None else lax.convert_element_type(out, out_dtype)


_internals.define_bilinear(conv_p, _conv_transpose(0), _conv_transpose(1))
_internals.define_batching(conv_p, _conv_batch)
