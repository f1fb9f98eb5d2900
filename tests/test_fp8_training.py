"""fp8 training end to end: wrapped Flax models, `TrainState`, checkpoints.

Oracles, none of them jmp_lite's fp8 code:

* Flax's own fp8 layer, ``flax.linen.Fp8DotGeneralOp`` (Flax 0.12.8,
  ``flax/linen/fp8_ops.py``: ``in_qdq`` on both operands, ``out_qdq`` on the
  output cotangent, the amax histories and scales carried as
  ``_overwrite_with_gradient`` variables), stepped from the same state:
  scales and operand histories bitwise, losses and gradients to float32
  rounding (its matmul dequantises before the dot, ours after);
* the traced program itself (``jax.make_jaxpr``): which fp8 conversions and
  which matmuls it holds;
* maxima computed by hand with NumPy (the first layer's input, the kernels,
  both cast to the compute dtype), and the same pass run on one micro-batch;
* a plain-NumPy transcription of delayed scaling (Transformer Engine's
  ``update_fp8_metas``: ``scale = 1 / ((fp8_max / amax) / 2**margin)``, kept
  when ``amax`` is 0) and of the history roll (Flax's
  ``compute_amax_history``);
* the NoOp loss-scale run (a power-of-two loss scale multiplies a
  cotangent's maximum exactly), ``optax.adam``'s own ``init`` for the
  optimizer state's structure, and a NumPy re-lay of a saved history.

Parameters are drawn with NumPy (an eager ``init`` compiles every
initializer). Each `jmp_lite.TrainState.create` holds a fresh optimizer, a
static field, so its first step compiles: the states are made once per
configuration and shared.
"""

import functools
import os
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flax.linen import fp8_ops

from jaxprs import equations
import jmp_lite
import jmp_lite.flax
import jmp_lite.fp8 as fp8
from jmp_lite.testing import assert_single_compile
from jmp_lite.testing import assert_trees_bitwise_equal
from jmp_lite.testing import count_compilations

BF16 = "p=f32,c=bf16,o=f32"
FP8 = BF16 + ",fp8=hybrid"
E4M3_MAX = float(ml_dtypes.finfo(jnp.float8_e4m3fn).max)  # 448
E5M2_MAX = float(ml_dtypes.finfo(jnp.float8_e5m2).max)  # 57344
TOPS = {"lhs": E4M3_MAX, "rhs": E4M3_MAX, "grad": E5M2_MAX}
ROLES = ("lhs", "rhs", "grad")
SITES = ("Dense_0", "Dense_1")
N, D_IN, D_HID, D_OUT = 16, 24, 32, 10
SCALE = 2.0 ** 15


class MLP(nn.Module):
  dot_general_cls: type = None

  @nn.compact
  def __call__(self, x):
    kw = {} if self.dot_general_cls is None else {"dot_general_cls": self.dot_general_cls}
    x = nn.gelu(nn.Dense(D_HID, **kw)(x))
    return nn.Dense(D_OUT, **kw)(x)


