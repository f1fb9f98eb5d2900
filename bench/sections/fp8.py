"""fp8 matmuls by policy: step time, compile time, what the emulation costs."""

from __future__ import annotations

import contextlib
import functools
import re
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from bench import harness
from bench import models
from bench.harness import Column, HardwareClass, SectionResult, Table, Target

NAME = "fp8"
TITLE = "fp8 matmuls (hybrid: e4m3 operands, e5m2 gradients) against bf16 and f32"
DESCRIPTION = (
    "The jitted `jmp_lite.TrainState.minimize` step (forward, backward, Adam, "
    "a dynamic loss scale, the state donated) of the MLP (4 × Dense 1024, "
    "batch 256 on a CPU; 4 × Dense 4096, batch 2048 on a GPU), timed side by "
    "side: plain float32 (traced at matmul precision "
    "highest); `jmp_lite.flax.wrap(model, \"p=f32,c=bf16,o=f32\")`; and the "
    "same wrap with the rule `{nn.Dense: \"p=f32,c=bf16,o=f32,fp8=hybrid\"}` "
    "and the state of `jmp_lite.fp8.init` (delayed scaling, history length "
    "1024; and once more with current and with block scaling) in "
    "`TrainState.create(..., fp8=)`, which quantises every Dense "
    "layer's operands to e4m3 and its output gradient to e5m2 and multiplies "
    "the fp8 arrays themselves (an fp8 `dot_general` accumulating in float32, "
    "the two scales applied to the product: Transformer Engine's GEMM; e5m2 × "
    "e4m3 for both backward products). Also: each step's trace-and-lower and XLA compile "
    "times; what the program given to XLA and the compiled one contain (dots "
    "on fp8 arrays; converts to f8e4m3fn and f8e5m2, reductions, the operand "
    "dtypes of every compiled dot, and how many run on fp8 operands); XLA's "
    "temporary buffers (the residuals of the backward pass live there); how "
    "this backend compiles a plain f8 × f8 dot; the "
    "bytes of the fp8 metadata against the parameters'; and what to expect on "
    "each class of hardware. Targets, on GPUs with fp8 units (sm ≥ 8.9): the "
    "fp8 step ≤ 0.9× the bf16 step, and every matmul of the fp8 step (forward, "
    "input and weight gradients of the fp8 layers) compiled to an fp8 GEMM. "
    "Elsewhere "
    "fp8 is emulated and the figures are its cost, not a speed-up.")

POLICY = "p=f32,c=bf16,o=f32"
VARIANTS = (
    # name, label, policy given to wrap (None: the plain float32 model), fp8 rule
    ("f32", "f32 (precision highest)", None, False),
    ("bf16", f"bf16 compute: wrap {POLICY}", POLICY, False),
    ("fp8", f"bf16 + fp8 hybrid on Dense: rule {POLICY},fp8=hybrid", POLICY, "delayed"),
    ("fp8_current", "the same fp8, current scaling (fp8.init(..., scaling=\"current\"))",
     POLICY, "current"),
    ("fp8_block", "the same fp8, block scaling (MXFP8: scaling=\"block\")",
     POLICY, "block"),
)
HISTORY_LENGTHS = (1024, 16)  # the default (Flax's and TE's too), a short one


@functools.lru_cache(maxsize=None)
def _native_fp8() -> bool:
  """Whether the device at hand has fp8 matrix units (`jmp_lite.hardware`)."""
  import jmp_lite.hardware

  return any(d.startswith("float8") for d in jmp_lite.hardware.describe().matrix_dtypes)


def _fp8_units(ctx: harness.Context) -> bool:
  # A forced GPU plan is made for the GPUs the fp8 targets are meant for, as
  # `plan.make_plan` gives a forced GPU plan bf16 units.
  return ctx.platform == "gpu" and (ctx.assumed or _native_fp8())


FP8_UNITS = HardwareClass(
    "GPUs with fp8 matrix units (sm ≥ 8.9: Ada, Hopper, Blackwell; CUDA ≥ 12)",
    "no fp8 units: fp8 is emulated", _fp8_units)

