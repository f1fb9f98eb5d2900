"""`wrap` on models written the way published Flax models are.

The oracle is the unwrapped model run by Flax itself: the same variable tree
(collections, paths, shapes) from ``init``, variables that load both ways,
bit-identical outputs under a float32 policy, and, under half-precision
policies, every matmul bf16/f16 x bf16/f16 -> float32 (`jmp_lite.audit`), the
policy overriding the layers' own ``dtype=jnp.float32``.
"""

import functools
import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_lite
import jmp_lite.flax
import jmp_lite.testing

POLICIES = ("f32", "p=f32,c=bf16,o=f32", "p=f32,c=f16,o=f32")
HALF = {"p=f32,c=bf16,o=f32": "bf16", "p=f32,c=f16,o=f32": "f16"}


class Config:
  """A model config whose dtype defaults to float32, as published ones do."""
  dtype = jnp.float32
  vocab = 32
  width = 16


class Encoder(nn.Module):
  embed: nn.Module

  @nn.compact
  def __call__(self, tokens):
    x = self.embed(tokens)
    return nn.Dense(Config.width, dtype=Config.dtype)(x)


class Decoder(nn.Module):
  embed: nn.Module

  @nn.compact
  def __call__(self, memory, tokens):
    x = self.embed(tokens) + jnp.mean(memory, axis=1, keepdims=True)
    x = nn.LayerNorm(dtype=Config.dtype)(x)
    return self.embed.attend(nn.Dense(Config.width, dtype=Config.dtype)(x))


class Seq2Seq(nn.Module):
  """An embedding built in ``setup``, shared by encoder and decoder, tied out."""

  def setup(self):
    self.shared = nn.Embed(Config.vocab, Config.width, dtype=Config.dtype)
    self.encoder = Encoder(self.shared)
    self.decoder = Decoder(self.shared)

  def __call__(self, src, tgt):
    return self.decoder(self.encoder(src), tgt)


class Adopting(nn.Module):
  """A Dense built in one module and called by another it is passed to."""

  @nn.compact
  def __call__(self, x):
    return _Apply(nn.Dense(3, dtype=Config.dtype))(x)


class _Apply(nn.Module):
  inner: nn.Module

  @nn.compact
  def __call__(self, x):
    return self.inner(x)


class LSTM(nn.Module):
  """``nn.RNN(nn.LSTMCell(...))`` as Flax's docs write it: its own carry."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(nn.RNN(nn.LSTMCell(8))(x)[:, -1])


class GRU(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(nn.RNN(nn.GRUCell(8))(x)[:, -1])


class _ScannedMethod(nn.Module):
  """A recurrent layer whose method is itself the lifted scan, the way
  Flax's SST-2 classifier writes its LSTM (examples/sst2/models.py,
  ``SimpleLSTM``, google/flax@0e5fc04): a transform decorating the method,
  a parameter of the body's own (``mix``) and a cell built in the body."""

  @functools.partial(nn.transforms.scan, variable_broadcast="params", in_axes=1,
                     out_axes=1, split_rngs={"params": False})
  @nn.compact
  def __call__(self, carry, x):
    mix = self.param("mix", nn.initializers.lecun_normal(), (x.shape[-1], 8),
                     Config.dtype)
    return nn.OptimizedLSTMCell(8, dtype=Config.dtype)(carry, x @ mix)


class BiLSTM(nn.Module):
  """Two such layers built in ``setup``, one reading the sequence reversed."""

  def setup(self):
    self.forward = _ScannedMethod()
    self.backward = _ScannedMethod()

  def __call__(self, x):
    carry = (jnp.zeros((x.shape[0], 8), x.dtype),) * 2
    _, ahead = self.forward(carry, x)
    _, behind = self.backward(carry, x[:, ::-1])
    return jnp.concatenate([ahead, behind[:, ::-1]], -1)[:, -1]


_TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, Config.vocab, (2, 6)),
                      jnp.int32)
_SEQ = jnp.asarray(np.random.default_rng(1).normal(size=(2, 5, 3)), jnp.float32)
MODELS = {
    "seq2seq": (Seq2Seq, (_TOKENS, _TOKENS[:, :4])),
    "adopting": (Adopting, (_SEQ[:, 0],)),
    "lstm": (LSTM, (_SEQ,)),
    "gru": (GRU, (_SEQ,)),
    "bilstm_method_scan": (BiLSTM, (_SEQ,)),
}


