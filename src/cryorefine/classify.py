"""`cryorefine classify`: RELION's 3D classification (relion_refine --K N, without --auto_refine).

All particles form one set; K references are refined side by side. RELION's rules:
- references: a single map is copied to all K classes (low-passed to --ini_high); in the first
  likelihood iteration (the second with --firstiter_cc) every particle is compared with one
  class drawn at random, so each class is rebuilt from a random ~1/K of the data ("seeds"); a
  STAR file of maps (rlnReferenceImage) gives one class per map and no seeds;
- with --firstiter_cc the first iteration uses class 1 alone (cross-correlation), and its map,
  low-passed to --ini_high again, is copied to every class;
- τ² of a class is the power spectrum of its previous reference (as the projector computes it);
  the reconstruction adds 1/(pf³·tau2_fudge·τ²) to the weights; the SSNR (data vs prior) is
  tau2_fudge·τ²/σ²_reconstruction; the resolution is where the best class's SSNR drops below 1;
- the class distribution is Σw per class and the class prior of the next search (RELION folds it
  into per-class direction distributions, which with few particles per direction shut directions
  out; those are written to the model file but not used as a prior); the sampling stays as given
  (no auto-sampling) and every one of --iter iterations runs (no convergence test).
Outputs per iteration: run_itNNN_data.star (rlnClassNumber), run_itNNN_classKKK.mrc,
run_itNNN_model.star (K classes), run_itNNN_optimiser.star, run_itNNN_sampling.star, and
run_itNNN_report.png (class distributions over the iterations, SSNR per class, orientations).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np

from cryorefine import refine as refine_loop
from cryorefine import schedule
from cryorefine.core import fourier
from cryorefine.core.arrays import array_module, to_host
from cryorefine.core.projector import BackProjector, Projector
from cryorefine.core.sampling import next_perturbation
from cryorefine.data import load_particles
from cryorefine.errors import InputError
from cryorefine.estep.engine import IterationSetup, WeightedSums
from cryorefine.images import ImageSettings, prepare_batch
from cryorefine.io import mrc
from cryorefine.io.background import BackgroundWriter
from cryorefine.io.relion_outputs import (model_star_blocks, optimiser_star_blocks, sampling_star_blocks,
                                          write_optimiser_star)
from cryorefine.io.star import read_star, write_particle_star, write_star
from cryorefine.report import write_classification_report
from cryorefine.state import ModelState

log = logging.getLogger("cryorefine.classify")


def classify(config, argv=(), make_engine=None, progress=None, resume_from=None):
    """Run a 3D classification of config.n_classes classes; returns the IterationReports. `resume_from`: a
    run_itNNN_optimiser.star of an earlier run, continued from the iteration after it (--continue)."""
    if make_engine is None:
        make_engine = refine_loop.default_engine_factory(config)
    if config.symmetry.upper() != "C1":
        raise InputError(f"--sym {config.symmetry}: classify handles C1 only so far; run with --sym C1")
    with refine_loop._scope_of(make_engine, "run_scope"):
        return _classify(config, argv, make_engine, progress, resume_from)


def initial_references(config, box, pixel):
    """K maps (float64) and whether they came from one map (then iteration 1 or 2 draws random seeds)."""
    path = Path(config.reference_map)
    if path.suffix.lower() == ".star":
        table = read_star(path)
        rows = next((b for b in table.values() if hasattr(b, "columns") and "rlnReferenceImage" in b.columns), None)
        if rows is None:
            raise InputError(f"{path}: no rlnReferenceImage column; give a map, or a STAR file listing one map per "
                             f"class")
        names = [str(n) for n in rows["rlnReferenceImage"]]
        if len(names) != config.n_classes:
            raise InputError(f"{path}: lists {len(names)} maps but --K is {config.n_classes}; give --K {len(names)}")
        maps = [refine_loop.lowpass_to_ini_high(refine_loop.read_reference(path.parent / n, box, pixel)
                                                .astype(np.float64), config, box, pixel) for n in names]
        return maps, False
    single = refine_loop.lowpass_to_ini_high(refine_loop.read_reference(path, box, pixel).astype(np.float64), config,
                                             box, pixel)
    return [single.copy() for _ in range(config.n_classes)], config.n_classes > 1


def _classify(config, argv, make_engine, progress, resume_from=None):
    k_classes = int(config.n_classes)
    particles = load_particles(config.input_star)
    box, pixel = particles.geometry()
    if config.do_ctf:
        particles.require_ctf()
    out_root = Path(config.output_root)
    out_root.parent.mkdir(parents=True, exist_ok=True)
    diameter = schedule.default_particle_diameter_angstrom(config, box, pixel)
    settings = ImageSettings(box, pixel, diameter, config.width_mask_edge_px, config.zero_mask, config.do_ctf,
                             config.random_seed)
    initial_optimiser, _ = schedule.initial_schedule(config)
    n_dir = schedule.sampling_from_optimiser(initial_optimiser, config).n_directions
    if resume_from is not None:
        model, optimiser, _, rng, state = refine_loop.load_resume(
            resume_from, box, len(particles), classification=True,
            map_paths=lambda root: [[f"{root}_class{k + 1:03d}.mrc" for k in range(k_classes)]])
        carried = refine_loop.resume_extra_arrays(resume_from)
        pdf_direction = carried["pdf_direction"]
        distributions = list(carried["class_distributions"])
        seeded = bool(carried["seeded"])
        first_iteration = optimiser.iteration + 1
    else:
        maps, seeded = initial_references(config, box, pixel)
        n_optics = len(particles.optics_groups)
        state = refine_loop.ParticleState.from_particles(particles, pixel)
        optimiser = initial_optimiser
        model = ModelState(ori_size_px=box, pixel_size_angstrom=pixel, n_classes=k_classes,
                           padding_factor=config.padding_factor, pdf_class=np.full(k_classes, 1.0 / k_classes),
                           sigma_offset_angstrom=refine_loop.INITIAL_SIGMA_OFFSET_ANGSTROM,
                           scale_correction=np.ones(n_optics))
        model.maps = [maps]
        model.sigma2_noise = refine_loop._initial_noise(particles, settings, n_optics, config.batch_size,
                                                        refine_loop.image_array_module(make_engine))
        model.current_resolution_angstrom = schedule.current_resolution(
            box, pixel, iteration=0,
            ini_high_angstrom=schedule.starting_resolution_angstrom(config)).resolution_angstrom
        pdf_direction = np.full((k_classes, n_dir), 1.0 / (k_classes * n_dir))
        rng = np.random.default_rng(config.random_seed)
        distributions = []
        first_iteration = 1
    everyone = np.arange(len(particles))
    reports = []
    with BackgroundWriter() as writer:
        for iteration in range(first_iteration, config.max_iterations + 1):
            timings, stages, flops = {}, {}, {}
            optimiser = replace(optimiser, iteration=iteration)
            sizes = schedule.image_sizes(model.current_resolution_angstrom, optimiser.healpix_order, diameter, box,
                                         pixel, config.incr_size_px, False, False, ave_pmax=model.ave_pmax,
                                         oversampling=config.oversampling)
            model.current_size_px, model.coarse_size_px = sizes.current_size_px, sizes.coarse_size_px
            do_cc = iteration == 1 and config.firstiter_cc
            optimiser = replace(optimiser, perturbation=next_perturbation(optimiser.perturbation, 0.5, rng))
            sampling = schedule.sampling_from_optimiser(optimiser, config)
            seeds_now = seeded and iteration == (2 if config.firstiter_cc else 1)

            tic = time.perf_counter()
            old = state.copy()
            with refine_loop._scope_of(make_engine, "iteration_scope"):
                if do_cc:  # class 1 alone, all particles
                    sums = _expectation(config, make_engine, progress, particles, settings, model, sampling, sizes,
                                        state, iteration, True, [0], everyone, None, stages, flops)
                    sums = _as_classes(sums, [0], k_classes)
                elif seeds_now:  # each particle against one random class
                    draw = np.random.default_rng(config.random_seed + iteration).integers(0, k_classes, len(particles))
                    parts = [_expectation(config, make_engine, progress, particles, settings, model, sampling, sizes,
                                          state, iteration, False, [k], np.flatnonzero(draw == k), None, stages, flops)
                             for k in range(k_classes)]
                    sums = _merge([_as_classes(p, [k], k_classes) for k, p in enumerate(parts)])
                else:
                    sums = _expectation(config, make_engine, progress, particles, settings, model, sampling, sizes,
                                        state, iteration, False, list(range(k_classes)), everyone, pdf_direction,
                                        stages, flops)
                refine_loop.keep_norms_unless_refined(config, old, state)
                timings["expectation"] = time.perf_counter() - tic
                tic = time.perf_counter()
                changes = refine_loop._hidden_variable_changes(old, state, pixel, config.symmetry)
                with refine_loop._scope_of(make_engine, "maximization_scope"):
                    _maximize(model, config, sums, sizes, do_cc)
                pdf_direction = _direction_distribution(sums, k_classes, n_dir)
                del sums
            model.current_resolution_angstrom = schedule.current_resolution(
                box, pixel, data_vs_prior=model.ssnr[0], iteration=iteration,
                ini_high_angstrom=config.ini_high_angstrom, firstiter_cc=config.firstiter_cc,
                check_high_res_side=False).resolution_angstrom
            optimiser = replace(optimiser, changes_optimal_orientations_deg=changes.orientations_deg,
                                changes_optimal_offsets_angstrom=changes.offsets_angstrom,
                                changes_optimal_classes=changes.classes)
            timings["maximization"] = time.perf_counter() - tic
            tic = time.perf_counter()
            distributions.append(np.asarray(model.pdf_class, dtype=np.float64).copy())
            snapshot = state.copy()  # the next E-step changes `state` while the writer thread reads this
            refine_loop.save_resume(f"{out_root}_it{iteration:03d}_resume.npz", config, model, optimiser, None, rng,
                                    snapshot, {"pdf_direction": pdf_direction,
                                               "class_distributions": np.array(distributions), "seeded": seeded})
            writes = _iteration_writes(out_root, iteration, particles, snapshot, model, optimiser, config, sampling,
                                       argv, pdf_direction)
            writes.insert(-1, partial(
                write_classification_report, f"{out_root}_it{iteration:03d}_report.png", iteration=iteration,
                class_distributions=np.array(distributions), ssnr=model.ssnr[0].copy(), ori_size_px=box,
                pixel_size_angstrom=pixel, resolution_angstrom=model.current_resolution_angstrom,
                rot_deg=snapshot.rot_deg, tilt_deg=snapshot.tilt_deg, timings_seconds=dict(timings)))
            writer.submit(writes)
            timings["write"] = time.perf_counter() - tic  # the loop's share: building the outputs, waiting for the last
            reports.append(refine_loop.IterationReport(
                iteration, model.current_resolution_angstrom, sizes.current_size_px, sizes.coarse_size_px,
                optimiser.healpix_order, False, changes.orientations_deg, changes.offsets_angstrom, model.ave_pmax,
                timings, dict(stages), dict(flops)))
            log.info("iteration %d: resolution %.2f Å, size %d/%d px, classes %s, Δangle %.2f°, Δoffset %.2f Å, "
                     "Δclass %.3f, pmax %.3f, E %.1f s, M %.1f s", iteration, model.current_resolution_angstrom,
                     sizes.current_size_px, sizes.coarse_size_px,
                     " ".join(f"{100 * p:.0f}%" for p in model.pdf_class), changes.orientations_deg,
                     changes.offsets_angstrom, changes.classes, model.ave_pmax, timings["expectation"],
                     timings["maximization"])
    return reports


def _expectation(config, make_engine, progress, particles, settings, model, sampling, sizes, state, iteration,
                 do_cc, classes, members, pdf_direction, stages, flops):
    """One engine over `members` against the classes `classes` (indices into model.maps[0]); results stored
    with those class numbers; returns the engine's sums (its class order = `classes`). Seconds per E-step
    stage are added to `stages`, the engine's operation counts to `flops`."""
    tic_setup = time.perf_counter()
    engine = make_engine()
    # the class prior: RELION folds it into a per-class direction distribution, which with few particles
    # per direction shuts whole directions out; the class distribution alone is used here
    with np.errstate(divide="ignore"):
        log_class = np.log(np.asarray(model.pdf_class, dtype=np.float64)[classes]) if pdf_direction is not None \
            else np.zeros(len(classes))
    engine.setup(IterationSetup(
        projectors=None, maps=[model.maps[0][k] for k in classes], sigma2_noise=model.sigma2_noise, sampling=sampling,
        ori_size_px=model.ori_size_px, current_size_px=sizes.current_size_px, coarse_size_px=sizes.coarse_size_px,
        pixel_size_angstrom=model.pixel_size_angstrom,
        log_pdf_class=log_class,
        sigma_offset_px=model.sigma_offset_angstrom / model.pixel_size_angstrom, do_cc=do_cc,
        adaptive_fraction=config.adaptive_fraction, max_significants=config.max_significants,
        scale_correction=model.scale_correction if config.do_scale else None,
        data_vs_prior=None if model.ssnr is None else model.ssnr[0][classes], padding_factor=config.padding_factor,
        avg_norm_correction=model.avg_norm_correction))
    old_angles = (state.rot_deg.copy(), state.tilt_deg.copy(), state.psi_deg.copy())
    xp = refine_loop.image_array_module(engine)
    tic_wait = refine_loop.add_seconds(stages, "setup", tic_setup)
    with particles.image_reader(np.arange(len(particles)) if config.preread_images else None) as reader:
        for indices, images in particles.read_ahead(particles.batches(config.batch_size, members), reader, xp):
            tic = refine_loop.add_seconds(stages, "read_wait", tic_wait)
            batch = prepare_batch(particles, indices, reader, settings, sizes.current_size_px,
                                  model.avg_norm_correction, iteration, state.origin_x_px, state.origin_y_px,
                                  refine_loop.image_norms(config, state), state.class_index, old_angles,
                                  xp=xp, images=images)
            del images
            refine_loop.add_seconds(stages, "images", tic)
            result = engine.run(batch)
            del batch  # its device arrays go before the next batch's (the arena is a stack)
            result.class_index = np.asarray(classes)[np.asarray(result.class_index)]
            state.store(indices, result)
            if progress:
                progress(indices.size, len(particles))
            tic_wait = time.perf_counter()
    refine_loop.add_engine_stages(stages, engine, flops)
    return engine.sums()


