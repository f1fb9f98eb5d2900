"""The examples run end to end (few steps), in a fresh process each."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(script, tmp_path, *flags):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run(
      [sys.executable, str(ROOT / "examples" / script), "--no-progress",
       "--out-dir", str(tmp_path), *flags],
      capture_output=True, text=True, env=env, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads((tmp_path / "summary.json").read_text()), out.stdout


def test_train_digits(tmp_path):
  summary, stdout = _run("train_digits.py", tmp_path, "--steps", "40",
                         "--policies", "f32,f16,pure_f16,pure_bf16_kahan")
  results = summary["results"]
  assert set(results) == {"f32", "f16", "pure_f16", "pure_bf16_kahan"}
  assert results["f16"]["policy"] == "p=f32,c=f16,o=f32"
  # float16 parameters with plain Adam: with_loss_scale keeps Adam in float32,
  # so nothing is NaN and steps are not all skipped.
  assert results["pure_f16"]["policy"] == "p=f16,c=f16,o=f32"
  assert results["pure_f16"]["skipped_steps"] < 10
  for r in results.values():
    assert 0.5 < r["test_accuracy"] <= 1.0  # 40 steps already learn something
  # Pure bf16 stores params in half the bytes (LayerNorm's stay in f32).
  ratio = results["pure_bf16_kahan"]["param_bytes"] / results["f32"]["param_bytes"]
  assert 0.5 < ratio < 0.501
  assert (tmp_path / "digits.png").stat().st_size > 10_000
  assert "test acc" in stdout


def test_train_char_lm(tmp_path):
  summary, _ = _run("train_char_lm.py", tmp_path, "--steps", "30", "--policies",
                    "f32,bf16", "--corpus-bytes", "200000", "--val-batches", "2")
  for r in summary["results"].values():
    assert r["val_loss"] < 5.0 and r["tokens_per_second"] > 0


def test_autocast_plain_jax(tmp_path):
  summary, stdout = _run("autocast_plain_jax.py", tmp_path, "--steps", "30")
  assert "with f32 accumulation, 0 flagged" in stdout
  assert set(summary["results"]) == {"float32", "autocast"}


@pytest.mark.parametrize("script", ["train_digits.py", "train_char_lm.py",
                                    "autocast_plain_jax.py"])
def test_help(script):
  out = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--help"],
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0 and "--steps" in out.stdout and "--seed" in out.stdout
