"""Targets are data: lookups, errors, and the figures' parsers (no compiler needed)."""
import dataclasses

import pytest

from fuseopt import targets
from fuseopt.benchmarks import compile_cases, compile_harness, compile_results, compiled


def test_every_target_is_described():
  assert targets.TARGETS
  for name, t in targets.TARGETS.items():
    assert t.name == name
    assert t.platform in ("gpu", "tpu")
    assert 1 in t.topologies
    if t.platform == "gpu":
      text = targets.spec_text(t)
      major, minor = t.compute_capability
      assert f"cuda_compute_capability {{ major: {major} minor: {minor} }}" in text
      assert f"core_count: {t.num_cores}" in text
      assert t.device_kind in text   # device_description_str
    else:
      assert t.spec is None


def test_unknown_target_lists_the_known_ones():
  with pytest.raises(targets.UnknownTarget, match="known targets: " + ", ".join(targets.TARGETS)):
    targets.get("h100")


def test_missing_topology_size_is_refused():
  with pytest.raises(ValueError, match="no 8-device topology"):
    targets.topology("l4", 8)


def test_missing_compiler_names_the_package(monkeypatch):
  monkeypatch.setitem(targets._NEEDS, "tpu", (("no_such_module_xyz", "libtpu (pip install x)"),))
  why = targets.missing("v6e")
  assert "libtpu" in why and "fuseopt[compile]" in why
  with pytest.raises(targets.CompilerMissing, match="libtpu"):
    targets.topology(dataclasses.replace(targets.TARGETS["v6e"], name="v6e-test"))


@pytest.mark.skipif(targets.missing("h200") is not None, reason="the compile extra is not installed")
def test_a_description_that_does_not_parse_names_its_file(tmp_path):
  bad = tmp_path / "broken.txtpb"
  bad.write_text("gpu_device_info { no_such_field: 1 }\n")
  t = dataclasses.replace(targets.TARGETS["h200"], name="broken", spec=str(bad))
  with pytest.raises(targets.BadTargetSpec, match="broken.txtpb"):
    targets.topology(t)


def test_collectives_are_counted_with_their_result_bytes():
  hlo = "\n".join([
      "  %ag = f32[8,1024]{1,0} all-gather(f32[1,1024]{1,0} %p), dimensions={0}",
      "  %a2a-start = ((bf16[2,64,64]{2,1,0}), bf16[2,64,64]{2,1,0}) all-to-all-start(%x)",
      "  %a2a-done = bf16[2,64,64]{2,1,0} all-to-all-done(%a2a-start)",
      "  ROOT %ar = f32[16]{0} all-reduce(f32[16]{0} %y), to_apply=%add",
  ])
  got = compile_harness.collectives(hlo)
  assert got == {"all-gather": {"count": 1, "bytes": 8 * 1024 * 4},
                 "all-to-all": {"count": 1, "bytes": 2 * 64 * 64 * 2},
                 "all-reduce": {"count": 1, "bytes": 64}}


def test_kernel_launches_are_counted_per_backend():
  hlo = ('%a = f32[8] custom-call(%x), custom_call_target="tpu_custom_call"\n'
         '%b = f32[8] custom-call(%x), custom_call_target="__gpu$xla.gpu.triton"\n'
         '%c = f32[8] custom-call(%x), custom_call_target="__cublas$gemm"\n')
  assert compile_harness.kernel_launches(hlo) == 2


