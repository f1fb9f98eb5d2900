"""The benchmarked models, in plain Flax Linen, and the same models by hand.

Three workloads, shared by the ``steps``, ``memory`` and ``telemetry``
sections:

* ``mlp``: Dense layers of equal width with ReLU, softmax cross-entropy.
* ``mlp_ln``: Dense layers of equal width, each followed by a LayerNorm and
  a GELU (the model on which a wrapped bf16 step was measured at 1.16x the
  hand-written one on an AVX2 CPU, where the other two read 0.94-0.99x).
* ``transformer``: one pre-LayerNorm block (multi-head self-attention + a 4x
  GELU MLP, both residual), a final LayerNorm and a Dense head, with a
  per-token softmax cross-entropy.

Each workload gives:

* `Workload.module(dtype)`: the Flax module. ``dtype=None`` is the model as a
  float32 user writes it; ``dtype=jnp.bfloat16`` is the "naive Flax" way
  (every layer's ``dtype`` set, parameters left float32).
* `Workload.hand_apply(params, x, ops)`: the same function on the same
  parameter tree, written by hand in bfloat16 with explicit ``astype`` casts
  (LayerNorm statistics, softmax and logits in float32). ``ops`` decides how
  the matrix multiplies are done, see `HAND_OPS`.

Why two kinds of hand-written matmul: ``lax.dot_general(bf16, bf16,
preferred_element_type=f32)`` gets the fast bf16 kernels in the forward pass,
but JAX's transpose rule then multiplies the float32 cotangent with the bf16
operand, which XLA:CPU runs as float32 x float32: two thirds of the matmul
FLOPs of a train step stay in float32. `dense_bf16_vjp` defines the backward
pass itself (bf16 operands, f32 accumulation) and feeds the weight-gradient
product a physically transposed activation, because XLA:CPU's bf16 kernels do
not take a left operand contracted over its leading dimension (it silently
upcasts that dot to float32; `harness.dot_census` shows it). On a GPU both run
on the tensor cores; the copy only costs memory traffic there.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax import lax

F32 = jnp.float32
BF16 = jnp.bfloat16


# ---------------------------------------------------------------------------
# Flax models


class MLP(nn.Module):
  """Dense layers of the given output widths, ReLU between them (with
  ``layer_norm``: a LayerNorm, then GELU)."""

  widths: tuple[int, ...]
  dtype: Any = None
  layer_norm: bool = False

  @nn.compact
  def __call__(self, x):
    for i, width in enumerate(self.widths):
      x = nn.Dense(width, dtype=self.dtype, name=f"dense{i}")(x)
      if i < len(self.widths) - 1:
        x = (nn.gelu(nn.LayerNorm(dtype=self.dtype, name=f"ln{i}")(x))
             if self.layer_norm else nn.relu(x))
    return x


class Block(nn.Module):
  """Pre-LayerNorm transformer block: x + MHA(LN(x)), then x + MLP(LN(x))."""

  num_heads: int
  mlp_ratio: int = 4
  dtype: Any = None

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    h = nn.LayerNorm(dtype=self.dtype, name="ln1")(x)
    h = nn.MultiHeadDotProductAttention(
        self.num_heads, dtype=self.dtype, name="attn")(h)
    x = x + h
    h = nn.LayerNorm(dtype=self.dtype, name="ln2")(x)
    h = nn.Dense(d * self.mlp_ratio, dtype=self.dtype, name="mlp_in")(h)
    h = nn.gelu(h)
    h = nn.Dense(d, dtype=self.dtype, name="mlp_out")(h)
    return x + h


class TransformerModel(nn.Module):
  """One `Block`, a final LayerNorm and a per-token Dense head."""

  num_heads: int
  num_classes: int
  dtype: Any = None

  @nn.compact
  def __call__(self, x):
    x = Block(self.num_heads, dtype=self.dtype, name="block")(x)
    x = nn.LayerNorm(dtype=self.dtype, name="ln_f")(x)
    return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x)


# ---------------------------------------------------------------------------
# Hand-written bf16 matmuls


def _dot_f32acc(x, w, dims):
  """bf16 x bf16 with float32 accumulation, rounded to bf16 once."""
  return lax.dot_general(x, w, (dims, ((), ())),
                         preferred_element_type=F32).astype(x.dtype)


def dense_bf16_fwd(x, w):
  """``x @ w`` over the last axis of x, f32 accumulation; autodiff backward."""
  return _dot_f32acc(x, w, ((x.ndim - 1,), (0,)))


def _physical_transpose(x2d):
  """``x2d.T``, materialised in row-major order.

  XLA folds a plain transpose into the dot's dimension numbers, which puts the
  contracting dimension of the left operand first: a layout XLA:CPU's bf16
  kernels refuse (the dot is upcast to f32). Flattening behind an optimization
  barrier forces the copy.
  """
  rows, cols = x2d.shape
  return lax.optimization_barrier(x2d.T.reshape(-1)).reshape(cols, rows)


@jax.custom_vjp
def dense_bf16_vjp(x, w):
  """``x @ w`` whose backward pass also runs bf16 x bf16 -> f32."""
  return dense_bf16_fwd(x, w)


def _dense_vjp_fwd(x, w):
  return dense_bf16_fwd(x, w), (x, w)


def _dense_vjp_bwd(res, g):
  x, w = res
  g2 = g.reshape(-1, g.shape[-1])
  x2 = x.reshape(-1, x.shape[-1])
  dx = _dot_f32acc(g2, w, ((1,), (1,))).reshape(x.shape)  # g @ w.T
  dw = _dot_f32acc(_physical_transpose(x2), g2, ((1,), (0,)))  # x.T @ g
  return dx, dw.astype(w.dtype)


dense_bf16_vjp.defvjp(_dense_vjp_fwd, _dense_vjp_bwd)


def _batch_dims(x):
  return tuple(range(x.ndim - 2))


def bmm_bf16_fwd(a, b):
  """Batched ``a @ b`` on ``[..., m, k] x [..., k, n]``, f32 accumulation."""
  bd = _batch_dims(a)
  return lax.dot_general(a, b, (((a.ndim - 1,), (b.ndim - 2,)), (bd, bd)),
                         preferred_element_type=F32).astype(a.dtype)


def bmm_nt_bf16_fwd(a, b):
  """Batched ``a @ b^T`` on ``[..., m, k] x [..., n, k]``, f32 accumulation."""
  bd = _batch_dims(a)
  return lax.dot_general(a, b, (((a.ndim - 1,), (b.ndim - 1,)), (bd, bd)),
                         preferred_element_type=F32).astype(a.dtype)


def _physical_swap(x):
  """``swapaxes(x, -1, -2)`` materialised (see `_physical_transpose`)."""
  shape = x.shape[:-2] + (x.shape[-1], x.shape[-2])
  return lax.optimization_barrier(jnp.swapaxes(x, -1, -2).reshape(-1)).reshape(shape)


def _row_major(x):
  """``x`` materialised in row-major order, whatever view it came from.

  A batched dot whose operand is a transposed view (attention's heads axis
  moved in front of the sequence axis) gets a non-row-major layout, and
  XLA:CPU runs such a bf16 dot in float32.
  """
  return lax.optimization_barrier(x.reshape(-1)).reshape(x.shape)


@jax.custom_vjp
def bmm_bf16_vjp(a, b):
  """`bmm_bf16_fwd` on row-major operands, backward pass bf16 x bf16 -> f32."""
  return bmm_bf16_fwd(_row_major(a), _row_major(b))


def _bmm_vjp_fwd(a, b):
  a, b = _row_major(a), _row_major(b)
  return bmm_bf16_fwd(a, b), (a, b)


def _bmm_vjp_bwd(res, g):
  a, b = res
  g = _row_major(g)
  return bmm_nt_bf16_fwd(g, b), bmm_bf16_fwd(_physical_swap(a), g)


bmm_bf16_vjp.defvjp(_bmm_vjp_fwd, _bmm_vjp_bwd)


@jax.custom_vjp
def bmm_nt_bf16_vjp(a, b):
  """`bmm_nt_bf16_fwd` on row-major operands, backward bf16 x bf16 -> f32."""
  return bmm_nt_bf16_fwd(_row_major(a), _row_major(b))


def _bmm_nt_vjp_fwd(a, b):
  a, b = _row_major(a), _row_major(b)
  return bmm_nt_bf16_fwd(a, b), (a, b)


def _bmm_nt_vjp_bwd(res, g):
  a, b = res
  g = _row_major(g)
  return bmm_bf16_fwd(g, b), bmm_bf16_fwd(_physical_swap(g), a)


bmm_nt_bf16_vjp.defvjp(_bmm_nt_vjp_fwd, _bmm_nt_vjp_bwd)


class HandOps(NamedTuple):
  """How a hand-written model multiplies.

  ``dense(x, w)``: ``x[..., k] @ w[k, n]``; ``bmm(a, b)``: batched
  ``[..., m, k] @ [..., k, n]``; ``bmm_nt(a, b)``: batched ``a @ b^T``.
  Attention is written with its batch and head axes leading, the layout in
  which XLA:CPU's bf16 kernels take every batched dot (an einsum with the
  batch axes elsewhere compiled, in the backward pass, to a bf16 dot that
  XLA:CPU then refused to run: "Unsupported element type for
  DotThunk::Execute: BF16 x BF16 = F32").
  """

  dense: Callable
  bmm: Callable
  bmm_nt: Callable


HAND_OPS = {
    # dot_general(preferred_element_type=f32) in the forward pass, JAX's
    # autodiff for the backward pass (which XLA:CPU runs in f32, see above).
    "autodiff": HandOps(dense_bf16_fwd, bmm_bf16_fwd, bmm_nt_bf16_fwd),
    # custom_vjp: bf16 operands with f32 accumulation in both passes.
    "custom_vjp": HandOps(dense_bf16_vjp, bmm_bf16_vjp, bmm_nt_bf16_vjp),
}


# ---------------------------------------------------------------------------
# Hand-written models (same parameter trees as the Flax ones)


def _layer_norm(x, p, dtype, eps=1e-6):
  """Flax's LayerNorm (fast variance), statistics in float32."""
  x32 = x.astype(F32)
  mean = jnp.mean(x32, axis=-1, keepdims=True)
  var = jnp.maximum(jnp.mean(x32 * x32, axis=-1, keepdims=True) - mean * mean, 0.0)
  y = (x32 - mean) * lax.rsqrt(var + eps)
  return (y * p["scale"] + p["bias"]).astype(dtype)


