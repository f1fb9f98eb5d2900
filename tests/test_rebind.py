"""`jmp_lite._jaxpr.rebind`: binding higher-order equations with rewritten bodies.

Each program of `test_traverse.PROGRAMS` is traced and its equations run one
by one, each higher-order one through `rebind` with bodies rewritten to
capture a constant array (``+ zeros``, so the values are unchanged): the
trace of a body hoists it into a leading input, which each primitive counts
in its own place. The oracle is the program run by JAX itself, and its
gradient (a custom VJP's forward rule is rewritten through its thunk).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_lite._jaxpr import internals as _internals
from jmp_lite._jaxpr import rebind as _rebind
from test_traverse import PROGRAMS


def _plus_zeros(closed):
  """``closed``, computing the same values through a captured zero array."""
  def fn(*args):
    outs = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)
    # A non-scalar NumPy array: a constant the trace hoists, not a literal.
    return [o + np.zeros(np.shape(o), o.dtype) if jnp.issubdtype(o.dtype, jnp.floating)
            else o for o in outs]
  return fn


def _run(closed, args, rebound):
  """Evaluates ``closed``, its higher-order equations through `rebind`."""
  def on_eqn(eqn, invals):
    if eqn.primitive.name in _rebind.PRIMITIVES:
      rebound.append(eqn.primitive.name)
      return _rebind.rebind(eqn, invals, _plus_zeros)
    return _internals.bind(eqn, invals)
  return _internals.eval_jaxpr(closed.jaxpr, closed.consts, args, on_eqn)


def test_every_primitive_it_rebinds_has_a_program():
  names = set()
  for fn in PROGRAMS.values():
    closed = jax.make_jaxpr(fn)(jnp.ones(4))
    names |= {e.primitive.name for e in closed.jaxpr.eqns}
  calls = {"jit", "pjit", "closed_call"}  # one rule; this JAX traces `jit` as one of them
  assert _rebind.PRIMITIVES - calls <= names, _rebind.PRIMITIVES - calls - names
  assert names & calls


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_rebinding_with_hoisted_constants_gives_the_same_values(name):
  x = jnp.asarray(np.linspace(0.1, 0.9, 4), jnp.float32)
  fn = PROGRAMS[name]
  closed = jax.make_jaxpr(fn)(x)
  rebound = []
  got = jax.jit(lambda a: _run(closed, [a], rebound))(x)
  assert rebound, name
  want = jax.tree.leaves(fn(x))
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-6)


@pytest.mark.parametrize("name", [n for n in PROGRAMS if n not in ("while", "shard_map")])
def test_gradients_through_the_rebound_program_are_jaxs(name):
  """Reverse mode through every rebound equation: JAX differentiates the
  rewritten bodies, a custom VJP's rewritten forward rule and its own
  backward rule. (A while loop has no reverse-mode derivative.)"""
  x = jnp.asarray(np.linspace(0.1, 0.9, 4), jnp.float32)
  fn = lambda a: sum(jnp.sum(o) for o in jax.tree.leaves(PROGRAMS[name](a))
                     if jnp.issubdtype(o.dtype, jnp.floating))
  closed = jax.make_jaxpr(PROGRAMS[name])(x)
  rebuilt = lambda a: sum(jnp.sum(o) for o in _run(closed, [a], [])
                          if jnp.issubdtype(o.dtype, jnp.floating))
  np.testing.assert_allclose(jax.grad(rebuilt)(x), jax.grad(fn)(x), rtol=1e-6)


def test_the_hoisted_constants_are_counted_where_each_primitive_counts_them():
  """The rebound program holds the constants as operands (one zero array per
  floating output of the body), counted where each primitive counts them
  (custom rules' are ordinary operands again once JAX traces their call)."""
  x = jnp.ones(4)
  for name, key, outputs in (("scan", "num_consts", 2), ("while", "body_nconsts", 1),
                             ("custom_jvp", None, 1), ("custom_vjp", None, 1)):
    closed = jax.make_jaxpr(PROGRAMS[name])(x)
    eqn = closed.jaxpr.eqns[-1]
    after = jax.make_jaxpr(lambda a: _run(closed, [a], []))(x)
    new = [e for e in after.jaxpr.eqns if e.primitive == eqn.primitive]
    assert len(new) == 1, name
    assert len(new[0].invars) == len(eqn.invars) + outputs, name
    if key is not None:
      assert new[0].params[key] == eqn.params[key] + outputs, name


def test_with_body_swaps_a_calls_body_without_tracing():
  """A structural edit: the call runs the new body on its operands; the oracle
  is JAX evaluating the edited program."""
  closed = jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x) * 2)(jnp.float32(0.5))
  (call,) = [e for e in closed.jaxpr.eqns if e.primitive.name in _rebind.CALLS]
  doubled = jax.make_jaxpr(lambda x: x + x)(jnp.float32(0.5))
  edited = _rebind.with_body(call, doubled.jaxpr, doubled.consts,
                             call.invars, call.outvars)
  program = _internals.replace_eqns(
      closed.jaxpr, [edited if e is call else e for e in closed.jaxpr.eqns])
  got = jax.core.eval_jaxpr(program, closed.consts, jnp.float32(0.5))
  np.testing.assert_array_equal(got[0], np.float32(2.0))  # (0.5 + 0.5) * 2
  scan = jax.make_jaxpr(lambda x: jax.lax.scan(lambda c, _: (c, c), x, None, 2))(1.0)
  with pytest.raises(ValueError, match="not a call"):
    _rebind.with_body(scan.jaxpr.eqns[0], doubled.jaxpr, (), [], [])
