"""What the instrumented step cannot reach is said, not skipped silently.

fp8 matmuls and telemetry marks inside a ``while`` loop (``fori_loop`` with
traced bounds) run as written: nothing carries their maxima or statistics
back. Such a loop can only sit in a differentiated step where no gradient
flows through it (JAX cannot reverse-differentiate it): a teacher or target
network under ``stop_gradient``, as here. `jmp_lite._unseen` warns with
`jmp_lite.UncoveredMatmulWarning`, as the engine does for matmuls it cannot
cover. Oracle: the same model with static bounds (``fori_loop`` then lowers
to a ``scan``, which the step enters) gets the loop's matmul as an fp8 site
(`jmp_lite.fp8.init`) and no warning.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jmp_lite
import jmp_lite.flax

BF16 = "p=f32,c=bf16,o=f32"


class Looped(nn.Module):
  """A Dense applied ``n`` times inside ``fori_loop``."""

  @nn.compact
  def __call__(self, x, n):
    dense = nn.Dense(8, name="step")
    if self.is_initializing():
      dense(x)  # parameters are created outside the loop's body
    return jax.lax.fori_loop(0, n, lambda i, h: jnp.tanh(dense(h)), x)


def _setup(n):
  """A student Dense trained in fp8, and a looped teacher under stop_gradient."""
  rules = {nn.Dense: BF16 + ",fp8=hybrid"}
  student = jmp_lite.flax.wrap(nn.Dense(8, name="student"), BF16, rules=rules)
  teacher = jmp_lite.flax.wrap(Looped(), BF16, rules=rules)
  x = jnp.ones((4, 8))
  params = {"student": student.init(jax.random.key(0), x)["params"],
            "teacher": teacher.init(jax.random.key(1), x, 1)["params"]}

  def loss(p, x):
    target = teacher.apply({"params": jax.lax.stop_gradient(p["teacher"])}, x, n)
    return jnp.sum((student.apply({"params": p["student"]}, x) - target) ** 2)
  return loss, params, x


def test_fp8_matmuls_in_a_while_loop_are_warned_about():
  traced = jnp.int32(3)  # traced bounds: fori_loop lowers to while
  loss, params, x = _setup(traced)
  with pytest.warns(jmp_lite.UncoveredMatmulWarning,
                    match=r"inside 'while' .* 1 matmul\(s\) the policy puts in fp8 run "
                          r"unquantised: a while loop"):
    state = jmp_lite.fp8.init(loss, params, x)
  assert len(state.sites) == 1  # the student's: the loop's matmul is not a site


def test_static_bounds_are_reached_and_nothing_is_warned():
  loss, params, x = _setup(3)  # a Python int: fori_loop lowers to scan
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    state = jmp_lite.fp8.init(loss, params, x)
  assert len(state.sites) == 2  # the student's, and the teacher's step


def test_telemetry_marks_in_a_while_loop_are_warned_about():
  model = jmp_lite.flax.wrap(Looped(), "p=f32,c=f16,o=f32")
  x = jnp.ones((4, 8))
  params = model.init(jax.random.key(0), x, 1)["params"]
  loss = lambda p: jnp.sum(
      model.apply({"params": jax.lax.stop_gradient(p)}, x, jnp.int32(2)) ** 2)
  vg = jmp_lite.value_and_grad(loss, telemetry=jmp_lite.Telemetry())
  with pytest.warns(jmp_lite.UncoveredMatmulWarning,
                    match=r"telemetry mark\(s\) report zeros"):
    vg(params, loss_scale=jmp_lite.StaticLossScale(1.0))
