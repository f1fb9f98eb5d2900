"""Tests for jmp_lite.flax: policies wrapped around Linen and NNX models."""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_lite
import jmp_lite.flax
from jmp_lite.auditing import audit
from jmp_lite.testing import assert_trees_bitwise_equal
from jmp_lite.testing import count_compilations

BF16 = "p=f32,c=bf16,o=f32"
F32, BF = np.dtype(np.float32), np.dtype(jnp.bfloat16)
MATMULS = ("dot_general", "conv_general_dilated")
# Every model runs jitted; the MLPs run eagerly too (eager is slow to dispatch).
JIT_CASES = [("mlp", False), ("mlp", True), ("cnn", True), ("attention", True),
             ("custom", True)]


def _audit(fun, *args):
  """The precision audit of ``fun(*args)`` (traced, not run)."""
  return jmp_lite.audit(fun, *args)


def _matmuls(report):
  return [(r.operand_dtypes, r.accumulation) for r in report.select(primitive=MATMULS)]


def _assert_accumulates_in_f32(report):
  found = _matmuls(report)
  assert found
  for operands, accumulation in found:
    assert operands == (BF, BF) and accumulation == F32, found


def _assert_norms_in_f32(report):
  rsqrts = report.select(primitive="rsqrt")
  assert rsqrts
  assert all(r.output_dtypes == (F32,) for r in rsqrts), rsqrts


def _dtypes(tree):
  return set(np.dtype(x.dtype) for x in jax.tree.leaves(tree))


# Linen models ------------------------------------------------------------------


class MLP(nn.Module):

  @nn.compact
  def __call__(self, x, train=False):
    x = nn.relu(nn.LayerNorm()(nn.Dense(16)(x)))
    x = nn.BatchNorm(use_running_average=not train)(x)
    return nn.Dense(3)(x)


class CNN(nn.Module):

  @nn.compact
  def __call__(self, x, train=False):
    x = nn.Conv(8, (3, 3))(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
    x = nn.GroupNorm(num_groups=2)(nn.Conv(8, (3, 3), strides=2)(x))
    return nn.Dense(3)(x.mean(axis=(1, 2)))


class Attention(nn.Module):

  @nn.compact
  def __call__(self, x, train=False):
    del train
    y = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(x)
    return nn.LayerNorm()(x + y)


class Scale(nn.Module):
  """A custom layer with its own parameter and a bare matmul."""
  features: int

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.lecun_normal(),
                   (x.shape[-1], self.features))
    return x @ w


class Custom(nn.Module):
  """Submodules from setup, one of them called twice."""

  def setup(self):
    self.scale = Scale(8)
    self.norm = nn.LayerNorm()
    self.out = nn.Dense(3)

  def __call__(self, x, train=False):
    del train
    return self.out(self.norm(self.scale(x)) + self.norm(self.scale(x)))


LINEN = {
    "mlp": (MLP, (4, 8)),
    "cnn": (CNN, (2, 6, 6, 3)),
    "attention": (Attention, (2, 5, 8)),
    "custom": (Custom, (4, 8)),
}


def _linen(name, policy=BF16, **kwargs):
  if not kwargs:  # Linen models and variables are immutable: share them.
    return _linen_cached(name, policy)
  return _linen_uncached(name, policy, **kwargs)


@functools.cache
def _linen_cached(name, policy):
  return _linen_uncached(name, policy)


def _linen_uncached(name, policy, **kwargs):
  cls, shape = LINEN[name]
  x = jax.random.normal(jax.random.key(1), shape)
  model = cls()
  wrapped = jmp_lite.flax.wrap(model, policy, **kwargs)
  return model, wrapped, wrapped.init(jax.random.key(0), x), x


def _maybe_jit(fun, jit):
  return jax.jit(fun) if jit else fun


@pytest.mark.parametrize("name", LINEN)
def test_linen_matmuls_accumulate_in_f32_forward_and_backward(name):
  _, wrapped, variables, x = _linen(name)
  forward = _audit(wrapped.apply, variables, x)
  _assert_accumulates_in_f32(forward)

  def loss(params):
    return wrapped.apply({**variables, "params": params}, x).sum()

  _assert_accumulates_in_f32(_audit(jax.grad(loss), variables["params"]))


