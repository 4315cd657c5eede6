"""The files a run leaves under its output root (--o, e.g. out/run): an earlier run's, found before a new run
starts on that root (refused, or removed with --overwrite), and the iteration a stopped run can be continued from.

A run's files are out/run_itNNN_* (every iteration's, from out/run_it000_*: the state before iteration 1, which
--continue can start from as it can from any other iteration) and the files a converged refinement writes, as RELION
does, without an iteration number in its final iteration (out/run_data.star, out/run_class001.mrc, …). A run
continued from iteration N writes under the root relion_refine gives it (`continued_output_root`: out/run_ctN where
--continue comes with no --o or the run's own, as RELION's GUI writes its continue lines).
"""

from __future__ import annotations

import functools
import glob
import logging
import re
import shlex
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryorefine.errors import InputError
from cryorefine.io.atomic import atomic_path
from cryorefine.io.relion_outputs import read_optimiser_star
from cryorefine.io.resume import SUFFIX as RESUME_SUFFIX

#: a converged refinement's files without an iteration number (`jobs.refine`), after the root
FINAL_SUFFIXES = ("_data.star", "_model.star", "_class001.mrc", "_class001_angdist.bild", "_half1_class001_unfil.mrc",
                  "_half2_class001_unfil.mrc", "_sampling.star", "_optimiser.star", "_report.png")
#: the final files by which an earlier run is known (its other final files come with them)
FINAL_SIGNS = ("_data.star", "_model.star", "_class001.mrc")
ITERATION_PATTERN = "_it[0-9][0-9][0-9]_*"


@dataclass(frozen=True)
class EarlierRun:
    """The files of a run found under an output root: its iterations (ascending) and all its files."""

    root: str
    iterations: tuple
    files: tuple  # Path of every file of the run under the root

    def describe(self) -> str:
        """What was found, e.g. "iterations 1–18 and the final files (run_class001.mrc …) of an earlier run"."""
        name = Path(self.root).name
        parts = []
        if self.iterations:
            first, last = self.iterations[0], self.iterations[-1]
            parts.append(f"iteration {first}" if first == last else f"iterations {first}–{last}")
        finals = [f"{name}{suffix}" for suffix in FINAL_SIGNS if Path(f"{self.root}{suffix}").is_file()]
        if finals:
            parts.append(f"the final files ({', '.join(finals)})")
        return f"{' and '.join(parts)} of an earlier run"

    def last_optimiser_star(self) -> Path | None:
        """The optimiser.star of its last iteration that --continue can start from, None where none can."""
        for iteration in reversed(self.iterations):
            star = optimiser_star(self.root, iteration)
            if star.is_file() and resume_file(self.root, iteration).is_file():
                return star
        return None


def iteration_root(root: str, iteration: int) -> str:
    """<root>_itNNN, the start of iteration NNN's file names (NNN 000: the files before iteration 1)."""
    return f"{root}_it{iteration:03d}"


def optimiser_star(root: str, iteration: int) -> Path:
    """<root>_itNNN_optimiser.star."""
    return Path(f"{iteration_root(root, iteration)}_optimiser.star")


def resume_file(root: str, iteration: int) -> Path:
    """<root>_itNNN_resume.npz, what --continue reads beside the optimiser.star."""
    return Path(f"{iteration_root(root, iteration)}{RESUME_SUFFIX}")


def earlier_run(root: str) -> EarlierRun | None:
    """The files of a run under `root` (out/run), None where there are none."""
    root_path = Path(root)
    folder, name = root_path.parent, root_path.name
    if not folder.is_dir():
        return None
    numbered = re.compile(re.escape(name) + r"_it(\d{3})_")
    iteration_files = [p for p in folder.glob(glob.escape(name) + ITERATION_PATTERN) if p.is_file()]
    iterations = sorted({int(m.group(1)) for p in iteration_files if (m := numbered.match(p.name))})
    if not iterations and not any(Path(f"{root}{suffix}").is_file() for suffix in FINAL_SIGNS):
        return None
    finals = [Path(f"{root}{suffix}") for suffix in FINAL_SUFFIXES if Path(f"{root}{suffix}").is_file()]
    return EarlierRun(str(root), tuple(iterations), tuple(sorted(iteration_files) + finals))


def check_no_earlier_run(root: str, overwrite: bool, log: logging.Logger) -> None:
    """Before a new run (not --continue) on `root`: an InputError where an earlier run's files are there, naming
    the folder, that run and the way on; with `overwrite` (--overwrite) its files are removed instead."""
    found = earlier_run(root)
    if found is None:
        return
    if overwrite:
        for path in found.files:
            path.unlink(missing_ok=True)
        log.info("--overwrite: removed the %d files of %s under %s", len(found.files), found.describe(), root)
        return
    star = found.last_optimiser_star()
    go_on = f"continue it with --continue {star}, " if star is not None else ""
    raise InputError(f"--o {root}: {Path(root).parent} holds {found.describe()} with this root; {go_on}give a new "
                     f"--o, or add --overwrite to remove that run's files first")


def last_complete_iteration(root: str, iterations: Iterable[int], continued_from: str | None = None) -> tuple | None:
    """(iteration, its optimiser.star) of the last of this run's `iterations` whose files --continue reads are
    on disk; else the run's starting point `continued_from` (an optimiser.star); None where there is none."""
    for iteration in sorted(iterations, reverse=True):
        star = optimiser_star(root, iteration)
        if star.is_file() and resume_file(root, iteration).is_file():
            return iteration, star
    if continued_from is not None:
        return iteration_of(continued_from), Path(continued_from)
    return None


