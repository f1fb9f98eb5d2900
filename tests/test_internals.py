"""The engine's use of JAX internals, checked against the installed JAX.

Oracle: the installed JAX itself (its primitives' parameters and rule
tables). That nothing outside `jmp_lite/_jaxpr/internals/` uses JAX internals
or Flax's private API is checked by `tests/test_layout.py`.
"""

import gc
import warnings
import weakref

import flax.linen  # noqa: F401  (loads the primitives a Flax user loads)
import flax.nnx  # noqa: F401
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.interpreters import mlir
from jax.sharding import PartitionSpec as P

from jmp_lite._jaxpr import internals as _internals
from jmp_lite._jaxpr.passes import engine as _engine
from jmp_lite.auditing import audit
from jmp_lite.autocasting import autocast
from jmp_lite.testing import count_compilations



def test_every_higher_order_primitive_of_this_jax_is_known():
  """Fails loudly when JAX grows a higher-order primitive nobody looked at."""
  # Load the modules that define higher-order primitives users reach.
  import jax.experimental.checkify  # noqa: F401  pylint: disable=g-import-not-at-top
  import jax.experimental.custom_partitioning  # noqa: F401  pylint: disable=g-import-not-at-top
  unknown = _internals.higher_order_primitives() - _internals.KNOWN_HIGHER_ORDER
  assert not unknown, (
      f"JAX {jax.__version__} has higher-order primitives the engine has not "
      f"been checked against: {sorted(unknown)}. Look at their params: a "
      "jaxpr param is rewritten generically; a function param needs a rule in "
      "jmp_lite/_jaxpr/passes/engine.py (as custom_vjp_call's bwd has).")
  # The detector itself finds the ones it must.
  assert {"scan", "while", "cond", "jit", "remat2", "shard_map",
          "custom_jvp_call", "custom_vjp_call"} <= _internals.higher_order_primitives()


def test_thunk_and_shard_map_param_names_are_what_the_engine_reads():
  @jax.custom_jvp
  def f(x):
    return x

  f.defjvp(lambda p, t: (p[0], t[0]))

  @jax.custom_vjp
  def g(x):
    return x

  g.defvjp(lambda x: (x, None), lambda _, ct: (ct,))
  mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  h = jax.shard_map(lambda x: x, mesh=mesh, in_specs=P(), out_specs=P())
  eqns = {e.primitive.name: e for e in
          jax.make_jaxpr(lambda x: h(g(f(x))))(1.0).jaxpr.eqns}
  for prim, param in (_internals.JVP_THUNK, _internals.FWD_THUNK,
                      _internals.BWD_FUN):
    assert _internals.is_wrapped_fun(eqns[prim].params[param]), (prim, param)
  assert {"mesh", "in_specs", "out_specs", "check_vma"} <= set(
      eqns["shard_map"].params)


def _opaque_matmul():
  """A primitive JAX does not define, whose lowering multiplies in bf16."""
  prim = _internals.Primitive("user_opaque_matmul")
  prim.def_abstract_eval(lambda a, b: jax.core.ShapedArray(
      (a.shape[0], b.shape[1]), a.dtype))
  mlir.register_lowering(prim, mlir.lower_fun(lambda a, b: a @ b,
                                              multiple_results=False))
  return prim


OPAQUE = _opaque_matmul()


def test_an_opaque_narrow_call_warns_by_default_and_raises_when_strict():
  a = jnp.ones((4, 8), jnp.bfloat16)
  b = jnp.ones((8, 2), jnp.bfloat16)
  fun = lambda a, b: OPAQUE.bind(a, b)  # the line the report names
  line = fun.__code__.co_firstlineno
  with pytest.warns(_engine.UncoveredMatmulWarning,
                    match=rf"user_opaque_matmul.*test_internals.py:{line}"):
    out = _engine.accumulate(fun)(a, b)
  assert out.dtype == jnp.bfloat16
  with pytest.raises(_engine.UncoveredMatmulError,
                     match=rf"user_opaque_matmul.*test_internals.py:{line}"):
    autocast(fun, jnp.bfloat16, strict=True)(a, b)
  # Float32 operands: nothing narrow goes in, nothing to report.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _engine.accumulate(fun)(a.astype(jnp.float32), b.astype(jnp.float32))


def test_eager_autocast_compiles_once_per_argument_structure():
  w = jnp.ones((8, 4))
  fun = autocast(lambda w, x: jax.nn.softmax(x @ w), jnp.bfloat16)
  xs = [jnp.full((2, 8), i, jnp.float32) for i in range(4)]
  fun(w, xs.pop())
  with count_compilations() as compiled:
    for x in xs:
      out = fun(w, x)
  assert not compiled and out.dtype == jnp.float32
  x = jnp.ones((3, 8), jnp.float32)
  with count_compilations() as compiled:
    fun(w, x)  # a new shape compiles once
  assert len(compiled) == 1


