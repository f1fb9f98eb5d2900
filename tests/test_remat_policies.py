"""`jax.checkpoint` policies see the engine's matmuls as the ops they replace.

``jax.checkpoint_policies.dots_saveable`` and its kin test ``prim is
dot_general_p``. The engine computes narrow matmuls with its own primitive,
so without help a policy applied *outside* a wrapped model (or an autocast
function) would recompute every matmul it was asked to save. The oracle is
plain JAX and Flax: the same model written with Flax's ``dtype=bfloat16``
(the same dtypes in both directions) under the same policy, and the float32
model. What a policy saves is read from `jax.ad_checkpoint.print_saved_residuals`.
"""

import re
import warnings

import flax.linen as nn
from flax import nnx
import jax
import jax.ad_checkpoint  # print_saved_residuals
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite
import jmp_lite.flax

POLICY = "p=f32,c=bf16,o=f32"
CP = jax.checkpoint_policies
POLICIES = {
    "dots_saveable": CP.dots_saveable,
    "dots_with_no_batch_dims_saveable": CP.dots_with_no_batch_dims_saveable,
    "nothing_saveable": CP.nothing_saveable,
}


class Attention(nn.Module):
  """Dense projections (saved by both policies) and two batched products
  (saved by ``dots_saveable`` only), GELU between."""
  dtype: object = None

  @nn.compact
  def __call__(self, x):
    q = nn.Dense(16, dtype=self.dtype, name="q")(x)
    k = nn.Dense(16, dtype=self.dtype, name="k")(x)
    v = nn.Dense(16, dtype=self.dtype, name="v")(x)
    logits = jnp.einsum("bqd,bkd->bqk", q, k)
    w = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(v.dtype)
    y = jnp.einsum("bqk,bkd->bqd", w, v)
    y = nn.gelu(nn.Dense(16, dtype=self.dtype, name="o")(y))
    return jnp.sum(y.astype(jnp.float32) ** 2)


def _saved(fun, *args, producer=""):
  """``(dtype, shape)`` of each value ``fun``'s derivative keeps, arguments
  aside (and only outputs of ``producer``, a regex, if given), sorted."""
  import contextlib  # pylint: disable=g-import-not-at-top
  import io  # pylint: disable=g-import-not-at-top
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    jax.ad_checkpoint.print_saved_residuals(fun, *args)
  return sorted(re.findall(rf"^(\w+)\[([\d,]*)\] output of {producer}",
                           out.getvalue(), re.M))


@pytest.fixture(scope="module")
def model_and_args():
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 16))
  params = Attention().init(jax.random.PRNGKey(1), x)
  return params, x


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_policy_around_a_wrapped_model_saves_what_it_saves_in_flax_bf16(
    name, model_and_args):
  params, x = model_and_args
  policy = POLICIES[name]
  wrapped = jmp_lite.flax.wrap(Attention(), POLICY)
  ours = _saved(jax.checkpoint(wrapped.apply, policy=policy), params, x)
  flax_bf16 = _saved(
      jax.checkpoint(Attention(dtype=jnp.bfloat16).apply, policy=policy),
      params, x)
  f32 = _saved(jax.checkpoint(Attention().apply, policy=policy), params, x)
  assert ours == flax_bf16, (ours, flax_bf16)
  # The same products as the float32 model, in the compute dtype. (A product
  # that feeds a float32 stretch the engine recomputes, the attention logits
  # here, is kept as that stretch's input: the same value, bytes and count.)
  assert [s for _, s in ours] == [s for _, s in f32]
  assert all(d == "bf16" for d, _ in ours)
  if name == "dots_saveable":
    assert len(ours) == 6  # four projections, two batched products
  if name == "dots_with_no_batch_dims_saveable":
    assert len(ours) == 4


