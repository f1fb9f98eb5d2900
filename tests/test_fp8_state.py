"""The fp8 metadata as state beside the loss scale (issue 18).

Oracles: the maxima of the batches computed by hand with NumPy, the NoOp
loss-scale run (a power-of-two scale multiplies gradients' maxima exactly),
and a NumPy re-lay of a saved history.
"""

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jmp_lite
import jmp_lite.fp8 as fp8

POLICY = "p=f32,c=bf16,o=f32"


def _loss(p, x, y):
  with jax.named_scope("mlp"):
    h = jnp.tanh(x.astype(p["w1"].dtype) @ p["w1"])
    out = h @ p["w2"]
  return jnp.mean((out.astype(jnp.float32) - y) ** 2)


def _params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"w1": jax.random.normal(k1, (8, 16)) / 3, "w2": jax.random.normal(k2, (16, 4)) / 4}


def _data(n, seed=0):
  rng = np.random.default_rng(seed)
  return (rng.standard_normal((n, 8)).astype(np.float32) * 3,
          rng.standard_normal((n, 4)).astype(np.float32))


def _state(loss_scale, history_length=8, accumulate_steps=1, tx=None):
  x, y = _data(4)
  meta = fp8.init(_loss, _params(), x, y, policy=POLICY, select="mlp",
                  history_length=history_length)
  return jmp_lite.TrainState.create(apply_fn=None, params=_params(), policy=POLICY,
                                    tx=tx or optax.sgd(0.05), loss_scale=loss_scale,
                                    fp8=meta, accumulate_steps=accumulate_steps)


_step = jax.jit(lambda s, x, y: s.minimize(_loss, x, y))


def _sites(state):
  return state.loss_scale_state.fp8.sites


def test_unscale_and_optimizer_never_touch_the_metadata(standard_promotion):
  x, y = _data(32)
  adam = optax.adam(1e-2)  # its count arithmetic needs standard promotion
  plain = _state(jmp_lite.NoOpLossScale(), tx=adam)
  scaled = _state(jmp_lite.StaticLossScale(2.0 ** 12), tx=adam)
  for _ in range(3):
    plain, _ = _step(plain, x, y)
    scaled, _ = _step(scaled, x, y)
  for name in ("mlp", "mlp#2"):
    a, b = _sites(plain)[name], _sites(scaled)[name]
    np.testing.assert_array_equal(a.lhs.amax_history, b.lhs.amax_history)
    np.testing.assert_array_equal(a.rhs.amax_history, b.rhs.amax_history)
    # Cotangents carry the loss scale, exactly (a power of two); nothing
    # divided it back out of the metadata.
    np.testing.assert_array_equal(b.grad.amax_history, a.grad.amax_history * 2.0 ** 12)
    assert float(a.grad.amax_history[0]) > 0
  # Adam's moments have exactly the parameters' tree: no fp8 leaf.
  inner = scaled.loss_scale_state.inner_state[0]
  assert jax.tree.structure(inner.mu) == jax.tree.structure(scaled.params)


def test_a_skipped_step_records_forward_maxima_and_zero_for_the_inf():
  # (An inf in the input would not do: e4m3 quantisation saturates it.)
  x, y = _data(32)
  state, _ = _step(_state(jmp_lite.DynamicLossScale(2.0 ** 10)), x, y)
  before = state
  bad = y.copy()
  bad[3, 2] = np.inf  # an infinite loss: every gradient maximum is inf
  state, info = _step(state, x, bad)
  assert bool(info.skipped)
  for a, b in zip(jax.tree.leaves((before.params, before.loss_scale_state.inner_state)),
                  jax.tree.leaves((state.params, state.loss_scale_state.inner_state))):
    np.testing.assert_array_equal(a, b)
  new, old = _sites(state)["mlp"], _sites(before)["mlp"]
  # The history rolled: the step was recorded, the inf as 0 ("nothing seen").
  assert float(new.grad.amax_history[0]) == 0.0
  np.testing.assert_array_equal(new.lhs.amax_history[-1], old.lhs.amax_history[0])
  np.testing.assert_array_equal(new.lhs.amax_history[0], old.lhs.amax_history[0])
  assert float(new.rhs.amax_history[0]) == float(np.abs(
      np.asarray(before.params["w1"]).astype(jnp.bfloat16).astype(np.float32)).max())
  # The loss scale halved, and the gradient history with it.
  assert float(state.loss_scale.loss_scale) == 2.0 ** 9
  np.testing.assert_array_equal(new.grad.amax_history[-1], old.grad.amax_history[0] / 2)
  leaves = jax.tree.leaves(state.loss_scale_state.fp8)
  assert all(bool(jnp.all(jnp.isfinite(v))) for v in leaves)


