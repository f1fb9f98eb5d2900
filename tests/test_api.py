"""Tests of jmp_lite's public surface: __all__, and jmp 0.0.4's names."""

import importlib
import inspect
import pathlib

import jax.numpy as jnp
import jmp
import pytest

import jmp_lite


def test_every_name_in_all_resolves():
  missing = [name for name in jmp_lite.__all__ if not hasattr(jmp_lite, name)]
  assert not missing
  assert all(isinstance(name, str) and not name.startswith("_")
             for name in jmp_lite.__all__)


def test_no_name_is_listed_twice():
  seen, duplicates = set(), []
  for name in jmp_lite.__all__:
    if name in seen:
      duplicates.append(name)
    seen.add(name)
  assert not duplicates


def test_star_import_exports_exactly_all():
  namespace = {}
  exec("from jmp_lite import *", namespace)  # pylint: disable=exec-used
  del namespace["__builtins__"]
  assert sorted(namespace) == sorted(jmp_lite.__all__)


def test_version():
  assert isinstance(jmp_lite.__version__, str) and jmp_lite.__version__


@pytest.mark.parametrize("name", jmp.__all__)
def test_every_public_name_of_jmp_exists_in_jmp_lite(name):
  assert name in jmp_lite.__all__
  ours, theirs = getattr(jmp_lite, name), getattr(jmp, name)
  # Same kind of object: class for class, function for function.
  assert inspect.isclass(ours) == inspect.isclass(theirs)
  assert callable(ours) == callable(theirs)
  if inspect.isfunction(theirs):
    # Every positional parameter of jmp's function is accepted under its name.
    ours_params = inspect.signature(ours).parameters
    for param in inspect.signature(theirs).parameters:
      assert param in ours_params, (name, param)


def test_jmp_has_the_names_we_think_it_has():
  # Pins the jmp version this superset is checked against.
  assert jmp.__version__ == "0.0.4"
  assert set(jmp.__all__) == {
      "all_finite", "DynamicLossScale", "LossScale", "NoOpLossScale", "select_tree",
      "StaticLossScale", "cast_to_full", "cast_to_half", "get_policy",
      "half_dtype", "Policy"}


def test_constructor_and_method_names_of_jmp_classes_exist():
  for cls in ("Policy", "NoOpLossScale", "StaticLossScale", "DynamicLossScale"):
    ours, theirs = getattr(jmp_lite, cls), getattr(jmp, cls)
    ours_params = inspect.signature(ours).parameters
    for param in inspect.signature(theirs).parameters:
      assert param in ours_params, (cls, param)
    public = [n for n in dir(theirs) if not n.startswith("_")
              and n not in ("tree_flatten", "tree_unflatten")]
    for attr in public:
      assert hasattr(ours, attr), (cls, attr)


def test_loss_scale_union_covers_the_three_classes():
  assert set(jmp_lite.LossScale.__args__) == {
      jmp_lite.NoOpLossScale, jmp_lite.StaticLossScale, jmp_lite.DynamicLossScale}


def test_jmp_readme_policy_example_runs_unchanged():
  jmp_ = jmp_lite
  half, full = jnp.float16, jnp.float32
  my_policy = jmp_.Policy(compute_dtype=half, param_dtype=full, output_dtype=half)

  def layer(params, x):
    params, x = my_policy.cast_to_compute((params, x))
    w, b = params
    y = x @ w + b
    return my_policy.cast_to_output(y)

  params = (jnp.ones([3, 2], dtype=my_policy.param_dtype), jnp.zeros([2]))
  y = layer(params, jnp.ones([4, 3]))
  assert y.dtype == half
  my_policy = my_policy.with_output_dtype(full)
  assert layer(params, jnp.ones([4, 3])).dtype == full
  assert jmp_.get_policy("float16") == jmp_.Policy(half, half, half)
  assert jmp_.get_policy("half").compute_dtype == jmp_.half_dtype()


def test_code_written_for_jmp_runs_unchanged():
  # jmp's README example, with `import jmp_lite as jmp`.
  jmp_ = jmp_lite
  policy = jmp_.get_policy("params=float32,compute=float16,output=float32")
  params = {"w": jnp.ones((3, 2)), "step": jnp.zeros((), jnp.int32)}
  loss_scale = jmp_.DynamicLossScale(jmp_.half_dtype()(2 ** 15))

  def loss_fn(params, x):
    params = policy.cast_to_compute(params)
    x = policy.cast_to_compute(x)
    y = x @ params["w"]
    return policy.cast_to_output(jnp.sum(y * y))

  x = jnp.ones((4, 3))
  loss = loss_scale.scale(loss_fn(params, x))
  grads = loss_scale.unscale({"w": jnp.full((3, 2), 2.0)})
  finite = jmp_.all_finite(grads)
  loss_scale = loss_scale.adjust(finite)
  params = jmp_.select_tree(finite, params, params)
  assert loss.dtype == jnp.float32 and float(loss) == 72.0 * 2 ** 15
  assert bool(finite) and int(loss_scale.counter) == 1
  assert policy.param_dtype == jnp.float32 and policy.compute_dtype == jnp.float16


