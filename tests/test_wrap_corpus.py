"""A corpus of models written the way published Flax models are, trained under `wrap`.

Each model passes a config's ``dtype=jnp.float32`` to its layers (the policy
must override it) and uses what published models use: ``nn.scan`` over
``nn.remat`` blocks with causal attention (GPT style), BatchNorm with mutable
``batch_stats`` and a cross-replica ``axis_name`` (ResNet style), and NNX's
``nnx.scan`` over stacked layers with BatchNorm and Dropout. For each model and
each of the float32, bfloat16 and float16 policies:

* ``init`` makes exactly the unwrapped model's variable tree;
* under the float32 policy the output is bit-identical to the model's own;
* under half policies every matmul and convolution of the forward and of the
  gradient is half x half -> float32 (`jmp_lite.audit`);
* 30 training steps (`jmp_lite.TrainState`, or `nnx.Optimizer` with
  `jmp_lite.optax.with_loss_scale`; a dynamic loss scale under float16) stay
  finite, end within tolerance of the unwrapped model trained in float32, and
  compile once.

Also in the corpus: an encoder-decoder whose one embedding is built in
``setup``, shared by encoder and decoder and tied to the output (``attend``);
``nn.RNN`` over LSTM and GRU cells making their own carries; a T5-style model
with its own ``T5LayerNorm`` class (kept in float32 by its name).

Tolerance: the difference of the losses after 30 Adam steps on a fixed batch
(the models nearly memorise it), relative to the float32 run's *initial* loss:
a loss near zero makes a relative error of the final loss meaningless (the
encoder-decoder ends at 0.106 in bf16 against 0.100 in float32). Measured
here: at most 0.13% (bf16, encoder-decoder and ResNet) and 0.02% (f16);
`LOSS_TOL = 2e-2` leaves room for other CPUs' rounding.
"""

import dataclasses
import functools
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_lite
import jmp_lite.flax
import jmp_lite.optax
from jmp_lite.testing import count_compilations

# The heavy tier (published-style models trained under wrap): `pytest -m slow`.
pytestmark = pytest.mark.slow

POLICIES = {"f32": "f32", "bf16": "p=f32,c=bf16,o=f32",
            "f16": "p=f32,c=f16,o=f32"}
HALF = {"bf16": "bf16", "f16": "f16"}
STEPS = 30
LOSS_TOL = 2e-2


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 64
  width: int = 32
  heads: int = 2
  layers: int = 2
  dtype: Any = jnp.float32


# GPT: nn.scan(nn.remat(Block)) ------------------------------------------------


class GPTBlock(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, x, _):
    cfg = self.config
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    h = nn.LayerNorm(dtype=cfg.dtype)(x)
    x = x + nn.MultiHeadDotProductAttention(cfg.heads, dtype=cfg.dtype)(
        h, mask=mask)
    h = nn.LayerNorm(dtype=cfg.dtype)(x)
    h = nn.Dense(4 * cfg.width, dtype=cfg.dtype)(h)
    return x + nn.Dense(cfg.width, dtype=cfg.dtype)(nn.gelu(h)), None


class GPT(nn.Module):
  config: Config = Config()

  @nn.compact
  def __call__(self, tokens):
    cfg = self.config
    embed = nn.Embed(cfg.vocab, cfg.width, dtype=cfg.dtype)
    pos = self.param("pos", nn.initializers.normal(0.02),
                     (tokens.shape[1], cfg.width))
    x = embed(tokens) + pos.astype(cfg.dtype)
    stack = nn.scan(nn.remat(GPTBlock), variable_axes={"params": 0},
                    split_rngs={"params": True}, length=cfg.layers)
    x, _ = stack(cfg, name="blocks")(x, None)
    return embed.attend(nn.LayerNorm(dtype=cfg.dtype)(x))


# ResNet: BatchNorm with batch_stats and axis_name ------------------------------


class ResBlock(nn.Module):
  dtype: Any

  @nn.compact
  def __call__(self, x, train):
    norm = lambda: nn.BatchNorm(use_running_average=not train, axis_name="batch",
                                dtype=self.dtype)
    h = nn.relu(norm()(nn.Conv(8, (3, 3), use_bias=False, dtype=self.dtype)(x)))
    h = norm()(nn.Conv(8, (3, 3), use_bias=False, dtype=self.dtype)(h))
    return nn.relu(x + h)