def _shapes(tree):
  return jax.tree.map(lambda a: (a.shape, np.dtype(a.dtype)), tree)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", MODELS)
def test_variables_are_the_models_both_ways(name, policy):
  cls, args = MODELS[name]
  model = cls()
  wrapped = jmp_lite.flax.wrap(model, policy)
  key = jax.random.key(0)
  mine, theirs = wrapped.init(key, *args), model.init(key, *args)
  assert _shapes(mine) == _shapes(theirs)
  # Same initial values: the parameter policy is float32.
  chex.assert_trees_all_equal(mine, theirs)
  out = jax.jit(wrapped.apply)(theirs, *args)
  ref = jax.jit(model.apply)(theirs, *args)
  assert out.dtype == ref.dtype == jnp.float32
  if policy == "f32":
    np.testing.assert_array_equal(out, ref)
  else:
    err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    assert err < 2e-2, err
  np.testing.assert_array_equal(jax.jit(model.apply)(mine, *args), ref)


class Constants(nn.Module):
  """Variables made from constants, as Flax's decoding attention makes its
  ``cache_index`` and as published models make scalar parameters."""

  @nn.compact
  def __call__(self, x):
    self.variable("cache", "index", lambda: jnp.array(0, jnp.uint32))
    self.variable("stats", "count", lambda: jnp.zeros((), jnp.int32))
    scale = self.param("scale", lambda _: jnp.array(1.0))
    return nn.Dense(4)(x) * scale


@pytest.mark.parametrize("policy", POLICIES + ("O1",))
def test_init_returns_arrays_as_the_models_init_does(policy):
  """Leaves of the wrapped ``init`` are `jax.Array`s with Flax's dtypes, not
  the constants of a jaxpr (which have no ``sharding`` and make a second jit
  cache entry). Other collections keep their weak types too; parameters are
  cast to the parameter dtype, which makes a weak ``jnp.array(1.0)`` strong
  (as the first optimizer update would)."""
  x = jnp.ones((2, 4))
  mine = jmp_lite.flax.wrap(Constants(), policy).init(jax.random.key(0), x)
  theirs = Constants().init(jax.random.key(0), x)
  describe = lambda a: (type(a), a.dtype, a.shape)  # pylint: disable=unnecessary-lambda-assignment
  assert jax.tree.map(describe, mine) == jax.tree.map(describe, theirs)
  weak = lambda v: {c: jax.tree.map(lambda a: a.weak_type, v[c]) for c in v if c != "params"}  # pylint: disable=unnecessary-lambda-assignment
  assert weak(mine) == weak(theirs)
  mine["cache"]["index"].block_until_ready()  # an array's method
  step = jax.jit(lambda v: jax.tree.map(lambda a: a + 1, v))
  step(mine)
  step(jax.tree.map(jnp.array, mine))  # copies: arrays of the same types
  assert step._cache_size() == 1  # pylint: disable=protected-access


class CachedAttention(nn.Module):
  """Flax's attention decoding one token at a time from its cache."""
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    return nn.MultiHeadDotProductAttention(num_heads=2, decode=True, dtype=self.dtype)(x, x)


@pytest.mark.parametrize("policy", list(HALF))
def test_a_decoding_cache_is_the_compute_dtype_models_cache(policy):
  """The wrapped model's cache is the one Flax's own model of the compute
  dtype makes; decoding with it gives the float32 model's outputs (to the
  compute dtype's precision). A float32 cache from the model's own init is
  refused with what to do, naming the collection and the path."""
  compute = jnp.bfloat16 if HALF[policy] == "bf16" else jnp.float16
  x = jax.random.normal(jax.random.key(1), (1, 4, 8))
  model, wrapped = CachedAttention(), jmp_lite.flax.wrap(CachedAttention(), policy)
  variables = model.init(jax.random.key(0), x)
  mine = wrapped.init(jax.random.key(0), x)
  flax_half = CachedAttention(dtype=compute).init(jax.random.key(0), x)
  describe = lambda a: (a.shape, a.dtype)  # pylint: disable=unnecessary-lambda-assignment
  assert jax.tree.map(describe, mine["cache"]) == jax.tree.map(describe, flax_half["cache"])
  chex.assert_trees_all_equal(mine["params"], variables["params"])
  ours, theirs = {**mine}, {**variables}
  decode = jax.jit(functools.partial(wrapped.apply, mutable=["cache"]))
  decode_ref = jax.jit(functools.partial(model.apply, mutable=["cache"]))
  for t in range(x.shape[1]):
    out, cache = decode(ours, x[:, t:t + 1])
    ours = {**ours, **cache}
    ref, cache = decode_ref(theirs, x[:, t:t + 1])
    theirs = {**theirs, **cache}
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, ref, atol=3e-2, rtol=3e-2)
  with pytest.raises(TypeError, match=r"'cache': \['MultiHeadDotProductAttention_0'\]"
                     r"\['cached_key'\] is float32.*wrapped model's init"):
    wrapped.apply(variables, x[:, :1], mutable=["cache"])


