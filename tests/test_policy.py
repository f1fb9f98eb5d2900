"""Tests of jmp_lite.policy: Policy, casting, get_policy's grammar and presets."""

import contextlib
import dataclasses
import os
import re
import subprocess
import sys
from typing import NamedTuple

import chex
import flax.core
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
E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)

# The dtypes the issue names for dtype-parameterised tests; float64 needs x64.
DTYPES = pytest.mark.parametrize(
    "dtype", [F32, BF16, F16, F64], ids=["f32", "bf16", "f16", "f64"])
CASTS = pytest.mark.parametrize(
    "method", ["cast_to_param", "cast_to_compute", "cast_to_output", "cast_to_reduce"])
JIT = pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])
FIELDS = ("param_dtype", "compute_dtype", "output_dtype", "reduce_dtype",
          "autocast_dtype")


def x64_if_needed(dtype):
  """float64 arrays exist only under x64; keep the switch local to one test."""
  return jax.enable_x64(True) if np.dtype(dtype) == F64 else contextlib.nullcontext()


def uniform_policy(dtype):
  return jmp_lite.Policy(dtype, dtype, dtype, reduce_dtype=dtype)


class Pair(NamedTuple):
  first: object
  second: object


def mixed_tree():
  """A tree with every kind of leaf casting must handle, made under the caller's x64 mode."""
  return {
      "jax": jnp.arange(3, dtype=jnp.float32),
      "jax_bf16": jnp.ones((2, 2), jnp.bfloat16),
      "numpy": np.array([0.0, 0.5, -1.0, 2.0], np.float32),
      "numpy_f16": np.ones(2, np.float16),
      "py_float": 1.5,
      "np_scalar": np.float32(2.5),
      "int": jnp.arange(3, dtype=jnp.int32),
      "np_int": np.arange(2, dtype=np.int64),
      "py_int": 7,
      "bool": jnp.array([True, False]),
      "key": jax.random.key(0),
      "legacy_key": jax.random.PRNGKey(0),
      "fp8": jnp.ones(3, jnp.float8_e4m3fn),
      "fp8_e5m2": jnp.ones(3, jnp.float8_e5m2),
      "none": None,
      "named": Pair(jnp.ones(2, jnp.float16), None),
      "variables": {"params": {"Dense_0": {"kernel": jnp.ones((2, 3)),
                                           "bias": jnp.zeros(3)}},
                    "batch_stats": {"BatchNorm_0": {"mean": np.zeros(3, np.float32)}}},
      "frozen": flax.core.freeze({"params": {"w": jnp.ones(2, jnp.bfloat16)}}),
  }


FLOATING = ("jax", "jax_bf16", "numpy", "numpy_f16")
UNTOUCHED = ("py_float", "np_scalar", "int", "np_int", "py_int", "bool", "key",
             "legacy_key", "fp8", "fp8_e5m2")


def assert_cast(tree, out, dtype):
  """Checks `out` is `tree` with exactly the floating array leaves cast to `dtype`."""
  assert jax.tree.structure(out) == jax.tree.structure(tree)
  for name in FLOATING:
    assert out[name].dtype == dtype, name
    assert type(out[name]) is type(tree[name]), name  # NumPy stays NumPy.
    np.testing.assert_array_equal(np.asarray(out[name], np.float32),
                                  np.asarray(tree[name], np.float32))
  for name in UNTOUCHED:
    assert out[name] is tree[name], name
  assert out["none"] is None
  assert type(out["named"]) is Pair and out["named"].second is None
  assert out["named"].first.dtype == dtype
  variables = out["variables"]
  assert variables["params"]["Dense_0"]["kernel"].dtype == dtype
  assert variables["params"]["Dense_0"]["bias"].dtype == dtype
  mean = variables["batch_stats"]["BatchNorm_0"]["mean"]
  assert isinstance(mean, np.ndarray) and mean.dtype == dtype
  assert isinstance(out["frozen"], flax.core.FrozenDict)
  assert out["frozen"]["params"]["w"].dtype == dtype


# Construction, validation, equality, hashing.