def test_micro_batches_are_max_reduced_and_recorded_once_per_step():
  (xa, ya), (xb, yb) = _data(16, seed=1), _data(16, seed=2)
  xb = xb * 4  # B's maximum is the larger
  state = _state(jmp_lite.NoOpLossScale(), accumulate_steps=2)
  state, _ = _step(state, xa, ya)
  pending = _sites(state)["mlp"]
  assert float(pending.lhs.amax_history.max()) == 0.0  # not recorded yet
  by_hand = lambda x: float(np.abs(x.astype(jnp.bfloat16).astype(np.float32)).max())
  assert float(pending.observed[0]) == by_hand(xa)
  state, _ = _step(state, xb, yb)
  done = _sites(state)["mlp"]
  assert float(done.lhs.amax_history[0]) == max(by_hand(xa), by_hand(xb)) == by_hand(xb)
  assert float(jnp.sum(done.lhs.amax_history > 0)) == 1  # one entry per step
  assert float(jnp.max(done.observed)) == 0.0


def _relay(history, length):
  newest_first = [history[0], *history[:0:-1]]
  seq = (newest_first + [0.0] * length)[:length]
  return np.array([seq[0], *seq[:0:-1]], np.float32)


@pytest.mark.parametrize("length", [8, 16, 32])
def test_checkpoint_restores_across_a_change_of_history_length(tmp_path, length):
  x, y = _data(32)
  state = _state(jmp_lite.DynamicLossScale(2.0 ** 10), history_length=16)
  for i in range(20):
    state, _ = _step(state, x * (1 + i % 5), y)
  path = os.path.join(tmp_path, "ckpt")
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, state)
  with ocp.StandardCheckpointer() as ckptr:
    raw = ckptr.restore(path)
  target = _state(jmp_lite.DynamicLossScale(2.0 ** 10), history_length=length)
  restored = fp8.restore(raw, target)
  for name, meta in _sites(restored).items():
    for role in ("lhs", "rhs", "grad"):
      saved = np.asarray(getattr(_sites(state)[name], role).amax_history)
      np.testing.assert_array_equal(getattr(meta, role).amax_history,
                                    _relay(list(saved), length))
      # The scale the kept entries ask for (Transformer Engine's formula in
      # NumPy; no margin): a shorter history may have dropped the maximum the
      # saved scale came from.
      kept = _relay(list(saved), length).max()
      top = float(ml_dtypes.finfo(getattr(meta, role).dtype).max)
      want = (np.float32(1.0) / (np.float32(top) / kept) if kept > 0 else
              getattr(_sites(state)[name], role).scale)
      np.testing.assert_allclose(getattr(meta, role).scale, want, rtol=1e-7)
      if length >= 16:  # every entry kept: the saved scale itself
        np.testing.assert_array_equal(getattr(meta, role).scale,
                                      getattr(_sites(state)[name], role).scale)
  rest = lambda s: jax.tree.leaves((s.params, s.step, s.loss_scale_state._replace(fp8=None)))
  for a, b in zip(rest(state), rest(restored)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)
  if length == 16:  # the same length: the very same state
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
      np.testing.assert_array_equal(a, b)
  restored, info = _step(restored, x, y)  # and it trains on
  assert not bool(info.skipped)


@pytest.mark.usefixtures("standard_promotion")  # optax's Adam: b1 ** count
@pytest.mark.parametrize("target", ["no loss scale", "static", "adam"])
def test_restore_refuses_what_the_target_has_no_place_for(tmp_path, target):
  """A checkpoint of a DynamicLossScale and adamw restored into a target
  without a loss scale, with a static one, or with adam: each was accepted,
  the scale's counter and settings (or adamw's schedule's count) dropped, and
  float16 training resumed unscaled. Oracle: msgpack and orbax refuse the
  same restores."""
  x, y = _data(8)
  _adamw = lambda: optax.adamw(optax.cosine_decay_schedule(1e-3, 100))  # a count kept
  saved = _state(jmp_lite.DynamicLossScale(2.0 ** 10), tx=_adamw())
  saved, _ = _step(saved, x, y)
  path = os.path.join(tmp_path, "ckpt")
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, saved)
  with ocp.StandardCheckpointer() as ckptr:
    raw = ckptr.restore(path)
  make = {"no loss scale": lambda: _state(None, tx=_adamw()),
          "static": lambda: _state(jmp_lite.StaticLossScale(8.0), tx=_adamw()),
          "adam": lambda: _state(jmp_lite.DynamicLossScale(2.0 ** 10), tx=optax.adam(1e-3))}
  with pytest.raises(ValueError, match=r"the checkpoint holds \d+ value\(s\) the target "
                     r"has no place for, e\.g\. at \['opt_state'\]"):
    fp8.restore(raw, jax.eval_shape(make[target]))
  # On purpose, part of it: strict=False takes what the target has.
  part = fp8.restore(raw, jax.eval_shape(make[target]), strict=False)
  np.testing.assert_array_equal(part.params["w1"], saved.params["w1"])
  # The state it was saved from takes it, bit for bit.
  same = fp8.restore(raw, jax.eval_shape(
      lambda: _state(jmp_lite.DynamicLossScale(2.0 ** 10), tx=_adamw())))
  for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(same)):
    np.testing.assert_array_equal(a, b)


