"""Places probes (`jmp_lite._jaxpr.probes`) and fp8 matmul sites (`jmp_lite._jaxpr.fp8_sites`)
in a traced function and reads them back.

`value_and_grad` traces the function once (with `tap` marks active), plans
where each probe's and each fp8 site's carrier lives in one flat float32
vector, evaluates the jaxpr with them in place and differentiates with
respect to that vector too. A probe's slice is zeros; an fp8 site's holds
its three scales and their reciprocals. What is measured comes back in the same layout, in two
ways (`forward_slots` says which slots are which):

* what the forward pass sees (a probed value's statistics, an fp8 site's
  operand maxima) as an output of the forward pass: a value no gradient
  reaches (behind ``stop_gradient``) is measured too;
* what the backward pass sees (a cotangent's statistics, an fp8 gradient's
  maximum) as the carrier's cotangent.

A value no gradient reaches in the step (computed from no differentiated
argument, or through ``stop_gradient``: `jmp_lite._jaxpr.passes.plan.Planner` follows
which are) is measured on the forward pass alone, and its fp8 sites read
their scales through ``stop_gradient``: a probe's carrier would otherwise
make JAX differentiate it and everything it flows into (a teacher's
backward pass; a ``while`` loop, which cannot be).

`jmp_lite._stats` reads the probes' statistics. Higher-order equations
holding probes are re-bound through the public API with their share of the
carrier, and return their share of the forward measurements:

* ``scan``: the carrier slice becomes one more scanned input, a row per
  iteration, so a scanned stack of layers reports each layer;
* ``checkpoint`` (``remat``) and ``cond``: one more operand (each branch
  its own slice; the branch not taken reports zeros);
* ``while`` (``fori_loop`` with traced bounds): one row for the whole loop,
  maxima by max and counts by sum over its iterations. JAX cannot
  reverse-differentiate a while loop, so one only sits where no gradient
  flows, and it reports forward measurements only;
* ``jit``: evaluated inline.

Other higher-order equations (custom derivatives, ``shard_map`` nested
inside the function) run as written, and marks inside them report nothing:
a custom rule's body is not what its derivative computes.
`jmp_lite._jaxpr.passes.unseen` warns when fp8 matmuls or telemetry marks sit there.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _fp8_numerics
from jmp_lite import _fp8_state
from jmp_lite._jaxpr import arguments as _arguments
from jmp_lite._jaxpr import fp8_sites as _fp8_sites
from jmp_lite._jaxpr import internals as _internals
from jmp_lite._jaxpr.passes.plan import decode, forward_slots, sites
from jmp_lite._jaxpr.passes.plan import Fp8Selection, Nested, Plan, Planner
from jmp_lite._jaxpr.passes import unseen as _unseen
from jmp_lite._jaxpr import probes as _probes
from jmp_lite._jaxpr import traverse as _traverse
from jmp_lite import _replicas

def interpret(jaxpr, consts, args, carrier, plan: Plan,
              gate=None) -> tuple[list[Any], jax.Array]:
  """Evaluates ``jaxpr`` with the probes of ``plan`` fed from ``carrier``.

  ``gate``: None (every probe measures) or a float32 scalar (they measure
  where it is positive, `jmp_lite._jaxpr.probes.probe`). Returns ``(outputs,
  forward)``: ``forward`` float32 ``[plan.size]``, the forward
  measurements in their slots (`forward_slots`) and zeros elsewhere.
  """
  index = iter(range(len(jaxpr.eqns)))
  found = []  # (offset, forward measurements)
  piece = _pieces(carrier, plan)

  def eval_eqn(eqn, invals):
    i = next(index)
    nested = plan.nested.get(i)
    if nested is not None:
      outs, measured = _nested(eqn, invals, piece[nested.offset], nested, gate)
      found.append((nested.offset, measured))
      return outs
    points = plan.points.get(i, ())
    site = next((p for j, p in points if p.recipe is not None), None)
    if site is not None:
      lhs, rhs = invals
      scales = piece[site.offset]
      # A site no gradient reaches (a teacher's) reads its scales and stays
      # undifferentiated: its maxima are forward outputs.
      scales = scales if site.live else jax.lax.stop_gradient(scales)
      outs, amax = _fp8_sites.matmul(
          lhs, rhs, scales,
          eqn.params["dimension_numbers"], eqn.outvars[0].aval.dtype,
          *(_fp8_numerics.FORMATS[f] for f in site.recipe), scaling=site.scaling,
          out_sharding=eqn.params.get("out_sharding"))
      found.append((site.offset, amax))
    else:
      # A mark is bound as it is: JAX may have moved a cast into its body.
      outs = _internals.bind(eqn, invals)
    points = [(j, p) for j, p in points if p.recipe is None]
    if not points:
      return outs
    outs = list(outs) if eqn.primitive.multiple_results else [outs]
    for j, p in points:
      slot = piece[p.offset]
      if p.live:
        outs[j], stats = _probes.probe(outs[j], slot, p.thresholds, gate, p.view,
                                       cast_back=p.cast_back)
      else:  # no gradient reaches it: no cotangent to measure, none made
        stats = _probes.forward(outs[j], slot, p.thresholds, gate, p.view)
      found.append((p.offset, stats))
    return outs if eqn.primitive.multiple_results else outs[0]

  outs = _internals.eval_jaxpr(jaxpr, consts, args, eval_eqn)
  return outs, _assemble(plan.size, found, carrier)


def _pieces(carrier: jax.Array, plan: Plan) -> dict[int, jax.Array]:
  """``carrier`` cut into each probe's, site's and nested equation's slice,
  by offset, in one ``split``.

  The plan lays them end to end. One split, not a slice each: the transpose
  of a slice pads its cotangent to the whole carrier, and the backward pass
  added up one carrier-sized vector per probe, quadratic in the number of
  probes (a Hugging Face BERT's telemetry step: 127k lines of HLO, 130 s to
  compile, against 2 s without telemetry). A split's transpose is one
  concatenation.
  """
  spans = [(p.offset, p.width) for points in plan.points.values() for _, p in points]
  spans += [(n.offset, n.length * sum(c.size for c in n.children))
            for n in plan.nested.values()]
  spans.sort()
  if [o for o, _ in spans] != list(np.cumsum([0] + [w for _, w in spans])[:-1]) \
      or sum(w for _, w in spans) != carrier.shape[0]:
    raise AssertionError(f"telemetry plan does not tile its carrier: {spans}")
  if len(spans) == 1:
    return {spans[0][0]: carrier}
  parts = jax.lax.split(carrier, [w for _, w in spans])
  return {o: part for (o, _), part in zip(spans, parts)}


def _assemble(size: int, found, like) -> jax.Array:
  """A float32 ``[size]`` vector: each ``(offset, values)`` of ``found`` in
  place, zeros elsewhere, typed varying like ``like`` under ``shard_map``."""
  axes = tuple(sorted(_replicas.varying_axes(like)))
  zeros = lambda n: _probes._varying(jnp.zeros((n,), jnp.float32), axes)
  parts, at = [], 0
  for start, values in sorted(found, key=lambda t: t[0]):
    if start > at:
      parts.append(zeros(start - at))
    parts.append(values.astype(jnp.float32))
    at = start + values.shape[0]
  if at < size or not parts:
    parts.append(zeros(size - at))
  return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


def _nested(eqn, invals, carrier, nested: Nested, gate):
  """``eqn`` re-bound with its share of ``carrier``: ``(outputs, forward)``.
  Its bodies are ``nested.regions``, one per child plan, evaluated by
  `interpret` through `jmp_lite._jaxpr.traverse.run`: a scan's iterations each
  read a row of the share, a cond's branches each their own slice of it,
  and a while loop's iterations all read it, their forward measurements
  combined (maxima by max, counts by sum) into one row."""
  sizes = [c.size for c in nested.children]
  share = carrier
  starts = np.cumsum([0, *sizes])

  def body(r, args, st):
    region, child = nested.regions[r], nested.children[r]
    if nested.kind != "cond":
      return interpret(region.jaxpr, region.consts, args, st, child, gate)
    start = int(starts[r])
    outs, measured = interpret(region.jaxpr, region.consts, args,
                               st[start:start + child.size], child, gate)
    return outs, _assemble(st.shape[0], [(start, measured)], st)

  if nested.kind == "scan":
    outs, measured = _traverse.run(eqn, invals, body,
                                   share.reshape(nested.length, sizes[0]))
    return outs, measured.reshape(-1)
  if nested.kind == "while":
    # No gradient flows through a while loop: its sites only read their scales.
    _, maxima = forward_slots(nested.children[0])
    fold = lambda seen, new: jnp.where(maxima, jnp.maximum(seen, new), seen + new)
    share = jax.lax.stop_gradient(share)
    return _traverse.run(eqn, invals, body, share, combine=fold,
                         start=_assemble(share.shape[0], [], share))
  return _traverse.run(eqn, invals, body, share)


def _trace(fun, args, kwargs, planner: Planner, argnums: Optional[tuple] = None,
           params: tuple = ()):
  """``fun`` traced once with marks active: its jaxpr, its plan, how to call it.

  ``argnums``: the differentiated arguments (None: every one), which the
  plan follows to know which values a gradient reaches. ``params``: the
  arguments that hold parameters, which tell a scanned stack of layers from
  a cell scanned over time (the same in every pass of a state: its shapes).
  """
  leaves, treedef, traced = _arguments.split(
      args, kwargs, (*_arguments.ARRAYS, np.generic, jax.ShapeDtypeStruct))
  owner = [a for a, arg in enumerate(args) for _ in jax.tree_util.tree_leaves(arg)]
  owner += [None] * (len(leaves) - len(owner))  # keyword arguments
  live = None if argnums is None else [owner[i] in argnums for i in traced]
  out_tree = {}

  def flat_fun(*dynamic):
    a, k = _arguments.refill(leaves, traced, treedef, dynamic)
    out, out_tree["tree"] = jax.tree_util.tree_flatten(fun(*a, **k))
    return out

  with _probes.tapping(), _fp8_sites.placing(planner.fp8 is not None):
    closed = jax.make_jaxpr(flat_fun)(*(leaves[i] for i in traced))
  params = {a % len(args) for a in params} if args else set()  # -1: the last
  stored = [owner[i] in params for i in traced]
  return closed, planner.plan(closed.jaxpr, "", live, stored), traced, out_tree


def fp8_sites(fun, args, kwargs, fp8: Fp8Selection,
              params: tuple = ()) -> list[tuple[str, tuple, tuple]]:
  """``(name, leading shape, recipe)`` of each fp8 matmul ``fun(*args)`` makes
  (``params``: the arguments that hold parameters)."""
  _, plan, _, _ = _trace(fun, args, kwargs, Planner(None, (), fp8), params=params)
  return [(name, p.state_shape(idx.shape[:-1]), p.recipe) for name, p, idx in sites(plan)]


def value_and_grad(fun: Callable[..., Any], argnums: tuple[int, ...], *,
                   mode: Optional[str] = None, what_if: Sequence[Any] = (),
                   fp8: Optional[Fp8Selection] = None,
                   allow_int: bool = False) -> Callable[..., Any]:
  """``jax.value_and_grad(fun, argnums, has_aux=True)`` with probes and fp8 sites.

  Returns ``g(gate, fp8_state, *args, **kwargs) -> ((value, aux), grads),
  rows, amax``: ``rows`` ``(measured, probes)``, the measured vector and
  each probe's ``(path, dtype, its slots' indices)`` in forward order
  (``mode`` None: no probes), ``amax`` each fp8 site's absolute
  maxima, ``[*its state's leading shape, 3]`` (a site with one state for a
  loop's iterations: their largest; a non-finite one, as for one tensor,
  makes the row's maximum non-finite), quantised with ``fp8_state``'s scales (``fp8`` None: no
  sites, ``{}``); all computed in the same pass. ``gate`` as `interpret`
  takes it.
  """

  def g(gate, fp8_state, *args, **kwargs):
    nums = tuple(a % len(args) for a in argnums)  # -1: the last argument
    closed, plan, traced, out_tree = _trace(fun, args, kwargs,
                                            Planner(mode, what_if, fp8), nums, nums)
    probes = [(p.path, p.dtype, idx) for p, idx in decode(np.arange(plan.size), plan)
              if p.recipe is None]
    if (mode == "modules" and not probes
        and not _unseen.count(closed.jaxpr, "", None, lambda *_: "")[1]):
      # No mark anywhere, reached or not (`_unseen` warns of those it cannot
      # reach): an empty table would read as "nothing to report". (The walk
      # runs only when the plan found no probe.)
      warnings.warn(
          "Telemetry(mode='modules') found no module to measure: only a model "
          "under jmp_lite.flax.wrap marks its modules' outputs, and only where "
          "it is traced inside the step (a jax.jit of its apply called before, "
          "outside the step, replays a trace without marks: call the wrapped "
          "apply itself). For another function (Equinox, plain JAX) use "
          "Telemetry(mode='ops'), which measures every value, grouped by "
          "jax.named_scope.", stacklevel=3)
    slots = sites(plan)

    def probed(carrier, *args, **kwargs):
      now = jax.tree_util.tree_leaves((args, kwargs))
      outs, measured = interpret(closed.jaxpr, closed.consts, [now[i] for i in traced],
                                 carrier, plan, gate)
      value, aux = jax.tree_util.tree_unflatten(out_tree["tree"], outs)
      return value, (aux, measured)

    shifted = tuple(a + 1 for a in nums)
    carrier = _carrier(plan, slots, fp8_state)
    (value, (aux, measured)), grads = jax.value_and_grad(
        probed, argnums=(0, *shifted), has_aux=True, allow_int=allow_int)(
            carrier, *args, **kwargs)
    both = jnp.where(forward_slots(plan)[0], measured, grads[0])
    # Each probe's slots in `both`, read in one gather (`jmp_lite._stats`).
    rows = (both, probes)
    # A site with one state for a loop's iterations: its largest maxima.
    amax = {name: jnp.max(both[idx][..., :_fp8_sites.ROLES], axis=p.shared_axes())
            for name, p, idx in slots}
    return ((value, aux), tuple(grads[1:])), rows, amax

  return g


def forward(fun: Callable[..., Any], fp8_state: Any, *args, params: tuple = (0,),
            **kwargs) -> Any:
  """``fun(*args, **kwargs)`` with its fp8 sites run with ``fp8_state``'s scales
  (``params``: the arguments that hold parameters, as training differentiates).

  The sites are chosen as the training step chooses them (the state's
  ``select`` and ``recipe``), and each runs the same forward computation
  (`jmp_lite._jaxpr.fp8_sites.matmul`), so for the same inputs and state the
  output is the training forward's, bitwise. Nothing is measured or
  updated.
  """
  if not isinstance(fp8_state, _fp8_state.Fp8State):
    raise TypeError(f"fp8 must be a jmp_lite.fp8.Fp8State (from jmp_lite.fp8.init), "
                    f"got {type(fp8_state).__name__}")
  selection = Fp8Selection(fp8_state.select, fp8_state.recipe, fp8_state.scaling)
  closed, plan, traced, out_tree = _trace(fun, args, kwargs,
                                          Planner(None, (), selection), params=params)
  _rows_as_trained(sites(plan), fp8_state)
  carrier = _carrier(plan, sites(plan), fp8_state)
  now = jax.tree_util.tree_leaves((args, kwargs))
  outs, _ = interpret(closed.jaxpr, closed.consts, [now[i] for i in traced], carrier, plan)
  return jax.tree_util.tree_unflatten(out_tree["tree"], outs)


def _rows_as_trained(slots, fp8_state) -> None:
  """Each loop's site, one state per iteration or one for the loop, as the
  state's rows say it was trained. Training knew its parameters (the
  differentiated arguments); a forward may get them otherwise (closed over,
  frozen weights among the variables), and must still run the state it has."""
  for name, point, idx in slots:
    meta = fp8_state.sites.get(name) if isinstance(fp8_state, _fp8_state.Fp8State) else None
    rows = idx.shape[:-1]
    if meta is None or point.state_shape(rows) == meta.lhs.scale.shape:
      continue
    for shared in itertools.product((False, True), repeat=len(rows)):
      if tuple(n for n, one in zip(rows, shared) if not one) == meta.lhs.scale.shape:
        point.shared = shared
        break


def _carrier(plan: Plan, slots, fp8_state) -> jax.Array:
  """The float32 carrier of ``plan``: zeros, and each fp8 site's scales and
  their reciprocals (`jmp_lite._fp8_numerics.site_carrier`)."""
  carrier = jnp.zeros((plan.size,), jnp.float32)
  if slots or fp8_state is not None:
    scales = _check_state(fp8_state, slots)  # every site of the state, and no other
  if slots:
    # A site with one state for a loop's iterations: the same scales in each row.
    rows = [jnp.broadcast_to(jnp.expand_dims(scales[name], p.shared_axes()),
                             (*idx.shape[:-1], _fp8_sites.ROLES)) for name, p, idx in slots]
    carrier = carrier.at[np.concatenate([i.ravel() for _, _, i in slots])].set(
        _fp8_numerics.site_carrier(rows))
  if _replicas.manual_axes() and _replicas.tracks_varying(_replicas.manual_axes()):
    # Per-device statistics: a carrier varying over every manual axis
    # takes them without the sum a replicated input's gradient gets.
    carrier = jax.lax.pcast(carrier, _replicas.manual_axes(), to="varying")
  return carrier


def _check_state(state, slots) -> dict:
  """The scales of ``state``, checked against the sites the trace found."""
  if not isinstance(state, _fp8_state.Fp8State):
    raise TypeError(f"expected a jmp_lite.fp8.Fp8State, got {type(state).__name__}")
  _fp8_state.same_sites(state.sites, {name: None for name, _, _ in slots})
  for name, point, idx in slots:
    meta = state.sites[name]
    formats = (meta.lhs.dtype, meta.grad.dtype)
    want = tuple(_fp8_numerics.FORMATS[f] for f in point.recipe)
    rows = point.state_shape(idx.shape[:-1])
    if formats != want or meta.lhs.scale.shape != rows:
      raise ValueError(
          f"fp8 site {name!r}: the state has formats {[d.name for d in formats]} and "
          f"rows {meta.lhs.scale.shape}, the step {[d.name for d in want]} and "
          f"{rows}. Make the state with jmp_lite.fp8.init on this step.")
  return state.scales()
