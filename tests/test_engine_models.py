"""The precision engine on Flax models: lifted transforms inside, JAX transforms outside.

`jmp_lite.flax.wrap` rewrites every bf16 ``dot_general`` and
``conv_general_dilated`` of a model into a float32-accumulating primitive,
including those inside ``scan``/``remat``/``vmap`` bodies that Flax's lifted
transforms (Linen ``nn.scan``/``nn.remat``/``nn.vmap``/``nn.RNN``, NNX
``nnx.scan``/``nnx.remat``/``nnx.vmap``) create, and the rewrite must compose
with ``jax.grad``/``jvp``/``hessian``/``jacfwd``/``jacrev``/``vmap`` applied
outside the wrapped model. The tests check it against two oracles that are
not jmp_lite's numerics:

* the jaxpr, through `jmp_lite.audit`: no ``half_matmul`` row (a bf16 product
  accumulating in bf16), and exactly as many bf16 x bf16 -> float32 matmul and
  convolution rows as the *unwrapped* model's jaxpr has matmuls and
  convolutions, so none slipped through the rewrite;
* the values of the same model, same variables, run in float32 by plain Flax
  and JAX.

Variables are shaped by the wrapped model's ``init`` (traced) and drawn by
NumPy (`_fill`): XLA:CPU takes seconds to compile each model's initializers.

Tolerances. Inputs, parameters and every activation are rounded to bf16
(unit roundoff 2**-9 ~ 2e-3). Errors are relative errors of the norm of a
whole pytree (all gradient leaves together), not per leaf: some leaves have
an exact gradient of zero (the attention key bias: softmax is invariant to
adding ``q . b_k`` to every logit), whose float32 value is rounding noise.
Measured on these models: forward and parameter gradients <= 0.9%; JVPs,
Jacobians and input gradients <= 1.4% (they go through gelu's derivative,
evaluated in bf16). ``TOL = 2e-2`` covers them with some headroom. The
Hessian goes through gelu's *second* derivative in bf16, with cancellation:
2.9% here and 0.8-3.1% over other draws of the same model, bit-identical to
Flax's own bf16 model (``nn.Dense(dtype=bfloat16)``), so ``HESSIAN_TOL =
5e-2``. The models use smooth activations and average pooling: with ReLU and
max-pooling the gradient is discontinuous, and rounding only the *inputs* of
a float32 conv net to bf16 moved its gradient by 46% (a property of the
model, not of the engine).

Compilation: a wrapped model's eager ``apply`` (Linen) or call (NNX) compiles
on its first call only (`jmp_lite.testing.count_compilations`, i.e.
``jax.monitoring`` backend-compile events).

Two Linen cases were jmp_lite bugs, fixed: ``nn.RNN`` with the carry it makes
itself (a carry comes back in the dtypes it came in), and the variable layout
of a submodule passed to another module as an attribute (the interceptor's
clone is not deep).
"""

import functools
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_lite
import jmp_lite.auditing
import jmp_lite.flax
import jmp_lite.testing

BF16 = "p=f32,c=bf16,o=f32"
TOL = 2e-2
HESSIAN_TOL = 5e-2
KINDS = ("matmul", "conv")
# The flags about matmuls, which the engine is responsible for. The others
# (16-bit exp/log and sums, ...) are about elementwise code, which a bf16
# policy runs in bf16 by design.
ENGINE_FLAGS = ("half_matmul", "f32_matmul")
OTHER_FLAGS = tuple(f for f in jmp_lite.auditing.FLAGS if f not in ENGINE_FLAGS)


# Oracles ----------------------------------------------------------------------


def _normal(shape, seed):
  """A float32 standard-normal array drawn by NumPy.

  Not `jax.random`: XLA:CPU takes seconds to compile a 4-D random draw, and
  the inputs need no JAX.
  """
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal(shape, dtype=np.float32))


