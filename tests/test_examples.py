"""examples/char_lm.py: a smoke run of a few steps with every optimizer."""

import importlib.util
import math
from pathlib import Path

import pytest

pytest.importorskip("flax.nnx")

ROOT = Path(__file__).resolve().parents[1]


def test_char_lm_smoke(capsys):
  spec = importlib.util.spec_from_file_location("char_lm", ROOT / "examples" / "char_lm.py")
  char_lm = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(char_lm)
  text = char_lm.corpus(50)
  assert text == char_lm.corpus(50) and text.count(".") == 50  # generated, deterministic
  results = char_lm.main(["--steps", "3", "--d", "16", "--layers", "1", "--heads", "2", "--seq", "8",
                          "--batch", "2", "--no-plot"])
  assert list(results) == ["optax AdamW", "fuseopt AdamW (bf16, fused)", "optax Muon", "fuseopt builder hybrid"]
  first = {name: losses[0] for name, (losses, _) in results.items()}
  assert len(set(first.values())) == 1  # same initial model and batch for every optimizer
  for losses, ms in results.values():
    assert len(losses) == 3 and all(math.isfinite(l) for l in losses) and min(ms) > 0
  assert "ms/step" in capsys.readouterr().out


def test_char_lm_bf16_params_smoke():
  spec = importlib.util.spec_from_file_location("char_lm", ROOT / "examples" / "char_lm.py")
  char_lm = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(char_lm)
  results = char_lm.main(["--steps", "3", "--d", "16", "--layers", "1", "--heads", "2", "--seq", "8",
                          "--batch", "2", "--no-plot", "--bf16-params"])
  assert list(results) == ["fp32 params", "bf16, round to nearest (optax)",
                           "bf16, stochastic rounding", "bf16 + mantissa companion"]
  for losses, _ in results.values():
    assert len(losses) == 3 and all(math.isfinite(l) for l in losses)
  # The first loss is the model's before any update: bf16 runs share theirs.
  bf16 = [losses[0] for name, (losses, _) in results.items() if name != "fp32 params"]
  assert len(set(bf16)) == 1


def test_char_lm_moments_smoke():
  spec = importlib.util.spec_from_file_location("char_lm", ROOT / "examples" / "char_lm.py")
  char_lm = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(char_lm)
  results = char_lm.main(["--steps", "3", "--d", "256", "--layers", "1", "--heads", "2", "--seq", "8",
                          "--batch", "2", "--no-plot", "--moments", "fp32,int8"])
  assert list(results) == ["fuseopt AdamW, fp32 moments", "fuseopt AdamW, int8 moments"]
  for losses, _ in results.values():
    assert len(losses) == 3 and all(math.isfinite(l) for l in losses)
  assert results["fuseopt AdamW, fp32 moments"][0][0] == results["fuseopt AdamW, int8 moments"][0][0]


def test_quality_smoke(capsys, monkeypatch):
  spec = importlib.util.spec_from_file_location("quality", ROOT / "examples" / "quality.py")
  quality = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(quality)
  assert quality.parse([]).mode_list == list(quality.MODES)  # the study runs every mode

  def broken(lr, wd, seed):
    raise ValueError("a format this build lacks")
  monkeypatch.setitem(quality.MODES, "broken", quality.Mode("a format to come", quality.jnp.float32, broken))
  modes = ["fp32", "master24", "flashoptim", "broken"]
  out = quality.main(["--modes", ",".join(modes), "--steps", "2", "--layers", "1", "--heads", "2",
                      "--seq", "8", "--batch", "2", "--seeds", "0", "--eval-windows", "2"])
  printed = capsys.readouterr().out
  assert list(out["modes"]) == modes and out["summary"]["reference"] == "fp32"
  assert not out["modes"]["broken"]["available"]
  assert "broken" in printed and "not available in this build (ValueError: a format this build lacks)" in printed
  for name in ("fp32", "master24"):
    assert math.isfinite(out["modes"][name]["heldout"]["0"])
  peer = out["modes"]["flashoptim"]  # flashoptim-jax is the bench extra's, maybe not installed here
  assert math.isfinite(peer["heldout"]["0"]) if peer["available"] else "not available" in peer["verdict"]
