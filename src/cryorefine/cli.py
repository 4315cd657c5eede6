"""The `cryorefine` command line: a click group, one function per command.

Logging, MPI and device set-up happen here only. Bad input ends with one line on stderr and
exit code 2 (a traceback only with --debug).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import click

from cryorefine import __version__
from cryorefine.config import RefineConfig
from cryorefine.errors import InputError, RunInterrupted, gpu_memory_message, resource_message


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cryorefine")
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
def cli(debug):
    """RELION-compatible cryo-EM 3D refinement (GPU E-step, MPI workers)."""


@cli.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the same as JSON.")
@click.option("--check-images", is_flag=True,
              help="Read every image: stacks exist, indices in range, one box size, no NaN/Inf pixels.")
def info(file, as_json, check_images):
    """What a particle STAR file or an MRC map/stack holds.

    For particles: count, optics groups (pixel size, box, voltage, Cs, Q0), stacks and whether
    they exist, defocus range, pose columns. For MRC: shape, pixel size, min/max/mean/rms.
    """
    from cryorefine.jobs.info import describe, format_text

    result = describe(file, check_images)
    click.echo(json.dumps(result, indent=2) if as_json else format_text(result))



@cli.command()
@click.option("--ref", required=True, type=click.Path(dir_okay=False), help="3D map to project (cubic MRC).")
@click.option("--n", "n_particles", required=True, type=int, help="Number of particles.")
@click.option("--o", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Output folder for particles.mrcs and particles.star.")
@click.option("--snr", default=0.05, show_default=True, type=float,
              help="Signal variance / noise variance inside the particle circle, per image (inf: no noise).")
@click.option("--defocus", default="0.8:2.5", show_default=True, help="Defocus range in µm, LOW:HIGH.")
@click.option("--astigmatism", default=0.05, show_default=True, type=float,
              help="Largest |defocus U − defocus V| in µm.")
@click.option("--voltage", default=300.0, show_default=True, type=float, help="Voltage in kV.")
@click.option("--cs", default=2.7, show_default=True, type=float, help="Spherical aberration in mm.")
@click.option("--q0", default=0.1, show_default=True, type=float, help="Amplitude contrast.")
@click.option("--angpix", default=None, type=float, help="Pixel size in Å [default: the map header].")
@click.option("--max_shift", default=None, type=float,
              help="Largest origin offset in Å, uniform in a disc [default: 3 pixels].")
@click.option("--particle_diameter", default=None, type=float,
              help="Diameter in Å of the circle in which --snr is measured [default: the box].")
@click.option("--sym", default="C1", show_default=True,
              help="Symmetrise the map with this point group first (poses stay uniform on SO(3)).")
@click.option("--noise", default="white", show_default=True, type=click.Choice(["white", "coloured"]),
              help="White noise, or coloured noise with a smooth 1/f-like power spectrum.")
@click.option("--no_ctf", is_flag=True, help="Do not apply a CTF (no CTF columns in the STAR file).")
@click.option("--seed", default=0, show_default=True, type=int, help="Random seed (same seed, same files).")
@click.option("--float16", is_flag=True,
              help="Write the stack in float16 (MRC mode 12, as relion_preprocess --float16): half the disk.")
@click.option("--batch", default=256, show_default=True, type=int, help="Images made per batch.")
@click.option("--gpu", "gpu", is_flag=False, flag_value="", default=None,
              help="Make the images on this GPU (first device listed) [default: GPU 0 when CuPy sees one].")
@click.option("--cpu", "force_cpu", is_flag=True, help="Make the images with numpy even when a GPU is present.")
def simulate(ref: str, n_particles: int, out_dir: str, gpu: str | None, force_cpu: bool, **made: Any) -> None:
    """Simulate particle images of a map with known poses, CTFs and noise (RELION 3.1 STAR + .mrcs).

    The STAR file's pose, origin and CTF columns are the ground truth, in RELION's conventions.
    """
    from cryorefine.jobs.simulate import SimulationOptions, parse_defocus_range_um
    from cryorefine.jobs.simulate import simulate as run_simulation

    # `made`: how the images are made, the options above but --ref, --n, --o and the engine's
    options = SimulationOptions(
        n_particles=n_particles, snr=made["snr"], defocus_range_um=parse_defocus_range_um(made["defocus"]),
        astigmatism_um=made["astigmatism"], voltage_kv=made["voltage"], cs_mm=made["cs"],
        amplitude_contrast=made["q0"], pixel_size_angstrom=made["angpix"], max_shift_angstrom=made["max_shift"],
        symmetry=made["sym"], noise=made["noise"], seed=made["seed"], batch_size=made["batch"],
        particle_diameter_angstrom=made["particle_diameter"], apply_ctf=not made["no_ctf"], float16=made["float16"])
    engine = engine_options(gpu, force_cpu, 0.0)

    def log(message):
        click.echo(message, err=True)

    if engine["engine"] == "cuda":
        import cupy

        with cupy.cuda.Device((engine["gpu_ids"] or (0,))[0]):
            result = run_simulation(ref, out_dir, options, log=log, xp=cupy)
    else:
        result = run_simulation(ref, out_dir, options, log=log)
    click.echo(f"wrote {result['n_particles']} particles ({result['box_px']} px, "
               f"{result['pixel_size_angstrom']:.4f} Å/px): {result['star']}")


@cli.command()
@click.option("--i", "star", required=True, type=click.Path(dir_okay=False), help="Particle STAR file with poses.")
@click.option("--o", "out", required=True, type=click.Path(dir_okay=False), help="Output map (.mrc).")
@click.option("--ctf", is_flag=True, help="Apply CTF correction (CTF·image into data, CTF² into weights).")
@click.option("--sym", default="C1", show_default=True, help="Point group symmetry (RELION symbols).")
@click.option("--maxres", default=None, type=float, help="Highest resolution in Å to use [default: Nyquist].")
@click.option("--half_maps", is_flag=True,
              help="Also write <o>_half1/2 maps from rlnRandomSubset and their FSC (<o>_fsc.star).")
@click.option("--angpix", default=None, type=float,
              help="Pixel size of the output map in Å [default: the particles'].")
@click.option("--pad", default=2.0, show_default=True, type=float, help="Padding factor.")
@click.option("--batch", default=256, show_default=True, type=int, help="Images read per batch.")
def reconstruct(star, out, ctf, sym, maxres, half_maps, angpix, pad, batch):
    """Reconstruct a map from particles at the poses in their STAR file (relion_reconstruct)."""
    from cryorefine.config import check_output_folder
    from cryorefine.jobs.reconstruct import ReconstructOptions
    from cryorefine.jobs.reconstruct import reconstruct as run_reconstruction

    check_output_folder("--o", Path(out).parent)
    options = ReconstructOptions(do_ctf=ctf, symmetry=sym, maxres_angstrom=maxres, half_maps=half_maps,
                                 pixel_size_angstrom=angpix, padding_factor=pad, batch_size=batch)
    result = run_reconstruction(star, out, options, log=lambda message: click.echo(message, err=True))
    if half_maps:
        click.echo(f"FSC between half maps: {result['fsc_star']}; resolution at FSC 0.143: "
                   f"{result['resolution_fsc0143_angstrom']:.2f} Å")
    click.echo(f"wrote {result['map']} ({result['n_particles']} particles, {result['box_px']} px, "
               f"{result['pixel_size_angstrom']:.4f} Å/px)")


# refine, classify and plan: their options, each declared once (JOB_OPTIONS) with the commands that honour it. A
# parameter is named after the RefineConfig field it sets, so that `job_config` builds the config from them all.

REFINE, CLASSIFY, PLAN = "refine", "classify", "plan"
RUNS = (REFINE, CLASSIFY)
ALL_JOBS = (REFINE, CLASSIFY, PLAN)
CLASS2D = "class2d"
#: the options of JOB_OPTIONS that class2d honours besides its own (declared with CLASS2D among their commands)
CLASS2D_HONOURS = ("--i", "--o", "--continue", "--overwrite", "--particle_diameter", "--ini_high", "--ctf",
                   "--flatten_solvent", "--zero_mask", "--ctf_intact_first_peak", "--pad", "--offset_range",
                   "--offset_step", "--oversampling", "--tau2_fudge", "--iter", "--adaptive_fraction", "--maxsig",
                   "--strict_highres_exp", "--coarse_size", "--norm", "--scale", "--random_seed", "--batch", "--j",
                   "--precision", "--preread_images", "--scratch_dir", "--gpu", "--cpu", "--free_gpu_memory",
                   "--pipeline_control", "--K", "--skip_align", "--fast_subsets", "--pool",
                   "--dont_combine_weights_via_disc", "--no_parallel_disc_io", "--skip_gridding", "--dont_check_norm")
INITIAL_MODEL = "initial_model"
#: the options of JOB_OPTIONS that initial_model honours besides its own (declared with INITIAL_MODEL among their
#: commands)
INITIAL_MODEL_HONOURS = ("--i", "--o", "--continue", "--overwrite", "--particle_diameter", "--ini_high", "--ctf",
                         "--sym", "--K", "--flatten_solvent", "--zero_mask", "--ctf_intact_first_peak", "--pad",
                         "--healpix_order", "--offset_range", "--offset_step", "--oversampling", "--tau2_fudge",
                         "--iter", "--adaptive_fraction", "--maxsig", "--strict_highres_exp", "--coarse_size",
                         "--norm", "--scale", "--random_seed", "--batch", "--j", "--precision", "--preread_images",
                         "--scratch_dir", "--gpu", "--cpu", "--free_gpu_memory", "--pipeline_control", "--pool",
                         "--dont_combine_weights_via_disc", "--no_parallel_disc_io", "--skip_gridding",
                         "--dont_check_norm")
#: initial_model's --iter and --tau2_fudge without them (RELION's GUI and updateTau2Fudge for the initial model)
INITIAL_MODEL_ITERATIONS = 200
INITIAL_MODEL_TAU2_FUDGE = 4.0

#: the sections of their help after "Options"
RELION_SECTION = "Accepted from RELION command lines (nothing in the run changes with them)"
PLAN_SECTION = "Options of refine that do not change the plan (accepted so that a refine line can be planned as it is)"
REFUSED_SECTION = "RELION options refused in one line that says what to do instead"

#: RELION options that cryorefine cannot honour: (names, the commands that refuse them, why and what to do
#: instead); a name that ends in "_" stands for every option that starts with it
REFUSED = (
    (("--blush", "--blush_skip_spectral_trailing"), ALL_JOBS + (CLASS2D,),
     "Blush regularisation needs RELION's trained denoising network, which cryorefine does not have; run this job "
     "with RELION, or without Blush (drop {name}; RELION's GUI: 'Use Blush regularisation?' No)"),
    (("--helix", "--helical_", "--ignore_helical_symmetry", "--skip_realspace_helical_sym"), ALL_JOBS + (CLASS2D,),
     "helical reconstruction is not available in cryorefine; run helical jobs with RELION, or, for particles that "
     "are not helical, drop the helical options (RELION's GUI: 'Do helical reconstruction?' No)"),
    (("--multibody_", "--reconstruct_subtracted_bodies"), ALL_JOBS + (CLASS2D,),
     "multi-body refinement is not available in cryorefine; run the MultiBody job with RELION"),
    (("--relax_sym",), ALL_JOBS + (CLASS2D,),
     "symmetry relaxation (local searches over the symmetry mates of a pseudo-symmetric particle) is not implemented "
     "in cryorefine; run the job with --sym set to the lower group (e.g. C1) and local searches (classify "
     "--sigma_ang), or run it with RELION"),
    (("--auto_refine", "--split_random_halves"), (CLASSIFY,),
     "a classification has no half sets and no auto-refinement; drop {name}, or use `cryorefine refine`"),
    (("--allow_coarser_sampling",), (CLASS2D,),
     "coarser sampling is not available in cryorefine's 2D classification yet; drop {name} (RELION's GUI: 'Allow "
     "coarser sampling?' No)"),
)

#: RELION's parseContinue reads these again from a --continue command line, and the run reads them afresh every
#: iteration: they may change on --continue (each option's parameter is its RefineConfig field)
CONTINUE_CHANGES = ("--tau2_fudge", "--particle_diameter", "--solvent_mask", "--solvent_mask2", "--solvent_correct_fsc",
                    "--flatten_solvent", "--maxsig", "--strict_highres_exp", "--norm", "--scale", "--pool",
                    "--preread_images", "--scratch_dir", "--j")
#: options of a --continue line that are taken as given (the engine, where the run goes, how far) or change nothing
CONTINUE_TAKES = ("--continue", "--o", "--iter", "--auto_iter_max", "--gpu", "--cpu", "--free_gpu_memory",
                  "--pipeline_control", "--trust_ref_size")


class SectionedOption(click.Option):
    """A click option that knows the section of the help that lists it (None: "Options")."""

    def __init__(self, *args, section: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.section = section


class JobCommand(click.Command):
    """refine, classify and plan: the help lists the options by section and names the RELION options refused; those
    (REFUSED) are refused in one line before the command line is parsed, wherever they stand in it."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        for arg in args:
            name = str(arg).partition("=")[0]
            reason = refusal(self.name, name) if name.startswith("--") else None
            if reason:
                raise click.UsageError(f"{name}: {reason}", ctx)
        return super().parse_args(ctx, args)

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections = {None: [], RELION_SECTION: [], PLAN_SECTION: []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record:
                sections[getattr(param, "section", None)].append(record)
        refused = [(", ".join(name + ("…" if name.endswith("_") else "") for name in names),
                    _sentence(reason.format(name=names[0]).split(";")[0]))
                   for names, commands, reason in REFUSED if self.name in commands]
        for title, records in (*sections.items(), (REFUSED_SECTION, refused)):
            if not records:
                continue
            with formatter.section(title or "Options"):
                if title == PLAN_SECTION:  # their names alone: what they do is in refine's help
                    formatter.write_text(", ".join(opts.split(" ")[0] for opts, _ in records))
                else:
                    formatter.write_dl(records)


def _sentence(text: str) -> str:
    return text[0].upper() + text[1:] + "."


def refusal(command: str, option: str) -> str | None:
    """Why `cryorefine COMMAND` refuses the RELION option `option` and what to do instead (REFUSED), or None."""
    for names, commands, reason in REFUSED:
        if command in commands and any(option == name or (name.endswith("_") and option.startswith(name))
                                       for name in names):
            return reason.format(name=option)
    return None


@dataclass(frozen=True)
class JobOption:
    """One option of refine, classify or plan: its click declaration (the option's name and the parameter's, which
    is the RefineConfig field it sets where it sets one), the commands that honour it, the help's section, and a
    command's own default or help where they differ (`per_command`); a help may be a function of the command.
    Without a default of its own, an option's default is its RefineConfig field's."""

    decls: tuple[str, str]
    commands: tuple[str, ...]
    settings: dict
    section: str | None = None
    per_command: dict = dataclasses.field(default_factory=dict)

    def decorator(self, command: str, section: str | None) -> Callable[[Callable], Callable]:
        """click's decorator of this option for `command`, listed in `section` of its help."""
        settings = dict(self.settings, **self.per_command.get(command, {}))
        section = settings.pop("section", section)
        if callable(settings.get("help")):
            settings["help"] = settings["help"](command)
        if "default" not in settings and not settings.get("is_flag") and self.decls[1] in CONFIG_DEFAULTS:
            settings["default"] = CONFIG_DEFAULTS[self.decls[1]]
        if settings.get("default") is not None and not settings.get("is_flag"):
            settings.setdefault("show_default", True)
        return click.option(*self.decls, cls=SectionedOption, section=section, **settings)


def _option(name: str, parameter: str, commands=RUNS, section=None, per_command=None, **settings) -> JobOption:
    return JobOption((name, parameter), tuple(commands), settings, section, per_command or {})


#: a RefineConfig field's default, the default of the option that sets it
CONFIG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RefineConfig) if f.default is not dataclasses.MISSING}
#: classify's --iter (RELION's GUI writes 25 for Class3D; relion_refine's own default is 50, as refine's here)
CLASSIFY_ITERATIONS = 25
#: class2d --grad's --iter without it (relion_refine's default for a gradient run, and RELION's GUI's VDAM line)
CLASS2D_GRAD_ITERATIONS = 200
_FILE = click.Path(dir_okay=False)
_FOLDER = click.Path(file_okay=False)

