"""Tiling shared by fuseopt's elementwise kernels (stochastic rounding, Adam):
the block configs of their three Pallas backends and how each steps over a leaf.

Both tile a leaf so that the counter hash sees each element's row-major flat
index in the whole leaf, whatever the block:

- Triton: a 1-D grid of ``block`` elements a program (a power of two) over the
  flattened leaf, the ragged last block's loads and stores masked by the
  kernel (:class:`TritonBounded`);
- Mosaic GPU (sm_90): a 1-D grid over the flattened leaf's first
  ``128 * (size // 128)`` elements, ``block`` a program loaded from and
  stored to global memory as one warpgroup's register array
  (:func:`mosaic_gpu_blocks`); the last program takes the shorter rest, and
  the caller the last ``size % 128`` elements;
- Mosaic TPU: the leaf in its own layout (:func:`mosaic_tiling`). A TPU array
  is stored in (8, 128) tiles of its last two dims (bf16 packs row pairs in
  them), so viewing a 2-D leaf as flat ``(rows, 128)`` lanes is a relayout
  copy of every operand (docs/pallas_notes.md, "TPU layouts and the
  elementwise kernels' views"); the kernel instead views a leaf
  ``(..., R, C)`` as ``(prod(...) * R, C)`` (or, when R is not a multiple of
  16, ``(prod(...), R, C)``) and steps over blocks of its last two dims.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

LANES = 128


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  block: int = 1024
  num_warps: int = 8

  def __post_init__(self):
    if self.block <= 0 or self.block & (self.block - 1):
      raise ValueError(f"block must be a positive power of two, got {self.block}")
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps}")


@dataclasses.dataclass(frozen=True)
class MosaicTPUConfig:
  """Mosaic TPU tiling budget: a grid step holds at most ``block_rows * 128``
  elements of each operand, columns counted padded to 128 as in VMEM (a
  minimal block may exceed it, within VMEM). The block's shape follows the
  leaf (:func:`mosaic_tiling`)."""
  block_rows: int = 512

  def __post_init__(self):
    if self.block_rows <= 0 or self.block_rows % 16:
      raise ValueError(f"block_rows must be a positive multiple of 16, got {self.block_rows}")

  @property
  def block_elements(self) -> int:
    return self.block_rows * LANES



@dataclasses.dataclass(frozen=True)
class MosaicGPUConfig:
  """Mosaic GPU: ``block`` elements a program (one CTA of one warpgroup,
  128 threads), a power of two of at least 128."""
  block: int = 1024

  def __post_init__(self):
    if self.block < MOSAIC_GPU_LANES or self.block & (self.block - 1):
      raise ValueError(f"block must be a power of two >= {MOSAIC_GPU_LANES}, got {self.block}")


# A warpgroup's 1-D register array spans a multiple of its 128 threads.
MOSAIC_GPU_LANES = 128
# The grid axis of the Mosaic GPU elementwise kernels.
MOSAIC_GPU_AXIS = "fuseopt_blocks"


# The search spaces of the elementwise kernels (stochastic rounding, Adam).
# Triton: every config ran inside XLA's CUDA graphs on the H200 once ragged
# blocks were masked; block 1024 / 8 warps measured fastest there
# (docs/pallas_notes.md, "CUDA graphs"). Mosaic GPU: the whole range a
# warpgroup holds in registers (ptxas decides).
TRITON_SEARCH_SPACE = tuple(TritonConfig(b, w) for b in (512, 1024, 2048, 4096) for w in (4, 8))
MOSAIC_GPU_SEARCH_SPACE = tuple(MosaicGPUConfig(b) for b in (256, 512, 1024, 2048, 4096))


def mosaic_gpu_heuristic(size: int) -> MosaicGPUConfig:
  # Triton's measured per-leaf block (triton_heuristic); not measured for
  # Mosaic GPU: the search space holds the rest.
  return MosaicGPUConfig(block=min(1024, max(MOSAIC_GPU_LANES, pl.next_power_of_2(max(size, 1)))))


def mosaic_gpu_split(size: int) -> int:
  """Elements of a flat leaf of ``size`` that a Mosaic GPU kernel covers."""
  return size - size % MOSAIC_GPU_LANES


def mosaic_gpu_programs(main: int, block: int) -> int:
  return pl.cdiv(main, block)


def mosaic_gpu_blocks(main: int, block: int, fn, program=None) -> None:
  """Inside a Mosaic GPU kernel over :data:`MOSAIC_GPU_AXIS`: calls
  ``fn(start, size)`` for this program's block of the first ``main``
  elements (a multiple of 128), ``size`` static (``block``, or the shorter
  rest in the last program: Mosaic GPU has no masked loads, so no block
  reads past ``main``). ``program``: the block's index in the leaf (default:
  the program's position in the grid)."""
  full, rest = divmod(main, block)
  b = jax.lax.axis_index(MOSAIC_GPU_AXIS) if program is None else program
  if full:
    pl.when(b < full)(lambda: fn(b * block, block))
  if rest:
    pl.when(b == full)(lambda: fn(b * block, rest))


