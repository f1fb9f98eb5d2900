"""What the forward pass sees is measured on the forward pass.

Forward statistics (telemetry's ``forward_*`` fields) and an fp8 site's
operand maxima are outputs of the forward pass, so values no gradient
reaches are measured too: a teacher or target network under
``stop_gradient``, and a ``fori_loop`` with traced bounds (a ``while``,
which JAX cannot reverse-differentiate, so it only sits where no gradient
flows). A loop gets one row for the whole loop (its maximum over the
iterations), whatever its trip count. Oracles: NumPy on the same values, and
a float32 forward pass.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jmp_lite
import jmp_lite.flax

BF16 = "p=f32,c=bf16,o=f32"
F16 = "p=f32,c=f16,o=f32"
FP8 = {nn.Dense: BF16 + ",fp8=hybrid"}
ONE = jmp_lite.StaticLossScale(1.0)


def _bf16(a):
  return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


class Pair(nn.Module):
  """A student Dense, and a teacher Dense the loss reads under stop_gradient."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(16, name="student")(x), nn.Dense(16, name="teacher")(x)


def _pair_loss(model):
  def loss(p, x):
    frozen = {"student": p["student"], "teacher": jax.lax.stop_gradient(p["teacher"])}
    student, teacher = model.apply({"params": frozen}, x)
    return jnp.mean((student - jax.lax.stop_gradient(teacher)) ** 2)
  return loss


def test_an_fp8_teacher_behind_stop_gradient_is_calibrated():
  """Its operands reach 1,000, above e4m3's 448: with maxima read only from
  the backward pass its scale stayed 1 and its output saturated (98% error
  after 4 steps). Now its maxima are the operands' (NumPy), and after a few
  steps its output is the float32 one up to fp8 rounding."""
  model = jmp_lite.flax.wrap(Pair(), BF16, rules=FP8)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((32, 16)) * 300, jnp.float32)
  params = model.init(jax.random.key(0), x)["params"]
  loss = _pair_loss(model)
  state = jmp_lite.fp8.init(loss, params, x, history_length=4)
  step = jax.jit(lambda s: jmp_lite.value_and_grad(loss)(params, x, loss_scale=ONE, fp8=s)[-1])
  first = step(state).sites["teacher"]
  kernel = params["teacher"]["kernel"]
  np.testing.assert_array_equal(first.lhs.amax_history[0], np.abs(_bf16(x)).max())
  np.testing.assert_array_equal(first.rhs.amax_history[0], np.abs(_bf16(kernel)).max())
  assert float(first.lhs.amax_history[0]) > 448
  assert float(first.grad.amax_history[0]) == 0  # no gradient reaches it
  for _ in range(4):
    state = step(state)
  assert float(state.sites["teacher"].lhs.scale) > 1
  _, teacher = jmp_lite.fp8.forward(lambda p, x: model.apply({"params": p}, x), state)(
      params, x)
  want = np.asarray(x) @ np.asarray(kernel) + np.asarray(params["teacher"]["bias"])
  error = np.linalg.norm(np.asarray(teacher) - want) / np.linalg.norm(want)
  assert error < 0.08, error


def test_telemetry_measures_a_value_behind_stop_gradient():
  """A teacher's output holding 90 and two infs reads so (it read 0 and 0)."""
  model = jmp_lite.flax.wrap(Pair(), F16)
  x = np.full((2, 4), 0.5, np.float32)
  params = jax.tree.map(jnp.zeros_like, model.init(jax.random.key(0), x)["params"])
  bias = np.zeros(16, np.float32)
  bias[3], bias[5], bias[6] = 90.0, np.inf, -7.0
  params["teacher"]["bias"] = jnp.asarray(bias)
  vg = jmp_lite.value_and_grad(_pair_loss(model), telemetry=jmp_lite.Telemetry())
  stats = vg(params, x, loss_scale=ONE)[-1].modules["teacher"]
  out = np.broadcast_to(bias.astype(np.float16), (2, 16)).astype(np.float32)
  finite = np.isfinite(out)
  assert float(stats.forward_max) == np.abs(out[finite]).max() == 90.0
  assert int(stats.forward_nonfinite) == (~finite).sum() == 2
  assert float(stats.backward_max) == 0 and int(stats.backward_nonfinite) == 0


class Looped(nn.Module):
  """A Dense applied ``n`` times inside ``fori_loop`` (traced ``n``: a while loop)."""

  @nn.compact
  def __call__(self, x, n):
    dense = nn.Dense(8, name="step")
    if self.is_initializing():
      dense(x)  # parameters are created outside the loop's body
    return jax.lax.fori_loop(0, n, lambda i, h: dense(h), x)


# A kernel that doubles: iteration i multiplies by 2 ** i, exactly in bf16 and fp8.
DOUBLING = {"step": {"kernel": 2 * jnp.eye(8), "bias": jnp.zeros(8)}}


