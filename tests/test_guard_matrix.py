"""Fault-injection matrix for `jmp_lite.optax.with_loss_scale`.

Every optimizer optax ships (the aliases in ``optax`` and ``optax.contrib``,
found by introspection so that a new one cannot be missed silently) and the
usual composites run a short training loop on four parameter trees, while
NaN, +inf, -inf and huge-but-finite values are injected into the scaled
gradients at chosen steps. After every step the guard's promise is checked:
nothing non-finite reaches params or opt_state, a skipped step leaves both
bitwise unchanged and says why, and training carries on after the faults.

Each optimizer compiles one step function, which steps the four trees side
by side: the fault kind, the fault step and the loss scale (above and below
1) are traced values.

The regression tests at the end each failed on an earlier version.
"""

import dataclasses
import functools
import inspect
import warnings
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest

import jmp_lite
from jmp_lite import _checks
from jmp_lite import optax as jo
from jmp_lite.testing import count_compilations, inject_nonfinite
from jmp_lite.testing import assert_trees_bitwise_equal

# The heavy tier (every optax optimizer under every fault): `pytest -m slow`.
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _check_w_on_a_copy(monkeypatch):
  """The guard checks arrays of `_checks.COPY_FROM` elements or more on a
  copy of the step and smaller ones on its results. Here "w" (12 elements)
  and state leaves of its size go through the copy and the smaller leaves
  through the results, so that every run covers both."""
  monkeypatch.setattr(_checks, "COPY_FROM", 12)

_LR = 1e-3
_TARGET = 0.25

# ---------------------------------------------------------------------------
# Parameter trees.
# ---------------------------------------------------------------------------


def _leaves_of(dtype_w, dtype_b, dtype_s):
  # "b" holds -0.0 (with no gradient, see _WEIGHTS), so that a skipped first
  # step that writes +0.0 shows, and 1e-4, so that the tiny first steps of
  # parameter-free methods still move 16-bit parameters.
  return {
      "w": jnp.linspace(-0.5, 0.75, 12, dtype=jnp.float32).reshape(3, 4).astype(dtype_w),
      "b": jnp.array([1e-4, -0.0, 0.4, -0.2], jnp.float32).astype(dtype_b),
      "s": jnp.array(0.3, jnp.float32).astype(dtype_s),
  }


def _tree(kind: str) -> dict:
  if kind == "f32":
    return _leaves_of(jnp.float32, jnp.float32, jnp.float32)
  if kind == "bf16":
    return _leaves_of(jnp.bfloat16, jnp.bfloat16, jnp.bfloat16)
  if kind == "f16":
    return _leaves_of(jnp.float16, jnp.float16, jnp.float16)
  assert kind == "mixed"
  tree = _leaves_of(jnp.float32, jnp.bfloat16, jnp.float16)
  tree["n"] = jnp.array([3, -7], jnp.int32)
  tree["z"] = None
  return tree


TREES = ("f32", "bf16", "f16", "mixed")

# Per-element weight of the loss: the second element of "b" has none, so its
# gradient is exactly zero and it can stay -0.0.
_WEIGHTS = {"b": np.array([1.0, 0.0, 1.0, 1.0], np.float32)}


def _loss(params) -> jax.Array:
  """Unscaled float32 loss; accepts the float32, None-for-int view inner sees."""
  total = jnp.zeros((), jnp.float32)
  for key in sorted(params):
    x = params[key]
    if x is None or not jnp.issubdtype(x.dtype, jnp.floating):
      continue
    sq = (x.astype(jnp.float32) - _TARGET) ** 2
    if key in _WEIGHTS:
      sq = sq * _WEIGHTS[key]
    total = total + 0.25 * jnp.sum(sq)
  return total


# ---------------------------------------------------------------------------
# The optimizer table.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
  """One row of the matrix."""

  make: Callable[[], optax.GradientTransformation]
  # Extra arguments of update: None, "value", "obj_fn", "grad_fn" or "lbfgs"
  # (value, grad and value_fn, for a linesearch).
  extra: Optional[str] = None
  # False for optimizers whose first update is zero by design.
  first_step_moves: bool = True
  # Whether the inner state may hold 16-bit floats (by request).
  state16: bool = False
  # Leaves left out of the trees, for optax transformations that cannot
  # take them even without jmp_lite.
  drop: tuple[str, ...] = ()


def _quietly(fn, *args, **kwargs):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    return fn(*args, **kwargs)


def _is_matrix(tree):
  return jax.tree.map(lambda x: x.ndim >= 2, tree)


def _not_matrix(tree):
  return jax.tree.map(lambda x: x.ndim < 2, tree)