def _linear(ops, x, p, dtype):
  return ops.dense(x, p["kernel"].astype(dtype)) + p["bias"].astype(dtype)


def hand_mlp(params, x, ops: HandOps, dtype=BF16):
  """`MLP` by hand; its LayerNorm variant where the parameters have ``ln0``."""
  h = x.astype(dtype)
  n = sum(1 for k in params if k.startswith("dense"))
  for i in range(n):
    h = _linear(ops, h, params[f"dense{i}"], dtype)
    if i < n - 1:
      h = (jax.nn.gelu(_layer_norm(h, params[f"ln{i}"], dtype), approximate=True)
           if "ln0" in params else jax.nn.relu(h))
  return h.astype(F32)


def hand_transformer(params, x, ops: HandOps, dtype=BF16):
  p = params["block"]
  a = p["attn"]
  x = x.astype(dtype)
  bsz, seq, d = x.shape
  heads, head_dim = a["query"]["bias"].shape

  h = _layer_norm(x, p["ln1"], dtype)

  def project(name):  # DenseGeneral(features=(heads, head_dim))
    k = a[name]["kernel"].astype(dtype).reshape(d, heads * head_dim)
    y = ops.dense(h, k).reshape(bsz, seq, heads, head_dim)
    return y + a[name]["bias"].astype(dtype)

  # [b, s, h, d] -> [b, h, s, d]
  q, k, v = (project(n).transpose(0, 2, 1, 3) for n in ("query", "key", "value"))
  q = q / jnp.sqrt(head_dim).astype(dtype)
  scores = ops.bmm_nt(q, k)  # [b, h, q, k]
  weights = jax.nn.softmax(scores.astype(F32), axis=-1).astype(dtype)
  o = ops.bmm(weights, v).transpose(0, 2, 1, 3).reshape(bsz, seq, heads * head_dim)
  o = ops.dense(o, a["out"]["kernel"].astype(dtype).reshape(heads * head_dim, d))
  x = x + o + a["out"]["bias"].astype(dtype)

  h = _layer_norm(x, p["ln2"], dtype)
  h = jax.nn.gelu(_linear(ops, h, p["mlp_in"], dtype), approximate=True)
  x = x + _linear(ops, h, p["mlp_out"], dtype)

  x = _layer_norm(x, params["ln_f"], dtype)
  return _linear(ops, x, params["head"], dtype).astype(F32)