def _looped_loss(model):
  return lambda p, x, n: jnp.sum(
      model.apply({"params": jax.lax.stop_gradient(p)}, x, n) ** 2)


def test_an_fp8_matmul_in_a_while_loop_is_one_site_with_the_loops_maximum():
  model = jmp_lite.flax.wrap(Looped(), BF16, rules=FP8)
  x = jnp.full((4, 8), 0.75)
  loss = _looped_loss(model)
  state = jmp_lite.fp8.init(loss, DOUBLING, x, jnp.int32(3))
  assert {k: v.lhs.scale.shape for k, v in state.sites.items()} == {"step": ()}
  step = jax.jit(lambda n: jmp_lite.value_and_grad(loss)(DOUBLING, x, n, loss_scale=ONE,
                                                         fp8=state))
  for n in (1, 3, 6):  # one compiled step; the trip count is data
    value, _, _, new = step(jnp.int32(n))
    site = new.sites["step"]
    # Operands 0.75 * 2 ** i for i < n: the largest is the last iteration's.
    assert float(site.lhs.amax_history[0]) == 0.75 * 2 ** (n - 1)
    assert float(site.rhs.amax_history[0]) == 2.0
    assert float(site.grad.amax_history[0]) == 0.0
    assert float(value) == 32 * (0.75 * 2 ** n) ** 2  # fp8-exact: the loop ran quantised


def test_telemetry_in_a_while_loop_reads_the_loops_maximum():
  model = jmp_lite.flax.wrap(Looped(), F16)
  x = jnp.full((4, 8), 0.75)
  vg = jax.jit(lambda n: jmp_lite.value_and_grad(_looped_loss(model),
                                                 telemetry=jmp_lite.Telemetry())(
      DOUBLING, x, n, loss_scale=ONE)[-1])
  for n in (2, 5):
    stats = vg(jnp.int32(n)).modules["step"]
    assert float(stats.forward_max) == 0.75 * 2 ** n
    assert float(stats.backward_max) == 0.0


@pytest.mark.parametrize("n", [jnp.int32(3), 3], ids=["while", "scan"])
def test_a_loop_is_measured_without_a_warning(n, recwarn):
  model = jmp_lite.flax.wrap(Looped(), BF16, rules=FP8)
  x = jnp.full((4, 8), 0.75)
  jmp_lite.fp8.init(_looped_loss(model), DOUBLING, x, n)
  assert not [w for w in recwarn if issubclass(w.category, jmp_lite.UncoveredMatmulWarning)]


def _frozen_teacher_loss(model):
  """Only the teacher's parameters are frozen: its output, computed from
  the batch and constants, is one no gradient reaches in plain JAX."""
  def loss(p, x):
    frozen = {"student": p["student"], "teacher": jax.lax.stop_gradient(p["teacher"])}
    student, teacher = model.apply({"params": frozen}, x)
    return jnp.mean((student - teacher) ** 2)
  return loss


@pytest.mark.parametrize("what", ["telemetry", "fp8"])
def test_measuring_differentiates_exactly_what_the_step_does(what):
  """Measuring the teacher must not make JAX differentiate it: the step
  with telemetry or fp8 sites has the plain step's matmuls (the student's
  forward and weight-gradient products, the teacher's forward), and the
  teacher's backward statistics are zero (before: 2 more matmuls, and the
  cotangent that would reach it read as its backward maximum)."""
  model = jmp_lite.flax.wrap(Pair(), BF16, rules=FP8 if what == "fp8" else None)
  x = jnp.asarray(np.random.default_rng(1).standard_normal((8, 16)), jnp.float32)
  params = model.init(jax.random.key(0), x)["params"]
  loss = _frozen_teacher_loss(model)
  with warnings.catch_warnings():  # the fp8 model run as bf16, on purpose
    warnings.filterwarnings("ignore", "jmp_lite.flax.wrap: the rules give modules fp8")
    plain = jmp_lite.audit(lambda p: jmp_lite.value_and_grad(loss)(p, x, loss_scale=ONE),
                           params).count(category="matmul")
  assert plain == 3
  if what == "telemetry":
    vg = jmp_lite.value_and_grad(loss, telemetry=jmp_lite.Telemetry())
    step = lambda p: vg(p, x, loss_scale=ONE)
    stats = step(params)[-1].modules
    assert float(stats["teacher"].forward_max) > 0
    assert float(stats["teacher"].backward_max) == 0
    assert float(stats["student"].backward_max) > 0
  else:
    state = jmp_lite.fp8.init(loss, params, x)
    step = lambda p: jmp_lite.value_and_grad(loss)(p, x, loss_scale=ONE, fp8=state)
    teacher = step(params)[-1].sites["teacher"]
    assert float(teacher.lhs.amax_history[0]) > 0 and float(teacher.grad.amax_history[0]) == 0
  assert jmp_lite.audit(step, params).count(category="matmul") == plain
