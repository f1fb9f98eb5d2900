"""Tests of jmp_lite.loss_scale: loss-scale state machines, all_finite, select_tree."""

import contextlib
import dataclasses
import re
import warnings

import chex
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

import jmp_lite
from jmp_lite.testing import count_compilations

F32 = np.dtype(jnp.float32)
BF16 = np.dtype(jnp.bfloat16)
F16 = np.dtype(jnp.float16)
F64 = np.dtype(jnp.float64)
I32 = np.dtype(jnp.int32)
E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)

JIT = pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])

# Every field of DynamicLossScale and the dtype it is held in.
DYNAMIC_FIELDS = {
    "loss_scale": F32, "counter": I32, "period": I32, "factor": F32,
    "min_loss_scale": F32, "max_loss_scale": F32, "hysteresis": I32,
    "hysteresis_left": I32, "consecutive_hysteresis": np.dtype(np.bool_),
}


def maybe_jit(f, jit):
  return jax.jit(f) if jit else f


def x64_if_needed(dtype):
  """float64 arrays exist only under x64; keep the switch local to one test."""
  return jax.enable_x64(True) if np.dtype(dtype) == F64 else contextlib.nullcontext()


def standard_promotion():
  """jmp's own arithmetic (int32 counter * bool) needs standard promotion."""
  return jax.numpy_dtype_promotion("standard")


def unusual_dynamic():
  """A DynamicLossScale with no field at its default value."""
  return jmp_lite.DynamicLossScale(
      jnp.float32(1024.0), counter=3, period=7, factor=3.0, min_loss_scale=0.25,
      max_loss_scale=2.0 ** 20, hysteresis=3, hysteresis_left=2,
      consecutive_hysteresis=True)


def field_values(ls):
  """{field: (dtype, weak_type, value)} for every dataclass field of `ls`."""
  out = {}
  for field in dataclasses.fields(ls):
    x = getattr(ls, field.name)
    out[field.name] = (x.dtype, x.weak_type, np.asarray(x).item())
  return out


# Construction.


def test_no_op_loss_scale():
  ls = jmp_lite.NoOpLossScale()
  tree = {"a": jnp.ones(2, jnp.float16), "b": 3.0}
  assert ls.scale(tree) is tree and ls.unscale(tree) is tree
  assert ls.adjust(jnp.bool_(False)) is ls
  assert ls.loss_scale == 1 and ls.loss_scale.dtype == F32
  assert jax.tree.leaves(ls) == []
  assert jax.jit(lambda ls: ls)(ls) == ls


def test_dynamic_defaults_are_jmps():
  ours = jmp_lite.DynamicLossScale(jnp.float32(2.0 ** 15))
  theirs = jmp.DynamicLossScale(jnp.float32(2.0 ** 15))
  for name in ("loss_scale", "counter", "period", "factor", "min_loss_scale"):
    assert getattr(ours, name) == getattr(theirs, name), name
  assert ours.max_loss_scale == F32_MAX
  assert ours.hysteresis == 1 and ours.hysteresis_left == 1
  # Megatron-LM's and DeepSpeed's default: only a growth refills the hysteresis.
  assert ours.consecutive_hysteresis.dtype == np.bool_ and not ours.consecutive_hysteresis


SCALE_INPUTS = {
    "py_float": 4.0,
    "np_f32": np.float32(4.0),
    "np_f64": np.float64(4.0),
    "np_f64_array": np.array(4.0, np.float64),
    "f16": jnp.float16(4.0),
    "bf16": jnp.bfloat16(4.0),
    "f32": jnp.array(4.0, jnp.float32),
}


@pytest.mark.parametrize("value", SCALE_INPUTS.values(), ids=SCALE_INPUTS.keys())
@pytest.mark.parametrize("cls", [jmp_lite.StaticLossScale, jmp_lite.DynamicLossScale])
def test_scale_is_float32_whatever_the_input(cls, value):
  for ls in (cls(value), jax.jit(cls)(value)):
    assert ls.loss_scale.dtype == F32
    assert not ls.loss_scale.weak_type
    assert ls.loss_scale == 4.0


@pytest.mark.parametrize("value", [4, np.int32(4), jnp.int32(4)], ids=["py", "np", "jnp"])
def test_int_scale_is_float32_and_warns_like_jmp(value):
  match = "Expected floating type for loss_scale"
  with pytest.warns(UserWarning, match=match):
    ours = jmp_lite.DynamicLossScale(value)
  with pytest.warns(UserWarning, match=match):
    jmp.DynamicLossScale(value)
  assert ours.loss_scale.dtype == F32 and ours.loss_scale == 4.0
  with pytest.warns(UserWarning, match="Expected floating type for min_loss_scale"):
    jmp_lite.DynamicLossScale(4.0, min_loss_scale=value)
  # jmp never warns for StaticLossScale; neither do we (warnings are errors here).
  assert jmp_lite.StaticLossScale(value).loss_scale.dtype == F32


def test_float64_scale_under_x64_is_float32():
  with jax.enable_x64(True):
    for cls in (jmp_lite.StaticLossScale, jmp_lite.DynamicLossScale):
      ls = cls(jnp.array(4.0, jnp.float64))
      assert ls.loss_scale.dtype == F32 and not ls.loss_scale.weak_type
      assert ls.scale(jnp.ones(2, jnp.float64)).dtype == F64