def _fill(shapes, seed):
  """Parameters for a tree of shapes, drawn by NumPy, no initializer compiled.

  Kernels are normal with variance ``1 / prod(shape[:-1])``: lecun_normal's
  for dense and conv kernels, smaller for stacked (scanned, vmapped) and
  multi-head ones. Biases are normal with scale 0.1 (not zero, so they take
  part). Integer leaves are zeros, RNG keys ``jax.random.key(seed)``.

  Args:
    shapes: a pytree of ``jax.ShapeDtypeStruct`` (an ``eval_shape`` of an
      ``init``, an ``nnx.State``).
    seed: NumPy seed.
  """
  rng = np.random.default_rng(seed)

  def leaf(path, s):
    if jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key):
      return jax.random.key(seed)
    if not jnp.issubdtype(s.dtype, jnp.floating):
      return jnp.zeros(s.shape, s.dtype)
    if "bias" in jax.tree_util.keystr(path):
      scale = 0.1
    else:
      scale = 1 / np.sqrt(np.prod(s.shape[:-1]))
    return jnp.asarray(rng.standard_normal(s.shape, np.float32) * scale,
                       s.dtype)

  return jax.tree_util.tree_map_with_path(leaf, shapes)


def _rel_err(got, want):
  """``|got - want| / |want|`` over all leaves of two pytrees, in float64."""
  got = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(got)]
  want = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(want)]
  assert len(got) == len(want) and got
  diff = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(got, want)))
  return diff / np.sqrt(sum(np.sum(b ** 2) for b in want))


def _assert_close(got, want, what, tol=TOL):
  assert all(np.dtype(x.dtype) == np.float32 for x in jax.tree.leaves(got)), (
      what, jax.tree.map(lambda x: x.dtype, got))
  err = _rel_err(got, want)
  assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def _assert_engine_covers(wrapped, reference, kinds=("matmul",)):
  """Audits of a wrapped and an unwrapped (float32) computation agree.

  Args:
    wrapped: `jmp_lite.audit` of the computation through the wrapped model.
    reference: `jmp_lite.audit` of the same computation, unwrapped.
    kinds: the categories that must occur (``matmul``, ``conv``).
  """
  assert wrapped.count(flag="half_matmul") == 0, wrapped
  for kind in KINDS:
    total = wrapped.count(category=kind)
    narrow_f32 = wrapped.count(category=kind, operand_dtype="bf16",
                               accumulation=jnp.float32)
    # Every product is bf16 x bf16 -> f32, and there are as many as the f32
    # model has: none left in bf16, none moved to f32, none lost. (A product
    # JAX writes as bf16 x bf16 -> f32, as `jax.nn.dot_product_attention`
    # writes its logits, too: its transposes took the float32 cotangent
    # times a bf16 operand before the engine took such products.)
    assert total == reference.count(category=kind), (
        kind, total, reference.count(category=kind), str(wrapped))
    assert narrow_f32 == total, (kind, narrow_f32, str(wrapped))
    if kind in kinds:
      assert narrow_f32 >= 1, (kind, str(wrapped))
  # The audit's own verdict agrees (with the policy, f32 matmuls are flagged).
  wrapped.assert_clean(allow=OTHER_FLAGS)


def _audit(fun, *args):
  """The audit of ``fun(*args)`` (traced, not run) against the bf16 policy."""
  return jmp_lite.audit(fun, *args, policy=BF16)


def _vjp_loss(fun, cot):
  """``sum(fun(params, x) * cot)``: its gradient is the VJP with ``cot``."""
  return lambda params, x: jnp.sum(fun(params, x) * cot)


def _forward_and_vjp(fun, cot):
  """One jitted program: ``fun(params, x)`` and the gradient of its VJP loss."""
  def run(params, x):
    out, vjp = jax.vjp(lambda p: fun(p, x), params)
    return out, vjp(cot)[0]
  return jax.jit(run)