# What to expect, by hardware class: (label, bf16 vs f32, fp8 vs bf16, why,
# expected sign of bf16/f32 - 1 and of fp8/bf16 - 1: "<" faster, ">" slower).
EXPECT = {
    "cpu_nobf16": (
        "CPU without bf16 matrix units (AVX2 only)", "> 1× (slower)",
        "> 1× (slower still)",
        "XLA:CPU converts bf16 dots to float32 at run time; fp8 adds the "
        "quantising converts, amax reductions and scale multiplies, and its "
        "dots convert fp8 operands to float32", ">", ">"),
    "cpu_bf16": (
        "CPU with avx512_bf16 or AMX", "< 1× (faster)", "> 1× (emulated)",
        "the bf16 dots run on the bf16 units; XLA:CPU has no fp8 dot (an "
        "f8 × f8 dot is converted to float32, see the probe), so the fp8 step "
        "is the bf16 step plus the emulation", "<", ">"),
    "gpu_nofp8": (
        "GPU without fp8 units (< sm89, e.g. A100)", "< 1× (from sm80)",
        "> 1× (emulated)",
        "XLA turns a dot of fp8 operands into a cuBLASLt fp8 GEMM only on "
        "sm ≥ 8.9 with CUDA ≥ 12; below that it converts them and runs a "
        "wider GEMM", "<", ">"),
    "gpu_fp8": (
        "GPU with fp8 units (sm ≥ 8.9: Ada, Hopper, Blackwell)", "< 1×",
        "< 1× where matmuls dominate",
        "the dots become fp8 GEMMs (twice the bf16 tensor-core rate); the "
        "quantising converts and amax reductions remain, memory-bound passes "
        "that small layers do not amortise", "<", "<"),
    "tpu": ("TPU", "< 1×", "no claim (not measured)",
            "this bench has not been run on a TPU", "<", None),
}

_F8 = ("f8e4m3fn", "f8e5m2")
_CONVERT_TO = {t: re.compile(rf"=\s*{t}\[[^\]]*\]\S*\s+convert\(") for t in _F8}
_CONVERT = re.compile(r"\]\S*\s+convert\(")
_REDUCE = re.compile(r"\]\S*\s+reduce\(")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=", re.MULTILINE)
_LOWERED_DOT = re.compile(r"stablehlo\.dot_general.*")
_LOWERED_F8 = re.compile(r"xf8E(?:4M3FN|5M2)>")


def lowered_fp8_dots(lowered_text: str) -> tuple[int, int]:
  """``(dots on fp8 operands, all dots)`` of a lowered (StableHLO) program:
  what XLA is given, before any backend rewrites it."""
  dots = _LOWERED_DOT.findall(lowered_text)
  return sum(1 for d in dots if len(_LOWERED_F8.findall(d.split("->")[0])) == 2), len(dots)


def hardware_class(ctx: harness.Context) -> str:
  if ctx.platform == "cpu":
    return "cpu_bf16" if ctx.bf16_units else "cpu_nobf16"
  if ctx.platform == "gpu":
    return "gpu_fp8" if _fp8_units(ctx) else "gpu_nofp8"
  return "tpu"


def hlo_counts(hlo_text: str) -> dict:
  """What a compiled program contains: fp8 converts, converts, reductions,
  instructions (fused computations included), dots by dtype, fp8 GEMMs."""
  dots = harness.dot_list(hlo_text)
  return {
      "to_e4m3": len(_CONVERT_TO["f8e4m3fn"].findall(hlo_text)),
      "to_e5m2": len(_CONVERT_TO["f8e5m2"].findall(hlo_text)),
      "converts": len(_CONVERT.findall(hlo_text)),
      "reduces": len(_REDUCE.findall(hlo_text)),
      "instructions": len(_INSTRUCTION.findall(hlo_text)),
      "census": harness.dot_census(hlo_text),
      "fp8_dots": sum(1 for a, b, _, _ in dots if a in _F8 or b in _F8),
  }


