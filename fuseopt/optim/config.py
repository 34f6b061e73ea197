"""``OptimConfig``: the one record a training script hands :func:`fuseopt.optim.build_optimizer`.

A validated, frozen dataclass that round-trips through plain dicts and YAML
(``to_dict``/``from_dict``, ``to_yaml``/``from_yaml``). Unknown keys and bad
values raise a ``ValueError`` naming the field; ``override("a.b=value", ...)``
applies command-line style overrides on top of a base config.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
from typing import Any, Mapping, Sequence

from fuseopt.optim import groups as groups_lib
from fuseopt.optim import schedules as schedules_lib

__all__ = ["CAPABILITIES", "Capabilities", "OPTIMIZERS", "BF16_PARAMS", "BF16_MOMENT_OPTIMIZERS",
           "CAUTIOUS_OPTIMIZERS", "MUON_OPTIMIZERS", "MOMENT_DTYPES", "MOMENTUM_DTYPES",
           "BLOCKWISE_MOMENT_OPTIMIZERS", "OptimConfig"]

@dataclasses.dataclass(frozen=True)
class Capabilities:
  """What the builder may ask of one optimizer (:data:`CAPABILITIES`)."""
  bf16_moments: bool = False   # moments stored in bf16 (moment_dtype="bfloat16")
  blockwise_moments: bool = False   # Adam's moments as 8-/4-bit blockwise codes (moment_dtype="int8"/"int4")
  muon_family: bool = False    # an AdamW side and Muon's parameter split
  cautious: bool = False       # cautious weight decay (a rate given as fuseopt.optim.cautious)
  weight_decay: bool = True    # weight decay among its own kwargs


# Each optimizer's capabilities, declared once: the tuples below are read off it.
# The Muon family keeps its momentum fp32 under moment_dtype="int8"/"int4" (its
# AdamW side's moments are the blockwise ones).
CAPABILITIES = {
    "adam": Capabilities(bf16_moments=True, blockwise_moments=True, weight_decay=False),
    "adamw": Capabilities(bf16_moments=True, blockwise_moments=True, cautious=True),
    "lamb": Capabilities(),
    "lion": Capabilities(bf16_moments=True),
    "adafactor": Capabilities(),
    "muon": Capabilities(bf16_moments=True, blockwise_moments=True, muon_family=True, cautious=True),
    "muonclip": Capabilities(bf16_moments=True, blockwise_moments=True, muon_family=True, cautious=True),
    "normuon": Capabilities(bf16_moments=True, blockwise_moments=True, muon_family=True, cautious=True),
}


def _having(field: str) -> tuple[str, ...]:
  return tuple(name for name, c in CAPABILITIES.items() if getattr(c, field))


OPTIMIZERS = tuple(CAPABILITIES)
BF16_MOMENT_OPTIMIZERS = _having("bf16_moments")
MUON_OPTIMIZERS = _having("muon_family")
CAUTIOUS_OPTIMIZERS = _having("cautious")
# ``bf16_params`` -> the master bits of its companion (None: stochastic rounding, no master).
BF16_PARAMS = {"stochastic": None, "mantissa": 32, "mantissa24": 24}
# The moment formats a config names (fuseopt.optim.adamw's moment_dtype, by name).
MOMENT_DTYPES = ("float32", "bfloat16", "int8", "int4")
BLOCKWISE_MOMENT_OPTIMIZERS = _having("blockwise_moments")
# The formats of the Muon family's own momentum a config names (fuseopt.optim.muon's
# mu_dtype, by name: "int8" is 8-bit codes with a scale per block of 256).
MOMENTUM_DTYPES = ("float32", "bfloat16", "int8")
_NO_DECAY_OPTIMIZERS = tuple(name for name, c in CAPABILITIES.items() if not c.weight_decay)


def _yaml():
  # pyyaml is needed only by the YAML methods: importing fuseopt.optim must
  # work where it is missing (e.g. a bare accelerator machine running bench/).
  try:
    import yaml
  except ImportError as e:
    raise ImportError("OptimConfig's YAML methods (to_yaml, from_yaml, override) need pyyaml: "
                      "pip install pyyaml") from e
  return yaml


@functools.cache
def _loader():
  yaml = _yaml()

  class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-3`` (no dot) as a float, as Python and JSON do."""

  _Loader.add_implicit_resolver(
      "tag:yaml.org,2002:float",
      re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                     |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                     |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                     |[-+]?\.(?:inf|Inf|INF)
                     |\.(?:nan|NaN|NAN))$""", re.X),
      list("-+0123456789."))
  return _Loader


def _load_yaml(text: str):
  return _yaml().load(text, Loader=_loader())


def _suggest(name: str, options: Sequence[str]) -> str:
  close = difflib.get_close_matches(name, options, n=1)
  return f" (did you mean {close[0]!r}?)" if close else ""


def _kwarg_hint(optimizer: str, reserved) -> str:
  """Where a reserved ``optimizer_kwargs`` key belongs: the moments' format
  is ``moment_dtype``; a Muon optimizer's ``b1``/``b2`` fields are the AdamW
  side's."""
  if {"moment_dtype", "mu_dtype"} & set(reserved):
    momentum = (f"; Muon's own momentum is OptimConfig.momentum_dtype, one of {MOMENTUM_DTYPES}"
                if optimizer in MUON_OPTIMIZERS else "")
    return (f" (the moments' format is OptimConfig.moment_dtype, one of {MOMENT_DTYPES}; Muon's "
            f"AdamW side takes it from there too{momentum})")
  if optimizer == "normuon" and "b2" in reserved:
    return (" (b1, b2 and eps are the AdamW side's; NorMuon's per-neuron decay is "
            "OptimConfig.normuon_b2)")
  if optimizer in MUON_OPTIMIZERS and {"b1", "b2"} & set(reserved):
    return " (b1 and b2 are the AdamW side's; Muon's momentum is optimizer_kwargs['beta'])"
  return ""