def test_import_does_not_pull_in_flax_or_optax():
  """A plain-JAX user does not pay for Flax and optax: integrations load on first use."""
  import subprocess
  import sys
  code = ("import sys, jmp_lite; "
          "print(sorted(m for m in ('flax', 'optax') if m in sys.modules)); "
          "jmp_lite.TrainState; "
          "print(sorted(m for m in ('flax', 'optax') if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, check=True)
  assert out.stdout.split("\n")[:2] == ["[]", "['flax', 'optax']"], out.stdout


def test_lazy_names_are_listed_by_dir():
  assert {"flax", "optax", "TrainState", "audit", "autocast"} <= set(dir(jmp_lite))


PUBLIC_MODULES = {
    "auditing": {"audit", "AuditReport", "AuditRow", "FLAGS", "HALF_MATMUL"},
    "autocasting": {"autocast", "primitive_name"},
    "calibration": {"calibrate", "Calibration", "ScopeStats"},
    "distributed": {"collectives", "Collective", "mark_varying", "reduce_gradients",
                    "is_replicated_everywhere", "AxisName"},
    "flax": {"wrap", "policy_map", "default_rules"},
    "fp8": {"DelayedScaling", "FORMATS", "Fp8State", "MatmulMeta", "SCHEMA_VERSION",
            "dequantize", "init", "qdq", "quantize", "quantize_by", "reciprocal", "restore"},
    "hardware": {"Hardware", "describe", "measure_matmuls", "CPU_FLAGS"},
    "loss_scale": {"LossScale", "NoOpLossScale", "StaticLossScale",
                   "DynamicLossScale", "all_finite", "select_tree", "AxisName"},
    "module_scale": {"ModuleLossScale"},
    "oplists": {"DEFAULT_WHITE_LIST", "DEFAULT_BLACK_LIST",
                "MIN_REDUCTION_SIZE", "primitive_name"},
    "optax": {"with_loss_scale", "apply_updates", "get_loss_scale",
              "find_loss_scale_state", "LossScaleState", "NonFinite"},
    "policy": {"Policy", "get_policy", "parse_dtype", "dtype_name",
               "dtype_to_names", "name_to_dtype", "half_dtype",
               "preferred_half_dtype", "cast_to_full", "cast_to_half",
               "PRESETS"},
    "rounding": {"stored_params", "StochasticRoundState", "stochastic_round",
                 "KahanState", "kahan_summation", "with_state_dtype"},
    "testing": {"inject_nonfinite", "count_compilations",
                "assert_single_compile", "assert_trees_bitwise_equal",
                "run_processes", "ProcessResult", "MultiProcessError",
                "initialize_worker", "report_result"},
    "telemetry": {"Telemetry", "PrecisionStats", "ModuleStats", "tap"},
    "training": {"value_and_grad", "StepInfo", "TrainState"},
    "underflow": {"AutomaticLossScale", "UnderflowAwareLossScale"},
}


def test_every_public_module_is_pinned():
  package = pathlib.Path(jmp_lite.__file__).parent
  modules = {p.stem for p in package.glob("*.py") if not p.stem.startswith("_")}
  assert modules == set(PUBLIC_MODULES)


@pytest.mark.parametrize("name", sorted(PUBLIC_MODULES))
def test_public_modules_pin_their_api(name):
  """Each public module says what it exports, and exports what it defines.

  A function or class defined in a public module without a leading
  underscore is API: it must be in ``__all__``. Helpers shared between
  modules live in private modules (`jmp_lite._dtypes`) or carry an
  underscore. The pinned names catch an accidental removal.
  """
  module = importlib.import_module(f"jmp_lite.{name}")
  exported = set(module.__all__)
  assert PUBLIC_MODULES[name] <= exported, PUBLIC_MODULES[name] - exported
  assert all(hasattr(module, n) for n in exported)
  defined = {n for n, v in vars(module).items()
             if not n.startswith("_") and (inspect.isfunction(v) or inspect.isclass(v))
             and getattr(v, "__module__", None) == module.__name__}
  assert defined <= exported, defined - exported


def test_the_api_reference_documents_every_public_module_and_name():
  """docs/api.rst (built by CI with warnings as errors) misses no module, and
  every top-level name is defined or re-exported by a documented module."""
  import pkgutil
  import re

  text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "api.rst").read_text()
  documented = set(re.findall(r"^\.\. automodule:: (jmp_lite\.\w+)$", text, re.M))
  public = {f"jmp_lite.{m.name}" for m in pkgutil.iter_modules(jmp_lite.__path__)
            if not m.name.startswith("_")}
  assert documented == public
  names = set()
  for module in documented:
    names |= set(getattr(importlib.import_module(module), "__all__", ()))
  names |= set(re.findall(r"^\.\. auto\w+:: jmp_lite\.(\w+)$", text, re.M))
  assert set(jmp_lite.__all__) - {"__version__"} <= names


def test_the_annotations_of_public_classes_resolve():
  """Every annotation a public jmp_lite class writes names something its
  module defines (what ``typing.get_type_hints`` and dataclass tools read).
  A class re-exported with its ``__module__`` changed to the public module
  would fail here."""
  import dataclasses
  import sys

  unresolved = []
  for module_name, names in PUBLIC_MODULES.items():
    module = importlib.import_module(f"jmp_lite.{module_name}")
    for name in names:
      obj = getattr(module, name)
      if not (inspect.isclass(obj) and dataclasses.is_dataclass(obj)):
        continue
      for cls in obj.__mro__:
        if not cls.__module__.startswith("jmp_lite"):
          continue  # e.g. flax's TrainState, whose own annotation does not resolve
        namespace = vars(sys.modules[cls.__module__])
        for field, annotation in vars(cls).get("__annotations__", {}).items():
          try:
            if isinstance(annotation, str):
              eval(annotation, namespace)  # pylint: disable=eval-used
          except NameError as e:
            unresolved.append(f"{cls.__module__}.{cls.__qualname__}.{field}: {e}")
  assert not unresolved, unresolved
