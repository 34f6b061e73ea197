"""One process of the 2-process test (tests/sharding/test_multiprocess.py).

Usage: python multiprocess_worker.py PROCESS_ID PORT OUT.npz
Each process owns 4 CPU devices of an 8-device global mesh; together they run
a few sharded fused AdamW and Muon steps; process 0 writes the gathered result.
"""

import sys

import jax

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main(process_id: int, port: int, out: str):
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                             process_id=process_id, initialization_timeout=60)
  import numpy as np
  from jax.experimental import multihost_utils
  from jax.sharding import AxisType, NamedSharding

  from tests.sharding import multiprocess_case as case

  assert jax.device_count() == 8 and jax.local_device_count() == 4
  mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))

  def put(tree):
    def one(a, spec):
      sh = NamedSharding(mesh, spec)
      return jax.make_array_from_callback(a.shape, sh, lambda idx: a[idx])
    return jax.tree.map(one, tree, case.SPECS)

  params, grads = case.inputs()
  adam_p, adam_s = case.adamw_steps(put(params), [put(g) for g in grads])
  muon_p = case.muon_steps(put(params), [put(g) for g in grads])
  result = multihost_utils.process_allgather(
      {"adam_params": adam_p, "adam_mu": adam_s[0].mu, "adam_nu": adam_s[0].nu,
       "muon_params": muon_p}, tiled=True)
  if process_id == 0:
    # fp32 holds bf16 exactly (npz has no bf16)
    flat = {jax.tree_util.keystr(k): np.asarray(v, np.float32)
            for k, v in jax.tree_util.tree_flatten_with_path(result)[0]}
    np.savez(out, **flat)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
