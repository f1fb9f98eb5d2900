"""`UnderflowAwareLossScale`: growth on measured underflow, and where it comes from.

Oracles: the state machine is checked against `DynamicLossScale` (the same
transitions whenever nothing is measured) and against a plain-Python
transcription of the rule in the class docstring; the measures it reads are
checked against the float16 backward pass itself (a cotangent held in
float16 is subnormal iff NumPy says so) and their effect against
`DynamicLossScale` trained on the same batches.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite

F16 = np.finfo(np.float16)


def _reference(scale, counter, finite, underflow, headroom, *, period, factor,
               threshold, margin, underflow_period, max_scale):
  """The rule, in Python: DynamicLossScale (hysteresis 1), then the boost."""
  old = scale
  if finite:
    if counter >= period - 1:
      scale, counter = min(scale * factor, max_scale), 0
    else:
      counter += 1
  else:
    scale, counter = max(1.0, scale / factor), 0
  boost = (finite and scale == old and counter - 1 >= underflow_period - 1
           and underflow > threshold and headroom >= factor * margin)
  # The boost is decided on the counter before this step's increment.
  if boost:
    scale, counter = min(scale * factor, max_scale), 0
  return scale, counter


def test_matches_the_rule_over_a_random_sequence():
  rng = np.random.default_rng(0)
  kw = dict(period=7, factor=2.0, threshold=0.05, margin=4.0, underflow_period=3,
            max_scale=2.0 ** 20)
  ls = jmp_lite.UnderflowAwareLossScale(
      jnp.float32(64), period=7, factor=2, underflow_threshold=0.05, margin=4.0,
      underflow_period=3, max_loss_scale=2.0 ** 20)
  adjust = jax.jit(lambda s, f, u, h: s.adjust(f, u, h))
  scale, counter = 64.0, 0
  for _ in range(300):
    finite = bool(rng.random() > 0.1)
    underflow = float(rng.choice([0.0, 0.01, 0.5]))
    headroom = float(rng.choice([1.0, 8.0, 100.0]))
    ls = adjust(ls, jnp.bool_(finite), underflow, headroom)
    scale, counter = _reference(scale, counter, finite, underflow, headroom, **kw)
    assert float(ls.loss_scale) == scale and int(ls.counter) == counter


def test_without_measures_it_is_dynamic_loss_scale():
  rng = np.random.default_rng(1)
  a = jmp_lite.UnderflowAwareLossScale(jnp.float32(2 ** 10), period=3)
  b = jmp_lite.DynamicLossScale(jnp.float32(2 ** 10), period=3)
  for finite in rng.random(50) > 0.2:
    a, b = a.adjust(jnp.bool_(finite)), b.adjust(jnp.bool_(finite))
    assert float(a.loss_scale) == float(b.loss_scale) and int(a.counter) == int(b.counter)


@pytest.mark.parametrize("kwargs, message", [
    (dict(underflow_threshold=1.0), "underflow_threshold"),
    (dict(underflow_threshold=-0.1), "underflow_threshold"),
    (dict(margin=0.5), "margin"),
    (dict(margin=float("inf")), "margin"),
    (dict(underflow_period=0), "underflow_period"),
])
def test_bad_arguments_are_refused(kwargs, message):
  with pytest.raises(ValueError, match=message):
    jmp_lite.UnderflowAwareLossScale(jnp.float32(8), **kwargs)


def test_is_a_pytree_that_compiles_once():
  ls = jmp_lite.UnderflowAwareLossScale(jnp.float32(8), underflow_period=1)
  leaves = jax.tree_util.tree_leaves(ls)
  assert len(leaves) == 12 and all(isinstance(x, jax.Array) for x in leaves)
  traces = []

  @jax.jit
  def step(ls, u):
    traces.append(1)
    return ls.adjust(jnp.bool_(True), u, jnp.float32(1e4))

  for u in (0.5, 0.0, 0.7):
    ls = step(ls, jnp.float32(u))
  assert len(traces) == 1 and float(ls.loss_scale) == 32.0


def _mlp():
  import flax.linen as nn

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.relu(nn.Dense(64)(x))  # Dense_0
      return nn.Dense(4)(h)  # Dense_1

  return MLP()


def _measured(loss):
  """The telemetry step of ``loss``, compiled: eagerly, this model's step
  takes 10-20 s on 2 CPU cores, compiled 1-2 s."""
  grad = jmp_lite.value_and_grad(loss, telemetry=jmp_lite.Telemetry())
  return jax.jit(lambda p, scale: grad(p, loss_scale=scale))


def test_the_measures_are_the_float16_backward_pass():
  # cotangent_underflow: the share of non-zero f16 cotangents (module
  # outputs and parameter copies) below float16's smallest normal;
  # cotangent_headroom: float16's max over the largest of them.
  model = jmp_lite.flax.wrap(_mlp(), "p=f32,c=f16,o=f32")
  x = jax.random.normal(jax.random.key(0), (32, 8))
  params = model.init(jax.random.key(1), x)["params"]
  loss = lambda p: jnp.mean(model.apply({"params": p}, x) ** 2) * 1e-3
  _, _, _, stats = _measured(loss)(params, jmp_lite.StaticLossScale(4.0))
  # Oracle: the scaled f16 cotangents of every f16 value, written out.
  cts, under, nonzero = [], 0, 0
  for path, ct in _f16_cotangents(model, params, x, 4e-3).items():
    a = np.abs(np.asarray(ct, np.float32)).ravel()
    a = a[a > 0]
    under += int(np.sum(a < F16.smallest_normal))
    nonzero += a.size
    cts.append(float(a.max(initial=0)))
  # The oracle is another program: on a GPU a cotangent that underflows to
  # 0 in one can stay a tiny non-zero in the other (an H200: 1726 of 2113
  # against 1725 of 2112).
  slack = 0 if jax.default_backend() == "cpu" else 8 / nonzero
  np.testing.assert_allclose(float(stats.cotangent_underflow), under / nonzero, rtol=1e-6,
                             atol=slack)
  np.testing.assert_allclose(float(stats.cotangent_headroom), float(F16.max) / max(cts),
                             rtol=1e-3)


def _f16_cotangents(model, params, x, scale):
  """Cotangents (scaled) of the f16 parameter copies and module outputs."""
  p16 = jax.tree.map(lambda a: a.astype(jnp.float16), params)

  def forward(p16, x16):
    d0 = x16 @ p16["Dense_0"]["kernel"] + p16["Dense_0"]["bias"]
    d1 = jax.nn.relu(d0) @ p16["Dense_1"]["kernel"] + p16["Dense_1"]["bias"]
    return d0, d1

  x16 = x.astype(jnp.float16)
  d0, d1 = forward(p16, x16)
  out_ct = (2 * d1.astype(jnp.float32) / d1.size * scale).astype(jnp.float16)
  relu_ct = out_ct @ p16["Dense_1"]["kernel"].T
  d0_ct = jnp.where(d0 > 0, relu_ct, 0).astype(jnp.float16)
  return {
      "Dense_1": out_ct, "": out_ct, "Dense_0": d0_ct,
      "Dense_1/kernel": (jax.nn.relu(d0).astype(jnp.float32).T
                         @ out_ct.astype(jnp.float32)).astype(jnp.float16),
      "Dense_1/bias": out_ct.astype(jnp.float32).sum(0).astype(jnp.float16),
      "Dense_0/kernel": (x16.astype(jnp.float32).T
                         @ d0_ct.astype(jnp.float32)).astype(jnp.float16),
      "Dense_0/bias": d0_ct.astype(jnp.float32).sum(0).astype(jnp.float16),
  }


@pytest.mark.slow  # about 13 s on 2 CPU cores: the heavy tier
@pytest.mark.usefixtures("standard_promotion")
def test_grows_where_dynamic_loss_scale_waits_and_skips_no_more():
  # Same model, batches and start: DynamicLossScale (period 200) never grows
  # in 60 steps; the underflow-aware scale grows every underflow_period
  # steps while the float16 cotangents underflow and headroom remains, and
  # reaches a lower measured underflow without a skipped step.
  model = jmp_lite.flax.wrap(_mlp(), "p=f32,c=f16,o=f32")
  rng = np.random.default_rng(0)
  xs = rng.normal(size=(60, 32, 8)).astype(np.float32)
  ys = rng.integers(0, 4, size=(60, 32))
  params = model.init(jax.random.key(1), xs[0])["params"]
  telemetry = jmp_lite.Telemetry(every=5)

  def run(loss_scale):
    state = jmp_lite.TrainState.create(apply_fn=model.apply, params=params,
                                       tx=optax.adam(1e-2), loss_scale=loss_scale)

    @jax.jit
    def step(state, x, y):
      loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(
          model.apply({"params": p}, x), y).mean() * 1e-4
      return state.minimize(loss, telemetry=telemetry)

    under = []
    for i in range(60):
      state, info = step(state, xs[i], ys[i])
      if i % 5 == 0:
        under.append(float(info.precision.cotangent_underflow))
    return state, under

  fixed, under_fixed = run(jmp_lite.DynamicLossScale(jnp.float32(1), period=200))
  aware, under_aware = run(jmp_lite.UnderflowAwareLossScale(
      jnp.float32(1), period=200, underflow_period=5))
  assert float(fixed.loss_scale.loss_scale) == 1.0
  assert float(aware.loss_scale.loss_scale) >= 2.0 ** 8
  assert int(aware.loss_scale_state.skipped_steps) == 0
  assert under_fixed[-1] > 0.1 and under_aware[-1] < under_fixed[-1] / 2


def test_vector_measures_are_refused_not_broadcast_into_the_scale():
  ls = jmp_lite.UnderflowAwareLossScale(jnp.float32(1024), underflow_period=1)
  for bad in ({"underflow": jnp.array([0.3, 0.2, 0.1]), "headroom": 1000.0},
              {"underflow": 0.3, "headroom": np.array([1e3, 1e4])}):
    with pytest.raises(ValueError, match=r"must be a scalar .* got shape \((3|2),\)"):
      ls.adjust(jnp.bool_(True), **bad)
  # Scalars of any kind still work, and the scale stays a scalar.
  out = ls.adjust(jnp.bool_(True), underflow=np.float32(0.3), headroom=jnp.float32(1e3))
  assert out.loss_scale.shape == () and float(out.loss_scale) == 2048.0


def test_a_growth_on_underflow_refills_hysteresis_as_a_period_growth_does():
  # hysteresis=2: one overflow is forgiven, then hysteresis_left is 1. Any
  # growth refills it (DynamicLossScale's period growth, DeepSpeed's
  # DynamicLossScaler.update_scale: `self.cur_hysteresis = self.delayed_shift`
  # on growth), so the next single overflow is forgiven again.
  kw = dict(period=1000, hysteresis=2, underflow_period=1)
  ls = jmp_lite.UnderflowAwareLossScale(jnp.float32(1024), **kw)
  ls = ls.adjust(jnp.bool_(False))  # forgiven: scale stays, one left
  assert float(ls.loss_scale) == 1024.0 and int(ls.hysteresis_left) == 1
  ls = ls.adjust(jnp.bool_(True), underflow=0.5, headroom=1e4)  # grows on underflow
  assert float(ls.loss_scale) == 2048.0 and int(ls.hysteresis_left) == 2
  ls = ls.adjust(jnp.bool_(False))  # forgiven again, as after a period growth
  assert float(ls.loss_scale) == 2048.0
  # The same sequence with the period doing the growing: the same state.
  ref = jmp_lite.DynamicLossScale(jnp.float32(1024), period=1, hysteresis=2)
  ref = ref.adjust(jnp.bool_(False)).adjust(jnp.bool_(True)).adjust(jnp.bool_(False))
  assert float(ref.loss_scale) == 2048.0
  assert int(ref.hysteresis_left) == int(ls.hysteresis_left) == 1


def _gain_model(policy="p=f32,c=f16,o=f32"):
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jmp_lite.flax  # noqa: F401  pylint: disable=g-import-not-at-top

  class Gain(nn.Module):
    """``x * g``: the loss's cotangent reaches the output as it is."""

    @nn.compact
    def __call__(self, x):
      return x * self.param("g", nn.initializers.ones, (x.shape[-1],))

  return jmp_lite.flax.wrap(Gain(), policy)


