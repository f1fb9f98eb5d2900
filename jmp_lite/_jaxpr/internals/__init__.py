"""Every use of JAX internals and of Flax's and Python's private API in jmp_lite.

The rest of the library uses public API only. What lives here is what a
precision rewrite cannot do without, each item with what it relies on:

* `rules`: defining primitives (their JVP, transpose, batching, lowering and
  remat rules).
* `jaxprs`: editing jaxpr equations in place, evaluating them in their
  source context, the parameters of higher-order primitives, the user frames
  of a source location, and how a traced value was computed.
* `private`: Flax's private API (a scope's variables, a shallow module clone,
  attributes set on an NNX module copy past its ``__setattr__``, under a
  name `flax.nnx.bridge.ToNNX` does not take for a variable) and
  Python's (the call stack).

`tests/test_internals.py` checks the items against the installed JAX, fails
when JAX has a higher-order primitive nobody here has looked at, and fails
when a module outside this package imports ``jax._src`` or touches the
private API named above. Callers import this package, not its modules.
"""

from jmp_lite._jaxpr.internals.jaxprs import all_primitives
from jmp_lite._jaxpr.internals.jaxprs import as_output
from jmp_lite._jaxpr.internals.jaxprs import bind
from jmp_lite._jaxpr.internals.jaxprs import is_tracer
from jmp_lite._jaxpr.internals.jaxprs import BWD_FUN
from jmp_lite._jaxpr.internals.jaxprs import closed
from jmp_lite._jaxpr.internals.jaxprs import constvars_to_invars
from jmp_lite._jaxpr.internals.jaxprs import context_here
from jmp_lite._jaxpr.internals.jaxprs import convert_weak
from jmp_lite._jaxpr.internals.jaxprs import core
from jmp_lite._jaxpr.internals.jaxprs import DropVar
from jmp_lite._jaxpr.internals.jaxprs import eqn_context
from jmp_lite._jaxpr.internals.jaxprs import eqn_inputs
from jmp_lite._jaxpr.internals.jaxprs import eval_jaxpr
from jmp_lite._jaxpr.internals.jaxprs import explicit_sharding
from jmp_lite._jaxpr.internals.jaxprs import FWD_THUNK
from jmp_lite._jaxpr.internals.jaxprs import higher_order_primitives
from jmp_lite._jaxpr.internals.jaxprs import invars_to_constvars
from jmp_lite._jaxpr.internals.jaxprs import is_wrapped_fun
from jmp_lite._jaxpr.internals.jaxprs import JVP_THUNK
from jmp_lite._jaxpr.internals.jaxprs import KNOWN_HIGHER_ORDER
from jmp_lite._jaxpr.internals.jaxprs import new_var
from jmp_lite._jaxpr.internals.jaxprs import Primitive
from jmp_lite._jaxpr.internals.jaxprs import producer
from jmp_lite._jaxpr.internals.jaxprs import replace_eqn
from jmp_lite._jaxpr.internals.jaxprs import replace_eqns
from jmp_lite._jaxpr.internals.jaxprs import rewire
from jmp_lite._jaxpr.internals.jaxprs import scan_split
from jmp_lite._jaxpr.internals.jaxprs import shard_map_call
from jmp_lite._jaxpr.internals.jaxprs import transposed
from jmp_lite._jaxpr.internals.jaxprs import user_frames
from jmp_lite._jaxpr.internals.jaxprs import with_more_consts
from jmp_lite._jaxpr.internals.jaxprs import wrap_fun
from jmp_lite._jaxpr.internals.private import called_from
from jmp_lite._jaxpr.internals.private import nested_code
from jmp_lite._jaxpr.internals.private import OWN_ATTRIBUTE
from jmp_lite._jaxpr.internals.private import scope_init_args
from jmp_lite._jaxpr.internals.private import scope_swapped
from jmp_lite._jaxpr.internals.private import in_setup_check
from jmp_lite._jaxpr.internals.private import interceptors_inside
from jmp_lite._jaxpr.internals.private import interceptors_restored
from jmp_lite._jaxpr.internals.private import set_attributes
from jmp_lite._jaxpr.internals.private import shallow_clone
from jmp_lite._jaxpr.internals.private import swap_class
from jmp_lite._jaxpr.internals.rules import abstract_eval
from jmp_lite._jaxpr.internals.rules import base_transpose
from jmp_lite._jaxpr.internals.rules import define_batching
from jmp_lite._jaxpr.internals.rules import define_bilinear
from jmp_lite._jaxpr.internals.rules import define_lowering
from jmp_lite._jaxpr.internals.rules import define_partitioned_lowering
from jmp_lite._jaxpr.internals.rules import define_remat_as

__all__ = (
    "all_primitives",
    "as_output",
    "bind",
    "BWD_FUN",
    "closed",
    "constvars_to_invars",
    "context_here",
    "convert_weak",
    "core",
    "DropVar",
    "eqn_context",
    "eqn_inputs",
    "eval_jaxpr",
    "explicit_sharding",
    "FWD_THUNK",
    "higher_order_primitives",
    "in_setup_check",
    "is_tracer",
    "invars_to_constvars",
    "is_wrapped_fun",
    "JVP_THUNK",
    "KNOWN_HIGHER_ORDER",
    "new_var",
    "Primitive",
    "producer",
    "replace_eqn",
    "replace_eqns",
    "rewire",
    "scan_split",
    "shard_map_call",
    "transposed",
    "user_frames",
    "with_more_consts",
    "wrap_fun",
    "called_from",
    "nested_code",
    "interceptors_inside",
    "interceptors_restored",
    "OWN_ATTRIBUTE",
    "scope_init_args",
    "scope_swapped",
    "set_attributes",
    "shallow_clone",
    "swap_class",
    "abstract_eval",
    "base_transpose",
    "define_batching",
    "define_bilinear",
    "define_lowering",
    "define_partitioned_lowering",
    "define_remat_as",
)