NOT_FLOATING = {"jnp.int32": jnp.int32, "int8": "int8", "np.bool_": np.bool_,
                "bool": bool, "complex64": jnp.complex64, "banana": "banana",
                "object": object(), "None": None, "3": 3, "comma": ","}


@pytest.mark.parametrize("field, bad", [
    pytest.param(field, bad, id=f"{field}-{name}")
    for field in FIELDS for name, bad in NOT_FLOATING.items()
    if not (field == "autocast_dtype" and bad is None)])  # None: no autocast.
def test_policy_rejects_non_floating_dtypes_naming_field_and_value(field, bad):
  kwargs = dict(param_dtype=F32, compute_dtype=F32, output_dtype=F32)
  kwargs[field] = bad
  with pytest.raises(ValueError, match=re.escape(f"Policy.{field}")) as info:
    jmp_lite.Policy(**kwargs)
  assert repr(bad) in str(info.value)


@pytest.mark.parametrize("bad", [jnp.int32, "banana", None])
def test_with_methods_validate(bad):
  policy = jmp_lite.get_policy("p=f32,c=bf16,o=f32")
  for method in ("with_param_dtype", "with_compute_dtype", "with_output_dtype",
                 "with_reduce_dtype"):
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
      getattr(policy, method)(bad)


def test_policy_is_frozen():
  policy = jmp_lite.Policy(F32, BF16, F32)
  with pytest.raises(dataclasses.FrozenInstanceError):
    policy.compute_dtype = F16  # pytype: disable=not-writable


SPELLINGS = [
    (np.float32, jnp.bfloat16, np.float16),
    (jnp.float32, "bfloat16", "float16"),
    ("float32", np.dtype(jnp.bfloat16), jnp.dtype("float16")),
    (np.dtype("float32"), BF16, "f2"),
    (">f4", jnp.bfloat16, "<f2"),  # JAX is native-endian; byte order is ignored.
]


@pytest.mark.parametrize("spelling", SPELLINGS, ids=range(len(SPELLINGS)))
def test_policy_equality_and_hash_across_dtype_spellings(spelling):
  reference = jmp_lite.Policy(F32, BF16, F16)
  policy = jmp_lite.Policy(*spelling)
  assert policy == reference
  assert hash(policy) == hash(reference)
  assert str(policy) == "p=f32,c=bf16,o=f16"
  assert policy == jmp_lite.get_policy("p=f32,c=bf16,o=f16")
  # Fields are NumPy dtypes, which compare equal to every spelling (as jmp's do).
  assert all(isinstance(getattr(policy, f), np.dtype) for f in FIELDS[:4])
  assert policy.param_dtype == np.float32 and policy.param_dtype == jnp.float32
  assert policy.compute_dtype == jnp.bfloat16 and policy.output_dtype == "float16"
  assert policy.reduce_dtype == F32 and policy.autocast_dtype is None
  assert jmp_lite.Policy(F32, BF16, F16, reduce_dtype=F16) != reference
  assert jmp_lite.Policy(F32, BF16, F16, autocast_dtype=BF16) != reference


def test_policy_as_static_jit_argument_compiles_once_per_policy():
  def apply(x, policy):
    return policy.cast_to_output(policy.cast_to_compute(x) * 2)

  apply = jax.jit(apply, static_argnums=1)
  x = jnp.ones(3)
  with count_compilations() as compiled:
    for spelling in SPELLINGS:
      out = apply(x, jmp_lite.Policy(*spelling))
      assert out.dtype == F16
      np.testing.assert_array_equal(np.asarray(out, np.float32), 2 * np.ones(3))
  assert len(compiled) == 1
  with count_compilations() as compiled:
    assert apply(x, jmp_lite.Policy(F32, BF16, BF16)).dtype == BF16
  assert len(compiled) == 1  # another policy: one more compilation


@pytest.mark.parametrize(
    "method, field",
    [("with_param_dtype", "param_dtype"), ("with_compute_dtype", "compute_dtype"),
     ("with_output_dtype", "output_dtype"), ("with_reduce_dtype", "reduce_dtype"),
     ("with_autocast_dtype", "autocast_dtype")])
