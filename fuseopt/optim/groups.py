"""Parameter groups: which parameters move at which rate and decay.

A parameter's *path* is its pytree keys joined by ``'/'``
(``layers_3/self_attn/q_proj/kernel``); groups select parameters with
:func:`fnmatch.fnmatchcase` patterns over that path, where ``*`` crosses
``'/'``. A parameter joins the first group that has a matching pattern
(lm-engine's rule, ``lm_engine/optimization/params_group.py``), and a parameter
no group matches raises rather than silently taking a default rate.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import Any, Callable, Sequence

import jax
import optax

__all__ = [
    "NO_DECAY_PATTERNS",
    "ParamGroup",
    "is_masked",
    "key_name",
    "match_group",
    "matches_any",
    "mup_param_groups",
    "param_labels",
    "path_str",
    "tree_paths",
    "validate_groups",
]

# lm-engine's no_weight_decay group (configs/param-groups/mup.yml): biases,
# every norm's weight (an RMSNorm keeps `scale` in flax, Mamba-2's gated norm
# keeps `norm/weight`) and Mamba-2's dt_bias.
NO_DECAY_PATTERNS = ("*/bias", "*/scale", "*norm/weight", "*/dt_bias")

# Token (and learned position) embeddings under the names flax, HF Llama and
# GPT-2 style trees give them.
# A flax nn.Embed's table is the leaf `embedding`.
EMBEDDING_PATTERNS = ("*embed_tokens/*", "*tok_embeddings/*", "*wte/*", "*wpe/*", "embedding", "*/embedding")


def is_masked(x) -> bool:
  """True for :class:`optax.MaskedNode`, optax's placeholder for a leaf that
  belongs to another partition (``optax.partition``, ``optax.masked``):
  callables given a partition's view of a tree meet it where a leaf was."""
  return isinstance(x, optax.MaskedNode)


def key_name(key) -> str:
  """One pytree key as a path component: a dict key, an attribute name or an index."""
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def path_str(keypath: Sequence[Any]) -> str:
  """A key path (from :func:`jax.tree_util.tree_flatten_with_path`) as ``'a/b/c'``.

  A trailing attribute key ``value`` is dropped: it is the array inside a
  flax nnx ``Variable``, which ``nnx.Optimizer`` passes to ``init`` wrapped
  and to ``update`` bare, so both see ``blocks/0/fc1/bias``."""
  keypath = list(keypath)
  if keypath and isinstance(keypath[-1], jax.tree_util.GetAttrKey) and keypath[-1].name == "value":
    keypath.pop()
  return "/".join(key_name(k) for k in keypath)


def tree_paths(tree) -> Any:
  """A tree shaped like ``tree`` whose leaves are their own path strings."""
  return jax.tree_util.tree_map_with_path(lambda kp, _: path_str(kp), tree)


def matches_any(path: str, patterns: Sequence[str]) -> bool:
  return any(fnmatch.fnmatchcase(path, p) for p in patterns)