@pytest.mark.parametrize("cls, kwargs, match", [
    (jmp_lite.StaticLossScale, dict(loss_scale=0.0), "loss_scale must be finite and > 0, got 0.0"),
    (jmp_lite.StaticLossScale, dict(loss_scale=-2.0), "got -2.0"),
    (jmp_lite.StaticLossScale, dict(loss_scale=float("nan")), "got nan"),
    (jmp_lite.StaticLossScale, dict(loss_scale=float("inf")), "got inf"),
    (jmp_lite.StaticLossScale, dict(loss_scale=jnp.ones(2)), "must be a scalar, got shape (2,)"),
    (jmp_lite.StaticLossScale, dict(loss_scale=1e39), "loss_scale=1e+39 is not representable in float32"),
    (jmp_lite.DynamicLossScale, dict(loss_scale=0.0), "loss_scale must be finite and > 0, got 0.0"),
    (jmp_lite.DynamicLossScale, dict(loss_scale=-1.5), "got -1.5"),
    (jmp_lite.DynamicLossScale, dict(loss_scale=np.nan), "got nan"),
    (jmp_lite.DynamicLossScale, dict(loss_scale=-np.inf), "got -inf"),
    (jmp_lite.DynamicLossScale, dict(loss_scale=np.ones((1,), np.float32)), "must be a scalar, got shape (1,)"),
    (jmp_lite.DynamicLossScale, dict(loss_scale=1e-46), "loss_scale=1e-46 is not representable"),
    (jmp_lite.DynamicLossScale, dict(loss_scale=2.0, period=0), "period must be >= 1, got 0"),
    (jmp_lite.DynamicLossScale, dict(loss_scale=2.0, period=-3), "period must be >= 1, got -3"),
    (jmp_lite.DynamicLossScale, dict(loss_scale=2.0, period=2.5), "period must be a whole number, got 2.5"),
    (jmp_lite.DynamicLossScale, dict(loss_scale=2.0, period=float("inf")), "period must be a whole number, got inf"),
    (jmp_lite.DynamicLossScale, dict(loss_scale=2.0, period=2 ** 40), "period is out of range: 1099511627776"),
    (jmp_lite.DynamicLossScale, dict(loss_scale=2.0, period=2.0 ** 40), "period must fit in int32, got 1099511627776.0"),
    (jmp_lite.DynamicLossScale, dict(loss_scale=2.0, period=jnp.ones(3, jnp.int32)), "period must be a scalar, got shape (3,)"),
    (jmp_lite.DynamicLossScale, dict(loss_scale=2.0, factor=1), "factor must be finite and > 1, got 1"),
    (jmp_lite.DynamicLossScale, dict(loss_scale=2.0, factor=0.5), "factor must be finite and > 1, got 0.5"),
    (jmp_lite.DynamicLossScale, dict(loss_scale=2.0, factor=-2.0), "got -2.0"),
    (jmp_lite.DynamicLossScale, dict(loss_scale=2.0, factor=np.inf), "factor must be finite and > 1, got inf"),
    (jmp_lite.DynamicLossScale, dict(loss_scale=2.0, hysteresis=0), "hysteresis must be >= 1, got 0"),
    (jmp_lite.DynamicLossScale, dict(loss_scale=2.0, hysteresis=1.5), "hysteresis must be a whole number, got 1.5"),
    (jmp_lite.DynamicLossScale, dict(loss_scale=2.0, counter=-1), "counter must be >= 0, got -1"),
    (jmp_lite.DynamicLossScale, dict(loss_scale=2.0, min_loss_scale=-1.0), "min_loss_scale must be finite and >= 0, got -1.0"),
    (jmp_lite.DynamicLossScale, dict(loss_scale=2.0, min_loss_scale=np.nan), "min_loss_scale must be finite and >= 0, got nan"),
    (jmp_lite.DynamicLossScale, dict(loss_scale=2.0, max_loss_scale=0.0), "max_loss_scale must be finite and > 0, got 0.0"),
    (jmp_lite.DynamicLossScale, dict(loss_scale=2.0, max_loss_scale=np.inf), "max_loss_scale must be finite and > 0, got inf"),
    (jmp_lite.DynamicLossScale, dict(loss_scale=2.0, min_loss_scale=4.0, max_loss_scale=2.0), "min_loss_scale=4.0 is larger than max_loss_scale=2.0"),
], ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_bad_construction_input_is_a_value_error_showing_the_value(cls, kwargs, match):
  with pytest.raises(ValueError, match=re.escape(match)):
    cls(**kwargs)


# Each case: the arguments, the exception, and the fragments its message must
# contain: the argument's name and the value given.
ORDER_AND_TYPE_ERRORS = {
    "min_above_scale": (
        dict(loss_scale=2.0, min_loss_scale=4.0), ValueError,
        ["min_loss_scale=4.0", "loss_scale=2.0"]),
    # The default floor of 1 is above a small starting scale: say which it is.
    "default_min_above_scale": (
        dict(loss_scale=0.5), ValueError,
        ["min_loss_scale=1.0", "loss_scale=0.5", "min_loss_scale <= 0.5"]),
    "scale_above_max": (
        dict(loss_scale=8.0, max_loss_scale=4.0), ValueError,
        ["loss_scale=8.0", "max_loss_scale=4.0"]),
    "scale_above_max_large": (
        dict(loss_scale=2.0 ** 100, max_loss_scale=2.0 ** 90), ValueError,
        [f"loss_scale={2.0 ** 100}", f"max_loss_scale={2.0 ** 90}"]),
    "hysteresis_left_zero": (
        dict(loss_scale=2.0, hysteresis=3, hysteresis_left=0), ValueError,
        ["hysteresis_left", "hysteresis=3", "got 0"]),
    "hysteresis_left_negative": (
        dict(loss_scale=2.0, hysteresis_left=-1), ValueError,
        ["hysteresis_left", "hysteresis=1", "got -1"]),
    "hysteresis_left_above_hysteresis": (
        dict(loss_scale=2.0, hysteresis=3, hysteresis_left=4), ValueError,
        ["hysteresis_left", "hysteresis=3", "got 4"]),
    "scale_str": (dict(loss_scale="1024"), TypeError, ["loss_scale", "'1024'"]),
    "scale_bytes": (dict(loss_scale=b"2"), TypeError, ["loss_scale", "b'2'"]),
    "scale_none": (dict(loss_scale=None), TypeError, ["loss_scale", "None"]),
    "min_none": (dict(loss_scale=2.0, min_loss_scale=None), TypeError,
                 ["min_loss_scale", "None"]),
    "period_str": (dict(loss_scale=2.0, period="10"), TypeError, ["period", "'10'"]),
    "consecutive_str": (dict(loss_scale=2.0, consecutive_hysteresis="yes"), TypeError,
                        ["consecutive_hysteresis", "'yes'"]),
    "consecutive_int": (dict(loss_scale=2.0, consecutive_hysteresis=1), TypeError,
                        ["consecutive_hysteresis", "got 1"]),
    "consecutive_none": (dict(loss_scale=2.0, consecutive_hysteresis=None), TypeError,
                         ["consecutive_hysteresis", "None"]),
    "consecutive_vector": (
        dict(loss_scale=2.0, consecutive_hysteresis=np.array([True, False])), TypeError,
        ["consecutive_hysteresis", "[ True, False]"]),
    "consecutive_int32": (
        dict(loss_scale=2.0, consecutive_hysteresis=jnp.int32(1)), TypeError,
        ["consecutive_hysteresis", "Array(1, dtype=int32)"]),
}


@pytest.mark.parametrize("kwargs, error, fragments", ORDER_AND_TYPE_ERRORS.values(),
                         ids=ORDER_AND_TYPE_ERRORS.keys())
def test_bad_order_range_or_type_names_the_argument_and_shows_the_value(
    kwargs, error, fragments):
  with pytest.raises(error) as info:
    jmp_lite.DynamicLossScale(**kwargs)
  for fragment in fragments:
    assert fragment in str(info.value), (fragment, str(info.value))


def test_order_errors_show_the_value_passed_not_its_float32_rounding():
  with pytest.raises(ValueError) as info:
    jmp_lite.DynamicLossScale(0.2, min_loss_scale=0.3)
  assert "min_loss_scale=0.3 " in str(info.value) and "loss_scale=0.2" in str(info.value)


def test_string_scale_is_a_type_error_for_static_too():
  with pytest.raises(TypeError, match="loss_scale must be a number or a scalar array, got '2'"):
    jmp_lite.StaticLossScale("2")


def test_boundary_values_are_accepted():
  # The checks are inclusive: a scale at its floor and cap, a full or an
  # exhausted tolerance, and every spelling of a boolean flag.
  ls = jmp_lite.DynamicLossScale(4.0, min_loss_scale=4.0, max_loss_scale=4.0)
  assert ls.min_loss_scale == ls.loss_scale == ls.max_loss_scale == 4.0
  for left in (1, 3):
    ls = jmp_lite.DynamicLossScale(2.0, hysteresis=3, hysteresis_left=left)
    assert ls.hysteresis_left == left
  for flag in (True, np.bool_(True), jnp.bool_(True), np.array(True)):
    ls = jmp_lite.DynamicLossScale(2.0, consecutive_hysteresis=flag)
    assert ls.consecutive_hysteresis.dtype == np.bool_ and bool(ls.consecutive_hysteresis)
  # Traced values are not known when constructed, so they are not checked.
  traced = jax.jit(lambda s, left: jmp_lite.DynamicLossScale(
      s, hysteresis=2, hysteresis_left=left))(jnp.float32(0.5), jnp.int32(2))
  assert traced.loss_scale == 0.5 and traced.hysteresis_left == 2


@pytest.mark.parametrize("cls", [jmp_lite.StaticLossScale, jmp_lite.DynamicLossScale])
def test_zero_scale_is_rejected_unlike_jmp(cls):
  # jmp accepts StaticLossScale(0), whose unscale divides by zero.
  with pytest.raises(ValueError, match="got 0.0"):
    cls(0.0)
  jmp.StaticLossScale(0)


# Pytree behaviour: leaves, dtypes, transformations.


def test_dynamic_leaves_have_fixed_dtypes_and_no_weak_types():
  checks = {
      "constructed": unusual_dynamic(),
      "defaults": jmp_lite.DynamicLossScale(2.0),
      "adjusted": unusual_dynamic().adjust(jnp.bool_(True)),
      "adjusted_down": unusual_dynamic().adjust(jnp.bool_(False)),
      "jit_adjusted": jax.jit(lambda ls: ls.adjust(jnp.bool_(False)))(unusual_dynamic()),
      "jit_constructed": jax.jit(lambda s: jmp_lite.DynamicLossScale(s, period=5))(3.0),
  }
  for name, ls in checks.items():
    values = field_values(ls)
    assert list(values) == list(DYNAMIC_FIELDS), name
    for field, dtype in DYNAMIC_FIELDS.items():
      assert values[field][:2] == (dtype, False), (name, field)
      assert getattr(ls, field).shape == (), (name, field)
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(unusual_dynamic())[0]]
  assert paths == [f".{name}" for name in DYNAMIC_FIELDS]