# Constructor arguments for optimizers that need more than learning_rate=_LR.
_OVERRIDES: dict[str, Case] = {
    # The factored second moment (the default factors dims >= 128 only).
    "optax.adafactor": Case(lambda: optax.adafactor(_LR, min_dim_size_to_factor=2)),
    # The step length comes from the zoom linesearch.
    "optax.lbfgs": Case(lambda: optax.lbfgs(), extra="lbfgs"),
    "optax.noisy_sgd": Case(lambda: optax.noisy_sgd(_LR, key=jax.random.key(0))),
    "optax.polyak_sgd": Case(lambda: optax.polyak_sgd(max_learning_rate=_LR), extra="value"),
    # A linesearch rather than an optimizer; the step length is its own.
    "optax.scale_by_backtracking_linesearch": Case(
        lambda: optax.chain(optax.sgd(1.0),
                            optax.scale_by_backtracking_linesearch(max_backtracking_steps=15)),
        extra="lbfgs"),
    "optax.optimistic_adam": Case(lambda: _quietly(optax.optimistic_adam, _LR)),  # deprecated
    # First step: no sign history yet, so no step.
    "optax.rprop": Case(lambda: optax.rprop(_LR), first_step_moves=False),
    # optax's sm3 fails on 0-d parameters (IndexError in its init).
    "optax.sm3": Case(lambda: optax.sm3(_LR), drop=("s",)),
    # ADOPT's first step only initialises its second moment.
    "optax.contrib.adopt": Case(lambda: optax.contrib.adopt(_LR), first_step_moves=False),
    # Parameter-free methods: their own step-size estimates, default scale 1.
    "optax.contrib.cocob": Case(lambda: optax.contrib.cocob()),
    "optax.contrib.dadapt_adamw": Case(lambda: optax.contrib.dadapt_adamw()),
    "optax.contrib.dog": Case(lambda: optax.contrib.dog()),
    "optax.contrib.dowg": Case(lambda: optax.contrib.dowg()),
    "optax.contrib.prodigy": Case(lambda: optax.contrib.prodigy()),
    "optax.contrib.mechanize": Case(lambda: optax.contrib.mechanize(optax.adam(_LR))),
    # optax's galore fails on None leaves (AttributeError in its init), and
    # with_loss_scale shows integer leaves to it as None.
    "optax.contrib.galore": Case(
        lambda: optax.contrib.galore(_LR, rank=2, update_proj_gap=5), drop=("n", "z")),
    "optax.contrib.momo": Case(lambda: optax.contrib.momo(_LR), extra="value"),
    "optax.contrib.momo_adam": Case(lambda: optax.contrib.momo_adam(_LR), extra="value"),
    "optax.contrib.reduce_on_plateau": Case(
        lambda: optax.chain(optax.sgd(_LR), optax.contrib.reduce_on_plateau(patience=2)),
        extra="value"),
    "optax.contrib.sam": Case(
        lambda: optax.contrib.sam(optax.sgd(_LR), optax.sgd(_LR), sync_period=2)),
    "optax.contrib.sophia": Case(
        lambda: optax.contrib.sophia(_LR, update_interval=3), extra="obj_fn"),
}

# Composites and jmp_lite's own transformations, beside optax's optimizers.
_COMPOSITES: dict[str, Case] = {
    "chain(clip_by_global_norm,adamw)": Case(
        lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(_LR))),
    "inject_hyperparams(adamw)": Case(
        lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=_LR)),
    "masked(adam)+masked(sgd)": Case(
        lambda: optax.chain(optax.masked(optax.adam(_LR), _is_matrix),
                            optax.masked(optax.sgd(_LR, momentum=0.9), _not_matrix))),
    "multi_transform": Case(
        lambda: optax.multi_transform(
            {"adam": optax.adam(_LR), "sgd": optax.sgd(_LR)},
            lambda p: jax.tree.map(lambda x: "adam" if x.ndim >= 2 else "sgd", p))),
    "with_state_dtype(adam,bf16)": Case(
        lambda: jo.with_state_dtype(optax.adam(_LR), jnp.bfloat16), state16=True),
    "with_state_dtype(adam,f16)": Case(
        lambda: jo.with_state_dtype(optax.adam(_LR), jnp.float16), state16=True),
    "chain(adam,kahan_summation)": Case(
        lambda: optax.chain(optax.adam(_LR), jo.kahan_summation()), state16=True),
    "chain(adam,stochastic_round)": Case(
        lambda: optax.chain(optax.adam(_LR), jo.stochastic_round(jax.random.key(0)))),
    "sam(opaque)": Case(
        lambda: optax.contrib.sam(optax.sgd(_LR), optax.sgd(_LR), opaque_mode=True),
        extra="grad_fn"),
    "apply_if_finite(adam)": Case(lambda: optax.apply_if_finite(optax.adam(_LR), 2)),
    "chain(ema,sgd)": Case(lambda: optax.chain(optax.ema(0.9), optax.sgd(_LR))),
}

# Public transformations the matrix does not run, with the reason. The
# building blocks run inside the optimizer named.
_BUILDING_BLOCKS = {
    "optax.scale_by_adadelta": "adadelta",
    "optax.scale_by_adam": "adam",
    "optax.scale_by_adamax": "adamax",
    "optax.scale_by_adan": "adan",
    "optax.scale_by_amsgrad": "amsgrad",
    "optax.scale_by_belief": "adabelief",
    "optax.scale_by_distance_over_gradients": "contrib.dog",
    "optax.scale_by_factored_rms": "adafactor",
    "optax.scale_by_lbfgs": "lbfgs",
    "optax.scale_by_learning_rate": "every alias",
    "optax.scale_by_lion": "lion",
    "optax.scale_by_novograd": "novograd",
    "optax.scale_by_optimistic_gradient": "optimistic_gradient_descent",
    "optax.scale_by_param_block_norm": "fromage",
    "optax.scale_by_param_block_rms": "adafactor",
    "optax.scale_by_polyak": "polyak_sgd",
    "optax.scale_by_radam": "radam",
    "optax.scale_by_rms": "rmsprop",
    "optax.scale_by_rprop": "rprop",
    "optax.scale_by_rss": "adagrad",
    "optax.scale_by_schedule": "inject_hyperparams(adamw)",
    "optax.scale_by_sign": "sign_sgd",
    "optax.scale_by_sm3": "sm3",
    "optax.scale_by_stddev": "rmsprop(centered=True)",
    "optax.scale_by_trust_ratio": "lamb, lars",
    "optax.scale_by_yogi": "yogi",
    "optax.scale_by_zoom_linesearch": "lbfgs",
    "optax.trace": "sgd(momentum=0.9) in masked(adam)+masked(sgd)",
    "optax.add_noise": "noisy_sgd",
    "optax.add_decayed_weights": "adamw",
    "optax.clip_by_global_norm": "chain(clip_by_global_norm,adamw)",
    "optax.masked": "masked(adam)+masked(sgd)",
    "optax.multi_transform": "multi_transform",
    "optax.inject_hyperparams": "inject_hyperparams(adamw)",
    "optax.chain": "every chain(...) row",
    "optax.apply_if_finite": "apply_if_finite(adam)",
    "optax.ema": "chain(ema,sgd)",
    "optax.with_extra_args_support": "with_loss_scale itself",
    "optax.contrib.scale_by_acprop": "contrib.acprop",
    "optax.contrib.scale_by_ademamix": "contrib.ademamix",
    "optax.contrib.scale_by_adopt": "contrib.adopt",
    "optax.contrib.scale_by_cocob": "contrib.cocob",
    "optax.contrib.scale_by_galore": "contrib.galore",
    "optax.contrib.scale_by_madgrad": "contrib.madgrad",
    "optax.contrib.scale_by_muon": "contrib.muon",
    "optax.contrib.scale_by_simplified_ademamix": "contrib.simplified_ademamix",
    "optax.contrib.schedule_free": "contrib.schedule_free_adamw and _sgd",
    "optax.contrib.hutchinson_estimator_diag_hessian": "contrib.sophia",
}