def test_the_policy_outside_and_inside_the_wrapped_model_agree(model_and_args):
  params, x = model_and_args
  policy = CP.dots_with_no_batch_dims_saveable

  class Remat(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.remat(Attention, policy=policy)(name="inner")(x)

  outer = jmp_lite.flax.wrap(Attention(), POLICY)
  inner = jmp_lite.flax.wrap(Remat(), POLICY)
  inner_params = {"params": {"inner": params["params"]}}
  # JAX 0.9 names a saved value after the identity `reduce_precision` remat
  # puts behind its producer (`_insert_reduce_precision` in
  # jax/_src/ad_checkpoint.py, jax-ml/jax#22244); JAX 0.10 after the producer.
  dots = "((jmp_)?dot_general|reduce_precision) "
  saved_outer = _saved(jax.checkpoint(outer.apply, policy=policy),
                       params, x, producer=dots)
  saved_inner = _saved(inner.apply, inner_params, x, producer=dots)
  assert saved_outer == saved_inner and len(saved_outer) == 4


@pytest.mark.parametrize("name", ["dots_saveable", "nothing_saveable"])
def test_a_policy_changes_no_gradient(name, model_and_args):
  """Saving or recomputing a product gives the same gradients.

  Bitwise on a CPU, whose compiled step computes the same values either way.
  On a GPU a different plan fuses the recomputed stretch differently, and the
  key bias's gradient is rounding noise (softmax ignores a shift along the
  keys: its exact gradient is 0), so there the gradients agree to bf16
  rounding, measured against the size of the whole gradient.
  """
  params, x = model_and_args
  wrapped = jmp_lite.flax.wrap(Attention(), POLICY)
  plain = jax.jit(jax.grad(wrapped.apply))(params, x)
  remat = jax.jit(jax.grad(jax.checkpoint(wrapped.apply,
                                          policy=POLICIES[name])))(params, x)
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(plain))
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(remat)):
    assert a.dtype == b.dtype
    if jax.default_backend() == "cpu":
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    else:
      np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0,
                                 atol=2.0 ** -5 * scale)


def test_a_policy_around_autocast_saves_what_it_saves_inside(model_and_args):
  params, x = model_and_args

  def f(p, x):
    return Attention().apply(p, x)

  policy = CP.dots_saveable
  outside = _saved(jax.checkpoint(jmp_lite.autocast(f, POLICY),
                                       policy=policy), params, x)
  inside = _saved(jmp_lite.autocast(jax.checkpoint(f, policy=policy),
                                         POLICY), params, x)
  f32 = _saved(jax.checkpoint(f, policy=policy), params, x)
  assert outside == inside
  assert [s for _, s in outside] == [s for _, s in f32]
  # Autocast hands a float32 consumer the float32 accumulator unrounded (its
  # docstring), so what feeds one is kept in float32; the rest in bf16.
  assert {d for d, _ in outside} <= {"bf16", "f32"}


def test_an_offloading_policy_recomputes_the_engines_matmuls_with_a_warning(
    model_and_args):
  params, x = model_and_args
  wrapped = jmp_lite.flax.wrap(Attention(), POLICY)
  policy = CP.offload_dot_with_no_batch_dims("device", "pinned_host")
  with pytest.warns(UserWarning, match="recomputed instead"):
    saved = _saved(jax.checkpoint(wrapped.apply, policy=policy),
                        params, x)
  assert saved == []
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    g = jax.grad(jax.checkpoint(wrapped.apply, policy=policy))(params, x)
  expected = jax.grad(wrapped.apply)(params, x)
  for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(g)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class NnxAttention(nnx.Module):
  """`Attention` in NNX."""

  def __init__(self, rngs, dtype=None):
    for name in "qkvo":
      setattr(self, name, nnx.Linear(16, 16, dtype=dtype, rngs=rngs))

  def __call__(self, x):
    q, k, v = self.q(x), self.k(x), self.v(x)
    logits = jnp.einsum("bqd,bkd->bqk", q, k)
    w = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(v.dtype)
    y = nnx.gelu(self.o(jnp.einsum("bqk,bkd->bqd", w, v)))
    return jnp.sum(y.astype(jnp.float32) ** 2)


def _functional(model):
  """``(f, state)``: ``f(state, x)`` runs ``model`` (NNX's split and merge)."""
  graphdef, state = nnx.split(model)
  return (lambda state, x: nnx.merge(graphdef, state)(x)), state


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_policy_around_a_wrapped_nnx_model_saves_what_nnx_bf16_saves(name):
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 16))
  policy = POLICIES[name]
  ours, state = _functional(
      jmp_lite.flax.wrap(NnxAttention(nnx.Rngs(1)), POLICY))
  flax_bf16, bf16_state = _functional(
      NnxAttention(nnx.Rngs(1), dtype=jnp.bfloat16))
  saved = _saved(jax.checkpoint(ours, policy=policy), state, x)
  expected = _saved(jax.checkpoint(flax_bf16, policy=policy), bf16_state, x)
  assert saved == expected, (saved, expected)
  assert all(d == "bf16" for d, _ in saved)
