"""`jmp_lite.calibrate`: a loss scale measured from one float32 pass.

Oracles: the float16 backward pass itself (at the calibrated scale the
gradients are finite; at a few doublings more they overflow), float32 model
code written here (activations and cotangents whose sizes are set by
construction), and `jmp_lite.flax.wrap` taking the suggested rules.
"""

import dataclasses
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite
import jmp_lite.flax

F16 = "p=f32,c=f16,o=f32"


class Scaled(nn.Module):
  """A dense layer whose output is multiplied by ``factor``."""
  features: int
  factor: float = 1.0

  @nn.compact
  def __call__(self, x):
    return nn.Dense(self.features)(x) * self.factor


class Mlp(nn.Module):
  """Four blocks; ``big`` and ``tiny`` scale two outputs by construction."""
  big: float = 1.0
  tiny: float = 1.0

  @nn.compact
  def __call__(self, x):
    x = nn.tanh(nn.Dense(32, name="embed")(x))
    x = Scaled(32, self.big, name="blow_up")(x)
    x = Scaled(32, self.tiny, name="fade")(nn.tanh(x))
    return nn.Dense(4, name="head")(x)


def _setup(**kwargs):
  model = Mlp(**kwargs)
  x = jax.random.normal(jax.random.key(1), (64, 16))
  y = jax.random.normal(jax.random.key(2), (64, 4))
  params = model.init(jax.random.key(0), x)["params"]
  loss = lambda p, x, y: jnp.mean(
      (model.apply({"params": p}, x).astype(jnp.float32) - y) ** 2) * 1e3
  return model, params, loss, x, y


def _f16_grads_finite(loss, params, x, y, scale):
  # The plain float16 step: parameters cast to f16, gradients computed in
  # f16 and cast back (the engine would accumulate in f32 and hide overflow
  # of the weight gradients, which are the largest cotangents here).
  policy = jmp_lite.get_policy(F16)
  scaled = lambda p: loss(policy.cast_to_compute(p), x.astype(jnp.float16), y) * scale
  grads = jax.jit(jax.grad(scaled))(params)
  return bool(jmp_lite.all_finite(grads))


def test_the_calibrated_scale_is_safe_in_float16_and_a_few_doublings_more_are_not():
  _, params, loss, x, y = _setup()
  cal = jmp_lite.calibrate(loss, params, x, y, policy=F16)
  assert cal.loss_scale == 2.0 ** np.floor(np.log2(65504 / (8 * cal.max_cotangent)))
  assert 1.0 <= cal.loss_scale < 2.0 ** 15  # below the usual start: it would skip
  assert _f16_grads_finite(loss, params, x, y, cal.loss_scale)
  # margin 8 = three doublings of headroom; four doublings overflow float16.
  assert not _f16_grads_finite(loss, params, x, y, cal.loss_scale * 16)


def test_max_cotangent_is_the_model_and_gradients_not_the_loss_around_it():
  _, params, loss, x, y = _setup()
  cal = jmp_lite.calibrate(loss, params, x, y, policy=F16)
  grads = jax.grad(loss)(params, x, y)
  largest_grad = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads))
  # The cotangent of the model's output, d(1e3 * mean((o - y)^2))/do.
  out = Mlp().apply({"params": params}, x)
  largest_out_ct = float(jnp.max(jnp.abs(2e3 * (out - y) / out.size)))
  # head's largest: its output's, or its bias broadcast's (the bias gradient).
  head_bias = float(jnp.max(jnp.abs(grads["head"]["bias"])))
  assert cal.scopes["Mlp/head"].max_cotangent == pytest.approx(
      max(largest_out_ct, head_bias), rel=1e-5)
  assert cal.max_cotangent == pytest.approx(max(
      largest_grad, *(s.max_cotangent for k, s in cal.scopes.items() if k)), rel=1e-6)
  # The loss's own cotangents (1e3 for the mean, in float32 around the
  # model) are outside every scope, and do not set the scale.
  assert cal.scopes[""].max_cotangent == pytest.approx(1e3)
  assert cal.max_cotangent < 1e3


