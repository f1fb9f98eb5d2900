"""Wide islands: float32 stretches of a bf16 computation are recomputed, not saved.

Oracles: JAX's own `jax.vjp` (the residuals it keeps are the leaves of the
function it returns), the same function without the island pass (the
engine's rewrite with `_islands.isolate` replaced by the identity), and the
unmodified float32 function.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite.flax
from jmp_lite._jaxpr.passes import engine as _engine
from jmp_lite._jaxpr.passes import islands as _islands

BF16 = "p=f32,c=bf16,o=f32"
B, T, D = 4, 16, 32


def _residuals(fun, *args):
  """The (dtype, shape) of every array `jax.vjp` of ``fun`` keeps."""
  vjp = jax.jit(lambda *a: jax.vjp(fun, *a)[1])(*args)
  return [(np.dtype(x.dtype), x.shape) for x in jax.tree.leaves(vjp)
          if hasattr(x, "dtype")]


@pytest.fixture
def no_islands(monkeypatch):
  """Runs the engine without the island pass, for the baseline."""
  def use():
    monkeypatch.setattr(_islands, "isolate", lambda eqns, outvars: eqns)
  return use


class Block(nn.Module):
  """Pre-norm MLP block, with a published norm layer."""
  norm: type = nn.LayerNorm

  @nn.compact
  def __call__(self, x):
    h = self.norm()(x)
    h = nn.Dense(D)(nn.gelu(nn.Dense(2 * D)(h)))
    return self.norm()(x + h)


def _model(norm):
  model = Block(norm=norm)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(B, T, D)), jnp.float32)
  params = jax.jit(model.init)(jax.random.key(0), x)["params"]
  return model, params, x


# LayerNorm's case (about 10 s on 2 CPU cores) runs in the heavy tier.
@pytest.mark.parametrize("norm", [pytest.param(nn.LayerNorm, marks=pytest.mark.slow),
                                  nn.RMSNorm], ids=["LayerNorm", "RMSNorm"])
def test_norms_keep_no_float32_activations(norm, no_islands):
  model, params, x = _model(norm)
  wrapped = jmp_lite.flax.wrap(model, BF16)
  # Not the plain sum: a LayerNorm's outputs sum to a constant.
  cot = jnp.asarray(np.random.default_rng(2).normal(size=x.shape), jnp.float32)
  loss = lambda p, x: jnp.sum(wrapped.apply({"params": p}, x) * cot)
  activation = (B, T, D)
  with_islands = _residuals(loss, params, x)
  grads = jax.jit(jax.grad(loss))(params, x)
  no_islands()
  without = _residuals(loss, params, x)
  baseline = jax.jit(jax.grad(loss))(params, x)
  f32 = [r for r in with_islands if r == (np.dtype(np.float32), activation)]
  f32_before = [r for r in without
                if r == (np.dtype(np.float32), activation)]
  # Each norm saved full-size float32 arrays; with islands the only float32
  # activation-sized residual left is the model's float32 input x (the first
  # norm reads it before the policy's cast).
  assert len(f32_before) >= 4, without
  assert len(f32) <= 1, with_islands
  nbytes = lambda rs: sum(d.itemsize * np.prod(s) for d, s in rs)
  assert nbytes(with_islands) < 0.8 * nbytes(without)
  # Recomputed, the float32 stretch may round to bf16 differently where XLA
  # fuses it differently, so the two gradients differ by bf16 noise; neither
  # is further from float32 than the other, beyond that noise.
  ref = jax.grad(lambda p, x: jnp.sum(model.apply({"params": p}, x) * cot))(
      params, x)
  assert _rel_err(grads, ref) < 2e-2
  assert _rel_err(grads, ref) < 1.25 * _rel_err(baseline, ref)


def _rel_err(got, want):
  return max(float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r))
             for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def _interleaved(x, w, v):
  """A float32 stretch read from outside mid-way, and reading outside values.

  ``m`` (a member) is read by an f32 matmul outside the island before the
  island ends, and the island's tail reads that matmul's result: the island
  must stop there, and everything must still be defined before it is read.
  """
  a = x.astype(jnp.float32)
  m = jnp.mean(a, axis=-1, keepdims=True)
  s = jnp.tanh(a - m) * jnp.exp(-m)
  outside = (m * s) @ w                  # reads island values: not cheap
  late = jnp.sin(v)                      # defined after the reader
  t = jnp.tanh(s) * late + outside       # reads outside values: not a member
  return jnp.sum(t * t) + jnp.sum(s.astype(jnp.bfloat16).astype(jnp.float32))


def test_island_next_to_outside_readers_matches_plain_jax():
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(8, 16)), jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=(16, 16)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)
  engine = _engine.accumulate(_interleaved)
  jaxpr = jax.make_jaxpr(engine)(x, w, v)
  assert "remat2" in str(jaxpr)
  # Float32 products in float32 on both sides (a GPU's default is TF32),
  # and both compiled: XLA:GPU may keep `s` in float32 where the program
  # rounds it to bfloat16 (its excess precision), in both or in neither,
  # where op-by-op execution always rounds (measured on an H200: 1e-3 apart).
  with jax.default_matmul_precision("highest"):
    np.testing.assert_allclose(engine(x, w, v), jax.jit(_interleaved)(x, w, v),
                               rtol=1e-6)
    got = jax.jit(jax.grad(engine, argnums=(0, 1, 2)))(x, w, v)
    want = jax.jit(jax.grad(_interleaved, argnums=(0, 1, 2)))(x, w, v)
  for g, r in zip(got, want):
    assert g.dtype == r.dtype
    np.testing.assert_allclose(np.asarray(g, np.float32),
                               np.asarray(r, np.float32), rtol=2e-5,
                               atol=1e-5)


def test_float32_and_linear_code_is_left_as_written():
  x = jnp.ones((4, 8), jnp.float32)
  fun = lambda x: jnp.sum(jnp.tanh(x) * x)
  assert "remat2" not in str(jax.make_jaxpr(_engine.accumulate(fun))(x))
  # An upcast followed by linear work only keeps nothing worth recomputing.
  lin = lambda x: jnp.sum(x.astype(jnp.float32) * 2.0 + 1.0)
  assert "remat2" not in str(jax.make_jaxpr(_engine.accumulate(lin))(
      x.astype(jnp.bfloat16)))