@pytest.mark.parametrize("dtype", [BF16, "float16", jnp.float64])
def test_with_methods_replace_one_field(method, field, dtype):
  policy = jmp_lite.Policy(F32, F32, F32)
  new = getattr(policy, method)(dtype)
  assert getattr(new, field) == np.dtype(dtype)
  assert isinstance(getattr(new, field), np.dtype)
  for other in FIELDS:
    if other != field:
      assert getattr(new, other) == getattr(policy, other)
  assert policy == jmp_lite.Policy(F32, F32, F32)  # Unchanged.
  if field == "autocast_dtype":
    assert new.with_autocast_dtype(None).autocast_dtype is None


# Casting.


@DTYPES
@CASTS
def test_cast_touches_floating_arrays_only(dtype, method):
  with x64_if_needed(dtype):
    tree = mixed_tree()
    out = getattr(uniform_policy(dtype), method)(tree)
    assert_cast(tree, out, dtype)


@DTYPES
@CASTS
def test_cast_under_jit_casts_tracers(dtype, method):
  with x64_if_needed(dtype):
    tree = mixed_tree()
    # Not arrays outside jit (and jit makes int64 int32 whatever the policy).
    for name in ("py_float", "np_scalar", "py_int", "np_int"):
      del tree[name]
    policy = uniform_policy(dtype)
    seen = []

    def cast(tree):
      seen.extend(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))
      return getattr(policy, method)(tree)

    out = jax.jit(cast)(tree)
    assert seen and all(seen)
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    expected = getattr(policy, method)(tree)
    chex.assert_trees_all_equal_dtypes(out, expected)
    for name in FLOATING + ("named",):
      assert jax.tree.leaves(out[name])[0].dtype == dtype
    for name in ("int", "bool", "legacy_key", "fp8", "fp8_e5m2"):
      assert out[name].dtype == tree[name].dtype
      np.testing.assert_array_equal(np.asarray(out[name]), np.asarray(tree[name]))
    assert jax.dtypes.issubdtype(out["key"].dtype, jax.dtypes.prng_key)
    # Shapes and dtypes without computing anything.
    shapes = jax.eval_shape(getattr(policy, method), tree)
    chex.assert_trees_all_equal_dtypes(shapes, expected)


def test_cast_inside_jit_matches_jmp_for_scalars():
  # Python floats and NumPy scalars become float32 tracers under jit: both
  # libraries cast them there, and leave them alone outside jit.
  policy = jmp_lite.Policy(F32, BF16, F32)
  jmp_policy = jmp.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
  tree = {"f": 1.5, "s": np.float32(2.0)}
  assert policy.cast_to_compute(tree)["f"] is tree["f"]
  assert jmp_policy.cast_to_compute(tree)["f"] is tree["f"]
  assert policy.cast_to_compute(tree)["s"] is tree["s"]
  assert jmp_policy.cast_to_compute(tree)["s"] is tree["s"]
  ours = jax.jit(policy.cast_to_compute)(tree)
  theirs = jax.jit(jmp_policy.cast_to_compute)(tree)
  assert jax.tree.map(lambda x: x.dtype, ours) == {"f": BF16, "s": BF16}
  assert jax.tree.map(lambda x: x.dtype, theirs) == {"f": BF16, "s": BF16}