@pytest.mark.parametrize("name", ["mlp", "cnn", "attention", "custom"])
def test_linen_norms_run_in_f32(name):
  _, wrapped, variables, x = _linen(name)
  _assert_norms_in_f32(_audit(wrapped.apply, variables, x))


@pytest.mark.parametrize("name, jit", JIT_CASES)
def test_linen_param_output_and_grad_dtypes(name, jit):
  _, wrapped, variables, x = _linen(name)
  assert _dtypes(variables["params"]) == {F32}

  def loss(params):
    out = wrapped.apply({**variables, "params": params}, x)
    assert out.dtype == F32
    return out.sum()

  grads = _maybe_jit(jax.grad(loss), jit)(variables["params"])
  assert _dtypes(grads) == {F32}
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("name, jit", [("mlp", False), ("mlp", True),
                                       ("cnn", True)])
def test_linen_batch_stats_stay_f32(name, jit):
  _, wrapped, variables, x = _linen(name)
  apply = _maybe_jit(
      lambda v, x: wrapped.apply(v, x, train=True, mutable=["batch_stats"]), jit)
  _, updates = apply(variables, x)
  assert _dtypes(updates["batch_stats"]) == {F32}
  assert jax.tree.structure(updates["batch_stats"]) == jax.tree.structure(
      variables["batch_stats"])
  changed = jax.tree.map(lambda a, b: bool(np.any(a != b)),
                         updates["batch_stats"], variables["batch_stats"])
  assert any(jax.tree.leaves(changed))


@pytest.mark.parametrize("name, jit", JIT_CASES)
def test_linen_f32_policy_is_bit_exact(name, jit):
  model, wrapped, variables, x = _linen(name, "f32")
  reference = model.init(jax.random.key(0), x)
  chex.assert_trees_all_equal(variables, reference)
  np.testing.assert_array_equal(
      _maybe_jit(wrapped.apply, jit)(variables, x),
      _maybe_jit(model.apply, jit)(variables, x))


def test_linen_bf16_policy_is_close_to_f32():
  model, wrapped, variables, x = _linen("mlp")
  np.testing.assert_allclose(wrapped.apply(variables, x),
                             model.apply(variables, x), atol=0.1, rtol=0.1)


def test_linen_output_dtype_and_param_dtype():
  _, wrapped, variables, x = _linen("mlp", "p=bf16,c=bf16,o=bf16")
  assert wrapped.apply(variables, x).dtype == BF
  dtypes = jax.tree.map(lambda a: np.dtype(a.dtype), variables["params"])
  assert dtypes["Dense_0"]["kernel"] == BF
  assert dtypes["LayerNorm_0"]["scale"] == F32  # default rule: norms in f32
  assert _dtypes(variables["batch_stats"]) == {F32}


class _SetupParams(nn.Module):
  """Parameters made in ``setup`` (an ``nn.Embed``'s table, ``self.param``),
  as published models make position embeddings and class tokens."""

  def setup(self):
    self.embed = nn.Embed(16, 8)
    self.cls = self.param("cls", nn.initializers.normal(1.0), (1, 8))
    self.out = nn.Dense(4)

  def __call__(self, ids):
    return self.out(self.embed(ids) + self.cls)


