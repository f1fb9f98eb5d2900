"""The README's Python examples run as a reader would run them.

Each block runs on its own, in a fresh namespace, unless its first line says
``# Continues the block above.``: then it runs in that block's namespace. So a
reader can copy any block that does not say so into a fresh interpreter.
They run under JAX's default (standard) dtype promotion, as users run them.
"""

import pathlib
import re

import jax

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
CONTINUES = "# Continues the block above."


def _blocks():
  return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_python_blocks_run(capsys):
  blocks = _blocks()
  assert len(blocks) >= 8
  namespace = {}
  with jax.numpy_dtype_promotion("standard"):
    for i, block in enumerate(blocks):
      if not block.startswith(CONTINUES):
        namespace = {}
      try:
        exec(compile(block, f"README.md[python block {i}]", "exec"), namespace)
      except Exception as e:
        raise AssertionError(f"README python block {i} failed:\n{block}") from e


def test_the_first_block_stands_alone():
  assert not _blocks()[0].startswith(CONTINUES)


def test_the_generated_tables_match_the_results_they_come_from():
  """The README's generated blocks are what docs/readme_tables.py renders from
  the committed results (docs/results/), so a figure cannot drift from its run."""
  import importlib.util

  path = README.parent / "docs" / "readme_tables.py"
  spec = importlib.util.spec_from_file_location("readme_tables", path)
  tables = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tables)
  text = README.read_text()
  assert tables.render(text) == text, "run: python docs/readme_tables.py --write"
  assert text.count(tables.END) == len(tables.TABLES)


def test_every_bench_target_row_finds_a_run():
  """Each row of the CPU bench table matches a target in some results file: a
  target renamed in the bench, or a pattern that rotted, would leave a row of
  dashes rather than fail."""
  import importlib.util
  import json

  path = README.parent / "docs" / "bench_table.py"
  spec = importlib.util.spec_from_file_location("bench_table", path)
  table = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(table)
  runs = table.by_class(*(json.loads((README.parent / "bench" / "results" / f"{n}.json")
                                      .read_text()) for n in table.FILES))
  for what, parts in table.ROWS:
    for label, pattern in parts:
      assert any(table._cell(r, pattern) for r in runs.values()), (what, label)


def test_each_committed_run_was_estimated_within_one_and_a_half_times():
  """The examples print an estimate before they train; each run committed
  under docs/results/ holds it and the seconds the run then took (from the
  notice to the summary). On a machine no busier than its cores the two
  agree within 1.5× either way, as the README promises."""
  import json
  import re as re_lib

  results = sorted((README.parent / "docs" / "results").glob("*.json"))
  assert results
  for path in results:
    summary = json.loads(path.read_text())
    assert "measured_seconds" in summary, f"{path.name}: rerun it (no measured_seconds)"
    cores = int(re_lib.search(r"(\d+) cores", summary["hardware"]).group(1))
    assert summary["load_average_start"][0] <= cores, (
        f"{path.name}: run on a busy machine (load "
        f"{summary['load_average_start'][0]} on {cores} cores)")
    estimate = summary.get("estimated_seconds_in_all", summary["estimated_seconds"])
    ratio = estimate / summary["measured_seconds"]
    assert 1 / 1.5 <= ratio <= 1.5, (
        f"{path.name}: estimated {estimate} s, took {summary['measured_seconds']} s")
