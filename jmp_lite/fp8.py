"""fp8 matmuls with delayed or current scaling: per-tensor metadata as a typed pytree.

A tensor is quantised to an fp8 format as ``q = clip(x * (1 / scale), ±max)``
cast to the format, in float32 with one rounding onto the format, and read
back as ``q * scale`` (Transformer Engine's arithmetic, its ``scale`` being
our ``1 / scale``). *Delayed* scaling chooses ``scale`` from a history of the
tensor's absolute maxima in earlier steps, so the quantisation does not wait
for this step's maximum: `DelayedScaling.qdq` computes the new scale from the
history, quantises with it, and records this step's maximum, in one pass.
*Current* scaling (``init(..., scaling="current")``) takes it from this
step's maximum.

fp8 training: a policy with ``fp8="hybrid"`` (``"p=f32,c=bf16,o=f32,fp8=hybrid"``)
puts the matmuls of the modules it governs under `jmp_lite.flax.wrap` in fp8
(``select=`` picks plain-JAX matmuls by name scope). Each becomes a
``dot_general`` of fp8 arrays accumulating in float32, forward and backward
(`jmp_lite._jaxpr.fp8_sites`). `init` traces the step and gives each such matmul a
`MatmulMeta` in one `Fp8State`, which lives beside the loss scale
(`jmp_lite.TrainState.create` ``fp8=``) and is updated by the step from the
maxima measured in the same pass. `forward` (and ``fp8=`` of a wrapped
model's ``apply``) runs inference with the trained scales. `restore`
migrates checkpoints across history lengths and schema versions. Scales and
histories are checked bitwise against Flax's ``flax.linen.fp8_ops``
(``tests/test_fp8.py``, ``tests/test_fp8_training.py``), the matmuls against
a transcription of TE's (``tests/test_fp8_matmul.py``).
"""

from __future__ import annotations

import re
from typing import Any, Optional

from jmp_lite import _fp8_checkpoint
from jmp_lite._fp8_numerics import DelayedScaling
from jmp_lite._fp8_numerics import dequantize
from jmp_lite._fp8_numerics import FORMATS
from jmp_lite._fp8_numerics import qdq
from jmp_lite._fp8_numerics import quantize
from jmp_lite._fp8_numerics import quantize_by
from jmp_lite._fp8_numerics import reciprocal
from jmp_lite._fp8_state import Fp8State
from jmp_lite._fp8_state import MatmulMeta
from jmp_lite._fp8_state import SCHEMA_VERSION
from jmp_lite._jaxpr.passes import instrument as _instrument
from jmp_lite._jaxpr.passes import plan as _plan
from jmp_lite import _scaled_grad
from jmp_lite.policy import FP8_RECIPES

__all__ = ("DelayedScaling", "FORMATS", "Fp8State", "MatmulMeta", "SCHEMA_VERSION",
           "dequantize", "forward", "init", "qdq", "quantize", "quantize_by", "reciprocal",
           "restore")

_SCALINGS = ("delayed", "current", "block")

# Documented here, defined in jmp_lite._fp8_numerics. (Not the classes: the
# annotations of a class resolve in its __module__'s names, and Sphinx finds
# them through __all__.)
for _f in (dequantize, qdq, quantize, quantize_by, reciprocal):
  _f.__module__ = __name__
del _f