def mosaic_gpu_flat_index(start, size: int) -> jax.Array:
  """uint32 flat indices of a Mosaic GPU block."""
  return start.astype(jnp.uint32) + jax.lax.iota(jnp.uint32, size)


def triton_heuristic(size: int) -> TritonConfig:
  # Block 1024 / 8 warps measured best for per-leaf elementwise passes on the
  # H200 (docs/kernels.md, "Choice of defaults"); tiny arrays get one small
  # block.
  block = min(1024, max(128, pl.next_power_of_2(max(size, 1))))
  return TritonConfig(block=block, num_warps=8 if size >= 1024 else 4)


def triton_flat_index(block: int) -> jax.Array:
  """uint32 flat indices of the current Triton program's block."""
  start = (pl.program_id(0) * block).astype(jnp.uint32)
  return start + jax.lax.iota(jnp.uint32, block)


class TritonBounded:
  """A Triton block ref read and written only where ``mask`` holds.

  jax 0.11.2's Triton lowering emits unmasked loads and stores for a block
  that runs past its array's end (0.12 masks them): the last program of a
  ragged leaf then writes past the leaf, into whatever buffer XLA placed
  after it (docs/pallas_notes.md, "Triton: ragged blocks"). The kernels
  wrap such refs; ``[...]`` reads (zeros outside the mask) and writes
  (nothing outside it) the whole block. A mask over the block's leading
  axes covers whole rows of a ref with more axes (an 8-bit kernel's rows
  of codes beside its one scale a row).
  """

  def __init__(self, ref, mask):
    extra = len(ref.shape) - mask.ndim
    if extra:
      mask = jnp.broadcast_to(mask.reshape(mask.shape + (1,) * extra), ref.shape)
    self.ref, self.mask = ref, mask

  @property
  def dtype(self):
    return self.ref.dtype

  @property
  def shape(self):
    return self.ref.shape

  def __getitem__(self, key):
    from jax.experimental.pallas import triton as plgpu
    if key is not Ellipsis:
      raise TypeError("TritonBounded reads the whole block ([...])")
    return plgpu.load(self.ref, mask=self.mask, other=0)

  def __setitem__(self, key, value):
    from jax.experimental.pallas import triton as plgpu
    if key is not Ellipsis:
      raise TypeError("TritonBounded writes the whole block ([...])")
    plgpu.store(self.ref, jnp.asarray(value, self.ref.dtype), mask=self.mask)