#: where a --continue run writes (io.run_files.continued_output_root), as --o's help says it
CONTINUE_ROOT_HELP = ("with --continue, none or the continued run's own gives RELION's <that root>_ct<N>, N the "
                      "iteration continued from")
JOB_OPTIONS = (
    _option("--i", "input_star", ALL_JOBS, type=_FILE, help="Particle STAR file."),
    _option("--o", "output_root",
            help=f"Output root, e.g. Refine3D/job001/run ({CONTINUE_ROOT_HELP}).",
            per_command={CLASSIFY: {"help": f"Output root, e.g. Class3D/job001/run ({CONTINUE_ROOT_HELP})."},
                         CLASS2D: {"help": f"Output root, e.g. Class2D/job001/run ({CONTINUE_ROOT_HELP})."},
                         INITIAL_MODEL: {"help": f"Output root, e.g. InitialModel/job001/run "
                                                 f"({CONTINUE_ROOT_HELP})."}}),
    _option("--ref", "reference_map", type=_FILE, help="Initial reference map (MRC).",
            per_command={CLASSIFY: {"help": "Initial reference: one map (MRC) for all classes, or a STAR file of K "
                                            "maps (rlnReferenceImage)."}}),
    _option("--continue", "continue_from", type=_FILE, help=lambda command: (
        "Go on from run_itNNN_optimiser.star of an earlier run: its options are kept, but for "
        + ", ".join(taken_by(command, CONTINUE_TAKES[1:])) + " and those that RELION's --continue reads again ("
        + ", ".join(taken_by(command, CONTINUE_CHANGES)) + ").")),
    _option("--overwrite", "overwrite", is_flag=True,
            help="Remove the files of an earlier run with this --o root before starting (without it, a new run on "
                 "such a root is refused: continue that run with --continue, or give a new --o)."),
    _option("--particle_diameter", "particle_diameter_angstrom", ALL_JOBS, type=float,
            help="Mask diameter in Å [default: the box less the 5 px soft edge]."),
    _option("--ini_high", "ini_high_angstrom", ALL_JOBS, type=float,
            help="Low-pass the initial reference to this resolution (Å) [default: none; the first iteration's "
                 "image size is that of 60 Å]."),
    _option("--sym", "symmetry", ALL_JOBS, help="Point group symmetry."),
    _option("--ctf", "do_ctf", is_flag=True, help="Do CTF correction."),
    _option("--firstiter_cc", "firstiter_cc", is_flag=True,
            help="Cross-correlation instead of likelihood in the first iteration."),
    _option("--flatten_solvent", "flatten_solvent", is_flag=True,
            help="Mask the references with a sphere of particle_diameter.",
            per_command={CLASS2D: {"help": "Set the class averages outside the circle of particle_diameter to zero "
                                           "(soft edge)."}}),
    _option("--zero_mask", "zero_mask", is_flag=True, help="Fill the solvent of the images with zeros, not noise."),
    _option("--solvent_mask", "solvent_mask", type=_FILE,
            help="With --flatten_solvent: multiply the references by this mask (values 0…1, the particles' box) "
                 "instead of the sphere.",
            per_command={REFINE: {"help": "With --flatten_solvent: multiply the references by this mask (values 0…1, "
                                          "the particles' box) instead of the sphere; the mask of "
                                          "--solvent_correct_fsc."}}),
    _option("--solvent_mask2", "solvent_mask2", type=_FILE,
            help="With --flatten_solvent: set the region of this mask (1 = in it) to its own average density."),
    _option("--solvent_correct_fsc", "solvent_correct_fsc", (REFINE,), is_flag=True,
            help="With --solvent_mask: the half maps' FSC (for τ² and the resolution) between masked maps, corrected "
                 "for the mask by phase randomisation."),
    _option("--ctf_intact_first_peak", "ctf_intact_first_peak", is_flag=True,
            help="With --ctf: the CTF is 1 up to its first peak."),
    _option("--auto_ignore_angles", "auto_ignore_angles", (REFINE,), is_flag=True,
            help="Auto-sampling: changes of the angles do not hold the next sampling step back."),
    _option("--auto_resol_angles", "auto_resol_angles", (REFINE,), is_flag=True,
            help="Auto-sampling: a finer angular step as soon as the resolution asks for it."),
    _option("--pad", "padding_factor", ALL_JOBS, type=float, help="Padding factor of the Fourier volumes."),
    _option("--healpix_order", "healpix_order", ALL_JOBS, type=int, help="Initial HEALPix order.",
            per_command={CLASSIFY: {"help": "HEALPix order of the angular sampling."}}),
    _option("--auto_local_healpix_order", "auto_local_healpix_order", (REFINE, PLAN), type=int,
            help="Local searches from this HEALPix order on.",
            per_command={PLAN: {"help": "Local searches from this HEALPix order on (a refine plan)."}}),
    _option("--offset_range", "offset_range_px", ALL_JOBS, type=float, help="Translation search range (px)."),
    _option("--offset_step", "offset_step_px", ALL_JOBS, type=float, help="Translation search step (px)."),
    _option("--oversampling", "oversampling", ALL_JOBS, type=int, help="Adaptive oversampling order."),
    _option("--tau2_fudge", "tau2_fudge", type=float, help="Regularisation parameter T.",
            per_command={INITIAL_MODEL: {"default": INITIAL_MODEL_TAU2_FUDGE,
                                         "help": "Regularisation parameter T (RELION's schedule: from 1)."}}),
    _option("--iter", "max_iterations", type=int, help="At most this many iterations.",
            per_command={CLASSIFY: {"default": CLASSIFY_ITERATIONS, "help": "The number of iterations."},
                         CLASS2D: {"default": CLASSIFY_ITERATIONS, "help": "The number of iterations."},
                         INITIAL_MODEL: {"default": INITIAL_MODEL_ITERATIONS,
                                         "help": "The number of iterations (gradient steps)."}}),
    _option("--auto_iter_max", "auto_iter_max", (REFINE,), type=int,
            help="RELION's last auto-refine iteration: the same as --iter here (give one of the two, or both the "
                 "same) [default: that of --iter]."),
    _option("--adaptive_fraction", "adaptive_fraction", type=float,
            help="Fraction of the probability mass kept by the coarse pass."),
    _option("--maxsig", "max_significants", type=int, help="At most this many significant samples (-1: no limit)."),
    _option("--strict_highres_exp", "strict_highres_exp_angstrom", ALL_JOBS, type=float,
            help="The E-step compares images up to this resolution (Å) in both passes, as RELION's; the sums "
                 "(reconstruction, noise) keep the current size (-1: no limit)."),
    _option("--coarse_size", "max_coarse_size_px", ALL_JOBS, type=int,
            help="At most this image size (px) in the coarse pass of the adaptive sampling, as RELION's (-1: "
                 "RELION's own rule alone, the size the coarse angular step resolves)."),
    _option("--norm", "do_norm", is_flag=True, help="Refine per-particle norm corrections."),
    _option("--scale", "do_scale", is_flag=True, help="Refine per-group intensity scales."),
    _option("--low_resol_join_halves", "low_resol_join_halves_angstrom", (REFINE,), type=float,
            help="Join the half sets below this resolution (Å)."),
    _option("--random_seed", "random_seed", type=int,
            help="Random seed (-1: from the clock, as RELION; the seed taken is saved with the run)."),
    _option("--batch", "batch_size", ALL_JOBS, type=int,
            help="Particles per E-step batch [default: 128 on the CPU and on the GPU 1024 images of 360 px or as "
                 "many as hold as many pixels (32 to 1024)]."),
    _option("--j", "threads", type=int,
            help="Threads of the CPU engine, over particles (numpy's BLAS one thread each) [default: the cores "
                 "present, shared among the MPI ranks on a node]."),
    _option("--precision", "precision", type=click.Choice(["double", "single"]), default="single",
            help="Arithmetic of the CPU engine: single as the GPU's, double for the reference engine."),
    _option("--scratch_dir", "scratch_dir", type=_FOLDER,
            help="Copy the particle stacks to this (local, fast) disk for the run; removed at the end (under MPI "
                 "once per node)."),
    _option("--preread_images", "preread_images", is_flag=True,
            help="Read the images once into the host's memory (the system's cache of their stacks, which the "
                 "host's processes share; under MPI each worker asks for its own share of the particles) while the "
                 "first iteration reads them; where they would take more than 80% of the available memory, they "
                 "are read batch by batch with a warning."),
    _option("--gpu", "gpu", ALL_JOBS, is_flag=False, flag_value="", default=None,
            help='Use the GPU engine on these devices ("0", "0:1"; alone: device 0, or under mpirun one GPU per '
                 'worker of a node in turn) [default: when CuPy sees a GPU].',
            per_command={PLAN: {"help": "Plan for this GPU (the first device listed): its free memory and speed "
                                        "[default: GPU 0 where CuPy sees one]."}}),
    _option("--cpu", "force_cpu", is_flag=True, help="Use the numpy engine even when a GPU is present."),
    _option("--free_gpu_memory", "free_gpu_memory_mb", ALL_JOBS, type=float,
            help="GPU memory (MB) left outside the engine's arena."),
    _option("--pipeline_control", "pipeline_control", type=_FOLDER,
            help="RELION's job folder: RELION_JOB_EXIT_SUCCESS/FAILURE/ABORTED written there at the end; "
                 "RELION_JOB_ABORT_NOW there stops the run before its next iteration."),
    _option("--K", "n_classes", (CLASSIFY, PLAN), type=int, help="Number of classes.",
            per_command={PLAN: {"default": None, "help": "Plan a classify run of this many classes [default: a "
                                                         "refine run]."}}),
    _option("--skip_align", "skip_align", (CLASSIFY,), is_flag=True,
            help="Keep the poses and origins of the STAR file; only the class of each particle is searched."),
    _option("--sigma_ang", "sigma_ang_deg", (CLASSIFY,), type=float,
            help="Local searches: σ (degrees) of rot, tilt and psi around each particle's pose (±3σ) [default: "
                 "global searches]."),
    _option("--sigma_psi", "sigma_psi_deg", (CLASSIFY,), type=float,
            help="Local searches of psi alone (σ in degrees), when --sigma_ang is not given."),
    _option("--sigma_rot", "sigma_rot_deg", (CLASSIFY,), type=float,
            help="With --sigma_tilt, when --sigma_ang is not given: local searches of the directions with σ (degrees) "
                 "the larger of the two, as RELION (psi by --sigma_psi, else globally)."),
    _option("--sigma_tilt", "sigma_tilt_deg", (CLASSIFY,), type=float,
            help="With --sigma_rot: see there."),
    _option("--relion_oversampling", "relion_oversampling", (CLASSIFY,), is_flag=True,
            help="Keep --oversampling throughout, as RELION does; by default the fine pass samples one order finer "
                 "once the average pmax reaches 0.5 while the resolution can still grow (RELION's fine angular step "
                 "too coarse for the box), or else once the share of particles changing class stops falling where "
                 "that step is too coarse for what the E-step compares (the fine pass then costs up to 32x)."),
    _option("--fast_subsets", "fast_subsets", (CLASSIFY,), is_flag=True,
            help="RELION's fast subsets: iterations 1-5 take 1500 random particles per class, 6-10 three times as "
                 "many, 11-15 that or 30% of the data, whichever is more, the later ones all; a subset no smaller "
                 "than the data set is the whole set (RELION asks for --iter 20 or more with it)."),
    _option("--psi_step", "psi_step_deg", (CLASS2D,), type=float,
            help="In-plane angular step (degrees) of the coarse pass; the fine pass samples 2^oversampling times "
                 "finer (RELION's GUI writes twice its 'In-plane angular sampling') [default: 10].",),
    _option("--center_classes", "center_classes", (CLASS2D,), is_flag=True,
            help="Move each class average to its centre of mass (of its positive values, at most --offset_range "
                 "pixels) after each iteration."),
    _option("--allow_coarser_sampling", "allow_coarser_sampling", (CLASSIFY,), is_flag=True,
            help="With --K 2 or more, as RELION: each iteration the coarsest HEALPix order from --healpix_order whose "
                 "step stays below 0.8x the estimated angular accuracy, and an offset step of 0.8x the translational "
                 "accuracy (between --offset_step and 0.95x the range); with one class it changes nothing, as in "
                 "RELION."),
    _option("--pool", "pooled_particles", type=int, section=RELION_SECTION,
            help="RELION's images a CPU thread takes at once: written to the optimiser file as RELION's; the E-step's "
                 "batches do not follow it (--batch sets them)."),
    _option("--auto_refine", "auto_refine_flag", (REFINE,), is_flag=True, section=RELION_SECTION,
            help="refine always auto-refines."),
    _option("--split_random_halves", "split_random_halves", (REFINE,), is_flag=True, section=RELION_SECTION,
            help="refine always uses gold-standard halves."),
    _option("--dont_combine_weights_via_disc", "dont_combine_weights_via_disc", is_flag=True, section=RELION_SECTION,
            help="Sums are never combined through files."),
    _option("--no_parallel_disc_io", "no_parallel_disc_io", is_flag=True, section=RELION_SECTION,
            help="How the stacks are read does not change with it."),
    _option("--ctf_corrected_ref", "ctf_corrected_ref", is_flag=True, section=RELION_SECTION,
            help="RELION 3.1's: the reference is always taken as CTF-corrected (a map, not an average of "
                 "CTF-affected images), as RELION 4 and later do."),
    _option("--skip_gridding", "skip_gridding", is_flag=True, section=RELION_SECTION,
            help="The reconstruction never runs gridding iterations here."),
    _option("--dont_check_norm", "dont_check_norm", is_flag=True, section=RELION_SECTION,
            help="Images are not checked for normalisation here."),
    _option("--grad", "grad", (INITIAL_MODEL, CLASS2D), is_flag=True, section=RELION_SECTION,
            help="Gradient refinement (VDAM): what initial_model always does.",
            per_command={CLASS2D: {"section": None, "help": "VDAM (RELION 4/5's default for 2D classification) instead "
                                   "of EM: each iteration a gradient step on a random mini-batch (RELION's sizes, from "
                                   "0.5 % to 5 % of the particles), 200 iterations unless --iter says otherwise."}}),
    _option("--class_inactivity_threshold", "class_inactivity_threshold", (CLASS2D,), type=float,
            help="With --grad: between the initial and the final iterations, the least active class, when its share "
                 "is below this fraction of an even share, is replaced by a copy of the class of the largest "
                 "gradient (RELION's GUI: 0.1; 0: none)."),
    _option("--grad_write_iter", "grad_write_iter", (CLASS2D, INITIAL_MODEL), type=int,
            help="A gradient run (--grad) writes its iteration's files every this many iterations, at the last, and "
                 "where the mini-batch holds every particle; --continue starts from those."),
    _option("--denovo_3dref", "denovo_3dref", (INITIAL_MODEL,), is_flag=True, section=RELION_SECTION,
            help="A 3D model from the particles alone: what initial_model always does."),
    _option("--auto_sampling", "auto_sampling", (INITIAL_MODEL,), is_flag=True,
            help="RELION's sampling updates of a gradient run (its GUI gives it): every 10 iterations, where the "
                 "resolution did not improve and the estimated accuracy asks for it, one HEALPix order finer (at "
                 "most 3: a gradient run makes no local searches) and offsets of the accuracy's step."),
    _option("--trust_ref_size", "trust_ref_size", is_flag=True,
            help="A reference of another box or pixel size (its header's) is re-scaled to the particles' pixel size "
                 "(its transform windowed to the nearest even box) and re-boxed to their box, as RELION does (RELION "
                 "5's GUI: 'Resize reference if needed?', Yes by default); without it such a reference is refused."),
)

