"""fp8 sites in loops, by role: one state per layer of a scanned stack, one
state for a cell scanned over time.

A matmul whose weight is sliced from a scanned stack (Flax's ``nn.scan``
with ``variable_axes={"params": 0}``) gets a history per layer; one whose
weights are closed over (``nn.RNN`` over time, a ``fori_loop``) gets one
history, the maximum over the iterations, so the fp8 state, and a
checkpoint of it, does not depend on the sequence length. Oracle: the same
cell unrolled by a Python loop, whose every call is a site of its own (the
largest of their maxima is the loop's).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite
import jmp_lite.flax

BF16 = "p=f32,c=bf16,o=f32"
FP8 = {nn.Dense: BF16 + ",fp8=hybrid"}
ONE = jmp_lite.StaticLossScale(1.0)


class Cell(nn.Module):
  """An Elman cell: ``h' = tanh(x W + h U)``."""

  @nn.compact
  def __call__(self, h, x):
    h = jnp.tanh(nn.Dense(16, name="i")(x) + nn.Dense(16, name="h", use_bias=False)(h))
    return h, h


class Scanned(nn.Module):
  """The cell scanned over time (its parameters broadcast)."""

  @nn.compact
  def __call__(self, x):
    cell = nn.scan(Cell, variable_broadcast="params", split_rngs={"params": False},
                   in_axes=1, out_axes=1)(name="cell")
    _, ys = cell(jnp.zeros((x.shape[0], 16), x.dtype), x)
    return ys


class Unrolled(nn.Module):
  """The same cell called once per time step by Python."""

  @nn.compact
  def __call__(self, x):
    cell = Cell(name="cell")
    h, ys = jnp.zeros((x.shape[0], 16), x.dtype), []
    for t in range(x.shape[1]):
      h, y = cell(h, x[:, t])
      ys.append(y)
    return jnp.stack(ys, axis=1)


def _setup(module, x):
  model = jmp_lite.flax.wrap(module, BF16, rules=FP8)
  loss = lambda p, x: jnp.mean(model.apply({"params": p}, x) ** 2)
  return loss, model.init(jax.random.key(0), x)["params"]


def _sequence(t):
  rng = np.random.default_rng(t)
  x = rng.standard_normal((4, t, 8)).astype(np.float32)
  x[1, t // 2, 3] = 37.0  # the largest input, mid-sequence
  return jnp.asarray(x)


def test_a_cell_over_time_has_one_state_whatever_the_length():
  shapes = {}
  for t in (8, 64):
    loss, params = _setup(Scanned(), _sequence(t))
    state = jmp_lite.fp8.init(loss, params, _sequence(t))
    shapes[t] = {k: v.lhs.scale.shape for k, v in state.sites.items()}
  assert shapes[8] == shapes[64] == {"cell/i": (), "cell/h": ()}
  # A state made on short sequences runs on long ones.
  loss, params = _setup(Scanned(), _sequence(8))
  state = jmp_lite.fp8.init(loss, params, _sequence(8))
  jmp_lite.value_and_grad(loss)(params, _sequence(64), loss_scale=ONE, fp8=state)


@pytest.mark.slow  # unrolls the loop by hand for the oracle (about 25 s): the heavy tier
def test_the_loops_maxima_are_the_largest_of_the_unrolled_calls():
  t = 6
  x = _sequence(t)
  loss, params = _setup(Scanned(), x)
  state = jmp_lite.fp8.init(loss, params, x)
  *_, scanned = jmp_lite.value_and_grad(loss)(params, x, loss_scale=ONE, fp8=state)
  unrolled_loss, unrolled_params = _setup(Unrolled(), x)
  assert jax.tree.map(jnp.shape, unrolled_params) == jax.tree.map(jnp.shape, params)
  state = jmp_lite.fp8.init(unrolled_loss, params, x)
  assert len(state.sites) == 2 * t  # cell/i, cell/h, cell/i#2, ...
  *_, unrolled = jmp_lite.value_and_grad(unrolled_loss)(params, x, loss_scale=ONE, fp8=state)
  for name in ("cell/i", "cell/h"):
    calls = [m for k, m in unrolled.sites.items() if k.split("#")[0] == name]
    for role in ("lhs", "rhs", "grad"):
      want = max(float(getattr(m, role).amax_history[0]) for m in calls)
      got = float(getattr(scanned.sites[name], role).amax_history[0])
      assert got == want, (name, role, got, want)
  assert float(scanned.sites["cell/i"].lhs.amax_history[0]) == 37.0


class Layer(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return jnp.tanh(nn.Dense(8, name="dense")(h)), None


class Stack(nn.Module):
  """Three layers, each with its own weights (stacked on axis 0)."""

  @nn.compact
  def __call__(self, x):
    layers = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True},
                     length=3)(name="layers")
    return layers(x, None)[0]


