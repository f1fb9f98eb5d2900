"""`jmp_lite.fp8`: quantisation and delayed scaling.

Oracles: Flax's own ``flax.linen.fp8_ops`` (``quantize``, ``dequantize``,
``quantize_dequantize_update``: the JAX reference of delayed scaling, which
cites Transformer Engine's ``update_fp8_metas``), ``ml_dtypes`` rounding
through NumPy for the formats, and a plain-NumPy transcription of the
history update for the options Flax does not have (``most_recent``, a
margin).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax.linen import fp8_ops

from jmp_lite import fp8

FORMATS = [("e4m3", jnp.float8_e4m3fn), ("e5m2", jnp.float8_e5m2)]


def _sequence(seed, n=40, size=64):
  """Tensors whose range jumps: zeros, spikes, an inf, ordinary steps."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    x = rng.normal(size=size) * 10.0 ** rng.integers(-3, 4)
    if i == 5:
      x[:] = 0.0
    if i == 11:
      x[3] = 1e6
    if i == 17:
      x[0] = np.inf
    out.append(jnp.asarray(x, jnp.float32))
  return out


@pytest.mark.parametrize("name, dtype", FORMATS)
def test_quantize_and_dequantize_are_flaxs(name, dtype):
  x = _sequence(0, n=1, size=4096)[0] * 300
  for scale in (jnp.float32(1.0), jnp.float32(0.37), jnp.float32(1024.0)):
    ours = fp8.dequantize(fp8.quantize(x, name, scale), scale, jnp.float32)
    theirs = fp8_ops.dequantize(fp8_ops.quantize(x, dtype, scale, jnp.float32),
                                jnp.float32, scale)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert fp8.quantize(x, name, scale).dtype == np.dtype(dtype)


@pytest.mark.parametrize("name, dtype", FORMATS)
def test_round_trip_is_ml_dtypes_rounding_with_saturation(name, dtype):
  info = ml_dtypes.finfo(dtype)
  x = np.concatenate([np.linspace(-2 * float(info.max), 2 * float(info.max), 2001),
                      np.geomspace(float(info.smallest_subnormal) / 4, 1.0, 500)])
  x = x.astype(np.float32)
  got = np.asarray(fp8.dequantize(fp8.quantize(jnp.asarray(x), name, jnp.float32(1)),
                                  jnp.float32(1), jnp.float32))
  want = np.clip(x, -float(info.max), float(info.max)).astype(dtype).astype(np.float32)
  np.testing.assert_array_equal(got, want)
  inside = np.abs(x) <= float(info.max)
  normal = inside & (np.abs(x) >= float(info.smallest_normal))
  # Round to nearest: half an ulp, 2**-(mantissa bits + 1) relative.
  rel = np.abs(got[normal] - x[normal]) / np.abs(x[normal])
  assert rel.max() <= 2.0 ** -(info.nmant + 1)


@pytest.mark.parametrize("name, dtype", FORMATS)
def test_delayed_scaling_matches_flax_over_a_sequence(name, dtype):
  meta = fp8.DelayedScaling.create(name, history_length=8)
  # Flax on a CPU: it divides in float32, correctly rounded there and not on
  # a GPU (an H200's scales were 1 ulp off, where ours are exact on both).
  cpu = jax.devices("cpu")[0]
  scale, history = jax.device_put((jnp.float32(1.0), jnp.zeros(8, jnp.float32)), cpu)
  step = jax.jit(lambda m, x: m.qdq(x))
  for x in _sequence(1):
    y, meta = step(meta, x)
    with jax.default_device(cpu):
      want, scale, history = fp8_ops.quantize_dequantize_update(
          jax.device_put(x, cpu), dtype, scale, history, jnp.float32)
      # Ours records a non-finite maximum as 0, "nothing seen", where Flax
      # records it and then keeps its scale for the history's length (its
      # maximum is inf); Flax's history with that one entry changed is ours.
      history = jnp.where(jnp.isfinite(history), history, 0.0)
    finite = np.isfinite(np.asarray(x))
    np.testing.assert_array_equal(np.asarray(y)[finite], np.asarray(want)[finite])
    # Flax saturates an inf to the format's max; ours stays non-finite, so
    # that an overflow upstream still reaches the finiteness check.
    assert not np.isfinite(np.asarray(y)[~finite]).any()
    assert np.isfinite(np.asarray(want)).all()
    np.testing.assert_array_equal(np.asarray(meta.scale), np.asarray(scale))
    np.testing.assert_array_equal(np.asarray(meta.amax_history), np.asarray(history))