def _crafted(case, shape=(16, 8)):
  """Loss cotangents in float32: float16-normal, subnormal, flushed to zero,
  or a mix, each with zeros that were zeros in float32 too."""
  rng = np.random.default_rng(0)
  if case == "mixed":
    mags = rng.choice([0.0, 1e-3, 1e-6, 3.1e-8, 2.9e-8, 1e-8], size=shape)
    return (mags * rng.choice([-1.0, 1.0], size=shape)).astype(np.float32)
  c = np.full(shape, {"normal": 1e-3, "subnormal": 1e-6, "flushed": 1e-8}[case],
              np.float32)
  c[0] = 0.0
  return c


@pytest.mark.parametrize("case", ["normal", "subnormal", "flushed", "mixed"])
def test_the_underflow_measure_counts_what_the_cast_to_float16_flushes(case):
  """The model's output is float16, the loss float32: the backward pass casts
  the loss's cotangent to float16, where values below 2**-25 become 0. Those
  count as underflow (before, a total flush read 0.0, with headroom inf)."""
  model, c = _gain_model(), _crafted(case)
  x = jnp.ones(c.shape)
  params = model.init(jax.random.key(0), x)["params"]
  loss = lambda p: jnp.sum(model.apply({"params": p}, x) * c)
  telemetry = jmp_lite.Telemetry(what_if=("bfloat16",))
  _, _, _, stats = jmp_lite.value_and_grad(loss, telemetry=telemetry)(
      params, loss_scale=jmp_lite.StaticLossScale(1.0))
  # Oracle: NumPy's cast of the same cotangents to float16.
  c16 = np.abs(c.astype(np.float16).astype(np.float32))
  nonzero = c != 0
  flushed = nonzero & (c16 == 0)
  under = nonzero & (c16 < F16.smallest_normal)
  out = stats.modules[""]
  np.testing.assert_allclose(float(out.backward_underflow["float16"]),
                             under.sum() / nonzero.sum(), rtol=1e-6)
  assert float(out.backward_max) == float(c16.max())
  # What float16 flushes, bfloat16 holds as normal numbers (its tiny is 1e-38).
  assert float(out.backward_underflow["bfloat16"]) == 0.0
  if case == "flushed":
    assert flushed.sum() == nonzero.sum() > 0
    # Every cotangent underflowed: the measure a loss scale grows on says so.
    assert float(stats.cotangent_underflow) == 1.0
  if case == "normal":
    assert float(stats.cotangent_underflow) == 0.0
  if case == "mixed":
    assert 0 < flushed.sum() < under.sum() < nonzero.sum()