def _f8_dot_probe() -> str:
  """How this backend compiles an f8e4m3fn × f8e4m3fn dot (f32 output)."""
  a = jnp.ones((64, 64), jnp.float8_e4m3fn)
  fn = jax.jit(lambda a, b: jax.lax.dot(a, b, preferred_element_type=jnp.float32))
  try:
    text = harness.compiled_text(fn, a, a)
  except Exception as e:  # a backend that cannot compile it is a finding
    return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
  census = harness.format_census(harness.dot_census(text)) or "no dot"
  converts = len(_CONVERT.findall(text))
  return f"{census}" + (f" after {converts} converts" if converts else "")


def _build(w, variant, params0, x, y, ctx):
  """(zero-argument step, compile facts) for one variant."""
  import jmp_lite
  import jmp_lite.flax

  name, _, policy, fp8 = variant
  module = w.module(None)
  if policy is not None:
    rules = {nn.Dense: policy + ",fp8=hybrid"} if fp8 else None
    module = jmp_lite.flax.wrap(module, policy, rules=rules)

  def loss(params, x, y):
    return models.cross_entropy(module.apply({"params": params}, x), y)

  state_fp8 = jmp_lite.fp8.init(loss, params0, x, y, scaling=fp8) if fp8 else None
  params = jax.tree_util.tree_map(jnp.copy, params0)  # donated below
  state = jmp_lite.TrainState.create(
      apply_fn=module.apply, params=params, tx=optax.adam(1e-3),
      loss_scale=jmp_lite.DynamicLossScale(2.0 ** 15), fp8=state_fp8)
  step = jax.jit(lambda s, x, y: s.minimize(loss, x, y), donate_argnums=0)
  scope = (jax.default_matmul_precision("highest") if name == "f32"
           else contextlib.nullcontext())
  t0 = time.perf_counter()
  with scope:
    lowered = step.lower(state, x, y)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  given_fp8, given = lowered_fp8_dots(lowered.as_text())
  facts = {"lower_s": t1 - t0, "compile_s": t2 - t1, "given_fp8_dots": given_fp8,
           "given_dots": given, **hlo_counts(compiled.as_text())}
  try:
    facts["temp_bytes"] = compiled.memory_analysis().temp_size_in_bytes
  except Exception:  # not every backend reports it
    facts["temp_bytes"] = None
  if fp8:
    facts["sites"] = list(state_fp8.sites)
    facts["fp8_state"] = state_fp8
  holder = [state]
  state, info = compiled(holder[0], x, y)  # the first step: loss at params0
  holder[0] = state
  facts["first_loss"] = float(info.loss)

  def call():
    holder[0], info = compiled(holder[0], x, y)
    return info.loss

  return call, facts


def _residual_bytes(fun, params, x) -> tuple[int, int, str]:
  """Bytes of the residuals ``jax.vjp(fun)`` keeps for the backward pass (the
  engine's residual figure, `bench.sections.memory`), the bytes of those
  that are constants, and the dtypes of all.

  A constant is a residual of more than one element, all equal, that is the
  same array when the parameters and the batch change (``jax.vjp`` of
  ``jax.nn.relu`` keeps the zeros its derivative selects from, a broadcast
  of a literal that a compiled step rematerialises rather than stores).
  """
  def leaves(p, x):
    # Differentiated with respect to the parameters only, as a train step is.
    vjp_fn = jax.vjp(functools.partial(jax.jit(fun), x=x), p)[1]
    return [np.asarray(a) for a in jax.tree_util.tree_leaves(vjp_fn) if hasattr(a, "dtype")]

  first = leaves(params, x)
  other = leaves(jax.tree.map(lambda a: a * 1.25 + 0.01, params), x * 1.25 + 0.01)
  by_dtype, constant = {}, 0
  for a, b in zip(first, other):
    by_dtype[a.dtype.name] = by_dtype.get(a.dtype.name, 0) + a.nbytes
    if (a.size > 1 and a.shape == b.shape and np.array_equal(a, b)
        and np.all(a.reshape(-1) == a.reshape(-1)[0])):
      constant += a.nbytes
  kinds = ", ".join(f"{k} {harness.human_bytes(v)}"
                    for k, v in sorted(by_dtype.items(), key=lambda kv: -kv[1]))
  return sum(by_dtype.values()), constant, kinds