@pytest.mark.parametrize("policy", ["p=bf16,c=bf16,o=bf16", "p=f32,c=bf16,o=f32"])
def test_linen_parameters_made_in_setup_follow_the_policy(policy):
  """Flax runs ``setup`` on the module before any method interceptor sees
  the call that needed it, so under ``p=bf16`` an ``nn.Embed`` and a
  ``self.param`` made in ``setup`` stayed float32 (a compact ``nn.Dense``
  beside them was bf16). Oracle: plain Flax, whose ``param_dtype=bf16``
  makes them bf16, and the unwrapped model's tree."""
  pol = jmp_lite.get_policy(policy)
  ids = jnp.arange(6).reshape(2, 3)
  wrapped = jmp_lite.flax.wrap(_SetupParams(), pol)
  variables = wrapped.init(jax.random.key(0), ids)
  plain = _SetupParams().init(jax.random.key(0), ids)
  assert jax.tree.structure(variables) == jax.tree.structure(plain)
  assert _dtypes(variables) == {np.dtype(pol.param_dtype)}
  assert nn.Embed(16, 8, param_dtype=BF).init(
      jax.random.key(0), ids)["params"]["embedding"].dtype == BF
  if pol.param_dtype == F32:  # the same values as the model's own
    chex.assert_trees_all_equal(variables, plain)
  # Read in the compute dtype: the same output as the model run in bf16 on
  # bf16 copies of its parameters.
  out = wrapped.apply(variables, ids)
  assert out.dtype == pol.output_dtype
  as_bf16 = jax.tree.map(lambda a: a.astype(BF), variables)
  want = _SetupParams().apply(as_bf16, ids)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                             rtol=2e-2, atol=2e-2)


def test_linen_jitted_step_compiles_once():
  _, wrapped, variables, x = _linen("mlp")
  step = jax.jit(jax.grad(
      lambda p, x: wrapped.apply({**variables, "params": p}, x).sum()))
  x1 = x + 1
  with count_compilations() as compiled:
    step(variables["params"], x)
    step(variables["params"], x1)
  assert len(compiled) == 1


# Rules and policy_map ----------------------------------------------------------


def _strs(mapping):
  return {k: str(v) for k, v in mapping.items()}


def test_policy_map_linen_lists_every_module():
  _, wrapped, _, x = _linen("attention")
  assert _strs(jmp_lite.flax.policy_map(wrapped, x)) == {
      "": "p=f32,c=bf16,o=f32",
      "MultiHeadDotProductAttention_0": "p=f32,c=bf16,o=f32",
      "MultiHeadDotProductAttention_0/query": "p=f32,c=bf16,o=f32",
      "MultiHeadDotProductAttention_0/key": "p=f32,c=bf16,o=f32",
      "MultiHeadDotProductAttention_0/value": "p=f32,c=bf16,o=f32",
      "MultiHeadDotProductAttention_0/out": "p=f32,c=bf16,o=f32",
      "LayerNorm_0": "p=f32,c=f32,o=f32",
  }


def test_class_rule():
  _, wrapped, variables, x = _linen("mlp", rules={nn.Dense: "f32"})
  assert _strs(jmp_lite.flax.policy_map(wrapped, x))["Dense_1"] == "p=f32,c=f32,o=f32"
  assert all(ops == (F32, F32) for ops, _ in
             _matmuls(_audit(wrapped.apply, variables, x)))


def test_path_rule():
  rules = {"MultiHeadDotProductAttention_0/(query|key)": "f32"}
  _, wrapped, variables, x = _linen("attention", rules=rules)
  got = _strs(jmp_lite.flax.policy_map(wrapped, x))
  assert got["MultiHeadDotProductAttention_0/query"] == "p=f32,c=f32,o=f32"
  assert got["MultiHeadDotProductAttention_0/value"] == "p=f32,c=bf16,o=f32"
  operands = [ops for ops, _ in
              _matmuls(_audit(wrapped.apply, variables, x))]
  assert operands.count((F32, F32)) == 2


def test_precedence():
  rules = {
      nn.Module: "f16",                  # least derived class
      nn.Dense: "p=f32,c=bf16,o=bf16",   # most derived class wins over Module
      "Dense_.*": "p=f32,c=f16,o=f32",   # a path rule beats class rules
      "Dense_1": "f32",                  # more literal characters wins
      ".*": "p=f32,c=f32,o=bf16",        # fewest literal characters
  }
  _, wrapped, _, x = _linen("mlp", rules=rules)
  got = _strs(jmp_lite.flax.policy_map(wrapped, x))
  assert got["Dense_0"] == "p=f32,c=f16,o=f32"
  assert got["Dense_1"] == "p=f32,c=f32,o=f32"
  assert got["LayerNorm_0"] == "p=f32,c=f32,o=bf16"