def test_eager_cache_does_not_keep_the_first_call_arguments_alive():
  fun = autocast(lambda w, x, scale: scale * (x @ w), jnp.bfloat16)
  w, x = jnp.ones((8, 4)), jnp.ones((2, 8))
  refs = [weakref.ref(w), weakref.ref(x)]
  fun(w, x, 2.0)  # 2.0 is static: it is the only leaf the cache holds
  del w, x
  gc.collect()
  assert [r() for r in refs] == [None, None]


@pytest.mark.parametrize("transform", ["grad", "jvp", "hessian", "jacfwd",
                                       "vmap"])
def test_transformations_outside_the_engine_keep_f32_accumulation(transform):
  rng = np.random.default_rng(0)
  w1 = jnp.asarray(rng.standard_normal((6, 5)), jnp.float32)
  w2 = jnp.asarray(rng.standard_normal((5, 3)), jnp.float32)
  x = jnp.asarray(rng.standard_normal((6,)), jnp.float32)

  def f(x, dtype=jnp.bfloat16):
    h = jnp.tanh(x.astype(dtype) @ w1.astype(dtype))
    return jnp.sum(jnp.sin(h @ w2.astype(dtype)).astype(jnp.float32))

  g = _engine.accumulate(f)
  ops = {"grad": jax.grad, "jacfwd": jax.jacfwd, "hessian": jax.hessian,
         "jvp": lambda h: (lambda x: jax.jvp(h, (x,), (x,))[1]),
         "vmap": lambda h: jax.vmap(h)}
  xs = jnp.stack([x, -x]) if transform == "vmap" else x
  got = ops[transform](g)(xs)
  want = ops[transform](lambda x: f(x, jnp.float32))(xs)
  np.testing.assert_allclose(got, want, rtol=0,
                             atol=3e-2 * max(1.0, float(jnp.max(jnp.abs(want)))))
  report = audit(ops[transform](g), xs)
  assert report.count(category="matmul") >= 2
  assert report.count(flag="half_matmul") == 0, str(report)
  assert report.count(category="matmul", accumulation=jnp.float32) == \
      report.count(category="matmul")


def test_a_traced_value_leads_to_its_equation_and_the_backward_pass_is_marked():
  # What jmp_lite._jaxpr.passes.provenance reads: the equation behind a traced value, its
  # operands, and whether autodiff's transposition emitted it.
  seen = {}

  def f(w, x):
    g = jax.grad(lambda w: jnp.sum(jnp.sin(x * w)))(w)
    out = g * 2.0
    eqn, index = _internals.producer(out)
    seen["mul"] = (eqn.primitive.name, index, _internals.transposed(eqn))
    (g_in, two) = _internals.eqn_inputs(eqn)
    back, _ = _internals.producer(g_in)
    seen["grad"] = _internals.transposed(back)
    seen["arg"] = _internals.producer(w)
    return out

  jax.jit(f).trace(jnp.ones(3), jnp.ones(3))
  assert seen == {"mul": ("mul", 0, False), "grad": True, "arg": None}
  assert _internals.producer(jnp.ones(3)) is None  # a concrete array


def test_scan_split_reads_how_a_scan_splits_its_operands():
  c = jnp.arange(3.0)

  def f(init, xs):
    def body(carry, x):
      a, b = carry
      return (a + x * c, b + 1.0), a
    return jax.lax.scan(body, init, xs)

  jaxpr = jax.make_jaxpr(f)((jnp.zeros(3), jnp.zeros(())), jnp.ones((4, 3)))
  (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
  n_consts, n_carry = _internals.scan_split(eqn.params)
  assert (n_consts, n_carry) == (1, 2)
  assert len(eqn.invars) == n_consts + n_carry + 1
  # The carry's avals are the scan's first outputs.
  assert ([v.aval for v in eqn.invars[n_consts:n_consts + n_carry]]
          == [v.aval for v in eqn.outvars[:n_carry]])
  more = _internals.with_more_consts("scan", eqn.params, 2)
  assert _internals.scan_split(more) == (3, 2)
  with pytest.raises(NotImplementedError, match="scan splits its operands"):
    _internals.scan_split({"jaxpr": None})
  with pytest.raises(NotImplementedError, match="how this JAX's scan counts"):
    _internals.with_more_consts("scan", {"jaxpr": None}, 1)


def test_scan_split_reads_jax_0_11s_one_tree_of_three_groups():
  """From JAX 0.11 a scan records its operand groups as one flat tree
  ``ft_in`` (consts, carry, xs) that ``unpack()`` splits; the layout the
  suite's JAX records is tested above. (A stand-in tree: this JAX has none.)"""

  class Tree:
    def unpack(self):
      return (None,) * 2, (None,) * 3, (None,)

  assert _internals.scan_split({"ft_in": Tree(), "jaxpr": None}) == (2, 3)