#: refine's options that plan does not take (planning a continued run is not implemented)
NOT_PLANNED = ("--continue",)


def taken_by(command: str, names) -> list[str]:
    """Those of the option `names` that `command` honours (JOB_OPTIONS)."""
    honoured = {spec.decls[0] for spec in JOB_OPTIONS if honours(command, spec)}
    return [name for name in names if name in honoured]


def honours(command: str, spec: JobOption) -> bool:
    """Whether `command` honours the option `spec` (its commands, or for class2d CLASS2D_HONOURS)."""
    return command in spec.commands or (command == CLASS2D and spec.decls[0] in CLASS2D_HONOURS) or (
        command == INITIAL_MODEL and spec.decls[0] in INITIAL_MODEL_HONOURS)


def job_options(command: str) -> Callable[[Callable], Callable]:
    """The decorator that gives `command` (refine, classify or plan) its options from JOB_OPTIONS: those it honours,
    and for plan also refine's others (PLAN_SECTION, except NOT_PLANNED), in JOB_OPTIONS's order."""
    def decorate(function):
        for spec in reversed(JOB_OPTIONS):
            if honours(command, spec):
                function = spec.decorator(command, spec.section)(function)
            elif command == PLAN and REFINE in spec.commands and spec.decls[0] not in NOT_PLANNED:
                function = spec.decorator(command, PLAN_SECTION)(function)
        return function
    return decorate


