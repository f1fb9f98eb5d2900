"""What the instrumented step cannot reach is said, not skipped silently.

fp8 matmuls and telemetry marks inside a ``custom_vjp`` body run as written:
the body is not what the rule differentiates, so nothing carries their
maxima or statistics back. `jmp_lite._jaxpr.passes.unseen` warns with
`jmp_lite.UncoveredMatmulWarning`, as the engine does for matmuls it cannot
cover. Oracle: the same module without the custom rule gets its matmul as an
fp8 site (`jmp_lite.fp8.init`) and no warning. (``while`` loops are entered:
`tests/test_forward_measures.py`.)
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jmp_lite
import jmp_lite.flax

BF16 = "p=f32,c=bf16,o=f32"


@jax.custom_vjp
def _matmul(x, w):
  return x @ w


_matmul.defvjp(lambda x, w: (x @ w, (x, w)), lambda r, g: (g @ r[1].T, r[0].T @ g))


class Custom(nn.Module):
  """A kernel applied through a custom_vjp (``custom``) or directly."""
  custom: bool = True

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.lecun_normal(), (8, 8))
    return (_matmul if self.custom else jnp.matmul)(x, w.astype(x.dtype))


def _loss(custom, policy=BF16, **kw):
  model = jmp_lite.flax.wrap(Custom(custom), policy, **kw)
  x = jnp.ones((4, 8))
  params = model.init(jax.random.key(0), x)["params"]
  return (lambda p: jnp.sum(model.apply({"params": p}, x) ** 2)), params


def test_fp8_matmuls_in_a_custom_vjp_are_warned_about():
  loss, params = _loss(True, rules={Custom: BF16 + ",fp8=hybrid"})
  with pytest.warns(jmp_lite.UncoveredMatmulWarning,
                    match=r"inside 'custom_vjp_call' .* 1 matmul\(s\) the policy puts in "
                          r"fp8 run unquantised: a custom_vjp's backward rule"):
    with pytest.raises(ValueError, match="no fp8 matmul"):
      jmp_lite.fp8.init(loss, params)


def test_without_the_custom_rule_the_matmul_is_a_site(recwarn):
  loss, params = _loss(False, rules={Custom: BF16 + ",fp8=hybrid"})
  assert list(jmp_lite.fp8.init(loss, params).sites) == ["dot_general"]
  assert not [w for w in recwarn if issubclass(w.category, jmp_lite.UncoveredMatmulWarning)]


def test_telemetry_marks_in_a_custom_vjp_are_warned_about():
  model = jmp_lite.flax.wrap(Custom(False), "p=f32,c=f16,o=f32")
  x = jnp.ones((4, 8))
  params = model.init(jax.random.key(0), x)["params"]

  @jax.custom_vjp
  def run(p):
    return model.apply({"params": p}, x)

  run.defvjp(lambda p: (run(p), p), lambda p, g: (jax.tree.map(jnp.zeros_like, p),))
  vg = jmp_lite.value_and_grad(lambda p: jnp.sum(run(p) ** 2),
                               telemetry=jmp_lite.Telemetry())
  with pytest.warns(jmp_lite.UncoveredMatmulWarning,
                    match=r"inside 'custom_vjp_call' .* telemetry mark\(s\) report zeros"):
    vg(params, loss_scale=jmp_lite.StaticLossScale(1.0))