def test_class_rule_precedence_without_path_rules():
  rules = {nn.Module: "f16", nn.Dense: "p=f32,c=bf16,o=bf16"}
  _, wrapped, _, x = _linen("mlp", rules=rules)
  got = _strs(jmp_lite.flax.policy_map(wrapped, x))
  assert got[""] == "p=f16,c=f16,o=f16"
  assert got["Dense_0"] == "p=f32,c=bf16,o=bf16"
  assert got["LayerNorm_0"] == "p=f32,c=f32,o=f32"  # its own default rule


def test_later_of_equally_specific_path_rules_wins():
  rules = {"Dense_[0]": "f16", "Dense_[01]": "f32"}
  _, wrapped, _, x = _linen("mlp", rules=rules)
  assert _strs(jmp_lite.flax.policy_map(wrapped, x))["Dense_0"] == "p=f32,c=f32,o=f32"


def test_user_rule_replaces_default_and_defaults_can_be_dropped():
  # Flax's own statistics code calls jnp.promote_types(bf16, float32), which
  # strict promotion rejects: bf16 normalisation needs standard promotion.
  with jax.numpy_dtype_promotion("standard"):
    _, wrapped, _, x = _linen("mlp", rules={nn.LayerNorm: "bf16"})
    got = _strs(jmp_lite.flax.policy_map(wrapped, x))
    assert got["LayerNorm_0"] == "p=bf16,c=bf16,o=bf16"
    assert got["BatchNorm_0"] == "p=f32,c=f32,o=f32"
    _, wrapped, _, x = _linen("mlp", default_rules=False)
    assert set(_strs(jmp_lite.flax.policy_map(wrapped, x)).values()) == {BF16}


def test_default_rules_cover_linen_and_nnx_norms():
  rules = jmp_lite.flax.default_rules(BF16)
  for cls in (nn.LayerNorm, nn.RMSNorm, nn.BatchNorm, nn.GroupNorm,
              nnx.LayerNorm, nnx.RMSNorm, nnx.BatchNorm, nnx.GroupNorm):
    assert str(rules[cls]) == "p=f32,c=f32,o=f32"


# Bad input ---------------------------------------------------------------------


@pytest.mark.parametrize("module", [3, "Dense", nn.Dense])
def test_wrap_rejects_non_modules(module):
  with pytest.raises(TypeError, match="flax.linen.Module or a flax.nnx.Module"):
    jmp_lite.flax.wrap(module, BF16)


@pytest.mark.parametrize("rules, error, match", [
    ({42: "f32"}, TypeError, "42"),
    ({int: "f32"}, TypeError, "<class 'int'>"),
    ({"Dense_(": "f32"}, ValueError, r"'Dense_\('"),
    ({"Dense_0": "banana"}, ValueError, "banana"),
    ({"Dense_0": 3.0}, TypeError, "3.0"),
    ([("Dense_0", "f32")], TypeError, "mapping"),
])
def test_wrap_rejects_bad_rules(rules, error, match):
  with pytest.raises(error, match=match):
    jmp_lite.flax.wrap(nn.Dense(3), BF16, rules=rules)


def test_wrap_rejects_bad_policy():
  with pytest.raises(ValueError, match="banana"):
    jmp_lite.flax.wrap(nn.Dense(3), "banana")
  with pytest.raises(TypeError, match="None"):
    jmp_lite.flax.wrap(nn.Dense(3), None)


def test_policy_map_rejects_unwrapped_models():
  with pytest.raises(TypeError, match="Dense"):
    jmp_lite.flax.policy_map(nn.Dense(3), jnp.ones((1, 2)))


# NNX ---------------------------------------------------------------------------


class NnxMLP(nnx.Module):

  def __init__(self, rngs):
    self.dense1 = nnx.Linear(8, 16, rngs=rngs)
    self.norm = nnx.LayerNorm(16, rngs=rngs)
    self.bn = nnx.BatchNorm(16, rngs=rngs)
    self.dense2 = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    return self.dense2(self.bn(nnx.relu(self.norm(self.dense1(x)))))


