"""fuseopt.optim.step on the builder's recipes: fused passes equal update + apply.

For adamw, muon and muonclip configs (clip, a no-decay group, a schedule;
with skip_nonfinite, freeze, accumulate_steps) the fused step must give
``tx.update`` + ``optax.apply_updates`` up to fp32 rounding over several
steps, return ``tx.init``'s state structure and dtypes, and run no fallback.
On an H200 (lowered from the CPU) the AdamW leaves go through Triton kernels
that read p, g, mu, nu and write p, mu, nu in place.
"""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseopt.optim as fo
from fuseopt.optim import build_optimizer, fusion
from tests.kernels import harness

F32, BF16 = jnp.float32, jnp.bfloat16
H200 = harness.targets_for("triton")[0]
TRITON_CALL = re.compile(r"stablehlo\.custom_call @__gpu\$xla\.gpu\.triton")


def _params(dtype=F32):
  rng = np.random.default_rng(0)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), F32).astype(dtype)
  return {"embed": normal(64, 32),
          "layers": {"attn": {"q": normal(32, 32), "o": normal(32, 32)},
                     "mlp": {"up": normal(32, 96), "down": normal(96, 32)},
                     "norm": {"scale": normal(32)}},
          "head": {"kernel": normal(32, 64), "bias": normal(64)}}


def _config(optimizer, **extra):
  return {"optimizer": optimizer, "clip_norm": 1.0, "weight_decay": 0.1,
          "schedule": {"kind": "cosine", "peak": 1e-2, "warmup_steps": 2},
          "param_groups": [
              {"name": "no_decay", "patterns": ["*/scale", "*/bias"], "weight_decay": 0.0},
              {"name": "rest", "patterns": ["*"], "learning_rate_multiplier": 0.5}],
          **extra}


WRAPPERS = {
    "plain": {},
    "bf16_state": {"moment_dtype": "bfloat16"},
    "skip_nonfinite": {"skip_nonfinite": True},
    "freeze": {"frozen": ["embed"]},
    "accumulate": {"accumulate_steps": 2},
    "all": {"skip_nonfinite": True, "frozen": ["embed"], "accumulate_steps": 2,
            "moment_dtype": "bfloat16"},
}


class _Fallbacks(logging.Handler):
  def __init__(self):
    super().__init__(logging.DEBUG)
    self.messages = []

  def emit(self, record):
    self.messages.append(record.getMessage())


def _watch_fallbacks():
  handler = _Fallbacks()
  logger = logging.getLogger("fuseopt")
  logger.addHandler(handler)
  old = logger.level
  logger.setLevel(logging.DEBUG)
  return handler, lambda: (logger.removeHandler(handler), logger.setLevel(old))


def _grads(params, t):
  g = jax.tree.map(lambda x: jnp.sin(x.astype(F32) * (t + 1.0)).astype(x.dtype), params)
  if t == 2:  # a non-finite step: skipped where skip_nonfinite is on
    g["layers"]["mlp"]["up"] = g["layers"]["mlp"]["up"].at[3, 5].set(jnp.nan)
  return g