@pytest.mark.usefixtures("standard_promotion")  # NNX's own half attention mixes dtypes
@pytest.mark.parametrize("policy", list(HALF))
def test_an_nnx_models_float32_cache_is_refused_with_what_to_do(policy):
  """An NNX model decoding with the float32 cache of ``init_cache``'s default
  got JAX's bare dynamic_update_slice error (Linen's says what to do). The
  cache made in the compute dtype decodes, as NNX's own model of that dtype
  does (oracle: its outputs, to the compute dtype's precision)."""
  compute = jnp.bfloat16 if HALF[policy] == "bf16" else jnp.float16
  x = jax.random.normal(jax.random.key(1), (1, 1, 8))
  make = lambda **kw: nnx.MultiHeadAttention(2, 8, rngs=nnx.Rngs(0), decode=True, **kw)
  wrapped = jmp_lite.flax.wrap(make(), policy)
  wrapped.module.init_cache((1, 4, 8))
  with pytest.raises(TypeError, match=r"'Cache': \['cached_key'\] is float32"
                     r".*init_cache\(shape, dtype="):
    wrapped(x)
  wrapped.module.init_cache((1, 4, 8), dtype=compute)
  native = make(dtype=compute)
  native.init_cache((1, 4, 8), dtype=compute)
  np.testing.assert_allclose(wrapped(x), native(x).astype(jnp.float32), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("policy", ["f32", "p=f32,c=bf16,o=f32"])
def test_a_users_interceptor_sees_each_call_once(policy):
  """``wrap`` re-runs each module's call on a clone, whose method went
  through the interceptor stack again: a user's ``nn.intercept_methods``
  interceptor outside the wrapper saw every call twice, and an edit it made
  to a module's output was applied twice. Oracle: plain Flax (the same
  calls, and under ``f32`` the same output bitwise)."""

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(2)(jnp.tanh(nn.Dense(4, name="d0")(x)))

  def run(model, params, x):
    seen = []

    def double_d0(next_fun, args, kwargs, context):
      out = next_fun(*args, **kwargs)
      seen.append((context.module.name, context.method_name))
      return out * 2.0 if context.module.name == "d0" else out

    with nn.intercept_methods(double_d0):
      return model.apply({"params": params}, x), seen

  x = jnp.arange(6.0).reshape(2, 3) / 6
  params = Net().init(jax.random.key(0), x)["params"]
  want, want_seen = run(Net(), params, x)
  got, got_seen = run(jmp_lite.flax.wrap(Net(), policy), params, x)
  layers = lambda seen: [s for s in seen if s[0] in ("d0", "Dense_0")]
  assert layers(got_seen) == layers(want_seen) == [("d0", "__call__"), ("Dense_0", "__call__")]
  if policy == "f32":
    np.testing.assert_array_equal(got, want)
  else:
    np.testing.assert_allclose(got, want, atol=2e-2)


def test_a_shared_embedding_stays_one_embedding():
  model = jmp_lite.flax.wrap(Seq2Seq(), "p=f32,c=bf16,o=f32")
  variables = model.init(jax.random.key(0), *MODELS["seq2seq"][1])
  embeddings = [path for path, _ in jax.tree_util.tree_flatten_with_path(
      variables)[0] if "embedding" in jax.tree_util.keystr(path)]
  assert len(embeddings) == 1, embeddings
  grads = jax.grad(lambda v: jnp.sum(model.apply(v, *MODELS["seq2seq"][1])))(
      variables)
  # The one embedding gets the gradient of all three uses.
  assert float(jnp.abs(grads["params"]["shared"]["embedding"]).sum()) > 0


@pytest.mark.parametrize("policy", list(HALF))
@pytest.mark.parametrize("name", MODELS)
def test_policy_overrides_layers_float32_dtype(name, policy):
  cls, args = MODELS[name]
  model = cls()
  variables = model.init(jax.random.key(0), *args)
  half = HALF[policy]

  def audit(**kwargs):
    wrapped = jmp_lite.flax.wrap(model, policy, **kwargs)
    return jmp_lite.audit(lambda v: wrapped.apply(v, *args), variables,
                          policy=policy)

  report = audit()
  total = report.count(category="matmul")
  assert total >= 1
  assert report.count(category="matmul", operand_dtype=half,
                      accumulation=jnp.float32) == total, str(report)
  if name in ("seq2seq", "adopting"):
    # Opting out: the layers' own dtype=float32 wins, as in plain Flax.
    assert audit(module_dtypes=True).count(
        category="matmul", operand_dtype=half) == 0


def test_module_dtypes_must_be_a_bool():
  with pytest.raises(TypeError, match="module_dtypes"):
    jmp_lite.flax.wrap(nn.Dense(2), "f32", module_dtypes="yes")


# NNX -------------------------------------------------------------------------


class NnxMLP(nnx.Module):

  def __init__(self, rngs):
    self.l1 = nnx.Linear(4, 8, dtype=jnp.float32, rngs=rngs)
    self.l2 = nnx.Linear(8, 2, dtype=jnp.float32, rngs=rngs)

  def __call__(self, x):
    return self.l2(nnx.gelu(self.l1(x)))


def test_nnx_wrap_never_changes_the_callers_model():
  model = NnxMLP(nnx.Rngs(0))
  before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
  wrapped = jmp_lite.flax.wrap(model, "p=bf16,c=bf16,o=f32")
  assert wrapped.module.l1.kernel.get_value().dtype == jnp.bfloat16
  after = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
  assert jax.tree.all(jax.tree.map(
      lambda a, b: a.dtype == b.dtype and np.array_equal(a, b), before, after))
  assert model.l1.dtype == jnp.float32  # attributes untouched too
  # Re-wrapping in float32 sees the original weights, not bf16-rounded ones.
  x = jnp.ones((3, 4))
  np.testing.assert_array_equal(jmp_lite.flax.wrap(model, "f32")(x), model(x))
  # A wrapper whose policy stores the parameters as they are shares them.
  assert jmp_lite.flax.wrap(model, "p=f32,c=bf16,o=f32").module is model


def test_nnx_policy_overrides_layers_float32_dtype():
  model = NnxMLP(nnx.Rngs(0))
  x = jnp.ones((3, 4))
  for kwargs, expected in (({}, 2), ({"module_dtypes": True}, 0)):
    wrapped = jmp_lite.flax.wrap(model, "p=f32,c=bf16,o=f32", **kwargs)
    graphdef, state = nnx.split(wrapped)
    report = jmp_lite.audit(lambda s: nnx.merge(graphdef, s)(x), state,
                            policy="p=f32,c=bf16,o=f32")
    assert report.count(category="matmul", operand_dtype="bf16",
                        accumulation=jnp.float32) == expected, str(report)


def test_nnx_rnn_keeps_its_carry_dtype():
  rnn = nnx.RNN(nnx.LSTMCell(3, 4, rngs=nnx.Rngs(0)))
  out = jmp_lite.flax.wrap(rnn, "p=f32,c=bf16,o=f32")(_SEQ)
  ref = rnn(_SEQ)
  assert out.dtype == jnp.float32
  assert float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)) < 2e-2