class MLP3(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.gelu(nn.Dense(D_HID)(x))
    x = nn.gelu(nn.Dense(D_HID)(x))
    return nn.Dense(D_OUT)(x)


MODEL = jmp_lite.flax.wrap(MLP(), BF16, rules={nn.Dense: FP8})


def _normal(seed, *shape, scale=1.0):
  return jnp.asarray(scale * np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _params(seed=0):
  return {"Dense_0": {"kernel": _normal(seed, D_IN, D_HID, scale=D_IN ** -0.5),
                      "bias": _normal(seed + 1, D_HID, scale=0.1)},
          "Dense_1": {"kernel": _normal(seed + 2, D_HID, D_OUT, scale=D_HID ** -0.5),
                      "bias": _normal(seed + 3, D_OUT, scale=0.1)}}


def _batch(seed, amplitude=1.0):
  rng = np.random.default_rng(100 + seed)
  x = rng.normal(size=(N, D_IN)).astype(np.float32) * np.float32(amplitude)
  return jnp.asarray(x), jnp.asarray(rng.integers(0, D_OUT, N), jnp.int32)


def _xent(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _loss(p, x, y):
  return _xent(MODEL.apply({"params": p}, x), y)


def _bf16_max(a):
  """max |a| of ``a`` cast to bfloat16, by NumPy."""
  return np.float32(np.abs(np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float32)).max())


def _roll(history, amax):
  """Flax's ``compute_amax_history`` in NumPy: roll left by one, newest at 0."""
  history = np.asarray(history, np.float32)
  return np.concatenate([[np.float32(amax)], history[2:], history[:1]]).astype(np.float32)


def _next_scale(history, scale, top, *, margin=0, algorithm="max"):
  """TE's ``update_fp8_metas`` in NumPy float32: the scale a history asks for."""
  history = np.asarray(history, np.float32)
  amax = history.max() if algorithm == "max" else history[0]
  if not (amax > 0 and np.isfinite(amax)):
    return np.float32(scale)
  return np.float32(1) / ((np.float32(top) / amax) / np.float32(2.0 ** margin))


def _fp8(state):
  return state.loss_scale_state.fp8


def _eq(a, b):
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# One jitted step for every TrainState of the module (each configuration's
# state compiles it once).
_step = jax.jit(lambda s, x, y: s.minimize(_loss, x, y))
_vg = jax.jit(lambda p, x, y, ls, st: jmp_lite.value_and_grad(_loss)(
    p, x, y, loss_scale=ls, fp8=st))


@functools.cache
def _meta(history_length=8, margin=0, algorithm="max"):
  x, y = _batch(0)
  return fp8.init(_loss, _params(), x, y, history_length=history_length, margin=margin,
                  algorithm=algorithm)


def _fresh(loss_scale="dynamic", history_length=8, accumulate_steps=1, tx="adam",
           margin=0, algorithm="max", tag=""):
  """A fresh TrainState per configuration, made once (its step compiles once).

  ``tag``: another state of the same configuration, whose step compiles anew.
  """
  return _made(loss_scale, history_length, accumulate_steps, tx, margin, algorithm, tag)


@functools.cache
def _made(loss_scale, history_length, accumulate_steps, tx, margin, algorithm, tag):
  del tag
  scale = {"dynamic": lambda: jmp_lite.DynamicLossScale(jnp.float32(SCALE)),
           "noop": jmp_lite.NoOpLossScale}[loss_scale]()
  opt = {"adam": lambda: optax.adam(1e-2), "sgd": lambda: optax.sgd(1e-2)}[tx]()
  with jax.numpy_dtype_promotion("standard"):  # optax's adam init
    return jmp_lite.TrainState.create(
        apply_fn=MODEL.apply, params=_params(), tx=opt, loss_scale=scale,
        fp8=_meta(history_length, margin, algorithm), accumulate_steps=accumulate_steps)


# --------------------------------------------------------------- 1. Flax's fp8


OWG = "_overwrite_with_gradient"
FLAX_NAMES = {"lhs": "input", "rhs": "kernel", "grad": "output_grad"}


@pytest.mark.filterwarnings("ignore:The Fp8DotGeneralOp is deprecated:DeprecationWarning")
def test_each_step_agrees_with_flax_fp8_dot_general_op_from_the_same_state():
  """Flax's ``nn.Fp8DotGeneralOp`` (flax 0.12.8, ``flax/linen/fp8_ops.py``) as the oracle.

  The same MLP, once with Flax's fp8 layer and once plain under wrap with an
  fp8 rule, all in float32 (Flax quantises in the dot's dtype), on inputs
  whose amplitude jumps (0.1x to 300x), with a history of 8 so that the
  largest entry leaves the window before the end. Each step starts Flax
  from our parameters and our metadata, so that the two quantise with the
  same scales:

  * the scale Flax computes from the history (``fp8_ops.compute_scale``) is
    the one our state holds for the step, bitwise, and so are the new
    histories of the values both see alike (the input, the kernels);
  * the loss, the gradients and the gradient's amax agree to float32
    rounding. They are not bitwise equal by design: Flax dequantises each
    operand (``q * scale`` rounded to float32) and multiplies those, ours
    multiplies the fp8 values in an fp8 ``dot_general`` and applies the
    scales to the product (Transformer Engine's GEMM), which XLA:GPU cannot
    fold back into a bf16 GEMM.

  Flax runs on a CPU wherever this test runs: compiled for a GPU, Flax's
  quantise-dequantise round trip is removed (XLA's excess precision) and
  its layer computes an unquantised product, so it is no oracle there.
  """
  H, lr = 8, 1e-3
  cpu = jax.devices("cpu")[0]
  f32 = "p=f32,c=f32,o=f32"
  theirs = MLP(nn.Fp8DotGeneralOp)
  ours = jmp_lite.flax.wrap(MLP(), f32, rules={nn.Dense: f32 + ",fp8=hybrid"})
  x, y = _batch(1)
  init = jax.eval_shape(theirs.init, jax.random.key(0), x)
  for site in SITES:
    assert set(init[OWG][site]["Fp8DotGeneralOp_0"]) == {
        f"{n}_{w}" for n in FLAX_NAMES.values() for w in ("amax_history", "scale")}
  assert jax.tree.structure(init["params"]) == jax.tree.structure(_params())
  params = _params(7)
  ref_vg_cpu = jax.jit(jax.value_and_grad(lambda v, x, y: _xent(theirs.apply(v, x), y)))
  ref_vg = lambda *args: ref_vg_cpu(*jax.device_put(args, cpu))
  our_vg = jax.jit(lambda p, x, y, st: jmp_lite.value_and_grad(
      lambda p, x, y: _xent(ours.apply({"params": p}, x), y))(p, x, y, fp8=st))
  st = fp8.init(lambda p, x, y: _xent(ours.apply({"params": p}, x), y), params, x, y,
                history_length=H)
  assert list(st.sites) == list(SITES)
  used = {(s, r): np.float32(1) for s in SITES for r in ROLES}  # the scales of the step before
  amplitudes = [1.0, 300.0, 0.1, 10.0, 1.0, 0.1, 3.0, 1.0, 0.3, 1.0]
  for t, amp in enumerate(amplitudes):
    xt = x * jnp.float32(amp)
    meta = {site: {"Fp8DotGeneralOp_0": {
        f"{FLAX_NAMES[r]}_{w}": (getattr(st.sites[site], r).amax_history if w == "amax_history"
                                 else jnp.asarray(used[site, r]).reshape(1))
        for r in ROLES for w in ("amax_history", "scale")}} for site in SITES}
    ref_loss, ref_grads = ref_vg({"params": params, OWG: meta}, xt, y)
    loss, grads, finite, new = our_vg(params, xt, y, st)
    assert bool(finite)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads),
                            jax.tree.leaves(ref_grads["params"])):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * float(jnp.max(jnp.abs(b))),
                                 err_msg=f"step {t} {jax.tree_util.keystr(path)}")
    for site in SITES:
      flax_meta = ref_grads[OWG][site]["Fp8DotGeneralOp_0"]
      for role in ROLES:
        dtype = jnp.float8_e5m2 if role == "grad" else jnp.float8_e4m3fn
        # The scale this step used: Flax's, from the same history.
        _eq(getattr(st.sites[site], role).scale.reshape(1), flax_meta[FLAX_NAMES[role] + "_scale"])
        with jax.default_device(cpu):
          history = jax.device_put(
              meta[site]["Fp8DotGeneralOp_0"][FLAX_NAMES[role] + "_amax_history"], cpu)
          _eq(flax_meta[FLAX_NAMES[role] + "_scale"], fp8_ops.compute_scale(
              jnp.max(history), jnp.asarray(used[site, role]).reshape(1),
              fp8_ops.get_fp8_max(dtype, jnp.float32)))
        ours_history = getattr(new.sites[site], role).amax_history
        theirs_history = flax_meta[FLAX_NAMES[role] + "_amax_history"]
        if role == "rhs" or (role, site) == ("lhs", "Dense_0"):  # the same values
          _eq(ours_history, theirs_history)
        else:  # the hidden activations and the cotangents: float32 rounding apart
          np.testing.assert_allclose(ours_history, theirs_history, rtol=1e-4)
        used[site, role] = np.float32(getattr(st.sites[site], role).scale)
    st = new
    params = jax.tree.map(lambda a, g: a - lr * g, params, grads)
  # The 300x step left the window: the input's scale came back down.
  assert float(st.sites["Dense_0"].lhs.scale) < float(used["Dense_0", "lhs"]) * 10


