"""The shape of the package: one engine below the public API, no cycles.

Oracle: the source tree itself, read with Python's `ast` (every import,
including those inside functions, since an import deferred to call time is
still a dependency and a deferred cycle still a cycle).

* Everything that reads or rewrites a jaxpr lives in `jmp_lite._jaxpr`, and
  nothing there imports a public module (or anything that imports one).
* No module imports another that imports it back, directly or not.
* JAX internals (``jax._src``) and Flax's and Python's private API are used
  only in `jmp_lite/_jaxpr/internals/`.
* The engine's modules are of one idea each: at most ~400 lines.
"""

import ast
import pathlib
import re

import pytest

import jmp_lite

PACKAGE = pathlib.Path(jmp_lite.__file__).parent
ENGINE = "jmp_lite._jaxpr"
INTERNALS = "jmp_lite._jaxpr.internals"


def _modules() -> dict[str, pathlib.Path]:
  found = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    found[".".join(parts)] = path
  return found


MODULES = _modules()


def _imports(name: str) -> set[str]:
  """The jmp_lite modules ``name`` imports, anywhere in its source."""
  path = MODULES[name]
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
      # ``from a import b``: the module a.b if there is one, else a.
      found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                for a in node.names}
  return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name) for name in MODULES}


def _public(name: str) -> bool:
  return name == "jmp_lite" or not any(
      part.startswith("_") for part in name.split(".")[1:])


def _reach(name: str) -> set[str]:
  seen, todo = set(), [name]
  while todo:
    for dep in GRAPH[todo.pop()]:
      if dep not in seen:
        seen.add(dep)
        todo.append(dep)
  return seen


def _cycles() -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(GRAPH[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(GRAPH):
    if v not in index:
      visit(v)
  return out


def test_the_reader_sees_the_imports():
  # The graph the other tests read is the real one, not an empty one.
  assert f"{ENGINE}.traverse" in GRAPH["jmp_lite.calibration"] | _reach(
      "jmp_lite.calibration")
  assert f"{ENGINE}.passes.engine" in GRAPH["jmp_lite._linen"]
  assert INTERNALS in GRAPH[f"{ENGINE}.passes.plan"]
  assert not _public("jmp_lite._dtypes")
  assert _public("jmp_lite.flax") and _public("jmp_lite")


def test_no_import_cycles():
  assert _cycles() == []


def test_the_cycle_finder_finds_a_cycle():
  GRAPH["jmp_lite.policy"].add("jmp_lite.training")
  try:
    assert any("jmp_lite.policy" in c and "jmp_lite.training" in c
               for c in _cycles())
  finally:
    GRAPH["jmp_lite.policy"].discard("jmp_lite.training")


ENGINE_MODULES = sorted(m for m in MODULES if m.startswith(ENGINE))


@pytest.mark.parametrize("name", ENGINE_MODULES)
def test_the_engine_imports_no_public_module(name):
  above = sorted(m for m in _reach(name) if _public(m))
  assert not above, f"{name} imports (through its imports) {above}"


def test_every_jaxpr_reader_is_in_the_engine():
  # A module that interprets or rewrites jaxprs outside the engine would be a
  # second traversal: only the engine touches equations' params and bodies.
  readers = re.compile(r"\.eqns\b|\beqn\.params\b|\.jaxpr\.jaxpr\b")
  outside = [name for name, path in MODULES.items()
             if not name.startswith(ENGINE) and readers.search(path.read_text())]
  assert outside == []


@pytest.mark.parametrize("name", ENGINE_MODULES)
def test_engine_modules_are_of_one_idea(name):
  lines = MODULES[name].read_text().count("\n")
  assert lines <= 420, f"{name}: {lines} lines"


# Flax's and Python's private API, as the source spells a use of it.
_PRIVATE = re.compile(
    r"\._variables\b|_deep_clone|sys\._getframe|\"__class__\"")


def test_private_api_only_in_internals():
  offenders = []
  for name, path in MODULES.items():
    if name.startswith(INTERNALS):
      continue
    source = path.read_text()
    offenders += [f"{name}: {m.group()}" for m in _PRIVATE.finditer(source)]
    for node in ast.walk(ast.parse(source)):
      names = []
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        names = [node.module or ""]
      offenders += [f"{name}: {n}" for n in names
                    if n == "jax._src" or n.startswith("jax._src.")]
  assert offenders == []


def test_internals_hold_what_the_check_looks_for():
  # The patterns above match the uses that are there: the check can fail.
  source = "".join(MODULES[m].read_text() for m in MODULES
                   if m.startswith(INTERNALS))
  found = {m.group() for m in _PRIVATE.finditer(source)}
  assert found == {"._variables", "_deep_clone", "sys._getframe", '"__class__"'}
  assert "jax._src" in source


def test_a_built_distribution_holds_every_subpackage():
  # `pip install .` (not editable) builds a wheel from this configuration: a
  # subpackage it does not match would be missing from it.
  import fnmatch  # pylint: disable=g-import-not-at-top
  tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
  config = tomllib.loads(
      (PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
  patterns = config["packages"]["find"]["include"]
  packages = {name for name, path in MODULES.items()
              if path.name == "__init__.py"}
  assert {"jmp_lite", ENGINE, INTERNALS, f"{ENGINE}.passes"} <= packages
  missed = sorted(p for p in packages
                  if not any(fnmatch.fnmatchcase(p, pat) for pat in patterns))
  assert missed == []
  # Every folder of modules is a package (a namespace folder would be left out).
  folders = {p.parent for p in PACKAGE.rglob("*.py")}
  assert all((f / "__init__.py").exists() for f in folders)