@pytest.mark.parametrize("target", [E4M3, E5M2], ids=["e4m3fn", "e5m2"])
def test_float8_leaves_cast_only_to_float8(target):
  tree = {"f32": jnp.ones(2), "bf16": jnp.ones(2, jnp.bfloat16),
          "e4m3": jnp.ones(2, jnp.float8_e4m3fn), "e5m2": jnp.ones(2, jnp.float8_e5m2),
          "np": np.ones(2, np.float32), "int": jnp.ones(2, jnp.int8)}
  out = jmp_lite.Policy(F32, target, F32).cast_to_compute(tree)
  assert {k: v.dtype for k, v in out.items()} == {
      "f32": target, "bf16": target, "e4m3": target, "e5m2": target,
      "np": target, "int": np.dtype(np.int8)}
  assert isinstance(out["np"], np.ndarray)
  # To a wide dtype: float8 leaves (quantised weights, scales) are left alone.
  for method in ("cast_to_param", "cast_to_output", "cast_to_reduce"):
    wide = getattr(jmp_lite.Policy(F32, target, F32), method)(tree)
    assert wide["bf16"].dtype == F32 and wide["np"].dtype == F32
    assert wide["e4m3"] is tree["e4m3"] and wide["e5m2"] is tree["e5m2"]
  assert jmp_lite.cast_to_full(tree)["e5m2"] is tree["e5m2"]
  assert jmp_lite.cast_to_half(tree)["e4m3"] is tree["e4m3"]


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
def test_cast_to_full_and_half_as_jmp(dtype):
  tree = {"x": jnp.ones(2, dtype), "i": jnp.ones(2, jnp.int16), "o": object(),
          "np": np.ones(2, dtype)}
  full, jmp_full = jmp_lite.cast_to_full(tree), jmp.cast_to_full(tree)
  half, jmp_half = jmp_lite.cast_to_half(tree), jmp.cast_to_half(tree)
  assert jmp_lite.half_dtype() == jmp.half_dtype()
  for ours, theirs in ((full, jmp_full), (half, jmp_half)):
    assert ours["o"] is tree["o"] and ours["i"] is tree["i"]
    assert ours["x"].dtype == theirs["x"].dtype
    assert ours["np"].dtype == theirs["np"].dtype
    assert type(ours["np"]) is type(theirs["np"])
  assert full["x"].dtype == F32
  assert half["x"].dtype == jmp_lite.half_dtype()


def test_half_dtypes():
  platform = jax.local_devices()[0].platform
  assert jmp_lite.half_dtype() == (BF16 if platform == "tpu" else F16)
  # The very object jmp returns, callable as in jmp's README.
  assert jmp_lite.half_dtype() is jmp.half_dtype()
  assert jmp_lite.half_dtype()(2 ** 15).dtype == jmp_lite.half_dtype()
  assert jmp_lite.parse_dtype("half") == jmp_lite.half_dtype()
  assert isinstance(jmp_lite.parse_dtype("half"), np.dtype)
  if platform in ("cpu", "tpu"):
    assert jmp_lite.preferred_half_dtype() == BF16


def test_dtype_to_names_accepts_any_spelling():
  names = jmp_lite.dtype_to_names
  assert names[np.float32] == names[jnp.float32] == names["float32"] == names[F32]
  assert names[jnp.bfloat16][0] == "bf16"
  assert names[np.float16][0] == "f16"
  with pytest.raises(KeyError):
    names[np.int32]  # pylint: disable=pointless-statement


# get_policy.


JMP_FORMS = [
    ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
    ("p=f32,c=bf16", (F32, BF16, BF16)),
    ("c=f16", (F32, F16, F16)),
    ("p=f16,c=f16", (F16, F16, F16)),
    ("p=f16,c=bf16", (F16, BF16, BF16)),
    ("c=bfloat16,o=full", (F32, BF16, F32)),
    ("p=full,c=half", (F32, None, None)),
    ("half", (None, None, None)),
    ("full", (F32, F32, F32)),
    ("float16", (F16, F16, F16)),
    ("bf16", (BF16, BF16, BF16)),
    ("f64", (F64, F64, F64)),
    ("o=f16", (F32, F32, F16)),
]


@pytest.mark.parametrize("name, dtypes", JMP_FORMS, ids=[n for n, _ in JMP_FORMS])
def test_get_policy_accepts_jmps_grammar_like_jmp(name, dtypes):
  half = jmp_lite.half_dtype()
  expected = tuple(half if d is None else d for d in dtypes)
  policy = jmp_lite.get_policy(name)
  assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == expected
  assert policy.reduce_dtype == F32 and policy.autocast_dtype is None
  theirs = jmp.get_policy(name)
  assert tuple(np.dtype(d) for d in (theirs.param_dtype, theirs.compute_dtype,
                                     theirs.output_dtype)) == expected


@pytest.mark.parametrize("name", [
    "  Params = Float32 , COMPUTE=BF16,output =F32 ",
    "P=F32,C=bf16,O=f32",
    "p=f32,\tc=BFloat16,\no=float32",
    "params=float32,compute=bfloat16,output=float32",
])
def test_get_policy_ignores_case_and_spaces(name):
  assert jmp_lite.get_policy(name) == jmp_lite.Policy(F32, BF16, F32)