def test_the_gate_fails_on_growth_and_reports_shrinking():
  base = {"temp_bytes": 100, "argument_bytes": 10, "output_bytes": 10, "alias_bytes": 10,
          "kernels": 3, "collectives": {"all-to-all": {"count": 2, "bytes": 64}}, "spills": []}
  same = dict(base)
  assert compile_results.compare(same, base)[0] == []
  grown = dict(base, temp_bytes=101, kernels=4,
               collectives={"all-to-all": {"count": 2, "bytes": 65},
                            "all-gather": {"count": 1, "bytes": 8}})
  fails, _ = compile_results.compare(grown, base)
  assert any("temp_bytes grew" in f for f in fails)
  assert any("kernels grew" in f for f in fails)
  assert any("all-to-all bytes grew" in f for f in fails)
  assert any("all-gather count grew" in f for f in fails)
  less_in_place = dict(base, alias_bytes=5)
  assert any("alias_bytes shrank" in f for f in compile_results.compare(less_in_place, base)[0])
  better = dict(base, temp_bytes=50)
  fails, notes = compile_results.compare(better, base)
  assert not fails and any("temp_bytes shrank" in n for n in notes)
  spilled = dict(base, spills=["fuseopt_ns_sym: 8 B spill stores, 8 B spill loads"])
  assert any("spills" in n for n in compile_results.compare(spilled, base)[1])   # reported
  assert compile_results.compare(same, None) == ([], ["not in the baseline (new case)"])


def test_ptxas_spills_are_parsed_per_kernel():
  log = ["I1201 subprocess_compilation.cc:313] ptxas info : Compiling entry function "
         "'fuseopt_ns_sym' for 'sm_90a' ptxas info : Function properties for fuseopt_ns_sym "
         "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads ptxas info : "
         "Function properties for loop_add_fusion_3",
         "    136 bytes stack frame, 136 bytes spill stores, 132 bytes spill loads",
         "ptxas info    : Compiling entry function 'fuseopt_adam_update' for 'sm_90a'",
         "ptxas info    : Function properties for fuseopt_adam_update",
         "    16 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads"]
  got = compile_harness.spills(log)
  assert got == ["fuseopt_adam_update: 8 B spill stores, 8 B spill loads",
                 "loop_add_fusion_3: 136 B spill stores, 132 B spill loads"]
  assert compile_harness.fuseopt_spills(got) == ["fuseopt_adam_update: 8 B spill stores, 8 B spill loads"]


def test_a_spill_warning_inside_another_kernels_report_names_its_own_kernel():
  # ptxas runs on several threads: a --warn-on-spills line for one kernel can
  # land between another kernel's "Compiling entry function" and its figures
  # (seen in CI: an XLA fusion's spill was charged to fuseopt_ns_sym).
  log = ["ptxas info    : Compiling entry function 'fuseopt_ns_sym__2' for 'sm_90a'",
         "I1201 subprocess_compilation.cc:349] ptxas warning : Registers are spilled to local "
         "memory in function 'loop_add_fusion_54', 136 bytes spill stores, 136 bytes spill loads",
         "ptxas info    : Function properties for fuseopt_ns_sym__2",
         "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
         "ptxas info    : Compiling entry function 'loop_add_fusion_54' for 'sm_90a'",
         "ptxas info    : Function properties for loop_add_fusion_54",
         "    136 bytes stack frame, 136 bytes spill stores, 136 bytes spill loads"]
  got = compile_harness.spills(log)
  assert got == ["loop_add_fusion_54: 136 B spill stores, 136 B spill loads"]
  assert compile_harness.fuseopt_spills(got) == []


def test_every_case_id_is_unique_and_names_its_target_backend():
  for name, t in targets.TARGETS.items():
    ids = [c.id for c in compile_cases.cases(name, full=True)]
    assert len(ids) == len(set(ids)), name
    for cid in ids:
      if cid.startswith("kernel/"):
        backends = (t.implementation, "mosaic_gpu") if t.platform == "gpu" else (t.implementation,)
        assert any(f"/{b}/" in cid for b in backends), (name, cid)
    assert any(i.startswith("step/") for i in ids)
    assert any(i.startswith("sharded/") for i in ids) == (8 in t.topologies)
    if not t.ci_shared_cases:
      # There for the scale cases: CI compiles nothing else on it.
      assert {c.kind for c in compile_cases.cases(name)} <= {"scale"}
      assert any(c.id.startswith("scale/") for c in compile_cases.cases(name, full=True))


