"""`jmp_lite._jaxpr.traverse`: how every pass enters higher-order primitives.

The oracle is JAX's own evaluation: for each primitive in the table, a
traced program using it is run equation by equation, and each region's
jaxpr, fed the operands its `Region.inputs` name, must give the results
its `Region.outputs` name (for a loop, on a first iteration).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jmp_lite._jaxpr import internals as _internals
from jmp_lite._jaxpr import traverse as _traverse


@jax.custom_jvp
def _cj(x):
  return jnp.sin(x) * 2


_cj.defjvp(lambda p, t: (_cj(*p), 2 * jnp.cos(p[0]) * t[0]))


@jax.custom_vjp
def _cv(x):
  return jnp.cos(x) + 1


_cv.defvjp(lambda x: (_cv(x), x), lambda r, g: (-jnp.sin(r) * g,))


def _shard_map(x):
  mesh = jax.make_mesh((1,), ("d",))
  return jax.shard_map(lambda y: y * 3, mesh=mesh, in_specs=P(), out_specs=P())(x)


# One program per primitive; a loop runs exactly once, a branch index is 1.
PROGRAMS = {
    "jit": lambda x: jax.jit(lambda a: a * 2 + 1)(x),
    "checkpoint": lambda x: jax.checkpoint(lambda a: jnp.sin(a) * x)(x),
    "scan": lambda x: jax.lax.scan(lambda c, a: (c + a * x, c * a), x, x[None]),
    "while": lambda x: jax.lax.while_loop(lambda s: s[0] < 1,
                                          lambda s: (s[0] + 1, s[1] * 3 + x), (0, x))[1],
    "cond": lambda x: jax.lax.cond(jnp.int32(1), lambda a: a - 1, lambda a: a * 5, x),
    "switch": lambda x: jax.lax.switch(jnp.int32(1), [jnp.sin, jnp.cos, jnp.tan], x),
    "custom_jvp": _cj,
    "custom_vjp": _cv,
    "shard_map": _shard_map,
}


def _outer(name):
  x = jnp.asarray(np.linspace(0.1, 0.9, 4), jnp.float32)
  closed = jax.make_jaxpr(PROGRAMS[name])(x)
  return closed, x


def _run_checking(closed, x):
  """Evaluates ``closed``; checks each region of each equation against the
  equation's own results; returns the region kinds met."""
  met = []

  def eval_eqn(eqn, invals):
    outs = _internals.bind(eqn, invals)
    results = list(outs) if eqn.primitive.multiple_results else [outs]
    for r in _traverse.regions(eqn):
      met.append(r.kind)
      assert len(r.inputs) == len(r.jaxpr.invars) == len(r.carried)
      assert len(r.outputs) == len(r.jaxpr.outvars)
      if r.kind == "cond" and int(invals[0]) != r.label.count("1"):
        continue  # a branch not taken (the programs take branch 1)
      if r.kind == "shard_map":
        continue  # per-device; one device here, but bound under its mesh
      sliced = r.sliced or (False,) * len(r.inputs)
      got = _internals.eval_jaxpr(r.jaxpr, r.consts,
                                  [invals[i][0] if s else invals[i]
                                   for i, s in zip(r.inputs, sliced)], _internals.bind)
      if r.kind == "while_cond":
        assert bool(got[0]) and r.outputs == (None,)
        continue
      for g, o in zip(got, r.outputs):
        if o is None:
          continue
        want = results[o]
        if r.stacked and r.stacked[list(r.outputs).index(o)]:
          want = want[0]  # ys: the first (only) iteration's row
        np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-6)
    return outs

  _internals.eval_jaxpr(closed.jaxpr, closed.consts, [x], eval_eqn)
  return met


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_each_region_computes_the_equations_results_from_the_operands_it_names(name):
  met = _run_checking(*_outer(name))
  want = {"switch": "cond", "jit": "call"}.get(name, name)
  assert want in met, met


