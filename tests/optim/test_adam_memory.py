"""The fused Adam step materialises no fp32 copy of any leaf (compile only)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fuseopt.optim as fo

F32, BF16 = jnp.float32, jnp.bfloat16


def _llama_like(d=2048, ff=8192, layers=1, vocab=8000, dtype=F32):
  """About 100M parameters in the shapes of a Llama block stack (the leaf
  shapes of docs/measurements.md's 1.2 B tree; few leaves keep the compile short)."""
  s = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
  layer = {"wq": s(d, d), "wk": s(d, d), "wv": s(d, d), "wo": s(d, d),
           "w1": s(d, ff), "w3": s(d, ff), "w2": s(ff, d), "norm1": s(d), "norm2": s(d)}
  return {"embed": s(vocab, d), "layers": [layer] * layers, "norm": s(d), "head": s(d, vocab)}


def _temp_and_state(params, grads, tx, params_first=True):
  state = jax.eval_shape(tx.init, params)
  state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  if params_first:  # the documented donation order
    fn = jax.jit(lambda p, s, g: fo.step(tx, g, s, p), donate_argnums=(0, 1))
    compiled = fn.lower(params, state, grads).compile()
  else:
    compiled = jax.jit(fo.step, static_argnums=0, donate_argnums=(2, 3)).lower(
        tx, grads, state, params).compile()
  return compiled.memory_analysis(), state_bytes


def test_fused_step_temp_memory_is_under_one_percent_of_state():
  params = _llama_like()
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  assert 90e6 < n < 120e6, n
  tx = fo.adamw(optax.cosine_decay_schedule(1e-3, 1000), weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p), execution=fo.Execution(implementation="xla"))
  # fp32 params never share an aval with bf16 moments: any donation order.
  mem, state_bytes = _temp_and_state(params, params, tx, params_first=False)
  assert state_bytes >= 4 * n  # bf16 mu + nu
  assert mem.temp_size_in_bytes < 0.01 * state_bytes, (mem.temp_size_in_bytes, state_bytes)
  # Donated params and moments are written in place, not copied.
  assert mem.alias_size_in_bytes >= 8 * n


def test_bf16_params_and_grads_step_is_lean_too():
  params = _llama_like(d=1024, ff=4096, vocab=4000, dtype=BF16)
  tx = fo.adam(1e-3, nesterov=True, execution=fo.Execution(implementation="xla"))
  mem, state_bytes = _temp_and_state(params, params, tx)
  assert mem.temp_size_in_bytes < 0.01 * state_bytes, (mem.temp_size_in_bytes, state_bytes)
  # The trap the documented order avoids: state donated before params pairs
  # each bf16 moment's buffer with a bf16 parameter output, and XLA copies.
  mem, _ = _temp_and_state(params, params, tx, params_first=False)
  assert mem.temp_size_in_bytes > 0.1 * state_bytes