def _residual_table(w, params0, x, y) -> tuple[Table, dict]:
  """The backward pass's residuals: the bf16 step's against each fp8 recipe's
  (the fp8 forward is `jmp_lite.fp8.forward`, which runs the step's sites)."""
  import jmp_lite
  import jmp_lite.flax

  bf16 = jmp_lite.flax.wrap(w.module(None), POLICY)
  fp8_model = jmp_lite.flax.wrap(w.module(None), POLICY,
                                 rules={nn.Dense: POLICY + ",fp8=hybrid"})

  def loss8(params, x, y):
    return models.cross_entropy(fp8_model.apply({"params": params}, x), y)

  total, const, kinds = _residual_bytes(
      lambda p, x: models.cross_entropy(bf16.apply({"params": p}, x), y), params0, x)
  base, raw_base = total - const, total
  table = Table(
      "Residuals kept for the backward pass (`jax.vjp` of the loss)",
      [Column("variant", "variant"), Column("total", "residuals", "bytes"),
       Column("constants", "of which constants", "bytes"),
       Column("bytes", "kept (residuals - constants)", "bytes"),
       Column("vs_bf16", "kept vs bf16", "ratio"),
       Column("raw_vs_bf16", "residuals vs bf16", "ratio"), Column("kinds", "by dtype")])
  table.add(variant="bf16 compute", total=total, constants=const, bytes=base, vs_bf16=1.0,
            raw_vs_bf16=1.0, kinds=kinds)
  ratios = {}
  for _, label, _, scaling in VARIANTS:
    if not scaling:
      continue
    st = jmp_lite.fp8.init(loss8, params0, x, y, scaling=scaling)
    total, const, kinds = _residual_bytes(
        lambda p, x: jmp_lite.fp8.forward(loss8, st)(p, x, y), params0, x)
    ratios[scaling] = (total - const) / base
    table.add(variant=label, total=total, constants=const, bytes=total - const,
              vs_bf16=(total - const) / base, raw_vs_bf16=total / raw_base, kinds=kinds)
  table.notes.append(
      "Each fp8 matmul keeps its operands in fp8 (a byte an element; block "
      "scaling adds an int32 exponent per 32), where the bf16 step keeps bf16 "
      "copies; an operand whose own cotangent nobody asks for (the first "
      "layer's input) frees the other operand's fp8 copy. What is left in bf16 "
      "and f32 is the model's own: the loss's softmax, the ReLU masks and, in "
      "bf16, the zeros each ReLU's derivative selects from.")
  table.notes.append(
      "Constants: residuals of more than one element, all equal, that stay the "
      "same array when the parameters and the batch change (here the ReLU "
      "zeros: `jax.vjp` holds a broadcast of a literal as an array, which a "
      "compiled step rematerialises instead of storing). They are the same "
      "bytes in every variant; the target reads the bytes kept without them, "
      "and 'residuals vs bf16' gives the ratio with them.")
  return table, ratios