def test_get_policy_reduce_and_autocast_keys():
  policy = jmp_lite.get_policy("p=f32,c=f32,reduce=bf16,autocast=f16")
  assert policy == jmp_lite.Policy(F32, F32, F32, reduce_dtype=BF16, autocast_dtype=F16)
  assert jmp_lite.get_policy("r=f16,a=bf16") == policy.with_reduce_dtype(F16).with_autocast_dtype(BF16)


def test_get_policy_returns_policies_unchanged():
  policy = jmp_lite.Policy(F32, BF16, F32)
  assert jmp_lite.get_policy(policy) is policy
  with pytest.raises(TypeError, match="3"):
    jmp_lite.get_policy(3)


@pytest.mark.parametrize("name, match", [
    ("p=f32,params=f16", r"Duplicate key 'params'"),
    ("c=f16,c=bf16", r"Duplicate key 'c'.*compute_dtype"),
    ("o=f32,output=f32", r"Duplicate key 'output'.*output_dtype"),
    ("p=f32,x=f16", r"Unknown key 'x'.*'params' \(p\), 'compute' \(c\), 'output' \(o\)"),
    ("param_dtype=f32", r"Unknown key 'param_dtype'.*'params' \(p\)"),
    ("compute_float16", r"Unknown dtype 'compute_float16'.*bf16.*f32"),
    ("p=f33", r"Unknown dtype 'f33'.*'bf16', 'bfloat16'"),
    ("c=int8", r"dtype 'int8' is int8, not a floating dtype"),
    ("p=f32,", r"Malformed token ''"),
    ("p=f32,c", r"Malformed token 'c'"),
    ("p==f32", r"Malformed token 'p==f32'"),
    ("=f32", r"Malformed token '=f32'"),
    ("", r"Unknown dtype ''"),
    (",", r"Unknown dtype ','"),
    ("O4", r"Unknown dtype 'o4'.*Presets: O0, O1, O2, O3, mixed_bfloat16, mixed_float16"),
])
def test_get_policy_rejects_mistakes_showing_the_token(name, match):
  with pytest.raises(ValueError, match=match):
    jmp_lite.get_policy(name)


def test_get_policy_almost_dtype_like_jmp():
  for module in (jmp, jmp_lite):
    with pytest.raises(ValueError, match="Unknown dtype"):
      module.get_policy("compute_float16")


def test_presets_map_as_documented():
  half = BF16
  expected = {
      "O0": jmp_lite.Policy(F32, F32, F32),
      "O1": jmp_lite.Policy(F32, F32, F32, autocast_dtype=half),
      "O2": jmp_lite.Policy(F32, half, F32),
      # Apex's O3 casts the model's outputs to float32 (apex/amp/_initialize.py,
      # output_caster), as MindSpore's _OutputTo32 does for O2 and O3.
      "O3": jmp_lite.Policy(half, half, F32),
      "mixed_bfloat16": jmp_lite.Policy(F32, BF16, BF16),
      "mixed_float16": jmp_lite.Policy(F32, F16, F16),
  }
  for name, policy in expected.items():
    for spelling in (name, name.lower(), name.upper(), f" {name} "):
      assert jmp_lite.get_policy(spelling) == policy, spelling
    assert jmp_lite.get_policy(str(policy)) == policy
  assert jmp_lite.get_policy("O1").autocast_dtype == half
  for level in ("O1", "O2", "O3"):
    assert jmp_lite.get_policy(f"{level}-bf16") == jmp_lite.get_policy(level)
  assert jmp_lite.get_policy("o2-F16") == jmp_lite.Policy(F32, F16, F32)
  assert jmp_lite.get_policy("O3-f16") == jmp_lite.Policy(F16, F16, F32)
  assert jmp_lite.get_policy("O1-f16").autocast_dtype == F16
  with pytest.raises(ValueError, match="o2-f8"):
    jmp_lite.get_policy("O2-f8")


