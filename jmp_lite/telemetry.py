"""Precision telemetry: what every module's values and cotangents look like, from inside ``jit``.

Pass a `Telemetry` to `jmp_lite.value_and_grad` or `jmp_lite.TrainState.minimize`
and the step also returns a `PrecisionStats`: per module path (a wrapped Flax
model's module, Linen or NNX, as in `jmp_lite.flax.wrap`'s rules, and each
parameter as the module computes with it, ``"Dense_0/kernel"``, whose
cotangent is the weight gradient in the compute dtype; or a value marked
with `tap` in plain JAX), the largest finite ``|x|`` of its output in the
forward pass and of that output's cotangent in the backward pass, how many
of each were non-finite, and which fraction of the non-zero ones were
subnormal or flushed to zero in the dtype they were held in (and in the
``what_if`` dtypes: "what if this module ran in float16 / e4m3?"). The
cotangents are the scaled ones, as the backward pass holds them.

It is measured in the compiled step itself, with no host callback, by probes
whose statistics come back as the gradient of a small carrier vector
(`jmp_lite._jaxpr.probes`): inside ``nn.scan`` each layer of the stack gets its own
row, inside ``remat``/``checkpoint`` and ``cond`` too. Under ``shard_map`` with
an ``axis_name`` the statistics are reduced across it (maxima by ``pmax``,
counts by ``psum``); under ``jit`` with sharded arrays they are global.

Cost: ``Telemetry(every=K)`` measures on every K-th step: each probe's
reductions sit in a small ``lax.cond``, so the other steps skip them and run
the step itself as compiled without telemetry (one compilation for both).
Without ``telemetry`` nothing changes at all. ``bench/`` (section
``telemetry``) times the three side by side.

Example:
  >>> import jax, jax.numpy as jnp, flax.linen as nn
  >>> import jmp_lite, jmp_lite.flax
  >>> model = jmp_lite.flax.wrap(nn.Dense(3), "p=f32,c=f16,o=f32")
  >>> x = jnp.ones((2, 4))
  >>> params = model.init(jax.random.key(0), x)["params"]
  >>> loss = lambda p: jnp.sum(model.apply({"params": p}, x) ** 2)
  >>> vg = jmp_lite.value_and_grad(loss, telemetry=jmp_lite.Telemetry())
  >>> value, grads, finite, stats = vg(params)
  >>> # The module's parameters as it computes with them (their cotangents
  >>> # are the weight gradients), then its output ("": the wrapped model).
  >>> list(stats.modules), stats.modules[""].dtype, int(stats.modules[""].forward_nonfinite)
  (['kernel', 'bias', ''], 'float16', 0)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._jaxpr import probes as _probes
from jmp_lite import _struct
from jmp_lite.policy import dtype_to_names
from jmp_lite.policy import parse_dtype

__all__ = ("ModuleStats", "PrecisionStats", "Telemetry", "tap")

_MODES = ("modules", "ops")


def tap(tree: Any, name: str) -> Any:
  """Marks ``tree``'s floating values as ``name``'s output, for `Telemetry`.

  For plain JAX functions (and inside modules) what `jmp_lite.flax.wrap`
  does for every module: ``Telemetry`` reports the marked values and their
  cotangents under ``name``. The identity, and free, outside a telemetry
  step.

  Raises:
    TypeError: if ``name`` is not a string.
  """
  if not isinstance(name, str):
    raise TypeError(f"tap: name must be a string, got {name!r}")
  return _probes.tap(tree, name)


@dataclasses.dataclass(frozen=True)
class Telemetry:
  """What to measure, and how often.

  Attributes:
    every: measure on steps where ``step % every == 0`` (`TrainState.minimize`
      counts with ``state.step``; `jmp_lite.value_and_grad` takes ``step=``).
    what_if: further dtypes (``"f16"``, ``"float8_e4m3fn"``...) in which to
      count the values that would underflow.
    mode: ``"modules"``: each module's output (`tap` marks); ``"ops"``: every
      floating intermediate, grouped by name scope (`jax.named_scope`, Flax
      module paths), for functions without marks. Costs more.
  """

  every: int = 1
  what_if: tuple = ()
  mode: str = "modules"

  def __post_init__(self):
    if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
      raise ValueError(f"Telemetry: every must be an int >= 1, got {self.every!r}")
    if self.mode not in _MODES:
      raise ValueError(f"Telemetry: mode must be one of {_MODES}, got {self.mode!r}")
    what_if = (self.what_if,) if isinstance(self.what_if, str) else tuple(self.what_if)
    dtypes = []
    for d in what_if:
      try:
        # Names as policies write them ("f16", "e4m3": NumPy reads "f16"
        # as float128), else any dtype.
        dt = parse_dtype(d) if isinstance(d, str) else np.dtype(d)
      except (TypeError, ValueError) as e:
        if "not a floating dtype" in str(e):
          raise ValueError(f"Telemetry: what_if entry {d!r} is not a floating dtype") from e
        raise TypeError(f"Telemetry: what_if entry {d!r} is not a dtype") from e
      if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"Telemetry: what_if entry {d!r} is not a floating dtype")
      dtypes.append(dt)
    object.__setattr__(self, "what_if", tuple(dtypes))

  def sample(self, step) -> Any:
    """Whether to measure at ``step`` (a bool, traced when ``step`` is)."""
    if step is not None and not (
        isinstance(step, (int, np.integer)) and not isinstance(step, bool)
        or jnp.issubdtype(getattr(step, "dtype", np.float64), jnp.integer)):
      raise TypeError(f"Telemetry: the step must be an integer, got {step!r}")
    if self.every == 1 or step is None:
      return True
    return jnp.asarray(step) % self.every == 0


@_struct.register_state
@dataclasses.dataclass(frozen=True)
class ModuleStats:
  """One module's (or tap's) statistics for one step.

  Arrays are scalars, or have one leading axis per ``scan`` the module runs
  in (a layer axis for a scanned stack).

  Attributes:
    dtype: the dtype the output was held in.
    forward_max: largest finite ``|x|`` of the output.
    forward_nonfinite: count of inf/NaN elements of the output.
    forward_underflow: per dtype name (``dtype`` and each ``what_if``): of
      the non-zero finite elements, the fraction below that dtype's smallest
      normal (subnormal there, or flushed to zero). Where the value crosses
      a cast (a parameter cast to the compute dtype; the model's output cast
      to the output dtype, whose cotangent the backward pass casts back), a
      value that cast turns into zero counts as non-zero and underflowed: a
      total flush reads 1.0, not 0. (A cotangent that an operation inside
      the model rounds to zero is not told apart from a zero: only casts
      are seen.)
    backward_max, backward_nonfinite, backward_underflow: the same of the
      output's cotangent (scaled by the loss scale).
  """

  forward_max: jax.Array
  forward_nonfinite: jax.Array
  forward_underflow: Mapping[str, jax.Array]
  backward_max: jax.Array
  backward_nonfinite: jax.Array
  backward_underflow: Mapping[str, jax.Array]
  dtype: str = _struct.static_field(default="float32")


@_struct.register_state
@dataclasses.dataclass(frozen=True)
class PrecisionStats:
  """A step's telemetry: `ModuleStats` per path, in forward order.

  Attributes:
    sampled: whether this step was measured (``Telemetry.every``); the
      statistics of a step that was not are zeros.
    modules: path -> `ModuleStats`; ``""`` is the wrapped model itself
      (read from ``rows``).
    rows: float32 ``[n, 2, 2 + d]``, a row per module (and layer of a
      scanned stack) in ``order``: forward then backward, the largest
      finite ``|x|``, the non-finite count and the underflow fraction in
      each dtype of ``layout``. One array, so that the compiled step
      returns the statistics of every module as one value.
    cotangent_underflow: of all non-zero cotangents held in a 16-bit (or
      narrower) float, the fraction below that dtype's smallest normal,
      counting as non-zero and below it the loss cotangents that the cast
      into the model's compute dtype flushes to zero (see ``ModuleStats``).
    cotangent_headroom: the smallest ratio, over those dtypes' modules, of
      the dtype's maximum to the largest cotangent (inf if none): how many
      times the loss scale could still grow. `jmp_lite.UnderflowAwareLossScale`
      reads both.
    cotangent_upper: of all those cotangents (zeros included), the fraction
      in the upper bin: at or above 1/16 of the dtype's maximum, or not
      finite (Graphcore's automatic loss scaling histogram, with PopART's
      default bin edge). `jmp_lite.AutomaticLossScale` reads it.
    layout: per module in forward order, ``(path, dtype, layer shape,
      ((underflow dtype name, its column), ...))``.
    order: the paths in the order their values were computed.
  """

  sampled: jax.Array
  rows: jax.Array
  cotangent_underflow: jax.Array
  cotangent_headroom: jax.Array
  cotangent_upper: jax.Array
  layout: tuple = _struct.static_field(default=())

  @property
  def order(self) -> tuple[str, ...]:
    return tuple(path for path, *_ in self.layout)

  @property
  def modules(self) -> dict[str, ModuleStats]:
    """path -> `ModuleStats`, in forward order (NumPy arrays outside a
    trace, slices of ``rows`` inside one)."""
    try:
      rows, xp = np.asarray(self.rows), np
    except jax.errors.TracerArrayConversionError:
      rows, xp = self.rows, jnp
    out, at = {}, 0
    for path, dtype, shape, names in self.layout:
      n = int(np.prod(shape, dtype=int))
      block = rows[at:at + n].reshape(*shape, *rows.shape[1:])
      at += n
      sides = [(block[..., s, 0], block[..., s, 1].astype(xp.int32),
                {name: block[..., s, 2 + i] for name, i in names}) for s in (0, 1)]
      out[path] = ModuleStats(*sides[0], *sides[1], dtype=dtype)
    return out

  def first_nonfinite(self) -> Optional[str]:
    """Where a non-finite value first appeared: forward, else backward.

    Forward, the first module in forward order whose output holds inf/NaN
    (a module's submodules come before it). Backward, the last such in
    forward order, where the backward pass starts. With a layer index for a
    scanned stack (``"blocks[1]/Dense_0"`` style: ``"blocks/Dense_0 (layer 1)"``).
    None if every value was finite.
    """
    rows = _rows(self)
    for row in rows:
      if row["forward_nonfinite"] > 0:
        return row["name"] + " (forward)"
    for row in reversed(rows):
      if row["backward_nonfinite"] > 0:
        return row["name"] + " (backward)"
    return None

  def table(self, *, max_rows: Optional[int] = None) -> str:
    """The statistics as a text table, one row per module (and layer)."""
    rows = _rows(self)
    if not bool(np.asarray(self.sampled)):
      return "(telemetry: this step was not sampled)"
    # Underflow in the dtype each value was held in, then in each what-if one.
    what_if = []
    for stats in self.modules.values():
      # Pytree dicts come back from jit sorted by key: the held dtype is
      # found by name, not position.
      what_if += [d for d in stats.forward_underflow
                  if d != stats.dtype and d not in what_if]
    head = ["module", "dtype", "fwd max", "nonfin", "subnormal"]
    head += [f"<{_short(d)}" for d in what_if]
    head += ["bwd max", "nonfin", "subnormal"] + [f"<{_short(d)}" for d in what_if]
    lines = [head]
    for row in rows[:max_rows]:
      for side in ("forward", "backward"):
        under = row[f"{side}_underflow"]
        cells = [_num(row[f"{side}_max"]), str(row[f"{side}_nonfinite"]),
                 _pct(under[row["dtype"]])] + [_pct(under.get(d)) for d in what_if]
        if side == "forward":
          line = [row["name"], _short(row["dtype"]), *cells]
        else:
          line += cells
      lines.append(line)
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                     for i, (c, w) in enumerate(zip(line, widths)))
           for line in lines]
    if max_rows is not None and len(rows) > max_rows:
      out.append(f"... {len(rows) - max_rows} more rows")
    return "\n".join(out)


def _short(dtype_name: str) -> str:
  names = dtype_to_names.get(np.dtype(dtype_name), ())
  return min(names, key=len) if names else dtype_name


def _num(x: float) -> str:
  return "0" if x == 0 else f"{x:.3g}"


def _pct(x: Optional[float]) -> str:
  """A fraction as a percentage of two significant digits: ``"1e+02%"`` was
  what ``:.2g`` made of 100, and a share short of all never reads as all."""
  if x is None:
    return "-"
  p = 100 * float(x)
  if p == 0:
    return "0%"  # -0.0 too
  if p == 100:
    return "100%"
  if p >= 99.5:
    return ">99%"
  return f"{p:.2g}%" if p < 10 else f"{p:.0f}%"


def _rows(stats: PrecisionStats) -> list[dict]:
  """Host-side rows, one per module and layer, in forward order."""
  host = jax.device_get(stats.modules)
  # Consecutive paths with the same layer axes ran in one scan: layer by
  # layer, in the order they ran.
  groups: list[list[str]] = []
  for path in stats.order or sorted(host):
    shape = np.shape(host[path].forward_max)
    if groups and shape and np.shape(host[groups[-1][0]].forward_max) == shape:
      groups[-1].append(path)
    else:
      groups.append([path])
  rows = []
  for group in groups:
    shape = np.shape(host[group[0]].forward_max)
    for index, path in ((i, p) for i in np.ndindex(*shape) for p in group):
      s = host[path]
      name = path or "(model)"
      if index:
        name += " (layer " + ",".join(map(str, index)) + ")"
      rows.append({
          "name": name, "dtype": s.dtype,
          "forward_max": float(s.forward_max[index]),
          "forward_nonfinite": int(s.forward_nonfinite[index]),
          "forward_underflow": {d: float(v[index])
                                for d, v in s.forward_underflow.items()},
          "backward_max": float(s.backward_max[index]),
          "backward_nonfinite": int(s.backward_nonfinite[index]),
          "backward_underflow": {d: float(v[index])
                                 for d, v in s.backward_underflow.items()},
      })
  return rows
