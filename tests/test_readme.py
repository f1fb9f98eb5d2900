"""The README's Python examples run, in order, in one namespace.

They run under JAX's default (standard) dtype promotion, as users run them.
"""

import pathlib
import re

import jax

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run(capsys):
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
  assert len(blocks) >= 8
  namespace = {}
  with jax.numpy_dtype_promotion("standard"):
    for i, block in enumerate(blocks):
      try:
        exec(compile(block, f"README.md[python block {i}]", "exec"), namespace)
      except Exception as e:
        raise AssertionError(f"README python block {i} failed:\n{block}") from e