def _as_classes(sums, classes, k_classes):
    """Sums of an engine over `classes` spread to all K classes (zeros for the others), where the sums are
    (the padded volumes stay on the GPU for the GPU engine; the distributions come to the host)."""
    xp = array_module(sums.data[0])
    shape = sums.data[0].shape
    data = [xp.zeros(shape, xp.complex128) for _ in range(k_classes)]
    weight = [xp.zeros(shape, xp.float64) for _ in range(k_classes)]
    pdf_class = np.zeros(k_classes)
    pdf_direction = np.zeros((k_classes, sums.pdf_direction.shape[1]))
    for i, k in enumerate(classes):
        data[k] = sums.data[i].astype(xp.complex128)
        weight[k] = sums.weight[i].astype(xp.float64)
        pdf_class[k] = to_host(sums.pdf_class)[i]
        pdf_direction[k] = to_host(sums.pdf_direction)[i]
    return replace(sums, data=data, weight=weight, pdf_class=pdf_class, pdf_direction=pdf_direction)


def _merge(parts):
    first = parts[0]
    out = WeightedSums(data=[sum(p.data[k] for p in parts) for k in range(len(first.data))],
                       weight=[sum(p.weight[k] for p in parts) for k in range(len(first.weight))],
                       sigma2_noise=sum(p.sigma2_noise for p in parts), sumw_group=sum(p.sumw_group for p in parts))
    for name in ("sigma2_offset_angstrom2", "pdf_class", "pdf_direction", "norm_correction", "scale_xa", "scale_aa",
                 "log_likelihood", "sum_pmax", "n_particles"):
        setattr(out, name, sum(getattr(p, name) for p in parts))
    return out