def test_static_loss_scale_is_a_float32_leaf_unlike_jmp():
  ls = jmp_lite.StaticLossScale(2.0)
  (leaf,) = jax.tree.leaves(ls)
  assert leaf is ls.loss_scale and leaf.dtype == F32 and not leaf.weak_type
  # jmp keeps the value in the treedef.
  assert jax.tree.leaves(jmp.StaticLossScale(2.0)) == []


def _identity_transforms():
  def scan(ls):
    carry, ys = jax.lax.scan(lambda c, _: (c, c), ls, length=3)
    assert jax.tree.structure(ys) == jax.tree.structure(ls)
    return carry

  def flatten_unflatten(ls):
    leaves, treedef = jax.tree_util.tree_flatten(ls)
    return jax.tree_util.tree_unflatten(treedef, leaves)

  def flatten_with_path(ls):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(ls)
    return jax.tree_util.tree_unflatten(treedef, [x for _, x in leaves])

  return {
      "jit": jax.jit(lambda ls: ls),
      # x + zeros_like(x): a computed copy of every leaf, bool included, with
      # no promotion (strict promotion rejects bool + 0).
      "jit_copy": jax.jit(lambda ls: jax.tree.map(lambda x: x + jnp.zeros_like(x), ls)),
      "tree_map": lambda ls: jax.tree.map(lambda x: x, ls),
      "tree_map_np": lambda ls: jax.tree.map(jnp.asarray, jax.tree.map(np.asarray, ls)),
      "scan": scan,
      "jit_scan": jax.jit(scan),
      "flatten_unflatten": flatten_unflatten,
      "flatten_with_path": flatten_with_path,
      "device_put": jax.device_put,
      "vmap": lambda ls: jax.tree.map(
          lambda x: x[0], jax.vmap(lambda _, ls: ls, in_axes=(0, None))(jnp.ones(2), ls)),
  }


TRANSFORMS = _identity_transforms()


@pytest.mark.parametrize("transform", TRANSFORMS.values(), ids=TRANSFORMS.keys())
def test_every_field_survives_transformations(transform):
  for ls in (unusual_dynamic(), jmp_lite.StaticLossScale(3.0), jmp_lite.NoOpLossScale()):
    out = transform(ls)
    assert type(out) is type(ls)
    assert field_values(out) == field_values(ls)


def test_jmp_loses_min_loss_scale_which_we_keep():
  # The bug this library fixes: jmp's tree_flatten forgets min_loss_scale.
  theirs = jmp.DynamicLossScale(jnp.float32(4.0), min_loss_scale=jnp.float32(0.5))
  assert theirs.min_loss_scale == 0.5
  assert jax.jit(lambda ls: ls)(theirs).min_loss_scale == 1.0
  leaves, treedef = jax.tree_util.tree_flatten(theirs)
  assert jax.tree_util.tree_unflatten(treedef, leaves).min_loss_scale == 1.0
  ours = jmp_lite.DynamicLossScale(jnp.float32(4.0), min_loss_scale=jnp.float32(0.5))
  assert jax.jit(lambda ls: ls)(ours).min_loss_scale == 0.5
  leaves, treedef = jax.tree_util.tree_flatten(ours)
  assert jax.tree_util.tree_unflatten(treedef, leaves).min_loss_scale == 0.5
  # And it keeps working as the floor after jit.
  step = jax.jit(lambda ls: ls.adjust(jnp.bool_(False)))
  for _ in range(5):
    ours = step(ours)
  assert ours.loss_scale == 0.5


def test_tree_map_does_not_revalidate():
  # Unflattening must accept placeholders (jax uses object() and None).
  ls = unusual_dynamic()
  shapes = jax.tree.map(lambda x: x.shape, ls)
  assert shapes.loss_scale == () and shapes.min_loss_scale == ()
  assert jax.eval_shape(lambda ls: ls.adjust(jnp.bool_(True)), ls).loss_scale.dtype == F32


# Compilation.


@pytest.mark.parametrize("cls", [jmp_lite.StaticLossScale, jmp_lite.DynamicLossScale])
def test_jitted_step_with_changing_scale_compiles_once(cls):
  @jax.jit
  def step(ls, grads):
    grads = ls.unscale(ls.scale(grads))
    finite = jmp_lite.all_finite(grads)
    return ls.adjust(finite), grads, finite

  grads = {"w": jnp.full(3, 2.0 ** -10, jnp.float16), "b": jnp.ones((), jnp.bfloat16)}
  bad = {"w": jnp.array([1.0, jnp.inf, 1.0], jnp.float16), "b": grads["b"]}
  if cls is jmp_lite.DynamicLossScale:
    ls = cls(2.0 ** 10, period=1)  # Grows after every finite step.
  else:
    ls = cls(2.0 ** 10)
  seen = []
  with count_compilations() as compiled:
    for i in range(8):
      if cls is jmp_lite.StaticLossScale:
        ls = cls(2.0 ** (i + 1))  # A new value every step.
      seen.append(float(ls.loss_scale))
      ls, out, finite = step(ls, bad if i % 3 == 2 else grads)
      assert bool(finite) == (i % 3 != 2)
      assert out["w"].dtype == F32 and out["b"].dtype == F32  # as jmp (below)
      if bool(finite):
        np.testing.assert_array_equal(np.asarray(out["w"], np.float32), [2.0 ** -10] * 3)
  assert all(a != b for a, b in zip(seen, seen[1:]))  # A new scale every step.
  assert len(compiled) == 1