_SKIP: dict[str, str] = {
    **{name: f"building block, runs inside {alias}" for name, alias in _BUILDING_BLOCKS.items()},
    # Stateless maps of the (already finite) updates: nothing to freeze on a
    # skip, and what they emit is checked like any update.
    **{f"optax.{name}": "stateless transform of the updates"
       for name in ("adaptive_grad_clip", "centralize", "clip", "clip_by_block_rms",
                    "identity", "keep_params_nonnegative", "normalize_by_update_norm",
                    "scale", "set_to_zero", "stateless", "stateless_with_tree_map",
                    "zero_nans")},
    "optax.contrib.normalize": "stateless transform of the updates",
    # Combinators whose behaviour is their inner transformation's.
    "optax.named_chain": "same as optax.chain with names",
    "optax.partition": "optax.multi_transform under its new name",
    "optax.conditionally_mask": "a combinator: needs a should_transform_fn over its own state",
    "optax.conditionally_transform": "a combinator: needs a should_transform_fn over its own state",
    "optax.selective_transform": "a combinator like masked, by path (covered by masked)",
    "optax.freeze": "masked(set_to_zero): stateless",
    "optax.flatten": "reshapes the updates for its inner transformation only",
    "optax.inject_stateful_hyperparams": "same state layout as inject_hyperparams",
    "optax.monitor": "records updates for inspection; no effect on them",
    "optax.measure_with_ema": "records measures for inspection; no effect on the updates",
    "optax.snapshot": "records a measure for inspection; no effect on the updates",
    # Other contracts.
    "optax.apply_every": "accumulates like optax.MultiSteps; with_loss_scale(accumulate_steps=) "
                         "replaces it (tested at the end)",
    "optax.lookahead": "needs LookaheadParams(fast, slow) as params, with gradients for fast only",
    "optax.contrib.dpsgd": "needs per-example gradients (a leading batch axis), whose shapes "
                           "differ from the parameters'",
    "optax.contrib.differentially_private_aggregate": "needs per-example gradients (see dpsgd)",
    "optax.contrib.split_real_and_imaginary": "complex parameters only (see the complex test)",
}

# Public callables without a return annotation that do not build a
# transformation.
_NOT_TRANSFORMATIONS = {
    "optax.bias_correction", "optax.matrix_inverse_pth_root", "optax.update_infinity_moment",
    "optax.update_moment", "optax.update_moment_per_elem_norm",
    "optax.sigmoid_binary_cross_entropy", "optax.contrib.schedule_free_eval_params",
}


def _public_callables():
  """(qualified name, return annotation) of public non-class callables."""
  for mod in (optax, optax.contrib):
    for name in sorted(dir(mod)):
      obj = getattr(mod, name)
      if name.startswith("_") or inspect.isclass(obj) or not callable(obj):
        continue
      if not (inspect.isroutine(obj) or isinstance(obj, functools.partial)
              or hasattr(obj, "__wrapped__")):
        continue  # typing aliases
      try:
        ann = inspect.signature(obj).return_annotation
      except (TypeError, ValueError):
        ann = inspect.Signature.empty
      yield f"{mod.__name__}.{name}", ann


def _builds_transformation(ann) -> Optional[bool]:
  """True, False, or None when the annotation does not tell."""
  if ann is inspect.Signature.empty:
    return None
  if isinstance(ann, type):
    return issubclass(ann, optax.GradientTransformation)
  return "GradientTransformation" in str(ann)


def _optimizer_names() -> list[str]:
  """Every public optax transformation that the matrix runs as an optimizer."""
  names = []
  for name, ann in _public_callables():
    if name in _SKIP or name in _NOT_TRANSFORMATIONS:
      continue
    if _builds_transformation(ann) is not False:
      names.append(name)
  return names


def _case(name: str) -> Case:
  if name in _COMPOSITES:
    return _COMPOSITES[name]
  if name in _OVERRIDES:
    return _OVERRIDES[name]
  fn = functools.reduce(getattr, name.split(".")[1:], optax)
  if "learning_rate" not in inspect.signature(fn).parameters:
    raise AssertionError(f"{name}: no learning_rate; add it to _OVERRIDES or _SKIP")
  return Case(lambda: fn(learning_rate=_LR))


MATRIX = [*_optimizer_names(), *_COMPOSITES]


def _short(name: str) -> str:
  return name.removeprefix("optax.")


