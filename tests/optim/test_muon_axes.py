"""muon_weight_dimension_numbers: the Muon/AdamW split from logical axes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fuseopt import optim
from fuseopt.optim import muon_axes
from fuseopt.optim.muon_axes import (BATCH_AXES, HEAD_AXES, LAYER_AXES, SELECTION_AXES,
                                     logical_axes, muon_weight_dimension_numbers)

MDN = optax.contrib.MuonDimensionNumbers


def _one(shape, names, name="kernel", **kw):
  out = muon_weight_dimension_numbers({"m": {name: jnp.zeros(shape)}}, {"m": {name: names}}, **kw)
  return out["m"][name]


def test_constants():
  assert SELECTION_AXES == frozenset({"vocab", "output"})
  assert BATCH_AXES == frozenset({"exp"})
  assert HEAD_AXES == frozenset({"heads", "head_dim", "kv"})
  assert "layers" in LAYER_AXES
  assert optim.muon_weight_dimension_numbers is muon_weight_dimension_numbers
  assert optim.HEAD_AXES is HEAD_AXES


def test_result_type_plugs_into_optax_and_fuseopt():
  dn = _one((4, 6), ("embed", "mlp"))
  assert isinstance(dn, MDN)  # optax.contrib.muon checks isinstance
  assert dn == MDN(0, 1)
  from fuseopt.optim import muon_transforms as fmuon
  assert isinstance(dn, getattr(fmuon, "DIMENSION_NUMBER_TYPES", (MDN,)))
  assert dn == fmuon.MuonDimensionNumbers(0, 1)


@pytest.mark.parametrize("shape,names,leaf", [
    ((8,), ("embed",), "scale"),                      # rank 1
    ((), (), "step"),                                 # scalar
    ((8, 4), ("embed", "mlp"), "bias"),               # named bias, even rank 2
    ((8,), None, "kernel"),                           # undeclared rank 1
])
def test_rank_below_two_and_bias_take_adamw(shape, names, leaf):
  assert _one(shape, names, leaf) is None


@pytest.mark.parametrize("shape,names", [
    ((16, 8), ("vocab", "embed")),          # embedding
    ((8, 16), ("embed", "vocab")),          # LM head
    ((8, 3), ("embed", "output")),          # classifier head
    ((2, 16, 8), ("layers", "vocab", "embed")),
])
def test_selection_axes_take_adamw(shape, names):
  assert _one(shape, names) is None


def test_batch_axes():
  assert _one((3, 8, 16), ("exp", "embed", "mlp")) == MDN(1, 2)
  assert _one((3, 16, 8), ("exp", "mlp", "embed")) == MDN(1, 2)
  assert _one((8, 3, 16), ("embed", "exp", "mlp")) == MDN(0, 2)
  assert _one((2, 3, 8, 16), ("layers", "exp", "embed", "mlp")) == MDN(2, 3)
  assert _one((2, 8, 16), ("layers", "embed", "mlp")) == MDN(1, 2)
  # a layer-stack axis last is still a batch axis, not a router
  assert _one((8, 16, 2), ("embed", "mlp", "layers")) == MDN(0, 1)


@pytest.mark.parametrize("shape,names", [
    ((8, 4), ("embed", "exp")),               # router
    ((2, 8, 4), ("layers", "embed", "exp")),  # stacked router
    ((2, 8), ("layers", "embed")),            # stacked norm scales
    ((4, 8), ("exp", "embed")),               # per-expert vectors
])
def test_routers_and_stacked_vectors_take_adamw(shape, names):
  assert _one(shape, names) is None


def test_head_axes_merge_into_one_side():
  assert _one((8, 2, 4), ("embed", "heads", "head_dim")) == MDN(0, (1, 2))
  assert _one((2, 4, 8), ("heads", "head_dim", "embed")) == MDN((0, 1), 2)
  assert _one((8, 2, 2, 4), ("embed", "kv", "heads", "head_dim")) == MDN(0, (1, 2, 3))
  assert _one((3, 8, 2, 4), ("layers", "embed", "heads", "head_dim")) == MDN(1, (2, 3))
  assert _one((8, 4), ("embed", "heads")) == MDN(0, 1)


def test_undeclared():
  assert _one((4, 6), None) == MDN(0, 1)
  with pytest.raises(ValueError, match=r"m/kernel.*rank 3"):
    _one((2, 4, 6), None)


@pytest.mark.parametrize("shape,names,n", [
    ((2, 4), ("heads", "head_dim"), 1),
    ((8, 16, 2), ("embed", "mlp", "heads"), 3),
    ((2, 8, 16, 4), ("heads", "embed", "mlp", "head_dim"), 4),
])
def test_not_two_sides_raises(shape, names, n):
  with pytest.raises(ValueError, match=rf"m/kernel.*{names[0]}.*{n} matrix sides"):
    _one(shape, names)


def test_rank_mismatch_raises():
  with pytest.raises(ValueError, match=r"m/kernel.*2 axes.*\(3\)"):
    _one((2, 4, 6), ("embed", "mlp"))


def test_configurable_axis_sets():
  with pytest.raises(ValueError):
    _one((2, 8, 16), ("block", "embed", "mlp"))  # 'block' not a layer axis: three sides
  assert _one((2, 8, 16), ("block", "embed", "mlp"), layer_axes={"block"}) == MDN(1, 2)
  assert _one((8, 4), ("embed", "expert"), batch_axes={"expert"}) is None
  assert _one((8, 16), ("embed", "classes"), selection_axes={"classes"}) is None
  with pytest.raises(TypeError, match="head_axes"):
    _one((8, 16), ("embed", "mlp"), head_axes="heads")


class Box:
  """A stand-in for flax's nn.Partitioned: a pytree node with metadata."""

  def __init__(self, value, names):
    self.value, self.names = value, names