def _check_model(fun, ref, params, x, kinds):
  """The engine's audit and the float32 values of forward and gradients.

  Args:
    fun: ``fun(params, x)`` through the wrapped model.
    ref: ``ref(params, x)`` through the unwrapped model (same params).
    params: float32 parameters of both.
    x: a float32 input.
    kinds: the categories (``matmul``, ``conv``) the model must have.
  """
  cot = _normal(jax.eval_shape(ref, params, x).shape, seed=2)
  loss, ref_loss = _vjp_loss(fun, cot), _vjp_loss(ref, cot)
  _assert_engine_covers(_audit(fun, params, x), _audit(ref, params, x), kinds)
  _assert_engine_covers(_audit(jax.grad(loss), params, x),
                        _audit(jax.grad(ref_loss), params, x), kinds)
  out, grads = _forward_and_vjp(fun, cot)(params, x)
  ref_out, ref_grads = _forward_and_vjp(ref, cot)(params, x)
  _assert_close(out, ref_out, "forward")
  _assert_close(grads, ref_grads, "gradients")
  assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)


# Linen models -----------------------------------------------------------------


class ScanBlock(nn.Module):
  """Dense + gelu + Dense with a residual, scanned over layers."""

  @nn.compact
  def __call__(self, x, _):
    return x + nn.Dense(16)(nn.gelu(nn.Dense(32)(x))), None


class LinenScan(nn.Module):

  @nn.compact
  def __call__(self, x):
    stack = nn.scan(ScanBlock, variable_axes={"params": 0},
                    split_rngs={"params": True}, length=4)
    x, _ = stack()(x, None)
    return nn.Dense(4)(x)


class Block(nn.Module):

  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(16)(nn.gelu(nn.Dense(32)(x)))


class LinenRemat(nn.Module):
  """Two rematerialized blocks, under a ``jax.checkpoint_policies`` policy.

  With a policy that saves matmuls, the gradient has as many matmuls as
  without remat; `_assert_engine_covers` counts them against the float32
  model, so a policy blind to the engine's primitive (every matmul
  recomputed) fails it.
  """
  policy: Any = None

  @nn.compact
  def __call__(self, x):
    x = nn.remat(Block, policy=self.policy)()(x)
    x = nn.remat(Block, policy=self.policy)()(x)
    return nn.Dense(4)(x)


class LinenVmap(nn.Module):
  """An ensemble: each of 3 Dense layers sees its own slice of the input."""

  @nn.compact
  def __call__(self, x):
    dense = nn.vmap(nn.Dense, variable_axes={"params": 0},
                    split_rngs={"params": True}, in_axes=0, out_axes=0)
    return dense(8)(x)


class LinenLSTM(nn.Module):
  """``nn.RNN(nn.LSTMCell)`` built in ``setup``, given its initial carry.

  `test_linen_rnn_default_carry` runs it with the carry it makes itself.
  """

  def setup(self):
    self.rnn = nn.RNN(nn.LSTMCell(features=16))
    self.head = nn.Dense(4)

  def __call__(self, x):
    zeros = jnp.zeros((x.shape[0], 16), jnp.float32)
    return self.head(self.rnn(x, initial_carry=(zeros, zeros))[:, -1])


class LinenAttention(nn.Module):

  @nn.compact
  def __call__(self, x):
    y = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)(x)
    return nn.Dense(4)(x + y)


def _avg_pool(x):
  """2x2 average pooling, as ``nn.avg_pool`` computes it.

  Not ``nn.avg_pool`` itself: it divides by ``np.prod(window)``, a NumPy
  integer, which strict promotion rejects for bf16 inputs (with or without
  jmp_lite). Not max-pooling: its gradient jumps when rounding to bf16 flips
  an argmax, which no tolerance covers.
  """
  return nn.pool(x, 0.0, jax.lax.add, (2, 2), (2, 2), "VALID") * 0.25


class LinenConv(nn.Module):
  """Conv + average pool twice, then Dense. Works batched or on one image."""

  @nn.compact
  def __call__(self, x):
    for _ in range(2):
      x = _avg_pool(nn.gelu(nn.Conv(8, (3, 3))(x)))
    return nn.Dense(4)(x.reshape(*x.shape[:-3], -1))