# ---------------------------------------------------------------------------
# Workloads


@dataclasses.dataclass(frozen=True)
class Workload:
  """A model, its data and its hand-written twin.

  Attributes:
    name: short name used in tables ("mlp", "transformer").
    description: sizes, for the table notes.
    module: dtype -> Flax module (``None``: as written for float32).
    hand_apply: (params, x, ops) -> float32 logits, written by hand in bf16.
    x_shape, num_classes: the batch is ``x ~ N(0, 1)`` of ``x_shape`` and
      integer labels over ``num_classes`` for every leading position.
  """

  name: str
  description: str
  module: Callable[[Any], nn.Module]
  hand_apply: Callable[..., jax.Array]
  x_shape: tuple[int, ...]
  num_classes: int

  def batch(self, seed: int = 0):
    return _make_batch(seed, self.x_shape, self.num_classes)

  def init(self, seed: int = 0):
    """float32 parameters (the same tree whatever the layers' ``dtype``)."""
    x, _ = self.batch(seed)
    # Jitted: eager Flax init compiles every small op separately (seconds).
    init = jax.jit(self.module(None).init)
    return init(jax.random.PRNGKey(seed + 1), x)["params"]

  def apply(self, params, x, dtype: Optional[Any] = None):
    return self.module(dtype).apply({"params": params}, x)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _make_batch(seed, x_shape, num_classes):
  kx, ky = jax.random.split(jax.random.PRNGKey(seed))
  x = jax.random.normal(kx, x_shape, F32)
  y = jax.random.randint(ky, x_shape[:-1], 0, num_classes)
  return x, y