class RecurrentLayer(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return Scanned(name="rnn")(x)[..., :8], None


class RecurrentStack(nn.Module):
  """Two recurrent layers scanned over depth, each its cell scanned over time."""

  @nn.compact
  def __call__(self, x):
    layers = nn.scan(RecurrentLayer, variable_axes={"params": 0},
                     split_rngs={"params": True}, length=2)(name="layers")
    return layers(x, None)[0]


def test_a_scanned_stack_keeps_a_state_per_layer():
  x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)), jnp.float32)
  loss, params = _setup(Stack(), x)
  state = jmp_lite.fp8.init(loss, params, x)
  assert {k: v.lhs.scale.shape for k, v in state.sites.items()} == {"layers/dense": (3,)}
  *_, new = jmp_lite.value_and_grad(loss)(params, x, loss_scale=ONE, fp8=state)
  kernels = np.asarray(params["layers"]["dense"]["kernel"], np.float32)
  want = [np.abs(k.astype(jnp.bfloat16).astype(np.float32)).max() for k in kernels]
  np.testing.assert_array_equal(new.sites["layers/dense"].rhs.amax_history[:, 0], want)


class CrossLayer(nn.Module):
  """A decoder layer: ``kv`` reads the encoder's output, the same in every
  layer (``nn.broadcast``); ``q`` the carried state."""

  @nn.compact
  def __call__(self, h, memory):
    kv = nn.Dense(8, name="kv")(memory)
    return h + jnp.tanh(nn.Dense(8, name="q")(h)) * jnp.tanh(kv), None


class CrossStack(nn.Module):
  @nn.compact
  def __call__(self, x, memory):
    layers = nn.scan(CrossLayer, variable_axes={"params": 0}, split_rngs={"params": True},
                     in_axes=nn.broadcast, length=3)(name="layers")
    return layers(x, memory)[0]


def test_a_stacked_weight_on_a_loop_invariant_input_keeps_a_state_per_layer():
  """The weight is the layer's, the other operand the same in every layer: by
  origins alone that is a cell over time with the roles swapped, and the
  three layers shared one scale (the widest layer's), where Flax's own fp8
  and the unrolled model keep one each. Oracle: each layer's kernel maximum,
  by NumPy, in the history; and the inference forward runs on the state."""
  rng = np.random.default_rng(0)
  x, memory = (jnp.asarray(rng.standard_normal((4, 8)), jnp.float32) for _ in range(2))
  model = jmp_lite.flax.wrap(CrossStack(), BF16, rules=FP8)
  params = model.init(jax.random.key(0), x, memory)["params"]
  spread = jnp.array([1.0, 30.0, 3000.0])[:, None, None]
  params["layers"]["kv"]["kernel"] = params["layers"]["kv"]["kernel"] * spread
  loss = lambda p, x, m: jnp.mean(model.apply({"params": p}, x, m) ** 2)
  state = jmp_lite.fp8.init(loss, params, x, memory)
  assert {k: v.rhs.scale.shape for k, v in state.sites.items()} == {
      "layers/kv": (3,), "layers/q": (3,)}
  *_, new = jmp_lite.value_and_grad(loss)(params, x, memory, loss_scale=ONE, fp8=state)
  kernels = np.asarray(params["layers"]["kv"]["kernel"], np.float32)
  want = [np.abs(k.astype(jnp.bfloat16).astype(np.float32)).max() for k in kernels]
  np.testing.assert_array_equal(new.sites["layers/kv"].rhs.amax_history[:, 0], want)
  out = model.apply({"params": params}, x, memory, fp8=new)
  assert out.shape == x.shape and bool(jnp.all(jnp.isfinite(out)))