def _compare(got, want, what):
  assert jax.tree.structure(got) == jax.tree.structure(want), what
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(got)):
    name = f"{what}{jax.tree_util.keystr(path)}"
    assert a.dtype == b.dtype and a.shape == b.shape, name
    if not jnp.issubdtype(a.dtype, jnp.floating):
      np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=name)
    elif a.dtype == BF16:
      # A bf16 value one fp32 ulp away from a rounding boundary may round the
      # other way: at most one bf16 ulp, rarely.
      d = np.abs(harness.bits(a).astype(np.int32) - harness.bits(b).astype(np.int32))
      assert d.max(initial=0) <= 1 and (d != 0).mean() < 0.01, name
    else:
      scale = float(jnp.max(jnp.abs(a), initial=0.0)) if a.size else 0.0
      harness.assert_close(b, a, rtol=1e-5, atol=1e-6 * scale + 1e-30, what=name)


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("optimizer", ("adamw", "muon", "muonclip"))
def test_fused_step_equals_update_then_apply(optimizer, wrapper):
  if optimizer != "adamw" and wrapper in ("freeze", "accumulate"):
    pytest.skip("covered by 'all' for the Muon recipes (keeps the suite short)")
  params = _params()
  extra = dict(WRAPPERS[wrapper])
  if optimizer != "adamw":
    # fp32 Newton-Schulz: in bf16 a one-ulp difference of the fp32 clip norm
    # (the two paths reduce the same gradients in different fusions) can flip
    # a bf16 rounding of the NS input, a bf16 ulp of the update.
    extra["optimizer_kwargs"] = {"execution": {"newton_schulz": {"dtype": "float32"}}}
  tx = build_optimizer(_config(optimizer, **extra), 10)
  state = tx.init(params)

  @jax.jit
  def reference(g, s, p):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  fused = jax.jit(lambda g, s, p: fo.step(tx, g, s, p))
  handler, done = _watch_fallbacks()
  try:
    p1 = p2 = params
    s1 = s2 = state
    for t in range(6):
      if t == 2 and not WRAPPERS[wrapper].get("skip_nonfinite"):
        continue
      g = _grads(params, t)
      p1, s1 = reference(g, s1, p1)
      p2, s2 = fused(g, s2, p2)
  finally:
    done()
  assert not handler.messages, handler.messages
  _compare(s2, s1, "state")
  _compare(p2, p1, "params")
  init = jax.eval_shape(tx.init, params)
  assert jax.tree.structure(s2) == jax.tree.structure(init)
  assert [x.dtype for x in jax.tree.leaves(s2)] == [x.dtype for x in jax.tree.leaves(init)]
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(p2), jax.tree.leaves(params)))


def test_skipped_step_keeps_params_and_state_bitwise():
  params = _params()
  tx = build_optimizer(_config("adamw", skip_nonfinite=True, moment_dtype="bfloat16"), 10)
  state = tx.init(params)
  step = jax.jit(lambda g, s, p: fo.step(tx, g, s, p))
  p1, s1 = step(_grads(params, 0), state, params)
  p2, s2 = step(_grads(params, 2), s1, p1)  # holds a NaN
  for a, b in zip(jax.tree.leaves(p2), jax.tree.leaves(p1)):
    harness.assert_bitwise_equal(a, b, "params")
  assert int(s2.total_skips) == 1 and not bool(s2.last_finite)
  for a, b in zip(jax.tree.leaves(s2.inner_state), jax.tree.leaves(s1.inner_state)):
    harness.assert_bitwise_equal(a, b, "inner state")


def test_pieces_without_a_rule_fall_back_and_say_which():
  params, grads = _params(), _grads(_params(), 0)
  handler, done = _watch_fallbacks()
  try:
    for tx in (build_optimizer(_config("lamb"), 10),
               optax.chain(optax.clip_by_global_norm(1.0), fo.adamw(1e-3))):
      state = tx.init(params)
      want = jax.jit(lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(
          *tx.update(g, s, p)))(grads, state, params)
      got = jax.jit(lambda g, s, p: fo.step(tx, g, s, p))(grads, state, params)
      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        harness.assert_bitwise_equal(a, b)
  finally:
    done()
  assert len(handler.messages) == 2, handler.messages
  assert "param_groups group 'no_decay'" in handler.messages[0], handler.messages[0]
  assert "no in-place rule" in handler.messages[1], handler.messages[1]


def test_muonclip_with_qk_stats_falls_back():
  params = {"attn": {"q_proj": jnp.eye(8), "k_proj": jnp.eye(8)}}
  tx = fo.muonclip(1e-2, tau=1.0)
  state = tx.init(params)
  handler, done = _watch_fallbacks()
  try:
    fo.step(tx, params, state, params, qk_stats={"attn": jnp.full((2,), 10.0)})
  finally:
    done()
  assert any("qk_stats" in m for m in handler.messages), handler.messages