def _direction_distribution(sums, k_classes, n_dir):
    pdf = np.asarray(sums.pdf_direction, dtype=np.float64).reshape(k_classes, n_dir)
    total = pdf.sum()
    return pdf / total if total > 0 else np.full((k_classes, n_dir), 1.0 / (k_classes * n_dir))


def _maximize(model, config, sums, sizes, do_cc):
    """Per class: τ² of the previous reference, reconstruction, SSNR; then the class distribution and the rest."""
    box, n_shells = model.ori_size_px, model.n_shells
    k_classes = model.n_classes
    r_max = sizes.current_size_px // 2
    tau2 = np.zeros((1, k_classes, n_shells))
    ssnr = np.zeros((1, k_classes, n_shells))
    ref_sigma2 = np.zeros((1, k_classes, n_shells))
    radius_px = schedule.default_particle_diameter_angstrom(config, box, model.pixel_size_angstrom) / (
        2 * model.pixel_size_angstrom)
    total_weight = float(np.sum(sums.pdf_class))
    pdf_class = np.asarray(sums.pdf_class, dtype=np.float64) / max(total_weight, 1e-300)
    new_maps = []
    for k in range(k_classes):
        previous = model.maps[0][k]
        xp = array_module(sums.data[k])
        t2 = to_host(Projector(xp.asarray(previous), config.padding_factor, r_max, xp=xp).power_spectrum)
        t2 = np.asarray(t2, dtype=np.float64)[:n_shells]
        t2[r_max + 1:] = 0.0
        bp = BackProjector.from_arrays(xp.asarray(sums.data[k], dtype=xp.complex128),
                                       xp.asarray(sums.weight[k], dtype=xp.float64), box, config.padding_factor, r_max,
                                       xp=xp)
        if pdf_class[k] <= 0 or float(bp.weight.sum()) <= 0:
            new_maps.append(np.zeros_like(previous, dtype=np.float32))
            continue
        sigma2 = to_host(bp.noise_sigma2())[:n_shells]
        volume = bp.reconstruct(tau2=xp.asarray(t2), tau2_fudge=config.tau2_fudge)
        if config.flatten_solvent:
            volume = volume * fourier.soft_spherical_mask(box, radius_px, config.width_mask_edge_px, xp)
        new_maps.append(to_host(volume).astype(np.float32))
        del bp, volume
        tau2[0, k, : t2.size] = t2
        ref_sigma2[0, k, : sigma2.size] = sigma2
        with np.errstate(divide="ignore", invalid="ignore"):
            s = np.where(sigma2 > 0, config.tau2_fudge * t2[: sigma2.size] / sigma2, 0.0)
        s[r_max + 1:] = 0.0
        ssnr[0, k, : s.size] = s
    if do_cc:  # class 1 seeds every class: low-passed again, the class distribution shared out
        xp = array_module(sums.data[0])
        first = to_host(refine_loop.lowpass_to_ini_high(xp.asarray(new_maps[0], dtype=xp.float64), config, box,
                                                        model.pixel_size_angstrom))
        new_maps = [first.astype(np.float32) for _ in range(k_classes)]
        tau2[0, :], ssnr[0, :], ref_sigma2[0, :] = tau2[0, 0], ssnr[0, 0], ref_sigma2[0, 0]
        pdf_class = np.full(k_classes, 1.0 / k_classes)
    model.maps = [new_maps]
    model.tau2, model.ssnr, model.reference_sigma2 = tau2, ssnr, ref_sigma2
    model.pdf_class = pdf_class
    model.class_distribution = pdf_class
    refine_loop.maximize_other_parameters(model, config, [sums], do_cc)


