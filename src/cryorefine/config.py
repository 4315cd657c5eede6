"""Options of `cryorefine refine` (relion_refine's names and defaults), one frozen dataclass.

Saved beside the outputs with the version and the command line, and read back by --continue.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class RefineConfig:
    """Every option of a refinement. Lengths in Å unless the name says px; angles in degrees."""

    input_star: str
    output_root: str
    reference_map: str
    particle_diameter_angstrom: float | None = None  # None: the whole box
    ini_high_angstrom: float | None = None  # low-pass of the initial reference
    symmetry: str = "C1"
    do_ctf: bool = False
    ctf_intact_first_peak: bool = False
    firstiter_cc: bool = False
    flatten_solvent: bool = False
    zero_mask: bool = False
    solvent_mask: str | None = None
    padding_factor: float = 2.0
    healpix_order: int = 2
    auto_local_healpix_order: int = 4
    offset_range_px: float = 6.0
    offset_step_px: float = 2.0
    oversampling: int = 1
    tau2_fudge: float = 1.0
    max_iterations: int = 50
    adaptive_fraction: float = 0.999
    max_significants: int = -1  # --maxsig; -1: no limit
    do_norm: bool = False
    do_scale: bool = False
    auto_refine: bool = True  # gold-standard halves with RELION's auto-sampling
    low_resol_join_halves_angstrom: float = 40.0
    random_seed: int = 0
    n_classes: int = 1
    width_mask_edge_px: float = 5.0
    incr_size_px: int = 10  # RELION's --incr_size
    batch_size: int = 256
    preread_images: bool = False  # --preread_images: read the images once into memory
    engine: str = "numpy"  # "numpy" or "cuda"
    gpu_ids: tuple = ()  # --gpu "0:1": the devices, one per worker (empty: device 0)
    free_gpu_memory_mb: float = 2048.0  # --free_gpu_memory: device memory left outside the arena
    dtype: str = "float64"  # numpy engine precision: float64 (oracle) or float32 (mirrors the GPU)

    def to_json(self):
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text):
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in json.loads(text).items() if k in known}
        if "gpu_ids" in values:
            values["gpu_ids"] = tuple(values["gpu_ids"])
        return cls(**values)