def _is_number(x) -> bool:
  return not isinstance(x, bool) and isinstance(x, (int, float))


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """Everything :func:`~fuseopt.optim.build_optimizer` needs to build a solver.

  Attributes:
    optimizer: one of :data:`OPTIMIZERS`.
    learning_rate: a constant rate; give it or ``schedule``, not both.
    schedule: a schedule record (:mod:`fuseopt.optim.schedules`) or a dict
      with its ``kind`` and fields.
    weight_decay: decoupled decay folded into the optimizer's own kwargs
      (Muon: both the Muon and the AdamW side); a group's ``weight_decay``
      replaces it. Not allowed for ``adam``.
    b1, b2, eps: the optimizer's moment rates and epsilon; None keeps its
      default (Muon: ``b1``/``b2`` are its AdamW side's, its momentum is
      ``optimizer_kwargs["beta"]``).
    moment_dtype: the moments' format, :func:`~fuseopt.optim.adamw`'s
      ``moment_dtype`` by name: ``"float32"`` (default), ``"bfloat16"``,
      ``"int8"`` or ``"int4"``; bf16 only for :data:`BF16_MOMENT_OPTIMIZERS`
      (the Muon family's momentum too); int8 / int4 (Adam's moments as 8-bit
      codes with one fp32 scale per 256 elements, or 4-bit codes with one per
      128, docs/adam.md) only for :data:`BLOCKWISE_MOMENT_OPTIMIZERS`, where
      the Muon family keeps its momentum in fp32 and stores its AdamW side's
      moments in that format.
    momentum_dtype: the Muon family's own momentum, :func:`~fuseopt.optim.muon`'s
      ``mu_dtype`` by name: ``"float32"``, ``"bfloat16"`` or ``"int8"``
      (8-bit codes, one fp32 scale per block of 256: docs/muon.md); None
      (default): bf16 with ``moment_dtype="bfloat16"``, else the parameters'
      dtype. Only for
      :data:`MUON_OPTIMIZERS` (the AdamW side's moments stay ``moment_dtype``'s).
    param_groups: :class:`~fuseopt.optim.groups.ParamGroup` records (or their
      dicts); empty means one group for everything.
    clip_norm: global-norm clip threshold over all gradients; 0 or ``inf``
      (YAML ``.inf``) disables the clip (the norm is still reported).
      Numbers must be finite except this one; NaN is always refused.
    accumulate_steps: apply the mean gradient of this many micro-steps
      (:class:`optax.MultiSteps`); 1 applies every step.
    skip_nonfinite: skip steps with a NaN/Inf gradient
      (:func:`~fuseopt.optim.safeguards.skip_nonfinite`).
    max_consecutive_skips: the bound on consecutive skips (None: unbounded).
    on_max_skips: ``"raise"`` or ``"apply"`` once the bound is hit.
    frozen: patterns of parameters that get zero updates and no state.
    trainable: when set, every parameter matching none of these is frozen
      too (``("*lora_*",)`` trains only LoRA adapters). Patterns match the
      whole ``'/'``-joined path (``*`` crosses ``'/'``); one that matches no
      parameter raises when the solver first sees the parameters.
    qk_clip_tau: MuonClip's logit threshold, > 0 (``muonclip`` only, where
      None means 100; set with another optimizer it raises, as it would do
      nothing).
    normuon_b2: NorMuon's per-neuron second-moment decay, in [0, 1)
      (``normuon`` only; None: 0.95). ``b1``/``b2`` are the AdamW side's.
    cautious_weight_decay: decay only where the update and the parameter
      have the same sign (Chen et al. 2025, arXiv 2510.12402), for
      :data:`CAUTIOUS_OPTIMIZERS`.
    bf16_params: how bf16 parameters are stored: ``"stochastic"`` (rounded
      stochastically), ``"mantissa"`` (an fp32 master: an int16 companion
      per parameter in the state) or ``"mantissa24"`` (a 24-bit master: an
      int8 companion); :mod:`fuseopt.optim.mantissa`, every parameter must
      be bfloat16. A companion wraps the whole solver (all groups), inside
      the clip and the safeguards.
    adam_learning_rate, adam_schedule: the AdamW side of ``muon`` /
      ``muonclip``: its own constant rate or schedule (at most one; neither:
      it shares ``learning_rate`` / ``schedule``). A group's
      ``learning_rate_multiplier`` scales both sides.
    muon_patterns: ``muon`` / ``muonclip``: fnmatch patterns over parameter
      paths (as in ``param_groups``) naming the parameters Muon takes; each
      such parameter of rank >= 2 is a stack of matrices over its last two
      axes (input, output), every other parameter takes AdamW.
    muon_logical_axes: ``muon`` / ``muonclip``: split from the logical axis
      names the parameters declare (linen boxes, nnx
      ``with_partitioning``) by the rules of
      :func:`~fuseopt.optim.muon_weight_dimension_numbers`.
    muon_axis_rules: overrides of those rules' axis-name sets
      (``selection_axes``, ``batch_axes``, ``layer_axes``, ``head_axes``:
      lists of names); only with ``muon_logical_axes``. With neither
      ``muon_patterns`` nor ``muon_logical_axes``, Muon takes every rank-2
      parameter (optax's default).
    optimizer_kwargs: extra keyword arguments for the optimizer, verbatim.
  """

  optimizer: str = "adamw"
  learning_rate: float | None = None
  schedule: schedules_lib.ScheduleBase | None = None
  weight_decay: float = 0.0
  b1: float | None = None
  b2: float | None = None
  eps: float | None = None
  moment_dtype: str = "float32"
  momentum_dtype: str | None = None
  param_groups: tuple[groups_lib.ParamGroup, ...] = ()
  clip_norm: float = 0.0
  accumulate_steps: int = 1
  skip_nonfinite: bool = False
  max_consecutive_skips: int | None = 10
  on_max_skips: str = "raise"
  frozen: tuple[str, ...] = ()
  trainable: tuple[str, ...] | None = None
  qk_clip_tau: float | None = None
  normuon_b2: float | None = None
  cautious_weight_decay: bool = False
  bf16_params: str = "stochastic"
  optimizer_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  adam_learning_rate: float | None = None
  adam_schedule: schedules_lib.ScheduleBase | None = None
  muon_patterns: tuple[str, ...] | None = None
  muon_logical_axes: bool = False
  muon_axis_rules: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    set_ = lambda k, v: object.__setattr__(self, k, v)
    if self.optimizer not in OPTIMIZERS:
      raise ValueError(f"OptimConfig.optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}"
                       + _suggest(str(self.optimizer), OPTIMIZERS))
    if self.schedule is not None:
      set_("schedule", schedules_lib.schedule_from_dict(self.schedule))
    if (self.learning_rate is None) == (self.schedule is None):
      raise ValueError("OptimConfig.learning_rate / OptimConfig.schedule: give exactly one "
                       f"(got learning_rate={self.learning_rate!r}, schedule={self.schedule!r})")
    if self.learning_rate is not None:
      if (not _is_number(self.learning_rate) or not math.isfinite(self.learning_rate)
          or self.learning_rate < 0):
        raise ValueError(f"OptimConfig.learning_rate must be a finite number >= 0, got {self.learning_rate!r}")
      set_("learning_rate", float(self.learning_rate))
    # NaN compares False with everything, so each check says "not (v >= lo)";
    # clip_norm alone may be +inf, a natural way to say "no clip".
    for name, lo, inf_ok in (("weight_decay", 0.0, False), ("clip_norm", 0.0, True)):
      v = getattr(self, name)
      if not _is_number(v) or not v >= lo or (v == math.inf and not inf_ok):
        what = "a number >= 0 (inf or 0: no clip)" if inf_ok else "a finite number >= 0"
        raise ValueError(f"OptimConfig.{name} must be {what}, got {v!r}")
      set_(name, float(v))
    v = self.qk_clip_tau
    if v is not None:
      if not _is_number(v) or not v > 0:
        raise ValueError(f"OptimConfig.qk_clip_tau must be a number > 0 (inf: never clip) or None, "
                         f"got {v!r}")
      if self.optimizer != "muonclip":
        raise ValueError(f"OptimConfig.qk_clip_tau: only for optimizer 'muonclip', got optimizer "
                         f"{self.optimizer!r}")
      set_("qk_clip_tau", float(v))
    v = self.normuon_b2
    if v is not None:
      if self.optimizer != "normuon":
        raise ValueError(f"OptimConfig.normuon_b2: only for optimizer 'normuon', got optimizer "
                         f"{self.optimizer!r}")
      if not _is_number(v) or not 0.0 <= v < 1.0:
        raise ValueError(f"OptimConfig.normuon_b2 must be a number in [0, 1) or None, got {v!r}")
      set_("normuon_b2", float(v))
    if not isinstance(self.cautious_weight_decay, bool):
      raise ValueError(f"OptimConfig.cautious_weight_decay must be a bool, got "
                       f"{self.cautious_weight_decay!r}")
    if self.cautious_weight_decay and self.optimizer not in CAUTIOUS_OPTIMIZERS:
      raise ValueError(f"OptimConfig.cautious_weight_decay: optimizer {self.optimizer!r} has no "
                       f"cautious weight decay; use one of {CAUTIOUS_OPTIMIZERS}")
    if self.bf16_params not in BF16_PARAMS:
      raise ValueError(f"OptimConfig.bf16_params must be one of {tuple(BF16_PARAMS)}, got "
                       f"{self.bf16_params!r}" + _suggest(str(self.bf16_params), tuple(BF16_PARAMS)))
    if BF16_PARAMS[self.bf16_params] is not None and self.optimizer == "muonclip":
      raise ValueError(f"OptimConfig.bf16_params={self.bf16_params!r}: not with optimizer 'muonclip' "
                       "(QK-Clip "
                       "rescales the parameters after the update); use 'stochastic'")
    for name in ("b1", "b2"):
      v = getattr(self, name)
      if v is not None and (not _is_number(v) or not 0.0 <= v < 1.0):
        raise ValueError(f"OptimConfig.{name} must be a number in [0, 1) or None, got {v!r}")
    if self.eps is not None and (not _is_number(self.eps) or not math.isfinite(self.eps)
                                 or self.eps < 0):
      raise ValueError(f"OptimConfig.eps must be a finite number >= 0 or None, got {self.eps!r}")
    if self.moment_dtype not in MOMENT_DTYPES:
      raise ValueError(f"OptimConfig.moment_dtype must be one of {MOMENT_DTYPES}, got "
                       f"{self.moment_dtype!r}" + _suggest(str(self.moment_dtype), MOMENT_DTYPES))
    if self.moment_dtype == "bfloat16" and self.optimizer not in BF16_MOMENT_OPTIMIZERS:
      raise ValueError(f"OptimConfig.moment_dtype='bfloat16': optimizer {self.optimizer!r} cannot "
                       f"keep bf16 moments; use one of {BF16_MOMENT_OPTIMIZERS} or "
                       f"moment_dtype='float32'")
    if self.moment_dtype in ("int8", "int4") and self.optimizer not in BLOCKWISE_MOMENT_OPTIMIZERS:
      bits = self.moment_dtype[3:]
      raise ValueError(f"OptimConfig.moment_dtype={self.moment_dtype!r}: optimizer "
                       f"{self.optimizer!r} cannot keep {bits}-bit moments; use one of "
                       f"{BLOCKWISE_MOMENT_OPTIMIZERS} or moment_dtype='float32'")
    v = self.momentum_dtype
    if v is not None:
      if v not in MOMENTUM_DTYPES:
        raise ValueError(f"OptimConfig.momentum_dtype must be one of {MOMENTUM_DTYPES} or None, "
                         f"got {v!r}" + _suggest(str(v), MOMENTUM_DTYPES))
      if self.optimizer not in MUON_OPTIMIZERS:
        raise ValueError(f"OptimConfig.momentum_dtype: only for optimizers {MUON_OPTIMIZERS} "
                         f"(Muon's own momentum), got optimizer {self.optimizer!r}; the moments' "
                         f"format is moment_dtype")
    if self.optimizer in _NO_DECAY_OPTIMIZERS and self.weight_decay > 0:
      raise ValueError(f"OptimConfig.weight_decay: optimizer {self.optimizer!r} has no weight decay "
                       f"(got {self.weight_decay}); use 'adamw'")
    set_("param_groups", groups_lib.validate_groups(self.param_groups or ()))
    if self.optimizer in _NO_DECAY_OPTIMIZERS:
      for g in self.param_groups:
        if g.weight_decay:
          raise ValueError(f"OptimConfig.param_groups: group {g.name!r} sets weight_decay={g.weight_decay} "
                           f"but optimizer {self.optimizer!r} has no weight decay; use 'adamw'")
    k = self.accumulate_steps
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
      raise ValueError(f"OptimConfig.accumulate_steps must be an integer >= 1, got {k!r}")
    if not isinstance(self.skip_nonfinite, bool):
      raise ValueError(f"OptimConfig.skip_nonfinite must be a bool, got {self.skip_nonfinite!r}")
    m = self.max_consecutive_skips
    if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
      raise ValueError(f"OptimConfig.max_consecutive_skips must be an integer >= 1 or None, got {m!r}")
    if self.on_max_skips not in ("raise", "apply"):
      raise ValueError(f"OptimConfig.on_max_skips must be 'raise' or 'apply', got {self.on_max_skips!r}")
    for name in ("frozen", "trainable"):
      v = getattr(self, name)
      if v is None and name == "trainable":
        continue
      if isinstance(v, str):
        v = (v,)
      if not isinstance(v, (list, tuple)) or not all(isinstance(p, str) and p for p in v):
        raise ValueError(f"OptimConfig.{name} must be a sequence of fnmatch patterns, got {v!r}")
      set_(name, tuple(v))
    if not isinstance(self.optimizer_kwargs, Mapping):
      raise ValueError(f"OptimConfig.optimizer_kwargs must be a mapping, got {self.optimizer_kwargs!r}")
    reserved = {"learning_rate", "weight_decay", "b1", "b2", "eps", "mu_dtype", "moment_dtype",
                "cautious_weight_decay", "bf16_params"} & set(self.optimizer_kwargs)
    if reserved:
      raise ValueError(f"OptimConfig.optimizer_kwargs: {sorted(reserved)} are OptimConfig fields; "
                       f"set them there" + _kwarg_hint(self.optimizer, reserved))
    set_("optimizer_kwargs", dict(self.optimizer_kwargs))
    self._check_muon_fields(set_)

  def _check_muon_fields(self, set_):
    muon = self.optimizer in MUON_OPTIMIZERS
    given = [n for n in ("adam_learning_rate", "adam_schedule", "muon_patterns")
             if getattr(self, n) is not None]
    given += [n for n in ("muon_logical_axes", "muon_axis_rules") if getattr(self, n)]
    if given and not muon:
      raise ValueError(f"OptimConfig.{given[0]}: only for optimizers {MUON_OPTIMIZERS}, "
                       f"got optimizer {self.optimizer!r}")
    if self.adam_schedule is not None:
      set_("adam_schedule", schedules_lib.schedule_from_dict(self.adam_schedule))
      if self.adam_learning_rate is not None:
        raise ValueError("OptimConfig.adam_learning_rate / OptimConfig.adam_schedule: give at most one "
                         f"(got {self.adam_learning_rate!r} and {self.adam_schedule!r})")
    if self.adam_learning_rate is not None:
      if not _is_number(self.adam_learning_rate) or self.adam_learning_rate < 0:
        raise ValueError("OptimConfig.adam_learning_rate must be a number >= 0 or None, "
                         f"got {self.adam_learning_rate!r}")
      set_("adam_learning_rate", float(self.adam_learning_rate))
    if self.muon_patterns is not None:
      v = (self.muon_patterns,) if isinstance(self.muon_patterns, str) else self.muon_patterns
      if not isinstance(v, (list, tuple)) or not v or not all(isinstance(p, str) and p for p in v):
        raise ValueError(f"OptimConfig.muon_patterns must be a non-empty sequence of fnmatch patterns "
                         f"or None, got {self.muon_patterns!r}")
      set_("muon_patterns", tuple(v))
    if not isinstance(self.muon_logical_axes, bool):
      raise ValueError(f"OptimConfig.muon_logical_axes must be a bool, got {self.muon_logical_axes!r}")
    if self.muon_logical_axes and self.muon_patterns is not None:
      raise ValueError("OptimConfig.muon_patterns / OptimConfig.muon_logical_axes: give at most one")
    rules = self.muon_axis_rules
    valid = ("selection_axes", "batch_axes", "layer_axes", "head_axes")
    if not isinstance(rules, Mapping):
      raise ValueError(f"OptimConfig.muon_axis_rules must be a mapping, got {rules!r}")
    for k, names in rules.items():
      if k not in valid:
        raise ValueError(f"OptimConfig.muon_axis_rules: unknown rule {k!r}{_suggest(str(k), valid)}; "
                         f"valid: {valid}")
      if isinstance(names, str) or not isinstance(names, (list, tuple)) or not all(
          isinstance(n, str) for n in names):
        raise ValueError(f"OptimConfig.muon_axis_rules.{k} must be a list of axis names, got {names!r}")
    if rules and not self.muon_logical_axes:
      raise ValueError("OptimConfig.muon_axis_rules: only with muon_logical_axes: true")
    set_("muon_axis_rules", {k: list(v) for k, v in rules.items()})
    if muon and (self.muon_patterns is not None or self.muon_logical_axes):
      if "muon_weight_dimension_numbers" in self.optimizer_kwargs:
        raise ValueError("OptimConfig.optimizer_kwargs['muon_weight_dimension_numbers'] and "
                         "muon_patterns / muon_logical_axes both choose Muon's parameters; give one")
    if "adam_learning_rate" in self.optimizer_kwargs:
      raise ValueError("OptimConfig.optimizer_kwargs: ['adam_learning_rate'] is an OptimConfig field; "
                       "set adam_learning_rate or adam_schedule there")

  # ------------------------------------------------------------------ dicts

  def to_dict(self) -> dict[str, Any]:
    """Plain Python types only (lists, dicts, numbers, strings, None): YAML/JSON safe."""
    out = {}
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if f.name in ("schedule", "adam_schedule"):
        v = None if v is None else v.to_dict()
      elif f.name == "param_groups":
        v = [g.to_dict() for g in v]
      elif isinstance(v, tuple):
        v = list(v)
      elif isinstance(v, Mapping):
        v = dict(v)
      out[f.name] = v
    return out

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "OptimConfig":
    if isinstance(d, OptimConfig):
      return d
    if not isinstance(d, Mapping):
      raise ValueError(f"OptimConfig.from_dict expects a mapping, got {type(d).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in d if k not in names]
    if unknown:
      hints = "".join(_suggest(str(k), names) for k in unknown)
      raise ValueError(f"OptimConfig got unknown key(s) {unknown}{hints}; valid keys: {names}")
    return cls(**dict(d))

  def to_yaml(self) -> str:
    return _yaml().safe_dump(self.to_dict(), sort_keys=False)

  @classmethod
  def from_yaml(cls, text: str) -> "OptimConfig":
    d = _load_yaml(text)
    return cls.from_dict({} if d is None else d)

  def override(self, *assignments: str) -> "OptimConfig":
    """A copy with ``"key=value"`` / ``"schedule.peak=1e-3"`` overrides applied (values parsed as YAML)."""
    d = self.to_dict()
    for a in assignments:
      if "=" not in a:
        raise ValueError(f"OptimConfig.override: expected 'key=value', got {a!r}")
      key, raw = a.split("=", 1)
      *parents, leaf = key.strip().split(".")
      node = d
      for p in parents:
        if not isinstance(node.get(p), dict):
          node[p] = {}
        node = node[p]
      node[leaf] = _load_yaml(raw)
      if key.strip() == "schedule" or key.startswith("schedule."):
        d["learning_rate"] = None
      elif key.strip() == "learning_rate":
        d["schedule"] = None
      elif key.strip() == "adam_schedule" or key.startswith("adam_schedule."):
        d["adam_learning_rate"] = None
      elif key.strip() == "adam_learning_rate":
        d["adam_schedule"] = None
    return OptimConfig.from_dict(d)
