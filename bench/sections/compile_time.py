"""How long a guarded train step takes to compile as the model grows."""

from __future__ import annotations

import functools
import re
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from bench import harness
from bench.harness import Column, SectionResult, Table, Target

NAME = "compile_time"
TITLE = "Compile time of a guarded step as the model grows"
DESCRIPTION = (
    "One whole train step (forward, backward, `optax.adam(1e-3)`) written "
    "five ways, for two model families of N = 25, 50, 100, 200 and 400 "
    "parameter arrays (25, 50 and 100 with `--quick`), the transformer only "
    "up to 200: at 400 arrays its five steps took 3.3 min to compile on a "
    "2-core CPU (2 min of it the DynamicScale step), longer than the rest of "
    "the section together. MLP: N/2 Dense(64) "
    "layers (rounded: 24 arrays for 25) with ReLU, input 64, batch 32. Transformer: blocks of LayerNorm, "
    "Dense q/k/v/o 64→64 (one-head attention), LayerNorm, Dense 64→256, GELU, "
    "Dense 256→64, both halves residual: 16 arrays a block, the block count "
    "closest to N (one block for dry runs), seq 16, batch 4. "
    "Loss: mean squared error. Steps: plain Flax + optax "
    "(`jax.grad`, `tx.update`, `optax.apply_updates`); the same with "
    "`optax.apply_if_finite(adam, max_consecutive_errors=10)`; Flax's "
    "`DynamicScale().value_and_grad` with the new parameters and Adam state "
    "chosen leaf by leaf with `jnp.where(is_fin, new, old)`, as Flax's "
    "examples do; `jmp_lite.TrainState.minimize` with a "
    "`DynamicLossScale(2**15)`, in float32 and under the policy "
    "`p=f32,c=bf16,o=f32` (model wrapped with `jmp_lite.flax.wrap`). "
    "Each step is a fresh Python function under a fresh `jax.jit`, measured "
    "once: `jit(step).lower(*args)` (trace and lower) then `.compile()` "
    "(XLA), in an order that rotates from size to size, after one untimed "
    "compilation of every step at a tiny size (first-use imports, one-time "
    "set-up). Counted in the compiled HLO (`compiled.as_text()`): `reduce` "
    "instructions (and per parameter array), fusions, and distinct kernels "
    "(fused computations that differ in structure). Targets, on all "
    "hardware, for each family at every size (a target's value is its worst "
    "size): `TrainState.minimize` (f32 and bf16) traces, lowers and compiles "
    "in ≤ 2× the plain step's time and in less than the DynamicScale step's, "
    "with ≤ 3 reduce instructions per parameter array.")

SIZES_FULL = (25, 50, 100, 200, 400)
SIZES_QUICK = (25, 50, 100)
SIZES_DRY = (4, 8)
# The transformer's largest size: at 400 arrays its steps take over 3 minutes
# to compile on a 2-core CPU, the Flax DynamicScale step 2 of them.
TRANSFORMER_MAX = 200
WIDTH = 64
HIDDEN = 256
MLP_BATCH = 32
SEQ, BATCH = 16, 4
ARRAYS_PER_BLOCK = 16  # 2 LayerNorms (scale, bias) + 6 Dense (kernel, bias)
POLICY = "p=f32,c=bf16,o=f32"
PLAIN = "Flax + optax"
VARIANTS = (PLAIN, "optax.apply_if_finite", "Flax DynamicScale by hand",
            "TrainState.minimize f32", "TrainState.minimize bf16 policy")
GUARDED = {"TrainState.minimize f32": "f32",
           "TrainState.minimize bf16 policy": "bf16"}
DYNAMIC_SCALE = "Flax DynamicScale by hand"
RATIO_GOAL = 2.0
REDUCES_GOAL = 3.0


class _MLP(nn.Module):
  layers: int

  @nn.compact
  def __call__(self, x):
    for i in range(self.layers):
      x = nn.Dense(WIDTH, name=f"dense{i}")(x)
      if i < self.layers - 1:
        x = nn.relu(x)
    return x


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(name="ln1")(x)
    q, k, v = (nn.Dense(WIDTH, name=n)(h) for n in ("q", "k", "v"))
    scores = jnp.einsum("bqd,bkd->bqk", q, k) / WIDTH ** 0.5
    a = jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores, axis=-1), v)
    x = x + nn.Dense(WIDTH, name="o")(a)
    h = nn.LayerNorm(name="ln2")(x)
    h = nn.Dense(WIDTH, name="mlp_out")(nn.gelu(nn.Dense(HIDDEN, name="mlp_in")(h)))
    return x + h


