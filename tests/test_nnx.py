"""flax nnx: parameter groups, logical axes and Muon's split on nnx state, the
fused step through fuseopt.nnx.Optimizer, and the builder's Muon fields."""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

nnx = pytest.importorskip("flax.nnx")

import fuseopt.nnx as fnnx  # noqa: E402
import fuseopt.optim as fo  # noqa: E402
from fuseopt.optim import muon_axes  # noqa: E402
from fuseopt.optim.groups import path_str  # noqa: E402

MDN = fo.MuonDimensionNumbers
P = nnx.with_partitioning
_INIT = nnx.initializers.lecun_normal()


class Block(nnx.Module):

  def __init__(self, d, rngs):
    self.attn = nnx.LinearGeneral(d, (2, d // 2), rngs=rngs, kernel_init=P(_INIT, ("embed", "heads", "head_dim")))
    self.fc1 = nnx.Linear(d, 2 * d, rngs=rngs, kernel_init=P(_INIT, ("embed", "mlp")))
    self.norm = nnx.RMSNorm(d, rngs=rngs)


class Model(nnx.Module):

  def __init__(self, rngs, d=8, vocab=16):
    self.embed = nnx.Embed(vocab, d, rngs=rngs, embedding_init=P(nnx.initializers.normal(), ("vocab", "embed")))
    self.blocks = nnx.List([Block(d, rngs)])  # a list: integer keys in the paths

  def __call__(self, x):
    h = self.embed(x)
    for b in self.blocks:
      h = h + b.attn(b.norm(h)).reshape(h.shape)
      h = h + b.fc1(h)[..., :h.shape[-1]]
    return self.embed.attend(h)


X = np.arange(12).reshape(2, 6) % 16
Y = (X + 1) % 16


def _loss(model_or_params, x=X, y=Y):
  return optax.softmax_cross_entropy_with_integer_labels(model_or_params(x), y).mean()


@pytest.fixture(autouse=True)
def _no_eager_sharding():
  # with_partitioning names logical axes; without a mesh, keep them as metadata only.
  with nnx.use_eager_sharding(False):
    yield


def _model():
  return Model(nnx.Rngs(0))


def _train_nnx(tx, cls, steps=2):
  model = _model()
  opt = cls(model, tx, wrt=nnx.Param)

  @nnx.jit
  def train(model, opt):
    loss, grads = nnx.value_and_grad(_loss)(model)
    opt.update(model, grads)
    return loss

  losses = [float(train(model, opt)) for _ in range(steps)]
  return losses, nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _train_pure(tx, steps=2):
  """The same model as a pure function of a nested dict, optax's way."""
  model = _model()
  graphdef, state = nnx.split(model, nnx.Param)
  params = nnx.to_pure_dict(state)

  def loss(params):
    s = jax.tree.map(lambda x: x, state)
    nnx.replace_by_pure_dict(s, params)
    return _loss(nnx.merge(graphdef, s))

  opt_state = tx.init(params)

  @jax.jit
  def train(params, opt_state):
    l, g = jax.value_and_grad(loss)(params)
    u, opt_state = tx.update(g, opt_state, params)
    return l, optax.apply_updates(params, u), opt_state

  losses = []
  for _ in range(steps):
    l, params, opt_state = train(params, opt_state)
    losses.append(float(l))
  return losses, params


def _flat(tree):
  return {path_str(kp): np.asarray(x) for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _assert_close(a, b, rtol=1e-6, atol=1e-7):
  fa, fb = _flat(a), _flat(b)
  assert fa.keys() == fb.keys()
  for k in fa:
    np.testing.assert_allclose(fa[k], fb[k], rtol=rtol, atol=atol, err_msg=k)


def test_param_labels_strip_nnx_value_segment():
  state = nnx.state(_model(), nnx.Param)
  labeller = fo.param_labels(fo.mup_param_groups(2.0))
  at_init = _flat(jax.tree.map(lambda s: np.asarray(0), labeller(state)))  # paths only
  labels_init = {path_str(kp): l for kp, l in jax.tree_util.tree_flatten_with_path(labeller(state))[0]}
  labels_update = {path_str(kp): l for kp, l in
                   jax.tree_util.tree_flatten_with_path(labeller(nnx.as_pure(state)))[0]}
  assert labels_init == labels_update and set(at_init) == set(labels_init)
  assert labels_init["blocks/0/fc1/bias"] == "no_weight_decay"
  assert labels_init["blocks/0/norm/scale"] == "no_weight_decay"
  assert labels_init["embed/embedding"] == "embeddings"
  assert labels_init["blocks/0/attn/kernel"] == "mup"


def test_logical_axes_and_dimension_numbers_read_nnx_metadata():
  model = _model()
  axes = {path_str(kp): a for kp, a in jax.tree_util.tree_flatten_with_path(
      fo.logical_axes(nnx.state(model, nnx.Param)), is_leaf=lambda x: x is None or isinstance(x, tuple))[0]}
  assert axes["embed/embedding"] == ("vocab", "embed")
  assert axes["blocks/0/attn/kernel"] == ("embed", "heads", "head_dim")
  assert axes["blocks/0/fc1/bias"] is None
  dims = fnnx.muon_dimension_numbers(model)
  got = {path_str(kp): d for kp, d in jax.tree_util.tree_flatten_with_path(
      dims, is_leaf=lambda x: x is None or isinstance(x, MDN))[0]}
  assert got["embed/embedding"] is None                    # a vocab axis: AdamW
  assert got["blocks/0/attn/kernel"] == MDN(0, (1, 2))     # [embed, heads*head_dim]
  assert got["blocks/0/fc1/kernel"] == MDN(0, 1)
  assert got["blocks/0/fc1/bias"] is None and got["blocks/0/norm/scale"] is None


def _hand_dims():
  block = {"attn": {"kernel": MDN(0, (1, 2)), "bias": None}, "fc1": {"kernel": MDN(0, 1), "bias": None},
           "norm": {"scale": None}}
  return {"embed": {"embedding": None}, "blocks": {0: block}}


def test_muon_dimension_numbers_dict_callable_and_state_on_nnx():
  # fp32 NS: the fused step rounds its NS input to the NS dtype before the
  # normalisation, update() after it; in fp32 both agree to fp32 rounding.
  ref_losses, ref = _train_pure(fo.muon(1e-2, muon_weight_dimension_numbers=_hand_dims(), execution=fo.Execution(newton_schulz=fo.NewtonSchulz(dtype=jnp.float32))))
  for dims, cls in ((_hand_dims(), nnx.Optimizer),  # a plain dict on nnx state
                    (muon_axes.logical_axes_dimension_numbers(), fnnx.Optimizer),  # the callable form
                    (fnnx.muon_dimension_numbers(_model()), fnnx.Optimizer)):
    losses, params = _train_nnx(fo.muon(1e-2, muon_weight_dimension_numbers=dims, execution=fo.Execution(newton_schulz=fo.NewtonSchulz(dtype=jnp.float32))), cls)
    if cls is nnx.Optimizer:
      np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
      _assert_close(params, ref)
    else:  # the fused step: equal to update + apply_updates up to fp32 rounding
      np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
      _assert_close(params, ref, rtol=1e-5, atol=1e-6)


def test_fused_step_through_nnx_optimizer():
  tx = fo.adamw(1e-2, weight_decay=0.1)
  ref_losses, ref = _train_nnx(tx, nnx.Optimizer)
  # The fused step builds no updates tree: optax.apply_updates is never called.
  with mock.patch.object(optax, "apply_updates", side_effect=AssertionError("not fused")):
    losses, params = _train_nnx(tx, fnnx.Optimizer)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
  _assert_close(params, ref, rtol=1e-5, atol=1e-6)


YAML = """
optimizer: muon
learning_rate: 0.02
adam_learning_rate: 3.0e-3
muon_logical_axes: true
weight_decay: 0.1
moment_dtype: bfloat16
param_groups:
  - {name: no_decay, patterns: ['*/bias', '*/scale'], weight_decay: 0.0}
  - {name: rest, patterns: ['*']}
clip_norm: 1.0
"""


def test_builder_yaml_muon_split_and_adam_rate_on_nnx():
  config = fo.OptimConfig.from_yaml(YAML)
  assert fo.OptimConfig.from_yaml(config.to_yaml()) == config
  explicit = config.override("muon_logical_axes=false")
  # fp32 NS on both sides: the fused step (fuseopt.nnx.Optimizer) rounds the
  # NS input before its normalisation, update() after it.
  explicit = fo.OptimConfig.from_dict({**explicit.to_dict(),
                                       "optimizer_kwargs": {"muon_weight_dimension_numbers": _hand_dims(),
                                                            "execution": {"newton_schulz": {"dtype": "float32"}}}})
  fp32_ns = fo.OptimConfig.from_dict({**config.to_dict(), "optimizer_kwargs": {"execution": {"newton_schulz": {"dtype": "float32"}}}})
  ref_losses, ref = _train_pure(fo.build_optimizer(explicit, steps=10))
  losses, params = _train_nnx(fo.build_optimizer(fp32_ns, steps=10), fnnx.Optimizer)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  _assert_close(params, ref, rtol=1e-5, atol=1e-6)
  # The AdamW side has its own rate: at 0 only Muon's matrices move.
  frozen_adam = config.override("adam_schedule={kind: constant, peak: 0.0}")
  assert frozen_adam.adam_learning_rate is None
  _, params = _train_nnx(fo.build_optimizer(frozen_adam, steps=10), fnnx.Optimizer)
  init = _flat(nnx.to_pure_dict(nnx.state(_model(), nnx.Param)))
  moved = {k for k, v in _flat(params).items() if not np.array_equal(v, init[k])}
  assert moved == {"blocks/0/attn/kernel", "blocks/0/fc1/kernel"}


def test_builder_muon_patterns():
  config = fo.OptimConfig(optimizer="muon", learning_rate=0.02, adam_learning_rate=0.0,
                          muon_patterns=("*fc1/kernel",))
  _, params = _train_nnx(fo.build_optimizer(config, steps=10), fnnx.Optimizer)
  init = _flat(nnx.to_pure_dict(nnx.state(_model(), nnx.Param)))
  moved = {k for k, v in _flat(params).items() if not np.array_equal(v, init[k])}
  assert moved == {"blocks/0/fc1/kernel"}  # the rank-3 attention kernel matches no pattern


@pytest.mark.parametrize("fields, match", [
    ({"optimizer": "adamw", "adam_learning_rate": 1e-3}, "adam_learning_rate: only for optimizers \\('muon'"),
    ({"optimizer": "muon", "adam_learning_rate": 1e-3, "adam_schedule": {"kind": "constant", "peak": 1e-3}},
     "give at most one"),
    ({"optimizer": "muon", "muon_patterns": ["*"], "muon_logical_axes": True}, "give at most one"),
    ({"optimizer": "muon", "muon_axis_rules": {"head_axes": ["heads"]}}, "only with muon_logical_axes"),
    ({"optimizer": "muon", "muon_logical_axes": True, "muon_axis_rules": {"head_axis": ["heads"]}},
     "did you mean 'head_axes'"),
    ({"optimizer": "muon", "muon_patterns": []}, "muon_patterns must be a non-empty sequence"),
])
def test_builder_muon_fields_validation(fields, match):
  with pytest.raises(ValueError, match=match):
    fo.OptimConfig(learning_rate=0.01, **fields)
