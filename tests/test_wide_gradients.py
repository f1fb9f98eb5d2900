"""Gradient sums in float32 under a narrow compute dtype, and reading collectives.

The engine moves a parameter's downcast past the broadcasts, gathers and
reshapes that read it (`jmp_lite._jaxpr.passes.sink`), so the sums their transposes make
(a bias's over the batch, an embedding's scatter-add) run in float32. The
oracle for the forward pass is the model run as written (bitwise); for the
backward pass, the float32 gradient, which the moved sums must match at
least as closely as JAX's own narrow sums do.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite
from jmp_lite import _hlo
from jmp_lite._jaxpr.passes import engine as _engine
from jmp_lite.testing import assert_trees_bitwise_equal
from jaxprs import equations

POLICY = jmp_lite.get_policy("p=f32,c=bf16,o=f32")


def _model(params, tokens):
  """An embedding, a dense layer with a bias, a per-feature scale: every move."""
  h = jnp.take(params["embed"], tokens, axis=0)           # gather
  h = h @ params["w"] + params["b"]                        # implicit broadcast
  h = h * params["scale"].reshape(1, 1, -1)                # reshape, broadcast
  h = h + jnp.broadcast_to(params["shift"], h.shape)       # explicit broadcast
  return jnp.mean(h.astype(jnp.float32) ** 2)


def _params():
  ks = jax.random.split(jax.random.key(0), 5)
  return {"embed": jax.random.normal(ks[0], (50, 16)),
          "w": jax.random.normal(ks[1], (16, 16)) / 4,
          "b": jax.random.normal(ks[2], (16,)),
          "scale": 1 + jax.random.normal(ks[3], (16,)) / 8,
          "shift": jax.random.normal(ks[4], (16,))}


def _tokens():
  return jax.random.randint(jax.random.key(1), (32, 64), 0, 50)


def _narrow(params, tokens):
  return _model(POLICY.cast_to_compute(params), tokens)


def _sums(jaxpr, adding=False):
  """(primitive, dtype) of every sum in a jaxpr, nested ones included; with
  ``adding``, only those that add two elements or more."""
  return [(eqn.primitive.name, eqn.outvars[0].aval.dtype)
          for eqn in equations(jaxpr)
          if eqn.primitive.name in ("reduce_sum", "scatter-add", "scatter_add")
          and not (adding and eqn.primitive.name == "reduce_sum"
                   and eqn.invars[0].aval.size == eqn.outvars[0].aval.size)]


def test_forward_is_bitwise_the_model_as_written():
  params, tokens = _params(), _tokens()
  got = jax.jit(_engine.accumulate(_narrow))(params, tokens)
  want = jax.jit(_narrow)(params, tokens)
  assert_trees_bitwise_equal(got, want)


def test_backward_sums_run_in_float32():
  params, tokens = _params(), _tokens()
  as_written = jax.make_jaxpr(jax.grad(_narrow))(params, tokens).jaxpr
  moved = jax.make_jaxpr(jax.grad(_engine.accumulate(_narrow)))(params, tokens).jaxpr
  # JAX's own: the bias, scale and shift sums and the embedding's scatter-add
  # run in bf16.
  narrow = {(p, d) for p, d in _sums(as_written) if d == jnp.bfloat16}
  assert {p for p, _ in narrow} >= {"reduce_sum", "scatter-add"}, _sums(as_written)
  # The engine's: none in bf16.
  assert all(d == jnp.float32 for _, d in _sums(moved)), _sums(moved)


def test_backward_is_closer_to_float32():
  params, tokens = _params(), _tokens()
  want = jax.jit(jax.grad(_model))(params, tokens)
  plain = jax.jit(jax.grad(_narrow))(params, tokens)
  moved = jax.jit(jax.grad(_engine.accumulate(_narrow)))(params, tokens)
  for name in ("b", "shift", "scale", "embed"):
    err = lambda g: float(jnp.max(jnp.abs(g[name] - want[name])))
    assert err(moved) <= err(plain), (name, err(moved), err(plain))
  # Bias and shift gradients are pure sums of the (identical) bf16 cotangent.
  assert err_ratio(moved["shift"], plain["shift"], want["shift"]) < 1


def err_ratio(a, b, want):
  return float(jnp.linalg.norm(a - want) / jnp.linalg.norm(b - want))


@pytest.mark.parametrize("reduce_dtype", ["bfloat16", "float16"])
def test_a_narrow_reduce_dtype_keeps_the_sums_as_written(reduce_dtype):
  params, tokens = _params(), _tokens()
  rewritten = _engine.accumulate(_narrow, reduce_dtype=reduce_dtype)
  as_written = jax.make_jaxpr(jax.grad(_narrow))(params, tokens).jaxpr
  moved = jax.make_jaxpr(jax.grad(rewritten))(params, tokens).jaxpr
  assert sorted(map(str, _sums(moved))) == sorted(map(str, _sums(as_written)))


def _bf16_params():
  return jax.tree.map(lambda a: a.astype(jnp.bfloat16), _params())


def test_bf16_stored_parameters_forward_is_bitwise_the_model_as_written():
  params, tokens = _bf16_params(), _tokens()
  assert_trees_bitwise_equal(jax.jit(_engine.accumulate(_model))(params, tokens),
                             jax.jit(_model)(params, tokens))


def test_the_sink_sums_from_autocasts_reduction_size():
  from jmp_lite import oplists  # pylint: disable=g-import-not-at-top
  from jmp_lite._jaxpr.passes import sink  # pylint: disable=g-import-not-at-top
  assert sink.SUMMED_FROM == oplists.MIN_REDUCTION_SIZE


def test_bf16_stored_parameters_are_summed_in_float32():
  """No downcast to move (``p=bf16``): the engine upcasts the parameter
  exactly before the moves that read it. JAX's own sums run in bf16."""
  params, tokens = _bf16_params(), _tokens()
  as_written = jax.make_jaxpr(jax.grad(_model))(params, tokens).jaxpr
  moved = jax.make_jaxpr(jax.grad(_engine.accumulate(_model)))(params, tokens).jaxpr
  assert {p for p, d in _sums(as_written) if d == jnp.bfloat16} >= {
      "reduce_sum", "scatter-add"}, _sums(as_written)
  # A sum over the size-1 dimensions ``b[None, None]`` added stays bf16: it
  # adds nothing.
  assert all(d == jnp.float32 for _, d in _sums(moved, adding=True)), _sums(moved)
  grads = jax.jit(jax.grad(_engine.accumulate(_model)))(params, tokens)
  assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("layer", ["dense", "embed"])