def test_jmp_static_loss_scale_recompiles_for_each_value():
  # The deliberate difference: jmp's StaticLossScale value is in the treedef.
  values, x = (2.0, 4.0, 8.0), jnp.ones(2)
  step = jax.jit(lambda ls, x: ls.scale(x))
  theirs = [jmp.StaticLossScale(value) for value in values]
  with count_compilations() as compiled:
    for ls in theirs:
      step(ls, x)
  assert len(compiled) == 3
  ours = jax.jit(lambda ls, x: ls.scale(x))
  mine = [jmp_lite.StaticLossScale(value) for value in values]
  with count_compilations() as compiled:
    outs = [ours(ls, x) for ls in mine]
  assert [float(out[0]) for out in outs] == list(values)
  assert len(compiled) == 1


@pytest.mark.parametrize("make", [
    lambda: jmp_lite.NoOpLossScale(),
    lambda: jmp_lite.StaticLossScale(8.0),
    lambda: unusual_dynamic(),
], ids=["noop", "static", "dynamic"])
def test_lower_and_compile_a_step_taking_a_loss_scale(make):
  def step(ls, x):
    grads = ls.unscale(ls.scale(x))
    return ls.adjust(jmp_lite.all_finite(grads)), grads

  ls, x = make(), jnp.arange(4, dtype=jnp.bfloat16)
  compiled = jax.jit(step).lower(ls, x).compile()
  new_ls, grads = compiled(ls, x)
  assert type(new_ls) is type(ls)
  np.testing.assert_array_equal(np.asarray(grads, np.float32), np.arange(4))
  # The compiled executable takes other values of the same loss-scale type.
  if isinstance(ls, jmp_lite.DynamicLossScale):
    other = jmp_lite.DynamicLossScale(4.0)
    assert compiled(other, x)[0].period == 2000
    assert new_ls.counter == 4 and new_ls.loss_scale == 1024.0


# scale / unscale.


@pytest.mark.parametrize("dtype", [F16, BF16, F32, F64], ids=["f16", "bf16", "f32", "f64"])
@pytest.mark.parametrize("cls", [jmp_lite.StaticLossScale, jmp_lite.DynamicLossScale])
@JIT
def test_scale_and_unscale_return_jmps_dtypes(dtype, cls, jit):
  """jmp scales by ``x * loss_scale`` (jmp/_src/loss_scale.py, jmp 0.0.4:
  ``StaticLossScale.scale``/``DynamicLossScale.scale``; its docstring's scale
  is ``jnp.asarray(2. ** 15)``, float32): a 16-bit leaf comes back float32
  under JAX's standard promotion; float32 and float64 stay."""
  with x64_if_needed(dtype):
    ls = cls(2.0 ** 8)
    values = np.array([0.5, -1.25, 3.0, 0.0], np.float32)
    tree = {"x": jnp.asarray(values, dtype), "i": jnp.arange(3, dtype=jnp.int32),
            "b": jnp.array([True]), "key": jax.random.key(1), "none": None,
            "nested": [jnp.asarray(values[:2], dtype)]}
    scaled = maybe_jit(ls.scale, jit)(tree)
    unscaled = maybe_jit(ls.unscale, jit)(scaled)
    want = F64 if dtype == F64 else F32
    with jax.numpy_dtype_promotion("standard"):
      jmp_scaled = tree["x"] * jnp.asarray(2.0 ** 8, jnp.float32)  # jmp's arithmetic
    assert jmp_scaled.dtype == want
    for out, factor in ((scaled, 2.0 ** 8), (unscaled, 1.0)):
      assert out["x"].dtype == want and out["nested"][0].dtype == want
      np.testing.assert_array_equal(np.asarray(out["x"], np.float32), values * factor)
      assert out["none"] is None
      np.testing.assert_array_equal(out["i"], tree["i"])
      assert out["i"].dtype == I32 and out["b"].dtype == np.bool_
      assert jax.dtypes.issubdtype(out["key"].dtype, jax.dtypes.prng_key)
    if not jit:  # Non-floating leaves are passed through, not copied.
      for name in ("i", "b", "key"):
        assert scaled[name] is tree[name] and unscaled[name] is tree[name]


@pytest.mark.parametrize("cls", [jmp_lite.StaticLossScale, jmp_lite.DynamicLossScale])
@JIT
def test_float16_leaf_with_a_scale_beyond_float16_range(cls, jit):
  # 2**16 is inf in float16: the product is float32, as in jmp.
  ls = cls(2.0 ** 16)
  x = jnp.float16(0.5)
  scaled = maybe_jit(ls.scale, jit)(x)
  assert scaled.dtype == F32 and scaled == 32768.0
  assert maybe_jit(ls.scale, jit)(jnp.float16(4.0)) == 2.0 ** 18  # inf in float16
  round_trip = maybe_jit(ls.unscale, jit)(scaled)
  assert round_trip.dtype == F32 and round_trip == 0.5
  # 2**-30 is 0 in float16, and 32768 / 2**40 = 2**-25 is below float16's
  # subnormals: float32 holds it.
  tiny = maybe_jit(cls(2.0 ** 40).unscale, jit)(jnp.float16(32768.0))
  assert tiny.dtype == F32 and tiny == 2.0 ** -25
  # Random float16 values survive a power-of-two round trip exactly.
  values = jnp.asarray(np.random.default_rng(0).uniform(-0.99, 0.99, 64), F16)
  np.testing.assert_array_equal(ls.unscale(ls.scale(values)), values.astype(F32))


def test_scaling_arithmetic_is_float32_in_the_jaxpr():
  ls = jmp_lite.DynamicLossScale(2.0 ** 16)
  # Unscaling multiplies by two normal factors (`_exact.normal_pair`).
  for fn, n in ((ls.scale, 1), (ls.unscale, 2)):
    jaxpr = jax.make_jaxpr(fn)(jnp.ones(3, jnp.float16)).jaxpr
    muls = [e for e in jaxpr.eqns if e.primitive.name == "mul"
            and e.outvars[0].aval.shape == (3,)]
    assert len(muls) == n
    assert all(v.aval.dtype == F32 for m in muls for v in m.invars)
    assert jaxpr.outvars[0].aval.dtype == F32


def test_value_and_grad_returns_gradients_in_the_parameters_dtypes():
  """`unscale` returns float32 for float16 leaves; `jmp_lite.value_and_grad`
  returns what `jax.grad` returns, float16 gradients of float16 parameters,
  rounded once (oracle: the float32 unscaled gradient, rounded)."""
  w = jnp.asarray([0.5, 3e-3, 1e-7], jnp.float16)
  loss = lambda w: jnp.sum(w.astype(jnp.float32) * jnp.float32(3.0))
  _, grads, _ = jmp_lite.value_and_grad(loss)(w, loss_scale=jmp_lite.StaticLossScale(1000.0))
  assert grads.dtype == F16
  np.testing.assert_array_equal(grads, np.full(3, 3.0, np.float16))


@pytest.mark.parametrize("scale", [2.0 ** 127, 3 * 2.0 ** 126, 1.5 * 2.0 ** 126,
                                   float(np.finfo(np.float32).max)])