def test_loops_mark_their_carry_and_how_often_they_run():
  closed, _ = _outer("scan")
  (scan,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
  (body,) = _traverse.regions(scan)
  n_consts, n_carry = _internals.scan_split(scan.params)
  assert body.carried == tuple(n_consts <= k < n_consts + n_carry
                               for k in range(len(body.jaxpr.invars)))
  assert (body.runs, body.length, body.differentiated) == (_traverse.EACH, 1, True)
  assert body.sliced == tuple(k >= n_consts + n_carry for k in range(len(body.inputs)))
  assert sum(body.stacked) == len(body.jaxpr.outvars) - n_carry
  # The carry may come to hold anything the loop reads.
  assert body.flow(["c", "i", "x"][:len(body.inputs)], "any") == [
      "any" if c else "cix"[i] for i, c in zip(body.inputs, body.carried)]
  closed, _ = _outer("while")
  (loop,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "while"]
  cond, body = _traverse.regions(loop)
  assert (cond.kind, body.kind) == ("while_cond", "while")
  assert body.length is None and not body.differentiated and all(body.carried[-2:])


def test_custom_rules_bodies_are_not_what_differentiates():
  for name in ("custom_jvp", "custom_vjp"):
    closed, _ = _outer(name)
    regions = [r for e in closed.jaxpr.eqns for r in _traverse.regions(e)]
    assert [(r.kind, r.differentiated) for r in regions] == [(name, False)]


def test_combiners_are_not_bodies():
  """``scatter-add`` holds its combiner as a jaxpr: it is first-order, no
  pass enters it and none warns (an embedding's gradient is one)."""
  closed = jax.make_jaxpr(lambda x, i: x.at[i].add(1.0))(jnp.zeros(4), jnp.array([1, 2]))
  (scatter,) = [e for e in closed.jaxpr.eqns if e.primitive.name.startswith("scatter")]
  assert _traverse.held_jaxprs(scatter) and _traverse.regions(scatter) == []


def test_an_unknown_higher_order_primitive_is_an_error_or_a_warning(monkeypatch):
  """A primitive that runs a jaxpr and that the table does not know
  (declared higher-order here, as JAX's rules would declare it): `regions`
  raises, for strict passes; `regions_or_warn` warns naming the pass and
  hands its body over as opaque. Never a silent skip."""
  monkeypatch.setitem(_traverse._HIGHER_ORDER, "someone_elses_call", True)

  class Fake:
    name = "someone_elses_call"
    multiple_results = True

  class Eqn:
    primitive = Fake()
    params = {"body": jax.make_jaxpr(lambda a: a * 2)(jnp.ones(2))}

  with pytest.raises(_traverse.UnknownPrimitiveError, match="someone_elses_call"):
    _traverse.regions(Eqn())
  with pytest.warns(_traverse.BodyNotEnteredWarning, match="calibrate.*someone_elses"):
    regions = _traverse.regions_or_warn(Eqn(), "calibrate")
  assert [(r.kind, r.outputs) for r in regions] == [("unknown", (None,))]


def test_the_table_knows_the_installed_jaxs_higher_order_primitives():
  """Every primitive the installed JAX gives higher-order rules is in the
  table or in the inventory of those that only transient traces hold
  (`jmp_lite._jaxpr.internals.KNOWN_HIGHER_ORDER`, checked against JAX by
  test_internals); a new one fails here until someone decides."""
  transient = _internals.KNOWN_HIGHER_ORDER - _traverse.KNOWN
  assert transient <= {"custom_lin", "linear_call", "custom_transpose_call",
                       "call_hi_primitive", "core_map", "run_state"}, transient
  assert _internals.higher_order_primitives() <= _traverse.KNOWN | transient


def test_a_pass_without_a_rule_for_a_body_says_so(recwarn):
  """`warn_not_entered`: a pass that runs a known primitive's body as
  written warns, naming itself and the primitive; a first-order equation
  and a combiner hold no body, and nothing is said."""
  closed, _ = _outer("shard_map")
  (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "shard_map"]
  with pytest.warns(_traverse.BodyNotEnteredWarning, match="some pass.*'shard_map'"):
    _traverse.warn_not_entered(eqn, "some pass")
  closed = jax.make_jaxpr(lambda x, i: jnp.sin(x.at[i].add(1.0)))(jnp.zeros(4),
                                                                    jnp.array([1]))
  for eqn in closed.jaxpr.eqns:
    _traverse.warn_not_entered(eqn, "some pass")
  assert not [w for w in recwarn if issubclass(w.category, _traverse.BodyNotEnteredWarning)]


@pytest.mark.parametrize("name", ["jit", "checkpoint", "scan", "while", "cond", "switch"])
def test_run_evaluates_as_jax_does_and_threads_the_pass_state(name):
  """`run`, with bodies evaluated as written, gives what binding the
  equation gives (the oracle), and threads the pass's state: a scan's
  iterations each see one row of it and their results come back stacked;
  a while loop's are folded (here: counted, one iteration)."""
  closed, x = _outer(name)
  met = []

  def eval_eqn(eqn, invals):
    want = _internals.bind(eqn, invals)
    entered = [r for r in _traverse.regions(eqn) if r.kind != "while_cond"]
    kind = entered[0].kind if entered else None
    if kind not in _traverse.RUNS:
      return want

    def body(r, args, st):
      outs = _internals.eval_jaxpr(entered[r].jaxpr, entered[r].consts, args,
                                   _internals.bind)
      return outs, st + 1.0

    length = entered[0].length if kind == "scan" else 1
    state = jnp.zeros((length,)) if kind == "scan" else jnp.float32(10)
    outs, out = _traverse.run(eqn, invals, body, state, combine=lambda a, b: a + 1.0,
                              start=jnp.float32(0))
    met.append(kind)
    want = list(want) if eqn.primitive.multiple_results else [want]
    for g, w in zip(outs, want):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)
    expected = {"scan": np.ones(length), "while": 1.0}.get(kind, 11.0)
    np.testing.assert_allclose(np.asarray(out), expected)
    return want if eqn.primitive.multiple_results else want[0]

  _internals.eval_jaxpr(closed.jaxpr, closed.consts, [x], eval_eqn)
  assert met, name


