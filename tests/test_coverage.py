"""Which pass reaches inside which higher-order primitive: the README's table, measured.

Each cell runs one pass on a function whose only matmul sits inside one
higher-order primitive (in a ``jax.named_scope("inner")``) and reads what
the pass did there, through its public API:

* engine: `jmp_lite.value_and_grad` with a bf16 policy; the matmul inside
  accumulates in float32 (`jmp_lite.audit` of the step);
* autocast: the same with ``O1`` on float32 operands; the matmul inside runs
  in bf16;
* telemetry: ``Telemetry(mode="ops")``; the matmul's row reads its
  forward maximum;
* fp8: `jmp_lite.fp8.init` selecting it; it is a site, and one step records
  its operands' maximum;
* calibrate: its scope is measured;
* audit: its row is there.

A cell reads ``yes``, ``warns`` (`jmp_lite.UncoveredMatmulWarning`, the
body run as written), ``outputs`` (calibrate: the primitive's outputs are
measured, not its body) or ``no``. The README's table must be this one.
"""

import functools
import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jmp_lite

BF16 = "p=f32,c=bf16,o=f32"
ONE = jmp_lite.StaticLossScale(1.0)


def _inner(x, w):
  with jax.named_scope("inner"):
    return x @ w


@jax.custom_jvp
def _custom_jvp(x, w):
  return _inner(x, w)


_custom_jvp.defjvp(lambda p, t: (_custom_jvp(*p), _inner(t[0], p[1]) + _inner(p[0], t[1])))


@jax.custom_vjp
def _custom_vjp(x, w):
  return _inner(x, w)


_custom_vjp.defvjp(lambda x, w: (_inner(x, w), (x, w)),
                   lambda r, g: (g @ r[1].T, r[0].T @ g))


def _shard_map(x, w):
  mesh = jax.make_mesh((1,), ("d",))
  return jax.shard_map(_inner, mesh=mesh, in_specs=(P(), P()), out_specs=P())(x, w)


# Each runs `_inner` inside one primitive. A while loop has no reverse-mode
# derivative: it reads the batch and a frozen weight (a teacher's loop).
PRIMITIVES = {
    "jit": lambda x, w: jax.jit(_inner)(x, w),
    "scan": lambda x, w: jax.lax.scan(lambda c, _: (_inner(c, w), None), x, None,
                                      length=2)[0],
    "while": lambda x, w: jax.lax.while_loop(
        lambda s: s[0] < 2, lambda s: (s[0] + 1, _inner(s[1], s[2]), s[2]),
        (0, x, jax.lax.stop_gradient(w)))[1],
    "cond": lambda x, w: jax.lax.cond(jnp.sum(x) < jnp.inf, lambda a: _inner(a, w),
                                      lambda a: a, x),
    "remat": lambda x, w: jax.checkpoint(_inner)(x, w),
    "custom_jvp": _custom_jvp,
    "custom_vjp": _custom_vjp,
    "shard_map": _shard_map,
}


def _loss(name):
  run = PRIMITIVES[name]

  def loss(w, x):
    # x in the dtype the policy gave w (a bf16 step's activations are bf16).
    with jax.named_scope("outer"):  # the primitive's outputs: "outer" alone
      y = run(x.astype(w.dtype), w)
    return jnp.sum(y.astype(jnp.float32) ** 2)
  return loss


def _reach(scopes: dict) -> str:
  """``yes`` if a value inside the primitive was measured, ``outputs`` if
  only its results were, else ``no``; ``scopes`` maps a path to its largest
  measured value."""
  if any(v > 0 for k, v in scopes.items() if "inner" in k):
    return "yes"
  return "outputs" if any(v > 0 for k, v in scopes.items() if k == "outer") else "no"


def _args():
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.standard_normal((8, 8)) / 3, jnp.float32)
  x = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
  return w, x


def _warned(record) -> bool:
  return any(issubclass(w.category, jmp_lite.UncoveredMatmulWarning) for w in record)


def _precision(name, policy, want):
  w, x = _args()
  step = lambda w, x: jmp_lite.value_and_grad(_loss(name), policy=policy)(w, x,
                                                                         loss_scale=ONE)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    # The step's only matmuls are the inner one and its derivatives.
    rows = jmp_lite.audit(step, w, x).select(category="matmul")
  if rows and all(r.operand_dtypes == (np.dtype(jnp.bfloat16),) * 2
                  and r.accumulation == np.dtype(np.float32) for r in rows):
    return want
  return "warns" if _warned(record) else "no"


def engine(name):
  return _precision(name, BF16, "yes")


def autocast(name):
  return _precision(name, "O1", "yes")


def telemetry(name):
  w, x = _args()
  vg = jmp_lite.value_and_grad(_loss(name), telemetry=jmp_lite.Telemetry(mode="ops"))
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    stats = jax.jit(lambda w, x: vg(w, x, loss_scale=ONE)[-1])(w, x)
  reached = _reach({k.split("#")[0]: float(jnp.max(m.forward_max))
                    for k, m in stats.modules.items()})
  return "warns" if reached != "yes" and _warned(record) else reached


def fp8(name):
  w, x = _args()
  loss = _loss(name)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    try:
      state = jmp_lite.fp8.init(loss, w, x, select=".*inner.*")
    except ValueError:  # no site
      return "warns" if _warned(record) else "no"
  new = jax.jit(lambda w, x, s: jmp_lite.value_and_grad(loss)(w, x, loss_scale=ONE,
                                                              fp8=s)[-1])(w, x, state)
  seen = [float(jnp.max(m.lhs.amax_history)) for m in new.sites.values()]
  return "yes" if seen and min(seen) > 0 else "no"


def calibrate(name):
  w, x = _args()
  cal = jmp_lite.calibrate(_loss(name), w, x, policy="p=f32,c=f16,o=f32")
  return _reach({k: s.max_activation for k, s in cal.scopes.items()})


def audit(name):
  w, x = _args()
  return "yes" if jmp_lite.audit(_loss(name), w, x).count(category="matmul") else "no"


PASSES = {"engine": engine, "autocast": autocast, "telemetry": telemetry, "fp8": fp8,
          "calibrate": calibrate, "audit": audit}


def _readme_table() -> dict:
  text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
  block = text.split("<!-- coverage table -->")[1].split("<!-- end coverage table -->")[0]
  rows = [line for line in block.splitlines() if line.startswith("| `")]
  table = {}
  for line in rows:
    cells = [c.strip() for c in line.strip("|").split("|")]
    table[cells[0].strip("`")] = dict(zip(PASSES, cells[1:]))
  return table


@functools.cache
def _measured(primitive, pass_name):
  return PASSES[pass_name](primitive)


@pytest.mark.parametrize("primitive", PRIMITIVES)
def test_the_readme_coverage_table_is_what_each_pass_does(primitive):
  want = _readme_table()[primitive]
  got = {p: _measured(primitive, p) for p in PASSES}
  assert got == want, (primitive, got)


def test_the_readme_table_has_every_primitive():
  assert list(_readme_table()) == list(PRIMITIVES)
  assert all(re.fullmatch(r"yes|warns|outputs|no", c)
             for row in _readme_table().values() for c in row.values())
