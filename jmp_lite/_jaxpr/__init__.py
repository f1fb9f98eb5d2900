"""Everything that reads or rewrites a jaxpr: the engine below the public API.

* `traverse`: the one table of how to enter each higher-order primitive, and
  the one evaluator of their bodies, which every pass reads; `rebind`: binding
  one again with its bodies rewritten (autocast's), constants hoisted.
* `internals`: every use of JAX internals and Flax's private API.
* What the passes place in a program: `accumulate` (the float32-accumulating
  matmul and convolution primitives), `probes` (telemetry's statistics),
  `fp8_sites` (an fp8 matmul and its transposes) and `module_scales` (the
  per-module loss scales' conversions).
* `passes`: one module per pass over a traced function. `engine` (float32
  accumulation, with `sink` and `islands`), `autocast` (the op lists),
  `plan` and `instrument` (telemetry and fp8, with `unseen`), `calibrate`
  and `provenance`.

The public modules import this package; nothing here imports them, and
`tests/test_layout.py` holds both and the absence of import cycles. Below it
lie only the numeric helpers it shares with them (`jmp_lite._dtypes`,
`_exact`, `_replicas`, `_fp8_numerics`, `_fp8_state`, ...).
"""
