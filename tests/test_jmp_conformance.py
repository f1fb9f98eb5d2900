"""jmp 0.0.4's own test suite, run against jmp_lite.

jmp ships its tests as `jmp._src.policy_test` and `jmp._src.loss_scale_test`
(absl parameterized TestCases). Each binds the module under test to the
module-level name `jmp` (``from jmp._src import loss_scale as jmp``) and uses it
at class-definition time too (``parameterized`` arguments such as
``jmp.StaticLossScale``), so re-pointing the attribute after import would leave
half the cases on jmp. Instead each module's source is executed afresh with that
one import line replaced by ``import jmp_lite as jmp``.

Every test method becomes a pytest case run with a `unittest.TestResult`. The
cases that jmp_lite fails on purpose are listed in `EXPECTED_FAILURES` with the
reason and a pattern the failure must match; a listed case that starts passing,
or fails differently, fails here, as does any unlisted failure. The same suite
also runs against jmp itself, which must pass all of it: that checks the
harness, and that every expected failure is a real difference from jmp.

jmp's tests assume JAX's standard dtype promotion (several compare a float16
array with a float32 one), so they run under it; a second pass under the strict
promotion the rest of this suite uses shows jmp_lite never needs standard
promotion, with the strict-only failures (inside jmp's test code, not in the
library) listed separately.
"""

import importlib.util
import re
import types
import unittest
import warnings

import jax
import pytest

SUITES = {
    "loss_scale": ("jmp._src.loss_scale_test", "from jmp._src import loss_scale as jmp"),
    "policy": ("jmp._src.policy_test", "from jmp._src import policy as jmp"),
}

# (suite, "Class.method") -> (reason, pattern the failure's traceback matches).
EXPECTED_FAILURES = {
    ("loss_scale", "LossScaleTest.test_static_empty_trees_StaticLossScale"): (
        "StaticLossScale(0) is rejected: a zero scale makes unscale divide by "
        "zero (and jmp_lite's StaticLossScale is a leaf, not an empty tree).",
        r"ValueError: StaticLossScale\.loss_scale must be finite and > 0, got 0\.0"),
    ("loss_scale", "LossScaleTest.test_dynamic_loss_scale_tree"): (
        "Every field of DynamicLossScale is a leaf (period, factor, min/max "
        "scale, hysteresis and its mode), not just [loss_scale, counter]: jmp's hand-written "
        "flatten drops min_loss_scale, and Python-int period/factor in the "
        "treedef would recompile per value.",
        r"First list contains 7 additional elements"),
}

# Failures under strict promotion only, caused by jmp's test code mixing dtypes.
STRICT_ONLY_FAILURES = {
    ("policy", "PolicyTest.test_cast_to_half"): (
        "The test compares a float16 array with a float32 one (its expected "
        "tree keeps 'f' in float32), which strict promotion forbids; jmp fails "
        "it the same way.",
        r"TypePromotionError: Input dtypes \(('float16', 'float32'"
        r"|'float32', 'float16')\)"),
    ("loss_scale", "LossScaleTest.test_dynamic_loss_scale_explicit_min_loss_scale2"): (
        "The test compares the int32 `period` with the Python float 5.0 it "
        "passed in; jmp keeps the float, jmp_lite holds period as int32.",
        # JAX lists the two dtypes in an order that depends on PYTHONHASHSEED.
        r"TypePromotionError: Input dtypes \((\"<class 'float'>\", 'int32'"
        r"|'int32', \"<class 'float'>\")\)"),
}


def load_suite(suite, target):
  """Executes a copy of a jmp test module whose name `jmp` is `target`.

  Args:
    suite: a key of SUITES.
    target: "jmp_lite", or None for jmp's own module (unchanged source).
  """
  module_name, import_line = SUITES[suite]
  spec = importlib.util.find_spec(module_name)
  with open(spec.origin, encoding="utf-8") as f:
    source = f.read()
  assert source.count(import_line) == 1, (module_name, import_line)
  if target is not None:
    source = source.replace(import_line, f"import {target} as jmp")
  module = types.ModuleType(f"{module_name}__{target or 'jmp'}")
  module.__file__ = spec.origin
  exec(compile(source, spec.origin, "exec"), module.__dict__)  # pylint: disable=exec-used
  return module