def test_every_public_optax_transformation_is_in_the_matrix_or_skipped_with_a_reason():
  """A new optimizer in optax must land in the matrix or be skipped on purpose."""
  unclassified, seen = [], set()
  for name, ann in _public_callables():
    seen.add(name)
    kind = _builds_transformation(ann)
    in_table = name in MATRIX or name in _SKIP
    if kind is None and not in_table and name not in _NOT_TRANSFORMATIONS:
      unclassified.append(f"{name} (no return annotation)")
    elif kind and not in_table:
      unclassified.append(name)
  assert not unclassified, f"add to the matrix or to _SKIP with a reason: {unclassified}"
  stale = sorted(n for n in [*_SKIP, *_OVERRIDES, *_NOT_TRANSFORMATIONS] if n not in seen)
  # The tables are written against optax 0.2.8; the declared minimum (0.2.5,
  # .ci/constraints-min.txt) does not have some of their names yet.
  if _version(optax.__version__) >= (0, 2, 8):
    assert not stale, f"no longer public in optax, remove: {stale}"


def _version(text: str) -> tuple[int, ...]:
  return tuple(int(p) for p in text.split(".")[:3] if p.isdigit())
  assert all(reason for reason in _SKIP.values())
  # Spot check: the list really is built from optax.
  for name in ("optax.adam", "optax.lbfgs", "optax.nadamw", "optax.contrib.muon",
               "optax.contrib.dog", "optax.contrib.schedule_free_adamw"):
    assert name in MATRIX


# ---------------------------------------------------------------------------
# Fault injection and the jitted step.
# ---------------------------------------------------------------------------

CLEAN, NAN, POS_INF, NEG_INF, HUGE = range(5)
_FAULT_NAMES = {NAN: "nan", POS_INF: "inf", NEG_INF: "-inf", HUGE: "huge"}
# Scaled gradients that are finite but large: 6e4 is near float16's largest
# value (65504); 1e30 squares beyond float32's range.
_HUGE = {jnp.dtype(jnp.float16): 6e4, jnp.dtype(jnp.bfloat16): 1e30,
         jnp.dtype(jnp.float32): 1e30}
# The fault of each step of a 12-step run: one on the very first step (before
# the optimizer has any history), lone ones, two in a row and a late one.
_RUNS = {
    "nan/inf": (NAN, 0, 0, POS_INF, 0, NEG_INF, NAN, 0, 0, NEG_INF, POS_INF, 0),
    # Huge values may be applied, after which the trajectory is no longer a
    # clean one: start clean.
    "huge": (0, 0, HUGE, 0, 0, HUGE, HUGE, 0, 0, 0, HUGE, 0),
}


def _is_float(x) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _inject(grads, t, kind):
  """The fault ``kind`` (traced) in the scaled gradients of step ``t`` (traced).

  NaN, +inf or -inf go into one element of one floating leaf, both chosen by
  ``t``; huge values into the first element of every floating leaf. (Hand-made
  rather than `inject_nonfinite` with random choices, whose PRNG code would
  triple the compile time of every step function.)
  """
  leaves, treedef = jax.tree.flatten(grads)
  floating = [i for i, g in enumerate(leaves) if _is_float(g)]
  nonfinite = (kind >= NAN) & (kind <= NEG_INF)
  bad = jnp.array([0.0, np.nan, np.inf, -np.inf], jnp.float32)[jnp.clip(kind, 0, 3)]
  target = t % len(floating)
  for n, i in enumerate(floating):
    g = leaves[i]
    flat = g.reshape(-1)
    pos = (3 * t + 1) % flat.size
    flat = flat.at[pos].set(jnp.where(nonfinite & (target == n), bad.astype(g.dtype), flat[pos]))
    flat = flat.at[0].set(jnp.where(kind == HUGE, jnp.asarray(_HUGE[g.dtype], g.dtype), flat[0]))
    leaves[i] = flat.reshape(g.shape)
  return jax.tree.unflatten(treedef, leaves)


def _inner_view(tree):
  """What with_loss_scale shows its inner optimizer: float32 for 16-bit, None for ints."""
  def one(x):
    if not _is_float(x):
      return None
    return x.astype(jnp.float32) if jnp.finfo(x.dtype).bits == 16 else x
  return jax.tree.map(one, tree)


def _extra_args(kind, params, grads, loss_scale):
  if kind is None:
    return {}
  if kind == "value":
    return {"value": _loss(params)}
  if kind == "obj_fn":
    return {"obj_fn": _loss}
  if kind == "grad_fn":
    return {"grad_fn": lambda p, i: jax.grad(_loss)(p)}
  assert kind == "lbfgs"
  # The linesearch wants the unscaled gradient, in the tree the inner sees.
  unscaled = _inner_view(jax.tree.map(
      lambda g: g.astype(jnp.float32) / loss_scale.loss_scale if _is_float(g) else g,
      grads))
  return {"value": _loss(params), "grad": unscaled, "value_fn": _loss}


def _make_step(tx, case: Case):
  """One jitted step for all trees at once (they share the traced fault)."""
  def one(params, opt_state, t, kind):
    scale = jo.get_loss_scale(opt_state)
    grads = jax.grad(lambda p: scale.scale(_loss(p)), allow_int=True)(params)
    grads = _inject(grads, t, kind)
    extra = _extra_args(case.extra, params, grads, scale)
    updates, opt_state = tx.update(grads, opt_state, params, **extra)
    return jo.apply_updates(params, updates), opt_state, updates

  def step(params, opt_states, t, kind):
    out = {k: one(params[k], opt_states[k], t, kind) for k in params}
    return ({k: o[0] for k, o in out.items()}, {k: o[1] for k, o in out.items()},
            {k: o[2] for k, o in out.items()})
  return jax.jit(step)