class _Stack(nn.Module):
  blocks: int

  @nn.compact
  def __call__(self, x):
    for i in range(self.blocks):
      x = _Block(name=f"block{i}")(x)
    return x


def _mlp(n):
  """The MLP with about ``n`` arrays: (module, x, y)."""
  layers = max(1, round(n / 2))
  x = jax.random.normal(jax.random.PRNGKey(1), (MLP_BATCH, WIDTH))
  return _MLP(layers), x, jnp.zeros((MLP_BATCH, WIDTH))


def _transformer(n):
  blocks = max(1, round(n / ARRAYS_PER_BLOCK))
  x = jax.random.normal(jax.random.PRNGKey(1), (BATCH, SEQ, WIDTH))
  return _Stack(blocks), x, jnp.zeros((BATCH, SEQ, WIDTH))


# family -> (model of about n arrays, largest n measured)
FAMILIES = {"MLP": (_mlp, None), "transformer": (_transformer, TRANSFORMER_MAX)}


def _mse(out, y):
  return jnp.mean((out.astype(jnp.float32) - y) ** 2)


def _where(flag, new, old):
  return jax.tree.map(functools.partial(jnp.where, flag), new, old)


def _build(variant, module, x, y, seed):
  """A fresh ``(step, args)`` for ``variant``: a new function every call."""
  import jmp_lite
  import jmp_lite.flax
  from flax.training import dynamic_scale

  if variant == "TrainState.minimize bf16 policy":
    module = jmp_lite.flax.wrap(module, POLICY)
  params = module.init(jax.random.PRNGKey(seed), x)["params"]

  def loss(p, x, y):
    return _mse(module.apply({"params": p}, x), y)

  if variant in (PLAIN, "optax.apply_if_finite"):
    tx = (optax.adam(1e-3) if variant == PLAIN else
          optax.apply_if_finite(optax.adam(1e-3), max_consecutive_errors=10))

    def step(params, opt_state, x, y):
      grads = jax.grad(loss)(params, x, y)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    return step, (params, tx.init(params), x, y)
  if variant == DYNAMIC_SCALE:
    tx = optax.adam(1e-3)

    def step(params, opt_state, dyn, x, y):
      dyn, is_fin, _, grads = dyn.value_and_grad(loss)(params, x, y)
      updates, new_opt_state = tx.update(grads, opt_state, params)
      new_params = optax.apply_updates(params, updates)
      return (_where(is_fin, new_params, params),
              _where(is_fin, new_opt_state, opt_state), dyn)

    return step, (params, tx.init(params), dynamic_scale.DynamicScale(), x, y)
  state = jmp_lite.TrainState.create(
      apply_fn=module.apply, params=params, tx=optax.adam(1e-3),
      loss_scale=jmp_lite.DynamicLossScale(2.0 ** 15),
      policy=POLICY if GUARDED[variant] == "bf16" else None)

  def step(state, x, y):
    def loss_fn(p, x, y):
      return _mse(state.apply_fn({"params": p}, x), y)
    return state.minimize(loss_fn, x, y)

  return step, (state, x, y)


# The `jax.monitoring` event JAX records when the persistent compilation cache
# (JAX_COMPILATION_CACHE_DIR) returns an executable instead of compiling it.
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


def _measure(variant, module, x, y, seed) -> dict:
  """Trace+lower and compile seconds of a fresh jit of the step, its reduces."""
  hits = []

  def listener(event, **kwargs):
    del kwargs
    if event == _CACHE_HIT:
      hits.append(event)

  # optax's Adam raises a Python float to an int32 power, which strict
  # promotion (if a user's configuration sets it) would reject.
  with jax.numpy_dtype_promotion("standard"):
    step, args = _build(variant, module, x, y, seed)
    harness.block(args)
    t0 = time.perf_counter()
    lowered = jax.jit(step).lower(*args)
    t1 = time.perf_counter()
    jax.monitoring.register_event_listener(listener)
    try:
      compiled = lowered.compile()
    finally:
      jax.monitoring.unregister_event_listener(listener)
    t2 = time.perf_counter()
  text = compiled.as_text()
  arrays = len(jax.tree_util.tree_leaves(args[0].params if hasattr(args[0], "params")
                                         else args[0]))
  fusions, kernels = kernel_counts(text)
  return {"lower_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0,
          "reduces": text.count(" reduce("), "arrays": arrays,
          "fusions": fusions, "kernels": kernels, "cached": bool(hits)}