# ------------------------------------------------------------- 2. the program


def test_the_step_quantises_in_fp8_and_multiplies_fp8_arrays():
  x, y = _batch(0)
  params = _params()
  st = _meta()
  step = lambda p, st: jmp_lite.value_and_grad(_loss)(p, x, y, fp8=st)
  closed = jax.make_jaxpr(step)(params, st)
  eqns = list(equations(closed.jaxpr))
  converts = [(np.dtype(e.invars[0].aval.dtype), np.dtype(e.params["new_dtype"]))
              for e in eqns if e.primitive.name == "convert_element_type"]
  e4m3, e5m2, bf16 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2), np.dtype(jnp.bfloat16)
  f32 = np.dtype(np.float32)
  sites = len(st.sites)
  assert sites == 2
  # Two operands per site quantised to e4m3, one cotangent to e5m2, each from
  # float32 (one rounding), and no fp8 value is ever converted back: the
  # matmuls take them as they are.
  assert converts.count((f32, e4m3)) == 2 * sites
  assert converts.count((f32, e5m2)) == sites
  assert sum(1 for _, to in converts if to in (e4m3, e5m2)) == 3 * sites
  assert not [c for c in converts if c[0] in (e4m3, e5m2)]
  # Every matmul (one forward, two transposes per site) is a dot_general on
  # fp8 operands accumulating in float32: e4m3 x e4m3 forward, the e5m2
  # cotangent with an e4m3 operand backward. The input's cotangent, which
  # nothing differentiates, is not computed at all.
  dots = [e for e in eqns
          if "dot" in e.primitive.name or e.primitive.name.startswith("conv_general")]
  assert len(dots) == 3 * sites - 1
  operands = sorted(tuple(sorted(np.dtype(v.aval.dtype).name for v in e.invars)) for e in dots)
  assert operands == sorted([(e4m3.name, e4m3.name)] * sites
                            + [(e4m3.name, e5m2.name)] * (2 * sites - 1))
  for e in dots:
    assert e.primitive.name == "dot_general"
    assert np.dtype(e.params["preferred_element_type"]) == f32
    assert [np.dtype(v.aval.dtype) for v in e.outvars] == [f32]
  # What XLA is given holds them too (XLA:CPU then converts the fp8 values to
  # float32 for its dot; XLA:GPU picks an fp8 GEMM), and the compiled CPU
  # program still reads fp8 arrays: the quantisation was not folded away.
  lowered = jax.jit(step).lower(params, st)
  lowered_dots = [line for line in lowered.as_text().splitlines()
                  if "stablehlo.dot_general" in line]
  kinds = [tuple(re.findall(r"x(f8E4M3FN|f8E5M2|bf16|f32)>", line)) for line in lowered_dots]
  # (The cotangent of the input, which nobody asked for, is not there.)
  assert sorted(kinds) == sorted([("f8E4M3FN", "f8E4M3FN", "f32")] * sites
                                 + [("f8E5M2", "f8E4M3FN", "f32")] * (2 * sites - 1))
  hlo = lowered.compile().as_text()
  assert hlo.count("= f8e4m3fn[") >= 2 * sites and hlo.count("= f8e5m2[") >= sites
  # The modules' outputs are bfloat16 (Flax's own record of them), the
  # model's float32.
  with pytest.warns(UserWarning, match="without an fp8 state"):  # run as bf16
    out, inter = jax.eval_shape(lambda p: MODEL.apply(
        {"params": p}, x, capture_intermediates=True, mutable=["intermediates"]), params)
  assert out.dtype == np.float32
  for site in SITES:
    assert inter["intermediates"][site]["__call__"][0].dtype == bf16