def test_restore_refuses_other_sites_and_newer_schemas():
  state = _state(jmp_lite.NoOpLossScale())
  meta = state.loss_scale_state.fp8
  raw = jax.tree.map(np.asarray, {"sites": {k: {
      "lhs": {"amax_history": m.lhs.amax_history, "scale": m.lhs.scale},
      "rhs": {"amax_history": m.rhs.amax_history, "scale": m.rhs.scale},
      "grad": {"amax_history": m.grad.amax_history, "scale": m.grad.scale},
      "observed": m.observed} for k, m in meta.sites.items()}, "version": meta.version,
      "grad_loss_scale": meta.grad_loss_scale})
  assert fp8.restore(raw, meta).history_length == 8
  # Version 1 recorded no loss scale: the state takes the next step's as it is.
  old = {k: v for k, v in raw.items() if k != "grad_loss_scale"}
  restored = fp8.restore(dict(old, version=np.int32(1)), meta)
  assert float(restored.grad_loss_scale) == 0.0
  assert int(restored.version) == fp8.SCHEMA_VERSION
  with pytest.raises(ValueError, match=r"nothing at <root>\.grad_loss_scale"):
    fp8.restore(old, meta)  # version 2 without it
  with pytest.raises(ValueError, match=r"nothing at <root>\.sites\['mlp'\]\.grad$"):
    fp8.restore(dict(raw, sites=dict(raw["sites"], mlp={
        k: v for k, v in raw["sites"]["mlp"].items() if k != "grad"})), meta)
  renamed = dict(raw, sites={"other" if k == "mlp" else k: v for k, v in raw["sites"].items()})
  with pytest.raises(ValueError, match="'other'"):
    fp8.restore(renamed, meta)
  with pytest.raises(ValueError, match="newer"):
    fp8.restore(dict(raw, version=np.int32(fp8.SCHEMA_VERSION + 1)), meta)


def test_a_state_from_another_step_is_refused_by_name():
  x, y = _data(4)
  other = fp8.init(lambda p, x, y: _loss(p, x, y) + jnp.sum(x @ p["w1"]), _params(), x, y,
                   select=".*")
  state = _state(jmp_lite.NoOpLossScale())
  with pytest.raises(ValueError, match="fp8 state"):
    jmp_lite.value_and_grad(_loss, policy=POLICY)(_params(), x, y, fp8=other)
  with pytest.raises(TypeError, match="Fp8State"):
    jmp_lite.value_and_grad(_loss)(_params(), x, y, fp8={"mlp": 1})
  with pytest.raises(ValueError, match="no fp8 matmul"):
    fp8.init(lambda p, x, y: jnp.sum(p["w1"]), _params(), x, y)
  del state


def test_by_hand_gradient_histories_follow_the_loss_scale():
  """`value_and_grad` with ``fp8=`` and the user adjusting the loss scale
  between calls (MindSpore's flow): a dynamic scale that doubles every
  step gives bitwise the gradients, and the grad histories times the
  scale, of a static scale. Powers of two multiply every cotangent and
  every fp8 scale exactly, so the quantised values are the same. Before,
  the histories stayed in the first step's units: after each growth the
  cotangent was twice what its scale covered and e5m2 saturated (gradients
  27% off float32's in a user's run)."""
  x, y = _data(16)
  params = _params()
  meta = fp8.init(_loss, params, x, y, policy=POLICY, select="mlp", history_length=4)
  vg = jax.jit(lambda ls, st: jmp_lite.value_and_grad(_loss, policy=POLICY)(
      params, x, y, loss_scale=ls, fp8=st))
  growing = jmp_lite.DynamicLossScale(jnp.float32(2.0 ** 4), period=1)
  static = jmp_lite.StaticLossScale(jnp.float32(2.0 ** 4))
  g_state, s_state = meta, meta
  for _ in range(5):
    _, g_grads, g_finite, g_state = vg(growing, g_state)
    _, s_grads, _, s_state = vg(static, s_state)
    jax.tree.map(np.testing.assert_array_equal, g_grads, s_grads)
    ratio = np.float32(growing.loss_scale / static.loss_scale)
    for name in ("mlp", "mlp#2"):
      a, b = g_state.sites[name].grad, s_state.sites[name].grad
      np.testing.assert_array_equal(a.amax_history, b.amax_history * ratio)
      np.testing.assert_array_equal(a.scale, b.scale * ratio)
    growing = growing.adjust(g_finite)
  assert float(growing.loss_scale) == 2.0 ** 9
  assert float(g_state.grad_loss_scale) == 2.0 ** 8  # the last step's