def init(fun: Any, *args: Any, argnums: Any = 0, has_aux: bool = False,
         policy: Any = None, select: Optional[str] = None, recipe: str = "hybrid",
         history_length: int = 1024, margin: int = 0, algorithm: str = "max",
         scaling: str = "delayed", **kwargs: Any) -> Fp8State:
  """The fp8 state of the step that differentiates ``fun(*args, **kwargs)``.

  Traces ``fun`` once (abstractly, nothing runs) as `jmp_lite.TrainState.minimize`
  and `jmp_lite.value_and_grad` will, finds its fp8 matmuls and gives each
  fresh metadata: all-zero histories and scales of 1, a row per layer for a
  matmul in a scanned stack of layers (one state for a matmul in a loop over
  time, `MatmulMeta`).

  Args:
    fun: the loss function, as the step will be given it.
    *args: example arguments (arrays or ``jax.ShapeDtypeStruct`` values are fine).
    argnums, has_aux, policy: as the step will be given them.
    select: which matmuls: None for those of the modules a policy with
      ``fp8`` governs under `jmp_lite.flax.wrap`; or a regular expression
      matched with `re.fullmatch` against each matmul's name-scope path
      (``jax.named_scope``, Flax module names), ``".*"`` for all.
    recipe: with ``select``: ``"hybrid"`` (e4m3 operands, e5m2 gradients) or
      ``"e4m3"``. Under wrap each module's policy says.
    history_length, margin, algorithm: as for `DelayedScaling.create`.
    scaling: ``"delayed"`` (the default: each tensor quantised with the
      scale its history asks for), ``"current"`` (Transformer Engine's
      ``Float8CurrentScaling``: with the scale of this step's own maximum,
      ``max / amax``; no history is read, a division more per tensor per
      step) or ``"block"`` (MXFP8, TE's ``MXFP8BlockScaling``: a power-of-two
      scale per 32 values along the contraction, `jmp_lite._fp8_blocks`).
      The state records the maxima either way.
    **kwargs: keyword arguments of ``fun``.

  Raises:
    ValueError: if no matmul is selected, or for a bad option.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import jmp_lite
    >>> def loss_fn(w, x):
    ...   with jax.named_scope("mlp"):
    ...     return jnp.mean(jnp.tanh(x @ w["a"]) @ w["b"])
    >>> w = {"a": jnp.ones((4, 8)), "b": jnp.ones((8, 2))}
    >>> state = jmp_lite.fp8.init(loss_fn, w, jnp.ones((3, 4)), select="mlp",
    ...                           history_length=16)
    >>> list(state.sites), state.history_length
    (['mlp', 'mlp#2'], 16)
  """
  if recipe not in FP8_RECIPES:
    raise ValueError(f"recipe must be one of {sorted(FP8_RECIPES)}, got {recipe!r}")
  if scaling not in _SCALINGS:
    raise ValueError(f"scaling must be one of {_SCALINGS}, got {scaling!r}")
  if select is not None and not isinstance(select, str):
    raise TypeError(f"select must be None or a regular expression string, got {select!r}")
  if select is not None:
    try:
      re.compile(select)
    except re.error as e:
      raise ValueError(f"select={select!r} is not a valid regular expression: {e}") from None
  if scaling != "delayed" and (margin != 0 or algorithm != "max"):
    # Refused rather than stored and ignored: these scalings read no history.
    raise ValueError(
        f"margin={margin!r} and algorithm={algorithm!r} choose a delayed scale "
        f"from the history; scaling={scaling!r} quantises with each step's own "
        "maxima (Transformer Engine's Float8CurrentScaling and MXFP8BlockScaling "
        "take neither). Leave them at 0 and 'max', or use scaling='delayed'.")
  DelayedScaling.create(history_length=history_length, margin=margin,
                        algorithm=algorithm)  # checks the options
  found = _scaled_grad.fp8_sites(
      fun, args, kwargs, argnums=argnums, has_aux=has_aux, policy=policy,
      selection=_plan.Fp8Selection(select, recipe))
  if not found:
    raise ValueError(
        "jmp_lite.fp8.init: no fp8 matmul in this step: " + (
            "no module's policy has fp8 (wrap the model with a rule such as "
            "{nn.Dense: 'p=f32,c=bf16,o=f32,fp8=hybrid'}, or pass select=)"
            if select is None else f"no matmul's name-scope path matches {select!r}"))
  return Fp8State(
      sites={name: MatmulMeta.create(shape, formats, history_length=history_length,
                                     margin=margin, algorithm=algorithm)
             for name, shape, formats in found},
      select=select, recipe=recipe, scaling=scaling)