class NnxCNN(nnx.Module):

  def __init__(self, rngs):
    self.conv1 = nnx.Conv(3, 8, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.conv2 = nnx.Conv(8, 8, (3, 3), strides=2, rngs=rngs)
    self.gn = nnx.GroupNorm(8, num_groups=2, rngs=rngs)
    self.head = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    x = self.gn(self.conv2(nnx.relu(self.bn(self.conv1(x)))))
    return self.head(x.mean(axis=(1, 2)))


class NnxAttention(nnx.Module):

  def __init__(self, rngs):
    # A nonzero dropout rate selects Flax's einsum attention: with rate 0, NNX
    # calls jax.nn.dot_product_attention, which breaks under strict dtype
    # promotion for bf16 inputs (jnp.promote_types(bf16, np.float32)).
    self.attention = nnx.MultiHeadAttention(
        2, 8, qkv_features=8, decode=False, dropout_rate=0.1,
        deterministic=True, rngs=rngs)
    self.norm = nnx.LayerNorm(8, rngs=rngs)

  def __call__(self, x):
    return self.norm(x + self.attention(x))


class NnxScale(nnx.Module):

  def __init__(self, din, dout, rngs):
    self.w = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (din, dout)))

  def __call__(self, x):
    return x @ self.w[...]


class NnxCustom(nnx.Module):

  def __init__(self, rngs):
    self.scale = NnxScale(8, 8, rngs)
    self.norm = nnx.RMSNorm(8, rngs=rngs)
    self.out = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    return self.out(self.norm(self.scale(x)) + self.norm(self.scale(x)))


NNX = {
    "mlp": (NnxMLP, (4, 8)),
    "cnn": (NnxCNN, (2, 6, 6, 3)),
    "attention": (NnxAttention, (2, 5, 8)),
    "custom": (NnxCustom, (4, 8)),
}


def _nnx(name, policy=BF16, **kwargs):
  cls, shape = NNX[name]
  x = jax.random.normal(jax.random.key(1), shape)
  model = cls(nnx.Rngs(0))
  model.eval()
  return model, jmp_lite.flax.wrap(model, policy, **kwargs), x


def _pure(module):
  """A function of the parameters, for make_jaxpr and grad."""
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)
  return (lambda params, x: nnx.merge(graphdef, params, rest)(x)), params


@pytest.mark.parametrize("name", NNX)
def test_nnx_matmuls_accumulate_in_f32_and_norms_run_in_f32(name):
  _, wrapped, x = _nnx(name)
  fun, state = _pure(wrapped)
  forward = _audit(fun, state, x)
  _assert_accumulates_in_f32(forward)
  if name != "attention":  # nnx.LayerNorm here is covered by the forward check
    _assert_norms_in_f32(forward)
  _assert_accumulates_in_f32(_audit(
      jax.grad(lambda s: fun(s, x).sum()), state))


@pytest.mark.parametrize("name, jit", JIT_CASES)
def test_nnx_param_output_and_grad_dtypes(name, jit):
  model, wrapped, x = _nnx(name)
  assert _dtypes(nnx.state(model, nnx.Param)) == {F32}
  assert wrapped(x).dtype == F32
  grad = nnx.grad(lambda m: m(x).sum())
  grads = (nnx.jit(grad) if jit else grad)(wrapped)
  assert _dtypes(grads) == {F32}
  assert _dtypes(nnx.state(model, nnx.Param)) == {F32}


@pytest.mark.parametrize("name, jit", [("mlp", False), ("mlp", True),
                                       ("cnn", True)])
def test_nnx_batch_stats_stay_f32(name, jit):
  model, wrapped, x = _nnx(name)
  model.train()
  before = jax.tree.map(np.array, nnx.state(model, nnx.BatchStat))
  call = nnx.jit(lambda m, x: m(x)) if jit else (lambda m, x: m(x))
  call(wrapped, x)
  after = nnx.state(model, nnx.BatchStat)
  assert _dtypes(after) == {F32}
  assert any(bool(np.any(a != b)) for a, b in
             zip(jax.tree.leaves(after), jax.tree.leaves(before)))


