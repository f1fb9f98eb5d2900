"""Bad input to every public entry point: a ValueError or TypeError that shows the value.

One case per mistake: the call, the exception type it must raise, and the
fragments its message must contain (the offending value, and for trees the
path of the offending leaf).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite
from jmp_lite import distributed
from jmp_lite import optax as jo
from jmp_lite import testing


def _vg(fun, *args, **kwargs):
  """Calls jmp_lite.value_and_grad(fun, ...) on args."""
  def call():
    return jmp_lite.value_and_grad(fun, **kwargs)(*args)
  return call


def _vg_scale(loss_scale):
  def call():
    return jmp_lite.value_and_grad(lambda w: jnp.sum(w))(jnp.ones(2), loss_scale=loss_scale)
  return call


def _train_state(**kwargs):
  def call():
    args = {"apply_fn": None, "params": {"w": jnp.ones(2)}, "tx": optax.sgd(0.1), **kwargs}
    return jmp_lite.TrainState.create(**args)
  return call


def _minimize(loss_fn):
  def call():
    state = jmp_lite.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)},
                                       tx=optax.sgd(0.1))
    return state.minimize(loss_fn)
  return call


def _update_with(grads):
  def call():
    params = {"w": jnp.ones(2), "b": jnp.ones(3)}
    tx = jo.with_loss_scale(optax.sgd(0.1), jmp_lite.StaticLossScale(2.0))
    return tx.update(grads, tx.init(params), params)
  return call


def _in_shard_map(f):
  def call():
    mesh = jax.make_mesh((1,), ("data",))
    return jax.shard_map(f, mesh=mesh, in_specs=(), out_specs=jax.P())()
  return call


ls = jmp_lite.DynamicLossScale
CASES = [
    # ---------------------------------------------------------- policies
    ("get_policy unknown dtype", lambda: jmp_lite.get_policy("banana"),
     ValueError, ["'banana'"]),
    ("get_policy integer dtype", lambda: jmp_lite.get_policy("p=int32,c=bf16"),
     ValueError, ["'int32'"]),
    ("get_policy bool dtype", lambda: jmp_lite.get_policy("bool"), ValueError, ["'bool'"]),
    ("get_policy unknown key", lambda: jmp_lite.get_policy("p=f32,x=bf16"),
     ValueError, ["'x'", "p=f32,x=bf16"]),
    ("get_policy duplicate key", lambda: jmp_lite.get_policy("c=bf16,compute=f16"),
     ValueError, ["'compute'", "compute_dtype is given twice"]),
    ("get_policy malformed token", lambda: jmp_lite.get_policy("p=f32,c"),
     ValueError, ["'c'"]),
    ("get_policy empty value", lambda: jmp_lite.get_policy("p=f32,c="),
     ValueError, ["'c='"]),
    ("get_policy not a string", lambda: jmp_lite.get_policy(42), TypeError, ["42"]),
    ("get_policy dtype object", lambda: jmp_lite.get_policy(jnp.float32),
     TypeError, ["float32"]),
    ("parse_dtype integer", lambda: jmp_lite.parse_dtype("int8"), ValueError,
     ["'int8'", "not a floating dtype"]),
    ("Policy integer param dtype", lambda: jmp_lite.Policy(jnp.int32, jnp.float32, jnp.float32),
     ValueError, ["param_dtype", "int32"]),
    ("Policy bool compute dtype", lambda: jmp_lite.Policy(jnp.float32, bool, jnp.float32),
     ValueError, ["compute_dtype", "bool"]),
    ("Policy unknown dtype", lambda: jmp_lite.Policy("banana", jnp.float32, jnp.float32),
     ValueError, ["param_dtype", "'banana'"]),
    ("Policy None dtype", lambda: jmp_lite.Policy(jnp.float32, None, jnp.float32),
     ValueError, ["compute_dtype", "None"]),
    ("Policy integer reduce dtype",
     lambda: jmp_lite.get_policy("bf16").with_reduce_dtype(jnp.int8),
     ValueError, ["reduce_dtype", "int8"]),
    ("Policy complex output dtype",
     lambda: jmp_lite.get_policy("f32").with_output_dtype(jnp.complex64),
     ValueError, ["output_dtype", "complex64"]),
    # -------------------------------------------------------- loss scales
    ("StaticLossScale zero", lambda: jmp_lite.StaticLossScale(0.0), ValueError, ["0.0"]),
    ("StaticLossScale negative", lambda: jmp_lite.StaticLossScale(-2.0), ValueError, ["-2.0"]),
    ("StaticLossScale inf", lambda: jmp_lite.StaticLossScale(float("inf")),
     ValueError, ["inf"]),
    ("StaticLossScale nan", lambda: jmp_lite.StaticLossScale(jnp.float32(jnp.nan)),
     ValueError, ["nan"]),
    ("StaticLossScale beyond float32", lambda: jmp_lite.StaticLossScale(1e39),
     ValueError, ["1e+39"]),
    ("StaticLossScale non-scalar", lambda: jmp_lite.StaticLossScale(jnp.ones(2)),
     ValueError, ["shape (2,)"]),
    ("DynamicLossScale zero", lambda: ls(jnp.float32(0.0)), ValueError, ["0.0"]),
    ("DynamicLossScale negative", lambda: ls(jnp.float32(-1.0)), ValueError, ["-1.0"]),
    ("DynamicLossScale inf", lambda: ls(jnp.float32(jnp.inf)), ValueError, ["inf"]),
    ("DynamicLossScale nan", lambda: ls(jnp.float32(jnp.nan)), ValueError, ["nan"]),
    ("DynamicLossScale non-scalar", lambda: ls(jnp.ones(3)), ValueError, ["shape (3,)"]),
    ("DynamicLossScale period 0", lambda: ls(jnp.float32(2.0), period=0),
     ValueError, ["period", "0"]),
    ("DynamicLossScale fractional period", lambda: ls(jnp.float32(2.0), period=2.5),
     ValueError, ["period", "2.5"]),
    ("DynamicLossScale factor 1", lambda: ls(jnp.float32(2.0), factor=1),
     ValueError, ["factor", "1"]),
    ("DynamicLossScale factor inf", lambda: ls(jnp.float32(2.0), factor=float("inf")),
     ValueError, ["factor", "inf"]),
    ("DynamicLossScale negative min", lambda: ls(jnp.float32(2.0), min_loss_scale=-1.0),
     ValueError, ["min_loss_scale", "-1.0"]),
    ("DynamicLossScale min above max",
     lambda: ls(jnp.float32(2.0), min_loss_scale=8.0, max_loss_scale=4.0),
     ValueError, ["8.0", "4.0"]),
    ("DynamicLossScale max zero", lambda: ls(jnp.float32(2.0), max_loss_scale=0.0),
     ValueError, ["max_loss_scale", "0.0"]),
    ("DynamicLossScale hysteresis 0", lambda: ls(jnp.float32(2.0), hysteresis=0),
     ValueError, ["hysteresis", "0"]),
    ("DynamicLossScale negative counter", lambda: ls(jnp.float32(2.0), counter=-3),
     ValueError, ["counter", "-3"]),
    ("DynamicLossScale huge period", lambda: ls(jnp.float32(2.0), period=2 ** 40),
     ValueError, ["period", str(2 ** 40)]),
    # --------------------------------------------------------------- flags
    ("adjust non-scalar flag", lambda: ls(jnp.float32(2.0)).adjust(jnp.ones(2, bool)),
     ValueError, ["shape=(2,)"]),
    ("adjust float flag", lambda: ls(jnp.float32(2.0)).adjust(jnp.float32(1.0)),
     ValueError, ["dtype=float32"]),
    ("adjust int flag", lambda: jmp_lite.StaticLossScale(2.0).adjust(1),
     ValueError, ["int", "1"]),
    ("NoOp adjust non-scalar flag", lambda: jmp_lite.NoOpLossScale().adjust(jnp.ones(3, bool)),
     ValueError, ["shape=(3,)"]),
    ("select_tree non-scalar pred",
     lambda: jmp_lite.select_tree(jnp.ones(2, bool), {"a": 1.0}, {"a": 2.0}),
     ValueError, ["shape=(2,)"]),
    ("select_tree float pred",
     lambda: jmp_lite.select_tree(jnp.float32(1), {"a": 1.0}, {"a": 2.0}),
     ValueError, ["dtype=float32"]),
    # --------------------------------------------------------- select_tree
    ("select_tree different keys",
     lambda: jmp_lite.select_tree(jnp.bool_(True), {"a": jnp.ones(2)}, {"b": jnp.ones(2)}),
     ValueError, ["['a']", "['b']"]),
    ("select_tree missing leaf",
     lambda: jmp_lite.select_tree(jnp.bool_(True), {"a": 1.0, "b": 2.0}, {"a": 1.0}),
     ValueError, ["['b']"]),
    ("select_tree leaf shape",
     lambda: jmp_lite.select_tree(jnp.bool_(True), {"x": {"w": jnp.ones(2)}},
                                  {"x": {"w": jnp.ones(3)}}),
     ValueError, ["['x']['w']", "[2]", "[3]"]),
    ("select_tree leaf dtype",
     lambda: jmp_lite.select_tree(jnp.bool_(True), [jnp.ones(2), jnp.ones(2)],
                                  [jnp.ones(2), jnp.ones(2, jnp.bfloat16)]),
     ValueError, ["[1]", "float32", "bfloat16"]),
    # ------------------------------------------------------ value_and_grad
    ("value_and_grad non-scalar loss", _vg(lambda w: w * 2, jnp.ones(3)),
     TypeError, ["shape=(3,)"]),
    ("value_and_grad integer loss", _vg(lambda w: jnp.int32(1), jnp.ones(3)),
     TypeError, ["dtype=int32"]),
    ("value_and_grad has_aux without aux", _vg(lambda w: jnp.sum(w), jnp.ones(3), has_aux=True),
     TypeError, ["(loss, aux)"]),
    ("value_and_grad bad policy", _vg(lambda w: jnp.sum(w), jnp.ones(3), policy="banana"),
     ValueError, ["'banana'"]),
    ("value_and_grad float loss_scale", _vg_scale(1024.0), TypeError, ["1024.0"]),
    ("value_and_grad axis_name int", _vg(lambda w: jnp.sum(w), jnp.ones(2), axis_name=3),
        TypeError, ["axis_name", "3"]),
    ("all_finite axis_name list of ints",
        lambda: jmp_lite.all_finite({"w": jnp.ones(2)}, axis_name=[0, 1]),
        TypeError, ["axis_name", "[0, 1]"]),
    ("TrainState.minimize non-scalar loss", _minimize(lambda p: p["w"]),
     TypeError, ["shape=(2,)"]),
    # ----------------------------------------------------- with_loss_scale
    ("with_loss_scale float loss_scale",
     lambda: jo.with_loss_scale(optax.sgd(0.1), 2.0 ** 15), TypeError, ["32768.0"]),
    ("with_loss_scale jmp-like object",
     lambda: jo.with_loss_scale(optax.sgd(0.1), "dynamic"), TypeError, ["'dynamic'"]),
    ("with_loss_scale clip_norm 0",
     lambda: jo.with_loss_scale(optax.sgd(0.1), ls(jnp.float32(2.0)), clip_norm=0.0),
     ValueError, ["0.0"]),
    ("with_loss_scale clip_norm nan",
     lambda: jo.with_loss_scale(optax.sgd(0.1), ls(jnp.float32(2.0)), clip_norm=float("nan")),
     ValueError, ["nan"]),
    ("with_loss_scale clip_norm inf",
        lambda: jo.with_loss_scale(optax.sgd(0.1), ls(jnp.float32(2.0)), clip_norm=float("inf")),
        ValueError, ["inf"]),
    ("with_loss_scale clip_norm string",
        lambda: jo.with_loss_scale(optax.sgd(0.1), ls(jnp.float32(2.0)), clip_norm="1"),
        TypeError, ["'1'"]),
    ("with_loss_scale accumulate_steps 0",
     lambda: jo.with_loss_scale(optax.sgd(0.1), ls(jnp.float32(2.0)), accumulate_steps=0),
     ValueError, ["0"]),
    ("with_loss_scale accumulate_steps 1.5",
     lambda: jo.with_loss_scale(optax.sgd(0.1), ls(jnp.float32(2.0)), accumulate_steps=1.5),
     ValueError, ["1.5"]),
    ("with_loss_scale axis_name int",
        lambda: jo.with_loss_scale(optax.sgd(0.1), ls(jnp.float32(2.0)), axis_name=3),
        TypeError, ["3"]),
    ("with_loss_scale.update grads missing a leaf", _update_with({"w": jnp.ones(2)}),
        ValueError, ["['b']"]),
    ("with_loss_scale.update grad shape differs from param",
        _update_with({"w": jnp.ones(3), "b": jnp.ones(3)}),
        ValueError, ["['w']", "(3,)", "(2,)"]),
    ("with_loss_scale.update integer gradient for a float parameter",
        _update_with({"w": jnp.ones(2, jnp.int32), "b": jnp.ones(3)}),
        TypeError, ["['w']", "int32", "float32"]),
    ("with_loss_scale.update float0 gradient for a float parameter",
        _update_with({"w": np.zeros(2, jax.dtypes.float0), "b": jnp.ones(3)}),
        TypeError, ["['w']", "float0", "float32"]),
    ("with_loss_scale.update complex gradient for a real parameter",
        _update_with({"w": jnp.ones(2), "b": jnp.ones(3, jnp.complex64)}),
        TypeError, ["['b']", "complex64", "real"]),
    ("stochastic_round key None", lambda: jo.stochastic_round(None), TypeError,
     ["PRNG key", "None"]),
    ("stochastic_round key an int", lambda: jo.stochastic_round(0), TypeError,
     ["PRNG key", "got 0"]),
    ("stochastic_round two keys", lambda: jo.stochastic_round(
        jax.random.split(jax.random.key(0))), TypeError, ["one PRNG key", "[2]"]),
    ("with_loss_scale accumulate_steps None",
     lambda: jo.with_loss_scale(optax.sgd(0.1), ls(jnp.float32(2.0)), accumulate_steps=None),
     TypeError, ["accumulate_steps", "None"]),
    ("with_loss_scale inner not a transformation",
     lambda: jo.with_loss_scale(optax.sgd, ls(jnp.float32(2.0))),
     TypeError, ["inner", "function sgd"]),
    ("with_loss_scale loss_scale a float",
     lambda: jo.with_loss_scale(optax.sgd(0.1), 1024.0),
     TypeError, ["loss_scale", "1024.0"]),
    ("with_loss_scale.update with another optimizer's state",
     lambda: jo.with_loss_scale(optax.sgd(0.1), jmp_lite.NoOpLossScale()).update(
         {"w": jnp.ones(2)}, optax.sgd(0.1).init({"w": jnp.ones(2)})),
     TypeError, ["LossScaleState", "tuple"]),
    ("with_loss_scale.update with a state of another accumulate_steps",
     lambda: jo.with_loss_scale(optax.sgd(0.1), jmp_lite.NoOpLossScale()).update(
         {"w": jnp.ones(2)}, jo.with_loss_scale(
             optax.sgd(0.1), jmp_lite.NoOpLossScale(), accumulate_steps=2).init(
                 {"w": jnp.ones(2)})),
     ValueError, ["accumulate_steps", "1"]),
    ("with_loss_scale.update gradients transposed",
     lambda: jo.with_loss_scale(optax.sgd(0.1), jmp_lite.NoOpLossScale()).update(
         {"w": jnp.ones((3, 2))}, jo.with_loss_scale(optax.sgd(0.1), jmp_lite.NoOpLossScale())
         .init({"w": jnp.ones((2, 3))}), {"w": jnp.ones((2, 3))}),
     ValueError, ["['w']", "(3, 2)", "(2, 3)"]),
    ("get_policy ambiguous float", lambda: jmp_lite.get_policy("p=float,c=bf16"),
     ValueError, ["'float'", "float32"]),
    ("get_loss_scale without with_loss_scale",
     lambda: jo.get_loss_scale(optax.sgd(0.1).init({"w": jnp.ones(2)})),
     ValueError, ["found 0"]),
    # ---------------------------------------------------------- TrainState
    ("TrainState.create bad policy", _train_state(policy="p=int8"), ValueError, ["'int8'"]),
    ("TrainState.create float loss_scale", _train_state(loss_scale=128.0),
     TypeError, ["128.0"]),
    ("TrainState.create clip_norm -1", _train_state(clip_norm=-1.0), ValueError, ["-1.0"]),
    # --------------------------------------------------------- distributed
    ("reduce_gradients axis_name int",
     lambda: distributed.reduce_gradients({"w": jnp.ones(2)}, 3), TypeError, ["3"]),
    ("reduce_gradients empty axis_name",
     lambda: distributed.reduce_gradients({"w": jnp.ones(2)}, ()), TypeError, ["()"]),
    ("reduce_gradients bad policy",
     _in_shard_map(lambda: distributed.reduce_gradients(jnp.ones(()), "data", policy="p=int8")),
     ValueError, ["'int8'"]),
    ("mark_varying axis_name None",
     lambda: distributed.mark_varying({"w": jnp.ones(2)}, None), TypeError, ["None"]),
    # ------------------------------------------------------------- testing
    ("inject_nonfinite finite value",
     lambda: testing.inject_nonfinite({"w": jnp.ones(2)}, 0, at_steps=[0], value=3.0),
     ValueError, ["3.0"]),
    ("inject_nonfinite unknown path",
     lambda: testing.inject_nonfinite({"w": jnp.ones(2)}, 0, at_steps=[0], leaves=["['v']"]),
     ValueError, ["['v']", "['w']"]),
    ("inject_nonfinite float step",
     lambda: testing.inject_nonfinite({"w": jnp.ones(2)}, 1.5, at_steps=[0]),
     TypeError, ["1.5"]),
    ("assert_single_compile n_steps 1",
     lambda: testing.assert_single_compile(lambda s: s, jnp.ones(()), n_steps=1),
     ValueError, ["1"]),
    # ------------------------------------------------------------- autocast
    # None was read as float64 (np.dtype(None)), a string as its characters.
    ("autocast None", lambda: jmp_lite.autocast(jnp.sum, None), TypeError, ["None"]),
    ("autocast white_list string", lambda: jmp_lite.autocast(jnp.sum, "bf16", white_list="exp"),
     TypeError, ["white_list", "'exp'"]),
    ("autocast black_list string", lambda: jmp_lite.autocast(jnp.sum, "bf16", black_list="log"),
     TypeError, ["black_list", "'log'"]),
    ("autocast fractional min_reduction_size",
     lambda: jmp_lite.autocast(jnp.sum, "bf16", min_reduction_size=2.5),
     TypeError, ["min_reduction_size", "2.5"]),
    # The loss scale is a positional argument inside: JAX's message said 4, 5 and 2.
    ("value_and_grad argnums past the arguments",
     _vg(lambda w: jnp.sum(w), jnp.ones(3), argnums=3), TypeError, ["argnums=3", "4", "1"]),
    ("kahan_summation integer compensation", lambda: jo.kahan_summation(jnp.int32),
     ValueError, ["kahan_summation", "int32"]),
    ("with_state_dtype None", lambda: jo.with_state_dtype(optax.sgd(0.1), None),
     ValueError, ["with_state_dtype", "None"]),
    ("select_tree different non-array leaves",
     lambda: jmp_lite.select_tree(jnp.bool_(True), {"f": jax.nn.relu, "w": jnp.ones(2)},
                                  {"f": jax.nn.gelu, "w": jnp.ones(2)}),
     TypeError, ["['f']", "gelu"]),
]


def _case_id(case):
  return case.values[0] if hasattr(case, "values") else case[0]


@pytest.mark.parametrize("name,call,error,fragments", CASES, ids=[_case_id(c) for c in CASES])
def test_bad_input_is_rejected_with_the_offending_value(name, call, error, fragments):
  del name
  with pytest.raises(error) as info:
    call()
  message = str(info.value)
  missing = [f for f in fragments if f not in message]
  assert not missing, f"{missing} not in message: {message}"


def test_every_public_entry_point_has_a_case():
  names = " ".join(_case_id(c) for c in CASES)
  public = ["get_policy", "parse_dtype", "Policy", "StaticLossScale", "DynamicLossScale",
            "adjust", "select_tree", "value_and_grad", "TrainState", "with_loss_scale",
            "get_loss_scale", "reduce_gradients", "mark_varying", "inject_nonfinite",
            "assert_single_compile", "stochastic_round"]
  assert [p for p in public if p not in names] == []


def test_all_finite_ignores_what_is_not_floating_rather_than_failing():
  # all_finite accepts any pytree (jmp does): strings and None are not errors.
  assert bool(jmp_lite.all_finite({"a": "text", "b": None, "c": np.int8(3)}))