@cli.command(cls=JobCommand)
@job_options(REFINE)
def refine(**params):
    """Gold-standard 3D auto-refinement (relion_refine --auto_refine --split_random_halves)."""
    _run(REFINE, params)


@cli.command(cls=JobCommand)
@job_options(CLASSIFY)
def classify(**params):
    """3D classification into K classes (relion_refine --K, without --auto_refine)."""
    _run(CLASSIFY, params)


@cli.command(cls=JobCommand)
@job_options(CLASS2D)
def class2d(**params):
    """2D classification into K classes (relion_refine without --ref: RELION's Class2D, the EM algorithm or with
    --grad VDAM; on the CPU engine, or with --gpu on the GPU engine, a GPU per process, under mpirun too)."""
    _run(CLASS2D, params)


@cli.command(INITIAL_MODEL, cls=JobCommand)
@job_options(INITIAL_MODEL)
def initial_model(**params):
    """A 3D initial model from the particles alone (relion_refine --grad --denovo_3dref: RELION's InitialModel, VDAM;
    --K classes, on the CPU engine or with --gpu the GPU engine's E-step; with --sym, run in C1 and aligned to the
    group's axes at the end)."""
    _run(INITIAL_MODEL, params)


def _run(command: str, params: dict) -> None:
    """Run refine, classify or class2d with its parsed options (`params`), from scratch or, with --continue, on."""
    import logging

    if command == REFINE:
        from cryorefine.jobs import refine as job

        min_mpi_ranks, report = job.RefineJob.min_mpi_ranks, _report_end
    elif command == CLASS2D:
        from cryorefine.jobs import class2d as job

        min_mpi_ranks, report = job.Class2DJob.min_mpi_ranks, _report_class_averages
    elif command == INITIAL_MODEL:
        from cryorefine.jobs import initial_model as job

        min_mpi_ranks, report = job.InitialModelJob.min_mpi_ranks, _report_classes
    else:
        from cryorefine.jobs import classify as job

        min_mpi_ranks, report = job.ClassifyJob.min_mpi_ranks, _report_classes
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    given = options_given(click.get_current_context())
    with _pipeline(params["pipeline_control"]) as control:
        _host_threads(params["threads"], params["dont_check_norm"])
        _unchanged_options(params["skip_gridding"], params["ctf_intact_first_peak"] and not params["do_ctf"])
        if params["continue_from"]:
            config = _continued_config(params, given)
        else:
            for name, key in (("--i", "input_star"), ("--o", "output_root"), ("--ref", "reference_map")):
                if key in params and not params[key]:
                    raise click.UsageError(f"Missing option '{name}' (needed unless --continue is given).")
            config = job_config(command, params, given)
        if command == INITIAL_MODEL:  # before any device is set up
            job.check_config(config)
        reports = _run_job(job, min_mpi_ranks, config, params["continue_from"], control, params["overwrite"])
        report(reports, config.output_root, control)