def cross_entropy(logits, labels):
  """Mean softmax cross-entropy, always computed in float32."""
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(F32), labels).mean()


# Sizes by `harness.Context.size_key`: the CPU sizes ("full", "quick"), the
# GPU/TPU sizes ("gpu", "gpu_quick": large enough that the matmuls, not the
# launches, dominate) and the dry run's ("dry": every code path, in seconds).
MLP_SIZES = {  # batch, width, layers
    "full": (256, 1024, 4), "quick": (64, 256, 4), "dry": (8, 32, 4),
    "gpu": (2048, 4096, 4), "gpu_quick": (512, 2048, 4)}
TRANSFORMER_SIZES = {  # batch, seq, d_model, heads, classes
    "full": (16, 128, 256, 4, 256), "quick": (8, 64, 128, 2, 128),
    "dry": (2, 8, 32, 2, 16),
    "gpu": (16, 512, 1024, 16, 1024), "gpu_quick": (8, 256, 512, 8, 512)}


def _size_key(size) -> str:
  if isinstance(size, bool):  # the former `quick` flag
    return "quick" if size else "full"
  return size


def mlp(size="full", layer_norm: bool = False) -> Workload:
  """The MLP at ``size``: a key of `MLP_SIZES` (or ``True`` for "quick");
  with ``layer_norm``, the ``mlp_ln`` workload."""
  batch, width, layers = MLP_SIZES[_size_key(size)]
  widths = (width,) * layers
  between = "each LayerNorm + GELU" if layer_norm else "ReLU"
  return Workload(
      name="mlp_ln" if layer_norm else "mlp",
      description=(f"MLP{' with LayerNorm' if layer_norm else ''}: {layers} Dense "
                   f"layers {width}->{width} ({between}), batch {batch}, {width} classes"),
      module=lambda dtype: MLP(widths, dtype=dtype, layer_norm=layer_norm),
      hand_apply=hand_mlp,
      x_shape=(batch, width), num_classes=width)


mlp_ln = functools.partial(mlp, layer_norm=True)


def transformer(size="full") -> Workload:
  """The transformer at ``size``: a key of `TRANSFORMER_SIZES`."""
  batch, seq, d, heads, classes = TRANSFORMER_SIZES[_size_key(size)]
  return Workload(
      name="transformer",
      description=(f"Transformer block: d_model {d}, {heads} heads, MLP 4x, "
                   f"seq {seq}, batch {batch}, head of {classes} classes"),
      module=lambda dtype: TransformerModel(heads, classes, dtype=dtype),
      hand_apply=hand_transformer,
      x_shape=(batch, seq, d), num_classes=classes)


WORKLOADS = {"mlp": mlp, "mlp_ln": mlp_ln, "transformer": transformer}