class ResNet(nn.Module):
  config: Config = Config()

  @nn.compact
  def __call__(self, x, train: bool = True):
    dtype = self.config.dtype
    x = nn.Conv(8, (3, 3), dtype=dtype)(x)
    for _ in range(2):
      x = ResBlock(dtype)(x, train)
    return nn.Dense(10, dtype=dtype)(jnp.mean(x, axis=(1, 2)))


# Encoder-decoder with one embedding, shared through setup and tied ------------


class Encoder(nn.Module):
  embed: nn.Module
  config: Config

  @nn.compact
  def __call__(self, tokens):
    cfg = self.config
    x = self.embed(tokens)
    h = nn.LayerNorm(dtype=cfg.dtype)(x)
    return x + nn.MultiHeadDotProductAttention(cfg.heads, dtype=cfg.dtype)(h)


class Decoder(nn.Module):
  embed: nn.Module
  config: Config

  @nn.compact
  def __call__(self, memory, tokens):
    cfg = self.config
    x = self.embed(tokens)
    h = nn.LayerNorm(dtype=cfg.dtype)(x)
    x = x + nn.MultiHeadDotProductAttention(cfg.heads, dtype=cfg.dtype)(
        h, memory)
    h = nn.Dense(cfg.width, dtype=cfg.dtype)(nn.LayerNorm(dtype=cfg.dtype)(x))
    return self.embed.attend(x + nn.gelu(h))


class Seq2Seq(nn.Module):
  config: Config = Config()

  def setup(self):
    self.shared = nn.Embed(self.config.vocab, self.config.width,
                           dtype=self.config.dtype)
    self.encoder = Encoder(self.shared, self.config)
    self.decoder = Decoder(self.shared, self.config)

  def __call__(self, tokens):
    src, tgt = tokens[:, :6], tokens[:, 6:]
    return self.decoder(self.encoder(src), tgt)


# Recurrent: nn.RNN over LSTM and GRU cells, making their own carries -----------


class Recurrent(nn.Module):
  cell: str = "lstm"
  config: Config = Config()

  @nn.compact
  def __call__(self, tokens):
    cfg = self.config
    x = nn.Embed(cfg.vocab, cfg.width, dtype=cfg.dtype)(tokens)
    make = {"lstm": nn.LSTMCell, "gru": nn.GRUCell}[self.cell]
    h = nn.RNN(make(cfg.width, dtype=cfg.dtype))(x)
    return nn.Dense(cfg.vocab, dtype=cfg.dtype)(h)


# A T5-style LM with its own RMSNorm class ----------------------------------------


class T5LayerNorm(nn.Module):
  """T5's RMSNorm as its model file writes it: no mean, a learned scale."""
  eps: float = 1e-6

  @nn.compact
  def __call__(self, x):
    scale = self.param("weight", nn.initializers.ones, (x.shape[-1],))
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(jnp.square(h), -1, keepdims=True) + self.eps)
    return scale * h.astype(scale.dtype)


class T5Like(nn.Module):
  config: Config = Config()

  @nn.compact
  def __call__(self, tokens):
    cfg = self.config
    x = nn.Embed(cfg.vocab, cfg.width, dtype=cfg.dtype)(tokens)
    for _ in range(cfg.layers):
      h = nn.Dense(2 * cfg.width, use_bias=False, dtype=cfg.dtype)(
          T5LayerNorm()(x))
      x = x + nn.Dense(cfg.width, use_bias=False, dtype=cfg.dtype)(nn.relu(h))
    return nn.Dense(cfg.vocab, dtype=cfg.dtype)(T5LayerNorm()(x))


# Data and oracles ---------------------------------------------------------------


def _gpt_batch():
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, Config.vocab, (4, 12)), jnp.int32)
  return tokens[:, :-1], tokens[:, 1:]


def _image_batch():
  rng = np.random.default_rng(1)
  # Two replicas of 4 images: BatchNorm averages its statistics across them.
  x = jnp.asarray(rng.normal(size=(2, 4, 8, 8, 3)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 10, (2, 4)), jnp.int32)
  return x, y


def _xent(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), labels).mean()


def _shapes(tree):
  return jax.tree.map(lambda a: (a.shape, str(a.dtype)), tree)


def _loss_scale(policy):
  return (jmp_lite.DynamicLossScale(2.0 ** 15) if "f16" in policy and
          "bf16" not in policy else None)


def _assert_all_half(report, half):
  for kind in ("matmul", "conv"):
    total = report.count(category=kind)
    assert report.count(category=kind, operand_dtype=half,
                        accumulation=jnp.float32) == total, str(report)
  assert report.count(category="matmul") >= 1