def test_scopes_that_overflow_or_underflow_are_suggested_for_float32():
  # fade scales by 1e-9 on the way back too: every cotangent before it is
  # below float16's smallest normal even at the calibrated scale.
  _, params, loss, x, y = _setup(tiny=1e-9)
  cal = jmp_lite.calibrate(loss, params, x, y, policy=F16)
  for scope in ("Mlp/embed", "Mlp/blow_up/Dense_0", "Mlp/fade/Dense_0"):
    assert cal.scopes[scope].underflow > 0.5 and scope in cal.keep_float32, scope
  assert cal.scopes["Mlp/head"].underflow < 0.5 and "Mlp/head" not in cal.keep_float32
  # blow_up's outputs exceed 65504 / margin.
  model, params, loss, x, y = _setup(big=1e5)
  cal = jmp_lite.calibrate(loss, params, x, y, policy=F16)
  assert cal.scopes["Mlp/blow_up"].overflow
  assert cal.scopes["Mlp/blow_up"].max_activation > 65504 / 8
  assert "Mlp/blow_up" in cal.keep_float32 and not cal.scopes["Mlp/head"].overflow
  rules = cal.flax_rules()
  assert set(rules.values()) == {"p=f32,c=f32,o=f32"}
  # wrap takes them: the kept module and its submodules compute in float32,
  # the rest in float16.
  computes = {path: p.compute_dtype for path, p in jmp_lite.flax.policy_map(
      jmp_lite.flax.wrap(model, F16, rules=rules), x).items()}
  assert computes["blow_up"] == computes["blow_up/Dense_0"] == jnp.float32
  assert computes["head"] == computes["embed"] == jnp.float16


def test_bfloat16_needs_no_scale_and_an_unscoped_function_works():
  loss = lambda w, x: jnp.sum(jnp.tanh(x @ w))
  cal = jmp_lite.calibrate(loss, jnp.ones((4, 3)), jnp.ones((2, 4)), policy="p=f32,c=bf16")
  assert cal.loss_scale == 1.0 and cal.compute_dtype == jnp.bfloat16
  assert set(cal.scopes) == {""} and cal.keep_float32 == ()
  scale = cal.dynamic_loss_scale(period=10)
  assert float(scale.loss_scale) == 1.0 and int(scale.period) == 10


def test_bad_input_is_named():
  loss = lambda w, x: jnp.sum(x @ w)
  with pytest.raises(ValueError, match=r"calibrate: margin must be a finite number >= 1, "
                     r"got 0.5"):
    jmp_lite.calibrate(loss, jnp.ones((4, 3)), jnp.ones((2, 4)), policy=F16, margin=0.5)
  with pytest.raises(ValueError, match=r"calibrate: the float32 pass is not finite"):
    jmp_lite.calibrate(loss, jnp.ones((4, 3)), jnp.full((2, 4), jnp.nan), policy=F16)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"margin": 0.5}, ValueError, r"margin must be a finite number >= 1, got 0\.5"),
    ({"margin": float("inf")}, ValueError, r"margin must be a finite number >= 1, got inf"),
    ({"margin": "8"}, TypeError, r"margin must be a finite number >= 1, got '8' \(str\)"),
    ({"margin": True}, TypeError, r"margin must be .* got True \(bool\)"),
    ({"max_loss_scale": -1}, ValueError, r"max_loss_scale must be a finite number >= 1, got -1\.0"),
    ({"max_loss_scale": 0}, ValueError, r"max_loss_scale must be a finite number >= 1, got 0\.0"),
    ({"underflow_threshold": 1.5}, ValueError, r"underflow_threshold must be a number in \[0, 1\], got 1\.5"),
    ({"underflow_threshold": float("nan")}, ValueError, r"underflow_threshold must be"),
])
def test_options_are_checked_with_errors_naming_the_value(kwargs, error, match):
  loss = lambda w, x: jnp.sum((x @ w) ** 2)
  with pytest.raises(error, match=match):
    jmp_lite.calibrate(loss, jnp.ones((4, 3)), jnp.ones((2, 4)), policy=F16, **kwargs)