# ---------------------------------------------------------------------------
# Host-side checks.
# ---------------------------------------------------------------------------


def _host(tree):
  """To NumPy, with PRNG keys as their raw data."""
  def one(x):
    if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return jax.random.key_data(x)
    return x
  return jax.device_get(jax.tree.map(one, tree))


def _paths(tree):
  return jax.tree_util.tree_flatten_with_path(tree)[0]


def _nonfinite_paths(tree, init=None):
  """Paths of inexact leaves with NaN or inf, except sentinels kept from ``init``.

  lbfgs and reduce_on_plateau start with inf (a "no value yet" marker) in
  their state; a skipped first step rightly keeps it.
  """
  sentinels = {} if init is None else {
      jax.tree_util.keystr(p): np.asarray(x) for p, x in _paths(init)}
  bad = []
  for path, x in _paths(tree):
    if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact):
      x = np.asarray(x)
      wide = x.astype(np.complex128 if jnp.iscomplexobj(x) else np.float64)
      nonfinite = ~np.isfinite(wide)
      if not nonfinite.any():
        continue
      was = sentinels.get(jax.tree_util.keystr(path))
      if was is not None and was.shape == x.shape and was.dtype == x.dtype:
        same = (np.atleast_1d(was).view(np.uint8).reshape(x.size, -1)
                == np.atleast_1d(x).view(np.uint8).reshape(x.size, -1)).all(axis=1)
        if same[nonfinite.reshape(-1)].all():
          continue
      bad.append((jax.tree_util.keystr(path), x))
  return bad


def _moved(before, after) -> bool:
  return any(np.asarray(x).tobytes() != np.asarray(y).tobytes()
             for (_, x), (_, y) in zip(_paths(before), _paths(after))
             if _is_float(np.asarray(x)))


def _loss_scales():
  return {
      "scale=2**15": jmp_lite.DynamicLossScale(2.0 ** 15),
      "scale=2**-4": jmp_lite.DynamicLossScale(2.0 ** -4, min_loss_scale=0.0),
  }


@dataclasses.dataclass
class _Progress:
  """What one tree's run has seen so far."""

  ctx: str
  init_state: object
  pristine: bool = True  # no fault has been applied
  first_clean_seen: bool = False


def _true_grad_norm(params) -> float:
  total = 0.0
  for key, x in params.items():
    if x is not None and _is_float(x):
      g = 0.5 * (np.asarray(x, np.float64) - _TARGET) * _WEIGHTS.get(key, 1.0)
      total += float(np.sum(g * g))
  return np.sqrt(total)


def _check_step(case: Case, kind: int, progress: _Progress, t: int,
                h_params, h_state, new_params, new_state, h_updates):
  """The guard's promise for one step of one tree (all arguments on the host)."""
  where = f"{progress.ctx}, step {t} ({_FAULT_NAMES.get(kind, 'clean')})"
  old = jo.find_loss_scale_state(h_state)
  new = jo.find_loss_scale_state(new_state)
  nf = new.nonfinite
  skipped = bool(new.skipped)

  # Nothing non-finite anywhere.
  bad = _nonfinite_paths(new_params) + _nonfinite_paths(new_state, progress.init_state)
  assert not bad, f"{where}: non-finite values written: {bad}"

  # The bookkeeping agrees with itself.
  assert skipped == bool(nf.grads | nf.updates | nf.params | nf.opt_state), f"{where}: {nf}"
  assert int(new.skipped_steps) == int(old.skipped_steps) + skipped, where
  if kind in (NAN, POS_INF, NEG_INF):
    assert bool(nf.grads) and skipped, f"{where}: not detected: {nf}"
    # Only the gradients are checked when they are not finite.
    assert not (bool(nf.updates) or bool(nf.params) or bool(nf.opt_state)), (
        f"{where}: only the gradients should be reported: {nf}")
  if kind == HUGE:
    assert not bool(nf.grads), f"{where}: finite gradients reported non-finite"
  # The loss scale follows the gradients' finiteness only (period: 2000).
  old_scale = float(old.loss_scale.loss_scale)
  expected = old_scale
  if bool(nf.grads):
    expected = max(old_scale / 2, float(old.loss_scale.min_loss_scale))
  assert float(new.loss_scale.loss_scale) == expected, where

  # Integer and None leaves; float32 updates for every floating parameter.
  if "n" in new_params:
    assert_trees_bitwise_equal(new_params["n"], h_params["n"], where)
    assert h_updates["n"].dtype == np.int32 and not np.any(h_updates["n"]), where
    assert new_params["z"] is None and h_updates["z"] is None, where
  for key, u in h_updates.items():
    if u is not None and _is_float(u):
      assert u.dtype == np.float32, f"{where}: update {key} is {u.dtype}"

  if skipped:
    assert_trees_bitwise_equal(h_params, new_params, f"{where}: skipped step, params")
    assert_trees_bitwise_equal(old.inner_state, new.inner_state,
                          f"{where}: skipped step, inner state")
    assert_trees_bitwise_equal(old.grad_norm, new.grad_norm, f"{where}: skipped step, grad_norm")
    for path, u in _paths(h_updates):
      if _is_float(u):
        assert_trees_bitwise_equal(u, np.full_like(u, -0.0),
                              f"{where}: skipped update {jax.tree_util.keystr(path)}")
  else:
    assert kind in (CLEAN, HUGE), where
    if kind == HUGE:
      progress.pristine = False

  if kind == CLEAN and progress.pristine:
    # Every fault so far was skipped: this step applies, as on a clean run.
    assert not skipped, f"{where}: a clean step was skipped ({nf}) after skipped faults"
    # The norm of the unscaled gradients, whatever the scale and dtypes (the
    # scaled gradients were rounded to the parameters' dtypes: 1%).
    np.testing.assert_allclose(new.grad_norm, _true_grad_norm(h_params), rtol=1e-2,
                               err_msg=where)
    if not progress.first_clean_seen:
      progress.first_clean_seen = True
      if case.first_step_moves:
        assert _moved(h_params, new_params), f"{where}: no parameter moved"

  if not case.state16:
    low = [(jax.tree_util.keystr(p), x.dtype) for p, x in _paths(new.inner_state)
           if _is_float(x) and np.ndim(x) >= 1 and jnp.finfo(x.dtype).bits < 32]
    assert not low, f"{where}: 16-bit inner state {low}"


