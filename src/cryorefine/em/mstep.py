"""The M-step pieces every job shares: weighted sums into a back-projector, a map reconstructed
from it (τ² regularised, solvent-flattened), RELION's joining of two halves at low resolution, and
maximizationOtherParameters (noise spectra, σ of the offsets, norm and scale corrections).

Everything runs with the array module of the sums it is given: CuPy FFTs and reductions on the
device for the GPU engine's sums, numpy otherwise; the maps come back to the host as float32.
"""

from __future__ import annotations

import math

import numpy as np

from cryorefine.core.arrays import to_host
from cryorefine.core.projector import BackProjector
from cryorefine.core.symmetry import symmetry_group
from cryorefine.em.schedule import MINRES_MAP_SHELL
from cryorefine.images import coefficients_per_shell

MIN_SIGMA2_OFFSET_ANGSTROM2 = 2.0  # RELION's --min_sigma2_offset


def backprojector(data, weight, model, config, current_size_px, xp):
    """A BackProjector over the padded sums `data` (complex) and `weight` (real) of one class, symmetrised
    with --sym (RELION's symmetriseReconstructions, right after the sums are combined: the FSC, the noise
    spectra and the reconstruction all see the symmetrised sums). The sums are changed in place."""
    data = xp.asarray(data, dtype=xp.complex128)
    weight = xp.asarray(weight, dtype=xp.float64)
    bp = BackProjector.from_arrays(data, weight, model.ori_size_px, config.padding_factor, current_size_px // 2,
                                   xp=xp)
    bp.symmetrise(symmetry_group(config.symmetry))
    return bp


def summed_backprojector(bps, model, config, current_size_px, xp):
    """A BackProjector over the sums of several (e.g. the two halves'), not symmetrised again."""
    return BackProjector.from_arrays(sum(bp.data for bp in bps), sum(bp.weight for bp in bps), model.ori_size_px,
                                     config.padding_factor, current_size_px // 2, xp=xp,
                                     hermitian_enforced=all(bp.hermitian_enforced for bp in bps))


def reconstruct_map(bp, tau2, model, config, xp, masks):
    """The map of a back-projector regularised by `tau2` (per shell, host) from shell 5 on (RELION's
    --minres_map: the lowest shells are not regularised), solvent-flattened as
    `masks` (em.solvent.SolventMasks) says (with --flatten_solvent: times --solvent_mask or the soft sphere of
    the particle diameter, then --solvent_mask2's region at its average); a host float32 volume (the maps go
    on as they are written, so a continued run sees exactly the same)."""
    volume = bp.reconstruct(tau2=xp.asarray(tau2), tau2_fudge=config.tau2_fudge, minres_map_px=MINRES_MAP_SHELL)
    return to_host(masks.apply(volume, xp)).astype(np.float32)


def unregularised_map(bp, xp):
    """The half map without τ² and without masks (RELION's _unfil.mrc: data / max(weight, mean/1000), the
    same gridding correction), as --solvent_correct_fsc compares them; on the sums' device."""
    return bp.reconstruct(tau2=None)


def join_halves_at_low_resolution(bps, resolution_angstrom, model):
    """RELION's joinTwoHalvesAtLowResolution: both halves get the sum of their data below a resolution."""
    grid = bps[0].grid
    shell_limit = model.ori_size_px * model.pixel_size_angstrom / resolution_angstrom
    r2 = grid.radius2(bps[0].xp)
    low = r2 <= (shell_limit * grid.padding_factor) ** 2
    data = bps[0].data[low] + bps[1].data[low]
    weight = bps[0].weight[low] + bps[1].weight[low]
    for bp in bps:
        bp.data[low] = data
        bp.weight[low] = weight


def maximize_other_parameters(model, config, sums, do_cc):
    """RELION's maximizationOtherParameters from a list of WeightedSums (two halves, or one set):
    noise spectra, σ offsets (at least 2 Å²), average norm (--norm) and scales (--scale), with CC
    (--firstiter_cc) only the log-likelihood and average pmax. Changes `model`."""
    box = model.ori_size_px
    total = sum(s.n_particles for s in sums)
    if not do_cc:
        sigma2_sum = sum(s.sigma2_noise for s in sums)
        sumw = sum(s.sumw_group for s in sums)
        per_shell = coefficients_per_shell(box)
        new = sigma2_sum / (2.0 * np.maximum(sumw, 1e-300)[:, None] * np.maximum(per_shell, 1.0)[None, :])
        keep = new > 1e-14
        model.sigma2_noise = np.where(keep, new, model.sigma2_noise)
        offset2 = sum(s.sigma2_offset_angstrom2 for s in sums) / (2.0 * total)
        model.sigma_offset_angstrom = math.sqrt(max(offset2, MIN_SIGMA2_OFFSET_ANGSTROM2))
        if config.do_norm:
            model.avg_norm_correction = sum(s.norm_correction for s in sums) / total
        if config.do_scale and sums[0].scale_aa is not None:
            xa = sum(s.scale_xa for s in sums)
            aa = sum(s.scale_aa for s in sums)
            scale = np.where(aa > 0, xa / np.maximum(aa, 1e-300), 1.0)
            median = np.median(scale)
            scale = np.clip(scale, median / 5, median * 5)
            model.scale_correction = scale / np.mean(scale)
    model.log_likelihood = sum(s.log_likelihood for s in sums)
    model.ave_pmax = sum(s.sum_pmax for s in sums) / total