LINEN = {
    "scan": (LinenScan, (4, 16), ("matmul",)),
    "remat": (LinenRemat, (4, 16), ("matmul",)),
    "remat_dots_saveable": (
        functools.partial(LinenRemat,
                          policy=jax.checkpoint_policies.dots_saveable),
        (4, 16), ("matmul",)),
    "remat_dots_with_no_batch_dims_saveable": (
        functools.partial(
            LinenRemat,
            policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
        (4, 16), ("matmul",)),
    "vmap": (LinenVmap, (3, 4, 16), ("matmul",)),
    "lstm": (LinenLSTM, (2, 5, 8), ("matmul",)),
    "attention": (LinenAttention, (2, 5, 16), ("matmul",)),
    "conv": (LinenConv, (2, 8, 8, 3), ("matmul", "conv")),
}


@functools.cache
def _linen(name):
  """(model, wrapped, variables, x) of a `LINEN` case."""
  cls, shape, _ = LINEN[name]
  x = _normal(shape, 1)
  model = cls()
  wrapped = jmp_lite.flax.wrap(model, BF16)
  # Traced, not compiled: XLA:CPU takes seconds to compile each model's
  # initializers, and the values need only be the same for both models.
  variables = _fill(jax.eval_shape(wrapped.init, jax.random.key(0), x), 0)
  return model, wrapped, variables, x


@pytest.mark.parametrize("name", LINEN)
def test_linen_init_keeps_layout_and_dtypes(name):
  """The wrapped ``init`` makes the float32 model's variables (p=f32)."""
  model, _, variables, x = _linen(name)
  reference = jax.eval_shape(model.init, jax.random.key(0), x)
  assert jax.tree.structure(variables) == jax.tree.structure(reference)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), variables) == jax.tree.map(
      lambda a: (a.shape, a.dtype), reference)


@pytest.mark.parametrize("name", LINEN)
def test_linen_forward_and_grad(name):
  model, wrapped, variables, x = _linen(name)
  kinds = LINEN[name][2]
  rest = {k: v for k, v in variables.items() if k != "params"}
  fun = lambda p, x: wrapped.apply({**rest, "params": p}, x)
  ref = lambda p, x: model.apply({**rest, "params": p}, x)
  _check_model(fun, ref, variables["params"], x, kinds)


class _RNNDefaultCarry(nn.Module):
  """``nn.RNN(nn.LSTMCell)`` making its own initial carry, built in ``setup``.

  (Built inline, as Flax's docs do: `tests/test_wrap_structure.py`.)
  """

  def setup(self):
    self.rnn = nn.RNN(nn.LSTMCell(features=4))

  def __call__(self, x):
    return self.rnn(x)


def test_linen_rnn_default_carry():
  model = _RNNDefaultCarry()
  wrapped = jmp_lite.flax.wrap(model, BF16)
  x = _normal((2, 3, 2), 1)
  variables = _fill(jax.eval_shape(wrapped.init, jax.random.key(0), x), 0)
  _assert_close(jax.jit(wrapped.apply)(variables, x),
                jax.jit(model.apply)(variables, x), "forward")


class _Apply(nn.Module):
  """Calls a module given as an attribute (as nn.RNN calls its cell)."""
  inner: nn.Module

  @nn.compact
  def __call__(self, x):
    return self.inner(x)


class _Adopting(nn.Module):

  @nn.compact
  def __call__(self, x):
    return _Apply(nn.Dense(3))(x)  # the Dense belongs to _Adopting: Dense_0


def test_linen_adopted_submodule_layout():
  x = jnp.ones((2, 4))
  for policy in ("f32", BF16):
    wrapped = jmp_lite.flax.wrap(_Adopting(), policy)
    got = jax.eval_shape(wrapped.init, jax.random.key(0), x)
    want = jax.eval_shape(_Adopting().init, jax.random.key(0), x)
    assert jax.tree.structure(got) == jax.tree.structure(want), (policy, got)