# -------------------------------------------- 3. metadata beside the loss scale


@pytest.mark.slow  # about 10 s on 2 CPU cores: the heavy tier
def test_unscale_and_optimizer_leave_the_metadata_alone(standard_promotion):
  plain, scaled = _fresh("noop"), _fresh("dynamic")
  # The same run with the gradient scales starting where the loss scale puts
  # them: every cotangent is then quantised exactly as the NoOp run's, times
  # 2**15, and nothing differs after unscaling.
  tracked = scaled.replace(opt_state=jax.tree.map(
      lambda n: n.rescale_gradients(SCALE) if isinstance(n, fp8.Fp8State) else n,
      scaled.opt_state, is_leaf=lambda n: isinstance(n, fp8.Fp8State)))
  for i, amp in enumerate([1.0, 3.0, 0.3]):
    x, y = _batch(i, amp)
    plain, _ = _step(plain, x, y)
    scaled, info = _step(scaled, x, y)
    tracked, _ = _step(tracked, x, y)
    assert not bool(info.skipped)
  assert float(scaled.loss_scale.loss_scale) == SCALE
  for site in SITES:
    a, b, c = _fp8(plain).sites[site], _fp8(scaled).sites[site], _fp8(tracked).sites[site]
    for run in (b, c):
      _eq(run.lhs.amax_history, a.lhs.amax_history)
      _eq(run.rhs.amax_history, a.rhs.amax_history)
      _eq(run.lhs.scale, a.lhs.scale)
      _eq(run.rhs.scale, a.rhs.scale)
      # Cotangents carry the loss scale, exactly (a power of two): nothing
      # unscaled the metadata.
      _eq(run.grad.amax_history, a.grad.amax_history * np.float32(SCALE))
      _eq(run.grad.scale, a.grad.scale * np.float32(SCALE))
    assert float(np.count_nonzero(a.grad.amax_history)) == 3
  assert_trees_bitwise_equal(tracked.params, plain.params)
  # The optimizer's state is adam's own for the params: no fp8 leaf in it.
  inner = scaled.loss_scale_state.inner_state
  assert jax.tree.structure(inner) == jax.tree.structure(optax.adam(1e-2).init(_params()))
  assert jax.tree.structure(inner[0].mu) == jax.tree.structure(scaled.params)