def test_a_body_no_rule_registers_is_still_a_body():
  """``custom_partitioning`` holds its function as a jaxpr but JAX gives it
  none of the higher-order rules: it is in the table, so `jmp_lite.audit`
  lists the float16 matmul inside (flagged), where a combiner rule would
  have hidden it."""
  import jmp_lite
  from jax.experimental.custom_partitioning import custom_partitioning

  @custom_partitioning
  def product(x, w):
    return x @ w

  product.def_partition(partition=lambda *a: None, sharding_rule="i j, j k -> i k")
  x, w = jnp.ones((4, 8), jnp.float16), jnp.ones((8, 8), jnp.float16)
  rows = jmp_lite.audit(product, x, w).select(category="matmul")
  assert [(r.path, r.flags) for r in rows] == [(("custom_partitioning",),
                                                ("half_matmul",))]


def test_an_unregistered_primitive_whose_jaxpr_takes_its_operands_is_not_a_combiner(
    monkeypatch):
  """A primitive with no higher-order rules whose jaxpr takes arrays of its
  operands' shapes runs that jaxpr as a body: it is warned about as
  unknown, not passed over as a combiner."""
  closed = jax.make_jaxpr(lambda a: a * 2)(jnp.ones(3))
  (v,) = closed.jaxpr.invars

  class Fake:
    name = "unregistered_call"
    multiple_results = True

  class Eqn:
    primitive = Fake()
    invars = [v]
    params = {"fun": closed}

  monkeypatch.setitem(_traverse._HIGHER_ORDER, "unregistered_call", False)
  with pytest.raises(_traverse.UnknownPrimitiveError, match="unregistered_call"):
    _traverse.regions(Eqn())
