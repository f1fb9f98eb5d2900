"""`AutomaticLossScale`: Graphcore's automatic loss scaling, and what it reads.

Oracles: a NumPy transcription of PopART's update (graphcore/popart
``willow/src/popx/op/lossscaleupdatex.cpp`` at 6dcca75c: with
``f = t / (1 - t)``, the scale is halved when ``upper > f * lower`` and
doubled otherwise, computed in float32), `DynamicLossScale` for the overflow
back-off it keeps, and the float16 backward pass itself, written out, for
the proportion it reads (`tests/test_underflow.py`'s transcription of the
model's cotangents).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite

from test_underflow import _f16_cotangents, _measured, _mlp

F16 = np.finfo(np.float16)
EDGE = float(F16.max) / 16  # PopART's default bin edge, 1/16 of the range


def _popart(scale, upper, lower, t, top):
  """PopART's LossScaleUpdateOpx::grow, in float32 (clipped at ``top``, as
  PopART clips a float16 scale at 2**15)."""
  f = np.float32(t) / (np.float32(1) - np.float32(t))
  down = np.float32(upper) > np.float32(lower) * f
  return scale / 2 if down else min(scale * 2, top)


@pytest.mark.parametrize("period", [1, 3])
@pytest.mark.parametrize("threshold", [1e-7, 1e-3, 0.2])
def test_finite_steps_follow_popart_rule(period, threshold):
  """Counts of values in the two bins, drawn so that both branches happen;
  PopART decides every `updatePeriod` steps on that step's histogram."""
  rng = np.random.default_rng(int(threshold * 1e7) + period)
  ls = jmp_lite.AutomaticLossScale(jnp.float32(2.0 ** 10), period=period,
                                   threshold=threshold, min_loss_scale=2.0 ** -60,
                                   max_loss_scale=2.0 ** 60)
  adjust = jax.jit(lambda s, u: s.adjust(jnp.bool_(True), upper=u))
  scale, seen = 2.0 ** 10, 0
  for step in range(120):
    n = int(rng.integers(1, 2 ** 24))  # counts float32 holds exactly
    # Around the threshold: the upper bin's share is t times 0.1 to 10.
    upper = min(n, int(round(n * threshold * 10.0 ** rng.uniform(-1, 1))))
    if step % 7 == 0:
      upper = 0
    proportion = np.float32(upper) / np.float32(n)
    ls = adjust(ls, proportion)
    seen += 1
    if seen == period:
      scale, seen = _popart(scale, upper, n - upper, threshold, 2.0 ** 60), 0
    assert float(ls.loss_scale) == scale, step


def test_overflow_backs_off_as_dynamic_loss_scale_and_unsampled_steps_hold():
  rng = np.random.default_rng(1)
  als = jmp_lite.AutomaticLossScale(jnp.float32(2.0 ** 12), hysteresis=2)
  dyn = jmp_lite.DynamicLossScale(jnp.float32(2.0 ** 12), period=10 ** 6, hysteresis=2)
  for _ in range(30):
    # Overflows only, or finite steps telemetry did not sample: the scale
    # moves exactly as DynamicLossScale's without its blind growth.
    finite = bool(rng.random() < 0.5)
    als = als.adjust(jnp.bool_(finite), upper=jnp.float32(0.0), sampled=jnp.bool_(False))
    dyn = dyn.adjust(jnp.bool_(finite))
    assert float(als.loss_scale) == float(dyn.loss_scale)
    assert int(als.hysteresis_left) == int(dyn.hysteresis_left)


def test_a_growth_refills_hysteresis_and_a_crowded_bin_does_not_spend_it():
  ls = jmp_lite.AutomaticLossScale(jnp.float32(64), hysteresis=2)
  ls = ls.adjust(jnp.bool_(False), upper=0.0)  # forgiven: 1 left
  assert float(ls.loss_scale) == 64 and int(ls.hysteresis_left) == 1
  ls = ls.adjust(jnp.bool_(True), upper=0.5)  # crowded: halves, keeps 1 left
  assert float(ls.loss_scale) == 32 and int(ls.hysteresis_left) == 1
  ls = ls.adjust(jnp.bool_(True), upper=0.0)  # grows: refilled
  assert float(ls.loss_scale) == 64 and int(ls.hysteresis_left) == 2


def test_bounds_hold():
  ls = jmp_lite.AutomaticLossScale(jnp.float32(4), min_loss_scale=2.0, max_loss_scale=8.0)
  for upper, want in [(1.0, 2), (1.0, 2), (0.0, 4), (0.0, 8), (0.0, 8)]:
    ls = ls.adjust(jnp.bool_(True), upper=upper)
    assert float(ls.loss_scale) == want


@pytest.mark.parametrize("kwargs", [dict(threshold=-0.1), dict(threshold=1.5)])
def test_bad_threshold_is_refused(kwargs):
  with pytest.raises(ValueError, match="threshold"):
    jmp_lite.AutomaticLossScale(jnp.float32(8), **kwargs)


def test_vector_measure_is_refused():
  ls = jmp_lite.AutomaticLossScale(jnp.float32(8))
  with pytest.raises(ValueError, match="scalar"):
    ls.adjust(jnp.bool_(True), upper=jnp.zeros(3))


