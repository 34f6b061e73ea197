"""Fused Adam/AdamW update of one leaf with Pallas's Mosaic GPU lowering (sm_90).

The ``mosaic_gpu`` backend of :func:`fuseopt.kernels.adam_update`: the math
and the bf16 roundings of :mod:`fuseopt.kernels.adam` (``_adam_math``,
``_store``: the same counter hash on the same global flat index), tiled as
the Mosaic GPU stochastic rounding is
(:mod:`fuseopt.kernels.stochastic_round_mosaic_gpu`): a ``plgpu.kernel``
over a 1-D grid of the flattened leaf's first ``128 * (size // 128)``
elements, ``block`` elements a program, loaded from and stored to global
memory as one warpgroup's register arrays.

In place: ``plgpu.kernel`` has no ``input_output_aliases``; the parameter and
the moments go in as ``jax.new_ref`` refs, which the kernel overwrites, and
jax turns each written ref into an aliased operand of the custom call (with
the inputs donated to the enclosing jit: no copy). The direction
(``p=None``) is a fresh output, as in the Triton kernel. The last
``size % 128`` elements (Mosaic GPU has no masked loads), which the kernel
leaves as they were, are updated by the same math in XLA from the kernel's
results and written into them in place.

One launch per leaf (no grouped launch yet). Compiles for sm_90 only
(:func:`fuseopt.kernels._backend.check_mosaic_gpu_target`); runs anywhere in
interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fuseopt.kernels import _elementwise
from fuseopt.kernels import adam as adam_lib
from fuseopt.kernels import sharding as sharding_lib
from fuseopt.kernels._elementwise import MosaicGPUConfig

# Not measured on hardware. Seven streams of up to 4 bytes in registers:
# block 4096 is 224 registers a thread for fp32 p, g, mu, nu (ptxas decides).
SEARCH_SPACE = tuple(MosaicGPUConfig(b) for b in (256, 512, 1024, 2048, 4096))


def heuristic(size: int) -> MosaicGPUConfig:
  return _elementwise.mosaic_gpu_heuristic(size)


def _kernel(s_ref, seed_ref, g_ref, *refs, main, block, nesterov, apply, index_map):
  if apply:
    p_ref, mu_ref, nu_ref = refs
    o_ref = p_ref
  else:
    mu_ref, nu_ref, o_ref = refs
  scalars = [s_ref[k] for k in range(adam_lib.N_SCALARS)]
  seeds = [seed_ref[k] for k in range(adam_lib.N_SEEDS)]

  def one(start, size):
    rows = pl.ds(start, size)
    f32 = lambda r: r.at[rows][...].astype(jnp.float32)
    # The skip flag as a block: Mosaic GPU's warpgroup lowering has no
    # select with a scalar predicate (an implicit broadcast).
    s = lambda k: (jnp.broadcast_to(scalars[k], (size,)) if k == adam_lib.APPLY
                   else scalars[k])
    out, mu_new, nu_new = adam_lib._adam_math(
        s, f32(p_ref) if apply else None, f32(g_ref), f32(mu_ref),
        f32(nu_ref), nesterov=nesterov, apply=apply)
    index = sharding_lib.global_index(_elementwise.mosaic_gpu_flat_index(start, size),
                                      index_map, seeds[adam_lib.SEED_BASE])
    o_ref.at[rows][...] = adam_lib._store(out, o_ref.dtype, index, seeds[0])
    mu_ref.at[rows][...] = adam_lib._store(mu_new, mu_ref.dtype, index, seeds[1])
    nu_ref.at[rows][...] = adam_lib._store(nu_new, nu_ref.dtype, index, seeds[2])

  _elementwise.mosaic_gpu_blocks(main, block, one)


def _tail(scalars, seeds, p, g, mu, nu, *, main, nesterov, out_dtype, index_map):
  """The last ``size - main`` elements, in XLA, with their own flat indices."""
  f32 = lambda a: a[main:].astype(jnp.float32)
  apply = p is not None
  out, mu_new, nu_new = adam_lib._adam_math(
      lambda k: scalars[k], f32(p) if apply else None, f32(g), f32(mu), f32(nu),
      nesterov=nesterov, apply=apply)
  local = jax.lax.iota(jnp.uint32, g.shape[0] - main) + jnp.uint32(main)
  index = lambda: sharding_lib.global_index(local, index_map, seeds[adam_lib.SEED_BASE])
  return (adam_lib._store(out, out_dtype, index(), seeds[0]),
          adam_lib._store(mu_new, mu.dtype, index(), seeds[1]),
          adam_lib._store(nu_new, nu.dtype, index(), seeds[2]))


def update_flat(scalars, seeds, p, g, mu, nu, *, nesterov, out_dtype, config: MosaicGPUConfig,
                interpret, index_map=None):
  """One leaf, flattened (``p`` None: the direction); returns ``(out, mu, nu)``.

  The caller runs leaves under 128 elements in the reference, and guards the
  inputs against differentiation (a custom_jvp around the kernel itself would
  hide its refs from the state discharge of the enclosing jit)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  (n,) = g.shape
  main = _elementwise.mosaic_gpu_split(n)
  apply = p is not None
  kernel = plgpu.kernel(
      functools.partial(_kernel, main=main, block=config.block, nesterov=nesterov,
                        apply=apply, index_map=index_map),
      out_type=() if apply else (jax.ShapeDtypeStruct((n,), out_dtype),),
      grid=(_elementwise.mosaic_gpu_programs(main, config.block),),
      grid_names=(_elementwise.MOSAIC_GPU_AXIS,),
      interpret=interpret or None,
      kernel_name="fuseopt_adam_update",
  )
  mu_ref, nu_ref = jax.new_ref(mu), jax.new_ref(nu)
  if apply:
    p_ref = jax.new_ref(p)
    kernel(scalars, seeds, g, p_ref, mu_ref, nu_ref)
    outs = (jax.freeze(p_ref), jax.freeze(mu_ref), jax.freeze(nu_ref))
  else:
    (u,) = kernel(scalars, seeds, g, mu_ref, nu_ref)
    outs = (u, jax.freeze(mu_ref), jax.freeze(nu_ref))
  if main < n:
    # The kernel leaves the tail as it was: read back from its results, not
    # from the donated inputs (keeping those alive past the in-place kernel
    # would make XLA copy every leaf), and written into them in place.
    tail = _tail(scalars, seeds, outs[0] if apply else None, g, outs[1], outs[2], main=main,
                 nesterov=nesterov, out_dtype=out_dtype, index_map=index_map)
    outs = tuple(o.at[main:].set(t) for o, t in zip(outs, tail))
  return outs