def test_numpy_scalars_are_numbers():
  loss = lambda w, x: jnp.sum((x @ w) ** 2)
  a = jmp_lite.calibrate(loss, jnp.full((4, 4), 30.0), jnp.ones((2, 4)), policy=F16,
                         margin=np.float32(8), max_loss_scale=np.int64(2 ** 24))
  b = jmp_lite.calibrate(loss, jnp.full((4, 4), 30.0), jnp.ones((2, 4)), policy=F16)
  assert (a.loss_scale, a.margin) == (b.loss_scale, b.margin) == (16.0, 8.0)


def test_a_cotangent_beyond_float16_at_scale_one_is_warned_not_silent():
  # d/dw sum((x @ w)**2) with x = 1 (2 x 4) and w = 4500: 2 * 2 * 4 * 4500 =
  # 72,000 (NumPy's oracle below), beyond float16's 65504 at any loss scale.
  loss = lambda w, x: jnp.sum((x @ w) ** 2)
  w, x = np.full((4, 4), 4500.0, np.float32), np.ones((2, 4), np.float32)
  grad = 2 * x.T @ (x @ w)
  assert grad.max() == 72000.0
  with pytest.warns(UserWarning, match=r"largest cotangent, 72000, exceeds float16's "
                    r"maximum \(65504\) / margin \(8\) at loss scale 1"):
    cal = jmp_lite.calibrate(loss, jnp.asarray(w), jnp.asarray(x), policy=F16)
  assert cal.loss_scale == 1.0 and cal.max_cotangent == 72000.0


class _Layer(nn.Module):
  factor: float

  @nn.compact
  def __call__(self, x, _):
    return jnp.tanh(nn.Dense(16, name="dense")(x)) * self.factor, None


class _Stack(nn.Module):
  """Four layers as one `nn.scan` (with `nn.remat` inside, as published
  transformers stack theirs), or unrolled with the same parameters."""
  scanned: bool
  remat: bool = False

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(16, name="inp")(x)
    if self.scanned:
      layer = nn.remat(_Layer) if self.remat else _Layer
      stack = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True},
                      length=4)
      x, _ = stack(1e4, name="stack")(x, None)
    else:
      for i in range(4):
        x, _ = _Layer(1e4, name=f"layer_{i}")(x, None)
    return nn.Dense(3, name="out")(x)


@pytest.mark.parametrize("remat", [False, True])
def test_scan_and_remat_bodies_are_measured_as_the_unrolled_model(remat):
  """A scanned stack's values are measured inside the scan (and its remat):
  per scope, the maxima over the iterations and the underflow over all of
  them are the unrolled model's over its four layers; the scale is the
  same. Before, the stack showed only as its output."""
  import optax  # pylint: disable=g-import-not-at-top
  x = jax.random.normal(jax.random.key(0), (8, 5))
  y = jnp.arange(8) % 3
  scanned = _Stack(scanned=True, remat=remat)
  params = scanned.init(jax.random.key(1), x)["params"]
  unrolled_params = {"inp": params["inp"], "out": params["out"], **{
      f"layer_{i}": jax.tree.map(lambda a, i=i: a[i], params["stack"]) for i in range(4)}}

  def loss(model):
    return lambda p, x, y: optax.softmax_cross_entropy_with_integer_labels(
        model.apply({"params": p}, x), y).mean()

  got = jmp_lite.calibrate(loss(scanned), params, x, y, policy=F16)
  want = jmp_lite.calibrate(loss(_Stack(scanned=False)), unrolled_params, x, y, policy=F16)
  assert got.loss_scale == want.loss_scale
  np.testing.assert_allclose(got.max_cotangent, want.max_cotangent, rtol=1e-5)
  for inner in ("dense", ""):
    mine = got.scopes["_Stack/stack" + (f"/{inner}" if inner else "")]
    theirs = [want.scopes[f"_Stack/layer_{i}" + (f"/{inner}" if inner else "")]
              for i in range(4)]
    np.testing.assert_allclose(mine.max_activation, max(s.max_activation for s in theirs),
                               rtol=1e-5)
    np.testing.assert_allclose(mine.max_cotangent, max(s.max_cotangent for s in theirs),
                               rtol=1e-5)
    np.testing.assert_allclose(mine.underflow, np.mean([s.underflow for s in theirs]),
                               atol=0.02)
  # Activations of 1e4 exceed float16's maximum over the margin: kept in float32.
  assert "_Stack/stack" in got.keep_float32