@dataclasses.dataclass(frozen=True)
class ParamGroup:
  """Parameters the optimizer moves at their own learning rate and decay.

  Attributes:
    name: unique among a config's groups; the optax.partition label.
    patterns: fnmatch patterns over the parameter's path (``*`` crosses ``'/'``).
    learning_rate_multiplier: the group's rate is the schedule's times this (> 0).
    weight_decay: replaces the config's decay for this group; None keeps it.
  """

  name: str
  patterns: tuple[str, ...]
  learning_rate_multiplier: float = 1.0
  weight_decay: float | None = None

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"ParamGroup.name must be a non-empty string, got {self.name!r}")
    patterns = self.patterns
    if isinstance(patterns, str):
      patterns = (patterns,)
    try:
      patterns = tuple(patterns)
    except TypeError:
      raise ValueError(f"ParamGroup {self.name!r}: patterns must be a sequence of strings, got {self.patterns!r}") from None
    if not patterns:
      raise ValueError(f"ParamGroup {self.name!r}: patterns is empty; give at least one pattern, e.g. ('*',)")
    if not all(isinstance(p, str) and p for p in patterns):
      raise ValueError(f"ParamGroup {self.name!r}: patterns must be non-empty strings, got {patterns!r}")
    object.__setattr__(self, "patterns", patterns)
    m = self.learning_rate_multiplier
    if isinstance(m, bool) or not isinstance(m, (int, float)) or not (m > 0 and math.isfinite(m)):
      raise ValueError(f"ParamGroup {self.name!r}: learning_rate_multiplier must be a finite number > 0, "
                       f"got {m!r}")
    object.__setattr__(self, "learning_rate_multiplier", float(m))
    wd = self.weight_decay
    if wd is not None:
      if isinstance(wd, bool) or not isinstance(wd, (int, float)) or not (wd >= 0 and math.isfinite(wd)):
        raise ValueError(f"ParamGroup {self.name!r}: weight_decay must be a finite number >= 0 or None, "
                         f"got {wd!r}")
      object.__setattr__(self, "weight_decay", float(wd))

  def matches(self, path: str) -> bool:
    return matches_any(path, self.patterns)

  def to_dict(self) -> dict[str, Any]:
    return {"name": self.name, "patterns": list(self.patterns),
            "learning_rate_multiplier": self.learning_rate_multiplier, "weight_decay": self.weight_decay}

  @classmethod
  def from_dict(cls, d) -> "ParamGroup":
    if isinstance(d, ParamGroup):
      return d
    if not isinstance(d, dict):
      raise ValueError(f"a param group must be a mapping of ParamGroup fields, got {d!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
      raise ValueError(f"ParamGroup got unknown field(s) {unknown}; its fields are {sorted(names)}")
    try:
      return cls(**d)
    except TypeError as e:
      raise ValueError(f"ParamGroup: {e}") from None


def validate_groups(groups: Sequence[ParamGroup]) -> tuple[ParamGroup, ...]:
  groups = tuple(ParamGroup.from_dict(g) for g in groups)
  seen = set()
  for g in groups:
    if g.name in seen:
      raise ValueError(f"param group names must be unique; {g.name!r} appears twice")
    seen.add(g.name)
  return groups


def match_group(path: str, groups: Sequence[ParamGroup]) -> ParamGroup:
  """The first group with a pattern matching ``path``; raises if none does."""
  for g in groups:
    if g.matches(path):
      return g
  raise ValueError(f"parameter {path!r} matches no param group ({[g.name for g in groups]}); "
                   "add a catch-all last, e.g. ParamGroup('rest', ('*',))")


def param_labels(groups: Sequence[ParamGroup]) -> Callable[[Any], Any]:
  """The :func:`optax.partition` labeller: each leaf's first matching group's name."""
  groups = validate_groups(groups)

  def labels(params):
    return jax.tree_util.tree_map_with_path(lambda kp, _: match_group(path_str(kp), groups).name, params)

  return labels


def mup_param_groups(width_multiplier: float) -> tuple[ParamGroup, ...]:
  """lm-engine's muP parameter groups (``params_group_method: mup``), in its order.

  1. ``no_weight_decay``: :data:`NO_DECAY_PATTERNS` (biases, norm weights,
     dt_bias) at the base rate with decay 0;
  2. ``embeddings``: the token (and position) embeddings at the base rate
     with the config's decay;
  3. ``mup``: everything else, attention/MLP/MoE matrices and the router,
     Mamba-2's A_log, D and conv taps included, at base rate /
     ``width_multiplier`` (lm-engine's ``m_width``) with the config's decay.

  Tied output heads share the embedding and so its group; an untied head
  falls into ``mup``.
  """
  if (isinstance(width_multiplier, bool) or not isinstance(width_multiplier, (int, float))
      or not (width_multiplier > 0 and math.isfinite(width_multiplier))):
    raise ValueError(f"mup_param_groups: width_multiplier must be a finite number > 0, got {width_multiplier!r}")
  return (
      ParamGroup("no_weight_decay", NO_DECAY_PATTERNS, 1.0, 0.0),
      ParamGroup("embeddings", EMBEDDING_PATTERNS, 1.0, None),
      ParamGroup("mup", ("*",), 1.0 / float(width_multiplier), None),
  )
