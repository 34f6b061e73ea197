"""Public exports: explicit, complete, cheap to import, free of cycles."""

import subprocess
import sys

import fuseopt
import fuseopt.kernels as fk
import fuseopt.optim as fo


def test_every_exported_name_resolves():
  for module in (fk, fo):
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, (module.__name__, missing)
  assert fuseopt.optim is fo and fuseopt.kernels is fk


def test_config_types_exported():
  assert fk.SymTritonConfig(128, 64, 8, 3).bm == 128
  assert fk.AdamTritonGroupConfig.__module__ == "fuseopt.kernels.adam"
  for name in ("ElementwiseTritonConfig", "ElementwiseMosaicTPUConfig", "FusedTritonConfig",
               "FusedMosaicTPUConfig", "SymMosaicTPUConfig", "GemmTritonConfig", "GemmMosaicTPUConfig",
               "TiledConfig"):
    assert isinstance(getattr(fk, name), type), name
  for name in ("ElementwiseMosaicConfig", "FusedMosaicConfig", "GramMosaicConfig", "GramTritonConfig",
               "UpdateTritonConfig", "UpdateMosaicConfig"):
    assert not hasattr(fk, name), name


def _run(code):
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  return out.stdout.strip()


def test_import_fuseopt_is_cheap_and_submodules_import_alone():
  # The bare package loads neither jax nor optax; each leaf module imports
  # first on its own (an import cycle would fail one of these orders).
  assert _run("import sys, fuseopt; print('jax' in sys.modules, 'optax' in sys.modules)") == "False False"
  _run("import fuseopt.optim.builder, fuseopt.optim; import fuseopt.kernels.newton_schulz.sym")
  _run("import fuseopt.kernels.adam; import fuseopt.optim.step; import fuseopt.nnx")