@pytest.mark.parametrize("cls", [jmp_lite.StaticLossScale, jmp_lite.DynamicLossScale])
def test_unscale_above_2_to_the_126(cls, scale):
  """1/scale is subnormal there, and XLA flushed it to 0: value_and_grad gave
  all-zero gradients, reported finite (torch's GradScaler unscales them; a
  dynamic scale with a short period grows there on its own). Oracle: the
  gradients of the unscaled loss, and NumPy, also with the scale a constant
  of the jitted function."""
  c = jnp.array([1.0, 0.5, 2e-3, 3e-30], jnp.float32)
  loss = lambda w: jnp.sum(w * c)  # pylint: disable=unnecessary-lambda-assignment
  w = jnp.ones(4)
  _, grads, finite = jax.jit(jmp_lite.value_and_grad(loss))(w, loss_scale=cls(scale))
  assert bool(finite)
  np.testing.assert_allclose(grads, c, rtol=2 ** -23)  # within an ulp of exact
  g = np.array([1e38, 3e30, 7e31, -2.5e36], np.float32)  # normal results
  # As jmp and torch's GradScaler unscale: times the float32-rounded
  # reciprocal (here its mantissa, rounded by NumPy), rounded once.
  ms, es = np.frexp(np.float32(scale))
  recip = np.float64(np.float32(0.5) / ms) * 2.0 ** (1 - int(es))
  want = (g.astype(np.float64) * recip).astype(np.float32)
  np.testing.assert_array_equal(jax.jit(cls(scale).unscale)(jnp.asarray(g)), want)


def test_scale_matches_jmp_for_float32_and_python_scalars():
  for value in (2.0, 3.0, 1024.0):
    tree = {"a": jnp.array([1.5, -2.0]), "s": 3.0}
    ours = jmp_lite.DynamicLossScale(value).scale(tree)
    theirs = jmp.DynamicLossScale(jnp.float32(value)).scale(tree)
    for name in tree:
      np.testing.assert_array_equal(ours[name], theirs[name])
    np.testing.assert_array_equal(jmp_lite.StaticLossScale(value).unscale(tree)["a"],
                                  jmp.StaticLossScale(value).unscale(tree)["a"])


# DynamicLossScale.adjust.


@pytest.mark.parametrize("seed", range(4))
def test_dynamic_trajectory_matches_jmp(seed):
  rng = np.random.default_rng(seed)
  period = int(rng.integers(1, 6))
  factor = int(rng.choice([2, 3, 4]))
  min_scale = float(rng.choice([1.0, 0.5, 2.0 ** -10]))
  flags = rng.random(100) < 0.8
  flags[50:80] = False  # Long enough to reach min_loss_scale.
  # jmp divides in float32, correctly rounded on a CPU; XLA:GPU's division
  # is not (an H200 gave 3640.8892 for 3640.889): the reference runs on a CPU.
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    theirs = jmp.DynamicLossScale(jnp.float32(2.0 ** 15), period=period, factor=factor,
                                  min_loss_scale=jnp.float32(min_scale))
  ours = jmp_lite.DynamicLossScale(jnp.float32(2.0 ** 15), period=period,
                                   factor=factor, min_loss_scale=min_scale)
  step = jax.jit(lambda ls, finite: ls.adjust(finite))
  jitted = ours
  hit_floor = False
  compiled = []  # by the jitted steps only, not by the eager ones around them
  for finite in flags:
    flag = jnp.bool_(finite)
    with standard_promotion(), jax.default_device(cpu):
      theirs = theirs.adjust(jax.device_put(flag, cpu))
    ours = ours.adjust(flag)
    with count_compilations() as now:
      jitted = step(jitted, flag)
    compiled += now
    for ls in (ours, jitted):
      assert np.float32(ls.loss_scale) == np.float32(theirs.loss_scale)
      assert int(ls.counter) == int(theirs.counter)
    hit_floor |= float(ours.loss_scale) == min_scale
  assert hit_floor
  assert len(compiled) == 1


# (loss_scale, counter, hysteresis_left) after each of the finite flags
# F F F F T F F T T, then F T F F, from DynamicLossScale(64.0, period=2,
# hysteresis=3).
HYSTERESIS_FLAGS = (False, False, False, False, True, False, False, True, True,
                    False, True, False, False)
HYSTERESIS_TRACES = {
    # Megatron-LM's and DeepSpeed's default: only a growth refills the tolerance.
    False: [
        (64.0, 0, 2), (64.0, 0, 1), (32.0, 0, 1), (16.0, 0, 1),  # Backs off on the 3rd.
        (16.0, 1, 1),  # A finite step does not refill the tolerance ...
        (8.0, 0, 1), (4.0, 0, 1),  # ... so the next overflows back off at once.
        (4.0, 1, 1), (8.0, 0, 3),  # A growth refills it.
        (8.0, 0, 2), (8.0, 1, 2),
        (8.0, 0, 1), (4.0, 0, 1),  # 3 overflows in a period, apart: backs off.
    ],
    # DeepSpeed's consecutive_hysteresis=True: every finite step refills it.
    True: [
        (64.0, 0, 2), (64.0, 0, 1), (32.0, 0, 1), (16.0, 0, 1),  # Backs off on the 3rd.
        (16.0, 1, 3),  # A finite step refills the tolerance.
        (16.0, 0, 2), (16.0, 0, 1),
        (16.0, 1, 3), (32.0, 0, 3),  # Growth is unaffected.
        (32.0, 0, 2), (32.0, 1, 3),
        (32.0, 0, 2), (32.0, 0, 1),  # Only 3 overflows in a row back off.
    ],
}


@pytest.mark.parametrize("consecutive", [False, True])
def test_hysteresis_delays_backoff(consecutive):
  step = jax.jit(lambda ls, finite: ls.adjust(finite))
  eager = jitted = jmp_lite.DynamicLossScale(64.0, period=2, hysteresis=3,
                                             consecutive_hysteresis=consecutive)
  compiled = []  # by the jitted steps only, not by the eager ones around them
  for n, (finite, want) in enumerate(zip(HYSTERESIS_FLAGS, HYSTERESIS_TRACES[consecutive])):
    eager = eager.adjust(jnp.bool_(finite))
    with count_compilations() as now:
      jitted = step(jitted, np.bool_(finite))
    compiled += now
    for ls in (eager, jitted):
      assert (float(ls.loss_scale), int(ls.counter), int(ls.hysteresis_left)) == want, n
  assert len(compiled) == 1


def test_max_loss_scale_caps_growth_and_overflow_keeps_scale():
  ls = jmp_lite.DynamicLossScale(2.0 ** 10, period=1, factor=4.0, max_loss_scale=5000.0)
  ls = ls.adjust(jnp.bool_(True))
  assert ls.loss_scale == 4096.0
  ls = ls.adjust(jnp.bool_(True))
  assert ls.loss_scale == 5000.0
  assert ls.adjust(jnp.bool_(True)).loss_scale == 5000.0
  # Without a cap, a growth that overflows float32 keeps the scale (jmp's first_finite).
  big = jmp_lite.DynamicLossScale(F32_MAX / 2, period=1, factor=4.0)
  assert big.adjust(jnp.bool_(True)).loss_scale == np.float32(F32_MAX / 2)


def test_scale_never_reaches_zero():
  ls = jmp_lite.DynamicLossScale(1.0, factor=2.0 ** 20, min_loss_scale=0.0)
  step = jax.jit(lambda ls: ls.adjust(jnp.bool_(False)))
  for _ in range(10):
    ls = step(ls)
  assert ls.loss_scale == np.float32(F32_TINY)


@pytest.mark.parametrize("flag", [
    jnp.array([True]), jnp.ones((2,), bool), jnp.float32(1.0), jnp.int32(1),
    np.array([False]), 1.0, "yes"], ids=lambda f: repr(f)[:20])