def _numpy_reference(xs, *, top, length, margin, algorithm):
  """The history and scale update, in NumPy: [(scale used, history after)]."""
  history, scale, out = np.zeros(length, np.float32), np.float32(1.0), []
  for x in xs:
    amax = history.max() if algorithm == "max" else history[0]
    if amax > 0 and np.isfinite(amax):
      scale = np.float32(1.0 / (np.float32(top) / amax / np.float32(2.0 ** margin)))
    seen = np.abs(x).max()
    seen = seen if np.isfinite(seen) else np.float32(0.0)  # "nothing seen"
    history = np.concatenate([[seen], history[2:], history[:1]]) \
        if length > 1 else np.array([seen], np.float32)
    out.append((scale, history.astype(np.float32)))
  return out


@pytest.mark.parametrize("algorithm", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("length", [1, 5])
def test_history_options_match_numpy(algorithm, margin, length):
  xs = _sequence(2, n=25)
  meta = fp8.DelayedScaling.create("e5m2", history_length=length, margin=margin,
                                   algorithm=algorithm)
  step = jax.jit(lambda m, x: m.qdq(x))
  top = float(ml_dtypes.finfo(jnp.float8_e5m2).max)
  for x, (scale, history) in zip(xs, _numpy_reference(
      [np.asarray(x) for x in xs], top=top, length=length, margin=margin,
      algorithm=algorithm)):
    _, meta = step(meta, x)
    np.testing.assert_allclose(float(meta.scale), scale, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(meta.amax_history), history)


def test_the_state_is_a_pytree_with_static_options_and_compiles_once():
  meta = fp8.DelayedScaling.create("e4m3", history_length=16, margin=1)
  leaves, treedef = jax.tree_util.tree_flatten(meta)
  assert [leaf.dtype for leaf in leaves] == [jnp.float32, jnp.float32]
  assert [leaf.shape for leaf in leaves] == [(16,), ()]
  traces = []

  @jax.jit
  def step(m, x):
    traces.append(1)
    return m.qdq(x)

  for x in _sequence(3, n=5):
    _, meta = step(meta, x)
  assert len(traces) == 1
  assert jax.tree_util.tree_structure(meta) == treedef


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(dtype="e3m4"), ValueError, "fp8 format"),
    (dict(dtype=jnp.float16), ValueError, "fp8 format"),
    (dict(history_length=0), ValueError, "history_length"),
    (dict(margin=-1), ValueError, "margin"),
    (dict(algorithm="mean"), ValueError, "algorithm"),
])
def test_bad_arguments_are_named(kwargs, error, match):
  with pytest.raises(error, match=match):
    fp8.DelayedScaling.create(**kwargs)


# Safe numerics in every compute dtype ----------------------------------------------


def _np_quantize(x, dtype, scale):
  """Transformer Engine's cast with our scale, in NumPy float32: ``x`` times
  the (IEEE) reciprocal of the scale clamped to [2**-126, 2**126], saturated,
  non-finite values kept (transformer_engine/common/recipe/recipe_common.cuh
  at 01c24fe clamps the quantisation factor instead of letting it be inf)."""
  x = np.asarray(x).astype(np.float32)
  inv = np.float32(1) / np.clip(np.float32(scale), np.float32(2.0 ** -126), np.float32(2.0 ** 126))
  top = np.float32(ml_dtypes.finfo(dtype).max)
  with np.errstate(over="ignore", invalid="ignore"):
    y = x * inv
  return np.where(np.isfinite(x), np.clip(y, -top, top), y).astype(dtype)