def _memory_table(w, params0, x, y, facts) -> Table:
  import jmp_lite
  import jmp_lite.flax

  module = jmp_lite.flax.wrap(w.module(None), POLICY,
                              rules={nn.Dense: POLICY + ",fp8=hybrid"})

  def loss(params, x, y):
    return models.cross_entropy(module.apply({"params": params}, x), y)

  params_bytes = harness.tree_bytes(params0)
  adam_bytes = harness.tree_bytes(jax.eval_shape(optax.adam(1e-3).init, params0))
  table = Table(
      "fp8 metadata (`Fp8State`) against the parameters",
      [Column("history", "history length", "{}"), Column("sites", "fp8 matmuls", "{}"),
       Column("bytes", "fp8 state", "bytes"), Column("per_site", "per matmul", "bytes"),
       Column("params", "parameters (f32)", "bytes"),
       Column("vs_params", "vs parameters", "{:.3g}%"),
       Column("vs_train", "vs parameters + Adam state", "{:.3g}%")])
  for history in HISTORY_LENGTHS:
    st = (facts["fp8_state"] if history == 1024
          else jmp_lite.fp8.init(loss, params0, x, y, history_length=history))
    n = harness.tree_bytes(st)
    table.add(history=history if history != 1024 else "1024 (default, timed)",
              sites=len(st.sites), bytes=n, per_site=n / len(st.sites),
              params=params_bytes, vs_params=100 * n / params_bytes,
              vs_train=100 * n / (params_bytes + adam_bytes))
  table.notes.append(
      "Per fp8 matmul: three float32 amax histories (lhs, rhs, gradient) and "
      "three scales, plus three observed maxima: 4 × (3 × history + 6) bytes; "
      "one int32 schema version per state. It does not grow with the layer's "
      "width, so its share falls as the model grows; it lives in the "
      "optimiser state (`LossScaleState.fp8`) and is checkpointed with it.")
  table.notes.append(
      f"Adam state (f32 moments and a count): {harness.human_bytes(adam_bytes)}.")
  return table


def _expect_table(here: str, ctx: harness.Context) -> Table:
  table = Table(
      "What to expect, by hardware class (step time ratios)",
      [Column("hardware", "hardware class"), Column("bf16", "bf16 step vs f32"),
       Column("fp8", "fp8 step vs bf16"), Column("why", "why"),
       Column("here", "this run")])
  for key, (label, bf16, fp8, why, _, _) in EXPECT.items():
    mark = ""
    if key == here:
      mark = "← this plan (assumed)" if ctx.assumed else "← here"
    table.add(hardware=label, bf16=bf16, fp8=fp8, why=why, here=mark)
  return table


def _reading(here: str, bf16_vs_f32: float, fp8_vs_bf16: float,
             ctx: harness.Context) -> str:
  label, _, _, _, bf16_op, fp8_op = EXPECT[here]

  def verdict(value, op):
    if op is None:
      return "no expectation"
    ok = value < 1.0 if op == "<" else value > 1.0
    return "as expected" if ok else f"NOT as expected: {op} 1× expected"

  text = (f"Reading for this plan's class, {label}: bf16 step "
          f"{bf16_vs_f32:.2f}× f32 ({verdict(bf16_vs_f32, bf16_op)}), fp8 step "
          f"{fp8_vs_bf16:.2f}× bf16 ({verdict(fp8_vs_bf16, fp8_op)}).")
  if ctx.dry_run:
    text += " A dry run: tiny sizes and one round, the ratios mean nothing."
  elif ctx.assumed:
    text += " The plan was forced: the device at hand is not of this class."
  return text