@pytest.mark.parametrize("name, jit", JIT_CASES)
def test_nnx_f32_policy_is_bit_exact(name, jit):
  model, wrapped, x = _nnx(name, "f32")
  call = nnx.jit(lambda m, x: m(x)) if jit else (lambda m, x: m(x))
  np.testing.assert_array_equal(call(wrapped, x), call(model, x))


def test_nnx_param_dtype_is_applied_to_a_copy():
  model, wrapped, x = _nnx("mlp", "p=bf16,c=bf16,o=bf16")
  assert wrapped.module.dense1.kernel[...].dtype == BF
  assert wrapped.module.norm.scale[...].dtype == F32
  assert model.dense1.kernel[...].dtype == F32  # the caller's, untouched
  assert wrapped(x).dtype == BF


@pytest.mark.parametrize("policy", ["f32", "p=bf16,c=f32,o=f32", "p=f32,c=bf16,o=f32"])
def test_nnx_call_leaves_the_stored_params_as_they_were(policy):
  """A policy with no 16-bit compute dtype ran a "copy" that shared the
  model's Variables: casting them wrote the compute dtype into the stored
  parameters (``p=bf16,c=f32``: the kernel became float32 after one call)
  and, from inside a plain JAX transformation, raised NNX's
  TraceContextError. Oracle: the stored parameters before the call, and the
  unwrapped model under the same transformation."""
  model, wrapped, x = _nnx("mlp", policy)
  before = jax.tree.map(np.array, nnx.state(wrapped.module, nnx.Param))
  wrapped(x)
  nnx.jit(lambda m, x: m(x))(wrapped, x)
  assert_trees_bitwise_equal(nnx.state(wrapped.module, nnx.Param), before)
  closed = jax.jit(lambda x: wrapped(x))(x)
  grads = jax.grad(lambda x: wrapped(x).sum())(x)
  assert closed.dtype == F32 and grads.dtype == F32
  if policy == "f32":
    np.testing.assert_array_equal(closed, jax.jit(lambda x: model(x))(x))


def test_nnx_rules_and_policy_map():
  rules = {nnx.Linear: "f32", "dense2": "p=f32,c=bf16,o=bf16"}
  model, wrapped, x = _nnx("mlp", rules=rules)
  assert _strs(jmp_lite.flax.policy_map(wrapped)) == {
      "": BF16,
      "dense1": "p=f32,c=f32,o=f32",
      "norm": "p=f32,c=f32,o=f32",
      "bn": "p=f32,c=f32,o=f32",
      "dense2": "p=f32,c=bf16,o=bf16",
  }
  fun, state = _pure(wrapped)
  assert [ops for ops, _ in _matmuls(_audit(fun, state, x))] == [
      (F32, F32), (BF, BF)]
  del model


class _DropoutMLP(nn.Module):
  @nn.compact
  def __call__(self, x, train=True):
    x = nn.Dense(32)(x)
    x = nn.Dropout(0.2, deterministic=not train)(nn.gelu(x))
    return nn.Dense(8)(nn.LayerNorm()(x))


def test_linen_o1_policy_autocasts_the_whole_model_with_dropout():
  """O1 under wrap: f32 params, bf16 matmuls accumulating in f32 both ways."""
  model, x = _DropoutMLP(), jax.random.normal(jax.random.key(3), (4, 16))
  rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
  wrapped = jmp_lite.flax.wrap(model, "O1")
  variables = wrapped.init(rngs, x)
  assert {a.dtype for a in jax.tree.leaves(variables)} == {F32}
  drop = {"dropout": jax.random.key(2)}

  def loss(apply, params):
    return jnp.mean(apply({"params": params}, x, rngs=drop) ** 2)

  got = jax.value_and_grad(functools.partial(loss, wrapped.apply))(
      variables["params"])
  want = jax.value_and_grad(functools.partial(loss, model.apply))(
      variables["params"])
  assert got[0].dtype == F32
  np.testing.assert_allclose(got[0], want[0], rtol=2e-2)
  for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
    assert g.dtype == F32
    np.testing.assert_allclose(g, w, atol=3e-2 * float(jnp.max(jnp.abs(w))))
  report = audit(jax.grad(functools.partial(loss, wrapped.apply)),
                 variables["params"])
  assert report.count(category="matmul") == 5  # 2 forward, 3 backward
  assert report.count(category="matmul", operand_dtype=BF,
                      accumulation=F32) == 5
  report.assert_clean()