def _shared_values(seed, n=4096):
  """Values bfloat16, float16 and float32 all hold: 8 significant bits, within
  float16's normal range, with zeros, an inf and a NaN."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(n) * 2.0 ** rng.integers(-12, 13, n)
  x = np.clip(x, -60000, 60000)
  x = np.where(np.abs(x) < 2.0 ** -14, 0.0, x)
  x = x.astype(ml_dtypes.bfloat16).astype(np.float32)
  x[:3] = [0.0, np.inf, np.nan]
  assert np.array_equal(x.astype(np.float16).astype(np.float32), x, equal_nan=True)
  return x


SCALES = [1.0, 0.37, 1024.0, 1.5e-5, 2.0 ** -126, 2.0 ** 126, 3.0e-39, 1e-30, 3e38]


@pytest.mark.parametrize("name, dtype", FORMATS)
@pytest.mark.parametrize("scale", SCALES)
def test_quantize_is_tes_cast_in_every_compute_dtype(name, dtype, scale):
  """bf16, f16 and f32 inputs holding the same values quantise alike, as TE
  quantises from float32; scales at and past the normal range are clamped,
  never giving 0, inf or NaN for a finite input."""
  x = _shared_values(0)
  want = _np_quantize(x, dtype, scale)
  for compute in (jnp.bfloat16, jnp.float16, jnp.float32):
    got = np.asarray(jax.jit(lambda v: fp8.quantize(v, name, jnp.float32(scale)))(
        jnp.asarray(x, compute)))
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got.view(np.uint8)[3:], want.view(np.uint8)[3:])
    assert not np.isfinite(got[1:3].astype(np.float32)).any()
    assert np.isfinite(got[3:].astype(np.float32)).all()


def test_float16_quantisation_with_a_tiny_scale_is_finite():
  """Flax's ``qdq(f16[0, 1e-4, -3e-4, 0.5], e5m2, 1.5e-5)`` gives
  ``[nan, 0.86, -0.86, 0.86]``: ``1 / 1.5e-5`` overflows float16."""
  x = jnp.asarray([0.0, 1e-4, -3e-4, 0.5], jnp.float16)
  got = fp8.qdq(x, "e5m2", jnp.float32(1.5e-5))
  q = _np_quantize(np.asarray(x), jnp.float8_e5m2, 1.5e-5)
  want = (q.astype(np.float32) * np.float32(1.5e-5)).astype(np.float16)
  assert got.dtype == jnp.float16
  np.testing.assert_array_equal(np.asarray(got), want)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(fp8.qdq(x.astype(jnp.float32), "e5m2",
                                                                    jnp.float32(1.5e-5))).astype(np.float16))


@pytest.mark.parametrize("amax", [1e-36, 1e-40, 3e38], ids=["tiny", "subnormal", "huge"])
@pytest.mark.parametrize("margin", [0, 4])
def test_a_scale_is_never_zero_inf_or_subnormal(amax, margin):
  """An amax of 1e-36 asks for a factor float32 cannot hold: Flax's scale is
  0 there and ``qdq([0, a, -a/2])`` gives ``[nan, 0, -0]``."""
  meta = fp8.DelayedScaling.create("e4m3", history_length=4, margin=margin)
  meta = meta.update(jnp.float32(amax))
  scale = np.float32(meta.scale)
  assert np.isfinite(scale) and scale >= np.finfo(np.float32).tiny
  a = np.float32(amax)
  x = jnp.asarray([0.0, a, -a / 2], jnp.float32)
  y, _ = meta.qdq(x)
  assert np.isfinite(np.asarray(y)).all()
  if a >= np.finfo(np.float32).tiny:
    assert float(y[1]) > 0 and float(y[2]) < 0  # both still there, signs kept
  # In range, the scale is TE's: 1 / ((448 / amax) / 2**margin).
  if amax == 3e38:
    want = np.float32(1) / ((np.float32(448) / a) / np.float32(2.0 ** margin))
    assert scale == want


def test_a_subnormal_amax_scales_the_same_eagerly_and_jitted():
  """After an amax of 1, an amax of 1e-40 kept the old scale eagerly and
  gave the clamped one under jit (XLA:CPU compared the subnormal as 0 in one
  computation and not in the other); current scaling's factor was 1 eagerly
  and 2**126 jitted. TE's recipe takes ``amax > 0`` (true for 1e-40 on a
  GPU without flush-to-zero) and clamps the unbounded factor: so do both."""
  meta = fp8.DelayedScaling.create("e4m3", history_length=1, margin=0).update(jnp.float32(1.0))
  tiny = jnp.float32(1e-40)
  eager = meta.update(tiny).scale
  jitted = jax.jit(lambda m, a: m.update(a))(meta, tiny).scale
  assert float(eager) == float(jitted) == np.finfo(np.float32).tiny  # 2**-126
  from jmp_lite._fp8_numerics import current_scaling  # pylint: disable=g-import-not-at-top
  factor = current_scaling(tiny, "e4m3")[0]
  assert float(factor) == float(jax.jit(lambda a: current_scaling(a, "e4m3")[0])(tiny)) == 2.0 ** 126


@pytest.mark.parametrize("algorithm", ["max", "most_recent"])
@pytest.mark.parametrize("length", [1, 2, 1024])
def test_a_subnormal_amax_scales_alike_for_every_history(algorithm, length):
  """A history's maximum is read without flushing a subnormal to 0: an
  amax of 1e-40 gave 2**-126 with one entry or "most_recent", and kept the
  scale of 1 (nothing seen) with "max" over two entries or more."""
  meta = fp8.DelayedScaling.create("e4m3", history_length=length, algorithm=algorithm)
  for update in (meta.update, jax.jit(lambda a: meta.update(a))):
    assert float(update(jnp.float32(1e-40)).scale) == np.finfo(np.float32).tiny


def test_qdq_records_a_non_finite_maximum_as_nothing_seen():
  meta = fp8.DelayedScaling.create("e4m3", history_length=4)
  for amax in (2.0, np.inf, 4.0):
    _, meta = meta.qdq(jnp.asarray([amax, 1.0], jnp.float32))
  _, meta = meta.qdq(jnp.asarray([np.nan], jnp.float32))
  # Rolled as Flax rolls (newest first, then from the end backwards).
  assert np.asarray(meta.amax_history).tolist() == [0.0, 2.0, 0.0, 4.0]
  # The scale this call used: from [4, 2, 0, 0] (Flax's is frozen by the inf).
  np.testing.assert_allclose(float(meta.scale), 4.0 / 448.0, rtol=1e-7)  # e4m3 max
  # ... and the one `update` gives from the same maxima.
  ref = fp8.DelayedScaling.create("e4m3", history_length=4)
  for amax in (2.0, np.inf, 4.0, np.nan):
    ref = ref.update(jnp.float32(amax))
  np.testing.assert_array_equal(meta.amax_history, ref.amax_history)


def test_options_take_numpy_integers_and_refuse_what_a_scaling_ignores():
  meta = fp8.DelayedScaling.create("e4m3", history_length=np.int64(8), margin=np.int32(1))
  assert meta.amax_history.shape == (8,) and type(meta.margin) is int
  with pytest.raises(ValueError, match=r"history_length must be an int >= 1, got 8\.0 \(float\)"):
    fp8.DelayedScaling.create("e4m3", history_length=8.0)
  loss = lambda w, x: jnp.sum(x @ w)
  w, x = jnp.ones((4, 2)), jnp.ones((3, 4))
  for scaling in ("current", "block"):
    with pytest.raises(ValueError, match=f"margin=3 .*scaling='{scaling}'"):
      fp8.init(loss, w, x, select=".*", scaling=scaling, margin=3)
    with pytest.raises(ValueError, match="algorithm='most_recent'"):
      fp8.init(loss, w, x, select=".*", scaling=scaling, algorithm="most_recent")
  with pytest.raises(ValueError, match=r"select='\(' is not a valid regular expression"):
    fp8.init(loss, w, x, select="(")


def test_init_takes_shape_dtype_structs_as_its_docstring_says():
  """``jax.ShapeDtypeStruct`` example arguments were passed to the function
  as they are (``@`` of a ShapeDtypeStruct raised). Oracle: the state made
  from concrete arrays."""
  def loss(p, x):
    with jax.named_scope("mlp"):
      return jnp.mean(jnp.tanh(x @ p["w"]) ** 2)
  p, x = {"w": jnp.ones((8, 4))}, jnp.ones((2, 8))
  sds = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), t)
  want = fp8.init(loss, p, x, select="mlp")
  got = fp8.init(loss, sds(p), sds(x), select="mlp")
  assert jax.tree.map(lambda a: (a.shape, a.dtype), got) == jax.tree.map(
      lambda a: (a.shape, a.dtype), want)
