"""Path rules that match nothing are reported; `policy_map` sees through
`flax.nnx.bridge.ToNNX`.

Oracles: the module paths Flax itself gives (the variables' layout, NNX's
graph), and `policy_map` of the same Linen model wrapped on its own.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from flax.nnx import bridge

import jmp_lite.flax as jflax
from jaxprs import equations

POLICY = "p=f32,c=bf16,o=f32"


class Block(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.Dropout(0.1, deterministic=True)(x)
    return nn.Dense(4, name="attention")(x)


class Model(nn.Module):

  def setup(self):
    self.layers_0 = Block()
    self.head = nn.Dense(2)

  def __call__(self, x):
    return self.head(self.layers_0(x))

  def encode(self, x):
    return self.layers_0(x)


def _unmatched(record):
  return [w for w in record if issubclass(w.category, jflax.UnmatchedRuleWarning)]


def test_misspelt_linen_path_rule_warns_with_closest_path():
  model = jflax.wrap(Model(), POLICY, rules={"layer_0/attention": "f32"})
  with pytest.warns(jflax.UnmatchedRuleWarning, match=r"'layer_0/attention'.*Closest paths: 'layers_0/attention'"):
    model.init(jax.random.key(0), jnp.ones((1, 3)))


def test_policy_map_reports_a_misspelt_linen_rule():
  model = jflax.wrap(Model(), POLICY, rules={"dense_1": "f32"})
  with pytest.warns(jflax.UnmatchedRuleWarning, match="'dense_1'"):
    jflax.policy_map(model, jnp.ones((1, 3)))


def test_warning_names_the_callers_line():
  model = jflax.wrap(Model(), POLICY, rules={"nowhere": "f32"})
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    model.init(jax.random.key(0), jnp.ones((1, 3)))
  (warning,) = _unmatched(record)
  assert warning.filename == __file__


def test_rules_that_match_do_not_warn():
  # A module with no variables (Dropout) matches by being called; one that a
  # method does not call (the head, under `encode`) by its variables.
  rules = {"layers_0/attention": "f32", "layers_0/Dropout_0": "f32",
           "head": "f32", "layers_.*": "f32"}
  model = jflax.wrap(Model(), POLICY, rules=rules)
  with warnings.catch_warnings():
    warnings.simplefilter("error", jflax.UnmatchedRuleWarning)
    variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
    model.apply(variables, jnp.ones((1, 3)), method="encode")
  assert set(jflax.policy_map(model, jnp.ones((1, 3)))) >= {
      "layers_0/attention", "layers_0/Dropout_0", "head"}


def test_apply_of_a_part_still_reports_a_misspelt_rule():
  model = jflax.wrap(Model(), POLICY, rules={"hed": "f32"})
  with pytest.warns(jflax.UnmatchedRuleWarning):
    variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
  with pytest.warns(jflax.UnmatchedRuleWarning, match="Closest paths: 'head'"):
    model.apply(variables, jnp.ones((1, 3)), method="encode")


class Encoder(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(4, name="inner")(x)
    return nn.Dense(3)(nn.LayerNorm()(x))


class Hybrid(nnx.Module):

  def __init__(self, rngs, init=True):
    self.enc = bridge.ToNNX(Encoder(), rngs=rngs)
    if init:
      bridge.lazy_init(self.enc, jnp.ones((1, 5)))
    self.head = nnx.Linear(3, 2, rngs=rngs)

  def __call__(self, x):
    return self.head(self.enc(x))


def test_misspelt_nnx_path_rule_warns_at_wrap():
  with pytest.warns(jflax.UnmatchedRuleWarning, match="Closest paths: 'head'"):
    jflax.wrap(Hybrid(nnx.Rngs(0)), POLICY, rules={"hed": "f32"})


def test_nnx_rules_into_linen_modules_of_a_bridge_match():
  with warnings.catch_warnings():
    warnings.simplefilter("error", jflax.UnmatchedRuleWarning)
    jflax.wrap(Hybrid(nnx.Rngs(0)), POLICY,
               rules={"enc/inner": "f32", "enc/LayerNorm_0": "f32", "head": "f32"})
  with pytest.warns(jflax.UnmatchedRuleWarning, match="'enc/iner'"):
    jflax.wrap(Hybrid(nnx.Rngs(0)), POLICY, rules={"enc/iner": "f32"})


def test_uninitialised_bridge_is_not_judged():
  # Its Linen modules are unknown until it runs: no warning, right or wrong.
  with warnings.catch_warnings():
    warnings.simplefilter("error", jflax.UnmatchedRuleWarning)
    jflax.wrap(Hybrid(nnx.Rngs(0), init=False), POLICY, rules={"enc/zzz": "f32"})


def test_nnx_policy_map_lists_linen_modules_inside_a_bridge():
  x = jnp.ones((1, 5))
  rules = {"enc/inner": "f32"}
  wrapped = jflax.wrap(Hybrid(nnx.Rngs(0)), POLICY, rules=rules)
  listed = jflax.policy_map(wrapped, x)
  # The oracle: the Linen model wrapped on its own, its rule without the
  # bridge's path.
  alone = jflax.policy_map(jflax.wrap(Encoder(), POLICY, rules={"inner": "f32"}), x)
  assert {k: v for k, v in listed.items() if k.startswith("enc/")} == {
      f"enc/{k}": v for k, v in alone.items() if k}
  assert list(listed) == ["enc", "enc/inner", "enc/LayerNorm_0", "enc/Dense_0",
                          "head", ""]
  assert str(listed["enc/LayerNorm_0"]) == "p=f32,c=f32,o=f32"  # default rule
  # Without inputs, the bridge is one row, as before.
  assert list(jflax.policy_map(wrapped)) == ["enc", "head", ""]


class _Inner(nn.Module):
  @nn.compact
  def __call__(self, h):
    return nn.Dense(8, name="d")(h)


class _Lifted(nn.Module):
  """A Dense reached through a Linen transform of a function, which gives the
  modules the function makes a scope of their own."""
  kind: str

  @nn.compact
  def __call__(self, x):
    if self.kind == "cond":
      return nn.cond(True, lambda m, h: _Inner(name="t")(h),
                     lambda m, h: -_Inner(name="t")(h), self, x)
    if self.kind == "switch":
      return nn.switch(1, [lambda m, h: _Inner(name="t")(h),
                           lambda m, h: -_Inner(name="t")(h)], self, x)
    if self.kind == "while_loop":
      def body(m, c):
        return c[0] + 1, _Inner(name="t")(c[1])
      if self.is_initializing():  # a loop cannot create parameters
        return body(self, (0, x))[1]
      return nn.while_loop(lambda m, c: c[0] < 2, body, self, (0, x),
                           broadcast_variables="params")[1]
    if self.kind == "scan_layers":
      def layer(m, h, _):
        return _Inner(name="t")(h), None
      return nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True},
                     length=3)(self, x, None)[0]
    return _Lifted("scan_layers", name="sub")(x)  # the same, one level down


@pytest.mark.parametrize("kind", ["cond", "switch", "while_loop", "scan_layers", "nested"])
def test_a_rule_reaches_a_module_a_lifted_function_makes(kind):
  """The copy of the calling module that a lifted function is given was named
  as its own child (``module/t/d``, the wrapper's field name): a rule for
  the Dense's parameter path was silently ignored while ``policy_map`` said
  it applied, and its matmul ran in bf16. Oracle: Flax's parameter paths,
  and the dtypes of the matmuls in the jaxpr."""
  x = jnp.ones((2, 8))
  params = _Lifted(kind).init(jax.random.key(0), x)["params"]
  path = "/".join(str(k.key) for k in jax.tree_util.tree_leaves_with_path(params)[0][0][:-1])
  assert path == ("sub/t/d" if kind == "nested" else "t/d")
  with warnings.catch_warnings():
    warnings.simplefilter("error", jflax.UnmatchedRuleWarning)
    model = jflax.wrap(_Lifted(kind), "p=f32,c=bf16,o=f32", rules={path: "p=f32,c=f32,o=f32"})
    assert str(jflax.policy_map(model, x)[path]) == "p=f32,c=f32,o=f32"
    closed = jax.make_jaxpr(lambda p: model.apply({"params": p}, x))(params)
  dots = [e for e in equations(closed.jaxpr) if "dot" in e.primitive.name]
  assert dots and {str(v.aval.dtype) for e in dots for v in e.invars} == {"float32"}


class _Recurrent(nn.Module):
  """``nn.RNN`` over a cell made here, as Flax's docs write it: the cell's
  variables are this module's child (``SimpleCell_0``), and ``nn.RNN``
  scans it in a lifted scope of its own."""
  cell: str

  @nn.compact
  def __call__(self, x):
    cell = (nn.SimpleCell(8) if self.cell == "simple" else nn.LSTMCell(8))
    return nn.Dense(2)(nn.RNN(cell)(x)[:, -1])


@pytest.mark.parametrize("cell", ["simple", "lstm"])
def test_a_rule_for_an_rnn_cells_parameter_path_reaches_its_matmuls(cell):
  """The cell was named by the call stack (``RNN_0/SimpleCell_0``), not where
  its variables are: a rule for its parameter path matched nothing, said
  nothing (the variables' path exists) and left its matmuls in bf16. Oracle:
  Flax's parameter paths and the matmuls' dtypes in the jaxpr."""
  x = jnp.ones((2, 5, 4))
  params = _Recurrent(cell).init(jax.random.key(0), x)["params"]
  name = "SimpleCell_0" if cell == "simple" else "LSTMCell_0"
  assert set(params) == {name, "Dense_0"}
  with warnings.catch_warnings():
    warnings.simplefilter("error", jflax.UnmatchedRuleWarning)
    model = jflax.wrap(_Recurrent(cell), "p=f32,c=bf16,o=f32",
                       rules={f"{name}(/.*)?": "p=f32,c=f32,o=f32"})
    listed = jflax.policy_map(model, x)
    closed = jax.make_jaxpr(lambda p: model.apply({"params": p}, x))(params)
  inner = {f"{name}/{k}" for k in params[name]}
  assert inner <= set(listed)
  assert all(str(listed[p]) == "p=f32,c=f32,o=f32" for p in inner)
  dots = [e for e in equations(closed.jaxpr) if "dot" in e.primitive.name]
  kinds = sorted(tuple(str(v.aval.dtype) for v in e.invars) for e in dots)
  # The cell's matmuls (inside the scan) in float32, the head's in bf16.
  assert kinds.count(("bfloat16", "bfloat16")) == 1
  assert kinds.count(("float32", "float32")) == len(dots) - 1 >= 2


def test_policy_map_of_an_rnn_lists_no_module_where_no_variables_are():
  """Flax checks the cell's ``setup`` abstractly (``_validate_setup``, a
  clone bound to a ``TestScope``); the wrapper named that call
  ``RNN_0/SimpleCell_0``, so ``policy_map`` listed a module with no
  variables there and a rule for it reached nothing without a warning.
  Oracle: Flax's parameter paths."""
  x = jnp.ones((2, 5, 4))
  params = _Recurrent("simple").init(jax.random.key(0), x)["params"]
  model = jflax.wrap(_Recurrent("simple"), "p=f32,c=bf16,o=f32")
  listed = set(jflax.policy_map(model, x))
  # Every module holding variables, and those above them.
  modules = {"/".join(str(k.key) for k in path[:i])
             for path, _ in jax.tree_util.tree_leaves_with_path(params)
             for i in range(1, len(path))}
  assert listed == modules | {"", "RNN_0"}
  with pytest.warns(jflax.UnmatchedRuleWarning, match="RNN_0/SimpleCell_0"):
    jflax.wrap(_Recurrent("simple"), "p=f32,c=bf16,o=f32",
               rules={"RNN_0/SimpleCell_0": "f32"}).init(jax.random.key(0), x)


class _Head(nn.Module):
  @nn.compact
  def __call__(self, h):
    return nn.Dense(3)(h)


class _AppliedHead(nn.Module):
  """A module applied on its own inside the model (a tied head's pattern):
  its scope's root has path (), its modules' paths are relative to it."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(5)(x)
    hp = self.param("head_params", lambda k: _Head().init(k, jnp.ones((1, 5)))["params"])
    return _Head(parent=None).apply({"params": hp}, h)


def test_a_module_applied_on_its_own_keeps_its_callers_prefix():
  """The lifted-scope naming (an RNN cell by its variables' path) took the
  head's Dense for the model's own ``Dense_0``, merging their rows, and a
  rule for ``_Head_0/Dense_0`` warned that it matched nothing (found in
  review). Oracle: the path the call stack gives, as before."""
  x = jnp.ones((2, 4))
  with warnings.catch_warnings():
    warnings.simplefilter("error", jflax.UnmatchedRuleWarning)
    model = jflax.wrap(_AppliedHead(), "p=f32,c=bf16,o=f32",
                       rules={"_Head_0/Dense_0": "p=f32,c=f32,o=f32"})
    listed = jflax.policy_map(model, x)
  assert set(listed) == {"", "Dense_0", "_Head_0", "_Head_0/Dense_0"}
  assert str(listed["_Head_0/Dense_0"]) == "p=f32,c=f32,o=f32"
  assert str(listed["Dense_0"]) == "p=f32,c=bf16,o=f32"