def test_a_bf16_bias_and_table_get_the_float32_sum(layer):
  """A bf16 bias over 8,192 rows, each cotangent 100 / 32,768: JAX's bf16
  sum gave 29.375 for every element, the float32 sum is 25 (exact in bf16).
  The same for a bf16 embedding row gathered 8,192 times. Oracle: the
  float32 model's gradient, bit for bit."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  if layer == "dense":
    model, x = nn.Dense(4), jax.random.normal(jax.random.key(0), (8192, 16))
    leaf = lambda g: g["params"]["bias"]
  else:
    model, x = nn.Embed(10, 4), jnp.zeros((8192,), jnp.int32)
    leaf = lambda g: g["params"]["embedding"][0]
  variables = jax.tree.map(lambda a: a.astype(jnp.bfloat16),
                           model.init(jax.random.key(1), x))
  wrapped = jmp_lite.flax.wrap(model, "p=bf16,c=bf16,o=f32")
  loss = lambda apply: lambda v: jnp.mean(apply(v, x).astype(jnp.float32) + 1) * 100
  got = jax.jit(jax.grad(loss(wrapped.apply)))(variables)
  want = jax.grad(loss(model.apply))(jax.tree.map(lambda a: a.astype(jnp.float32), variables))
  assert leaf(got).dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(leaf(got), np.float32), leaf(want))
  np.testing.assert_array_equal(leaf(want), 25.0)


def test_a_symbolic_batch_exports_and_sums_in_float32():
  """Shape-polymorphic export of a bf16 bias over a batch of n rows: the
  size test compared '4*n' >= '64' and raised. A symbolic dimension counts
  as large: the sum is float32."""
  fun = _engine.accumulate(lambda b, x: jnp.sum((x + b[None]).astype(jnp.float32)))
  n = jax.export.symbolic_shape("n")[0]
  args = (jax.ShapeDtypeStruct((4,), jnp.bfloat16), jax.ShapeDtypeStruct((n, 4), jnp.bfloat16))
  jax.export.export(jax.jit(jax.grad(fun)))(*args)
  grad = jax.make_jaxpr(jax.grad(fun))(jnp.ones(4, jnp.bfloat16), jnp.ones((64, 4), jnp.bfloat16))
  assert all(d == jnp.float32 for _, d in _sums(grad.jaxpr, adding=True)), _sums(grad.jaxpr)


def test_narrow_values_the_function_computes_keep_their_sums():
  """Only the function's narrow inputs (stored parameters) are upcast: an
  activation it computes in bf16 and broadcasts (``h - h[:, :1]``) keeps
  the sums the engine makes without the sink."""
  def f(w, x):
    h = x @ w                                       # bf16 activation
    m = h[:, 0]                                     # computed, then broadcast
    return jnp.sum((h - m[:, None]).astype(jnp.float32) ** 2)
  w = jax.random.normal(jax.random.key(0), (16, 64)).astype(jnp.bfloat16)
  x = jax.random.normal(jax.random.key(1), (32, 16)).astype(jnp.bfloat16)
  mine = jax.make_jaxpr(jax.grad(_engine.accumulate(f), argnums=1))(w, x).jaxpr
  theirs = jax.make_jaxpr(jax.grad(_engine.accumulate(f, sink=False), argnums=1))(w, x).jaxpr
  assert sorted(map(str, _sums(mine))) == sorted(map(str, _sums(theirs)))


# --------------------------------------------------------------- HLO parsing

HLO = """\
HloModule jit_step, entry_computation_layout={(f32[4,8]{1,0})->f32[4,8]{1,0}}