def options_given(ctx: click.Context) -> set[str]:
    """The options (by name, such as --iter) given on the command line of `ctx`'s command."""
    return {p.opts[0] for p in ctx.command.params
            if ctx.get_parameter_source(p.name) == click.core.ParameterSource.COMMANDLINE}


def _continued_config(params: dict, given: set[str]) -> RefineConfig:
    """The options of the run that --continue (a run_itNNN_optimiser.star) belongs to, with those that --continue
    may change: --o, --iter, the engine (CONTINUE_TAKES), and those of RELION's parseContinue that this run reads
    afresh each iteration (CONTINUE_CHANGES); other options given are named in a warning and ignored. The output
    root is RELION's (`io.run_files.continued_output_root`): without --o, or with the run's own, <root>_ct<N>."""
    from cryorefine.io import resume, run_files

    config = RefineConfig.from_json(json.dumps(resume.load_config_values(params["continue_from"])))
    parameters = {p.opts[0]: p for p in click.get_current_context().command.params}
    ignored = sorted(o for o in given if o not in CONTINUE_TAKES + CONTINUE_CHANGES
                     and getattr(parameters[o], "section", None) != RELION_SECTION)
    if ignored:
        _command_line_log().warning(
            "--continue keeps the run's sampling and the other options it was started with; ignored here: %s",
            " ".join(ignored))
    changed = [o for o in parameters if o in given and o in CONTINUE_CHANGES]  # in the help's order
    changes = {parameters[o].name: params[parameters[o].name] for o in changed}
    if changes:
        _command_line_log().info("--continue: %s changed from the run's own", ", ".join(changed))
    if given & {"--gpu", "--cpu"}:
        engine = engine_options(params["gpu"], params["force_cpu"], params["free_gpu_memory_mb"])
    else:  # the run's own engine, where it can run
        from cryorefine.estep.backend import cupy_available

        engine = {"engine": config.engine if config.engine != "cuda" or cupy_available() else "numpy",
                  "free_gpu_memory_mb": params["free_gpu_memory_mb"]}
    iterations = _max_iterations(params, given) if given & {"--iter", "--auto_iter_max"} else config.max_iterations
    output_root = run_files.continued_output_root(params["continue_from"], params["output_root"])
    if output_root != params["output_root"]:
        _command_line_log().info("--continue: the files go under %s (relion_refine's root for a run continued "
                                 "without --o or with its own)", output_root)
    return dataclasses.replace(config, output_root=output_root, max_iterations=iterations, **engine,
                               **changes).check()


@cli.command("relion_refine", context_settings={"ignore_unknown_options": True}, add_help_option=False,
             options_metavar="")
@click.argument("arguments", nargs=-1, type=click.UNPROCESSED, metavar="RELION_REFINE_ARGUMENTS...")
@click.pass_context
def relion_refine(ctx, arguments):
    """Run a relion_refine or relion_refine_mpi command line as is: its arguments, the job RELION would run.

    With --auto_refine, `cryorefine refine`; otherwise, with --ref, `cryorefine classify` (3D classification);
    without --ref, `cryorefine class2d` (2D classification); with --continue, the job of the run it continues (its
    optimiser.star's rlnDoAutoRefine, and the run's saved state). Every option then means what it means to that
    command (see `cryorefine refine --help`, `cryorefine classify --help`, `cryorefine class2d --help`). Under
    mpirun, as those commands. Lines with --denovo_3dref (the initial model) run `cryorefine initial_model`.
    `cryorefine install-relion-shims DIR` writes relion_refine and relion_refine_mpi that run this.
    """
    arguments = [str(a) for a in arguments]
    command = relion_refine_command(arguments)
    if command is None:
        click.echo(ctx.get_help())
        return
    target = cli.commands[command]
    # a context of the group's own: errors and --help name `cryorefine refine` / `cryorefine classify`
    with target.make_context(command, arguments, parent=ctx.parent) as job_ctx:
        target.invoke(job_ctx)