@pytest.mark.usefixtures("standard_promotion")  # optax.adam's bias correction
def test_nnx_optimizer_guard_keeps_everything_on_a_skipped_step():
  """``nnx.Optimizer`` holds its optax state's arrays in Variables:
  ``find_loss_scale_state(opt.opt_state).skipped`` was one, which
  ``select_tree`` refused (``__jax_array__`` during abstractification). With
  it a plain flag, the README's NNX step keeps parameters, moments and
  BatchNorm statistics on a skipped step. Oracle: the state before it."""
  import optax
  import jmp_lite.optax

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.l1, self.bn = nnx.Linear(8, 16, rngs=rngs), nnx.BatchNorm(16, rngs=rngs)

    def __call__(self, x):
      return self.bn(self.l1(x))

  model = jmp_lite.flax.wrap(Net(nnx.Rngs(0)), "p=f32,c=f16,o=f32")
  opt = nnx.Optimizer(model, jmp_lite.optax.with_loss_scale(
      optax.adam(1e-3), jmp_lite.DynamicLossScale(2.0 ** 10)), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, x):
    scale = jmp_lite.optax.get_loss_scale(opt.opt_state)
    before = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
    grads = nnx.grad(lambda m: scale.scale(jnp.mean(m(x) ** 2)))(model)
    opt.update(model, grads)
    skipped = jmp_lite.optax.find_loss_scale_state(opt.opt_state).skipped
    after = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
    nnx.update(model, jmp_lite.select_tree(skipped, before, after))
    return skipped

  x = jax.random.normal(jax.random.key(1), (32, 8))
  assert not bool(step(model, opt, x))
  kept = jax.tree.map(np.array, (nnx.state(model), opt.opt_state))
  assert bool(step(model, opt, x * 1e5))  # float16 overflows in l1's output
  state = jmp_lite.optax.find_loss_scale_state(opt.opt_state)
  assert isinstance(state.skipped, jax.Array) and state.skipped.dtype == jnp.bool_
  now = jax.tree.map(np.array, (nnx.state(model), opt.opt_state))
  inner = lambda t: (t[0], jmp_lite.optax.find_loss_scale_state(t[1]).inner_state)
  assert_trees_bitwise_equal(inner(now), inner(kept))