# Norms by role ---------------------------------------------------------------


class T5LayerNorm(nn.Module):
  """An RMSNorm written in a model's own file (T5's)."""
  eps: float = 1e-6

  @nn.compact
  def __call__(self, x):
    scale = self.param("weight", nn.initializers.ones, (x.shape[-1],))
    h = x.astype(jnp.float32)
    var = jnp.mean(jnp.square(h), -1, keepdims=True)
    return scale * (h * jax.lax.rsqrt(var + self.eps)).astype(scale.dtype)


class WithOwnNorm(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(T5LayerNorm()(nn.Dense(4)(x)))


def test_a_models_own_norm_class_runs_in_float32():
  x = jnp.ones((2, 3))
  wrapped = jmp_lite.flax.wrap(WithOwnNorm(), "p=f32,c=bf16,o=f32")
  policies = {k: str(v) for k, v in jmp_lite.flax.policy_map(wrapped, x).items()}
  assert policies["T5LayerNorm_0"] == "p=f32,c=f32,o=f32", policies
  assert policies["Dense_0"] == "p=f32,c=bf16,o=f32", policies
  # A user rule wins over the role; no defaults, no role.
  ruled = jmp_lite.flax.wrap(WithOwnNorm(), "p=f32,c=bf16,o=f32",
                             rules={T5LayerNorm: "p=f32,c=bf16,o=f32"})
  assert str(jmp_lite.flax.policy_map(ruled, x)["T5LayerNorm_0"]) == (
      "p=f32,c=bf16,o=f32")
  bare = jmp_lite.flax.wrap(WithOwnNorm(), "p=f32,c=bf16,o=f32",
                            default_rules=False)
  assert str(jmp_lite.flax.policy_map(bare, x)["T5LayerNorm_0"]) == (
      "p=f32,c=bf16,o=f32")


def test_nnx_own_norm_class_runs_in_float32():

  class ScaleNorm(nnx.Module):

    def __init__(self):
      self.g = nnx.Param(jnp.ones(()))

    def __call__(self, x):
      return self.g * x / jnp.linalg.norm(x, axis=-1, keepdims=True)

  wrapped = jmp_lite.flax.wrap(ScaleNorm(), "p=f32,c=bf16,o=f32")
  assert str(jmp_lite.flax.policy_map(wrapped)[""]) == "p=f32,c=f32,o=f32"


class _AttentionBlock(nnx.Module):

  def __init__(self, rngs):
    self.norm = nnx.LayerNorm(16, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=16, decode=False,
                                       rngs=rngs)
    self.mlp = nnx.Linear(16, 16, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.norm(x))
    return x + self.mlp(x)


class _ScannedRematStack(nnx.Module):
  """Stacked blocks run by ``nnx.scan(nnx.remat(...))``, as NNX's docs scan layers."""

  def __init__(self, rngs):
    @nnx.split_rngs(splits=2)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return _AttentionBlock(rngs)
    self.blocks = make(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat
    def step(x, block):
      return block(x)
    return step(x, self.blocks)


@pytest.mark.parametrize("policy", list(HALF))
def test_nnx_scanned_remat_attention_backward_matmuls_are_half(policy):
  """NNX's attention asks its logits' product for a float32 result
  (``preferred_element_type``); JAX's own derivative of that is a float32
  cotangent times a 16-bit operand (2 of 27 gradient matmuls were). Every
  matmul of the gradient is 16-bit x 16-bit -> float32."""
  wrapped = jmp_lite.flax.wrap(_ScannedRematStack(nnx.Rngs(0)), policy)
  graphdef, state = nnx.split(wrapped)
  x = jnp.ones((2, 5, 16))
  loss = lambda s, x: jnp.mean(nnx.merge(graphdef, s)(x) ** 2)
  with jax.numpy_dtype_promotion("standard"):
    report = jmp_lite.audit(jax.grad(loss), state, x, policy=policy)
  total = report.count(category="matmul")
  assert total == 27, str(report)
  assert report.count(category="matmul", operand_dtype=HALF[policy],
                      accumulation=jnp.float32) == total, str(report)


# float16 on CPU --------------------------------------------------------------


@pytest.mark.slow  # about 12 s on 2 CPU cores: the heavy tier
def test_nnx_attention_in_float16_compiles_on_cpu():
  """`jax.nn.dot_product_attention` asks f16 logits for ``F16_F16_F32``.

  XLA:CPU has no such algorithm and JAX's fallback only catches trace-time
  errors, so plain Flax fails too (under `jax.jit`); the engine runs that dot
  with the default algorithm on CPU, the same f16 x f16 -> f32 product.
  """
  x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 5, 16)),
                  jnp.float32)
  model = nnx.MultiHeadAttention(num_heads=2, in_features=16, qkv_features=16,
                                 decode=False, rngs=nnx.Rngs(0))
  f16_flax = nnx.MultiHeadAttention(num_heads=2, in_features=16,
                                    qkv_features=16, decode=False,
                                    dtype=jnp.float16, rngs=nnx.Rngs(0))
  # JAX's attention calls `jnp.promote_types(float16, float32)`, which strict
  # promotion (this suite's setting) refuses, with or without jmp_lite.
  with jax.numpy_dtype_promotion("standard"):
    if jax.default_backend() == "cpu":  # a GPU has the algorithm (an H200 runs it)
      with pytest.raises(ValueError, match="F16_F16_F32"):
        nnx.jit(lambda m, x: m(x))(f16_flax, x)
    wrapped = jmp_lite.flax.wrap(model, "p=f32,c=f16,o=f32")
    ref = model(x)
    out = wrapped(x)
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(wrapped)
    ref_grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
  assert out.dtype == jnp.float32
  assert float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)) < 5e-3
  got, want = (jax.tree.leaves(nnx.state(g, nnx.Param))
               for g in (grads, ref_grads))
  assert len(got) == len(want) and all(g.dtype == jnp.float32 for g in got)
  # Over all leaves together: the key bias's exact gradient is zero (softmax
  # ignores a shift of every logit), so its own relative error is noise.
  diff = sum(float(jnp.sum((g - r) ** 2)) for g, r in zip(got, want))
  norm = sum(float(jnp.sum(r ** 2)) for r in want)
  assert (diff / norm) ** 0.5 < 1e-2


