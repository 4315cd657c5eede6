"""The device memory an iteration's large arrays take, in bytes, as the GPU engine and the M-step make them:
what decides whether a finished half set's sums wait on the host (`halves_wait_on_host`), and what
`cryorefine plan` predicts.

The arrays that grow with the box (N px, padded box Np = pf·N, compact grid of V elements at the
iteration's r_max; `core.grid.PaddedGrid`, 3D, or 2D for a 2D classification's references, whose grids and
temporaries are a box's side smaller):
- a work unit's back-projection sums: complex64 data and float32 weights per class, 12·V bytes each;
- its references while the E-step is set up: complex64 transforms per class, and building one
  (`core.padded_transforms`, written in its place): the map, its planes' transforms (N·D·W complex64),
  one slab;
- a reconstruction in the M-step: the complex64 half transform of the padded box, three float32 maps
  of the box, one slab's float64 temporaries (`core.reconstruct`);
- a batch's image preparation: float64 images of the whole box and their transforms, prepared a few
  at a time where the free memory is short; the prepared transforms at the current size, joined
  into one batch for the engine.

Both half sets' sums stay on the device when they fit beside the larger of one unit's set-up (with
room for the E-step's batches) and a reconstruction; otherwise the half that is not being worked on
waits on the host, so that only one half's sums are ever on the device: RELION's footprint per MPI
rank, which holds one half.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cryorefine.core.grid import SLAB_ELEMENTS, PaddedGrid, padded_size_px

#: bytes per element of the float64 temporaries of one slab (`core.reconstruct`, `core.padded_transforms`)
SLAB_BYTES_PER_ELEMENT = 150.0
#: float32 maps of the box alive at once in a reconstruction (the window, the masks)
MAPS_PER_RECONSTRUCTION = 3
#: room kept for the E-step's batches when deciding whether both halves' sums stay on the device
BATCH_RESERVE_BYTES = 2.0e9
#: device bytes a batch's image preparation takes on the arena's stack per pixel of each image (`images.prepare_batch`
#: works on the whole box; measured on the H100 when it worked in float64: 5.1 GB for 128 images of 512² px; its
#: float32 images now take less, and the figure is kept as a bound)
PREPARATION_BYTES_PER_PIXEL = 160.0
#: the share of the free device memory one part of a batch's preparation may take for its temporaries (they are gone
#: before the engine runs)
PREPARATION_SHARE = 0.5
#: device bytes of a prepared image per pixel of the current size (`estep.engine.Batch`: masked and unmasked complex128
#: half transforms, a float64 CTF)
PREPARED_BYTES_PER_PIXEL = 20.0
#: the share of the free device memory the prepared images handed to the engine at once may take; the rest is the
#: engine's
PREPARED_SHARE = 0.25
#: the share of the free device memory the two device buffers of the images' overlapped uploads may take
#: (`gpu.staging.UploadSlots`; 1.06 GB for batches of 1,024 float32 images of 360 px); past it, images are
#: uploaded where they are prepared, as the preparation's part of the wait
UPLOAD_SLOTS_SHARE = 0.05
#: the share of the free device memory (before a run's first E-step) the particle images a GPU process keeps there from
#: one iteration to the next may take (`data.KeptImages`: 27 GB for 105,247 float16 images of 360 px); the rest is the
#: iterations'
KEPT_IMAGES_SHARE = 0.25


def slab_bytes(grid_shape: tuple[int, ...]) -> float:
    """One slab's temporaries in a loop over a padded grid."""
    return min(SLAB_ELEMENTS, float(np.prod(grid_shape))) * SLAB_BYTES_PER_ELEMENT


def sums_bytes(grid_shape: tuple[int, ...], n_classes: int) -> float:
    """A work unit's back-projection sums: complex64 data and float32 weights per class (3D or 2D grids alike)."""
    return n_classes * float(np.prod(grid_shape)) * (8 + 4)


def references_bytes(grid_shape: tuple[int, ...], box_px: int, n_classes: int) -> float:
    """The E-step's references: complex64 transforms of every class (each built in its place), and the temporaries
    of building one: the map and its planes' transforms, one slab; of a 2D classification's references (a 2D
    `grid_shape` (d, w)), the image with its gridding correction in float64, the padded box (about d² pixels) and
    its transform, and the grid's temporaries."""
    volume = float(np.prod(grid_shape))
    d, w = grid_shape[0], grid_shape[-1]
    if len(grid_shape) == 2:
        return n_classes * volume * 8 + float(box_px) ** 2 * 24 + float(d) ** 2 * 12 + slab_bytes(grid_shape)
    return n_classes * volume * 8 + float(box_px) ** 3 * 4 + float(box_px) * d * w * 8 + slab_bytes(grid_shape)