def test_layers_over_depth_each_with_a_loop_over_time():
  for t in (5, 9):
    x = _sequence(t)
    loss, params = _setup(RecurrentStack(), x)
    state = jmp_lite.fp8.init(loss, params, x)
    assert {k: v.lhs.scale.shape for k, v in state.sites.items()} == {
        "layers/rnn/cell/i": (2,), "layers/rnn/cell/h": (2,)}


def test_a_fori_loop_over_a_weight_stack_keeps_a_state_per_layer():
  """``fori_loop`` reading ``ws[i]`` is a stack of layers too (the counter
  is carried, the stack closed over); one reading ``xs[i]`` against closed
  over weights is a loop over time. Oracle: the rhs maxima of ``lax.scan``
  over the same stack, layer by layer."""
  ws = jnp.stack([jnp.eye(8) * s for s in (2.0, 20.0, 200.0)])
  x = jnp.full((4, 8), 0.5)
  xs = jnp.ones((5, 4, 8))

  def run(ws, x, how):
    with jax.named_scope("mlp"):
      if how == "fori":
        return jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ ws[i]), x)
      if how == "scan":
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]
      return jax.lax.fori_loop(0, 5, lambda i, h: jnp.tanh(xs[i] @ ws[0] + h @ ws[1]), x)

  got = {}
  for how in ("fori", "scan", "time"):
    loss = lambda ws, x: jnp.sum(run(ws, x, how))
    state = jmp_lite.fp8.init(loss, ws, x, select="mlp.*")
    got[how] = {k: v.lhs.scale.shape for k, v in state.sites.items()}
    if how != "time":
      new = jmp_lite.value_and_grad(loss)(ws, x, loss_scale=ONE, fp8=state)[-1]
      got[how + " rhs"] = new.sites["mlp"].rhs.amax_history[:, 0].tolist()
  assert got["fori"] == got["scan"] == {"mlp": (3,)}
  assert got["fori rhs"] == got["scan rhs"] == [2.0, 20.0, 200.0]
  assert got["time"] == {"mlp": (), "mlp#2": ()}


def test_a_cell_over_time_fed_by_an_embedding_lookup_has_one_state():
  """``emb[tokens]`` is a lookup of a parameter, not the parameter: counted
  as one, the sequence scanned over time was taken for a stack of layers,
  and the state had a row per time step (its shape the sequence's length).
  Oracle: the README's rule, a cell over time keeps one state."""
  def loss(params, tokens):
    x = params["emb"][tokens]
    def cell(h, xt):
      with jax.named_scope("cell"):
        h = jnp.tanh(xt @ params["wx"] + h @ params["wh"])
      return h, h
    return jnp.mean(jax.lax.scan(cell, jnp.zeros((tokens.shape[1], 8)), x)[0] ** 2)
  params = {"emb": jnp.ones((50, 8)) * 0.1, "wx": jnp.eye(8), "wh": jnp.eye(8) * 0.5}
  shapes = {}
  for t in (5, 9):
    state = jmp_lite.fp8.init(loss, params, jnp.zeros((t, 2), jnp.int32), select="cell")
    shapes[t] = {k: v.rhs.scale.shape for k, v in state.sites.items()}
  assert shapes[5] == shapes[9] == {"cell": (), "cell#2": ()}
  jmp_lite.fp8.forward(loss, state)(params, jnp.zeros((5, 2), jnp.int32))