# apply(method=...) -----------------------------------------------------------


class AutoEncoder(nn.Module):

  def setup(self):
    self.enc = nn.Dense(4, dtype=Config.dtype)
    self.dec = nn.Dense(8, dtype=Config.dtype)

  def encode(self, x):
    return self.enc(x)

  def __call__(self, x):
    return self.dec(self.encode(x))


@pytest.mark.parametrize("policy", ("f32", "p=f32,c=bf16,o=f32", "O1"))
def test_method_is_forwarded_to_the_model(policy):
  model = AutoEncoder()
  x = jnp.asarray(np.random.default_rng(4).normal(size=(2, 8)), jnp.float32)
  variables = model.init(jax.random.key(0), x)
  want = model.apply(variables, x, method="encode")
  wrapped = jmp_lite.flax.wrap(model, policy)
  for method in ("encode", AutoEncoder.encode, model.encode):
    got = wrapped.apply(variables, x, method=method)
    assert got.dtype == jnp.float32 and got.shape == want.shape
    if policy == "f32":
      np.testing.assert_array_equal(got, want)
    else:
      np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
  report = jmp_lite.audit(lambda v: wrapped.apply(v, x, method="encode"),
                          variables, policy=policy)
  assert report.count(category="matmul") == 1
  assert report.count(category="matmul", operand_dtype="bf16") == (
      0 if policy == "f32" else 1)
  # init(method=...) makes what Flax makes: the encoder's variables only.
  assert _shapes(wrapped.init(jax.random.key(0), x, method="encode")) == (
      _shapes(model.init(jax.random.key(0), x, method="encode")))
  # Eager calls with the same method reuse one compiled step.
  with jmp_lite.testing.count_compilations() as compiled:
    wrapped.apply(variables, x, method="encode")
  assert not compiled