def test_parsing_a_preset_initialises_no_backend():
  """A policy parsed at import time must not break a later
  `jax.distributed.initialize()`: in a fresh process, parsing every preset
  leaves JAX's backends uninitialised."""
  # A platform that does not exist: initialising any backend raises.
  code = (
      "import jax, jmp_lite, jmp_lite.policy\n"
      "for name in jmp_lite.policy.PRESETS + ('O2-f16', 'O1-bf16'):\n"
      "  jmp_lite.get_policy(name)\n"
      "try:\n"
      "  jax.devices()\n"
      "except RuntimeError:\n"
      "  print('ok')\n")
  env = dict(os.environ, JAX_PLATFORMS="no_such_platform")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=120, env=env)
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
  # The docstring's table says the same.
  doc = jmp_lite.get_policy.__doc__
  for row in ("``O0``              ``p=f32,c=f32,o=f32``",
              "``O1``              ``p=f32,c=f32,o=f32,a=half``",
              "``O2``              ``p=f32,c=half,o=f32``",
              "``O3``              ``p=half,c=half,o=f32``",
              "``mixed_bfloat16``  ``p=f32,c=bf16,o=bf16``",
              "``mixed_float16``   ``p=f32,c=f16,o=f16``"):
    assert row in doc


# str(policy) round trip.


ROUND_TRIP_DTYPES = [F32, BF16, F16, F64, E4M3, E5M2, np.dtype(jnp.float8_e4m3fnuz),
                     np.dtype(jnp.float8_e5m2fnuz), np.dtype(jnp.float8_e4m3b11fnuz),
                     np.dtype(jnp.float4_e2m1fn)]


@hypothesis.settings(max_examples=60, deadline=None, database=None)
@hypothesis.given(
    param=st.sampled_from(ROUND_TRIP_DTYPES),
    compute=st.sampled_from(ROUND_TRIP_DTYPES),
    output=st.sampled_from(ROUND_TRIP_DTYPES),
    reduce=st.sampled_from(ROUND_TRIP_DTYPES),
    autocast=st.one_of(st.none(), st.sampled_from(ROUND_TRIP_DTYPES)),
)
def test_str_round_trips_through_get_policy(param, compute, output, reduce, autocast):
  policy = jmp_lite.Policy(param, compute, output, reduce_dtype=reduce,
                           autocast_dtype=autocast)
  text = str(policy)
  parsed = jmp_lite.get_policy(text)
  assert parsed == policy, text
  assert str(parsed) == text
  assert jmp_lite.get_policy(text.upper().replace(",", " , ")) == policy


@pytest.mark.parametrize("name", ["O0", "O1", "O2", "O3", "mixed_bfloat16",
                                  "mixed_float16", "half", "full", "c=f16",
                                  "p=bf16,c=f16,o=f64,r=bf16,a=f16"])
def test_str_round_trips_for_presets_and_grammar(name):
  policy = jmp_lite.get_policy(name)
  assert jmp_lite.get_policy(str(policy)) == policy


def test_str_matches_jmp_format():
  # jmp prints "p=...,c=...,o=..." with the first name in its dtype table.
  policy = jmp_lite.Policy(F32, BF16, F16)
  assert str(policy) == "p=f32,c=bf16,o=f16"
  assert str(policy.with_reduce_dtype(BF16)) == "p=f32,c=bf16,o=f16,r=bf16"
  assert str(policy.with_autocast_dtype(F16)) == "p=f32,c=bf16,o=f16,a=f16"
  for dtype in (F32, BF16, F16):
    pieces = str(jmp_lite.Policy(dtype, dtype, dtype)).split(",")
    assert pieces == [f"{k}={jmp_lite.dtype_to_names[dtype][0]}" for k in "pco"]


def test_policy_string_mistakes_say_what_to_write():
  """A newcomer's spellings: a preset misremembered, semicolons for commas."""
  with pytest.raises(ValueError, match=r"Unknown dtype 'mixed_bf16': expected 'full', "
                     r"'half' or one of .* Did you mean 'mixed_bfloat16'\?"):
    jmp_lite.get_policy("mixed_bf16")
  with pytest.raises(ValueError, match=r"separated by commas \('p=f32,c=bf16,o=f32'\)"):
    jmp_lite.get_policy("p=f32;c=bf16;o=f32")
  with pytest.raises(ValueError, match=r"expected key=dtype\.$"):
    jmp_lite.get_policy("p=f32,c")
