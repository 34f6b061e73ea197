"""NorMuon: Muon with a per-neuron second moment on the orthogonalised update.

Li et al. 2025, "NorMuon: Making Muon more efficient and scalable", arXiv
2510.05491. Muon's orthogonalised update has equal singular values but very
unequal rows: some output neurons get far larger updates than others.
NorMuon keeps an Adam-style second moment per output neuron of each matrix
and divides it out after Newton-Schulz, then rescales the update to Muon's
RMS (:mod:`fuseopt.optim.neuron_norm` has the math and the layouts).

NorMuon is Muon with one piece (:class:`NeuronNorm`, a
:class:`~fuseopt.optim.muon_finish.UpdatePiece`) where the orthogonalised
update is finished. Everything else is :func:`~fuseopt.optim.muon`'s: the
same arguments (its one signature, less ``adaptive`` and
``preconditioning``, which NorMuon replaces), the same batched and sharded
Newton-Schulz, the same AdamW side, the same fused
:func:`fuseopt.optim.step` (the per-neuron statistic comes out of the
Newton-Schulz call, where each matrix is whole; the factor is folded into the
pass that writes the parameter).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fuseopt.kernels import counter_hash
from fuseopt.kernels import sharding as kernel_sharding
from fuseopt.optim import _checks
from fuseopt.optim import matrix_views
from fuseopt.optim import muon_store
from fuseopt.optim import muon_transforms
from fuseopt.optim import neuron_norm

__all__ = ["NeuronNorm", "NorMuonState", "normuon", "scale_by_normuon"]


class NorMuonState(NamedTuple):
  """NorMuon's state: Muon's fields and ``nu``, the per-neuron second
  moments (per leaf, the leaf's shape without its reduction axes, a matrix
  view axis among them kept with one entry per view; an empty array where
  Muon does not act)."""
  count: jax.Array
  mu: Any
  nu: Any
  ns_coeffs: jax.Array


@dataclasses.dataclass(frozen=True)
class NeuronNorm:
  """NorMuon's piece (an :class:`~fuseopt.optim.muon_finish.UpdatePiece`):
  ``b2`` the decay of the per-neuron second moment, ``eps`` added to its
  square root, ``nu_dtype`` its dtype (None: fp32). Its state is ``nu``."""
  b2: Any = 0.95
  eps: Any = 1e-8
  nu_dtype: Any = None

  state_field = "nu"

  @classmethod
  def checked(cls, owner, b2, normuon_eps, nu_dtype):
    """The piece of NorMuon's arguments: a bool ``b2=True`` would be 1
    (NorMuon silently off), a string would fail at the first update."""
    _checks.check_decay(owner, "b2", b2)
    _checks.check_nonnegative(owner, "normuon_eps", normuon_eps)
    nu_dtype = _checks.check_dtype(owner, "nu_dtype", nu_dtype, (jnp.float32, jnp.bfloat16))
    return cls(b2, normuon_eps, nu_dtype)

  def init_state(self, count, mu, ns_coeffs, params, cuts):
    """``nu``: per Muon leaf the leaf's shape without its reduction axes (one
    entry per output neuron of each matrix; a view axis on the reduction
    side stays, one entry per view), zeros; an empty array for leaves Muon
    passes through."""
    dtype = self.nu_dtype or jnp.float32
    leaves, treedef = jax.tree.flatten(params)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    nu = []
    for x, s, path in zip(leaves, cuts, paths):
      if s is None:
        nu.append(jnp.zeros((0,), dtype))
        continue
      views = matrix_views.geometry(s, jnp.shape(x), path)
      nu.append(jnp.zeros(neuron_norm.state_shape(jnp.shape(x), views), dtype))
    return NorMuonState(count=count, mu=mu, nu=treedef.unflatten(nu), ns_coeffs=ns_coeffs)

  def wrap_ns(self, ns):
    """``ns``, returning its result's column sums of squares too (computed
    where the matrices are whole: the same numbers on any sharding)."""
    def run(x):
      y = ns(x)
      return y, neuron_norm.column_sums(y)
    return run

  def finish(self, result, state, *, active, count, leaf_index):
    """The result's parts times each neuron's factor (fp32), and the leaf's
    new second moment (stored in ``state``'s dtype). On a mesh (the
    result's placement) the small per-neuron arithmetic runs replicated, as
    the unsharded step runs it; a frozen matrix keeps its second moment."""
    views, shape = result.views, result.shape
    stat = result.statistic()
    v_old = jnp.reshape(state, views.statistic_shape(shape))
    fn = functools.partial(neuron_norm.normalize_views, views=views, shape=shape, b2=self.b2,
                           eps=self.eps)
    placement = result.placement
    if isinstance(placement, kernel_sharding.Placement):
      whole = kernel_sharding.Placement(placement.mesh,
                                        jax.sharding.PartitionSpec(*[None] * len(shape)))
      fn = kernel_sharding.shard_local(fn, placement.mesh, (whole.spec, whole.spec),
                                       (whole.spec, whole.spec))
      stat, v_old = (kernel_sharding.to_spec(x, whole) for x in (stat, v_old))
    scale, v_new = fn(stat, v_old)
    if active is not None:
      v_new = jnp.where(jnp.broadcast_to(active, v_new.shape), v_new, v_old)
    v_leaf = jnp.reshape(v_new, state.shape)
    stored = muon_store.store(v_leaf, state.dtype, count, leaf_index, counter_hash.STREAM_NU)
    return result.per_neuron(scale), stored


# What NorMuon replaces of Muon's arguments.
_REPLACED = ("adaptive", "preconditioning")


def scale_by_normuon(*args, b2: float = 0.95, normuon_eps: float = 1e-8,
                     nu_dtype: Any = None, **kwargs) -> optax.GradientTransformation:
  r"""NorMuon's direction: Muon's, normalised per output neuron.

  With :math:`O = \mathrm{NS}(\hat m)` of :func:`~fuseopt.optim.scale_by_muon`
  on a ``(rows = fan-in, cols = fan-out)`` matrix:

  .. math::
    v_j \leftarrow \beta_2 v_j + (1-\beta_2)\,\overline{O_{:j}^2},\qquad
    \hat O_{:j} = \frac{O_{:j}}{\sqrt{v_j} + \varepsilon},\qquad
    u = \frac{\sqrt{\min(\text{rows}, \text{cols})}}{\|\hat O\|_F}\,\hat O

  (Li et al. 2025, arXiv 2510.05491: the mean is over the neuron's inputs,
  one :math:`v_j` per output unit -- the paper's rows of :math:`W` in
  :math:`y = Wx`), then Muon's width scaling when ``shape_scaling``.
  ``b2 = 0`` makes every neuron's update the same RMS. No bias correction of
  :math:`v` (the rescale to a fixed norm makes it moot).

  Args:
    b2: decay of the per-neuron second moment, in [0, 1).
    normuon_eps: added to :math:`\sqrt{v_j}`, >= 0 (the NS ``eps`` is separate).
    nu_dtype: dtype of ``nu``: float32 (default, ``None``) or bfloat16
      (stochastically rounded, seed stream ``STREAM_NU``).
    Everything else: :func:`~fuseopt.optim.scale_by_muon`'s (without
    ``adaptive`` and ``preconditioning``, which NorMuon replaces). Matrices
    are declared with :class:`~fuseopt.optim.MuonDimensionNumbers` or
    :class:`~fuseopt.optim.MatrixViews`; each view has its own second
    moment per output neuron (a view axis on the reduction side stays in
    ``nu``, one entry per view).

  Returns:
    A transformation whose state is :class:`NorMuonState` ``(count, mu, nu,
    ns_coeffs)``.
  """
  piece = NeuronNorm.checked("scale_by_normuon", b2, normuon_eps, nu_dtype)
  arguments = muon_transforms.bind_arguments("scale_by_normuon", muon_transforms.scale_by_muon,
                                             args, kwargs, _REPLACED)
  return muon_transforms.direction_transform(muon_transforms.muon_direction(arguments, piece))


def normuon(*args, b2: float = 0.95, normuon_eps: float = 1e-8, nu_dtype: Any = None,
            **kwargs) -> optax.GradientTransformation:
  r"""NorMuon for the matrices, AdamW for everything else.

  :func:`~fuseopt.optim.muon` with :func:`scale_by_normuon`'s direction:

  .. math::
    W \leftarrow W - \eta\,(s\,u + \lambda W)

  with :math:`u` NorMuon's normalised update and :math:`s` Muon's width
  factor (``consistent_rms=0.2`` gives the paper's
  :math:`0.2\sqrt{mn}/\|\hat O\|_F`). Arguments: :func:`~fuseopt.optim.muon`'s
  (without ``adaptive`` and ``preconditioning``) and ``b2``,
  ``normuon_eps``, ``nu_dtype`` of :func:`scale_by_normuon`. The state has
  :func:`~fuseopt.optim.muon`'s structure with a :class:`NorMuonState` in
  place of the Muon state. :func:`fuseopt.optim.step` fuses it as it fuses
  Muon.
  """
  piece = NeuronNorm.checked("normuon", b2, normuon_eps, nu_dtype)
  arguments = muon_transforms.bind_arguments("normuon", muon_transforms.muon, args, kwargs,
                                             _REPLACED)
  return muon_transforms.build_muon(arguments, piece, owner="normuon")


scale_by_normuon.__signature__ = muon_transforms.variant_signature(
    scale_by_normuon, muon_transforms.scale_by_muon, ("b2", "normuon_eps", "nu_dtype"), _REPLACED)
normuon.__signature__ = muon_transforms.variant_signature(
    normuon, muon_transforms.muon, ("b2", "normuon_eps", "nu_dtype"), _REPLACED)