# NNX models -------------------------------------------------------------------


class NnxBlock(nnx.Module):

  def __init__(self, rngs):
    self.up = nnx.Linear(16, 32, rngs=rngs)
    self.down = nnx.Linear(32, 16, rngs=rngs)

  def __call__(self, x):
    return x + self.down(nnx.gelu(self.up(x)))


class NnxScan(nnx.Module):
  """4 blocks stacked by ``nnx.vmap`` and run by ``nnx.scan`` (Flax's docs)."""

  def __init__(self, rngs):
    @nnx.split_rngs(splits=4)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return NnxBlock(rngs)

    self.blocks = make(rngs)
    self.head = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, block):
      return block(x)

    return self.head(body(x, self.blocks))


class NnxRemat(nnx.Module):

  def __init__(self, rngs):
    self.block1 = NnxBlock(rngs)
    self.block2 = NnxBlock(rngs)
    self.head = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    run = nnx.remat(lambda block, x: block(x))
    return self.head(run(self.block2, run(self.block1, x)))


class NnxVmap(nnx.Module):
  """An ensemble of 3 Linear layers made and run by ``nnx.vmap``."""

  def __init__(self, rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return nnx.Linear(16, 8, rngs=rngs)

    self.members = make(rngs)

  def __call__(self, x):
    @nnx.vmap(in_axes=(0, 0), out_axes=0)
    def run(member, x):
      return member(x)

    return run(self.members, x)


class NnxAttention(nnx.Module):
  """``nnx.MultiHeadAttention``.

  With ``dropout_rate=0`` NNX calls ``jax.nn.dot_product_attention``, which
  calls ``jnp.promote_types(bf16, np.float32)`` and so fails under strict
  promotion for bf16 inputs (a JAX matter, with or without jmp_lite); a
  nonzero rate (deterministic) selects Flax's own einsum attention. The
  ``dpa`` case runs the default under standard promotion.
  """

  def __init__(self, rngs, dropout_rate=0.1):
    self.attention = nnx.MultiHeadAttention(
        2, 16, qkv_features=16, decode=False, dropout_rate=dropout_rate,
        deterministic=True, rngs=rngs)
    self.head = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.head(x + self.attention(x))


class NnxConv(nnx.Module):

  def __init__(self, rngs):
    self.conv1 = nnx.Conv(3, 8, (3, 3), rngs=rngs)
    self.conv2 = nnx.Conv(8, 8, (3, 3), rngs=rngs)
    self.head = nnx.Linear(32, 4, rngs=rngs)

  def __call__(self, x):
    x = _avg_pool(nnx.gelu(self.conv1(x)))
    x = _avg_pool(nnx.gelu(self.conv2(x)))
    return self.head(x.reshape(x.shape[0], -1))


# name: (class, input shape, categories, promotion).
NNX = {
    "scan": (NnxScan, (4, 16), ("matmul",), "strict"),
    "remat": (NnxRemat, (4, 16), ("matmul",), "strict"),
    "vmap": (NnxVmap, (3, 4, 16), ("matmul",), "strict"),
    "attention": (NnxAttention, (2, 5, 16), ("matmul",), "strict"),
    # jax.nn.dot_product_attention: q.k^T is bf16 x bf16 -> f32 as JAX writes
    # it; its two backward products are bf16 x bf16 -> f32 too.
    "attention_dpa": (functools.partial(NnxAttention, dropout_rate=0.0),
                      (2, 5, 16), ("matmul",), "standard"),
    "conv": (NnxConv, (2, 8, 8, 3), ("matmul", "conv"), "strict"),
}


def _build(cls):
  """An NNX model of class ``cls`` with `_fill` parameters.

  Built abstractly (``nnx.eval_shape``) and filled: eager construction
  compiles every initializer op by op, seconds per model on XLA:CPU.
  """
  abstract = nnx.eval_shape(lambda: cls(rngs=nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  return nnx.merge(graphdef, _fill(params, 0), _fill(rest, 0))


def _pure(module):
  """``(fun, params)``: the module as a function of its parameters."""
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)
  return (lambda params, x: nnx.merge(graphdef, params, rest)(x)), params


@pytest.mark.parametrize("name", NNX)
def test_nnx_forward_and_grad(name):
  cls, shape, kinds, promotion = NNX[name]
  with jax.numpy_dtype_promotion(promotion):
    x = _normal(shape, 1)
    model = _build(cls)
    ref, ref_params = _pure(model)
    ref_params = jax.tree.map(jnp.array, ref_params)  # before wrap shares them
    wrapped = jmp_lite.flax.wrap(model, BF16)
    fun, params = _pure(wrapped)
    # The wrapper's parameters are the model's (p=f32: unchanged), one level
    # down.
    assert (jax.tree.structure(params["module"])
            == jax.tree.structure(ref_params))
    chex.assert_trees_all_equal(params["module"], ref_params)
    # The float32 oracle takes the wrapper's parameter tree: same leaves.
    unwrap = lambda p, x: ref(p["module"], x)
    _check_model(fun, unwrap, params, x, kinds)


def test_nnx_grad_of_wrapper_object():
  """``nnx.grad`` of the wrapper itself, as users write it."""
  model = _build(NnxRemat)
  x = _normal((4, 16), 1)
  ref, ref_params = _pure(model)
  ref_params = jax.tree.map(jnp.array, ref_params)
  wrapped = jmp_lite.flax.wrap(model, BF16)
  grad = nnx.grad(lambda m: jnp.sum(m(x) ** 2))
  ref_grad = jax.grad(lambda p: jnp.sum(ref(p, x) ** 2))
  graphdef, state = nnx.split(wrapped)
  _assert_engine_covers(
      _audit(lambda state: grad(nnx.merge(graphdef, state)), state),
      _audit(ref_grad, ref_params))
  got = nnx.jit(grad)(wrapped)
  assert jax.tree.structure(got["module"]) == jax.tree.structure(ref_params)
  _assert_close(got["module"], jax.jit(ref_grad)(ref_params), "nnx.grad")


# JAX transformations outside the wrapper --------------------------------------


class TinyMLP(nn.Module):
  """Dense(16) + gelu + Dense(4); takes one example or a batch."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(nn.gelu(nn.Dense(16)(x)))


@functools.cache
def _tiny(name):
  """(model, wrapped, variables, one example) for the transformation tests."""
  cls, shape = {"mlp": (TinyMLP, (8,)), "conv": (LinenConv, (8, 8, 3))}[name]
  x = _normal(shape, 3)
  model = cls()
  wrapped = jmp_lite.flax.wrap(model, BF16)
  variables = _fill(jax.eval_shape(wrapped.init, jax.random.key(0), x), 0)
  return model, wrapped, variables, x


def _check_transform(transform, name, *args, tol=TOL):
  """``transform(apply)(*args)`` through wrapped and float32 models agree.

  Args:
    transform: maps ``apply(x)`` to the function to check.
    name: a `_tiny` model.
    *args: arguments of the transformed function.
    tol: the relative error allowed.
  """
  model, wrapped, variables, _ = _tiny(name)
  fun = transform(lambda x: wrapped.apply(variables, x))
  ref = transform(lambda x: model.apply(variables, x))
  kinds = ("matmul", "conv") if name == "conv" else ("matmul",)
  _assert_engine_covers(_audit(fun, *args), _audit(ref, *args), kinds)
  _assert_close(jax.jit(fun)(*args), jax.jit(ref)(*args), name, tol)


@pytest.mark.parametrize("name", ["mlp", "conv"])
def test_jvp(name):
  x = _tiny(name)[3]
  t = _normal(x.shape, 4)
  _check_transform(lambda f: lambda x, t: jax.jvp(f, (x,), (t,)), name, x, t)


def test_hessian():
  """Forward-over-reverse: JVPs of the engine's transposed products."""
  x = _tiny("mlp")[3]
  loss = lambda f: lambda x: jnp.sum(jnp.sin(f(x)))
  _check_transform(lambda f: jax.hessian(loss(f)), "mlp", x, tol=HESSIAN_TOL)


@pytest.mark.parametrize("jac", [jax.jacfwd, jax.jacrev])
@pytest.mark.parametrize("name", ["mlp", "conv"])
def test_jacobians(name, jac):
  _check_transform(jac, name, _tiny(name)[3])


@pytest.mark.parametrize("name", ["mlp", "conv"])
def test_vmap_per_example(name):
  xs = _normal((3, *_tiny(name)[3].shape), 5)
  _check_transform(jax.vmap, name, xs)


def test_vmap_over_parameters():
  """An ensemble: vmap over stacked variables, so the kernels are batched."""
  model, wrapped, _, x = _tiny("conv")
  xs = _normal((2, *x.shape), 5)
  shapes = jax.eval_shape(wrapped.init, jax.random.key(0), xs)
  stacked = jax.tree.map(lambda *a: jnp.stack(a), _fill(shapes, 5),
                         _fill(shapes, 6))
  fun = jax.vmap(lambda v: wrapped.apply(v, xs))
  ref = jax.vmap(lambda v: model.apply(v, xs))
  _assert_engine_covers(_audit(fun, stacked), _audit(ref, stacked))
  _assert_close(jax.jit(fun)(stacked), jax.jit(ref)(stacked), "ensemble")


def test_grad_of_jitted_vmapped_wrapped_model():
  """jit(grad(vmap(wrapped))) w.r.t. the input: three transformations."""
  xs = _normal((3, *_tiny("mlp")[3].shape), 5)
  loss = lambda f: jax.grad(lambda xs: jnp.sum(jnp.sin(jax.vmap(f)(xs))))
  _check_transform(loss, "mlp", xs)


# Compilation cache ------------------------------------------------------------


class _CompileOnce(nn.Module):
  """A model no other test uses, so its first call is the first compilation."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(5)(nn.gelu(nn.Dense(12)(x)))


def test_linen_eager_apply_compiles_on_first_call_only():
  model = _CompileOnce()
  wrapped = jmp_lite.flax.wrap(model, BF16)
  xs = [_normal((3, 7), i) for i in range(3)]
  variables = _fill(jax.eval_shape(model.init, jax.random.key(0), xs[0]), 0)
  want = [jax.jit(model.apply)(variables, x) for x in xs]
  with jmp_lite.testing.count_compilations() as first:
    out = [wrapped.apply(variables, xs[0])]
  with jmp_lite.testing.count_compilations() as later:
    out += [wrapped.apply(variables, x) for x in xs[1:]]
  assert first, "the first eager call should compile"
  assert not later, f"{len(later)} compilations after the first call"
  for got, ref in zip(out, want):  # not a stale result: each input's own
    _assert_close(got, ref, "eager apply")


class _NnxCompileOnce(nnx.Module):

  def __init__(self, rngs):
    self.linear = nnx.Linear(7, 5, rngs=rngs)

  def __call__(self, x):
    return self.linear(x)


def test_nnx_eager_call_compiles_on_first_call_only():
  model = _build(_NnxCompileOnce)
  ref, params = _pure(model)
  xs = [_normal((3, 7), i) for i in range(3)]
  want = [jax.jit(ref)(params, x) for x in xs]
  wrapped = jmp_lite.flax.wrap(model, BF16)
  with jmp_lite.testing.count_compilations() as first:
    out = [wrapped(xs[0])]
  with jmp_lite.testing.count_compilations() as later:
    out += [wrapped(x) for x in xs[1:]]
  assert first and not later, (len(first), len(later))
  for got, ref_out in zip(out, want):
    _assert_close(got, ref_out, "eager call")

