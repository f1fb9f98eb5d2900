"""Test utilities: fault injection, a compile-count check, a multi-process harness.

`inject_nonfinite` poisons gradients (NaN, +inf or -inf) at chosen steps, in
chosen or random leaves, inside ``jit`` with the step number traced, so a
training loop can prove that its bad steps are skipped and leave nothing
behind. `assert_trees_bitwise_equal` checks what "nothing behind" means: every
bit of every leaf unchanged. `assert_single_compile` proves that a step
function compiles once.

Example: a jitted step that survives an overflow at steps 3 and 7::

    @jax.jit
    def train_step(state, batch, step):
      grads = grad_fn(state.params, batch)               # scaled gradients
      grads = inject_nonfinite(grads, step, at_steps=[3, 7], value="inf")
      return state.apply_gradients(grads=grads, scaled=True)  # skips steps 3 and 7

`run_processes` runs a worker script as N processes of K CPU devices each,
joined into one JAX runtime by `initialize_worker`, and collects what each
sent with `report_result`: multi-process data parallelism, tested on one
machine (implemented in ``jmp_lite/_launch.py`` and ``jmp_lite/_worker.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._dtypes import is_floating
from jmp_lite._launch import MultiProcessError
from jmp_lite._launch import ProcessResult
from jmp_lite._launch import run_processes
from jmp_lite._worker import initialize_worker
from jmp_lite._worker import report_result

__all__ = (
    "assert_trees_bitwise_equal",
    "inject_nonfinite",
    "count_compilations",
    "assert_single_compile",
    "run_processes",
    "ProcessResult",
    "MultiProcessError",
    "initialize_worker",
    "report_result",
)

T = TypeVar("T")

_VALUES = {"nan": np.nan, "inf": np.inf, "+inf": np.inf, "-inf": -np.inf}
_ELEMENTS = ("first", "random", "all")


def _check_value(value: Any) -> Union[str, float]:
  if isinstance(value, str):
    v = value.strip().lower()
    if v == "random" or v in _VALUES:
      return v
    raise ValueError(
        f"inject_nonfinite: value={value!r} must be 'nan', 'inf', '-inf', "
        "'random' or a non-finite float.")
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, (float, int, np.floating, np.integer)):
    raise TypeError(
        f"inject_nonfinite: value must be a string or a float, got {value!r}.")
  if np.isfinite(value):
    raise ValueError(
        f"inject_nonfinite: value={value!r} is finite; inject NaN, inf or -inf.")
  return float(value)


def _check_steps(at_steps: Any) -> np.ndarray:
  if isinstance(at_steps, (int, np.integer)) and not isinstance(at_steps, bool):
    at_steps = [at_steps]
  try:
    steps = np.asarray(at_steps)
  except (TypeError, ValueError) as e:
    raise TypeError(
        f"inject_nonfinite: at_steps must be a sequence of ints, got {at_steps!r}") from e
  if steps.size == 0:
    return np.zeros((0,), np.int32)
  if steps.ndim != 1 or not jnp.issubdtype(steps.dtype, jnp.integer):
    raise TypeError(
        f"inject_nonfinite: at_steps must be a 1-D sequence of ints, got "
        f"{at_steps!r}")
  if (steps < 0).any() or (steps > np.iinfo(np.int32).max).any():
    raise ValueError(
        f"inject_nonfinite: at_steps must be >= 0 and fit in int32, got {at_steps!r}")
  return steps.astype(np.int32)


def _select(paths_and_leaves, leaves: Any) -> list[int]:
  """Indices of the floating leaves ``leaves`` selects."""
  floating = [i for i, (_, x) in enumerate(paths_and_leaves) if is_floating(x)]
  if not floating:
    raise ValueError("inject_nonfinite: the tree has no floating-point leaf to poison.")
  if isinstance(leaves, str) and leaves in ("all", "random"):
    return floating
  names = {jax.tree_util.keystr(paths_and_leaves[i][0]): i for i in floating}
  if callable(leaves):
    chosen = [i for i in floating
              if leaves(jax.tree_util.keystr(paths_and_leaves[i][0]),
                        paths_and_leaves[i][1])]
    if not chosen:
      raise ValueError(
          f"inject_nonfinite: the leaves predicate selected none of {sorted(names)}.")
    return chosen
  if isinstance(leaves, str) or not isinstance(leaves, (list, tuple)):
    raise TypeError(
        f"inject_nonfinite: leaves must be 'all', 'random', a sequence of leaf "
        f"paths or a predicate (path, leaf) -> bool, got {leaves!r}.")
  unknown = [p for p in leaves if p not in names]
  if unknown or not leaves:
    raise ValueError(
        f"inject_nonfinite: unknown leaf paths {unknown or leaves!r}; the floating "
        f"leaves are {sorted(names)}.")
  return sorted({names[p] for p in leaves})


def inject_nonfinite(
    tree: T,
    step: Any,
    *,
    at_steps: Union[int, Sequence[int]],
    value: Union[str, float] = "nan",
    leaves: Union[str, Sequence[str], Callable[[str, Any], bool]] = "all",
    element: str = "first",
    key: Optional[jax.Array] = None,
    enabled: Any = True,
) -> T:
  """Returns ``tree`` with NaN or infinities injected on the chosen steps.

  Works on any floating dtype (float64 to float8; formats without infinity,
  such as ``float8_e4m3fn``, receive NaN for ``"inf"``), inside or outside
  ``jit``, with ``step`` and ``enabled`` traced or concrete: the poisoning is
  a ``where`` on a traced condition, so one compiled step serves clean and
  poisoned steps alike. On a step not in ``at_steps`` the tree is returned
  bitwise unchanged.

  Args:
    tree: a pytree of arrays, typically gradients.
    step: the current step number (int scalar, may be traced).
    at_steps: the step numbers to poison (ints >= 0).
    value: ``"nan"``, ``"inf"``, ``"-inf"``, a non-finite float, or
      ``"random"`` (one of the three per poisoned step; needs ``key``).
    leaves: which floating leaves: ``"all"``, ``"random"`` (one per poisoned
      step; needs ``key``), a sequence of paths as printed by
      ``jax.tree_util.keystr`` (e.g. ``"['dense']['kernel']"``), or a
      predicate ``(path, leaf) -> bool``.
    element: which elements of a chosen leaf: ``"first"`` (flat index 0),
      ``"random"`` (one per leaf and step; needs ``key``) or ``"all"``.
    key: a PRNG key for the random choices; folded with ``step``, so the
      choice is reproducible and differs between steps.
    enabled: an extra boolean scalar condition, e.g.
      ``jax.lax.axis_index("data") == 3`` to poison one replica under
      ``shard_map``.

  Returns:
    A tree of the same structure, shapes and dtypes.

  Raises:
    ValueError: for an unknown value, step, element or leaf path, a finite
      value, a tree with no floating leaf, or a chosen leaf whose dtype has
      neither NaN nor infinity.
    TypeError: for arguments of the wrong type, or a random choice without
      ``key``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite.testing import inject_nonfinite
    >>> grads = {"b": jnp.ones(2, jnp.bfloat16), "w": jnp.ones(3)}
    >>> inject_nonfinite(grads, 4, at_steps=[4], value="-inf", leaves=["['w']"])
    {'b': Array([1, 1], dtype=bfloat16), 'w': Array([-inf,   1.,   1.], dtype=float32)}
    >>> inject_nonfinite(grads, 5, at_steps=[4])["w"]
    Array([1., 1., 1.], dtype=float32)
  """
  value = _check_value(value)
  steps = _check_steps(at_steps)
  if element not in _ELEMENTS:
    raise ValueError(
        f"inject_nonfinite: element={element!r} must be one of {_ELEMENTS}.")
  wants_key = (value == "random" or (isinstance(leaves, str) and leaves == "random")
               or element == "random")
  if wants_key and key is None:
    raise TypeError(
        "inject_nonfinite: a random choice (value, leaves or element 'random') "
        "needs key=jax.random.key(...).")
  step_shape = np.shape(step)
  if step_shape != () or not jnp.issubdtype(jnp.result_type(step), jnp.integer):
    raise TypeError(
        f"inject_nonfinite: step must be an integer scalar, got {step!r}.")
  enabled_shape = np.shape(enabled)
  if enabled_shape != () or jnp.result_type(enabled) != jnp.bool_:
    raise TypeError(
        f"inject_nonfinite: enabled must be a boolean scalar, got {enabled!r}.")

  paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  chosen = _select(paths_and_leaves, leaves)
  for i in chosen:
    dtype = paths_and_leaves[i][1].dtype
    with np.errstate(invalid="ignore", over="ignore"):
      if np.isfinite(np.array(np.nan, np.float32).astype(dtype)):
        raise ValueError(
            f"inject_nonfinite: leaf {jax.tree_util.keystr(paths_and_leaves[i][0])} "
            f"is {np.dtype(dtype).name}, which has neither NaN nor infinity.")

  step = jnp.asarray(step).astype(jnp.int32)
  poison = jnp.any(step == jnp.asarray(steps)) & jnp.asarray(enabled)
  step_key = None if key is None else jax.random.fold_in(key, step)
  if value == "random":
    choice = jax.random.randint(jax.random.fold_in(step_key, 0), (), 0, 3)
    bad = jnp.array([np.nan, np.inf, -np.inf], jnp.float32)[choice]
  else:
    bad = jnp.asarray(_VALUES.get(value, value), jnp.float32)
  if isinstance(leaves, str) and leaves == "random":
    pick = jax.random.randint(jax.random.fold_in(step_key, 1), (), 0, len(chosen))
  else:
    pick = None

  out = [x for _, x in paths_and_leaves]
  for n, i in enumerate(chosen):
    x = jnp.asarray(out[i])
    hit = poison if pick is None else poison & (pick == n)
    with np.errstate(invalid="ignore", over="ignore"):
      v = bad.astype(x.dtype)
    if element == "all" or x.size == 0:
      out[i] = jnp.where(hit, v, x)
      continue
    if element == "random":
      k = jax.random.fold_in(jax.random.fold_in(step_key, 2), i)
      flat = jax.random.randint(k, (), 0, x.size)
    else:
      flat = jnp.zeros((), jnp.int32)
    index = jnp.unravel_index(flat, x.shape)
    out[i] = x.at[index].set(jnp.where(hit, v, x[index]))
  return jax.tree_util.tree_unflatten(treedef, out)


@contextlib.contextmanager
def count_compilations() -> Iterator[list]:
  """Counts XLA compilations in this process while the context is open.

  Yields a list that receives one entry per backend compilation; its length
  is the count.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jmp_lite.testing import count_compilations
    >>> f = jax.jit(lambda x: x * 2)
    >>> x, y = jnp.ones(3), jnp.zeros(3)
    >>> with count_compilations() as compiled:
    ...   _ = f(x); _ = f(y)
    >>> len(compiled)
    1
  """
  compiled: list = []
  # The `jax.monitoring` event JAX records for each backend compilation.
  event = "/jax/core/compile/backend_compile_duration"

  def listener(name, duration, **kwargs):
    del duration, kwargs
    if name == event:
      compiled.append(name)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield compiled
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def _avals(tree: Any) -> list[tuple[str, Any]]:
  def describe(x):
    try:
      aval = jax.typeof(x)
    except TypeError:
      return type(x).__name__
    return (tuple(aval.shape), np.dtype(aval.dtype).name,
            bool(getattr(aval, "weak_type", False)))

  return [(jax.tree_util.keystr(p), describe(x))
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def assert_single_compile(
    step_fn: Callable[..., Any],
    state: Any,
    *args: Any,
    n_steps: int = 3,
    get_state: Optional[Callable[[Any], Any]] = None,
    **kwargs: Any,
) -> Any:
  """Asserts that ``state = step_fn(state, *args, **kwargs)`` compiles once.

  Runs ``n_steps`` steps (jitting ``step_fn`` if it is not jitted already),
  feeding each step's state into the next, and checks that:

  * the state coming out has the structure, shapes, dtypes and weak types of
    the state going in (the usual reason for a second compilation: a Python
    scalar in the initial state, or a counter that changes dtype);
  * steps 2 to ``n_steps`` trigger no compilation.

  Args:
    step_fn: the step; returns the new state, or a tuple whose first element
      is the new state (``(state, metrics)``).
    state: the initial state.
    *args: further arguments, the same on every step.
    n_steps: number of steps to run (>= 2).
    get_state: extracts the new state from ``step_fn``'s output, when the
      default rule above does not fit.
    **kwargs: further keyword arguments of ``step_fn``.

  Returns:
    The output of the last step.

  Raises:
    AssertionError: naming the leaves whose type changed, or the number of
      recompilations.
    ValueError: if ``n_steps < 2``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_lite.testing import assert_single_compile
    >>> out = assert_single_compile(lambda s: s + 1, jnp.zeros((), jnp.int32))
    >>> int(out)
    3
    >>> assert_single_compile(lambda s: s + jnp.float32(1), 0.0)  # a Python float
    Traceback (most recent call last):
    ...
    AssertionError: step_fn's state changed type between steps, so the second step recompiles: (root): ((), 'float32', True) -> ((), 'float32', False)
  """
  if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 2:
    raise ValueError(f"assert_single_compile: n_steps must be an int >= 2, got {n_steps!r}")
  fn = step_fn if hasattr(step_fn, "lower") else jax.jit(step_fn)
  state_def = jax.tree_util.tree_structure(state)

  def next_state(out):
    if get_state is not None:
      return get_state(out)
    if jax.tree_util.tree_structure(out) == state_def:
      return out
    if isinstance(out, tuple) and out and (
        jax.tree_util.tree_structure(out[0]) == state_def):
      return out[0]
    raise TypeError(
        "assert_single_compile: cannot find the new state in step_fn's output "
        f"{jax.tree_util.tree_structure(out)}; pass get_state=.")

  out = fn(state, *args, **kwargs)
  new = next_state(out)
  before, after = _avals(state), _avals(new)
  if before != after:
    diffs = [f"{p or '(root)'}: {a} -> {b}"
             for (p, a), (_, b) in zip(before, after) if a != b]
    raise AssertionError(
        "step_fn's state changed type between steps, so the second step "
        "recompiles: " + "; ".join(diffs or [f"{before} -> {after}"]))
  with count_compilations() as compiled:
    for _ in range(n_steps - 1):
      out = fn(new, *args, **kwargs)
      new = next_state(out)
  if compiled:
    raise AssertionError(
        f"step_fn compiled {len(compiled)} more time(s) after its first step "
        f"(over {n_steps - 1} further steps).")
  return out


def _as_bits(x: Any) -> np.ndarray:
  """A leaf as unsigned integers of its width (a PRNG key: its key data)."""
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  x = np.asarray(x)
  return x.view(f"u{x.itemsize}") if x.dtype.itemsize in (1, 2, 4, 8) else x


def _equal(x: Any, y: Any) -> bool:
  try:
    return bool(x == y)
  except Exception:  # pylint: disable=broad-except  # no truth value: not equal
    return False


def assert_trees_bitwise_equal(a: Any, b: Any, custom_message: Optional[str] = None) -> None:
  """Asserts that two pytrees are equal bit for bit: structure, dtypes, bits.

  A skipped step must leave parameters and optimizer state exactly as they
  were. Value equality (``np.array_equal``, ``chex.assert_trees_all_equal``)
  misses what matters there: it holds ``-0.0 == 0.0`` and, with
  ``equal_nan``, any NaN equal to any other. Here each leaf is compared as the
  unsigned integers of its width, after its dtype and shape.

  Raises:
    AssertionError: naming the first differing leaf's pytree path.

  Example:
    >>> import jax.numpy as jnp
    >>> assert_trees_bitwise_equal({"w": jnp.zeros(2)}, {"w": jnp.zeros(2)})
    >>> try:
    ...   assert_trees_bitwise_equal({"w": jnp.zeros(2)}, {"w": -jnp.zeros(2)})
    ... except AssertionError as e:
    ...   print(e)
    ['w']: differ bitwise at 2 of 2 elements
  """
  prefix = f"{custom_message}: " if custom_message else ""
  leaves_a, tree_a = jax.tree_util.tree_flatten_with_path(a)
  leaves_b, tree_b = jax.tree_util.tree_flatten_with_path(b)
  if tree_a != tree_b:
    raise AssertionError(f"{prefix}tree structures differ: {tree_a} vs {tree_b}")
  numeric = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)
  for (path, x), (_, y) in zip(leaves_a, leaves_b):
    where = jax.tree_util.keystr(path) or "the tree"
    if not (isinstance(x, numeric) and isinstance(y, numeric)):
      # A model's own leaves that are not numbers (an Equinox activation
      # function, a string): the same object, or equal.
      if not (x is y or (type(x) is type(y) and _equal(x, y))):
        raise AssertionError(f"{prefix}{where}: {x!r} vs {y!r}")
      continue
    dx, dy = getattr(x, "dtype", type(x)), getattr(y, "dtype", type(y))
    if dx != dy or np.shape(x) != np.shape(y):
      raise AssertionError(f"{prefix}{where}: {dx}{list(np.shape(x))} vs "
                           f"{dy}{list(np.shape(y))}")
    bx, by = _as_bits(x), _as_bits(y)
    if bx.shape != by.shape or not np.array_equal(bx, by):
      differ = int(np.sum(bx != by)) if bx.shape == by.shape else "all"
      raise AssertionError(f"{prefix}{where}: differ bitwise at {differ} of "
                           f"{bx.size} elements")
