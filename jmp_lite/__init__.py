"""jmp_lite: mixed-precision training for JAX, Flax and optax.

A drop-in superset of jmp (``import jmp_lite as jmp`` runs code written for
jmp 0.0.4), with loss scales that compile once, a one-pass `all_finite`, and
integrations with Flax and optax in `jmp_lite.flax` and `jmp_lite.optax`.
"""

import importlib as _importlib
from typing import Any as _Any

from jmp_lite.loss_scale import all_finite
from jmp_lite.loss_scale import DynamicLossScale
from jmp_lite.loss_scale import LossScale
from jmp_lite.loss_scale import NoOpLossScale
from jmp_lite.loss_scale import select_tree
from jmp_lite.loss_scale import StaticLossScale
from jmp_lite.policy import cast_to_full
from jmp_lite.policy import cast_to_half
from jmp_lite.policy import dtype_to_names
from jmp_lite.policy import get_policy
from jmp_lite.policy import half_dtype
from jmp_lite.policy import parse_dtype
from jmp_lite.policy import Policy
from jmp_lite.policy import preferred_half_dtype

# Imported on first use, so that `import jmp_lite` costs a plain-JAX user
# little more than `import jax`: the integrations pull in Flax (Linen and NNX)
# and optax. Submodules, and names that live in them.
_LAZY_MODULES = ("distributed", "flax", "fp8", "hardware", "optax", "telemetry",
                 "testing", "underflow")
_LAZY_NAMES = {
    "audit": "auditing",
    "AuditReport": "auditing",
    "autocast": "autocasting",
    "calibrate": "calibration",
    "Calibration": "calibration",
    "PrecisionStats": "telemetry",
    "StepInfo": "training",
    "Telemetry": "telemetry",
    "TrainState": "training",
    "UnderflowAwareLossScale": "underflow",
    "ModuleLossScale": "module_scale",
    "AutomaticLossScale": "underflow",
    "UncoveredMatmulError": "_jaxpr.passes.engine",
    "UncoveredMatmulWarning": "_jaxpr.passes.engine",
    "value_and_grad": "training",
}


def __getattr__(name: str) -> _Any:
  if name in _LAZY_MODULES:
    return _importlib.import_module(f"jmp_lite.{name}")
  if name in _LAZY_NAMES:
    value = getattr(_importlib.import_module(f"jmp_lite.{_LAZY_NAMES[name]}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value
  raise AttributeError(f"module 'jmp_lite' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_LAZY_MODULES) | set(_LAZY_NAMES))


__version__ = "0.1.0"

__all__ = (
    "all_finite",
    "audit",
    "AuditReport",
    "autocast",
    "AutomaticLossScale",
    "calibrate",
    "Calibration",
    "UncoveredMatmulError",
    "UncoveredMatmulWarning",
    "DynamicLossScale",
    "LossScale",
    "ModuleLossScale",
    "NoOpLossScale",
    "select_tree",
    "StaticLossScale",
    "cast_to_full",
    "cast_to_half",
    "dtype_to_names",
    "get_policy",
    "half_dtype",
    "parse_dtype",
    "Policy",
    "preferred_half_dtype",
    "PrecisionStats",
    "StepInfo",
    "Telemetry",
    "TrainState",
    "UnderflowAwareLossScale",
    "value_and_grad",
)
