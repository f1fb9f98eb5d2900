"""What the instrumented step cannot reach: fp8 matmuls and telemetry marks
inside bodies it runs as written (`jmp_lite._jaxpr.passes.instrument`).

A ``custom_vjp``/``custom_jvp`` body is not what its derivative rule
computes; a ``shard_map`` nested inside the step is re-bound as it is; a
``while`` loop's condition is evaluated as written (its body is entered).
Matmuls there that the policy puts in fp8 run unquantised in the compute
dtype, and modules there report zeros. That used to be silent; the engine
warns for the same case (`jmp_lite.UncoveredMatmulWarning`), and so does
this.
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional

from jmp_lite._jaxpr import internals as _internals
from jmp_lite._jaxpr.passes.engine import UncoveredMatmulWarning
from jmp_lite._jaxpr import probes as _probes
from jmp_lite._jaxpr import traverse as _traverse

_WHY = {
    "while": "a while loop's condition is run as written (its body is measured)",
    "custom_vjp_call": "a custom_vjp's backward rule, not its body, is what "
                       "differentiates",
    "custom_jvp_call": "a custom_jvp's rule, not its body, is what differentiates",
    "shard_map": "a shard_map nested inside the step is run as it is",
}


def _bodies(eqn):
  """The jaxprs held by ``eqn``'s parameters (branches and bodies)."""
  return [getattr(body, "jaxpr", body) for _, body in _traverse.held_jaxprs(eqn)]


def count(jaxpr, where: str, choose: Optional[Callable], join: Callable) -> tuple[int, int]:
  """``(fp8 matmuls, telemetry marks)`` anywhere inside ``jaxpr``."""
  fp8 = marks = 0
  for eqn in jaxpr.eqns:
    inner = join(where, str(eqn.source_info.name_stack))
    if _probes.tap_info(eqn) is not None:
      marks += 1
      continue
    if choose is not None and choose(eqn, inner)[0] is not None:
      fp8 += 1
    for body in _bodies(eqn):
      f, m = count(body, inner, choose, join)
      fp8, marks = fp8 + f, marks + m
  return fp8, marks


def warn(eqn, where: str, choose: Optional[Callable], join: Callable,
         mode: Optional[str], shown: str, bodies=None) -> None:
  """Warns if ``eqn``, run as written, holds fp8 matmuls or (telemetry's
  ``mode`` ``"modules"``) telemetry marks (in ``bodies``: by default all it
  holds); ``shown`` is its module path, for the message. (``"ops"`` mode
  measures such an equation's outputs.)"""
  fp8 = marks = 0
  for body in (_bodies(eqn) if bodies is None else bodies):
    f, m = count(body, where, choose, join)
    fp8, marks = fp8 + f, marks + m
  marks = marks if mode == "modules" else 0
  if not (fp8 or marks):
    return
  frames = _internals.user_frames(eqn)
  source = (f"{frames[0].file_name}:{frames[0].start_line}" if frames
            else "unknown source")
  what = " and ".join(
      ([f"{fp8} matmul(s) the policy puts in fp8 run unquantised"] if fp8 else [])
      + ([f"{marks} telemetry mark(s) report zeros"] if marks else []))
  name = eqn.primitive.name
  warnings.warn(
      f"jmp_lite: inside {name!r} at {source} (in {shown or 'the top level'}), {what}: "
      f"{_WHY.get(name, 'its body is run as written')}.", UncoveredMatmulWarning,
      stacklevel=5)