%add.clone (x: f32[], y: f32[]) -> f32[] {
  ROOT %add = f32[] add(f32[] %x, f32[] %y)
}

ENTRY %main (param: f32[4,8], p1: bf16[16,8]) -> f32[4,8] {
  %param = f32[4,8]{1,0} parameter(0), sharding={replicated}
  %p1 = bf16[16,8]{1,0} parameter(1)
  %dot.3 = f32[128,64]{1,0} dot(%a, %b)
  %all-reduce.4 = (f32[128,64]{1,0}, bf16[16,128]{1,0}) all-reduce(%dot.3, %dot.4), channel_id=1, replica_groups={{0,1}}, to_apply=%add.clone
  %reduce-scatter = bf16[4,8]{1,0} reduce-scatter(bf16[16,8]{1,0} %p1), dimensions={0}, to_apply=%add.clone
  all-gather.2 = f8e4m3fn[32,8]{1,0} all-gather(%param), dimensions={0}
  ROOT %cp = f32[4,8]{1,0} collective-permute(%param), source_target_pairs={{0,1}}
}
"""


def test_parse_reads_kinds_dtypes_shapes_and_bytes():
  ops = _hlo.parse(HLO)
  assert [(op.kind, op.dtype.name, op.shape, op.bytes) for op in ops] == [
      ("all-reduce", "float32", (128, 64), 128 * 64 * 4),
      ("all-reduce", "bfloat16", (16, 128), 16 * 128 * 2),
      # A reduce-scatter combines its whole operand.
      ("reduce-scatter", "bfloat16", (4, 8), 16 * 8 * 2),
      ("all-gather", "float8_e4m3fn", (32, 8), 32 * 8),
      ("collective-permute", "float32", (4, 8), 4 * 8 * 4)]


def test_collectives_on_one_device_is_empty():
  from jmp_lite.distributed import collectives
  f = lambda w, x: jax.grad(lambda w: jnp.mean(x @ w))(w)
  assert collectives(f, jnp.ones((4, 2)), jnp.ones((8, 4))) == ()
  np.testing.assert_equal(collectives(jax.jit(f), jnp.ones((4, 2)), jnp.ones((8, 4))), ())