def triton_masks(n: int, block: int, interpret) -> bool:
  """Whether a Triton kernel over ``n`` elements (or rows) in blocks of
  ``block`` masks its last block: when the block does not divide ``n`` and
  the kernel is compiled. Interpret mode pads a ragged block itself and
  drops what falls outside the array; there the masks would only change
  XLA:CPU's program for the kernel body, and with it the rounding of a few
  elements between a sharded and an unsharded run (docs/pallas_notes.md,
  "Triton: ragged blocks")."""
  return n % block != 0 and not interpret


def triton_bound(refs, mask, ragged: bool):
  """``refs`` as :class:`TritonBounded` under ``mask`` where ``ragged``
  (the grid runs past the array's end), else as they are: a leaf that the
  blocks divide keeps its plain, unmasked accesses."""
  if not ragged:
    return tuple(refs)
  return tuple(TritonBounded(r, mask) for r in refs)


# Rows of a Mosaic block: a multiple of 16 (bf16 packs 16 rows a vreg tile,
# fp32 8) unless it is the array's whole extent.
SUBLANES = 16
# Row blocks that divide the rows: multiples of 16, else of 8 (an (8, 128)
# tile; bf16 then fills half its packed vreg tiles).
ROW_MULTIPLES = (SUBLANES, 8)
# Double-buffered pipeline blocks of all a kernel's operands must fit the
# scoped VMEM limit with room for Mosaic's own scratch. The kernels raise the
# limit to what their blocks take (:func:`mosaic_vmem_limit`): a grid step
# has a fixed cost, so a streaming kernel needs blocks of megabytes to run
# near the HBM bandwidth (docs/kernels.md, "TPU block sizes"). 32 MiB of
# blocks leaves room on every TPU the compile tier targets (v5e and v6e: 128
# MiB of VMEM a core; v5p: 95 MiB).
MOSAIC_VMEM_BYTES = 32 * 2**20
# Mosaic's internal scratch and the kernel's temporaries beside the blocks.
MOSAIC_VMEM_HEADROOM = 8 * 2**20
# The default scoped VMEM limit of v5e (v6e: 32 MiB); never asked below it.
MOSAIC_VMEM_DEFAULT = 16 * 2**20


def mosaic_vmem_limit(block_bytes: int) -> int:
  """The scoped VMEM limit a kernel whose double-buffered blocks take
  ``block_bytes`` asks for."""
  return max(MOSAIC_VMEM_DEFAULT, block_bytes + MOSAIC_VMEM_HEADROOM)