class _SharedScope(nn.Module):
  """A module that hands its scope to a child (`nn.share_scope`), as adapters
  around a published backbone do: the child's variables sit at its level."""

  def setup(self):
    self.backbone = AutoEncoder()
    nn.share_scope(self, self.backbone)

  def __call__(self, x):
    return self.backbone(x) * 2.0


@pytest.mark.parametrize("policy", POLICIES)
def test_share_scope_keeps_the_layout(policy):
  model = _SharedScope()
  x = jnp.ones((2, 8))
  wrapped = jmp_lite.flax.wrap(model, policy)
  mine, theirs = (m.init(jax.random.key(0), x) for m in (wrapped, model))
  assert _shapes(mine) == _shapes(theirs)
  assert set(theirs["params"]) == {"enc", "dec"}
  out, ref = wrapped.apply(theirs, x), model.apply(theirs, x)
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, ref, rtol=0 if policy == "f32" else 2e-2,
                             atol=0 if policy == "f32" else 2e-2)


class _Sowing(nnx.Module):
  """Records its hidden layer with ``sow``, as NNX's guide to intermediates
  shows (outside ``nnx.capture``: deprecated, but published models do it)."""

  def __init__(self, rngs):
    self.l1 = nnx.Linear(4, 8, rngs=rngs)
    self.l2 = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    h = self.l1(x)
    self.sow(nnx.Intermediate, "l1_out", h)
    return self.l2(h)


