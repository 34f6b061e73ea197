"""fo.convert_moments: a state's Adam moments into another format, the state
then what tx.init gives for that format, and the run resumes from it."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseopt.optim as fo
from fuseopt.kernels.adam import formats, quantized


def _params():
  k = jax.random.split(jax.random.key(0), 3)
  return {"w": jax.random.normal(k[0], (8, 512)), "odd": jax.random.normal(k[1], (6, 10)),
          "b": jax.random.normal(k[2], (16,))}


def _tx(moment_dtype):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")   # int8: the leaves without whole blocks keep bf16
    return fo.adamw(1e-2, weight_decay=0.1, moment_dtype=moment_dtype)


def _init(tx, params):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return tx.init(params)


def _advanced(moment_dtype, params, steps=2):
  tx = _tx(moment_dtype)
  state = _init(tx, params)
  step = jax.jit(lambda p, s, g: fo.step(tx, g, s, p))
  for t in range(steps):
    params, state = step(params, state, jax.tree.map(lambda x: x * (t + 1) * 0.1, params))
  return params, state


def _layout(state):
  return jax.tree.map(lambda x: (x.shape, x.dtype), state)


@pytest.mark.parametrize("source,target", [("float32", "int8"), ("int8", "bfloat16"),
                                           ("bfloat16", "float32"), ("int8", "float32"),
                                           ("float32", "bfloat16"), ("int8", "int4"),
                                           ("int4", "float32")])
def test_converted_state_is_what_init_gives_and_resumes(source, target):
  params = _params()
  params, state = _advanced(source, params)
  new = fo.convert_moments(state, target)
  assert _layout(new) == _layout(_init(_tx(target), params))
  assert int(new[0].count) == int(state[0].count)
  # the run resumes in the new format (tx.update refuses a state of another format)
  tx = _tx(target)
  p2, s2 = jax.jit(lambda p, s, g: fo.step(tx, g, s, p))(params, new, params)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(p2))
  tx.update(params, new, params)


def _value(m, signed):
  return (formats.of(m).dequantize(m, signed=signed) if formats.is_blockwise(m)
          else m.astype(jnp.float32))


def test_values_survive_the_round_trip_within_the_formats_resolution():
  params = _params()
  _, state = _advanced("float32", params)
  mu, nu = state[0].mu["w"], state[0].nu["w"]
  q = fo.convert_moments(state, "int8")
  assert quantized.is_quantized(q[0].mu["w"]) and q[0].mu["odd"].dtype == jnp.bfloat16
  back = fo.convert_moments(q, "float32")
  # one code step of the block: |mu| max / 127; sqrt(nu) max / 255 in the root domain
  mstep = np.max(np.abs(np.asarray(mu)).reshape(8, 2, 256), axis=-1, keepdims=True) / 127
  err = np.abs(np.asarray(back[0].mu["w"]) - np.asarray(mu)).reshape(8, 2, 256)
  assert np.all(err <= mstep * 1.0001 + 1e-12)
  root = np.sqrt(np.asarray(nu)).reshape(8, 2, 256)
  rstep = root.max(axis=-1, keepdims=True) / 255
  rerr = np.abs(np.sqrt(np.asarray(back[0].nu["w"])).reshape(8, 2, 256) - root)
  assert np.all(rerr <= rstep * 1.0001 + 1e-12)
  # nu never 0 where the fp32 nu > 0
  assert not np.any((np.asarray(back[0].nu["w"]) == 0) & (np.asarray(nu) > 0))


def test_same_state_and_seed_give_the_same_codes_and_another_seed_others():
  _, state = _advanced("float32", _params())
  a = fo.convert_moments(state, "int8", seed=1)
  b = fo.convert_moments(state, "int8", seed=1)
  c = fo.convert_moments(state, "int8", seed=2)
  np.testing.assert_array_equal(a[0].mu["w"].codes, b[0].mu["w"].codes)
  assert np.any(np.asarray(a[0].mu["w"].codes) != np.asarray(c[0].mu["w"].codes))


def test_muon_adamw_side_is_converted_and_momentum_kept():
  params = {"w": jnp.ones((256, 512)), "b": jnp.ones((512,))}
  state = fo.muon(1e-3).init(params)
  new = fo.convert_moments(state, "int8")
  adam = [s for s in jax.tree.leaves(new, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
          if isinstance(s, optax.ScaleByAdamState)]
  assert len(adam) == 1 and quantized.is_quantized(adam[0].mu["b"])
  assert isinstance(adam[0].mu["w"], optax.MaskedNode)     # Muon's matrix: not Adam's
  # Muon's momentum is no Adam moment: the same arrays
  before = [x for x in jax.tree.leaves(state) if x.shape == (256, 512)]
  after = [x for x in jax.tree.leaves(new) if x.shape == (256, 512)]
  assert len(before) == len(after) == 1 and after[0].dtype == before[0].dtype


@pytest.mark.parametrize("factory", ["muon", "normuon"])
def test_muon_momentum_converts_to_8_bits_and_back(factory):
  """momentum_dtype: Muon's momentum in the layout init gives for that
  mu_dtype (a leaf blocked over its trailing axes included), the run resumes,
  and back to fp32 within one code step of each block."""
  make = getattr(fo, factory)
  params = {"w": jnp.ones((8, 512)), "q": jnp.ones((8, 4, 64)), "b": jnp.ones((7,))}
  grads = jax.tree.map(lambda p: 0.01 * jnp.sin(jnp.arange(p.size, dtype=jnp.float32)
                                                 .reshape(p.shape)), params)
  tx = make(1e-2, weight_decay=0.1)
  params, state = jax.jit(lambda g, s, p: fo.step(tx, g, s, p))(grads, _init(tx, params), params)
  tx8 = make(1e-2, weight_decay=0.1, mu_dtype="int8")
  new = fo.convert_moments(state, momentum_dtype="int8")
  assert _layout(new) == _layout(_init(tx8, params))
  jax.jit(lambda g, s, p: fo.step(tx8, g, s, p))(grads, new, params)
  back = fo.convert_moments(new, momentum_dtype="float32")
  assert _layout(back) == _layout(state)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
    if a.shape == (8, 512):   # the momentum of Muon's matrix
      np.testing.assert_allclose(a, b, atol=float(jnp.max(jnp.abs(b))) / 127)


@pytest.mark.parametrize("bad", [None, "uint4", jnp.float16])
def test_a_format_not_offered_is_refused_naming_the_accepted(bad):
  _, state = _advanced("float32", _params(), steps=1)
  with pytest.raises((ValueError, TypeError), match="float32.*bfloat16.*int8.*int4|int8.*int4"):
    fo.convert_moments(state, bad)


@pytest.mark.parametrize("back", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("factory", ["muon", "normuon"])
def test_muon_momentum_back_from_8_bits_continues_with_the_matching_config(factory, back):
  """A run on 8-bit momentum converted back (momentum_dtype=float32 or
  bfloat16) continues with fo.muon(mu_dtype=that dtype), fused and through
  update: the AdamW side's moments are moment_dtype's whatever Muon's
  mu_dtype (it used to take mu_dtype's, so the converted state's bf16 AdamW mu
  was refused)."""
  make = getattr(fo, factory)
  params = {"w": jnp.ones((8, 512)), "b": jnp.ones((256,))}
  grads = jax.tree.map(lambda p: 0.01 * jnp.sin(jnp.arange(p.size, dtype=jnp.float32)
                                                 .reshape(p.shape)), params)
  tx8 = make(1e-2, weight_decay=0.1, mu_dtype="int8")
  params, state = jax.jit(lambda g, s, p: fo.step(tx8, g, s, p))(grads, _init(tx8, params), params)
  name = jnp.dtype(back).name
  converted = fo.convert_moments(state, momentum_dtype=name)
  tx = make(1e-2, weight_decay=0.1, mu_dtype=back)
  assert _layout(converted) == _layout(_init(tx, params))
  p2, s2 = params, converted
  for _ in range(2):
    p2, s2 = jax.jit(lambda g, s, p: fo.step(tx, g, s, p))(grads, s2, p2)
  for _ in range(2):
    u, converted = jax.jit(tx.update)(grads, converted, params)
    params = optax.apply_updates(params, u)
  assert _layout(s2) == _layout(converted) == _layout(_init(tx, params))


@pytest.mark.parametrize("state_mu, tx_mu, found, keeps", [
    ("int8", jnp.float32, r"8-bit momentum \(QuantizedMoment codes and scales, mu_dtype='int8'\)",
     r"float32 momentum \(mu_dtype='float32'\)"),
    (jnp.bfloat16, jnp.float32, "bfloat16 momentum", r"float32 momentum \(mu_dtype='float32'\)"),
    (jnp.float32, "int8", "float32 momentum",
     r"8-bit momentum \(QuantizedMoment codes and scales, mu_dtype='int8'\)"),
    ("int8", None, r"8-bit momentum \(QuantizedMoment codes and scales, mu_dtype='int8'\)",
     r"momentum in the parameters' dtype \(mu_dtype=None\)"),
])
def test_muon_update_refuses_a_momentum_of_another_format(state_mu, tx_mu, found, keeps):
  """Muon's update refuses a state whose momentum is in another format than
  its mu_dtype, as the AdamW side refuses moments of another format (it
  used to run on, keeping the state's format)."""
  params = {"w": jnp.ones((8, 512)), "b": jnp.ones((256,))}
  state = _init(fo.muon(1e-2, mu_dtype=state_mu), params)
  tx = fo.muon(1e-2, mu_dtype=tx_mu)
  with pytest.raises(ValueError, match=rf"scale_by_muon: the state holds {found} at \['w'\], but "
                                       rf"this optimizer keeps {keeps}: was the state built by "
                                       rf"another optimizer's init\?"):
    tx.update(params, state, params)


@pytest.mark.parametrize("seed", [1.5, True, -1, 2**32, np.float32(2.0), jnp.ones(2, jnp.int32)])
def test_convert_moments_refuses_a_seed_off_the_uint32_rule(seed):
  """docs/validation.md's seed rule: a float, a bool, a non-scalar (TypeError)
  or an integer outside [0, 2**32) (ValueError) is refused naming seed; 1.5
  and True used to act as seed 1, -1 and 2**32 to wrap."""
  _, state = _advanced("float32", _params(), steps=1)
  with pytest.raises((TypeError, ValueError),
                     match=r"convert_moments: seed must be an integer (scalar )?in \[0, 2\*\*32\)"):
    fo.convert_moments(state, "int8", seed=seed)
  fo.convert_moments(state, "int8", seed=2**32 - 1)   # every uint32 is a seed
  fo.convert_moments(state, "int8", seed=np.uint32(7))


@pytest.mark.parametrize("bad", ["int4", "fp8", jnp.uint8, 8])
def test_momentum_dtype_errors_name_momentum_dtype_and_every_value(bad):
  _, state = _advanced("float32", _params(), steps=1)
  with pytest.raises((TypeError, ValueError),
                     match=r"convert_moments: momentum_dtype must be (a dtype \()?a floating dtype "
                           r"\(e\.g\. float32 or bfloat16.*'int8' \(8-bit codes, a scale per block "
                           r"of 256\) or None"):
    fo.convert_moments(state, momentum_dtype=bad)