def test_python_values_in_the_batch_reach_the_loss_as_they_are():
  """``train=False`` (a Python bool a model branches on) and a name are not
  traced: before, ``if not train`` raised TracerBoolConversionError."""

  class Dropping(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
      x = nn.Dense(8, name="dense")(x)
      return nn.Dropout(0.5, deterministic=not train)(x)

  model = Dropping()
  x = jnp.ones((4, 3))
  params = model.init(jax.random.key(0), x, train=False)["params"]

  def loss(p, x, *, train, reduction):
    assert isinstance(train, bool) and reduction == "mean"
    return jnp.mean(model.apply({"params": p}, x, train=train) ** 2)

  got = jmp_lite.calibrate(loss, params, x, train=False, reduction="mean", policy=F16)
  assert "Dropping/dense" in got.scopes and got.loss_scale >= 1


def test_a_mask_fill_value_is_not_an_overflowing_activation():
  """Flax's attention masks logits with ``jnp.finfo(dtype).min``: float32's
  lowest in the calibrating pass, float16's own under the policy. A real
  activation of 1e5 in the same scope still overflows float16."""

  def loss(w, x, big):
    with jax.named_scope("attention"):
      logits = x @ w
      mask = jnp.arange(logits.shape[-1]) < 3
      logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
      probs = jax.nn.softmax(logits) * big
    return jnp.sum(probs) * 1e-6  # small cotangents: only the activation is large

  w = jnp.ones((4, 6)) * 0.1
  x = jnp.ones((2, 4))
  masked = jmp_lite.calibrate(loss, w, x, 1.0, policy=F16)
  assert masked.scopes["attention"].max_activation < 10
  assert masked.keep_float32 == ()
  blown = jmp_lite.calibrate(loss, w, x, 1e5, policy=F16)
  assert blown.scopes["attention"].overflow and blown.keep_float32 == ("attention",)


def test_an_nnx_model_is_measured_per_module_like_its_linen_twin():
  """An NNX model opens no name scopes of its own; through `jmp_lite.flax.wrap`
  (float32 policy) each module's call opens its path, so calibrate sees the
  same modules as for the Linen model with the same weights: the same
  statistics per scope, the same suggestions, and rules that wrap takes."""
  from flax import nnx

  class NnxScaled(nnx.Module):
    def __init__(self, din, dout, factor, rngs):
      self.lin = nnx.Linear(din, dout, rngs=rngs)
      self.factor = factor

    def __call__(self, x):
      return self.lin(x) * self.factor

  class NnxMlp(nnx.Module):
    def __init__(self, big, rngs):
      self.embed = nnx.Linear(16, 32, rngs=rngs)
      self.blow_up = NnxScaled(32, 32, big, rngs)
      self.fade = NnxScaled(32, 32, 1.0, rngs)
      self.head = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
      x = self.blow_up(jnp.tanh(self.embed(x)))
      return self.head(self.fade(jnp.tanh(x)))

  model, params, loss, x, y = _setup(big=1e5)
  linen = jmp_lite.calibrate(loss, params, x, y, policy=F16)
  twin = NnxMlp(1e5, nnx.Rngs(0))
  # The Linen weights, in the NNX modules (the same layout: kernel (in, out)).
  for name, inner in (("embed", None), ("blow_up", "Dense_0"), ("fade", "Dense_0"),
                      ("head", None)):
    src = params[name] if inner is None else params[name][inner]
    dst = getattr(twin, name) if inner is None else getattr(twin, name).lin
    dst.kernel.set_value(src["kernel"])
    dst.bias.set_value(src["bias"])
  wrapped = jmp_lite.flax.wrap(twin, "p=f32,c=f32,o=f32")
  graphdef, nparams, rest = nnx.split(wrapped, nnx.Param, ...)
  nloss = lambda p, x, y: jnp.mean(
      (nnx.merge(graphdef, p, rest)(x) - y) ** 2) * 1e3
  cal = jmp_lite.calibrate(nloss, nparams, x, y, policy=F16)

  rename = {"Mlp": "NnxMlp", "Dense_0": "lin"}
  as_nnx = lambda scope: "/".join(rename.get(p, p) for p in scope.split("/"))
  assert {as_nnx(s) for s in linen.scopes} == set(cal.scopes)
  for scope, stats in linen.scopes.items():
    theirs = cal.scopes[as_nnx(scope)]
    np.testing.assert_allclose(theirs.max_activation, stats.max_activation, rtol=1e-5)
    np.testing.assert_allclose(theirs.max_cotangent, stats.max_cotangent, rtol=1e-5)
    assert theirs.overflow == stats.overflow, scope
  assert cal.loss_scale == linen.loss_scale
  assert tuple(map(as_nnx, linen.keep_float32)) == cal.keep_float32
  assert "NnxMlp/blow_up" in cal.keep_float32
  # The rules name NNX paths that wrap resolves.
  computes = {path: p.compute_dtype for path, p in jmp_lite.flax.policy_map(
      jmp_lite.flax.wrap(twin, F16, rules=cal.flax_rules())).items()}
  assert computes["blow_up"] == computes["blow_up/lin"] == jnp.float32
  assert computes["head"] == computes["embed"] == jnp.float16


def _matmul_rows(x, w):
  return np.asarray(x, np.float64) @ np.asarray(w, np.float64)


def test_the_branch_taken_is_measured_inside_and_the_other_reports_zeros():
  """Inside ``cond``: the taken branch's values and cotangents are the
  ones written out by hand in NumPy (``y = x @ w``, loss ``sum(y**2)``:
  the cotangent of ``y`` is ``2 y``); the branch not taken ran nothing and
  reports zeros. Before, only the cond's outputs were measured."""
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.standard_normal((5, 3)), jnp.float32)
  x = jnp.asarray(rng.standard_normal((4, 5)), jnp.float32)

  def taken(a, w):
    with jax.named_scope("taken"):
      return a @ w

  def other(a, w):
    with jax.named_scope("other"):
      return a[:, :3] * 7.0

  def loss(w, x, flag):
    return jnp.sum(jax.lax.cond(flag, taken, other, x, w) ** 2)

  got = jmp_lite.calibrate(loss, w, x, True, policy=F16)
  y = _matmul_rows(x, w)
  np.testing.assert_allclose(got.scopes["taken"].max_activation, np.abs(y).max(), rtol=1e-5)
  np.testing.assert_allclose(got.scopes["taken"].max_cotangent, np.abs(2 * y).max(),
                             rtol=1e-5)
  assert got.scopes["other"].max_activation == 0 == got.scopes["other"].max_cotangent
  # The other way round, the other branch's values (7 x) are measured.
  flipped = jmp_lite.calibrate(loss, w, x, False, policy=F16)
  np.testing.assert_allclose(flipped.scopes["other"].max_activation,
                             7 * np.abs(np.asarray(x)[:, :3]).max(), rtol=1e-6)
  assert flipped.scopes["taken"].max_activation == 0