# Linen ------------------------------------------------------------------------


def _gpt_apply(module):
  return lambda variables, x: module.apply(variables, x)


def _resnet_apply(module, train=True):
  """Applies the model to both replicas, BatchNorm reducing across them."""
  def apply(variables, x):
    run = lambda x: module.apply(variables, x, train=train,
                                 mutable=["batch_stats"] if train else False)
    out = jax.vmap(run, axis_name="batch")(x)
    if train:
      logits, updates = out
      return logits, jax.tree.map(lambda a: a[0], updates)
    return out
  return apply


def _seq2seq_batch():
  tokens, labels = _gpt_batch()
  return tokens, labels[:, 6:]


LINEN = {"gpt": (GPT, _gpt_batch, _gpt_apply),
         "resnet": (ResNet, _image_batch, _resnet_apply),
         "seq2seq": (Seq2Seq, _seq2seq_batch, _gpt_apply),
         "lstm": (functools.partial(Recurrent, "lstm"), _gpt_batch, _gpt_apply),
         "gru": (functools.partial(Recurrent, "gru"), _gpt_batch, _gpt_apply),
         "t5_rmsnorm": (T5Like, _gpt_batch, _gpt_apply)}


def _linen_init(module, x):
  init = lambda x: module.init(jax.random.key(0), x)
  if isinstance(module, ResNet) or isinstance(
      getattr(module, "module", None), ResNet):
    return jax.vmap(init, axis_name="batch")(x)  # per replica: take one
  return init(x)


def _first_replica(variables, name):
  return jax.tree.map(lambda a: a[0], variables) if name == "resnet" else variables


def _train_linen(name, wrapped, variables, batch, loss_scale=None):
  """30 steps; returns the losses and the number of compilations after step 1."""
  _, _, make_apply = LINEN[name]
  apply = make_apply(wrapped)
  x, y = batch
  rest = {k: v for k, v in variables.items() if k != "params"}
  policy_str = getattr(getattr(wrapped, "rules", None), "policy", None)
  state = jmp_lite.TrainState.create(
      apply_fn=apply, params=variables["params"], tx=optax.adam(3e-3),
      loss_scale=loss_scale or _loss_scale(str(policy_str)))

  @jax.jit
  def step(state, rest):
    def loss_fn(params):
      out = state.apply_fn({**rest, "params": params}, x)
      logits, new_rest = out if name == "resnet" else (out, rest)
      return _xent(logits, y), new_rest
    state, info = state.minimize(loss_fn, has_aux=True)
    return state, info.aux, info

  losses = []
  state, rest, info = step(state, rest)
  losses.append(float(info.loss))
  with count_compilations() as compiled:
    for _ in range(STEPS - 1):
      state, rest, info = step(state, rest)
      losses.append(float(info.loss))
  assert all(np.isfinite(losses)), losses
  assert all(np.all(np.isfinite(a)) for a in jax.tree.leaves((state, rest)))
  return losses, len(compiled)


@functools.cache
def _reference_losses(name):
  """The unwrapped model trained in float32, once per model."""
  cls, make_batch, _ = LINEN[name]
  model = cls()
  x, y = make_batch()
  variables = _first_replica(_linen_init(model, x), name)
  with jax.numpy_dtype_promotion("standard"):
    return _train_linen(name, model, variables, (x, y))[0]


@pytest.mark.usefixtures("standard_promotion")  # optax's Adam (conftest.py)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", LINEN)
def test_linen_corpus(name, policy):
  cls, make_batch, make_apply = LINEN[name]
  model = cls()
  wrapped = jmp_lite.flax.wrap(model, POLICIES[policy])
  x, y = make_batch()
  mine, theirs = _linen_init(wrapped, x), _linen_init(model, x)
  assert _shapes(mine) == _shapes(theirs)
  variables = _first_replica(theirs, name)
  # Inference output: bit-identical under f32; within bf16 noise otherwise.
  infer = (lambda m: make_apply(m, train=False)) if name == "resnet" else make_apply
  out = jax.jit(infer(wrapped))(variables, x)
  ref = jax.jit(infer(model))(variables, x)
  assert out.dtype == ref.dtype == jnp.float32
  if policy == "f32":
    np.testing.assert_array_equal(out, ref)
  else:
    # Every product half x half -> f32, forward and gradient.
    apply = make_apply(wrapped)

    def loss(params):
      out = apply({**variables, "params": params}, x)
      return _xent(out[0] if name == "resnet" else out, y)

    _assert_all_half(jmp_lite.audit(loss, variables["params"],
                                    policy=POLICIES[policy]), HALF[policy])
    _assert_all_half(jmp_lite.audit(jax.grad(loss), variables["params"],
                                    policy=POLICIES[policy]), HALF[policy])
  losses, compiled = _train_linen(name, wrapped, variables, (x, y))
  ref_losses = _reference_losses(name)
  assert compiled == 0
  assert losses[-1] < 0.9 * losses[0], losses  # it learns
  err = abs(losses[-1] - ref_losses[-1]) / ref_losses[0]
  assert err < LOSS_TOL, (losses[-1], ref_losses[-1])