@pytest.mark.parametrize("policy", POLICIES + ("p=bf16,c=bf16,o=f32",))
def test_nnx_sow_under_wrap_records_as_the_model_does(policy):
  """Records land on the model the wrapper runs: the caller's, or the
  converted copy it holds (``p=bf16``), as the parameters do."""
  x = jnp.asarray(np.random.default_rng(2).normal(size=(3, 4)), jnp.float32)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    model = _Sowing(nnx.Rngs(0))
    ref = [model(x) for _ in range(2)]
    wrapped = jmp_lite.flax.wrap(_Sowing(nnx.Rngs(0)), policy)
    out = [wrapped(x) for _ in range(2)]
  recorded = wrapped.module.l1_out.get_value()
  assert len(recorded) == len(model.l1_out.get_value()) == 2  # one per call
  half = {"bf16": jnp.bfloat16, "f16": jnp.float16}.get(
      HALF.get(policy, "bf16" if "c=bf16" in policy else None), jnp.float32)
  assert all(r.dtype == half and r.shape == (3, 8) for r in recorded)
  if policy == "f32":
    chex.assert_trees_all_equal(out, ref)
    chex.assert_trees_all_equal(recorded, model.l1_out.get_value())


class _Float32Logits(nn.Module):
  """Attention logits and softmax computed on operands the model casts to
  float32 itself (the "softmax in fp32" pattern of published LLMs)."""

  @nn.compact
  def __call__(self, x):
    q, k, v = (nn.Dense(8, name=n)(x) for n in "qkv")
    logits = jnp.einsum("bqd,bkd->bqk", q.astype(jnp.float32), k.astype(jnp.float32))
    weights = jax.nn.softmax(logits).astype(v.dtype)
    return nn.Dense(8, name="out")(weights @ v)


def test_explicit_float32_stays_unless_the_policy_decides_by_operation():
  """Under p/c/o the model's own float32 logits product stays float32 (1
  forward, 2 backward); under O1 every matmul is bf16 (torch.autocast's
  rule), and the softmax's exp stays float32 under both."""
  model = _Float32Logits()
  x = jnp.asarray(np.random.default_rng(4).normal(size=(2, 4, 8)), jnp.float32)
  variables = model.init(jax.random.key(0), x)

  def report(policy):
    wrapped = jmp_lite.flax.wrap(model, policy)
    return jmp_lite.audit(jax.grad(lambda v: jnp.sum(wrapped.apply(v, x))), variables,
                          policy=policy)

  pco, o1 = report("p=f32,c=bf16,o=f32"), report("O1")
  total = pco.count(category="matmul")
  assert total == o1.count(category="matmul") == 15
  assert pco.count(category="matmul", operand_dtype="f32") == 3
  assert pco.count(category="matmul", operand_dtype="bf16", accumulation=jnp.float32) == 12
  assert o1.count(category="matmul", operand_dtype="bf16", accumulation=jnp.float32) == 15
  for r in (pco, o1):
    assert [row.operand_dtypes for row in r.select(primitive="exp")] == [
        (np.dtype(np.float32),)]