def test_a_while_loop_is_measured_over_its_iterations_forward_only():
  """A ``while`` loop over the batch (a frozen teacher's refinement: no
  gradient flows through a while loop) doubles its value a number of times
  known only at run time: the scope's largest activation is the last
  iteration's, ``max|x w| * 2**(n-1)``, computed here in NumPy; no
  cotangent reaches it."""
  rng = np.random.default_rng(1)
  w = jnp.asarray(rng.standard_normal((5, 5)), jnp.float32)
  x = jnp.asarray(rng.standard_normal((4, 5)), jnp.float32)

  def loss(w, x, n):
    def body(state):
      i, h = state
      with jax.named_scope("refine"):
        h = h * 2.0
      return i + 1, h

    with jax.named_scope("teacher"):
      h0 = x @ jax.lax.stop_gradient(w)
    _, h = jax.lax.while_loop(lambda s: s[0] < n, body, (jnp.int32(1), h0))
    return jnp.sum((x @ w) ** 2) + jnp.sum(jax.lax.stop_gradient(h))

  n = jnp.int32(5)
  got = jmp_lite.calibrate(loss, w, x, n, policy=F16)
  want = np.abs(_matmul_rows(x, w)).max() * 2.0 ** 4
  np.testing.assert_allclose(got.scopes["refine"].max_activation, want, rtol=1e-5)
  assert got.scopes["refine"].max_cotangent == 0