def test_a_skipped_step_rolls_the_histories_and_leaves_the_rest_alone(standard_promotion):
  state = _fresh("dynamic")
  for i, amp in enumerate([1.0, 3.0, 0.3]):
    state, _ = _step(state, *_batch(i, amp))
  before = state
  x, y = _batch(3)
  x = x.at[3, 5].set(jnp.inf)  # an inf in the batch: NaN logits, NaN gradients
  state, info = _step(state, x, y)
  assert bool(info.skipped)
  assert_trees_bitwise_equal(state.params, before.params)
  assert_trees_bitwise_equal(state.loss_scale_state.inner_state,
                             before.loss_scale_state.inner_state)
  assert float(state.loss_scale.loss_scale) == SCALE / 2
  for site in SITES:
    old, new = _fp8(before).sites[site], _fp8(state).sites[site]
    # This step's maxima: the kernels' (finite, by hand); the input and the
    # cotangents are not finite and are recorded as 0, "nothing seen".
    kernel = before.params[site]["kernel"]
    amax = {"lhs": 0.0, "rhs": _bf16_max(kernel), "grad": 0.0}
    for role in ROLES:
      o, n = getattr(old, role), getattr(new, role)
      rolled = _roll(o.amax_history, amax[role])
      committed = _next_scale(rolled, o.scale, TOPS[role])
      if role == "grad":  # the loss scale halved, the gradient's metadata with it
        _eq(n.amax_history, rolled * np.float32(0.5))
        _eq(n.scale, committed * np.float32(0.5))
      else:
        _eq(n.amax_history, rolled)
        _eq(n.scale, committed)
    _eq(new.observed, np.zeros(3, np.float32))
  for leaf in jax.tree.leaves(_fp8(state)):
    assert np.isfinite(np.asarray(leaf)).all()


# ------------------------------------------------------------- 4. micro-batches


def test_micro_batch_maxima_are_max_reduced_and_recorded_once_per_step(standard_promotion):
  state = _fresh("dynamic", accumulate_steps=2)
  ls = jmp_lite.DynamicLossScale(jnp.float32(SCALE))  # the state's, unchanged here
  # Two optimizer steps of two micro-batches each: the larger one last, then
  # first (neither "the last" nor "the first" is the maximum both times).
  pairs = [(_batch(10, 1.0), _batch(11, 4.0)), (_batch(12, 6.0), _batch(13, 0.5))]
  newest = []
  for k, pair in enumerate(pairs):
    params, start = state.params, _fp8(state)
    # Each micro-batch alone: the same pass on the same params and scales.
    alone = [_vg(params, x, y, ls, start)[3] for x, y in pair]
    # By hand: the first layer's input and the kernels, in the compute dtype.
    for a, (x, _) in zip(alone, pair):
      assert float(a.sites["Dense_0"].lhs.amax_history[0]) == _bf16_max(x)
      for site in SITES:
        assert float(a.sites[site].rhs.amax_history[0]) == _bf16_max(params[site]["kernel"])

    state, _ = _step(state, *pair[0])
    for site in SITES:  # nothing recorded yet: the first micro-batch's maxima pending
      pending, was = _fp8(state).sites[site], start.sites[site]
      for role in ROLES:
        assert_trees_bitwise_equal(getattr(pending, role), getattr(was, role))
      _eq(pending.observed, [getattr(alone[0].sites[site], r).amax_history[0] for r in ROLES])
    state, info = _step(state, *pair[1])
    assert not bool(info.skipped) and int(state.step) == 2 * (k + 1)
    assert float(state.loss_scale.loss_scale) == SCALE
    entry = {}
    for site in SITES:
      done = _fp8(state).sites[site]
      for role in ROLES:
        history = np.asarray(getattr(done, role).amax_history)
        want = max(float(getattr(a.sites[site], role).amax_history[0]) for a in alone)
        assert float(history[0]) == want > 0
        # One entry per optimizer step, the earlier one rolled to the end.
        assert np.count_nonzero(history) == k + 1
        if k:
          assert history[-1] == newest[-1][site, role]
        entry[site, role] = history[0]
      _eq(done.observed, np.zeros(3, np.float32))
    newest.append(entry)
    assert entry["Dense_0", "lhs"] == max(_bf16_max(x) for x, _ in pair)