@pytest.mark.parametrize("scale", [4.0, 2.0 ** 25, 2.0 ** 29])
def test_the_upper_bin_is_the_float16_backward_pass(scale):
  """cotangent_upper: of every float16 cotangent (module outputs and
  parameter copies, zeros included), the share at or above 65504 / 16 or
  not finite; at 2**29 some overflow."""
  model = jmp_lite.flax.wrap(_mlp(), "p=f32,c=f16,o=f32")
  x = jax.random.normal(jax.random.key(0), (32, 8))
  params = model.init(jax.random.key(1), x)["params"]
  loss = lambda p: jnp.mean(model.apply({"params": p}, x) ** 2) * 1e-3
  _, _, _, stats = _measured(loss)(params, jmp_lite.StaticLossScale(scale))
  upper = total = 0
  with np.errstate(invalid="ignore"):
    for ct in _f16_cotangents(model, params, x, scale * 1e-3).values():
      a = np.abs(np.asarray(ct, np.float32)).ravel()
      upper += int(np.sum(~np.isfinite(a) | (a >= EDGE)))
      total += a.size
  np.testing.assert_allclose(float(stats.cotangent_upper), upper / total, rtol=1e-6)
  if scale == 4.0:
    assert upper == 0
  else:
    assert 0 < upper < total


def test_with_loss_scale_refuses_to_run_it_blind():
  params = {"w": jnp.ones(3)}
  tx = jmp_lite.optax.with_loss_scale(optax.sgd(0.1), jmp_lite.AutomaticLossScale(2.0 ** 8))
  state = tx.init(params)
  with pytest.raises(ValueError, match="loss_scale_upper"):
    tx.update(params, state, params)
  # Given the measures, it runs.
  _, state = tx.update(params, state, params, loss_scale_upper=jnp.float32(0.0),
                       loss_scale_sampled=jnp.bool_(True))
  assert float(jmp_lite.optax.get_loss_scale(state).loss_scale) == 2.0 ** 9


@pytest.mark.slow  # about 10 s on 2 CPU cores: the heavy tier
@pytest.mark.usefixtures("standard_promotion")
def test_trains_with_a_scale_just_below_the_upper_bin():
  """From a scale of 1 on float16, the scale doubles every step while no
  cotangent reaches the upper bin, then stays where the largest cotangent
  sits within a factor 2 of its edge (against PopART's rule on the
  largest cotangent the step measured); nothing non-finite is applied."""
  model = jmp_lite.flax.wrap(_mlp(), "p=f32,c=f16,o=f32")
  rng = np.random.default_rng(0)
  xs = rng.normal(size=(40, 32, 8)).astype(np.float32)
  ys = rng.integers(0, 4, size=(40, 32))
  params = model.init(jax.random.key(1), xs[0])["params"]
  state = jmp_lite.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.adam(1e-3),
      loss_scale=jmp_lite.AutomaticLossScale(jnp.float32(1.0)))

  @jax.jit
  def step(state, x, y):
    def loss(p, x, y):
      logits = model.apply({"params": p}, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return state.minimize(loss, x, y, telemetry=jmp_lite.Telemetry())

  scales, tops = [], []
  for x, y in zip(xs, ys):
    scale = float(state.loss_scale_state.loss_scale.loss_scale)
    state, info = step(state, x, y)
    top = max(float(m.backward_max) for m in info.precision.modules.values()
              if m.dtype == "float16")
    scales.append(scale)
    tops.append(top)
    assert np.isfinite(top) and not bool(info.skipped)
  assert scales[:5] == [1.0, 2.0, 4.0, 8.0, 16.0]
  # Each step's move is PopART's decision on what that step measured.
  for s, nxt, top in zip(scales, scales[1:], tops):
    assert nxt == (s / 2 if top >= EDGE else s * 2)
  assert EDGE / 4 <= tops[-1] < 2 * EDGE
  for leaf in jax.tree.leaves(state.params):
    assert np.isfinite(np.asarray(leaf)).all()


@pytest.mark.parametrize("make, name", [
    (lambda: jmp_lite.AutomaticLossScale(jnp.float32(2.0 ** 8)), "upper"),
    (lambda: jmp_lite.UnderflowAwareLossScale(jnp.float32(2.0 ** 8), underflow_period=1),
     "underflow"),
])
def test_micro_batches_combine_their_measures(make, name):
  """With accumulate_steps=3 the scale decides on the mean share of the
  three micro-batches (and the smallest headroom), not on the last one's."""
  params = {"w": jnp.ones(3)}
  tx = jmp_lite.optax.with_loss_scale(optax.sgd(0.1), make(), accumulate_steps=3)
  update = jax.jit(tx.update)

  def run(shares, headrooms=(1e4, 1e4, 1e4)):
    state = tx.init(params)
    for share, headroom in zip(shares, headrooms):
      extra = ({"loss_scale_upper": jnp.float32(share), "loss_scale_sampled": jnp.bool_(True)}
               if name == "upper" else
               {"loss_scale_underflow": jnp.float32(share),
                "loss_scale_headroom": jnp.float32(headroom)})
      _, state = update(params, state, params, **extra)
    return float(jmp_lite.optax.get_loss_scale(state).loss_scale)

  if name == "upper":
    # The last micro-batch saw nothing in the upper bin, the first a lot:
    # the mean (0.1) is above the threshold, so the scale halves.
    assert run([0.3, 0.0, 0.0]) == 128.0
    assert run([0.0, 0.0, 0.0]) == 512.0
  else:
    # Underflow in the first micro-batch only: the mean (0.1) is above 1%.
    assert run([0.3, 0.0, 0.0]) == 512.0
    assert run([0.0, 0.0, 0.0]) == 256.0
    # ... but the first micro-batch left no headroom: no growth.
    assert run([0.3, 0.3, 0.3], headrooms=(2.0, 1e4, 1e4)) == 256.0
