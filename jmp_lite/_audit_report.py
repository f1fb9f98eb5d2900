"""The rows and report of a precision audit (see `jmp_lite.auditing`)."""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Iterable
from typing import Any, Optional, Union

import jax
import numpy as np

from jmp_lite._jaxpr.passes.audit import FLAGS
from jmp_lite.policy import Policy, dtype_name, parse_dtype


DTypeLike = Any


def _is_float(dtype) -> bool:
  return bool(jax.numpy.issubdtype(dtype, jax.numpy.floating))


@dataclasses.dataclass(frozen=True)
class AuditRow:
  """One precision-relevant equation of a traced function.

  Attributes:
    primitive: the jaxpr primitive name (``"dot_general"``).
    category: ``matmul``, ``conv``, ``reduction``, ``exp_log``,
      ``collective`` or ``convert``.
    operand_dtypes: dtypes of all operands, in order.
    accumulation: the dtype the op accumulates in as written in the jaxpr:
      ``preferred_element_type`` for matmuls and convolutions (their output
      dtype when unset), the output dtype for reductions, None otherwise.
      Backends may accumulate wider internally (GPUs and TPUs do for bf16).
    output_dtypes: dtypes of all results.
    operand_shapes: shapes of all operands.
    reduced_size: elements combined into each output (reductions), else None.
    source: ``file:line (function)`` of the user code that emitted the op.
    path: the sub-jaxprs containing the op, outermost first, e.g.
      ``("scan", "cond.branch1")``; ``()`` at top level.
    in_loop: whether the op runs in a ``scan`` or ``while`` body.
    flags: names of the likely mistakes this op shows (see module docstring).
  """

  primitive: str
  category: str
  operand_dtypes: tuple[np.dtype, ...]
  accumulation: Optional[np.dtype]
  output_dtypes: tuple[np.dtype, ...]
  operand_shapes: tuple[tuple[int, ...], ...]
  reduced_size: Optional[int]
  source: str
  path: tuple[str, ...]
  in_loop: bool
  flags: tuple[str, ...] = ()

  @property
  def float_operand_dtypes(self) -> tuple[np.dtype, ...]:
    return tuple(d for d in self.operand_dtypes if _is_float(d))

  @property
  def signature(self) -> str:
    """Floating operand dtypes and accumulation (or output), ``bf16->f32``."""
    ins = list(dict.fromkeys(map(
        dtype_name, self.float_operand_dtypes or self.operand_dtypes)))
    out = self.accumulation if self.accumulation is not None else (
        self.output_dtypes[0] if self.output_dtypes else None)
    return f"{'+'.join(ins) or '-'}->{dtype_name(out) if out else '-'}"


def _as_dtype(dtype: DTypeLike) -> np.dtype:
  """Any dtype spelling, including jmp_lite's names (``"bf16"``)."""
  return parse_dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype)


def _matches(dtypes: Iterable[np.dtype], want: Optional[DTypeLike]) -> bool:
  dtypes = [d for d in dtypes if _is_float(d)]
  return want is None or (bool(dtypes) and
                          all(d == _as_dtype(want) for d in dtypes))


@dataclasses.dataclass(frozen=True)
class AuditReport:
  """The rows of an audit, with queries for tests.

  Attributes:
    rows: one `AuditRow` per precision-relevant equation, in program order
      (a sub-jaxpr's rows come right after the rows before it).
    policy: the policy the audit checked against, if any.
  """

  rows: tuple[AuditRow, ...]
  policy: Optional[Policy] = None

  @property
  def flags(self) -> tuple[AuditRow, ...]:
    """The flagged rows."""
    return tuple(r for r in self.rows if r.flags)

  def select(self, *,
             primitive: Union[str, Iterable[str], None] = None,
             category: Optional[str] = None,
             operand_dtype: Optional[DTypeLike] = None,
             accumulation: Optional[DTypeLike] = None,
             output_dtype: Optional[DTypeLike] = None,
             flag: Optional[str] = None,
             in_loop: Optional[bool] = None) -> tuple[AuditRow, ...]:
    """Rows matching every given criterion.

    ``operand_dtype`` and ``output_dtype`` match rows whose floating operands
    (outputs) *all* have that dtype. Dtypes may be given as in NumPy or by
    jmp_lite's names (``"bf16"``).
    """
    if isinstance(primitive, str):
      primitive = (primitive,)
    if flag is not None and flag not in FLAGS:
      raise ValueError(f"Unknown flag {flag!r}; flags are {FLAGS}.")
    return tuple(
        r for r in self.rows
        if (primitive is None or r.primitive in primitive)
        and (category is None or r.category == category)
        and _matches(r.operand_dtypes, operand_dtype)
        and (accumulation is None or r.accumulation == _as_dtype(accumulation))
        and _matches(r.output_dtypes, output_dtype)
        and (flag is None or flag in r.flags)
        and (in_loop is None or r.in_loop == in_loop))

  def assert_clean(self, *, allow: Iterable[str] = ()) -> None:
    """Raises `AssertionError` listing the flagged rows, if any.

    For users' own CI: ``audit(step, *args, policy=...).assert_clean()``.

    Args:
      allow: flags to ignore (names from `FLAGS`).
    """
    allow = tuple(allow)
    unknown = [f for f in allow if f not in FLAGS]
    if unknown:
      raise ValueError(f"Unknown flags {unknown}; flags are {FLAGS}.")
    bad = [r for r in self.rows if any(f not in allow for f in r.flags)]
    if bad:
      lines = [f"  {r.primitive} {r.signature} at {_short(r.source)}"
               f"{' in ' + '/'.join(r.path) if r.path else ''}:"
               f" {', '.join(f for f in r.flags if f not in allow)}"
               for r in bad]
      raise AssertionError(
          f"precision audit: {len(bad)} of {len(self.rows)} ops flagged\n"
          + "\n".join(lines))

  def count(self, **criteria) -> int:
    """The number of rows `select` returns for ``criteria``."""
    return len(self.select(**criteria))

  def summary(self) -> dict[tuple[str, str], int]:
    """Counts of ops by primitive and dtype signature (`AuditRow.signature`)."""
    counts = collections.Counter((r.primitive, r.signature) for r in self.rows)
    return dict(sorted(counts.items()))

  def __str__(self) -> str:
    header = ("#", "primitive", "operands", "acc", "out", "where", "source",
              "flags")
    lines = []
    for i, r in enumerate(self.rows):
      lines.append((
          str(i), r.primitive,
          ",".join(dtype_name(d) for d in r.operand_dtypes),
          dtype_name(r.accumulation) if r.accumulation is not None else "",
          ",".join(dtype_name(d) for d in r.output_dtypes),
          "/".join(r.path), _short(r.source), ",".join(r.flags)))
    widths = [max(len(row[c]) for row in [header, *lines])
              for c in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [f"precision audit{f' (policy {self.policy})' if self.policy else ''}:"
           f" {len(self.rows)} ops, {len(self.flags)} flagged",
           fmt.format(*header).rstrip()]
    out += [fmt.format(*line).rstrip() for line in lines]
    out.append("summary:")
    out += [f"  {prim:<20} {sig:<16} {n}"
            for (prim, sig), n in self.summary().items()]
    return "\n".join(out)


def _short(source: str) -> str:
  path, sep, rest = source.partition(":")
  return os.path.basename(path) + sep + rest