# ------------------------------------------------------ 5. delayed scaling, NumPy


@pytest.mark.parametrize("algorithm, margin", [("max", 0), ("most_recent", 0), ("max", 1)])
def test_scales_follow_delayed_scaling_in_numpy(algorithm, margin):
  state = _fresh("noop", history_length=4, tx="sgd", margin=margin, algorithm=algorithm)
  # A zero batch first (nothing seen: the scale stays 1) and again later (the
  # most recent maximum is 0: the scale is kept); a large batch that leaves
  # the 4-step window.
  amplitudes = [0.0, 1.0, 50.0, 0.5, 2.0, 0.1, 0.0, 1.0, 3.0, 0.2]
  for t, amp in enumerate(amplitudes):
    before = state
    x, y = _batch(20 + t, amp)
    state, info = _step(state, x, y)
    assert not bool(info.skipped)
    for site in SITES:
      old, new = _fp8(before).sites[site], _fp8(state).sites[site]
      by_hand = {"rhs": _bf16_max(before.params[site]["kernel"])}
      if site == "Dense_0":
        by_hand["lhs"] = _bf16_max(x)
      for role in ROLES:
        o, n = getattr(old, role), getattr(new, role)
        amax = np.asarray(n.amax_history)[0]
        if role in by_hand:
          assert amax == by_hand[role]
        _eq(n.amax_history, _roll(o.amax_history, amax))
        want = _next_scale(n.amax_history, o.scale, TOPS[role], margin=margin,
                           algorithm=algorithm)
        _eq(n.scale, want)
        chosen = (np.max(n.amax_history) if algorithm == "max"
                  else np.asarray(n.amax_history)[0])
        if chosen > 0:  # the scale the next step uses: amax * 2**margin / fp8 max
          np.testing.assert_allclose(float(n.scale), chosen * 2.0 ** margin / TOPS[role],
                                     rtol=2.0 ** -21)
        else:
          _eq(n.scale, o.scale)
    lhs = _fp8(state).sites["Dense_0"].lhs
    if t == 0:
      assert float(lhs.scale) == 1.0
    if t == 6:
      assert (float(lhs.scale) == float(_fp8(before).sites["Dense_0"].lhs.scale)) == (
          algorithm == "most_recent")


# ---------------------------------------------------------------- 6. checkpoints


def _relay(history, length):
  """A saved history re-laid to ``length``: newest first, padded with zeros."""
  history = list(np.asarray(history, np.float32))
  newest_first = [history[0], *history[:0:-1]]  # then the older ones backwards
  seq = (newest_first + [0.0] * length)[:length]
  return np.array([seq[0], *seq[:0:-1]], np.float32)


def _not_fp8(state):
  return (state.step, state.params, state.loss_scale_state._replace(fp8=None))


@functools.cache
def _saved(tmp):
  state = _fresh("dynamic", history_length=16)
  with jax.numpy_dtype_promotion("standard"):
    for i in range(20):
      state, _ = _step(state, *_batch(30 + i, [0.2, 1.0, 5.0, 40.0, 0.5][i % 5]))
  path = os.path.join(tmp, "ckpt")
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, state)
  with ocp.StandardCheckpointer() as ckptr:
    raw = ckptr.restore(path)
  return state, raw


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  return _saved(str(tmp_path_factory.mktemp("fp8_ckpt")))