def test_a_step_that_does_not_fit_is_a_figure():
  error = ("scale/hybrid/optax/llama8.8b-fsdp256 does not compile for v5e (TPU v5 lite): "
           "JaxRuntimeError: RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
           "required for HLO temporaries (17.97G) exceeds available HBM (15.75G).")
  assert compiled.requested_bytes(error) == int(17.97 * 2**30)
  assert compiled.why_failed(error) == "does not fit (17.97 GiB)"
  assert compiled.why_failed("x does not compile for v6e (TPU v6 lite): NotImplementedError: "
                             "Mosaic kernels cannot be automatically partitioned") == (
      "does not compile: NotImplementedError")
  # Only the cases whose failure is a figure are written failed.
  scale_ids = {c.id for c in compile_cases.cases("v5e", full=True, kinds=("scale",)) if c.records_failure}
  assert "scale/hybrid/fuseopt_step/llama8.8b-fsdp256" in scale_ids
  assert not any(c.records_failure for c in compile_cases.cases("v5e", full=True, kinds=("sharded",)))


def test_cli_refuses_an_unknown_target(capsys):
  from fuseopt import cli
  assert cli.main(["compile-check", "--target", "h100"]) == 2
  assert "known targets: " + ", ".join(targets.TARGETS) in capsys.readouterr().err


@pytest.mark.skipif(targets.missing("h200") is not None, reason="the compile extra is not installed")
def test_cli_writes_then_gates_the_figures(tmp_path, capsys):
  import json

  from fuseopt import cli
  args = ["compile-check", "--target", "h200", "--match", "kernel/stochastic_round/triton/1048576/",
          "--results", str(tmp_path)]
  assert cli.main(args + ["--update"]) == 0
  path = compile_results.results_path("h200", tmp_path)   # the running release's own file
  assert path == compile_results.write_path("h200", tmp_path)
  doc = json.loads(path.read_text())
  (cid, fig), = doc["cases"].items()
  assert fig["kernels"] == 1 and fig["temp_bytes"] == 0 and fig["spills"] == []
  assert cli.main(args) == 0                       # the same figures pass
  fig["kernels"] = 0                               # a baseline with fewer launches
  path.write_text(json.dumps(doc))
  capsys.readouterr()
  assert cli.main(args) == 1
  assert "kernels grew: 0 -> 1" in capsys.readouterr().out


@pytest.fixture
def new_target(monkeypatch):
  """A target added as adding one is documented: one entry in TARGETS (a copy
  of h200's, under a new name, reusing its description file)."""
  t = dataclasses.replace(targets.TARGETS["h200"], name="h200copy")
  monkeypatch.setitem(targets.TARGETS, t.name, t)
  return t


def test_a_new_target_is_its_entry_alone(new_target, tmp_path, capsys):
  import jax

  from fuseopt import cli
  from tests.compile import tier
  name = new_target.name
  # The compile tests are parametrised over it: the cases CI compiles on every
  # target like the one it copies (the costly ones name their targets), in
  # groups of its own.
  for kind in compile_cases.KINDS:
    shared = [c.id for c in compile_cases.cases("h200", kinds=(kind,)) if c.ci_targets is None]
    got = [p for p in tier.params(kind) if p.values[0] == name]
    assert [p.values[1] for p in got] == shared, kind
    assert {m.args[0] for p in got for m in p.marks} == ({f"compile-{name}-{kind}"} if shared else set())
  assert tier.case_ids(name, ("kernel",))
  # The command line knows it, `--target all` includes it, its figures have their file.
  assert name in compiled.target_names("all") and compiled.target_names(name) == [name]
  with pytest.raises(SystemExit):
    cli.build_parser().parse_args(["compile-check", "--help"])
  assert name in capsys.readouterr().out
  assert compile_results.results_path(name, tmp_path) == tmp_path / f"jax-{jax.__version__}" / f"{name}.json"