@pytest.mark.usefixtures("standard_promotion")  # optax's Adam (conftest.py)
@pytest.mark.parametrize("name", ["gpt", "seq2seq", "lstm", "t5_rmsnorm"])
def test_module_loss_scale_on_the_corpus(name):
  """`jmp_lite.ModuleLossScale` on published-style models (scan over remat
  blocks, a tied embedding's ``attend``, attention, recurrent cells): with
  float32 compute and scales spread over 2**-10..2**10 the gradients are
  the unwrapped model's, to float32 rounding of the largest; in float16 the
  30 steps train as float32 does."""
  cls, make_batch, make_apply = LINEN[name]
  model = cls()
  x, y = make_batch()
  variables = _first_replica(_linen_init(model, x), name)
  loss = lambda apply: lambda p: _xent(make_apply(apply)({"params": p}, x), y)
  want = jax.grad(loss(model))(variables["params"])
  wrapped = jmp_lite.flax.wrap(model, "p=f32,c=f32,o=f32")
  paths = tuple(p for p in jmp_lite.flax.policy_map(wrapped, x) if p)
  scales = 2.0 ** np.random.default_rng(0).integers(-10, 11, len(paths))
  ls = jmp_lite.ModuleLossScale(2.0 ** 4, paths=paths, module_scales=scales,
                                compute_dtypes=("float16",) * len(paths))
  got = jax.jit(lambda s, p: jmp_lite.value_and_grad(loss(wrapped))(p, loss_scale=s)[1])(
      ls, variables["params"])
  largest = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(want))
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0,
                               atol=2.0 ** -20 * largest,
                               err_msg=jax.tree_util.keystr(path))
  wrapped = jmp_lite.flax.wrap(model, POLICIES["f16"])
  ls = jmp_lite.ModuleLossScale.create(wrapped, x)
  losses, compiled = _train_linen(name, wrapped, variables, (x, y), loss_scale=ls)
  ref_losses = _reference_losses(name)
  assert compiled == 0
  err = abs(losses[-1] - ref_losses[-1]) / ref_losses[0]
  assert err < LOSS_TOL, (losses[-1], ref_losses[-1])


@pytest.mark.usefixtures("standard_promotion")  # GPT adds a float32 `pos` to f16
@pytest.mark.parametrize("name", ["gpt", "seq2seq", "t5_rmsnorm"])
def test_calibrate_on_the_corpus_is_safe_in_the_wrapped_float16_step(name):
  # Oracle: the float16 step itself (wrap, precision engine). Measured here:
  # calibrated 2^12, 2^12, 2^13 against a first overflowing 2^18, 2^19, 2^19;
  # the engine's float32 weight gradients and the margin of 8 leave 6 to 7
  # doublings. GPT's blocks are measured inside its nn.scan (their largest
  # cotangent, at a LayerNorm, sets the scale), and the attention mask's
  # fill value (float32's lowest) is not taken for an overflowing activation.
  cls, make_batch, make_apply = LINEN[name]
  model = cls()
  x, y = make_batch()
  variables = _linen_init(model, x)

  def loss_of(module):
    apply = make_apply(module)
    return lambda params, x, y: _xent(apply({**variables, "params": params}, x), y)

  cal = jmp_lite.calibrate(loss_of(model), variables["params"], x, y, policy=POLICIES["f16"])
  assert 2.0 ** 10 <= cal.loss_scale <= 2.0 ** 15 and cal.keep_float32 == ()
  vg = jmp_lite.value_and_grad(loss_of(jmp_lite.flax.wrap(model, POLICIES["f16"])))
  finite = jax.jit(lambda p, s: vg(p, x, y, loss_scale=jmp_lite.StaticLossScale(s))[2])
  assert bool(finite(variables["params"], cal.loss_scale))
  assert not bool(finite(variables["params"], cal.loss_scale * 2.0 ** 8))