def test_inference_runs_the_rows_training_made_with_frozen_weights():
  """Training knows its parameters by ``argnums``: frozen ``kv`` weights given
  as another argument are not among them, and their site got one state.
  Inference on all the variables took them for a stack of layers and
  refused the state; it now runs each site as the state was trained.
  Oracle: the forward of the trained function, arguments as in training."""
  rng = np.random.default_rng(0)
  x, memory = (jnp.asarray(rng.standard_normal((4, 8)), jnp.float32) for _ in range(2))
  model = jmp_lite.flax.wrap(CrossStack(), BF16, rules=FP8)
  params = model.init(jax.random.key(0), x, memory)["params"]
  frozen = {"layers": {"kv": params["layers"]["kv"]}}
  train = {"layers": {"q": params["layers"]["q"]}}

  def loss(train, frozen, x, m):
    p = {"layers": {**train["layers"], **frozen["layers"]}}
    return jnp.mean(model.apply({"params": p}, x, m) ** 2)

  state = jmp_lite.fp8.init(loss, train, frozen, x, memory)
  assert {k: v.rhs.scale.shape for k, v in state.sites.items()} == {
      "layers/kv": (), "layers/q": (3,)}
  *_, state = jmp_lite.value_and_grad(loss)(train, frozen, x, memory, loss_scale=ONE, fp8=state)
  out = model.apply({"params": params}, x, memory, fp8=state)
  # The forward of the trained function, its arguments as in training.
  want = jmp_lite.fp8.forward(lambda t, f, x, m: model.apply(
      {"params": {"layers": {**t["layers"], **f["layers"]}}}, x, m), state)(train, frozen, x, memory)
  np.testing.assert_array_equal(out, want)


def test_an_nnx_stack_on_a_loop_invariant_input_keeps_a_state_per_layer():
  """NNX marks each parameter as it is read (an identity call): the mark hid
  that the scanned operand was a parameter stack, and the layers' ``kv``
  shared one state. Oracle: each layer's kernel maximum, by NumPy."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  class NnxLayer(nnx.Module):
    def __init__(self, rngs):
      self.q = nnx.Linear(8, 8, rngs=rngs)
      self.kv = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, h, memory):
      return h + jnp.tanh(self.q(h)) * jnp.tanh(self.kv(memory))

  class NnxStack(nnx.Module):
    def __init__(self, rngs):
      @nnx.split_rngs(splits=3)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make(rngs):
        return NnxLayer(rngs)
      self.layers = make(rngs)

    def __call__(self, x, memory):
      @nnx.scan(in_axes=(nnx.Carry, 0, None), out_axes=nnx.Carry)
      def step(h, layer, memory):
        return layer(h, memory)
      return step(x, self.layers, memory)

  rng = np.random.default_rng(0)
  x, memory = (jnp.asarray(rng.standard_normal((4, 8)), jnp.float32) for _ in range(2))
  model = jmp_lite.flax.wrap(NnxStack(nnx.Rngs(0)), BF16, rules={nnx.Linear: BF16 + ",fp8=hybrid"})
  graphdef, state = nnx.split(model)
  loss = lambda s, x, m: jnp.mean(nnx.merge(graphdef, s)(x, m) ** 2)
  fp8 = jmp_lite.fp8.init(loss, state, x, memory)
  assert {k: v.rhs.scale.shape for k, v in fp8.sites.items()} == {
      "layers/q": (3,), "layers/kv": (3,)}
  *_, fp8 = jmp_lite.value_and_grad(loss)(state, x, memory, loss_scale=ONE, fp8=fp8)
  kernels, = [np.asarray(v, np.float32) for k, v in jax.tree_util.tree_leaves_with_path(state)
              if "['layers']['kv']['kernel']" in jax.tree_util.keystr(k)]
  want = [np.abs(k.astype(jnp.bfloat16).astype(np.float32)).max() for k in kernels]
  assert len(set(want)) == 3  # the layers' own maxima, not the widest one's
  np.testing.assert_array_equal(fp8.sites["layers/kv"].rhs.amax_history[:, 0], want)
  assert model(x, memory, fp8=fp8).shape == x.shape
