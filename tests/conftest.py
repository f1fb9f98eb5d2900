"""Fixtures shared by the test modules (suite-wide JAX settings are in ../conftest.py)."""

import pathlib
import sys

import jax
import pytest

# Test helpers that are modules of their own (`excess_precision`): importable
# by name under `--import-mode=importlib`.
sys.path.insert(0, str(pathlib.Path(__file__).parent))


@pytest.fixture
def standard_promotion():
  """Runs a test under standard dtype promotion.

  optax's Adam computes ``b1 ** count`` (a Python float to an int32 power),
  which strict promotion rejects; jmp_lite's own code is checked strictly by
  the other tests.
  """
  with jax.numpy_dtype_promotion("standard"):
    yield