jax.tree_util.register_pytree_node(Box, lambda b: ((b.value,), b.names),
                                   lambda names, c: Box(c[0], names))


def _model():
  params = {
      "embed": jnp.zeros((32, 8)),
      "layers": {
          "attn": {"q_proj": {"kernel": jnp.zeros((2, 8, 2, 4)), "bias": jnp.zeros((2, 2, 4))},
                   "o_proj": {"kernel": jnp.zeros((2, 2, 4, 8))}},
          "moe": {"router": {"kernel": jnp.zeros((2, 8, 4))},
                  "wi": jnp.zeros((2, 4, 8, 16)), "wo": jnp.zeros((2, 4, 16, 8))},
          "norm": {"scale": jnp.zeros((2, 8))},
      },
      "final_norm": {"scale": jnp.zeros((8,))},
      "head": {"kernel": jnp.zeros((8, 32))},
  }
  axes = {
      "embed": ("vocab", "embed"),
      "layers": {
          "attn": {"q_proj": {"kernel": ("layers", "embed", "heads", "head_dim"),
                              "bias": ("layers", "heads", "head_dim")},
                   "o_proj": {"kernel": ("layers", "heads", "head_dim", "embed")}},
          "moe": {"router": {"kernel": ("layers", "embed", "exp")},
                  "wi": ("layers", "exp", "embed", "mlp"), "wo": ("layers", "exp", "mlp", "embed")},
          "norm": {"scale": ("layers", "embed")},
      },
      "final_norm": {"scale": ("embed",)},
      "head": {"kernel": ("embed", "vocab")},
  }
  expected = {
      "embed": None,
      "layers": {
          "attn": {"q_proj": {"kernel": MDN(1, (2, 3)), "bias": None},
                   "o_proj": {"kernel": MDN((1, 2), 3)}},
          "moe": {"router": {"kernel": None}, "wi": MDN(2, 3), "wo": MDN(2, 3)},
          "norm": {"scale": None},
      },
      "final_norm": {"scale": None},
      "head": {"kernel": None},
  }
  return params, axes, expected


def test_model_tree_and_boxed_metadata():
  params, axes, expected = _model()
  assert muon_weight_dimension_numbers(params, axes) == expected
  # boxes in the axes tree
  boxed_axes = jax.tree.map(lambda n: Box(None, n), axes,
                            is_leaf=lambda x: isinstance(x, tuple))
  assert muon_weight_dimension_numbers(params, boxed_axes) == expected
  # boxes in params: axes read off them, result shaped like the unboxed tree
  boxed = jax.tree.map(lambda p, n: Box(p, n), params, axes,
                       is_leaf=lambda x: isinstance(x, tuple))
  assert logical_axes(boxed) == axes
  assert muon_weight_dimension_numbers(boxed) == expected
  # PartitionSpecs of logical names
  specs = jax.tree.map(lambda n: jax.sharding.PartitionSpec(*n), axes,
                       is_leaf=lambda x: isinstance(x, tuple))
  assert muon_weight_dimension_numbers(params, specs) == expected
  # no axes on a plain tree: every leaf undeclared
  assert muon_weight_dimension_numbers({"w": jnp.zeros((4, 6)), "b": jnp.zeros(6)}) == {
      "w": MDN(0, 1), "b": None}