def iteration_of(optimiser_star_path: Path | str) -> int:
    """NNN of run_itNNN_optimiser.star."""
    match = re.search(r"_it(\d{3})_optimiser\.star$", str(optimiser_star_path))
    if match is None:
        raise InputError(f"{optimiser_star_path}: --continue takes a run_itNNN_optimiser.star file")
    return int(match.group(1))


def continued_output_root(optimiser_star_path: Path | str, given_root: str | None) -> str:
    """The output root of a run continued from `optimiser_star_path` with --o `given_root` (None: no --o), as
    relion_refine's MlOptimiser::parseContinue sets it: with no --o, or with the text of the continued run's own root
    (the optimiser.star's rlnOutputRootName, as RELION's GUI writes its continue lines: `--o <job folder>/run`),
    `<that root>_ct<N>`, N the iteration continued from (its rlnCurrentIteration, no leading zeros); otherwise
    `given_root`, as given."""
    iteration, general = read_optimiser_star(optimiser_star_path)
    run_root = str(general.get("rlnOutputRootName", ""))
    if given_root and (not run_root or str(given_root) != run_root):
        return str(given_root)
    if not run_root:
        raise InputError(f"{optimiser_star_path}: data_optimiser_general has no rlnOutputRootName; give --o")
    return f"{run_root}_ct{iteration}"


#: what a continued run does not write again of its starting iteration's files under a new root: RELION writes no
#: report, and --continue's own state is saved afresh for the new root
NOT_WRITTEN_AGAIN = ("_report.png", RESUME_SUFFIX)
#: the STAR files whose text names the run's files (model.star's maps and momenta, optimiser.star's files and root)
RENAMED_SUFFIXES = ("_model.star", "_optimiser.star")


def continued_iteration_writes(optimiser_star_path: Path | str, output_root: str, argv: list[str],
                               with_sampling: bool) -> list:
    """RELION's files of the iteration a run continues from, written again under a new output root (--continue with
    another --o: relion_refine's MlOptimiser::initialise writes the read state at its iteration under the new root,
    MlOptimiser::write; MlOptimiserMpi::initialise as well, with the sampling.star). The writes, each a callable, the
    optimiser.star last: each file of that iteration beside `optimiser_star_path` (`<old>_itNNN_*`) copied to
    `<output_root>_itNNN_*`, but the report and the saved state (NOT_WRITTEN_AGAIN) and, where `with_sampling` is
    false (relion_refine of one process), the sampling.star; in its model.star and optimiser.star the run's file
    names (those under the root the optimiser.star names, rlnOutputRootName) are the new root's, and the
    optimiser.star's command line is `argv`. None where `output_root` is the iteration's own root."""
    source = Path(optimiser_star_path)
    iteration = iteration_of(source)
    old_prefix = str(source)[: -len("_optimiser.star")]
    new_prefix = iteration_root(output_root, iteration)
    if Path(old_prefix).resolve() == Path(new_prefix).resolve():
        return []
    named_root = str(read_optimiser_star(source)[1].get("rlnOutputRootName", old_prefix[: -len("_itNNN")]))
    named_prefix = iteration_root(named_root, iteration)
    skipped = NOT_WRITTEN_AGAIN + (() if with_sampling else ("_sampling.star",))
    files = sorted(p for p in Path(old_prefix).parent.glob(glob.escape(Path(old_prefix).name) + "_*") if p.is_file())
    writes = []
    for path in files:
        suffix = path.name[len(Path(old_prefix).name):]
        if suffix in skipped or suffix == "_optimiser.star":
            continue
        target = f"{new_prefix}{suffix}"
        if suffix in RENAMED_SUFFIXES:
            writes.append(functools.partial(_write_renamed, path, target, named_prefix, new_prefix))
        else:
            writes.append(functools.partial(_copy_file, path, target))
    writes.append(functools.partial(_write_renamed, source, f"{new_prefix}_optimiser.star", named_prefix, new_prefix,
                                    (named_root, str(output_root)), argv))
    return writes


def renamed_star_text(text: str, old_prefix: str, new_prefix: str, root_names: tuple[str, str] | None = None,
                      argv: list[str] | None = None) -> str:
    """A run's STAR text with its file names under another root: every name that begins `old_prefix`_ (a whole
    value, or the stack after `NNNNNN@`) begins `new_prefix`_; with `root_names` (old, new) the value of
    rlnOutputRootName that is the old root becomes the new; with `argv` the command line comment (the second line
    of an optimiser.star, as RELION writes it) is that command's."""
    boundary = r"(^|[\s@\"'])"
    text = re.sub(boundary + re.escape(old_prefix + "_"), lambda m: m.group(1) + new_prefix + "_", text,
                  flags=re.MULTILINE)
    if root_names is not None:
        old_root, new_root = root_names
        text = re.sub(r"^(_rlnOutputRootName\s+)(\S+|\"[^\"]*\")[ \t]*$",
                      lambda m: m.group(1) + (new_root if m.group(2).strip("\"'") == old_root else m.group(2)),
                      text, flags=re.MULTILINE)
    if argv is not None:
        lines = text.split("\n")
        if len(lines) > 1 and lines[0].startswith("# RELION optimiser") and lines[1].startswith("#"):
            command = shlex.join(str(a) for a in argv).replace("\r", " ").replace("\n", " ")
            lines[1] = f"# {command}"
            text = "\n".join(lines)
    return text


def _write_renamed(source: Path, target: str, old_prefix: str, new_prefix: str,
                   root_names: tuple[str, str] | None = None, argv: list[str] | None = None) -> None:
    text = renamed_star_text(source.read_text(), old_prefix, new_prefix, root_names, argv)
    with atomic_path(target) as tmp:
        Path(tmp).write_text(text)


def _copy_file(source: Path, target: str) -> None:
    with atomic_path(target) as tmp:
        shutil.copyfile(source, tmp)
