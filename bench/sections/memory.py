"""Memory per policy: stored state, and what the backward pass keeps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from bench import harness
from bench import models
from bench import variants as variants_lib
from bench.harness import Column, SectionResult, Table, Target

NAME = "memory"
TITLE = "Memory by policy"
DESCRIPTION = (
    "Bytes counted from array shapes and dtypes, not measured from the "
    "allocator. *State*: parameters plus `optax.adam` state (its moments "
    "take the parameters' dtype) under float32 parameters (f32, and every "
    "mixed policy that keeps float32 master weights) and under bfloat16 "
    "parameters (`p=bf16`, pure bf16); mixed policies also hold a transient "
    "bf16 copy of the parameters during the step. *Residuals*: the arrays "
    "that `jax.vjp` of the loss keeps for the backward pass (the leaves of "
    "the returned vjp function), split into those that are the inputs "
    "themselves (float32 parameters and batch, held anyway) and the rest "
    "(activations, bf16 copies of the parameters). This is before XLA's own "
    "optimisation of the jitted step, which may rematerialise or fuse some of "
    "them. The models are those of the `steps` section at this run's sizes. "
    "Target, on all hardware (bytes do not depend on it): the transformer's "
    "residuals under jmp_lite's `wrap` ≤ 0.55× f32's, because float32 "
    "islands (norms) are recomputed in the backward pass rather than saved.")


def _residuals(loss_fn, params, x, y):
  """Bytes of the residuals of ``jax.vjp(loss)``, by kind, and their count.

  Kinds: ``inputs`` (equal to a float32 parameter or to the batch: eager
  `jax.vjp` may hold a copy rather than the input buffer itself, so values
  are compared, up to a reshape), ``copies`` (a parameter or the batch cast
  to another dtype, e.g. the bf16 compute copy) and ``activations`` (everything else).
  """
  vjp_fn = jax.jit(lambda p, x_: jax.vjp(lambda p_, x__: loss_fn(p_, x__, y),
                                          p, x_)[1])(params, x)
  candidates = {}
  for a in jax.tree_util.tree_leaves((params, x)):
    candidates.setdefault(a.size, []).append(np.asarray(a))
  out = {"inputs": 0, "copies": 0, "activations": 0, "count": 0}
  for leaf in jax.tree_util.tree_leaves(vjp_fn):
    if not hasattr(leaf, "dtype"):
      continue
    out["count"] += 1
    kind = "activations"
    value = np.asarray(leaf)
    for a in candidates.get(leaf.size, []):
      a = a.reshape(value.shape)  # hand-written models reshape some kernels
      if a.dtype == value.dtype and np.array_equal(value, a):
        kind = "inputs"
        break
      if (jnp.issubdtype(value.dtype, jnp.floating) and a.dtype != value.dtype
          and np.array_equal(value, a.astype(value.dtype))):
        kind = "copies"
        break
    out[kind] += harness.tree_bytes(leaf)
  out["total"] = out["inputs"] + out["copies"] + out["activations"]
  return out


def run(ctx: harness.Context) -> SectionResult:
  result = SectionResult()
  opt = optax.adam(1e-3)
  state = Table(
      "Stored state: parameters + Adam state",
      [Column("model", "model"), Column("policy", "parameters"),
       Column("params", "params", "bytes"), Column("opt", "Adam state", "bytes"),
       Column("total", "total", "bytes"), Column("vs_f32", "vs f32", "ratio"),
       Column("transient", "+ bf16 compute copy (mixed only)", "bytes")])
  residuals = Table(
      "Residuals of jax.vjp(loss) (saved between forward and backward)",
      [Column("model", "model"), Column("variant", "variant"),
       Column("activations", "activations", "bytes"),
       Column("act_vs_f32", "activations vs f32", "ratio"),
       Column("copies", "cast copies of params/batch", "bytes"),
       Column("inputs", "inputs (f32 params, batch)", "bytes"),
       Column("total", "total", "bytes"),
       Column("total_vs_f32", "total vs f32", "ratio"),
       Column("count", "arrays", "{}")])
  result.tables += [state, residuals]
  for make in models.WORKLOADS.values():
    w = make(ctx.size_key)
    ctx.log(f"memory: {w.description}")
    params = w.init(ctx.seed)
    x, y = w.batch(ctx.seed)
    f32_total = None
    for label, dtype in (("f32 (f32, or f32 master + bf16 compute)", jnp.float32),
                         ("bf16 (p=bf16)", jnp.bfloat16)):
      p = jax.eval_shape(lambda: jax.tree_util.tree_map(lambda a: a.astype(dtype), params))
      nparams = harness.tree_bytes(p)
      nopt = harness.tree_bytes(jax.eval_shape(opt.init, p))
      total = nparams + nopt
      f32_total = f32_total or total
      state.add(model=w.name, policy=label, params=nparams, opt=nopt,
                total=total, vs_f32=total / f32_total,
                transient=nparams // 2 if dtype == jnp.float32 else 0)
    f32_res = None
    for v in variants_lib.active(ctx):
      if not v.in_memory:
        continue
      loss_fn = v.make_loss(w)
      if v.value_and_grad is not jax.value_and_grad:
        # The variant transforms the differentiated function as a whole (as
        # autocast does): jax.vjp of its loss would show the f32 residuals.
        residuals.add(model=w.name, variant=v.label,
                      activations="n/a: differentiated inside its own transform")
        continue
      if loss_fn is None:
        residuals.add(model=w.name, variant=v.label,
                      activations=f"unavailable: {v.unavailable}")
        continue
      res = _residuals(loss_fn, params, x, y)
      f32_res = f32_res or res
      residuals.add(model=w.name, variant=v.label, activations=res["activations"],
                    act_vs_f32=res["activations"] / f32_res["activations"],
                    copies=res["copies"], inputs=res["inputs"], total=res["total"],
                    total_vs_f32=res["total"] / f32_res["total"], count=res["count"])
      result.data[f"{w.name}/{v.name}"] = res
      if w.name == "transformer" and v.name == "jmp_lite_wrap":
        # float32 islands (norms) are recomputed, not saved.
        result.targets.append(Target(
            "transformer residuals kept for the backward pass, jmp_lite wrap "
            "bf16 ≤ 0.55× f32",
            res["total"] / f32_res["total"], 0.55, "<="))
  state.notes.append(
      "The bf16 compute copy is what a mixed policy's `cast_to_compute` "
      "materialises each step (half the f32 parameter bytes); it is freed "
      "after the backward pass.")
  return result