_COMPUTATION = re.compile(r"\n(?=(?:ENTRY )?%\S+ )")
_FUSION = re.compile(r"%\S+ = .* fusion\(.*calls=%([\w.-]+)")
_NAME = re.compile(r"%([\w.-]+)")


def kernel_counts(text: str) -> tuple[int, int]:
  """Fusion instructions in optimised HLO text, and how many differ in structure.

  XLA compiles one kernel for fused computations that are the same but for
  their names (XLA:CPU's kernel cache), so the structurally distinct ones,
  rather than the fusions, are what its code generation pays for. Two
  computations count as the same here if their instructions match line by
  line once every name is replaced by its position and metadata dropped
  (a parameter's number is kept: XLA's comparison keeps it too).
  """
  comps = {}
  for chunk in _COMPUTATION.split(text):
    m = re.match(r"(?:ENTRY )?%(\S+) ", chunk)
    if m:
      comps[m.group(1)] = chunk
  fusions, structures = 0, set()
  for chunk in comps.values():
    for line in chunk.split("\n"):
      m = _FUSION.search(line)
      if not m or m.group(1) not in comps:
        continue
      fusions += 1
      names, body = {}, []
      for inner in comps[m.group(1)].split("\n")[1:]:
        if " = " not in inner:
          continue
        inner = re.sub(r", metadata=.*|/\*index=\d+\*/", "", inner).strip()
        lhs, rhs = inner.split(" = ", 1)
        names[lhs.replace("ROOT ", "").lstrip("%")] = f"v{len(names)}"
        body.append(_NAME.sub(lambda n: names.get(n.group(1), "?"), rhs))
      structures.add("\n".join(body))
  return fusions, len(structures)


