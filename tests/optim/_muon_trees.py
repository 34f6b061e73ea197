"""Small Llama/MoE-shaped trees shared by the Muon tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fuseopt.optim.muon_transforms import MuonDimensionNumbers as MDN

D, H, HD, FF, V, L = 32, 4, 4, 48, 64, 2


def llama_tree(key, dtype=jnp.float32):
  """Params with a stacked-layers axis, multi-axis attention leaves, a
  per-layer leaf of the same matrix shape as a stacked one, and AdamW leaves."""
  shapes = {
      "embed": (V, D),
      "layers": {
          "wq": (L, D, H, HD), "wk": (L, D, H, HD), "wo": (L, H, HD, D),
          "gate": (L, D, FF), "up": (L, D, FF), "down": (L, FF, D), "norm": (L, D),
      },
      "extra_mlp": {"gate": (D, FF), "down": (FF, D)},
      "final_norm": (D,),
      "head": (D, V),
  }
  leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
  keys = jax.random.split(key, len(leaves))
  return treedef.unflatten([jax.random.normal(k, s, dtype) * 0.1 for k, s in zip(keys, leaves)])


def llama_dims(params):
  """Muon dimension numbers for :func:`llama_tree` (None → AdamW)."""
  del params
  return {
      "embed": None,
      "layers": {
          "wq": MDN(1, (2, 3)), "wk": MDN(1, (2, 3)), "wo": MDN((1, 2), 3),
          "gate": MDN(1, 2), "up": MDN(1, 2), "down": MDN(1, 2), "norm": None,
      },
      "extra_mlp": {"gate": MDN(0, 1), "down": MDN(0, 1)},
      "final_norm": None,
      "head": None,
  }


def optax_dims(dims):
  """The same tree with optax's own MuonDimensionNumbers."""
  import optax
  return jax.tree.map(lambda d: None if d is None else optax.contrib.MuonDimensionNumbers(*d), dims,
                      is_leaf=lambda x: x is None or isinstance(x, MDN))