def reconstruction_bytes(grid_shape: tuple[int, ...], box_px: int, padded_size_px: int) -> float:
    """One reconstruction's temporaries in the M-step; of a 2D reference (a 2D `grid_shape`), the padded box's half
    transform (complex128 at most), the box's inverse, the image's maps in float64 and the grid's temporaries
    (`core.reconstruct.reconstruct_image` takes the small grid whole)."""
    npad = float(padded_size_px)
    if len(grid_shape) == 2:
        return npad * (padded_size_px // 2 + 1) * 16 + npad ** 2 * 8 \
            + MAPS_PER_RECONSTRUCTION * float(box_px) ** 2 * 8 + slab_bytes(grid_shape)
    return npad ** 2 * (padded_size_px // 2 + 1) * 8 + MAPS_PER_RECONSTRUCTION * float(box_px) ** 3 * 4 \
        + slab_bytes(grid_shape)


def images_per_preparation(free_bytes: float, box_px: int) -> int:
    """The most images of `box_px` prepared at once (one part of a batch) in `free_bytes`."""
    return max(1, int(PREPARATION_SHARE * free_bytes / (PREPARATION_BYTES_PER_PIXEL * float(box_px) ** 2)))


def upload_slots_room(free_bytes: float | None) -> int:
    """Device bytes the images' overlapped uploads may take (0 on the host, where `free_bytes` is None)."""
    return 0 if free_bytes is None else int(UPLOAD_SLOTS_SHARE * free_bytes)


def whole_box_iteration_bytes(box_px: int, padding_factor: float, n_maps: int, ndim: int = 3) -> float:
    """What an iteration at the whole box may take on the device beside the images kept there: the sums and the
    references of `n_maps` maps (a classification's classes, a refinement's two halves), one reconstruction and the
    batches' reserve."""
    grid = PaddedGrid.create(box_px, padding_factor, box_px // 2, ndim=ndim).shape
    return (sums_bytes(grid, n_maps) + references_bytes(grid, box_px, n_maps)
            + reconstruction_bytes(grid, box_px, padded_size_px(box_px, padding_factor)) + BATCH_RESERVE_BYTES)


def kept_images_capacity(free_bytes: float | None, image_bytes: int, n_owned: int, reserve_bytes: float = 0.0) -> int:
    """How many of a process's `n_owned` particle images of `image_bytes` it keeps on the device, in `free_bytes`:
    KEPT_IMAGES_SHARE of it at most, leaving `reserve_bytes` (`whole_box_iteration_bytes`) free; 0 on the host, where
    `free_bytes` is None."""
    if free_bytes is None:
        return 0
    room = min(KEPT_IMAGES_SHARE * free_bytes, free_bytes - reserve_bytes)
    return max(0, min(int(n_owned), int(room) // max(1, int(image_bytes))))


def images_per_engine_run(free_bytes: float, current_size_px: int) -> int:
    """The most prepared images of `current_size_px` handed to the engine at once in `free_bytes` (the parts they
    were prepared in, `images_per_preparation`, joined)."""
    return max(1, int(PREPARED_SHARE * free_bytes / (PREPARED_BYTES_PER_PIXEL * float(current_size_px) ** 2)))


def halves_take_turns(free_bytes: float, away_bytes: float, reconstruction_bytes_: float) -> bool:
    """True when the M-step cannot bring the sums that wait on the host (`away_bytes`) onto the device beside a
    reconstruction in `free_bytes` (what the half already there leaves): then the halves take turns."""
    return away_bytes > 0 and away_bytes + reconstruction_bytes_ > free_bytes


def halves_wait_on_host(free_bytes: float, unit_sums_bytes: Sequence[float], unit_setup_bytes: float,
                        reconstruction_bytes_: float) -> bool:
    """True when the sums of every unit (`unit_sums_bytes`, one figure per unit) do not fit in `free_bytes`
    beside the larger of one unit's set-up (references, and the batches' reserve) and a reconstruction:
    then a finished unit's sums wait on the host while the others are worked on."""
    if len(unit_sums_bytes) < 2:
        return False
    need = sum(unit_sums_bytes) + max(unit_setup_bytes + BATCH_RESERVE_BYTES, reconstruction_bytes_)
    return need > free_bytes