@dataclasses.dataclass(frozen=True)
class MosaicTiling:
  """How a Mosaic elementwise kernel steps over one leaf.

  ``view``: the shape the kernel sees, ``(M, C)`` or ``(A, R, C)``, a
  reshape of the leaf that keeps its TPU layout (a bitcast); ``block``: one
  grid step's block, ``None`` for a squeezed leading dim (one slab a step).
  A block dim divides its extent, or (``ragged_edge``) leaves a padded last
  block, which Pallas pads on load and clips on store.
  """
  view: tuple[int, ...]
  block: tuple[int | None, ...]

  @property
  def grid(self) -> tuple[int, ...]:
    return tuple(pl.cdiv(d, b or 1) for d, b in zip(self.view, self.block))

  def spec(self) -> pl.BlockSpec:
    return pl.BlockSpec(self.block, lambda *ids: ids)

  def vmem_bytes(self, stream_bytes: int) -> int:
    """VMEM of the double-buffered blocks of operands and results taking
    ``stream_bytes`` bytes an element together, rows padded to the 8 of an
    fp32 tile and columns to the 128 lanes."""
    return block_vmem_bytes(self.block, stream_bytes)

  @property
  def semantics(self) -> tuple[str, ...]:
    return ("parallel",) * len(self.view)

  def flat_index(self, offset=None, shape=None) -> jax.Array:
    """uint32 row-major flat indices in the whole ``view`` of the current
    grid step's block (inside the kernel); with ``offset`` and ``shape``, of
    the chunk of ``shape`` at ``offset`` (per block dim) inside the block."""
    shape = shape or tuple(b for b in self.block if b is not None)
    offset = offset or (0,) * len(shape)
    index, axis, stride = None, len(shape), 1
    for d in reversed(range(len(self.view))):
      b = self.block[d]
      # Grid sizes are static here: pl.num_programs is never read (it goes
      # stale across grids, docs/pallas_notes.md).
      coord = (pl.program_id(d) * (b or 1)).astype(jnp.uint32)
      if b is not None:
        axis -= 1
        if not isinstance(offset[axis], int) or offset[axis]:
          coord = coord + jnp.asarray(offset[axis]).astype(jnp.uint32)
        coord = coord + jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
      term = coord if stride == 1 else coord * jnp.uint32(stride & 0xFFFFFFFF)
      index = term if index is None else index + term
      stride *= self.view[d]
    return index

  def for_each_chunk(self, body, *, unrolled: bool = False) -> None:
    """Inside the kernel: ``body(view, index)`` for each chunk of the grid
    step's block, ``view(ref)`` the chunk's window of a block ref and
    ``index`` its elements' flat indices (:meth:`flat_index`).

    A chunk is :data:`CHUNK` (16 rows, a packed bf16 vreg tile, by 512
    lanes: 8 fp32 vregs an operand), so the body's temporaries stay in
    registers; the whole block as one value spilled every temporary of a
    block of megabytes to VMEM and back, and the step cost more vector
    bundles than its bytes take to stream (docs/kernels.md, "TPU: chunks").
    The full chunks are a loop (one body whatever the block); a block whose
    rows or columns the chunk does not divide ends with a static chunk of
    the rest. ``unrolled``: static chunks only (interpret mode, where jax's
    TPU interpreter with race detection runs a loop of dynamic slices
    slowly); the same elements get the same arithmetic either way. A 3-D
    block (several slabs a step, small by construction) is one chunk."""
    block = tuple(b for b in self.block if b is not None)
    if len(block) != 2:
      body(lambda ref: ref, self.flat_index())
      return
    (n_rows, rest_rows), (n_cols, rest_cols) = (divmod(b, c) for b, c in zip(block, CHUNK))

    def run(r0, rows, c0, cols):
      window = (pl.ds(r0, rows), pl.ds(c0, cols))
      body(lambda ref: ref.at[window], self.flat_index((r0, c0), (rows, cols)))

    def loop(n, size, fn):
      if unrolled or n == 1:
        for i in range(n):
          fn(i * size)
      elif n:
        jax.lax.fori_loop(0, n, lambda i, c: (fn(pl.multiple_of(i * size, size)), c)[1], 0)

    def columns(r0, rows):
      loop(n_cols, CHUNK[1], lambda c0: run(r0, rows, c0, CHUNK[1]))
      if rest_cols:
        run(r0, rows, n_cols * CHUNK[1], rest_cols)

    loop(n_rows, CHUNK[0], lambda r0: columns(r0, CHUNK[0]))
    if rest_rows:
      columns(n_rows * CHUNK[0], rest_rows)


# A Mosaic elementwise kernel's chunk (MosaicTiling.for_each_chunk).
CHUNK = (16, 512)


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def block_vmem_bytes(block, stream_bytes: int) -> int:
  """VMEM of a grid step's blocks (``None`` dims squeezed), double-buffered."""
  return 2 * stream_bytes * math.prod(
      _round_up(b or 1, m) for b, m in zip(block, (1,) * (len(block) - 2) + (8, LANES)))


def _divisor(extent: int, most: int, multiple: int) -> int | None:
  """The largest multiple of ``multiple`` up to ``most`` dividing ``extent``."""
  for b in range(most - most % multiple, 0, -multiple):
    if extent % b == 0:
      return b
  return None


