"""jmp_lite: mixed-precision training for JAX, Flax and optax.

A drop-in superset of jmp (``import jmp_lite as jmp`` runs code written for
jmp 0.0.4), with loss scales that compile once, a one-pass `all_finite`, and
integrations with Flax and optax in `jmp_lite.flax` and `jmp_lite.optax`.
"""

from jmp_lite import distributed
from jmp_lite import flax
from jmp_lite import optax
from jmp_lite import testing
from jmp_lite.auditing import audit
from jmp_lite.autocasting import autocast
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
from jmp_lite.training import StepInfo
from jmp_lite.training import TrainState
from jmp_lite.training import value_and_grad

__version__ = "0.1.0"

__all__ = (
    "all_finite",
    "audit",
    "autocast",
    "DynamicLossScale",
    "LossScale",
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
    "StepInfo",
    "TrainState",
    "value_and_grad",
)