def _aliases(text):
  """(operands, aliased outputs) of each Pallas-Triton call in ``text``."""
  out = []
  for line in text.splitlines():
    if TRITON_CALL.search(line):
      call = line.split("stablehlo.custom_call", 1)[1]
      operands = call.split("(", 1)[1].split(")", 1)[0].count("%")
      out.append((operands, line.count("stablehlo.output_operand_alias")))
  return out


@pytest.mark.parametrize("optimizer", ("adamw", "muon"))
def test_h200_lowering_reads_p_g_mu_nu_and_writes_them_in_place(optimizer):
  """Every Adam launch of the recipe updates its leaves in place: 2 scalar
  operands + 4 per leaf (p, g, mu, nu), 3 aliased outputs per leaf (p, mu,
  nu); no launch writes a separate direction."""
  s = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  params = jax.tree.map(s, _params())
  # on_max_skips="apply": the "raise" limit's host callback has no CUDA lowering from a CPU.
  tx = build_optimizer(_config(optimizer, skip_nonfinite=True, on_max_skips="apply"), 10)
  state = jax.eval_shape(tx.init, params)
  fn = jax.jit(lambda p, st, g: fo.step(tx, g, st, p), donate_argnums=(0, 1))
  text = harness.lower_for(H200, fn, params, state, params)
  calls = _aliases(text)
  adam = [c for c in calls if (c[0] - 2) % 4 == 0 and c[1] == 3 * (c[0] - 2) // 4]
  adam_leaves = sum((c[0] - 2) // 4 for c in adam)
  # adamw: every leaf; muon: the 1-D leaves (scale, bias), the matrices are Muon's.
  assert adam_leaves == (8 if optimizer == "adamw" else 2), calls
  # (muon: the matrices' Newton-Schulz runs as the GPU's default picks it, Gram
  # iterations on Triton or XLA's matmuls: tests/kernels/test_newton_schulz.py)


def test_muon_implementation_reaches_its_adamw_side():
  """muon(implementation="xla") lowers no Triton kernel at all on an H200;
  muon(implementation="triton", interpret=True) runs on the CPU (every kernel,
  the AdamW side's included, in interpret mode)."""
  s = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  params = {"w": jnp.asarray(np.random.default_rng(1).standard_normal((16, 32)), F32),
            "b": jnp.linspace(-1.0, 1.0, 16, dtype=F32)}
  tx = fo.muon(1e-2, weight_decay=0.1, adam_weight_decay=0.1, execution=fo.Execution(implementation='xla'))
  state = jax.eval_shape(tx.init, params)
  for fn in (lambda p, st, g: fo.step(tx, g, st, p),
             lambda p, st, g: optax.apply_updates(p, tx.update(g, st, p)[0])):
    text = harness.lower_for(H200, fn, jax.tree.map(s, params), state, jax.tree.map(s, params),
                             expect_kernel=False)
    assert not TRITON_CALL.search(text)
  tx = fo.muon(1e-2, weight_decay=0.1, execution=fo.Execution(implementation='triton', interpret=True))
  state = tx.init(params)
  new_p, _ = jax.jit(lambda g, s, p: fo.step(tx, g, s, p))(params, state, params)
  ref = fo.muon(1e-2, weight_decay=0.1, execution=fo.Execution(implementation='xla'))
  want, _ = jax.jit(lambda g, s, p: fo.step(ref, g, s, p))(params, ref.init(params), params)
  for a, b in zip(jax.tree.leaves(new_p), jax.tree.leaves(want)):
    harness.assert_close(a, b, rtol=1e-2, atol=1e-3)


def test_one_reduction_gives_norm_and_finiteness():
  tree = {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.float32(2.0), "c": jnp.ones((4,), BF16)}
  sq, finite = fusion.grad_stats(tree)
  assert float(sq) == 55.0 + 4.0 + 4.0 and bool(finite)
  _, finite = fusion.grad_stats({**tree, "b": jnp.float32(jnp.inf)})
  assert not bool(finite)
  # A square that overflows fp32 is still a finite gradient.
  sq, finite = fusion.grad_stats({"a": jnp.full((2,), 1e30, F32)})
  assert bool(finite) and np.isinf(float(sq))