@cli.command("install-relion-shims")
@click.argument("folder", type=click.Path(file_okay=False))
def install_relion_shims(folder):
    """Write relion_refine and relion_refine_mpi into FOLDER: scripts that run `cryorefine relion_refine` (with this
    cryorefine's Python). With FOLDER first on the PATH of RELION's GUI (or of a script), its Refine3D, Class3D,
    Class2D and InitialModel jobs run cryorefine. Files of those names that these scripts are not (RELION's own) are
    never overwritten."""
    import shlex

    from cryorefine.jobs.relion_shims import install

    paths = install(folder)
    for path in paths:
        click.echo(f"wrote {path}")
    folder = Path(folder).resolve()
    click.echo(f"put {folder} first on the PATH of RELION's GUI (start it after `export PATH={shlex.quote(str(folder))}"
               f":$PATH`) to run its Refine3D, Class3D, Class2D and InitialModel jobs with cryorefine")


def relion_refine_command(arguments):
    """The cryorefine command that runs relion_refine's `arguments` (refine or classify), or None for a line that
    asks for help alone; a line of a job not available here is refused (InputError)."""
    names = {a.partition("=")[0] for a in arguments if a.startswith("-")}
    if "--continue" in names:
        return _continued_command(arguments, "--auto_refine" in names)
    if "--auto_refine" in names:
        return "refine"
    if "--ref" in names:
        return "classify"
    if not arguments or names & {"--help", "-h"}:
        return None
    if "--denovo_3dref" in names:
        return INITIAL_MODEL  # RELION's InitialModel
    return CLASS2D  # no --ref: RELION's 2D classification


def _continued_command(arguments, auto_refine):
    """refine or classify, as the run that --continue names was (its optimiser.star's rlnDoAutoRefine, as RELION
    reads it); where that file cannot be read, as the line says (the command then says what is wrong with it)."""
    from cryorefine.io.star import read_star

    path = next((arguments[i + 1] for i, a in enumerate(arguments[:-1]) if a == "--continue"),
                next((a.partition("=")[2] for a in arguments if a.startswith("--continue=")), None))
    try:
        general = read_star(path)["optimiser_general"]
        auto_refine = bool(int(general["rlnDoAutoRefine"]))
    except (InputError, KeyError, TypeError, ValueError):
        pass
    saved = None if auto_refine else _saved_job(path)
    if saved in (CLASS2D, INITIAL_MODEL):
        return saved
    return "refine" if auto_refine else "classify"


def _saved_job(optimiser_star) -> str | None:
    """The kind of job (refine, classify, class2d, initial_model) whose --continue state sits beside `optimiser_star`,
    or None."""
    from cryorefine.io import resume

    try:
        return resume.load(optimiser_star)[0].get("job")
    except (InputError, OSError, KeyError, ValueError, TypeError):
        return None


def _run_job(job, min_mpi_ranks, config, resume_from, control, overwrite=False):
    """`job.run` (jobs.refine or jobs.classify) with the runner this process was started for (`overwrite`:
    --overwrite, an earlier run's files under the output root removed rather than refused)."""
    from cryorefine import runners
    from cryorefine.io.pipeline import FAILURE

    on_abort = (lambda: control.finished(FAILURE)) if control else None
    runner = runners.for_config(config, min_mpi_ranks, on_abort=on_abort)
    with _sigterm_stops_the_run():
        return job.run(config, runner, argv=sys.argv[1:], progress=_progress_bar(), resume_from=resume_from,
                       stop_requested=control.abort_requested if control else None, overwrite=overwrite)


@contextlib.contextmanager
def _sigterm_stops_the_run():
    """SIGTERM raises errors.Terminated in the main thread, as Ctrl-C raises KeyboardInterrupt, so that a run
    stopped either way says which iteration is complete and how to resume it (`em.loop.interruption_reported`).
    MPI workers keep the default (the master reports); the previous handler is put back at the end."""
    import signal
    import threading

    from cryorefine.errors import Terminated
    from cryorefine.runners.mpi import rank_from_environment

    if rank_from_environment() > 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


#: the exit status of a job stopped by RELION_JOB_ABORT_NOW, RELION's own (pipeline_control.h)
ABORTED_EXIT_CODE = 2


@contextlib.contextmanager
def _pipeline(folder):
    """--pipeline_control: RELION_JOB_EXIT_SUCCESS, _FAILURE or _ABORTED in `folder` as the command ends
    (written by the MPI master; a failing MPI rank writes _FAILURE itself before the job is aborted)."""
    if not folder:
        yield None
        return
    from cryorefine.config import check_output_folder
    from cryorefine.io.pipeline import ABORTED, FAILURE, SUCCESS, PipelineControl
    from cryorefine.runners.mpi import rank_from_environment

    check_output_folder("--pipeline_control", folder)  # before the job: its exit file must be writable there
    control = PipelineControl(folder)
    master = rank_from_environment() == 0
    try:
        yield control
    except BaseException as exc:
        if master and not (isinstance(exc, SystemExit) and exc.code in (0, None)):
            control.finished(FAILURE)
        raise
    if master and control.abort_requested():  # RELION's GUI asked the job to stop: it ends as RELION's does
        control.finished(ABORTED)
        sys.exit(ABORTED_EXIT_CODE)
    if master:
        control.finished(SUCCESS)


def _command_line_log():
    """The logger of what the command line itself makes of its options: under mpirun said once, by the master."""
    import logging

    from cryorefine.runners.mpi import rank_from_environment

    log = logging.getLogger("cryorefine.command_line")
    if rank_from_environment() > 0:
        log.setLevel(logging.ERROR)
    return log


def _one_blas_thread():
    """numpy's BLAS runs one thread (unless the environment says otherwise): the CPU engine runs its
    own threads (--j) over particles, and a multi-threaded BLAS under them makes their small matrix
    products ten times slower. Set before numpy loads, which is why the entry point does it."""
    import os

    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, "1")


def _host_threads(threads, dont_check_norm):
    """--j: the CPU engine's threads (config.threads, checked here first); --dont_check_norm: noted."""
    log = _command_line_log()
    if threads is not None and threads < 1:
        raise InputError(f"--j {threads}: out of range; give 1 thread or more")
    if dont_check_norm:
        log.info("--dont_check_norm: accepted; changes nothing here (images are not checked for normalisation)")


def _unchanged_options(skip_gridding, ctf_intact_without_ctf):
    """One INFO line for each option that changes nothing here."""
    log = _command_line_log()
    if skip_gridding:
        log.info("--skip_gridding: accepted; changes nothing here (the reconstruction never runs gridding iterations)")
    if ctf_intact_without_ctf:
        log.info("--ctf_intact_first_peak: changes nothing without --ctf")


def _report_class_averages(reports, out, control=None):
    if reports is None or _report_abort(reports, out, control):
        return
    last = reports[-1] if reports else None
    if last:
        click.echo(f"{_iterations_run(reports)}; resolution {last.resolution_angstrom:.2f} Å; class averages: "
                   f"{out}_it{last.iteration:03d}_classes.mrcs")


def _report_classes(reports, out, control=None):
    if reports is None:  # an MPI worker: the master reports
        return
    if _report_abort(reports, out, control):
        return
    last = reports[-1] if reports else None
    if last:
        click.echo(f"{_iterations_run(reports)}; resolution {last.resolution_angstrom:.2f} Å; maps: "
                   f"{out}_it{last.iteration:03d}_class*.mrc")


@cli.command(cls=JobCommand)
@job_options(PLAN)
@click.option("--gpu_memory", type=float, default=None,
              help="GPU memory (GB) to plan for [default: the free memory of the GPU, else 80].")
@click.option("--gpu_tflops", type=float, default=None,
              help="FP32 peak (TFLOP/s) to plan for [default: the GPU's, else an H100 SXM's 66.9].")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option("--resolution", "late_resolution", type=float, default=None,
              help="Resolution (Å) of the late iterations to plan for [default: three quarters of Nyquist, the most "
                   "a refinement reaches before its final iteration; a classification usually stops well short of it, "
                   "so give the resolution you expect].")