def _row_block(extent: int, most: int, ragged_edge: bool) -> int:
  """Rows a step, at most ``most`` (a multiple of 8) unless the whole extent.

  A divisor of the extent, a multiple of 16 (else of 8: an (8, 128) tile,
  half a packed bf16 one); with ``ragged_edge``, ``most`` itself when every
  such divisor is under a quarter of it; else the whole extent (which the
  caller checks against VMEM)."""
  if extent <= most:
    return extent
  for m in ROW_MULTIPLES:
    b = _divisor(extent, most, m)
    if b is not None and (not ragged_edge or 4 * b >= most):
      return b
  return most if ragged_edge else extent


def mosaic_tiling(shape, config: MosaicTPUConfig, *, stream_bytes: int,
                  ragged_edge: bool = False) -> MosaicTiling | None:
  """The tiling of a leaf of ``shape`` for a kernel whose operands and
  results together take ``stream_bytes`` bytes an element (Adam with fp32 p
  and g and bf16 moments: 4 + 4 + 2 + 2 in, 4 + 2 + 2 out).

  A leaf of two or more dims whose last dim spans the 128 lanes keeps its
  layout. Columns: the whole last dim (any width: a full-extent block is
  legal), or, when 16 rows of it exceed the budget, the widest multiple of
  128 dividing it that fits. Rows: see :func:`_row_block`; ``ragged_edge``
  allows a padded last block, for kernels with no aliased output (jax
  0.11.2's TPU interpreter returns an aliased output padded to whole
  blocks, a shape error). Other leaves are viewed as flat ``(size // 128,
  128)`` lanes: a 1-D leaf (a bitcast on TPU too), a leaf with a last dim
  under 128 (XLA stores those with the last dim major, so no view of them is
  native), and one whose smallest native block overflows VMEM (a relayout
  copy). ``None`` when no tiling applies (a flat size that is not a
  multiple of 128, or flat rows with no divisor and no ragged edge): the
  caller runs the reference.
  """
  # (a budget past VMEM shrinks to it: only a minimal block that does not fit
  # leaves the native layout)
  budget = min(config.block_elements, MOSAIC_VMEM_BYTES // (2 * stream_bytes))
  # (a bf16 block of 8 rows would pad to 16: the headroom covers it)
  fits = lambda block: block_vmem_bytes(block, stream_bytes) <= MOSAIC_VMEM_BYTES
  if len(shape) >= 2 and shape[-1] >= LANES and math.prod(shape):
    *lead, r, c = (int(d) for d in shape)
    a = math.prod(lead)
    c_pad = _round_up(c, LANES)
    if c % LANES or SUBLANES * c_pad <= budget:
      bc = c
    else:
      bc = max(b for b in range(LANES, c + 1, LANES) if c % b == 0 and SUBLANES * b <= budget)
    bc_pad = _round_up(bc, LANES)
    most_rows = budget // bc_pad
    most_rows = most_rows - most_rows % (SUBLANES if most_rows >= SUBLANES else 8) or 8
    rows = lambda extent: _row_block(extent, most_rows, ragged_edge)
    if a == 1 or r % SUBLANES == 0:
      # Whole tiles per slab: merging the leading dims into the rows keeps
      # the layout.
      tiling = MosaicTiling((a * r, c), (rows(a * r), bc))
    elif r <= most_rows:
      most_slabs = max(1, budget // (_round_up(r, SUBLANES) * bc_pad))
      slabs = a if a <= most_slabs else _divisor(a, most_slabs, 1)
      tiling = MosaicTiling((a, r, c), (slabs if slabs > 1 else None, r, bc))
    else:
      tiling = MosaicTiling((a, r, c), (None, rows(r), bc))
    if fits(tiling.block):
      return tiling
  size = math.prod(shape)
  if size == 0 or size % LANES:
    return None
  flat_rows = size // LANES
  block = _row_block(flat_rows, budget // LANES // SUBLANES * SUBLANES, ragged_edge)
  tiling = MosaicTiling((flat_rows, LANES), (block, LANES))
  return tiling if fits(tiling.block) else None