def _iteration_writes(out_root, iteration, particles, state, model, optimiser, config, sampling, argv,
                      pdf_direction):
    """The writes of one iteration's files as callables over what they need now (tables and STAR blocks are
    built here; the maps are the model's, which the next M-step replaces rather than changes); the
    optimiser STAR file comes last."""
    root = f"{out_root}_it{iteration:03d}"
    pixel = model.pixel_size_angstrom
    table = refine_loop._particle_table(particles, state, particles.random_subset, pixel)
    if "rlnRandomSubset" not in particles.star.particles.columns:  # classification has no half sets
        table = table.drop(columns=["rlnRandomSubset"])
    names, counts = refine_loop._optics_names_and_counts(particles)
    maps = [f"{root}_class{k + 1:03d}.mrc" for k in range(model.n_classes)]
    writes = [partial(write_particle_star, particles.star, f"{root}_data.star", table)]
    writes += [partial(mrc.write_volume, name, model.maps[0][k], pixel) for k, name in enumerate(maps)]
    writes += [
        partial(write_star, model_star_blocks(model, optimiser, config, None, maps, names, counts,
                                              pdf_direction=pdf_direction), f"{root}_model.star"),
        partial(write_star, sampling_star_blocks(sampling, optimiser, config, pixel), f"{root}_sampling.star"),
        partial(write_optimiser_star, f"{root}_optimiser.star",
                optimiser_star_blocks(optimiser, model, config, str(out_root), iteration), list(argv)),
    ]
    return writes
