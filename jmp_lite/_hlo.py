"""The collectives XLA's partitioner puts into a compiled step, read from its HLO.

Under ``jax.jit`` with sharded arrays, the communication a step does is
decided by XLA's SPMD partitioner, after JAX has lowered the step: neither the
jaxpr nor the lowered StableHLO shows it, and the compiled program's HLO shows
it after the backend's own passes (XLA:CPU, which has no bfloat16 all-reduce,
widens those to float32). What the partitioner emitted is what a GPU or TPU
runs; `partitioned_hlo` asks XLA to dump the module right after partitioning
(``compile(compiler_options=...)``, JAX's public API, with XLA's
``xla_dump_to`` and ``xla_dump_hlo_pass_re`` debug options) and reads it.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import tempfile
from typing import Any, Callable

import jax
import numpy as np

KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all",
         "collective-permute")

_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+"
    r"(?P<op>[a-z][\w\-]*)\((?P<args>[^)]*)\)")
# An operand: ``%name``, or ``type %name`` in dumps that print operand types.
_OPERAND = re.compile(
    r"(?:^|,)\s*(?:(?P<type>[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+)?"
    r"%?(?P<name>[\w.\-]+)")
_ARRAY = re.compile(r"\b(?P<dtype>pred|[a-z]+[0-9]+[a-z0-9]*)\[(?P<dims>[0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of a partitioned program (one per operand of a tuple).

  Attributes:
    kind: ``"all-reduce"``, ``"reduce-scatter"``, ``"all-gather"``,
      ``"all-to-all"`` or ``"collective-permute"``.
    dtype: the element type it communicates.
    shape: its per-device result.
    bytes: the size of the whole array it combines, per device: the result
      of an all-reduce or all-gather, the operand of a reduce-scatter (a ring
      algorithm moves about twice this for an all-reduce, once for the
      others).
  """

  kind: str
  dtype: np.dtype
  shape: tuple[int, ...]
  bytes: int


def _dtype(name: str) -> np.dtype:
  if name == "pred":
    return np.dtype(bool)
  if name == "bf16":
    return np.dtype(jax.numpy.bfloat16)
  if name.startswith("f8"):
    return np.dtype(getattr(jax.numpy, "float8_" + name[2:]))
  kind = {"f": "float", "s": "int", "u": "uint", "c": "complex"}[name[0]]
  return np.dtype(f"{kind}{name[1:]}")


def _arrays(type_text: str) -> list[tuple[np.dtype, tuple[int, ...]]]:
  return [(_dtype(m["dtype"]), tuple(int(d) for d in m["dims"].split(",") if d))
          for m in _ARRAY.finditer(type_text)]


def _size(dtype: np.dtype, shape: tuple[int, ...]) -> int:
  return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def parse(hlo_text: str) -> tuple[Collective, ...]:
  """The collectives of HLO text, in program order (a loop body's once)."""
  types: dict[str, str] = {}
  found = []
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    types[m["name"]] = m["type"]
    op = m["op"].removesuffix("-start")
    if op not in KINDS:
      continue
    results = _arrays(m["type"])
    operands = [o["type"] or types.get(o["name"], "")
                for o in _OPERAND.finditer(m["args"])]
    for i, (dtype, shape) in enumerate(results):
      size = _size(dtype, shape)
      if op == "reduce-scatter" and i < len(operands):
        size = max([size] + [_size(*a) for a in _arrays(operands[i])])
      found.append(Collective(op, dtype, shape, size))
  return tuple(found)


def partitioned_hlo(fun: Callable[..., Any], *args, **kwargs) -> str:
  """The HLO of ``jax.jit(fun)(*args, **kwargs)`` right after partitioning."""
  jitted = fun if hasattr(fun, "lower") else jax.jit(fun)
  lowered = jitted.lower(*args, **kwargs)
  with tempfile.TemporaryDirectory() as tmp:
    lowered.compile(compiler_options={
        "xla_dump_to": tmp, "xla_dump_hlo_pass_re": "spmd-partitioning"})
    dumps = sorted(pathlib.Path(tmp).glob("*after_spmd-partitioning*.txt"))
    if not dumps:  # nothing to partition (one device)
      dumps = sorted(pathlib.Path(tmp).glob("*before_optimizations.txt"))
    if not dumps:
      raise RuntimeError(
          "XLA wrote no HLO dump for this computation; this JAX/XLA version "
          "may name its dumps differently.")
    return dumps[-1].read_text()