def test_mismatched_structure_raises():
  params, axes, _ = _model()
  del axes["head"]
  with pytest.raises(ValueError, match="structure of `params`"):
    muon_weight_dimension_numbers(params, axes)
  params, axes, _ = _model()
  axes["head"] = {"kernel": {"x": ("embed", "vocab")}}
  with pytest.raises(ValueError, match="head/kernel"):
    muon_weight_dimension_numbers(params, axes)
  params, axes, _ = _model()
  axes["head"] = ("embed", "vocab")  # a leaf where params has a subtree
  with pytest.raises(ValueError, match="structure of `params`"):
    muon_weight_dimension_numbers(params, axes)
  params, axes, _ = _model()
  axes["head"]["kernel"] = ("embed", 3)
  with pytest.raises(ValueError, match="head/kernel"):
    muon_weight_dimension_numbers(params, axes)


def _run(opt, params, grads_list):
  state = opt.init(params)
  update = jax.jit(opt.update)
  outs = []
  for g in grads_list:
    u, state = update(g, state, params)
    params = optax.apply_updates(params, u)
    outs.append(u)
  return outs


def test_heads_update_equals_flat_matrix_update_optax():
  """[embed, heads, head_dim] gets exactly the update of [embed, heads*head_dim]."""
  rng = np.random.default_rng(0)
  e, h, d = 16, 4, 8
  w = jnp.asarray(rng.standard_normal((e, h, d)), jnp.float32)
  grads = [jnp.asarray(rng.standard_normal((e, h, d)), jnp.float32) for _ in range(2)]
  params3 = {"q": {"kernel": w}, "o": {"kernel": w.transpose(1, 2, 0)}}
  axes = {"q": {"kernel": ("embed", "heads", "head_dim")},
          "o": {"kernel": ("heads", "head_dim", "embed")}}
  dn = muon_weight_dimension_numbers(params3, axes)
  opt3 = optax.contrib.muon(0.1, ns_steps=2, muon_weight_dimension_numbers=dn)
  out3 = _run(opt3, params3, [{"q": {"kernel": g}, "o": {"kernel": g.transpose(1, 2, 0)}}
                              for g in grads])
  params2 = {"q": {"kernel": w.reshape(e, h * d)}, "o": {"kernel": w.transpose(1, 2, 0).reshape(h * d, e)}}
  opt2 = optax.contrib.muon(0.1, ns_steps=2)
  out2 = _run(opt2, params2, [{"q": {"kernel": g.reshape(e, h * d)},
                               "o": {"kernel": g.transpose(1, 2, 0).reshape(h * d, e)}}
                              for g in grads])
  for u3, u2 in zip(out3, out2):
    np.testing.assert_allclose(u3["q"]["kernel"].reshape(e, h * d), u2["q"]["kernel"],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(u3["o"]["kernel"].reshape(h * d, e), u2["o"]["kernel"],
                               rtol=1e-5, atol=1e-6)
    # and not the per-head (vmapped) orthogonalisation
  per_head = optax.contrib.muon(0.1, ns_steps=2, muon_weight_dimension_numbers={
      "q": {"kernel": MDN(0, 2)}, "o": {"kernel": MDN(1, 2)}})
  out_ph = _run(per_head, params3, [{"q": {"kernel": g}, "o": {"kernel": g.transpose(1, 2, 0)}}
                                    for g in grads[:1]])
  assert not np.allclose(out_ph[0]["q"]["kernel"], out3[0]["q"]["kernel"], atol=1e-4)


def test_fuseopt_muon_accepts_the_tree():
  from fuseopt.optim import muon_transforms as fmuon
  rng = np.random.default_rng(1)
  e, h, d = 16, 4, 8
  w = jnp.asarray(rng.standard_normal((e, h, d)), jnp.float32)
  g = jnp.asarray(rng.standard_normal((e, h, d)), jnp.float32)
  dn = muon_weight_dimension_numbers({"q": w}, {"q": ("embed", "heads", "head_dim")})
  opt3 = fmuon.muon(0.1, muon_weight_dimension_numbers=dn)
  u3 = _run(opt3, {"q": w}, [{"q": g}])[0]["q"]
  u2 = _run(fmuon.muon(0.1), {"q": w.reshape(e, h * d)}, [{"q": g.reshape(e, h * d)}])[0]["q"]
  np.testing.assert_allclose(u3.reshape(e, h * d), u2, rtol=2e-2, atol=2e-3)
  as_fn = fmuon.muon(0.1, muon_weight_dimension_numbers=functools.partial(
      muon_weight_dimension_numbers, axes={"q": ("embed", "heads", "head_dim")}))
  np.testing.assert_array_equal(_run(as_fn, {"q": w}, [{"q": g}])[0]["q"], u3)


def test_model_tree_through_optax_muon():
  """AdamW leaves get Adam's first step (a constant times -sign(g)); Muon
  leaves do not."""
  params, axes, expected = _model()
  rng = np.random.default_rng(2)
  params = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params)
  grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params)
  dn = muon_weight_dimension_numbers(params, axes)
  lr = 0.01
  opt = optax.contrib.muon(lr, ns_steps=1, muon_weight_dimension_numbers=dn, eps=1e-12)
  updates, _ = jax.jit(opt.update)(grads, opt.init(params), params)
  flat_u = jax.tree_util.tree_flatten_with_path(updates)[0]
  flat_g = jax.tree.leaves(grads)
  flat_dn = jax.tree.leaves(jax.tree.map(lambda x: x is None, expected,
                                         is_leaf=lambda x: x is None or isinstance(x, MDN)))
  assert len(flat_u) == len(flat_g) == len(flat_dn)
  for (path, u), g, is_adam in zip(flat_u, flat_g, flat_dn):
    u = np.asarray(u)
    sign_step = -np.abs(u).max() * np.sign(np.asarray(g))
    if is_adam:
      np.testing.assert_allclose(u, sign_step, rtol=1e-4, err_msg=jax.tree_util.keystr(path))
    else:
      assert not np.allclose(u, sign_step, rtol=1e-2), jax.tree_util.keystr(path)