def plan(gpu_memory, gpu_tflops, as_json, late_resolution, **params):
    """Predict GPU memory per scope, batch sizes and E-step time of a refine run (or, with --K, a classify run),
    without running it."""
    from dataclasses import asdict

    from cryorefine.jobs.plan import GpuSpec, format_plan, plan_run

    if not params["input_star"]:
        raise click.UsageError("Missing option '--i'.")
    for option, value in (("--gpu_memory", gpu_memory), ("--gpu_tflops", gpu_tflops),
                          ("--resolution", late_resolution)):
        if value is not None and not value > 0:
            raise InputError(f"{option} {value:g}: out of range; give more than 0")
    device = (parse_gpu_ids(params["gpu"] or "") or (0,))[0]
    config = job_config(PLAN, params, options_given(click.get_current_context()))
    result = plan_run(config, GpuSpec.detect(device, gpu_memory, gpu_tflops), late_resolution)
    if as_json:
        out = dict(result, gpu=asdict(result["gpu"]), moments=[dict(asdict(m), peak_bytes=m.peak_bytes)
                                                             for m in result["moments"]])
        click.echo(json.dumps(out, indent=2))
    else:
        click.echo(format_plan(result))


def config_from_arguments(command: str, arguments) -> RefineConfig:
    """The RefineConfig that `cryorefine COMMAND ARGUMENTS` runs, for COMMAND refine or classify (scripts and
    benchmarks use it to run a job in their own process with the command line's exact meaning); plan's, for plan."""
    with cli.commands[command].make_context(command, [str(a) for a in arguments]) as ctx:
        return job_config(command, dict(ctx.params), options_given(ctx))


def job_config(command: str, params: dict, given: set[str] = frozenset()) -> RefineConfig:
    """The RefineConfig of `command` (refine, classify or plan) from its parsed options `params` (`given`: those
    given on the command line): each parameter named after a RefineConfig field sets it; then what no field holds
    as it is given (the engine, the precision, a seed from the clock, --auto_iter_max) and the kind of job."""
    fields = {f.name for f in dataclasses.fields(RefineConfig)}
    values = {name: value for name, value in params.items()
              if name in fields and (value is not None or name not in CONFIG_DEFAULTS)}
    if values.get("random_seed") == -1:
        values["random_seed"] = int(time.time()) % 2 ** 31
    if "precision" in params:
        values["dtype"] = "float64" if params["precision"] == "double" else "float32"
    if "max_iterations" in params:
        values["max_iterations"] = _max_iterations(params, given)
        if command == CLASS2D and params.get("grad") and "--iter" not in given:
            values["max_iterations"] = CLASS2D_GRAD_ITERATIONS
    planned = command == PLAN
    values.setdefault("reference_map", "")  # class2d has none
    # class2d (as relion_refine) and initial_model run on the CPU engine unless --gpu asks for the GPU engine
    cpu_only = command in (CLASS2D, INITIAL_MODEL) and params["gpu"] is None
    values.update(auto_refine=command == REFINE or (planned and params.get("n_classes") is None),
                  **engine_options(None if planned else params["gpu"], planned or params["force_cpu"] or cpu_only,
                                   params["free_gpu_memory_mb"]))
    return RefineConfig(**values).check()


def _max_iterations(params: dict, given: set[str]) -> int:
    """--iter, or refine's --auto_iter_max (RELION's last iteration of an auto-refine: here the same); both given,
    the same number."""
    iterations, last = params["max_iterations"], params.get("auto_iter_max")
    if last is None:
        return iterations
    if last < 1:
        raise InputError(f"--auto_iter_max {last}: out of range; give 1 or more")
    if "--iter" in given and iterations != last:
        raise InputError(f"--iter {iterations} and --auto_iter_max {last}: both set the last iteration of an "
                         f"auto-refine here; give one of the two")
    return last


def parse_gpu_ids(text):
    """RELION's --gpu syntax: "0", "0:1", "0,1:2,3": one group per MPI worker, split by ':', and in a group the
    devices of that worker's threads, split by ','. A worker here drives one GPU: the first of its group (the
    others are named in one INFO line). "" (--gpu alone, or not given) is RELION's automatic assignment: () here,
    device 0 for one process, and under mpirun each worker its own (`runners.mpi.device_of_worker`)."""
    ids, unused = [], []
    for group in str(text).split(":"):
        devices = [d.strip() for d in group.split(",") if d.strip()]
        if not devices:
            continue
        if not all(d.isdigit() for d in devices):
            raise click.UsageError(f"--gpu {text!r}: expected device numbers such as 0, 0:1 or 0,1:2,3")
        ids.append(int(devices[0]))
        unused += devices[1:]
    if unused:
        _command_line_log().info(
            "--gpu %s: each process drives one GPU here (the first of its group); not used: %s; run more MPI "
            "workers to use them", text, ", ".join(unused))
    return tuple(ids)


def engine_options(gpu, force_cpu, free_gpu_memory):
    """The engine fields of RefineConfig from --gpu/--cpu/--free_gpu_memory."""
    from cryorefine.estep.backend import cupy_available

    if gpu is not None and force_cpu:
        raise click.UsageError("--gpu and --cpu exclude each other; give one")
    if free_gpu_memory < 0:
        raise InputError(f"--free_gpu_memory {free_gpu_memory:g}: out of range; give 0 MB or more")
    if force_cpu or (gpu is None and not cupy_available()):  # the reserve is kept for `plan`, which plans a GPU run
        return {"engine": "numpy", "free_gpu_memory_mb": free_gpu_memory}
    if not cupy_available():
        raise InputError(f"--gpu {gpu!r}: no usable CUDA device (CuPy missing or no GPU); install "
                         f"cryorefine[cuda13] (or [cuda12]) on a GPU node, or run with --cpu")
    return {"engine": "cuda", "gpu_ids": parse_gpu_ids(gpu or ""), "free_gpu_memory_mb": free_gpu_memory}


def _report_abort(reports, out, control):
    """True, after one line, where RELION's GUI asked the job to stop (RELION_JOB_ABORT_NOW)."""
    if control is None or not control.abort_requested():
        return False
    from cryorefine.io.pipeline import ABORT_NOW

    last = f"; last outputs: {out}_it{reports[-1].iteration:03d}_*" if reports else ""
    click.echo(f"aborted: {ABORT_NOW} in {control.folder} after {len(reports)} iterations{last}")
    return True


def _report_end(reports, out, control=None):
    if reports is None:  # an MPI worker: the master reports
        return
    if _report_abort(reports, out, control):
        return
    if not reports:
        click.echo("nothing to do: the run had already reached --iter")
        return
    last = reports[-1]
    root = f"{out}_it{last.iteration:03d}"
    # a converged run names its final files (RELION's, written by the final iteration instead of run_itNNN_* files)
    click.echo(f"converged after {_iterations_run(reports)}; final resolution {last.resolution_angstrom:.2f} Å; "
               f"particles: {out}_data.star; model: {out}_model.star; half maps: {out}_half1_class001_unfil.mrc, "
               f"{out}_half2_class001_unfil.mrc; map: {out}_class001.mrc" if reports.finished else
               f"not converged after {_iterations_run(reports)} (--iter); resolution {last.resolution_angstrom:.2f} Å; "
               f"last maps: {root}_half1_class001.mrc, {root}_half2_class001.mrc; go on with --continue "
               f"{root}_optimiser.star and a larger --iter")


def _iterations_run(reports) -> str:
    """ "N iterations", with the iterations' numbers and where the run went on from after --continue."""
    count = f"{len(reports)} iteration{'' if len(reports) == 1 else 's'}"
    if reports.continued_from is None:
        return count
    first, last = reports[0].iteration, reports[-1].iteration
    numbers = f"iteration {last}" if first == last else f"iterations {first}–{last}"
    return f"{count} ({numbers}, continued from iteration {reports.continued_from})"


