"""The scale cases' models, placements and table (no compiler needed)."""
import json

import jax
import pytest
from jax.sharding import PartitionSpec as P

from fuseopt.benchmarks import compile_results, scale, scale_report
from fuseopt.optim.matrix_views import MatrixViews, MuonDimensionNumbers


@pytest.mark.parametrize("model,layout,billions", [
    ("llama8.8b", "leaves", 8.84), ("llama8.8b", "scan", 8.84), ("llama8.8b", "packed", 8.84),
    ("llama80b", "leaves", 79.9), ("moe13.8b", "moe", 13.8)])
def test_models_have_the_sizes_they_are_named_for(model, layout, billions):
  assert scale.parameters(model, layout) / 1e9 == pytest.approx(billions, abs=0.05)


def _spec(where, model, layout, path):
  tree = scale.tree(model, layout)
  for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if jax.tree_util.keystr(p) == path:
      return scale.placement(where).spec(path, x)
  raise KeyError(path)


def test_placements():
  # Rows over the mesh, or the columns where the rows do not divide (the
  # 80 B embedding's 128256 rows over 1024 devices).
  assert _spec("fsdp1024", "llama80b", "leaves", "['embed']") == P(None, "fsdp")
  assert _spec("fsdp1024", "llama80b", "leaves", "['lm_head']") == P("fsdp", None)
  # Stacked layers stay whole on their axis; experts go over the mesh.
  assert _spec("fsdp256", "llama8.8b", "scan", "['layers']['attn']['q']") == P(None, "fsdp", None)
  assert _spec("ep64", "moe13.8b", "moe", "['layers']['experts']['down']") == P(
      None, "fsdp", None, None)
  assert _spec("ep64", "moe13.8b", "moe", "['layers']['attn']['o']") == P(None, "fsdp", None)
  # 2-D: rows over fsdp, columns over tp.
  assert _spec("fsdp32xtp8", "llama8.8b", "leaves", "['layers'][3]['mlp']['down']") == P("fsdp", "tp")
  assert _spec("fsdp256", "llama8.8b", "leaves", "['final_norm']") == P()


def test_packed_leaves_are_views_and_the_rest_goes_to_adamw():
  tree = scale.tree("llama8.8b", "packed")
  dims = scale.muon_dims("llama8.8b", "packed")(tree)
  assert dims["layers"][0]["attn"]["qkv"] == MatrixViews(MuonDimensionNumbers(0, 1), axis=1,
                                                         sizes=(4096,) * 3)
  assert dims["layers"][0]["mlp"]["gate_up"].sizes == (14336, 14336)
  assert dims["layers"][0]["mlp"]["down"] == MuonDimensionNumbers(0, 1)
  assert dims["embed"] is None and dims["lm_head"] is None and dims["layers"][0]["attn_norm"] is None
  moe = scale.muon_dims("moe13.8b", "moe")(scale.tree("moe13.8b", "moe"))
  assert moe["layers"]["experts"]["gate"] == MuonDimensionNumbers(2, 3)
  assert moe["layers"]["router"] is None


def test_the_table_says_what_does_not_fit_and_what_does_not_compile(tmp_path):
  fig = {"temp_bytes": 3 << 29, "argument_bytes": 1 << 30, "output_bytes": 0, "alias_bytes": 0,
         "kernels": 97, "collectives": {"all-to-all": {"count": 6, "bytes": 1 << 20}},
         "spills": [], "lower_s": 10.0, "compile_s": 50.0}
  oom = ("x does not compile for v5e (TPU v5 lite): JaxRuntimeError: RESOURCE_EXHAUSTED: Ran out "
         "of memory on HBM, the total memory required for HLO temporaries (16.86G) exceeds "
         "available HBM (15.75G).")
  views = "x does not compile for v5e (TPU v5 lite): NotImplementedError: Mosaic kernels cannot"
  doc = {"schema": compile_results.SCHEMA, "target": "v5e", "environment": {}, "cases": {
      "scale/hybrid/fuseopt_step/llama8.8b-fsdp256": fig,
      "scale/hybrid/optax/llama8.8b-fsdp256": {"error": oom},
      "scale/hybrid/fuseopt_step/llama8.8b-packed-fsdp256": {"error": views}}}
  (tmp_path / "v5e.json").write_text(json.dumps(doc))
  table = scale_report.markdown(tmp_path)
  row = next(l for l in table.splitlines() if "8.8 B, one leaf per matrix, FSDP | 256 × v5e" in l)
  assert "| 1.50 GiB | 1.00 GiB | 6 all-to-all (1 MiB) | 97 | does not fit (16.86 GiB) |" in row
  assert "60 / -" in row
  packed = next(l for l in table.splitlines() if "packed" in l and "256 × v5e" in l)
  assert "does not compile: NotImplementedError" in packed and "no views" in packed
  page = tmp_path / "scaling.md"
  page.write_text(f"a\n{scale_report.SCALE_START}\nold\n{scale_report.SCALE_END}\nb\n")
  assert scale_report.render(page, tmp_path) is True
  assert page.read_text() == f"a\n{scale_report.SCALE_START}\n{table}{scale_report.SCALE_END}\nb\n"
  assert scale_report.render(page, tmp_path) is False


def test_the_table_takes_each_row_from_the_newest_release_that_recorded_it(tmp_path):
  def fig(temp):
    return {"temp_bytes": temp, "argument_bytes": 1 << 30, "output_bytes": 0, "alias_bytes": 0,
            "kernels": 97, "collectives": {}, "spills": [], "lower_s": 1.0, "compile_s": 2.0}
  ours, scan = ("scale/hybrid/fuseopt_step/llama8.8b-fsdp256",
                "scale/hybrid/fuseopt_step/llama8.8b-scan-fsdp256")
  old = {"environment": {"jax": "0.11.2"}, "cases": {ours: fig(3 << 29), scan: fig(1 << 29)}}
  (tmp_path / "v5e.json").write_text(json.dumps(old))
  for release, temp in (("0.12.0.1", 3 << 27), ("0.9.0", 5 << 29)):
    (tmp_path / f"jax-{release}").mkdir()
    (tmp_path / f"jax-{release}" / "v5e.json").write_text(
        json.dumps({"environment": {"jax": release}, "cases": {ours: fig(temp)}}))
  table = scale_report.markdown(tmp_path).splitlines()
  row = next(l for l in table if "8.8 B, one leaf per matrix, FSDP | 256 × v5e" in l)
  assert "| 384 MiB |" in row and row.endswith("| 0.12.0.1 / - |")
  stacked = next(l for l in table if "scan-stacked" in l and "256 × v5e" in l)
  assert "| 512 MiB |" in stacked and stacked.endswith("| 0.11.2 / - |")