def _run(step, params0, states0, case, schedule, label, failures, compiled):
  """Runs one schedule on every tree; records the first failure of each.

  Appends to ``compiled`` the compilations the steps cause (and only those).
  """
  params, opt_states = params0, states0
  h_params, h_states = _host((params, opt_states))
  ctx = {k: f"{label} on {k}" for k in params0}
  progress = {k: _Progress(ctx[k], h_states[k]) for k in params0}
  for t, kind in enumerate(schedule):
    args = (jnp.int32(t), jnp.int32(kind))  # jnp.int32 compiles a conversion once
    with count_compilations() as now:
      params, opt_states, updates = step(params, opt_states, *args)
    compiled += now
    new_params, new_states, h_updates = _host((params, opt_states, updates))
    for k in params0:
      if ctx[k] in failures:
        continue
      try:
        _check_step(case, kind, progress[k], t, h_params[k], h_states[k],
                    new_params[k], new_states[k], h_updates[k])
      except AssertionError as e:
        failures[ctx[k]] = str(e)
    h_params, h_states = new_params, new_states
  h_params0 = _host(params0)
  for k in params0:
    # Training went on after the faults.
    if ctx[k] not in failures and not _moved(h_params0[k], h_params[k]):
      failures[ctx[k]] = "parameters never moved"


@pytest.mark.parametrize("name", MATRIX, ids=[_short(n) for n in MATRIX])
@pytest.mark.usefixtures("standard_promotion")
def test_fault_matrix(name):
  """Faults at chosen steps never reach params or opt_state, and training goes on.

  One compiled step runs the four trees side by side: the compile time of the
  guard dominates this module, and one program for four trees compiles in
  about 70% of the time of four.
  """
  case = _case(name)
  params0 = {kind: {k: v for k, v in _tree(kind).items() if k not in case.drop}
             for kind in TREES}
  txs = {label: jo.with_loss_scale(case.make(), ls) for label, ls in _loss_scales().items()}
  # The wrappers differ only in their initial loss scale, a traced leaf of the
  # state: one compiled step serves both.
  step = _make_step(next(iter(txs.values())), case)
  failures: dict[str, str] = {}
  compiled = []
  for label, tx in txs.items():
    states0 = {kind: tx.init(p) for kind, p in params0.items()}
    for faults, schedule in _RUNS.items():
      _run(step, params0, states0, case, schedule, f"{_short(name)}, {label}, {faults}",
           failures, compiled)
  if failures:
    runs = len(txs) * len(_RUNS) * len(TREES)
    report = "\n\n".join(f"[{ctx}] {msg}" for ctx, msg in sorted(failures.items()))
    pytest.fail(f"{len(failures)} of {runs} runs failed:\n\n{report}", pytrace=False)
  assert len(compiled) == 1


# ---------------------------------------------------------------------------
# Found by the matrix: optimizers whose state holds inf on purpose.
# ---------------------------------------------------------------------------


@pytest.mark.usefixtures("standard_promotion")
def test_an_inf_the_inner_state_starts_with_does_not_block_training():
  """reduce_on_plateau keeps best_value=inf until its first accumulation ends.

  That inf is the optimizer's "no value yet", not an overflow: a guard that
  refuses every state holding it never lets the first accumulation end.
  """
  params = {"w": jnp.ones(3)}
  tx = jo.with_loss_scale(
      optax.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau(accumulation_size=2)),
      jmp_lite.StaticLossScale(1.0))
  opt_state = tx.init(params)
  for _ in range(4):
    updates, opt_state = tx.update({"w": jnp.ones(3)}, opt_state, params, value=jnp.float32(1.0))
    params = jo.apply_updates(params, updates)
  state = jo.find_loss_scale_state(opt_state)
  assert int(state.skipped_steps) == 0, state.nonfinite
  np.testing.assert_allclose(params["w"], 0.6, rtol=1e-6)


@pytest.mark.usefixtures("standard_promotion")
def test_a_step_skipped_for_its_gradients_reports_only_the_gradients():
  """NonFinite: updates, params and opt_state are False when the gradients were not finite.

  lbfgs starts with inf in its state (no previous value yet); a first step
  with a NaN gradient must not blame the optimizer state.
  """
  params = {"w": jnp.ones(3)}
  tx = jo.with_loss_scale(optax.lbfgs(), jmp_lite.StaticLossScale(1.0))
  opt_state = tx.init(params)
  grads = {"w": jnp.array([jnp.nan, 1.0, 1.0])}
  loss = lambda p: jnp.sum(p["w"] ** 2)
  _, opt_state = tx.update(grads, opt_state, params, value=loss(params), grad=grads,
                           value_fn=loss)
  state = jo.find_loss_scale_state(opt_state)
  assert bool(state.skipped) and bool(state.nonfinite.grads)
  assert not bool(state.nonfinite.opt_state), state.nonfinite


# ---------------------------------------------------------------------------
# Regression tests: each failed on an earlier version.
# ---------------------------------------------------------------------------