@pytest.mark.parametrize("length", [8, 16, 32])
def test_checkpoint_restores_across_history_lengths(saved, length, standard_promotion):
  state, raw = saved
  hist = np.asarray(_fp8(state).sites["Dense_0"].lhs.amax_history)
  assert np.count_nonzero(hist) == 16  # 20 steps filled the 16 entries
  # A target of the saved configuration (its step compiled while training),
  # or a new one.
  target = _fresh("dynamic", history_length=length, tag="" if length == 16 else "restore")
  restored = fp8.restore(raw, target)
  assert _fp8(restored).history_length == length
  for site in SITES:
    for role in ROLES:
      s, r = getattr(_fp8(state).sites[site], role), getattr(_fp8(restored).sites[site], role)
      _eq(r.amax_history, _relay(s.amax_history, length))
      # The scale the kept entries ask for: all kept (16, 32), the saved
      # one; the newest 8, possibly another (the saved one came from an
      # entry dropped).
      _eq(r.scale, s.scale if length >= 16 else _next_scale(
          r.amax_history, s.scale, TOPS[role]))
      saved_h, new_h = np.asarray(s.amax_history), np.asarray(r.amax_history)
      if length == 8:  # the newest 8 in order (newest at 0, then from the end)
        _eq([new_h[0], *new_h[:0:-1]], [saved_h[0], *saved_h[:8:-1]])
      if length == 32:  # all 16, and 16 zeros where the next steps will write
        _eq([new_h[0], *new_h[:16:-1]], [saved_h[0], *saved_h[:0:-1]])
        _eq(new_h[1:17], np.zeros(16, np.float32))
    _eq(_fp8(restored).sites[site].observed, _fp8(state).sites[site].observed)
  assert int(_fp8(restored).version) == fp8.SCHEMA_VERSION
  assert_trees_bitwise_equal(_not_fp8(restored), _not_fp8(state))
  if length == 16:  # the same length: the very same state, types and all
    assert_trees_bitwise_equal(restored, state)
  # It trains on: a step compiles once for a new history length (never for
  # the saved one), and the next steps do not compile again.
  x, y = _batch(99)
  with count_compilations() as compiled:
    out, info = assert_single_compile(_step, restored, x, y, n_steps=2)
  assert len(compiled) == (0 if length == 16 else 1)
  assert not bool(info.skipped)
  assert np.count_nonzero(np.asarray(_fp8(out).sites["Dense_0"].lhs.amax_history)) == \
      min(length, 18)


def test_restore_refuses_other_sites_and_newer_schemas(saved):
  state, raw = saved
  sites = raw["opt_state"]["fp8"]["sites"] if "fp8" in raw["opt_state"] else None
  assert sites is not None and set(sites) == set(SITES)
  renamed = jax.tree.map(lambda a: a, raw)
  renamed["opt_state"]["fp8"]["sites"] = {
      ("Dense_9" if k == "Dense_1" else k): v for k, v in sites.items()}
  with pytest.raises(ValueError, match="Dense_9"):
    fp8.restore(renamed, state)
  missing = jax.tree.map(lambda a: a, raw)
  missing["opt_state"]["fp8"]["sites"] = {"Dense_0": sites["Dense_0"]}
  with pytest.raises(ValueError, match="Dense_1"):
    fp8.restore(missing, state)
  newer = jax.tree.map(lambda a: a, raw)
  newer["opt_state"]["fp8"]["version"] = np.int32(fp8.SCHEMA_VERSION + 1)
  with pytest.raises(ValueError, match="newer"):
    fp8.restore(newer, state)
  # The checkpoint itself was left as it was.
  assert set(raw["opt_state"]["fp8"]["sites"]) == set(SITES)


# ----------------------------------------------------------------------- 7. NNX


class NnxMLP(nnx.Module):

  def __init__(self, rngs):
    self.a = nnx.Linear(D_IN, D_HID, rngs=rngs)
    self.b = nnx.Linear(D_HID, D_OUT, rngs=rngs)

  def __call__(self, x):
    return self.b(nnx.gelu(self.a(x)))