def collect(module):
  """{"Class.method": (class, method)} for every test in `module`."""
  cases = {}
  loader = unittest.TestLoader()
  for cls in vars(module).values():
    if (isinstance(cls, type) and issubclass(cls, unittest.TestCase)
        and cls.__module__ == module.__name__):
      for name in loader.getTestCaseNames(cls):
        cases[f"{cls.__name__}.{name}"] = (cls, name)
  return cases


MODULES = {(suite, target): load_suite(suite, target)
           for suite in SUITES for target in ("jmp_lite", None)}
CASES = {key: collect(module) for key, module in MODULES.items()}


def run_case(suite, target, case, promotion):
  """Runs one jmp test; returns (outcome, traceback text, stray warnings)."""
  module = MODULES[(suite, target)]
  cls, name = CASES[(suite, target)][case]
  result = unittest.TestResult()
  with jax.numpy_dtype_promotion(promotion), warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    cls(name).run(result)
  # jmp's own arithmetic (np.float32(10) / 3 ** 100) overflows and warns in its
  # test file; any other warning would come from the library under test.
  stray = [w for w in caught if not (w.filename == module.__file__
                                     and issubclass(w.category, RuntimeWarning))]
  if result.skipped:
    return "skipped", result.skipped[0][1], stray
  problems = result.failures + result.errors
  if problems:
    return "failed", "\n".join(text for _, text in problems), stray
  return "passed", "", stray


def params(target):
  return [pytest.param(suite, case, id=f"{suite}:{case}")
          for suite in SUITES for case in CASES[(suite, target)]]


def check(suite, case, promotion, expected):
  outcome, text, stray = run_case(suite, "jmp_lite", case, promotion)
  if outcome == "skipped":
    pytest.skip(f"skipped by jmp's test: {text}")
  assert not stray, [str(w.message) for w in stray]
  if (suite, case) in expected:
    reason, pattern = expected[(suite, case)]
    assert outcome == "failed", (
        f"{case} now passes on jmp_lite: remove it from the expected failures "
        f"({reason})")
    assert re.search(pattern, text), f"{case} failed for another reason:\n{text}"
  else:
    assert outcome == "passed", text


@pytest.mark.parametrize("suite, case", params("jmp_lite"))
def test_jmp_suite_on_jmp_lite(suite, case):
  check(suite, case, "standard", EXPECTED_FAILURES)


@pytest.mark.parametrize("suite, case", params("jmp_lite"))
def test_jmp_suite_on_jmp_lite_with_strict_promotion(suite, case):
  check(suite, case, "strict", {**EXPECTED_FAILURES, **STRICT_ONLY_FAILURES})


@pytest.mark.parametrize("suite, case", params(None))
def test_jmp_suite_on_jmp_itself(suite, case):
  # The harness is sound, and every expected failure is a real difference.
  outcome, text, stray = run_case(suite, None, case, "standard")
  if outcome == "skipped":
    pytest.skip(f"skipped by jmp's test: {text}")
  assert outcome == "passed", text
  assert not stray, [str(w.message) for w in stray]


def test_expected_failures_name_real_tests():
  for suite, case in {**EXPECTED_FAILURES, **STRICT_ONLY_FAILURES}:
    assert case in CASES[(suite, "jmp_lite")], (suite, case)


def test_both_copies_collect_the_same_tests():
  for suite in SUITES:
    assert CASES[(suite, "jmp_lite")].keys() == CASES[(suite, None)].keys()
  # jmp 0.0.4 has 25 loss-scale and 72 policy test cases once parameterised.
  assert len(CASES[("loss_scale", "jmp_lite")]) == 25
  assert len(CASES[("policy", "jmp_lite")]) == 72


def test_copies_point_at_the_right_library():
  import jmp_lite  # pylint: disable=g-import-not-at-top
  from jmp._src import loss_scale, policy  # pylint: disable=g-import-not-at-top
  assert MODULES[("loss_scale", "jmp_lite")].jmp is jmp_lite
  assert MODULES[("policy", "jmp_lite")].jmp is jmp_lite
  assert MODULES[("loss_scale", None)].jmp is loss_scale
  assert MODULES[("policy", None)].jmp is policy
