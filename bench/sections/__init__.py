"""Benchmark sections. Registration point: add a module here and to `SECTIONS`.

A section module defines:

* ``NAME``: the key used by ``--only`` and in the JSON output;
* ``TITLE`` and ``DESCRIPTION``: the markdown heading and the paragraph under it
  (what is measured, and how);
* ``run(ctx: harness.Context) -> harness.SectionResult``, choosing its sizes
  with ``ctx.pick`` (CPU, GPU/TPU and dry-run sizes) so that it runs unchanged
  on every platform.

Sections run in the order listed. A section that raises is reported as failed
in the output and the run goes on with the next one.
"""

from bench.sections import all_finite
from bench.sections import compile_time
from bench.sections import compiles
from bench.sections import fp8
from bench.sections import fused_clip
from bench.sections import guard
from bench.sections import imports
from bench.sections import matmul
from bench.sections import memory
from bench.sections import steps
from bench.sections import telemetry

# Later sections (the Flax `wrap` bench, an autocast bench, the examples' timings)
# go here, in the order they should run.
SECTIONS = {m.NAME: m for m in (all_finite, matmul, steps, fused_clip, guard,
                                compiles, compile_time, memory, imports,
                                telemetry, fp8)}