@pytest.mark.parametrize("ls", [jmp_lite.NoOpLossScale(), jmp_lite.StaticLossScale(2.0),
                                jmp_lite.DynamicLossScale(2.0)],
                         ids=["noop", "static", "dynamic"])
def test_adjust_rejects_non_boolean_scalars(ls, flag):
  with pytest.raises(ValueError, match="expected boolean scalar") as info:
    ls.adjust(flag)
  assert isinstance(info.value, AssertionError)  # jmp raises AssertionError.


@pytest.mark.parametrize("flag", [True, np.bool_(False), jnp.bool_(True)],
                         ids=["py", "np", "jnp"])
def test_adjust_accepts_boolean_scalars(flag):
  ls = jmp_lite.DynamicLossScale(8.0, period=1).adjust(flag)
  assert ls.loss_scale == (16.0 if flag else 4.0)


# A plain-Python model of DynamicLossScale, from the pseudo-code in its docstring:
#
#     if all_finite(grads):
#       counter += 1
#       if consecutive_hysteresis:
#         left = hysteresis
#       if counter == period:
#         counter = 0; left = hysteresis
#         if isfinite(loss_scale * factor):
#           loss_scale = min(loss_scale * factor, max_loss_scale)
#     else:
#       counter = 0
#       if left > 1:
#         left -= 1
#       else:
#         loss_scale = max(min_loss_scale, loss_scale / factor, tiny_f32)
#
# tests/test_loss_scale_reference.py checks the same semantics against
# Megatron-LM's and DeepSpeed's own code; this model also covers our extras
# (the cap, the isfinite test on growth, the tiny floor, any factor).


def model_trajectory(init, flags):
  """Returns [(loss_scale, counter, hysteresis_left)] after each step, in float32."""
  f32 = np.float32
  scale, factor = f32(init["loss_scale"]), f32(init["factor"])
  lo, hi = f32(init["min_loss_scale"]), f32(init["max_loss_scale"])
  counter, left = init["counter"], init["hysteresis_left"]
  period, hysteresis = init["period"], init["hysteresis"]
  consecutive = init["consecutive_hysteresis"]
  out = []
  with np.errstate(over="ignore", under="ignore"):
    for finite in flags:
      if finite:
        counter += 1
        if consecutive:
          left = hysteresis
        if counter == period:
          counter = 0
          left = hysteresis
          grown = f32(scale * factor)
          if np.isfinite(grown):
            scale = min(grown, hi)
      else:
        counter = 0
        if left > 1:
          left -= 1
        else:
          scale = max(lo, f32(scale / factor), f32(F32_TINY))
      assert 1 <= left <= hysteresis  # The range the constructor enforces.
      out.append((f32(scale), counter, left))
  return out


@st.composite
def dynamic_configs(draw):
  f32 = dict(width=32, allow_nan=False, allow_infinity=False)
  period = draw(st.integers(1, 6))
  hysteresis = draw(st.integers(1, 4))
  # Drawn as float32 values, so that the bounds below are representable and
  # the constructor compares the same numbers: min <= loss_scale <= max.
  scale = float(np.float32(draw(st.one_of(
      st.floats(2.0 ** -20, F32_MAX, **f32),
      st.sampled_from([1.0, 2.0 ** 15, F32_MAX / 3])))))
  lo = draw(st.one_of(st.just(0.0), st.just(min(1.0, scale)), st.just(scale),
                      st.floats(0.0, scale, **f32)))
  hi = draw(st.one_of(st.just(F32_MAX), st.just(scale), st.floats(scale, F32_MAX, **f32)))
  return dict(
      loss_scale=scale,
      counter=draw(st.integers(0, period - 1)),
      period=period,
      factor=draw(st.one_of(st.sampled_from([2.0, 3.0, 1.5]),
                            st.floats(1.0, 1e3, exclude_min=True, **f32))),
      min_loss_scale=lo,
      max_loss_scale=hi,
      hysteresis=hysteresis,
      hysteresis_left=draw(st.integers(1, hysteresis)),
      consecutive_hysteresis=draw(st.booleans()),
  )


NUM_STEPS = 32
FLAGS = st.lists(st.booleans(), min_size=NUM_STEPS, max_size=NUM_STEPS)
PROPERTY = hypothesis.settings(max_examples=40, deadline=None, database=None)


def assert_matches_model(init, flags, trajectory):
  expected = model_trajectory(init, flags)
  for step, (got, want) in enumerate(zip(trajectory, expected)):
    scale, counter, left = got
    assert (np.float32(scale), int(counter), int(left)) == want, (step, init, flags)
  assert len(trajectory) == len(expected)


def states(ls_list):
  return [(ls.loss_scale, ls.counter, ls.hysteresis_left) for ls in ls_list]


@hypothesis.settings(PROPERTY, max_examples=15)
@hypothesis.given(init=dynamic_configs(), flags=FLAGS)
def test_adjust_matches_model_unjitted(init, flags):
  ls = jmp_lite.DynamicLossScale(**init)
  trajectory = []
  for finite in flags:
    ls = ls.adjust(jnp.bool_(finite))
    trajectory.append(ls)
  assert_matches_model(init, flags, states(trajectory))
  for field in ("period", "factor", "min_loss_scale", "max_loss_scale", "hysteresis"):
    assert np.float32(getattr(ls, field)) == np.float32(init[field])
  assert bool(ls.consecutive_hysteresis) is init["consecutive_hysteresis"]


# One compilation for every step of every example: chex counts the traces of
# these module-level steps over the whole process, as their jit caches do.
_JIT_ADJUST = jax.jit(chex.assert_max_traces(lambda ls, finite: ls.adjust(finite), n=1))


@PROPERTY
@hypothesis.given(init=dynamic_configs(), flags=FLAGS)
def test_adjust_matches_model_jitted_step(init, flags):
  ls = jmp_lite.DynamicLossScale(**init)
  trajectory = []
  for finite in flags:
    ls = _JIT_ADJUST(ls, np.bool_(finite))
    trajectory.append(ls)
  assert_matches_model(init, flags, states(trajectory))


@jax.jit
@chex.assert_max_traces(n=1)
def _scan_adjust(ls, flags):
  def body(ls, finite):
    ls = ls.adjust(finite)
    return ls, (ls.loss_scale, ls.counter, ls.hysteresis_left)
  return jax.lax.scan(body, ls, flags)


@PROPERTY
@hypothesis.given(init=dynamic_configs(), flags=FLAGS)
def test_adjust_matches_model_in_scan(init, flags):
  final, (scales, counters, lefts) = _scan_adjust(
      jmp_lite.DynamicLossScale(**init), np.array(flags, bool))
  assert_matches_model(init, flags, list(zip(np.asarray(scales), np.asarray(counters),
                                              np.asarray(lefts))))
  assert np.float32(final.loss_scale) == np.asarray(scales)[-1]
  assert np.float32(final.min_loss_scale) == np.float32(init["min_loss_scale"])


# all_finite.


_JIT_ALL_FINITE = jax.jit(jmp_lite.all_finite)
FLOAT_DTYPES = {"f64": F64, "f32": F32, "bf16": BF16, "f16": F16,
                "e4m3fn": E4M3, "e5m2": E5M2}
NON_FINITE = {"nan": np.nan, "+inf": np.inf, "-inf": -np.inf}