@pytest.mark.usefixtures("standard_promotion")
def test_float16_params_train_with_adam():
  """Adam's eps (1e-8) is 0 in float16: its arithmetic must not happen there.

  In float16, a parameter with a zero gradient (here "unused") gets
  0 / (sqrt(0) + 0) = NaN, and every step is skipped.
  """
  x = jnp.linspace(-1.0, 1.0, 32, dtype=jnp.float32).reshape(8, 4)
  y = x @ jnp.array([1.0, -2.0, 0.5, 3.0])
  state = jmp_lite.TrainState.create(
      apply_fn=lambda p, x: x @ p["w"] + p["b"],
      params={"w": jnp.zeros(4), "b": jnp.zeros(()), "unused": jnp.ones(2)},
      tx=optax.adam(1e-2), loss_scale=jmp_lite.DynamicLossScale(2.0 ** 15),
      policy="p=f16,c=f16,o=f32")

  @jax.jit
  def train_step(state):
    def loss_fn(params):
      pred = state.apply_fn(params, state.policy.cast_to_compute(x))
      return jnp.mean((state.policy.cast_to_output(pred) - y) ** 2)
    return state.minimize(loss_fn)

  losses, skipped = [], []
  for _ in range(40):
    state, info = train_step(state)
    losses.append(float(info.loss))
    skipped.append(bool(info.skipped))
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(state.params))
  assert state.params["w"].dtype == jnp.float16
  assert not all(skipped)
  assert sum(skipped) < 10, skipped
  assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.usefixtures("standard_promotion")
def test_inject_hyperparams_keeps_float32_hyperparameters_for_bfloat16_params():
  """0.999 is 1.0 in bfloat16: Adam's second moment would never update."""
  params = {"w": jnp.ones((2, 3), jnp.bfloat16)}
  tx = jo.with_loss_scale(optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3),
                          jmp_lite.DynamicLossScale(2.0 ** 15))
  opt_state = tx.init(params)
  for _ in range(2):
    grads = {"w": jnp.full((2, 3), 2.0 ** 14, jnp.bfloat16)}
    updates, opt_state = tx.update(grads, opt_state, params)
    params = jo.apply_updates(params, updates)
    hyper = jo.find_loss_scale_state(opt_state).inner_state.hyperparams
    assert hyper["b2"].dtype == jnp.float32
    assert np.asarray(hyper["b2"]) == np.float32(0.999)
    assert np.asarray(hyper["learning_rate"]) == np.float32(1e-3)
  assert not bool(jo.find_loss_scale_state(opt_state).skipped)


def test_finite_update_that_overflows_a_float16_param_is_skipped():
  """A finite gradient and update can still make a float16 parameter -inf."""
  params = {"w": jnp.ones(2, jnp.float16)}
  loss_scale = jmp_lite.StaticLossScale(0.5)
  tx = jo.with_loss_scale(optax.sgd(1e4), loss_scale)
  opt_state = tx.init(params)
  grads = loss_scale.scale({"w": jnp.full(2, 2e4, jnp.float16)})  # 1e4: finite
  updates, opt_state = tx.update(grads, opt_state, params)
  new_params = jo.apply_updates(params, updates)
  state = jo.find_loss_scale_state(opt_state)
  assert bool(state.skipped)
  assert bool(state.nonfinite.params) and not bool(state.nonfinite.grads)
  assert not bool(jnp.any(jnp.isinf(new_params["w"])))
  assert_trees_bitwise_equal(new_params["w"], params["w"])
  # The scale stays: the gradients were fine.
  assert float(state.loss_scale.loss_scale) == 0.5


def test_tiny_gradient_of_float16_param_survives_unscaling():
  """3e-8 is below float16's smallest subnormal spacing: unscale into float32."""
  params = {"w": jnp.ones(3, jnp.float16)}
  loss_scale = jmp_lite.DynamicLossScale(2.0 ** 15)
  tx = jo.with_loss_scale(optax.sgd(1.0), loss_scale)
  grads = jax.grad(lambda p: loss_scale.scale(3e-8 * jnp.sum(p["w"].astype(jnp.float32))))(params)
  assert grads["w"].dtype == jnp.float16 and bool(jnp.all(grads["w"] > 0))
  updates, opt_state = tx.update(grads, tx.init(params), params)
  assert updates["w"].dtype == jnp.float32
  np.testing.assert_allclose(updates["w"], -3e-8, rtol=1e-2)
  assert not bool(jo.find_loss_scale_state(opt_state).skipped)


@pytest.mark.usefixtures("standard_promotion")
def test_float16_state_saturates_instead_of_overflowing():
  """nu = 0.001 * 1e4**2 = 1e5 is beyond float16: stored as 65504, not inf."""
  params = {"w": jnp.zeros(3)}
  tx = jo.with_loss_scale(jo.with_state_dtype(optax.adam(1e-3), jnp.float16),
                          jmp_lite.StaticLossScale(1.0))
  updates, opt_state = tx.update({"w": jnp.full(3, 1e4)}, tx.init(params), params)
  state = jo.find_loss_scale_state(opt_state)
  assert not bool(state.skipped), state.nonfinite
  nu = state.inner_state[0].nu["w"]
  assert nu.dtype == jnp.float16
  np.testing.assert_array_equal(nu, np.full(3, 65504, np.float16))
  np.testing.assert_allclose(updates["w"], -1e-3, rtol=1e-3)