def test_a_parameter_that_float16_flushes_counts_as_forward_underflow():
  model = _gain_model()
  x = jnp.ones((4, 8))
  g = np.ones(8, np.float32)
  g[:3] = [1e-8, -2e-8, 1e-6]  # two flushed, one subnormal in float16
  params = {"g": jnp.asarray(g)}
  loss = lambda p: jnp.sum(model.apply({"params": p}, x))
  _, _, _, stats = jmp_lite.value_and_grad(loss, telemetry=jmp_lite.Telemetry())(
      params, loss_scale=jmp_lite.StaticLossScale(1.0))
  g16 = np.abs(g.astype(np.float16).astype(np.float32))
  expected = ((g != 0) & (g16 < F16.smallest_normal)).sum() / (g != 0).sum()
  np.testing.assert_allclose(float(stats.modules["g"].forward_underflow["float16"]),
                             expected, rtol=1e-6)
  assert expected == 3 / 8


def test_an_output_narrowed_on_its_way_out_is_measured_as_computed():
  """c=f32,o=bf16: the model's output row is the float32 value it computed,
  not its bfloat16 rounding (1 + 2**-10 is not a bfloat16)."""
  model = _gain_model("p=f32,c=f32,o=bf16")
  x = jnp.full((2, 8), 1.0 + 2.0 ** -10, jnp.float32)
  params = model.init(jax.random.key(0), x)["params"]
  loss = lambda p: jnp.sum(model.apply({"params": p}, x).astype(jnp.float32))
  _, _, _, stats = jmp_lite.value_and_grad(loss, telemetry=jmp_lite.Telemetry())(
      params, loss_scale=jmp_lite.StaticLossScale(1.0))
  assert stats.modules[""].dtype == "float32"
  assert float(stats.modules[""].forward_max) == 1.0 + 2.0 ** -10


@pytest.mark.parametrize("policy", ["p=f32,c=f16,o=bf16", "p=f32,c=bf16,o=f16"])
def test_an_output_cast_between_half_formats_is_measured_as_computed(policy):
  """float16 <-> bfloat16 rounds both ways (65504 becomes 65536 in bfloat16,
  inf in float16): the model's row is what it computed, not the cast."""
  model = _gain_model(policy)
  x = jnp.asarray([[65504.0, 1.0, 1.0, 1.0]], jnp.float32)
  params = model.init(jax.random.key(0), x)["params"]
  loss = lambda p: jnp.sum(model.apply({"params": p}, x).astype(jnp.float32))
  _, _, _, stats = jmp_lite.value_and_grad(loss, telemetry=jmp_lite.Telemetry())(
      params, loss_scale=jmp_lite.StaticLossScale(1.0))
  computed = jnp.asarray(x, policy.split(",")[1][2:].replace("f16", "float16")
                         .replace("bf16", "bfloat16"))
  row = stats.modules[""]
  assert row.dtype == str(computed.dtype)
  assert float(row.forward_max) == float(jnp.max(computed.astype(jnp.float32)))
  assert int(row.forward_nonfinite) == 0