def forward(fun: Any, state: Fp8State) -> Any:
  """``fun`` with its fp8 matmuls run with ``state``'s scales: inference.

  The matmuls are chosen as the training step chose them, and each computes
  what the training step's forward computes, so for the same inputs and
  state the output is the training forward's, bitwise. The scales are read,
  never updated. Under `jmp_lite.flax.wrap`, ``wrapped.apply(variables, x,
  fp8=state)`` (Linen) and ``wrapped(x, fp8=state)`` (NNX) do this.

  Args:
    fun: the function, e.g. a model's forward pass. A loop's matmuls run
      as the state's rows say they were trained (one state per layer of a
      scanned stack, one for a cell over time), however the parameters
      reach ``fun``.
    state: the `Fp8State` of training (`jmp_lite.TrainState`'s
      ``loss_scale_state.fp8``, or restored from a checkpoint).

  Returns:
    A function with ``fun``'s signature.

  Raises:
    TypeError: if ``state`` is not an `Fp8State`.
    ValueError: if ``fun``'s fp8 matmuls are not the state's (names, formats
      or layers).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import jmp_lite.fp8 as fp8
    >>> def mlp(w, x):
    ...   with jax.named_scope("mlp"):
    ...     return jnp.tanh(x @ w)
    >>> w, x = jnp.ones((4, 8)), jnp.full((3, 4), 0.1)
    >>> state = fp8.init(lambda w, x: mlp(w, x).sum(), w, x, select="mlp")
    >>> fp8.forward(mlp, state)(w, x).shape
    (3, 8)
  """
  def run(*args, **kwargs):
    return _instrument.forward(fun, state, *args, **kwargs)

  return run


def restore(raw: Any, target: Any, *, strict: bool = True) -> Any:
  """``target`` filled from a checkpoint restored without a target.

  For a checkpoint whose fp8 metadata no longer fits the state it is restored
  into: a new history length (the newest entries are kept, in order, and a
  longer history is padded with zeros, "nothing seen") or an older schema
  version. ``raw`` is what ``orbax.checkpoint`` returns when restoring with no
  target (nested dicts and lists of arrays); ``target`` is the state to
  restore into, concrete or abstract (``jax.eval_shape``), holding
  `Fp8State` anywhere (a `jmp_lite.TrainState`, its ``opt_state``...).
  Every other leaf is taken as saved, checked against ``target``'s shape and
  converted to its dtype. Each leaf is placed on the target's sharding where
  it has one (an abstract target laid out for the restoring mesh), and a
  leaf spanning other processes' devices is read as it is: every process
  calls ``restore``, as with orbax.

  Args:
    raw: the checkpoint, restored with no target.
    target: the state to fill.
    strict: refuse a value of ``raw`` the target has no place for (a loss
      scale or optimizer state it lacks); False takes part of a checkpoint
      on purpose (the parameters and fp8 state of a training checkpoint,
      for inference).

  Raises:
    ValueError: a leaf missing or of another shape, a value the target has
      no place for (with ``strict``), a checkpoint of a newer schema, or fp8
      sites that differ (names or layers), naming the path.

  Example:
    >>> import jax.numpy as jnp
    >>> import jmp_lite.fp8 as fp8
    >>> old = fp8.Fp8State({"mlp": fp8.MatmulMeta.create(history_length=4)})
    >>> old = old.observe({"mlp": jnp.array([1.0, 2.0, 3.0])}).commit()
    >>> raw = {"sites": {"mlp": {"lhs": {"amax_history": old.sites["mlp"].lhs.amax_history,
    ...                                  "scale": old.sites["mlp"].lhs.scale},
    ...        "rhs": {"amax_history": old.sites["mlp"].rhs.amax_history,
    ...                "scale": old.sites["mlp"].rhs.scale},
    ...        "grad": {"amax_history": old.sites["mlp"].grad.amax_history,
    ...                 "scale": old.sites["mlp"].grad.scale},
    ...        "observed": old.sites["mlp"].observed}}, "version": old.version,
    ...        "grad_loss_scale": old.grad_loss_scale}
    >>> new = fp8.Fp8State({"mlp": fp8.MatmulMeta.create(history_length=2)})
    >>> fp8.restore(raw, new).sites["mlp"].grad.amax_history.tolist()
    [3.0, 0.0]
  """
  return _fp8_checkpoint.restore(raw, target, strict)