# NNX: nnx.scan over layers, BatchNorm, Dropout ---------------------------------


class NnxLayer(nnx.Module):

  def __init__(self, width, dtype, rngs):
    self.dense = nnx.Linear(width, width, dtype=dtype, rngs=rngs)
    self.bn = nnx.BatchNorm(width, dtype=dtype, rngs=rngs)
    self.drop = nnx.Dropout(0.1, rngs=rngs)

  def __call__(self, x):
    return x + self.drop(nnx.gelu(self.bn(self.dense(x))))


class NnxScanNet(nnx.Module):

  def __init__(self, config: Config, rngs):
    dtype = config.dtype
    self.inp = nnx.Linear(16, config.width, dtype=dtype, rngs=rngs)

    @nnx.split_rngs(splits=config.layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def layers(rngs):
      return NnxLayer(config.width, dtype, rngs)

    self.layers = layers(rngs)
    self.out = nnx.Linear(config.width, 10, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    x = self.inp(x)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, layer):
      return layer(x)

    return self.out(body(x, self.layers))


def _host(state):
  """A copy of ``state`` in NumPy (PRNG keys as their key data)."""
  return jax.tree.map(lambda a: np.asarray(
      jax.random.key_data(a) if jax.dtypes.issubdtype(
          a.dtype, jax.dtypes.prng_key) else a), state)


def _nnx_batch():
  rng = np.random.default_rng(2)
  return (jnp.asarray(rng.normal(size=(16, 16)), jnp.float32),
          jnp.asarray(rng.integers(0, 10, (16,)), jnp.int32))


def _train_nnx(module, policy, x, y):
  tx = jmp_lite.optax.with_loss_scale(
      optax.adam(3e-3), _loss_scale(policy) or jmp_lite.NoOpLossScale())
  optimizer = nnx.Optimizer(module, tx, wrt=nnx.Param)

  @nnx.jit
  def step(module, optimizer):
    scale = jmp_lite.optax.get_loss_scale(nnx.as_pure(optimizer.opt_state))
    loss_fn = lambda m: scale.scale(_xent(m(x), y))
    scaled, grads = nnx.value_and_grad(loss_fn)(module)
    optimizer.update(module, grads)
    return scale.unscale(scaled)

  losses = [float(step(module, optimizer))]
  with count_compilations() as compiled:
    losses += [float(step(module, optimizer)) for _ in range(STEPS - 1)]
  assert all(np.isfinite(losses)), losses
  return losses, len(compiled)


@pytest.mark.usefixtures("standard_promotion")
@pytest.mark.parametrize("policy", POLICIES)
def test_nnx_corpus(policy):
  x, y = _nnx_batch()
  make = lambda: NnxScanNet(Config(), nnx.Rngs(0, dropout=1))
  model = make()
  before = _host(nnx.state(model))
  wrapped = jmp_lite.flax.wrap(model, POLICIES[policy])
  # Float32 parameters are what every policy here stores: the wrapper shares
  # the model, whose state (values and dtypes) wrapping left as it was.
  assert wrapped.module is model
  chex.assert_trees_all_equal(_host(nnx.state(model)), before, strict=True)
  model.eval()
  wrapped.eval()
  out, ref = wrapped(x), model(x)
  if policy == "f32":
    np.testing.assert_array_equal(out, ref)
  else:
    graphdef, params, rest = nnx.split(wrapped, nnx.Param, ...)
    loss = lambda p: _xent(nnx.merge(graphdef, p, rest)(x), y)
    _assert_all_half(jmp_lite.audit(loss, params, policy=POLICIES[policy]),
                     HALF[policy])
    _assert_all_half(jmp_lite.audit(jax.grad(loss), params,
                                    policy=POLICIES[policy]), HALF[policy])
  wrapped.train()
  losses, compiled = _train_nnx(wrapped, POLICIES[policy], x, y)
  reference = make()
  reference.train()
  ref_losses, _ = _train_nnx(reference, "f32", x, y)
  assert compiled == 0
  assert losses[-1] < 0.9 * losses[0], losses
  err = abs(losses[-1] - ref_losses[-1]) / ref_losses[0]
  assert err < LOSS_TOL, (losses[-1], ref_losses[-1])