def run(ctx: harness.Context) -> SectionResult:
  result = SectionResult()
  here = hardware_class(ctx)
  w = models.mlp(ctx.size_key)
  ctx.log(f"fp8: {w.description}")
  params0 = w.init(ctx.seed)
  x, y = w.batch(ctx.seed)

  calls, facts = {}, {}
  for variant in VARIANTS:
    start = time.perf_counter()
    calls[variant[0]], facts[variant[0]] = _build(w, variant, params0, x, y, ctx)
    ctx.log(f"fp8: {variant[0]} built, compiled and run once in "
            f"{time.perf_counter() - start:.1f} s")
  t = harness.measure(calls, ctx)
  f32, bf16, fp8 = (t[n].median for n in ("f32", "bf16", "fp8"))

  steps = Table(
      f"mlp: train step (TrainState.minimize, Adam) — {w.description}",
      [Column("variant", "variant"), Column("ms", "step ms", "ms"),
       Column("vs_f32", "vs f32", "ratio"), Column("vs_bf16", "vs bf16", "ratio"),
       Column("lower_s", "trace + lower s", "{:.2f}"),
       Column("compile_s", "XLA compile s", "{:.2f}"),
       Column("loss", "first loss", "{:.4f}"), Column("spread", "spread", "pct")])
  for name, label, _, _ in VARIANTS:
    f = facts[name]
    steps.add(variant=label, ms=t[name].median, vs_f32=t[name].median / f32,
              vs_bf16=t[name].median / bf16, lower_s=f["lower_s"],
              compile_s=f["compile_s"], loss=f["first_loss"], spread=t[name].spread)
  sites = facts["fp8"]["sites"]
  steps.notes.append(
      f"fp8 matmuls: {len(sites)} ({', '.join(sites)}), every Dense layer "
      "including the logits layer; each has three quantised tensors (the "
      "activation and the kernel in e4m3, the output gradient in e5m2).")
  steps.notes.append(
      "Every variant uses the same step: `DynamicLossScale(2**15)`, its "
      "finiteness check and skip, Adam on float32 parameters. The first fp8 "
      "step quantises with scales of 1 (empty histories); later steps use the "
      "delayed scales. Compile times are single measurements (one compile "
      "each), so they move with the load more than the interleaved step "
      "times; " + ("this dry run compiles at -O0 and may hit a persistent "
                   "compilation cache." if ctx.dry_run else
                   "the fp8 step traces its fp8 sites once more in "
                   "`fp8.init`, not counted here."))
  result.tables.append(steps)

  hlo = Table(
      "What the compiled step contains (optimised HLO, fusions included)",
      [Column("variant", "variant"), Column("to_e4m3", "converts → f8e4m3fn", "{}"),
       Column("to_e5m2", "converts → f8e5m2", "{}"),
       Column("converts", "all converts", "{}"), Column("reduces", "reduces", "{}"),
       Column("instructions", "instructions", "{}"),
       Column("given", "fp8 dots given to XLA", "{}"),
       Column("dots", "compiled dots (lhs·rhs→out)"), Column("fp8_dots", "fp8 GEMMs", "{}"),
       Column("temp", "XLA temp buffers", "bytes")])
  for name, label, _, _ in VARIANTS:
    f = facts[name]
    hlo.add(variant=label, to_e4m3=f["to_e4m3"], to_e5m2=f["to_e5m2"],
            converts=f["converts"], reduces=f["reduces"],
            instructions=f["instructions"],
            given=f"{f['given_fp8_dots']} of {f['given_dots']}",
            dots=harness.format_census(f["census"]), fp8_dots=f["fp8_dots"],
            temp=f["temp_bytes"])
  if facts["fp8"]["temp_bytes"] and facts["bf16"]["temp_bytes"]:
    hlo.notes.append(
        "XLA temp buffers (`compiled.memory_analysis().temp_size_in_bytes`): "
        f"the fp8 step's are {facts['fp8']['temp_bytes'] / facts['bf16']['temp_bytes']:.2f}× "
        "the bf16 step's. The backward pass keeps each fp8 layer's quantised "
        "operands (a byte an element) and its scales, not bf16 copies.")
  extra = {k: facts["fp8"][k] - facts["bf16"][k]
           for k in ("converts", "reduces", "instructions")}
  probe = _f8_dot_probe()
  hlo.notes.append(
      f"The fp8 step adds, to the bf16 step: {facts['fp8']['to_e4m3']} "
      f"quantising converts to e4m3 (2 operands × {len(sites)} layers = "
      f"{2 * len(sites)} in the program as written; XLA may duplicate a convert "
      f"into several fusions), {facts['fp8']['to_e5m2']} to e5m2 (one output "
      f"gradient per layer: {len(sites)}), {extra['converts']:+d} converts in "
      f"all, {extra['reduces']:+d} reductions ("
      f"{extra['reduces'] / len(sites):.3g} per fp8 layer: each quantised "
      "tensor's amax, and each amax history's maximum for the next scale) and "
      f"{extra['instructions']:+d} instructions. No fp8 value is converted "
      "back to bf16 in the program given to XLA: each fp8 layer's three "
      "matmuls are `dot_general`s of fp8 arrays (the `fp8 dots given to XLA` "
      "column; the first layer's input gradient, which nobody asks for, is "
      "not computed).")
  hlo.notes.append(
      "Block scaling (MXFP8) quantises each operand by blocks of 32 and "
      "multiplies the blocks' values read back exactly in float32 (an fp8 "
      "value times a power of two), accumulating in float32: the numbers an MX "
      "GEMM computes, emulated, since only Blackwell GPUs have MX matrix "
      "units (its `fp8 dots given to XLA` are 0 by design).")
  hlo.notes.append(
      f"An f8e4m3fn × f8e4m3fn dot (f32 output) compiles on this backend "
      f"({jax.default_backend()}) to: {probe}.")
  if jax.default_backend() == "cpu":
    hlo.notes.append(
        "On a CPU there is no fp8 GEMM: XLA:CPU converts the fp8 operands of "
        "each dot to float32 (the probe above) and multiplies those, the same "
        "values an fp8 GEMM multiplies, so every fp8 figure here is the "
        "emulation's cost.")
  hlo.notes.append(
      "On a GPU with fp8 units (sm ≥ 8.9, CUDA ≥ 12) XLA's gemm rewriter "
      "(`xla/service/gpu/transforms/gemm_rewriter.cc`) turns a dot of fp8 "
      "operands into a cuBLASLt fp8 matmul (`__cublas$lt$matmul$f8`): on an "
      "H100 an 8192³ e4m3 dot ran at 1,124 TFLOP/s against 705 for bf16. "
      "The pattern Flax's `Fp8DotGeneralOp` emits (convert to fp8, convert "
      "back, multiply by the scale, then a bf16 dot) is one XLA:GPU's "
      "default excess precision may remove whole, leaving a bf16 GEMM of the "
      "unquantised operands; an fp8 `dot_general` cannot be removed. The "
      "`fp8 GEMMs` column counts the compiled dots and cuBLAS calls with an "
      "fp8 operand.")
  result.tables.append(hlo)

  result.tables.append(_memory_table(w, params0, x, y, facts["fp8"]))
  residuals, residual_ratios = _residual_table(w, params0, x, y)
  result.tables.append(residuals)
  result.targets.append(Target(
      "MLP backward-pass residuals with fp8 (delayed scaling) on every Dense "
      "≤ 0.6× the bf16 step's (any hardware: bytes kept, constants aside)",
      residual_ratios["delayed"], 0.6, "<="))
  result.tables.append(_expect_table(here, ctx))
  result.notes.append(_reading(here, bf16 / f32, fp8 / bf16, ctx))

  result.targets.append(Target(
      "MLP train step, bf16 + fp8 (hybrid) on the Dense layers ≤ 0.9× bf16",
      fp8 / bf16, 0.9, "<=", applies_to=FP8_UNITS))
  result.targets.append(Target(
      "MLP train step with fp8 on every Dense layer: every matmul given to "
      "XLA multiplies fp8 arrays (any backend)",
      float(facts["fp8"]["given_fp8_dots"]), float(facts["fp8"]["given_dots"]),
      ">=", unit=" fp8 dots"))
  # Every matmul of the MLP's step is an fp8 layer's (forward, input gradient
  # except the first layer's, weight gradient): all should be fp8 GEMMs.
  result.targets.append(Target(
      "MLP train step with fp8 on every Dense layer: all its matmuls compiled "
      "to fp8 GEMMs",
      float(facts["fp8"]["fp8_dots"]), float(sum(facts["fp8"]["census"].values())),
      ">=", unit=" fp8 GEMMs", applies_to=FP8_UNITS))

  result.data = {
      "workload": w.description, "hardware_class": here,
      "timings": t, "f8_dot_probe": probe,
      "ratios": {"bf16_vs_f32": bf16 / f32, "fp8_vs_f32": fp8 / f32,
                 "fp8_vs_bf16": fp8 / bf16,
                 "fp8_current_vs_bf16": t["fp8_current"].median / bf16,
                 "fp8_block_vs_bf16": t["fp8_block"].median / bf16},
      "residual_ratios": residual_ratios,
      "variants": {n: {k: v for k, v in f.items() if k != "fp8_state"}
                   for n, f in facts.items()},
  }
  return result