def test_a_custom_vjp_body_is_measured_and_its_rule_still_differentiates():
  """Inside a ``custom_vjp`` the forward values are measured (the body's
  ``3 x w``); the gradients are still the rule's, which here multiplies the
  cotangent by 100, so the parameter gradient ``jax.grad`` gives (the
  oracle) is the largest cotangent calibrate reports. Differentiating the
  body instead would report one 100 times smaller."""
  rng = np.random.default_rng(2)
  w = jnp.asarray(rng.standard_normal((5, 3)), jnp.float32)
  x = jnp.asarray(rng.standard_normal((4, 5)) / 10, jnp.float32)

  @jax.custom_vjp
  def amplified(x, w):
    with jax.named_scope("inside"):
      return (x @ w) * 3.0

  def fwd(x, w):
    return amplified(x, w), (x, w)

  def bwd(res, g):
    x, w = res
    g = g * 300.0  # the body's own derivative times 100
    return g @ w.T, x.T @ g

  amplified.defvjp(fwd, bwd)

  def loss(w, x):
    return jnp.sum(amplified(x, w) ** 2)

  got = jmp_lite.calibrate(loss, w, x, policy=F16)
  np.testing.assert_allclose(got.scopes["inside"].max_activation,
                             3 * np.abs(_matmul_rows(x, w)).max(), rtol=1e-5)
  np.testing.assert_allclose(got.max_cotangent,
                             float(jnp.max(jnp.abs(jax.grad(loss)(w, x)))), rtol=1e-5)



def test_a_wrapped_model_gives_the_rules_of_the_unwrapped_one():
  """Calibrated wrapped (with a float32 policy, as the docstring allows),
  a Linen model's scopes carried wrap's own ``_LinenWrapper/module`` frames,
  so `flax_rules` named ``module/Dense_0`` and kept nothing in float32.
  Oracle: the unwrapped model's scopes and rules, and wrap's `policy_map`."""
  from jmp_lite import _linen  # pylint: disable=g-import-not-at-top
  from jmp_lite._jaxpr.passes import plan  # pylint: disable=g-import-not-at-top
  assert plan.WRAPPER_FRAME == _linen._LinenWrapper.__name__ + "/module"
  assert "module" in {f.name for f in dataclasses.fields(_linen._LinenWrapper)}

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(4)(nn.relu(nn.Dense(8)(x)))

  x = jnp.ones((2, 3)) * 1e6  # overflows float16: every scope is kept
  params = MLP().init(jax.random.key(0), x)
  runs = {}
  for name, model in (("plain", MLP()), ("wrapped", jmp_lite.flax.wrap(MLP(), "p=f32,c=f32,o=f32"))):
    runs[name] = jmp_lite.calibrate(lambda p, m=model: jnp.sum(m.apply(p, x)) * 1e-6, params,
                                    policy="p=f32,c=f16,o=f32", underflow_threshold=0.0)
  plain, wrapped = runs["plain"], runs["wrapped"]
  assert [s.split("/", 1)[1:] for s in wrapped.scopes] == [
      s.split("/", 1)[1:] for s in plain.scopes]
  assert wrapped.flax_rules() == plain.flax_rules() != {}
  kept = jmp_lite.flax.policy_map(
      jmp_lite.flax.wrap(MLP(), "p=f32,c=f16,o=f32", rules=wrapped.flax_rules()), x)
  assert {p for p, pol in kept.items() if p and pol.compute_dtype == jnp.float32} == {
      "Dense_0", "Dense_1"}