def test_float16_products_asking_for_float32_keep_jaxs_derivative():
  """A bf16 product with ``preferred_element_type=float32`` becomes the
  engine's (its backward products bf16 x bf16 -> f32); a float16 one keeps
  JAX's derivative (float32 cotangent x f16 operand): its cotangent, here
  above 65504, would overflow rounded to f16. Oracle: plain JAX."""
  row = np.random.default_rng(5).normal(size=8)
  # Rows that nearly cancel: the logits' cotangent is 1e5 (above 65504) and
  # h's, 1e5 times a column sum of x, 5000 (within float16).
  x = jnp.asarray(np.stack([row, -row, row + 0.05, -row]), jnp.float32)
  w = jnp.asarray(np.random.default_rng(6).normal(size=(8, 8)), jnp.float32)

  def loss(w, x):
    h = x.astype(w.dtype) @ w
    logits = jnp.einsum("bd,cd->bc", h, x.astype(w.dtype),
                        preferred_element_type=jnp.float32)
    return jnp.sum(logits) * 1e5

  with jax.numpy_dtype_promotion("standard"):
    _, grads, finite = jmp_lite.value_and_grad(loss, policy="p=f32,c=f16,o=f32")(
        w, x, loss_scale=jmp_lite.StaticLossScale(1.0))
    want = jax.grad(loss)(w.astype(jnp.float16), x).astype(jnp.float32)
  assert bool(finite)
  np.testing.assert_allclose(grads, want, rtol=2e-2)


class _LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(nn.LayerNorm()(nn.relu(nn.Dense(8)(x))))


class _Bridged(nnx.Module):
  """An NNX model holding a Linen module through `flax.nnx.bridge.ToNNX`."""

  def __init__(self, rngs):
    self.inner = nnx.bridge.ToNNX(_LinenBlock(), rngs=rngs)
    nnx.bridge.lazy_init(self.inner, jnp.ones((1, 8)))
    self.out = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    return self.out(self.inner(x))


def test_a_linen_module_held_by_an_nnx_model_runs_under_the_rules():
  """Through `flax.nnx.bridge.ToNNX` (the wrapper's attributes broke the
  bridge's variables): its matmuls bf16 accumulating in float32, its
  LayerNorm in float32 on float32 parameters, path rules seen from the NNX
  model's root; gradients float32, close to the float32 model's."""
  x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 8)), jnp.float32)
  model = _Bridged(nnx.Rngs(0))
  loss = lambda m, x: jnp.sum(m(x) ** 2)  # pylint: disable=unnecessary-lambda-assignment
  ref, ref_grads = nnx.value_and_grad(loss)(model, x)
  wrapped = jmp_lite.flax.wrap(model, "p=f32,c=bf16,o=f32")
  value, grads = nnx.jit(nnx.value_and_grad(loss))(wrapped, x)
  np.testing.assert_allclose(value, ref, rtol=3e-2)
  flat = dict(nnx.to_flat_state(nnx.state(grads, nnx.Param)))
  for path, g in nnx.to_flat_state(nnx.state(ref_grads, nnx.Param)):
    mine = flat[("module", *path)].get_value()
    assert mine.dtype == jnp.float32, path
    np.testing.assert_allclose(mine, g.get_value(), rtol=5e-2, atol=5e-2 * float(
        jnp.abs(g.get_value()).max()))
  report = jmp_lite.audit(nnx.jit(lambda m, x: m(x)), wrapped, x)
  assert report.count(primitive="dot_general") == 3
  assert report.count(primitive="dot_general", operand_dtype="bf16", accumulation="f32") == 3
  assert report.count(primitive="reduce_sum", operand_dtype="f32") == 2  # LayerNorm's mean, var
  assert not report.flags
  # A path rule reaches into the Linen module: its second Dense in float32.
  ruled = jmp_lite.flax.wrap(model, "p=f32,c=bf16,o=f32", rules={"inner/Dense_1": "f32"})
  report = jmp_lite.audit(nnx.jit(lambda m, x: m(x)), ruled, x)
  assert report.count(primitive="dot_general", operand_dtype="f32") == 1


@pytest.mark.usefixtures("standard_promotion")  # bf16 inputs, float32 kernel
def test_an_nnx_module_held_by_a_linen_model_is_warned_about():
  """Through `flax.nnx.bridge.ToLinen` wrap does not enter the NNX module: its
  float32 parameters keep its matmul float32. Said, not silent."""

  class Outer(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(4)(nnx.bridge.ToLinen(nnx.Linear, args=(8, 16))(x))

  wrapped = jmp_lite.flax.wrap(Outer(), "p=f32,c=bf16,o=f32")
  x = jnp.ones((2, 8))
  with pytest.warns(UserWarning, match=r"ToLinen_0 is an NNX module held through .*ToLinen \(Linear\)"):
    variables = wrapped.init(jax.random.key(0), x)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jmp_lite.flax.wrap(Outer(), "f32").apply(variables, x)  # nothing to say