def test_nnx_optimizer_state_of_a_model_with_an_integer_param_finds_its_loss_scale():
  """Found by a user: with an integer ``nnx.Param`` (a step counter),
  ``get_loss_scale(opt.opt_state)`` raised "None is not a valid value for
  jnp.array": the inner optimizer's moment for the int leaf is None, which
  ``nnx.Optimizer`` keeps in a Variable. Oracle: the same parameters as a
  pure dict."""
  import optax
  import jmp_lite.optax

  class Counted(nnx.Module):
    def __init__(self, rngs):
      self.l = nnx.Linear(4, 2, rngs=rngs)
      self.count = nnx.Param(jnp.zeros((), jnp.int32))

    def __call__(self, x):
      return self.l(x)

  model = jmp_lite.flax.wrap(Counted(nnx.Rngs(0)), "p=f32,c=f16,o=f32")
  tx = jmp_lite.optax.with_loss_scale(optax.adam(1e-3), jmp_lite.DynamicLossScale(2.0 ** 10))
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  pure = tx.init(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  for opt_state in (opt.opt_state, tx.init(nnx.state(model, nnx.Param))):
    got = jmp_lite.optax.find_loss_scale_state(opt_state)
    want = jmp_lite.optax.find_loss_scale_state(pure)
    assert_trees_bitwise_equal(got.loss_scale, want.loss_scale)
    assert isinstance(got.skipped, jax.Array) and not bool(got.skipped)
    assert float(jmp_lite.optax.get_loss_scale(opt_state).loss_scale) == 1024.0


def test_wrap_refuses_a_wrapped_model_and_names_a_non_module_briefly():
  """``wrap(wrap(m))`` was accepted (two wrappers, the inner one's rules
  winning); ``wrap(nnx.state(m))`` printed every array of the state."""
  linen = jmp_lite.flax.wrap(nn.Dense(3), BF16)
  nnx_model = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
  for wrapped in (linen, jmp_lite.flax.wrap(nnx_model, "f32")):
    with pytest.raises(ValueError, match=r"already wrapped.*wrap\(wrapped.module"):
      jmp_lite.flax.wrap(wrapped, "f32")
  with pytest.raises(TypeError, match="flax.nnx.statelib.State") as info:
    jmp_lite.flax.wrap(nnx.state(nnx_model), "f32")
  assert len(str(info.value)) < 300


def test_nnx_o1_policy_autocasts_the_whole_model():
  model = nnx.Sequential(nnx.Linear(16, 32, rngs=nnx.Rngs(0)),
                         nnx.Dropout(0.2, rngs=nnx.Rngs(1)),
                         nnx.Linear(32, 8, rngs=nnx.Rngs(2)))
  wrapped = jmp_lite.flax.wrap(model, "O1")
  x = jnp.ones((4, 16))
  assert nnx.jit(lambda m, x: m(x))(wrapped, x).dtype == F32  # with dropout
  wrapped.eval()  # a pure function of the parameters, for the audit
  fun, state = _pure(wrapped)
  report = audit(fun, state, x)
  assert report.count(category="matmul", operand_dtype=BF,
                      accumulation=F32) == 2


def test_wrap_rejects_op_level_autocast_in_rules():
  with pytest.raises(ValueError, match="O1.*whole model"):
    jmp_lite.flax.wrap(nn.Dense(3), "bf16", rules={nn.Dense: "O1"})


class _TiedEncoder(nn.Module):
  embed: nn.Module

  def setup(self):
    self.proj = nn.Dense(4)

  def __call__(self, ids):
    return self.proj(self.embed(ids))


class _TiedInner(nn.Module):
  def setup(self):
    self.shared = nn.Embed(16, 8)
    self.encoder = _TiedEncoder(embed=self.shared)

  def __call__(self, ids):
    return self.encoder(ids)


class _TiedOuter(nn.Module):
  """Hugging Face's seq2seq layout: ``encode`` reaches the encoder through
  a method (``_get_encoder_module``), and the encoder holds the shared
  embedding as an attribute."""

  def setup(self):
    self.model = _TiedInner()

  def __call__(self, ids):
    return self.model(ids)

  def _get_encoder_module(self):
    return self.model.encoder


def _encode(module, ids):
  return module._get_encoder_module()(ids)  # pylint: disable=protected-access


@pytest.mark.parametrize("policy", ["p=f32,c=f32,o=f32", "p=f32,c=bf16,o=f32"])
def test_linen_method_reaching_a_tied_embedding_through_a_method(policy):
  """The submodule a method returned outlived the clone that method ran on;
  it holds its parent weakly, so its tied embedding looked unbound and was
  adopted again at ``model/encoder/embed``: ``apply(method=encode)`` raised
  ScopeParamNotFoundError and ``init(method=encode)`` built the embedding at
  the wrong path (Hugging Face's BART, Pegasus, Marian: encode, decode,
  generate). Oracle: the plain model's init tree and (float32) output."""
  ids = jnp.array([[1, 2, 3]])
  plain = _TiedOuter()
  variables = plain.init(jax.random.key(0), ids)
  wrapped = jmp_lite.flax.wrap(plain, policy)
  want = plain.apply(variables, ids, method=_encode)
  got = wrapped.apply(variables, ids, method=_encode)
  if policy.startswith("p=f32,c=f32"):
    np.testing.assert_array_equal(got, want)
  else:
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
  init = wrapped.init(jax.random.key(0), ids, method=_encode)
  assert jax.tree.structure(init) == jax.tree.structure(
      plain.init(jax.random.key(0), ids, method=_encode))
