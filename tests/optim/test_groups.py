"""Parameter groups: paths, the first-match rule, and lm-engine's muP split.

lm-engine's muP split (``params_group_method: mup``,
``lm_engine/optimization/params_group.py``, ``configs/param-groups/mup.yml``)
puts every parameter in one of three groups, in this order:

1. ``no_weight_decay``: biases, the weight (flax: ``scale``) of every norm,
   RMSNorm and Mamba-2's gated norm alike, and Mamba-2's ``dt_bias``; base
   learning rate, weight decay 0.
2. ``embeddings``: the token embeddings (lm-engine's "normal" group); base
   learning rate, the config's weight decay.
3. ``mup``: every other weight, attention and MLP matrices, the MoE router,
   the untied LM head, Mamba-2's in/out projections, conv taps, ``A_log``
   and ``D``; learning rate / ``m_width``, the config's weight decay.
"""

import jax
import jax.numpy as jnp
import pytest

from fuseopt.optim import groups as G

Z = jax.ShapeDtypeStruct  # labels need shapes only, never values


def llama_tree(d=8, vocab=32, moe=False):
  def layer():
    mlp = {"gate_proj": {"kernel": Z((d, 2 * d), jnp.float32)},
           "up_proj": {"kernel": Z((d, 2 * d), jnp.float32)},
           "down_proj": {"kernel": Z((2 * d, d), jnp.float32)}}
    if moe:
      mlp["router"] = {"kernel": Z((d, 4), jnp.float32)}
    return {
        "input_layernorm": {"scale": Z((d,), jnp.float32)},
        "self_attn": {n: {"kernel": Z((d, d), jnp.float32)} for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
                     | {"q_proj_bias": {"bias": Z((d,), jnp.float32)}},
        "post_attention_layernorm": {"scale": Z((d,), jnp.float32)},
        "mlp": mlp,
    }

  return {"model": {"embed_tokens": {"embedding": Z((vocab, d), jnp.float32)},
                    "layers_0": layer(), "layers_1": layer(),
                    "norm": {"scale": Z((d,), jnp.float32)}},
          "lm_head": {"kernel": Z((d, vocab), jnp.float32)}}


def mamba_tree(d=8, vocab=32):
  mixer = {"in_proj": {"kernel": Z((d, 4 * d), jnp.float32)},
           "conv1d": {"kernel": Z((4, 1, 2 * d), jnp.float32), "bias": Z((2 * d,), jnp.float32)},
           "dt_bias": Z((2,), jnp.float32), "A_log": Z((2,), jnp.float32), "D": Z((2,), jnp.float32),
           "norm": {"weight": Z((2 * d,), jnp.float32)},
           "out_proj": {"kernel": Z((2 * d, d), jnp.float32)}}
  return {"embeddings": {"embedding": Z((vocab, d), jnp.float32)},
          "layers": [{"norm": {"scale": Z((d,), jnp.float32)}, "mixer": mixer}],
          "final_norm": {"scale": Z((d,), jnp.float32)}}


def labelled(tree, groups):
  labels = G.param_labels(groups)(tree)
  return {G.path_str(kp): lab for kp, lab in jax.tree_util.tree_flatten_with_path(labels)[0]}


def test_path_str_and_tree_paths():
  tree = {"a": {"b": [1, {"c": 2}]}}
  assert jax.tree.leaves(G.tree_paths(tree)) == ["a/b/0", "a/b/1/c"]


def test_star_crosses_slashes():
  g = G.ParamGroup("x", ("model*kernel",))
  assert g.matches("model/layers_0/self_attn/q_proj/kernel")
  assert not g.matches("lm_head/kernel")


def test_mup_split_on_llama():
  groups = G.mup_param_groups(4.0)
  assert [g.name for g in groups] == ["no_weight_decay", "embeddings", "mup"]
  assert [g.learning_rate_multiplier for g in groups] == [1.0, 1.0, 0.25]
  assert [g.weight_decay for g in groups] == [0.0, None, None]
  labels = labelled(llama_tree(moe=True), groups)
  expected_nwd = {p for p in labels if p.endswith(("/scale", "/bias"))}
  assert {p for p, l in labels.items() if l == "no_weight_decay"} == expected_nwd
  assert "model/norm/scale" in expected_nwd and "model/layers_1/input_layernorm/scale" in expected_nwd
  assert {p for p, l in labels.items() if l == "embeddings"} == {"model/embed_tokens/embedding"}
  mup = {p for p, l in labels.items() if l == "mup"}
  assert mup == {p for p in labels if p.endswith("/kernel")}
  assert "model/layers_0/mlp/router/kernel" in mup and "lm_head/kernel" in mup
  assert len(labels) == len(expected_nwd) + 1 + len(mup)


def test_mup_split_on_mamba():
  labels = labelled(mamba_tree(), G.mup_param_groups(2.0))
  m = "layers/0/mixer/"
  assert labels == {
      "embeddings/embedding": "embeddings",
      "layers/0/norm/scale": "no_weight_decay",
      m + "in_proj/kernel": "mup",
      m + "conv1d/kernel": "mup",          # conv taps: muP rate
      m + "conv1d/bias": "no_weight_decay",
      m + "dt_bias": "no_weight_decay",
      m + "A_log": "mup",
      m + "D": "mup",
      m + "norm/weight": "no_weight_decay",  # Mamba-2's gated norm
      m + "out_proj/kernel": "mup",
      "final_norm/scale": "no_weight_decay",
  }


def test_first_match_wins():
  groups = [G.ParamGroup("attn", ("*self_attn*",), 2.0),
            G.ParamGroup("kernels", ("*kernel",), 3.0),
            G.ParamGroup("rest", ("*",))]
  labels = labelled(llama_tree(), groups)
  assert labels["model/layers_0/self_attn/q_proj/kernel"] == "attn"  # matches both; the first wins
  assert labels["model/layers_0/mlp/up_proj/kernel"] == "kernels"
  assert labels["model/norm/scale"] == "rest"
  assert G.match_group("a/kernel", groups).learning_rate_multiplier == 3.0


def test_unmatched_raises_and_suggests_catch_all():
  groups = [G.ParamGroup("kernels", ("*kernel",))]
  with pytest.raises(ValueError, match=r"model/embed_tokens/embedding.*\('\*',\)"):
    G.param_labels(groups)(llama_tree())


@pytest.mark.parametrize("make,match", [
    (lambda: G.ParamGroup("a", ()), "patterns is empty"),
    (lambda: G.ParamGroup("a", ("*",), 0.0), "learning_rate_multiplier"),
    (lambda: G.ParamGroup("a", ("*",), -1.0), "learning_rate_multiplier"),
    (lambda: G.ParamGroup("a", ("*",), weight_decay=-0.1), "weight_decay"),
    (lambda: G.ParamGroup("", ("*",)), "name"),
    (lambda: G.validate_groups([G.ParamGroup("a", ("*x",)), G.ParamGroup("a", ("*",))]), "unique"),
    (lambda: G.mup_param_groups(0.0), "width_multiplier"),
    (lambda: G.ParamGroup.from_dict({"name": "a", "patterns": ["*"], "lr": 2.0}), "unknown field"),
])
def test_bad_groups_raise(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_group_dict_round_trip_and_string_pattern():
  g = G.ParamGroup("a", "*kernel", 0.5, 0.0)
  assert g.patterns == ("*kernel",)
  assert G.ParamGroup.from_dict(g.to_dict()) == g