def _progress_bar(stream=None):
    """A callback(done, total) showing particles/s and ETA per iteration on a terminal (`stream`, stderr by default);
    silent otherwise. Each iteration's bar is cleared as its last particles are done, before the iteration's lines
    are logged (and before the process ends at once after the last: `end_process`)."""
    stream = sys.stderr if stream is None else stream
    if not stream.isatty():
        return None
    from tqdm import tqdm

    state = {"bar": None, "seen": 0}

    def update(done, total):
        if state["bar"] is None:
            state["bar"] = tqdm(total=total, unit="particle", leave=False, file=stream)
            state["seen"] = 0
        state["bar"].update(done)
        state["seen"] += done
        if state["seen"] >= total:
            state["bar"].close()
            state["bar"] = None

    return update


def console_main() -> None:
    """The `cryorefine` command (and `python -m cryorefine`): `main`, then the process ends as soon as it has
    (`end_process`). `main` itself returns, for callers in this interpreter."""
    try:
        main()
    except SystemExit as exc:
        end_process(exc.code)
    end_process(0)


def end_process(code: int | str | None) -> NoReturn:
    """Ends the process with `code` (SystemExit's meaning: None is 0, a message goes to stderr and is 1) once its
    work is done: the log and the standard streams flushed, MPI finalised where this process started it, then
    `os._exit`, without the interpreter's teardown (the collection of every object, CuPy's pools given back block
    by block, the modules unloaded), which nothing needs: every file was written and closed, and every thread and
    process the command started ended, before it returned. From a run's last line to the process's exit took
    0.7 s in one process and 1.5-1.8 s under mpirun with two GPUs before this (20,000 particles at 360 px, one 2 x H200
    host); after it 0.35-0.5 and 1.1-1.4 s at 105,247 particles (the driver's and mpirun's ends remain), and on the
    CPU machine 0.6 s before and 0.05 s after."""
    import logging
    import os

    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe (`| head`) has nothing left to take
            stream.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    os._exit(code)


def main(argv=None):
    """Runs the group with `argv` (the command line's arguments by default) and turns errors into one line and an
    exit code (SystemExit)."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    _one_blas_thread()
    try:
        cli.main(args=args, prog_name="cryorefine", standalone_mode=False)
    except click.exceptions.NoSuchOption as exc:
        takers = _commands_taking(exc.option_name)
        named = " and ".join(f"`cryorefine {name}`" for name in takers)
        guess = _near_miss(exc)
        message = f"No such option: {exc.option_name}" + (f". Did you mean {guess}?" if guess else "")
        # a typo of an option the command has is not called unimplemented: only an option it has nothing near is
        where = (f"{named} take{'s' if len(takers) == 1 else ''} it, `cryorefine {_command(exc)}` does not; "
                 if takers else "" if guess else "this option is not implemented; ")
        _fail(f"{message} ({where}see `cryorefine {_command(exc)} --help`)", 2, debug, args)
    except click.exceptions.UsageError as exc:
        _fail(f"{exc.format_message()} (see `cryorefine {_command(exc)} --help`)", 2, debug, args)
    except click.exceptions.Abort:
        _fail("aborted", 130, False, args)
    except RunInterrupted as exc:  # Ctrl-C or SIGTERM in a run: the last complete iteration and how to resume
        _fail(str(exc), exc.exit_code, False, args)
    except InputError as exc:
        _fail(str(exc), 2, debug, args)
    except MemoryError as exc:  # CuPy's OutOfMemoryError is one: the GPU's memory outside the arena
        _fail(gpu_memory_message(exc) or f"out of memory: {exc}; use a smaller batch or box", 3, debug, args)
    except Exception as exc:  # the last line of defence: one line, and the traceback with --debug
        resource = resource_message(exc)
        if resource:
            _fail(resource, 3, debug, args)
        _fail(f"internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)", 1, debug, args)
    return 0


def _near_miss(exc) -> str | None:
    """The command's option that the unknown one is a near miss of (a typo), else None: RELION options that are not
    implemented here (--relax_sym …) are not typos of the options they share words with (--sym …), and an option of
    the opposite meaning is never offered (--no_norm is not a misspelt --norm: `opposite_meaning`)."""
    import difflib

    close = [name for name in (exc.possibilities or [])
             if difflib.SequenceMatcher(None, exc.option_name, name).ratio() >= NEAR_MISS_RATIO
             and not opposite_meaning(exc.option_name, name)]
    return close[0] if close else None


#: difflib's similarity from which an unknown option is taken for a typo of a known one (--healpix_ordr: 0.97;
#: --relax_sym against --sym: 0.62)
NEAR_MISS_RATIO = 0.8

#: words of an option name that negate the rest (--no_norm, --dont_combine_weights_via_disc, --skip_align)
NEGATING_WORDS = frozenset({"no", "not", "dont", "non", "skip", "without"})
#: prefixes that negate a word (--ctf_uncorrected_ref against --ctf_corrected_ref)
NEGATING_PREFIXES = ("un", "non", "dis", "in")
#: words (or parts of words: lowres, highres) of opposite meaning
ANTONYMS = (("low", "high"), ("join", "split"), ("min", "max"), ("first", "last"), ("inner", "outer"),
            ("more", "less"), ("enable", "disable"), ("keep", "drop"))


def opposite_meaning(option, other) -> bool:
    """Whether two option names say opposite things: one carries a negating word the other lacks (no_, dont_ …), or,
    word for word, a word of one is the other's with a negating prefix (uncorrected, corrected) or with a part
    swapped for its antonym (lowres, highres; join, split). Such names are near each other in spelling only."""
    words = [name.lstrip("-").lower().split("_") for name in (option, other)]
    negations = [sum(word in NEGATING_WORDS for word in name) for name in words]
    if negations[0] != negations[1]:
        return True
    first, second = ([word for word in name if word not in NEGATING_WORDS] for name in words)
    if len(first) != len(second):
        return False
    return any(_opposite_words(a, b) or _opposite_words(b, a) for a, b in zip(first, second) if a != b)


def _opposite_words(word, other) -> bool:
    if any(word == prefix + other for prefix in NEGATING_PREFIXES):
        return True
    for one, two in ANTONYMS + tuple((b, a) for a, b in ANTONYMS):
        start = word.find(one)
        while start >= 0:
            if word[:start] + two + word[start + len(one):] == other:
                return True
            start = word.find(one, start + 1)
    return False


def _pipeline_failure(args):
    """RELION_JOB_EXIT_FAILURE in the folder of --pipeline_control, read from the raw arguments: an error before
    the command's own handling (`_pipeline`), such as an option it does not know, must end the job for RELION's GUI
    too, which waits for that file (the master writes it; a folder that cannot hold it is passed over)."""
    folder = None
    for i, arg in enumerate(args):
        if arg == "--pipeline_control" and i + 1 < len(args):
            folder = args[i + 1]
        elif str(arg).startswith("--pipeline_control="):
            folder = str(arg).partition("=")[2]
    if not folder:
        return
    from cryorefine.io.pipeline import FAILURE, PipelineControl
    from cryorefine.runners.mpi import rank_from_environment

    if rank_from_environment() == 0:
        try:
            PipelineControl(folder).finished(FAILURE)
        except OSError:
            pass


def _commands_taking(option_name):
    """The cryorefine commands that honour the option `option_name` (such as --K), by name (plan's options that do
    not change the plan are not counted)."""
    return sorted(name for name, command in cli.commands.items()
                  if any(option_name in param.opts and getattr(param, "section", None) != PLAN_SECTION
                         for param in command.params))


def _command(exc):
    ctx = getattr(exc, "ctx", None)
    return ctx.command_path.split(" ", 1)[1] if ctx and " " in ctx.command_path else ""


def _fail(message, code, debug, args=()):
    _pipeline_failure(args)
    if debug:
        raise
    from cryorefine.runners.mpi import launched_with_mpi, rank_from_environment

    if not (launched_with_mpi() and rank_from_environment() > 0):  # under mpirun every rank sees it: say it once
        click.echo(f"cryorefine: error: {' '.join(str(message).split())}", err=True)
    sys.exit(code)
