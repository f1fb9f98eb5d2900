"""Finds gradients that JAX's autodiff already summed across devices.

Inside ``shard_map`` with ``check_vma=True``, ``jax.grad`` with respect to a
replicated (invariant) value transposes the ``pvary`` JAX inserted where that
value met per-device data into a ``psum_invariant``: the gradient comes back
summed over the axis, in the dtype the value had there, and invariant.
`jmp_lite.distributed.reduce_gradients` would sum it a second time. Its
invariance gives it away, until an operation after ``jax.grad`` combines it
with anything per-device (a mask, a varying accumulator, a per-device
weight): JAX then marks it varying again with a ``pvary`` outside the
backward pass, and the type no longer shows what happened.

`summed_by_autodiff` reads the trace instead: from a gradient, back through
the operations after ``jax.grad`` to each non-transposed ``pvary`` over the
axis, and from there, through values invariant over it, to a
``psum_invariant`` the backward pass emitted. A backward pass whose own
output is per-device is not entered, so reductions inside it (the transpose
of a synchronised batch norm's ``pmean``) do not count; an explicit
``psum`` of per-device values after ``jax.grad`` (a global norm) stops the
walk, as it starts from per-device values. Jaxprs inside ``jit``, ``scan``,
``while``, ``cond``, ``jax.checkpoint`` and custom derivatives are entered;
a transposed equation's jaxprs count as transposed. What the trace does not
show (outside ``jit``, other interpreters) is not reported: the check can
miss, never cry wolf.

Reading the trace relies on JAX internals, each listed in `jmp_lite._jaxpr.internals`.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
from jax import extend as jex

from jmp_lite._jaxpr import internals as _internals
from jmp_lite._jaxpr import traverse as _traverse
from jmp_lite import _replicas


def _aval(node) -> Any:
  graph, x = node
  return x.aval if graph is not None else jax.typeof(x)


class _Inner:
  """A jaxpr inside an equation (a `jmp_lite._jaxpr.traverse.Region`): where its
  variables come from."""

  def __init__(self, region, outer_eqn, outer_graph, transposed):
    self.region = region
    self.jaxpr = region.jaxpr
    self.eqn = outer_eqn
    self.outer = outer_graph
    self.transposed = transposed
    self.producers = {}
    for e in self.jaxpr.eqns:
      for i, v in enumerate(e.outvars):
        self.producers[v] = (e, i)

  def result(self, index: int):
    """The jaxpr's output that is the equation's result ``index``, or None."""
    return next((v for v, o in zip(self.jaxpr.outvars, self.region.outputs) if o == index),
                None)


def _sub_graphs(eqn, graph, transposed) -> list[_Inner]:
  """The jaxprs of ``eqn`` whose outputs are its outputs (none for a
  first-order equation, or an unknown one: its operands are walked)."""
  return [_Inner(r, eqn, graph, transposed)
          for r in _traverse.regions_or_warn(eqn, "reduce_gradients")
          if any(o is not None for o in r.outputs)]


def _producer(node):
  """``(eqn, output index, graph the eqn's operands live in)`` or None."""
  graph, x = node
  if graph is None:
    found = _internals.producer(x)
    return None if found is None else (*found, None)
  if isinstance(x, jex.core.Literal):
    return None
  found = graph.producers.get(x)
  return None if found is None else (*found, graph)


def _outer_sources(node) -> list[Any]:
  """Where an inner jaxpr's input comes from: the operand, and the loop."""
  graph, x = node
  if graph is None or isinstance(x, jex.core.Literal) or x not in graph.jaxpr.invars:
    return []
  j = graph.jaxpr.invars.index(x)
  operands = _internals.eqn_inputs(graph.eqn)
  region = graph.region
  out = [(graph.outer, operands[region.inputs[j]])]
  if region.carried[j]:
    # The k-th carry is, from the second iteration on, the body's k-th output.
    out.append((graph, graph.jaxpr.outvars[sum(region.carried[:j])]))
  return out


def summed_by_autodiff(x, axis: str) -> Optional[jax.typing.DTypeLike]:
  """The dtype of the autodiff ``psum`` over ``axis`` behind ``x``, or None."""
  start = "varying" if axis in _replicas.varying_axes(x) else "invariant"
  stack = [((None, x), start, False)]
  seen = set()
  while stack:
    node, phase, in_transposed = stack.pop()
    key = (id(node[0]), id(node[1]), phase)
    if key in seen:
      continue
    seen.add(key)
    found = _producer(node)
    if found is None:
      stack.extend((n, phase, in_transposed) for n in _outer_sources(node))
      continue
    eqn, index, graph = found
    transposed = in_transposed or _internals.transposed(eqn)
    name = eqn.primitive.name
    if phase == "varying":
      if transposed:
        continue  # a backward pass's own per-device output
      if name == "pvary" and axis in eqn.params.get("axes", ()):
        stack.append(((graph, _internals.eqn_inputs(eqn)[index]), "invariant", False))
        continue
    elif transposed and name == "psum_invariant" and axis in eqn.params["axes"]:
      return eqn.outvars[index].aval.dtype
    inner = [(g, g.result(index)) for g in _sub_graphs(eqn, graph, transposed)]
    inner = [(g, v) for g, v in inner if v is not None]
    if inner:
      stack.extend((node, phase, transposed) for node in inner)
      continue
    for operand in _internals.eqn_inputs(eqn):
      if isinstance(operand, jex.core.Literal):
        continue
      child = (graph, operand)
      varying = axis in _replicas.aval_varying_axes(_aval(child))
      if (phase == "varying") == varying:
        stack.append((child, phase, transposed))
  return None
