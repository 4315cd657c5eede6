"""The M-step pieces every job shares: weighted sums into a back-projector, a map reconstructed
from it (τ² regularised, solvent-flattened), RELION's joining of two halves at low resolution, and
maximizationOtherParameters (noise spectra, σ of the offsets, norm and scale corrections).

Everything runs with the array module of the sums it is given and in their precision (the GPU
engine's float32 sums stay float32; float64 only in per-shell sums and one slab's temporaries): CuPy
FFTs and reductions on the device for the GPU engine's sums, numpy otherwise; nothing the size of the
sums is copied (`core.reconstruct` works in slabs); the maps come back to the host as float32.
"""

from __future__ import annotations

import math

import numpy as np

from cryorefine.core import reconstruct
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
    bp = BackProjector.from_arrays(data, weight, model.ori_size_px, config.padding_factor, current_size_px // 2,
                                   xp=xp)
    bp.symmetrise(symmetry_group(config.symmetry))
    return bp


def joined_backprojector(bps, model, config, current_size_px, xp):
    """A BackProjector over the sums of several (the two halves'), not symmetrised again: the others' sums are
    added into the first's, in place (no third copy of the sums: make what needs the first's own sums before)."""
    first = bps[0]
    for bp in bps[1:]:
        first.data += bp.data
        first.weight += bp.weight
    return BackProjector.from_arrays(first.data, first.weight, model.ori_size_px, config.padding_factor,
                                     current_size_px // 2, xp=xp,
                                     hermitian_enforced=all(bp.hermitian_enforced for bp in bps))


def half_sets_fsc(bps, xp):
    """The FSC (N//2+1,) on the host between the downsampled averages of two back-projectors' sums (RELION's
    getDownsampledAverage and getFSC), summed a run of planes at a time."""
    return to_host(reconstruct.half_sets_fsc((bps[0].data, bps[0].weight), (bps[1].data, bps[1].weight),
                                             bps[0].grid, xp))


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
    """RELION's joinTwoHalvesAtLowResolution: both halves get the sum of their data below a resolution (only the
    small box around the origin that holds those frequencies is touched)."""
    grid = bps[0].grid
    xp = bps[0].xp
    shell_limit = model.ori_size_px * model.pixel_size_angstrom / resolution_angstrom
    limit2 = (shell_limit * grid.padding_factor) ** 2
    reach = min(int(math.floor(math.sqrt(limit2))), grid.origin)
    o = grid.origin
    box = (slice(o - reach, o + reach + 1), slice(o - reach, o + reach + 1), slice(0, reach + 1))
    kz, ky, kx = grid.frequencies(xp)
    low = (kz[box[0]] ** 2 + ky[:, box[1]] ** 2 + kx[:, :, box[2]] ** 2) <= limit2
    data = xp.where(low, bps[0].data[box] + bps[1].data[box], 0)
    weight = xp.where(low, bps[0].weight[box] + bps[1].weight[box], 0)
    for bp in bps:
        bp.data[box] = xp.where(low, data, bp.data[box])
        bp.weight[box] = xp.where(low, weight, bp.weight[box])


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