@pytest.mark.parametrize("dtype, bad", [
    pytest.param(dtype, bad, id=f"{dname}-{bname}")
    for dname, dtype in FLOAT_DTYPES.items() for bname, bad in NON_FINITE.items()
    if not (dtype == E4M3 and np.isinf(bad))])  # float8_e4m3fn has no infinity.
def test_all_finite_detects_every_non_finite_value_anywhere(dtype, bad):
  with x64_if_needed(dtype):
    ok = np.ones(5, np.float32)
    clean = [jnp.asarray(ok, dtype), jnp.arange(4, dtype=jnp.int32),
             jnp.asarray(ok[:2], dtype)]
    assert bool(_JIT_ALL_FINITE(clean)) is True
    cases = [(leaf, pos) for leaf in (0, 2)  # First and last leaf, an int between.
             for pos in ((0, 2, 4) if leaf == 0 else (0, 1))]  # First/middle/last.
    for leaf, pos in cases:
      values = np.array(ok[:5 if leaf == 0 else 2])
      values[pos] = bad
      poisoned = jnp.asarray(values, dtype)
      assert not np.isfinite(np.asarray(poisoned, np.float32)[pos])
      tree = list(clean)
      tree[leaf] = poisoned
      # Jitted for every position, eagerly (slower: one trace per call) for one.
      for fn in ((_JIT_ALL_FINITE, jmp_lite.all_finite) if (leaf, pos) == (2, 1)
                 else (_JIT_ALL_FINITE,)):
        result = fn(tree)
        assert result.shape == () and result.dtype == np.bool_
        assert bool(result) is False, (leaf, pos)


def test_all_finite_ignores_non_floating_leaves_and_empty_trees():
  for tree in (None, {}, [], (), {"a": None}, {"i": jnp.arange(3)},
               {"b": jnp.array([True])}, {"k": jax.random.key(0)}):
    for fn in (jmp_lite.all_finite, jax.jit(jmp_lite.all_finite)):
      result = fn(tree)
      assert result.shape == () and result.dtype == np.bool_ and bool(result) is True
  assert bool(jmp.all_finite(None)) and bool(jmp.all_finite({}))


def test_all_finite_counts_python_and_numpy_scalars_like_jmp():
  for tree, want in (([1.0, float("nan")], False), ({"x": float("inf")}, False),
                     ([np.float32(np.inf), np.float16(1.0)], False),
                     (np.array([1.0, np.nan]), False), ([1.0, 2.0], True),
                     ([np.float32(3.0), np.float16(1.0)], True)):
    assert bool(jmp_lite.all_finite(tree)) is want, tree
    assert bool(jmp.all_finite(tree)) is want, tree


@JIT
def test_all_finite_is_exact_when_the_sum_overflows(jit):
  fn = maybe_jit(jmp_lite.all_finite, jit)
  assert bool(fn({"a": jnp.full(3, 3e38, jnp.float32)})) is True
  # Leaves whose sums are finite but whose total is not; and in half precision.
  big = {"a": jnp.full(2, 3e38), "b": jnp.full(2, 3e38, jnp.bfloat16),
         "c": jnp.full(4096, 60000.0, jnp.float16),
         "d": jnp.full(4, 448.0, jnp.float8_e4m3fn)}
  assert bool(fn(big)) is True
  assert bool(fn(dict(big, a=jnp.array([3e38, jnp.nan])))) is False
  assert bool(fn(dict(big, d=jnp.array([448.0, jnp.nan], jnp.float8_e4m3fn)))) is False


def test_all_finite_float64_beyond_float32_range():
  with jax.enable_x64(True):
    for fn in (jmp_lite.all_finite, jax.jit(jmp_lite.all_finite)):
      assert bool(fn([jnp.full(3, 1e300, jnp.float64)])) is True
      assert bool(fn([jnp.array([1e300, jnp.nan], jnp.float64)])) is False
      assert bool(fn([jnp.array([-jnp.inf], jnp.float64), jnp.ones(2)])) is False


def test_max_abs_shortcut_misses_nan_on_this_backend_but_all_finite_does_not():
  x = np.ones(100_000, np.float32)
  x[12_345] = np.nan
  x = jnp.asarray(x)
  shortcut = jax.jit(lambda x: jnp.max(jnp.abs(x)) < jnp.inf)(x)
  assert bool(jmp_lite.all_finite(x)) is False
  assert bool(jax.jit(jmp_lite.all_finite)({"g": x})) is False
  if jax.default_backend() != "cpu" or not bool(shortcut):
    pytest.skip(f"max(abs(x)) < inf returned {bool(shortcut)} for a NaN on "
                f"{jax.default_backend()}: the shortcut's flaw does not show here")
  assert bool(shortcut) is True  # The flaw all_finite avoids.


def test_all_finite_under_vmap():
  batch = jnp.array([[1.0, 2.0], [1.0, jnp.nan], [jnp.inf, 0.0], [3e38, 3e38]])
  for fn in (jax.vmap(jmp_lite.all_finite), jax.jit(jax.vmap(jmp_lite.all_finite))):
    result = fn({"x": batch, "i": jnp.zeros((4, 2), jnp.int32)})
    assert result.dtype == np.bool_
    np.testing.assert_array_equal(result, [True, False, False, True])


def test_all_finite_axis_name_under_shard_map_and_pmap():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
  spec = jax.sharding.PartitionSpec
  sharded = jax.jit(jax.shard_map(
      lambda x: jmp_lite.all_finite({"x": x}, axis_name="d"),
      mesh=mesh, in_specs=spec("d"), out_specs=spec()))
  assert bool(sharded(jnp.array([1.0, 2.0]))) is True
  assert bool(sharded(jnp.array([1.0, jnp.nan]))) is False
  assert "psum" in str(jax.make_jaxpr(sharded)(jnp.ones(2)))
  pmapped = jax.pmap(lambda x: jmp_lite.all_finite(x, axis_name="i"), axis_name="i")
  np.testing.assert_array_equal(pmapped(jnp.array([[1.0, jnp.inf]])), [False])
  np.testing.assert_array_equal(pmapped(jnp.array([[1.0, 2.0]])), [True])


def _eqns(jaxpr, recursive):
  for eqn in jaxpr.eqns:
    yield eqn
    if recursive:
      for param in eqn.params.values():
        for sub in (param if isinstance(param, (tuple, list)) else [param]):
          sub = getattr(sub, "jaxpr", sub)
          if hasattr(sub, "eqns"):
            yield from _eqns(sub, recursive)


def test_all_finite_is_a_handful_of_reductions():
  tree = {"a": jnp.ones((64, 32)), "b": jnp.ones(7, jnp.bfloat16),
          "c": jnp.ones((3, 3, 3), jnp.float16), "i": jnp.ones(5, jnp.int32),
          "d": jnp.ones((64, 32), jnp.float16), "e": jnp.ones(7)}
  distinct_shapes = 3  # (64, 32), (7,), (3, 3, 3)
  closed = jax.make_jaxpr(jmp_lite.all_finite)(tree)
  everything = [e.primitive.name for e in _eqns(closed.jaxpr, recursive=True)]
  # One exact pass, no branch: one sum per distinct shape of the floating
  # leaves (same-shape leaves are added element by element first).
  assert "cond" not in everything
  assert everything.count("reduce_sum") == distinct_shapes
  for name in ("reduce_max", "reduce_min", "reduce_and", "reduce_or", "argmax"):
    assert name not in everything
  # isfinite runs on one scalar only, never elementwise over the gradients.
  finite_checks = [e for e in _eqns(closed.jaxpr, recursive=True)
                   if e.primitive.name == "is_finite"]
  assert len(finite_checks) == 1 and finite_checks[0].invars[0].aval.shape == ()
  # The integer leaf is never read.
  (index,) = [i for i, x in enumerate(jax.tree.leaves(tree)) if x is tree["i"]]
  int_var = closed.jaxpr.invars[index]
  assert all(int_var not in e.invars for e in _eqns(closed.jaxpr, recursive=False))