def test_accumulation_with_an_overflowing_micro_batch_keeps_no_nan():
  """The accumulator never holds NaN; the overflowing step is skipped, the next applies."""
  params = {"w": jnp.array([1.0, 2.0]), "h": jnp.ones((2, 2), jnp.float16)}
  tx = jo.with_loss_scale(optax.sgd(0.1), jmp_lite.DynamicLossScale(2.0 ** 10),
                          accumulate_steps=3)
  opt_state = tx.init(params)

  @jax.jit
  def micro_step(params, opt_state, t):
    scale = jo.get_loss_scale(opt_state)
    grads = jax.grad(lambda p: scale.scale(
        jnp.sum(p["w"] ** 2) + jnp.sum(p["h"].astype(jnp.float32))))(params)
    grads = inject_nonfinite(grads, t, at_steps=[1], value="inf")
    updates, opt_state = tx.update(grads, opt_state, params)
    return jo.apply_updates(params, updates), opt_state

  start = params
  for t in range(6):
    params, opt_state = micro_step(params, opt_state, jnp.int32(t))
    state = jo.find_loss_scale_state(opt_state)
    assert all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(state.acc_grads)), t
    if t == 2:
      assert bool(state.skipped) and bool(state.nonfinite.grads)
      assert_trees_bitwise_equal(params, start, f"step {t}")
    if t == 5:
      assert not bool(state.skipped)
      assert int(state.skipped_steps) == 1
      np.testing.assert_allclose(params["w"], [0.8, 1.6], rtol=1e-6)
      assert bool(jnp.all(params["h"] < 1))


def test_clipping_gradients_beyond_2_to_the_126():
  """Finite float32 gradients whose squares overflow still clip to the right norm."""
  params = {"w": jnp.zeros(2)}
  big = 2.0 ** 127
  tx = jo.with_loss_scale(optax.sgd(1.0), jmp_lite.StaticLossScale(1.0), clip_norm=2.0)
  updates, opt_state = tx.update({"w": jnp.array([big, -big], jnp.float32)},
                                 tx.init(params), params)
  state = jo.find_loss_scale_state(opt_state)
  assert not bool(state.skipped)
  np.testing.assert_allclose(updates["w"], [-np.sqrt(2), np.sqrt(2)], rtol=1e-6)
  np.testing.assert_allclose(state.grad_norm, big * np.sqrt(2), rtol=1e-6)


def test_clipping_float64_gradients_of_1e200():
  """Under x64, norms beyond float64's sqrt(max) clip exactly and stay finite."""
  with jax.enable_x64(True):
    params = {"w": jnp.zeros(4, jnp.float64)}
    tx = jo.with_loss_scale(optax.sgd(1.0), jmp_lite.DynamicLossScale(2.0 ** 15),
                            clip_norm=1.0)
    opt_state = tx.init(params)
    grads = {"w": jnp.full(4, 1e200, jnp.float64) * 2.0 ** 15}
    updates, opt_state = jax.jit(tx.update)(grads, opt_state, params)
    params = jo.apply_updates(params, updates)
    state = jo.find_loss_scale_state(opt_state)
    assert not bool(state.skipped)
    assert params["w"].dtype == jnp.float64 and bool(jnp.all(jnp.isfinite(params["w"])))
    np.testing.assert_allclose(params["w"], -0.5, rtol=1e-12)
    assert state.grad_norm.dtype == jnp.float64
    np.testing.assert_allclose(state.grad_norm, 2e200, rtol=1e-12)


@pytest.mark.usefixtures("standard_promotion")
def test_complex_params_keep_their_imaginary_part_and_complex_nan_is_caught():
  """Unscaling must not drop the imaginary part, nor the check miss a NaN in it."""
  params = {"c": jnp.array([1 + 1j, 2 - 1j], jnp.complex64)}
  loss_scale = jmp_lite.StaticLossScale(2.0 ** 8)
  tx = jo.with_loss_scale(optax.sgd(1.0), loss_scale)
  opt_state = tx.init(params)
  true = jnp.array([0.5 + 0.25j, -1 + 2j], jnp.complex64)
  updates, opt_state = tx.update({"c": true * 2.0 ** 8}, opt_state, params)
  assert updates["c"].dtype == jnp.complex64
  np.testing.assert_allclose(updates["c"], -true, rtol=1e-6)
  for bad in (complex(0, np.nan), complex(np.nan, 0), complex(1, np.inf)):
    grads = {"c": true.at[1].set(bad) * 2.0 ** 8}
    updates, new_state = tx.update(grads, opt_state, params)
    state = jo.find_loss_scale_state(new_state)
    assert bool(state.skipped) and bool(state.nonfinite.grads), bad
    new_params = jo.apply_updates(params, updates)
    assert_trees_bitwise_equal(new_params["c"], params["c"], str(bad))


def test_multisteps_around_the_guard_is_refused():
  """MultiSteps keeps one overflowing micro-batch's NaN in its accumulator for good."""
  tx = jo.with_loss_scale(optax.sgd(0.1), jmp_lite.DynamicLossScale(2.0 ** 15))
  with pytest.raises(ValueError, match="accumulate_steps"):
    optax.MultiSteps(tx, every_k_schedule=2).init({"w": jnp.ones(3)})


def test_train_state_refuses_an_already_wrapped_optimizer():
  """Wrapping twice would unscale the gradients twice."""
  tx = jo.with_loss_scale(optax.sgd(0.1), jmp_lite.DynamicLossScale(2.0 ** 15))
  with pytest.raises(ValueError, match="with_loss_scale"):
    jmp_lite.TrainState.create(apply_fn=None, params={"w": jnp.ones(3)}, tx=tx)


def test_find_loss_scale_state_refuses_a_hand_nested_state():
  """Two loss scales in one state: which one scales the loss is ambiguous."""
  tx = jo.with_loss_scale(optax.sgd(0.1), jmp_lite.DynamicLossScale(2.0 ** 15))
  state = tx.init({"w": jnp.ones(3)})
  with pytest.raises(ValueError, match="found 2"):
    jo.find_loss_scale_state(state._replace(inner_state=state))