def test_module_exports():
  assert set(muon_axes.__all__) >= {"muon_weight_dimension_numbers", "SELECTION_AXES",
                                    "BATCH_AXES", "HEAD_AXES", "LAYER_AXES", "logical_axes"}


def test_callable_form_in_optax_muon():
  """optax.contrib.muon calls a callable spec with its masked updates too."""
  rng = np.random.default_rng(3)
  params = {"q": jnp.asarray(rng.standard_normal((4, 2, 3)), jnp.float32),
            "emb": jnp.asarray(rng.standard_normal((10, 4)), jnp.float32),
            "b": jnp.ones(3)}
  axes = {"q": ("embed", "heads", "head_dim"), "emb": ("vocab", "embed"), "b": None}
  as_tree = optax.contrib.muon(0.1, ns_steps=1,
                               muon_weight_dimension_numbers=muon_weight_dimension_numbers(params, axes))
  as_fn = optax.contrib.muon(0.1, ns_steps=1, muon_weight_dimension_numbers=functools.partial(
      muon_weight_dimension_numbers, axes=axes))
  u_tree = _run(as_tree, params, [params])[0]
  u_fn = _run(as_fn, params, [params])[0]
  jax.tree.map(np.testing.assert_array_equal, u_fn, u_tree)


# ------------------------------------------- PyTorch's (out, in) layout ----
TORCH = optim.MuonDimensionNumbers(1, 0)   # reduction axis last: y = x @ W.T


@pytest.mark.parametrize("make", [optim.muon, optim.normuon], ids=["muon", "normuon"])
@pytest.mark.parametrize("shape", [(24, 16), (16, 16), (16, 24)])
def test_torch_layout_runs_under_jit_with_bf16_newton_schulz(make, shape):
  """(24, 16) with the output axis first crashed under jit on the CPU
  ("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32"):
  XLA:CPU folded the transpose into the first Gram product after choosing
  how to run it. The update is the standard layout's on the transposed leaf."""
  w = jax.random.normal(jax.random.key(0), shape) * 0.1
  g = jax.random.normal(jax.random.key(1), shape)
  tx = make(0.02, muon_weight_dimension_numbers={"w": TORCH})
  state = tx.init({"w": w})
  u, _ = jax.jit(tx.update)({"w": g}, state, {"w": w})
  new_w, _ = jax.jit(lambda g, s, p: optim.step(tx, g, s, p))({"w": g}, state, {"w": w})
  assert np.isfinite(np.asarray(u["w"])).all() and np.isfinite(np.asarray(new_w["w"])).all()
  std = make(0.02, muon_weight_dimension_numbers={"w": optim.MuonDimensionNumbers(0, 1)})
  u_t, _ = jax.jit(std.update)({"w": g.T}, std.init({"w": w.T}), {"w": w.T})
  # bf16 iterates: the two layouts may round an element differently.
  np.testing.assert_allclose(np.asarray(u["w"]), np.asarray(u_t["w"]).T, atol=2e-4)


def test_transposed_2d_matrix_runs_in_the_newton_schulz_reference_under_jit():
  """The op-level form of the crash: a 2-D transpose turned into a batch of one."""
  from fuseopt.kernels.newton_schulz import newton_schulz_reference
  x = jax.random.normal(jax.random.key(2), (24, 16))
  f = lambda x: newton_schulz_reference(x.T[None], coeffs="jordan")
  got = np.asarray(jax.jit(f)(x))
  np.testing.assert_allclose(got, np.asarray(f(x)), atol=2e-3)   # eager always ran