# select_tree.


@JIT
def test_select_tree_as_jmp(jit):
  a = {"a": jnp.ones([]), "b": jnp.zeros([2], jnp.bfloat16), "c": (jnp.int32(3),)}
  b = {"a": jnp.zeros([]), "b": jnp.ones([2], jnp.bfloat16), "c": (jnp.int32(4),)}
  fn = maybe_jit(jmp_lite.select_tree, jit)
  for pred, want in ((True, a), (False, b)):
    for flag in (jnp.bool_(pred), np.bool_(pred)):
      got = fn(flag, a, b)
      theirs = jmp.select_tree(jnp.bool_(pred), a, b)
      chex.assert_trees_all_equal_dtypes(got, want, theirs)
      chex.assert_trees_all_equal(got, want, theirs)
  assert jmp_lite.select_tree(jnp.bool_(True), None, None) is None
  assert jmp_lite.select_tree(jnp.bool_(False), None, None) is None


@pytest.mark.parametrize("pred", [
    jnp.ones([1]), jnp.ones([1], bool), jnp.ones((2, 2), bool), jnp.float32(1.0),
    jnp.int32(1), np.array([True]), 1.0], ids=lambda p: repr(p)[:24])
def test_select_tree_rejects_non_boolean_scalars_like_jmp(pred):
  with pytest.raises(ValueError, match="expected boolean scalar") as info:
    jmp_lite.select_tree(pred, None, None)
  assert isinstance(info.value, AssertionError)
  if hasattr(pred, "ndim"):
    with pytest.raises(AssertionError, match="expected boolean scalar"):
      jmp.select_tree(pred, None, None)


@pytest.mark.parametrize("a, b, match", [
    ({"a": {"x": jnp.ones(2)}}, {"a": {"y": jnp.ones(2)}},
     r"differ in structure at leaf \['a'\]\['x'\] in a, \['a'\]\['y'\] in b"),
    ({"a": [jnp.ones(2), jnp.ones(2)]}, {"a": [jnp.ones(2)]},
     r"differ in structure at leaf \['a'\]\[1\] in a, \(nothing\) in b"),
    ({"a": None}, {"a": jnp.ones(2)},
     r"differ in structure at leaf \(nothing\) in a, \['a'\] in b"),
    ((jnp.ones(2),), [jnp.ones(2)], r"differ in structure"),
    ({"a": {"x": jnp.ones(2)}}, {"a": {"x": jnp.ones(3)}},
     r"leaf \['a'\]\['x'\] is float32\[2\] in a but float32\[3\] in b"),
    ({"a": [jnp.ones(2)]}, {"a": [jnp.ones(2, jnp.bfloat16)]},
     r"leaf \['a'\]\[0\] is float32\[2\] in a but bfloat16\[2\] in b"),
    ({"s": jnp.ones((), jnp.int32)}, {"s": jnp.ones((), jnp.float32)},
     r"leaf \['s'\] is int32\[\] in a but float32\[\] in b"),
], ids=["key", "length", "none", "node_type", "shape", "dtype", "int_vs_float"])
def test_select_tree_mismatch_is_a_value_error_naming_the_path(a, b, match):
  with pytest.raises(ValueError, match=match):
    jmp_lite.select_tree(jnp.bool_(True), a, b)
  with pytest.raises(ValueError, match=match):
    jax.jit(jmp_lite.select_tree)(jnp.bool_(False), a, b)


def test_select_tree_on_loss_scales():
  # The intended use: keep the old state on a non-finite step.
  old, new = unusual_dynamic(), unusual_dynamic().adjust(jnp.bool_(True))
  kept = jax.jit(jmp_lite.select_tree)(jnp.bool_(False), new, old)
  assert field_values(kept) == field_values(old)
  assert int(jmp_lite.select_tree(jnp.bool_(True), new, old).counter) == 4


def test_no_warnings_for_float_construction():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jmp_lite.DynamicLossScale(2.0 ** 15)
    jmp_lite.DynamicLossScale(jnp.float32(2.0), min_loss_scale=jnp.float32(1.0))
    jmp_lite.StaticLossScale(2)


def test_select_tree_keeps_a_model_s_own_non_array_leaves():
  """An Equinox model holds its activation functions as leaves: selecting
  between a model and its update failed inside ``eval_shape`` without
  naming the leaf. The same object in both trees is kept."""
  new = {"act": jax.nn.relu, "w": jnp.ones(2), "name": "mlp"}
  old = {"act": jax.nn.relu, "w": jnp.zeros(2), "name": "mlp"}
  out = jax.jit(lambda pred: jmp_lite.select_tree(pred, new, old)["w"])(jnp.bool_(False))
  np.testing.assert_array_equal(out, old["w"])
  assert jmp_lite.select_tree(jnp.bool_(True), new, old)["act"] is jax.nn.relu


def test_select_tree_keeps_a_python_number_both_trees_hold():
  """An Equinox model's ``n: int`` field and its Dropout's ``p``/``inference``
  came back as arrays (tracers under ``eqx.filter_jit``, where ``range(n)``
  then failed). Numbers that differ, or that are not the same bits (-0.0 and
  0.0), are selected as arrays, as jmp selects every leaf."""
  new = {"n": 2, "p": 0.5, "inference": False, "w": jnp.ones(2), "z": 0.0, "k": 3}
  old = {"n": 2, "p": 0.5, "inference": False, "w": jnp.zeros(2), "z": -0.0, "k": 4}

  @jax.jit
  def select(pred):
    out = jmp_lite.select_tree(pred, new, old)
    assert [type(out[k]) for k in ("n", "p", "inference")] == [int, float, bool]
    return out["w"] * out["n"], out["z"], out["k"]

  w, z, k = select(jnp.bool_(False))
  np.testing.assert_array_equal(w, [0.0, 0.0])
  assert np.signbit(z) and int(k) == 4


def test_a_tree_given_as_the_finiteness_flag_is_named_not_printed():
  grads = {"w": jnp.ones((64, 64)), "b": jnp.ones(64)}
  with pytest.raises(ValueError, match=r"got dict of 2 leaves\. Reduce it first") as e:
    jmp_lite.DynamicLossScale(2.0 ** 15).adjust(grads)
  assert len(str(e.value)) < 300 and "Array(" not in str(e.value)


def test_jmps_own_loss_scale_is_refused_with_its_name():
  import optax  # pylint: disable=g-import-not-at-top
  import jmp_lite.optax  # pylint: disable=g-import-not-at-top
  foreign = jmp.DynamicLossScale(jnp.float32(2.0 ** 15))
  for make in (lambda: jmp_lite.optax.with_loss_scale(optax.sgd(0.1), foreign),
               lambda: jmp_lite.value_and_grad(lambda w: jnp.sum(w))(
                   jnp.ones(3), loss_scale=foreign)):
    with pytest.raises(TypeError, match=r"That is jmp's DynamicLossScale: use jmp_lite's"):
      make()