def kernel_cost_ms(kernels: int = 40, rounds: int = 3) -> float:
  """XLA's compile time per distinct kernel, in ms: a jit of ``kernels``
  different scalar computations, each its own kernel (an integer division,
  which XLA does not duplicate into its readers, ends each), against an
  empty one; the median of ``rounds``."""
  def make(k, seed):
    def f(x, n):
      return [x * ((n * (i + seed + 3)) // (n + i + 1)).astype(jnp.float32)
              for i in range(k)]
    return f

  def compile_s(k, seed):
    lowered = jax.jit(make(k, seed)).lower(jnp.ones((), jnp.float32), jnp.int32(7))
    t0 = time.perf_counter()
    lowered.compile()
    return time.perf_counter() - t0

  per = sorted((compile_s(kernels, r) - compile_s(0, r)) / kernels
               for r in range(rounds))
  return 1e3 * per[len(per) // 2]


def run(ctx: harness.Context) -> SectionResult:
  sizes = ctx.pick(full=SIZES_FULL, quick=SIZES_QUICK, dry=SIZES_DRY)
  table = Table(
      "Trace+lower and XLA compile time of one jitted train step, by model size",
      [Column("family", "family"), Column("arrays", "arrays", "{}"),
       Column("variant", "step"),
       Column("lower", "trace+lower s", "{:.2f}"),
       Column("compile", "compile s", "{:.2f}"),
       Column("total", "total s", "{:.2f}"),
       Column("ratio", "vs plain", "ratio"),
       Column("reduces", "reduce ops", "{}"),
       Column("per_array", "reduces per array", "{:.2f}"),
       Column("fusions", "fusions", "{}"),
       Column("kernels", "distinct kernels", "{}")])
  result = SectionResult(tables=[table])
  # Untimed: every step once at a tiny size, so that no measurement pays for
  # a first use (jmp_lite.flax and jmp_lite.optax are imported on first use).
  for variant in VARIANTS:
    module, x, y = _mlp(2)
    _measure(variant, module, x, y, ctx.seed)
  rows = {}
  cached = 0
  turn = 0
  for family, (make, largest) in FAMILIES.items():
    seen = set()
    for n in sizes:
      if largest is not None and n > largest:
        continue
      module, x, y = make(n)
      key = (type(module).__name__, getattr(module, "layers", None),
             getattr(module, "blocks", None))
      if key in seen:  # a dry run's sizes can give the same model twice
        continue
      seen.add(key)
      order = VARIANTS[turn % len(VARIANTS):] + VARIANTS[:turn % len(VARIANTS)]
      turn += 1
      got = {}
      for variant in order:
        got[variant] = _measure(variant, module, x, y, ctx.seed)
        cached += got[variant]["cached"]
      arrays = got[PLAIN]["arrays"]
      ctx.log(f"compile_time: {family}, {arrays} arrays: " + ", ".join(
          f"{v} {got[v]['total_s']:.1f} s" for v in VARIANTS))
      for variant in VARIANTS:
        g = got[variant]
        table.add(family=family, arrays=g["arrays"], variant=variant,
                  lower=g["lower_s"], compile=g["compile_s"], total=g["total_s"],
                  ratio=g["total_s"] / got[PLAIN]["total_s"],
                  reduces=g["reduces"], per_array=g["reduces"] / g["arrays"],
                  fusions=g["fusions"], kernels=g["kernels"])
        rows[(family, arrays, variant)] = g
  result.data = {f"{f}/{a}/{v}": g for (f, a, v), g in rows.items()}

  def total(family, arrays, variant):
    return rows[(family, arrays, variant)]["total_s"]

  for family in FAMILIES:
    counts = sorted({a for f, a, _ in rows if f == family})
    span = (f"{counts[0]}–{counts[-1]} arrays" if len(counts) > 1
            else f"{counts[0]} arrays")
    for variant, label in GUARDED.items():
      vs_plain = [total(family, a, variant) / total(family, a, PLAIN)
                  for a in counts]
      vs_dyn = [total(family, a, variant) / total(family, a, DYNAMIC_SCALE)
                for a in counts]
      per_array = [rows[(family, a, variant)]["reduces"] / a for a in counts]
      result.targets.append(Target(
          f"{family}: TrainState.minimize {label} trace+lower+compile ≤ "
          f"{RATIO_GOAL:g}× the plain Flax + optax step's, worst of {span}",
          max(vs_plain), RATIO_GOAL, "<="))
      result.targets.append(Target(
          f"{family}: TrainState.minimize {label} trace+lower+compile under "
          f"the Flax DynamicScale step's (ratio ≤ 1×), worst of {span}",
          max(vs_dyn), 1.0, "<="))
      result.targets.append(Target(
          f"{family}: TrainState.minimize {label} ≤ {REDUCES_GOAL:g} reduce "
          f"instructions per parameter array in the compiled step, worst of "
          f"{span}", max(per_array), REDUCES_GOAL, "<=", unit=" per array"))
      table.notes.append(
          f"{family}, TrainState.minimize {label}, total vs the DynamicScale "
          "step's, by arrays: " + ", ".join(
              f"{a}: {r:.2f}×" for a, r in zip(counts, vs_dyn)) + ".")
  table.notes.insert(0,
      "vs plain: total time over the plain Flax + optax step's for the same "
      "model. reduce ops: occurrences of ` reduce(` in the optimised HLO "
      "(one per reduce instruction, fused or not; the model's own, such as "
      "bias gradients, LayerNorm statistics and the loss, included); every "
      "step has the same model, so differences are the step's own. Each "
      "figure is a single compilation, not a median: under a shared "
      "machine's load it can move by tens of percent from run to run.")
  per_kernel = kernel_cost_ms()
  result.data["kernel_cost_ms"] = per_kernel
  table.notes.insert(1,
      "fusions: fusion instructions in the optimised HLO; distinct kernels: "
      "those whose fused computations differ in structure (`kernel_counts`), "
      "as XLA compiles one kernel for identical ones. On this machine XLA "
      f"took {per_kernel:.1f} ms of compile time per distinct kernel "
      "(`kernel_cost_ms`: 40 different scalar kernels against none), so the "
      "distinct kernels a step adds, more than its reductions, set its "
      "compile time at small sizes.")
  if cached:
    table.notes.append(
        f"{cached} of the compilations were read from JAX's persistent "
        "compilation cache (JAX_COMPILATION_CACHE_DIR is set): their compile "
        "times are cache reads, not compilations.")
  return result