@pytest.mark.slow  # about 10 s on 2 CPU cores: the heavy tier
def test_nnx_sites_are_module_paths_and_match_linen_bitwise():
  model = NnxMLP(nnx.Rngs(0))
  params = _params(3)  # the Linen model's, copied in
  for ours, theirs in (("a", "Dense_0"), ("b", "Dense_1")):
    for name in ("kernel", "bias"):
      getattr(getattr(model, ours), name)[...] = params[theirs][name]
  graphdef, state = nnx.split(jmp_lite.flax.wrap(model, BF16, rules={nnx.Linear: FP8}))

  def nnx_loss(s, x, y):
    return _xent(nnx.merge(graphdef, s)(x), y)

  x, y = _batch(40)
  st = fp8.init(nnx_loss, state, x, y, history_length=8)
  assert list(st.sites) == ["a", "b"]
  nnx_vg = jax.jit(lambda s, x, y, ls, st: jmp_lite.value_and_grad(nnx_loss)(
      s, x, y, loss_scale=ls, fp8=st))
  ls = jmp_lite.DynamicLossScale(jnp.float32(SCALE))
  linen_st = _meta()
  for t, amp in enumerate([1.0, 20.0, 0.5]):
    x, y = _batch(40 + t, amp)
    loss, grads, _, st = nnx_vg(state, x, y, ls, st)
    ref_loss, ref_grads, _, linen_st = _vg(params, x, y, ls, linen_st)
    _eq(loss, ref_loss)
    for ours, theirs in (("a", "Dense_0"), ("b", "Dense_1")):
      for name in ("kernel", "bias"):
        assert_trees_bitwise_equal(grads["module"][ours][name][...], ref_grads[theirs][name],
                                   f"step {t} {ours}.{name}")
      assert_trees_bitwise_equal(st.sites[ours], linen_st.sites[theirs], f"step {t} {ours}")
    state = jax.tree.map(lambda p, g: p - 1e-2 * g, state, grads)
    params = jax.tree.map(lambda p, g: p - 1e-2 * g, params, ref_grads)


# ---------------------------------------------------------------------- 8. errors


def test_misuse_is_refused_by_name():
  x, y = _batch(0)
  plain = jmp_lite.flax.wrap(MLP(), BF16)
  with pytest.raises(ValueError, match="no fp8 matmul"):
    fp8.init(lambda p, x, y: _xent(plain.apply({"params": p}, x), y), _params(), x, y)

  deeper = jmp_lite.flax.wrap(MLP3(), BF16, rules={nn.Dense: FP8})
  p3 = dict(_params(), Dense_2={"kernel": _normal(9, D_HID, D_OUT), "bias": _normal(10, D_OUT)})
  p3["Dense_1"] = {"kernel": _normal(11, D_HID, D_HID), "bias": _normal(12, D_HID)}
  loss3 = lambda p, x, y: _xent(deeper.apply({"params": p}, x), y)
  st3 = fp8.init(loss3, p3, x, y, history_length=8)
  assert list(st3.sites) == ["Dense_0", "Dense_1", "Dense_2"]
  with pytest.raises(ValueError, match=r"new \['Dense_2'\]"):
    jax.eval_shape(lambda p, st: jmp_lite.value_and_grad(loss3)(p, x, y, fp8=st),
                   p3, _meta())
  with pytest.raises(ValueError, match=r"missing \['Dense_2'\]"):
    jax.eval_shape(lambda p, st: jmp_lite.value_and_grad(_loss)(p, x, y, fp8=st),
                   _params(), st3)

  with pytest.raises(TypeError, match="Fp8State"):
    jmp_lite.value_and_grad(_loss)(_params(), x, y, fp8=dict(_meta().sites))
  with pytest.raises(TypeError, match="Fp8State"):
    jmp_lite.value_and_grad(_loss)(_params(), x, y, fp8=_meta().sites["Dense_0"])
  with pytest.raises(TypeError, match="Fp8State"):
    jmp_lite.TrainState.create(apply_fn=None, params=_params(), tx=optax.sgd(0.1),
                               fp8={"Dense_0": 1})

  with pytest.raises(ValueError, match="fp8"):
    jmp_lite.Policy(jnp.float32, jnp.bfloat16, jnp.float32, fp8="e5m2")
  with pytest.raises(ValueError, match="bogus"):
    jmp_lite.get_policy("c=bf16,fp8=bogus")
  policy = jmp_lite.get_policy("p=f32,c=bf16,o=f32,fp8=hybrid")
  assert policy.fp8 == "hybrid"
  assert str(policy) == "p=f32,c=bf16,o=f32,fp8=hybrid"
  assert jmp_lite.get_policy(str(policy)) == policy
  assert jmp_lite.get_policy(str(policy.with_fp8("e4m3"))).fp8 == "e4m3"


# ----------------------------------------------------------- 9. one compilation


def test_a_jitted_fp8_step_compiles_once(standard_promotion):
  state = _fresh("dynamic", accumulate_steps=2)
  step = jax.jit(lambda s, x, y: s.minimize(_loss, x, y))  # not compiled yet
  x, y = _batch(50)
  with count_compilations() as compiled:
    out, _ = assert_single_compile(step, state, x, y, n_steps=3)
  assert len(compiled) == 1
  assert int(out.step) == 3
