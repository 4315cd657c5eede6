"""The per-iteration report: run_itNNN_report.png with the FSC curve, the angular distribution
of the particles' best orientations and the time spent per stage; a classification's with its classes' distribution,
resolutions and SSNR; a 2D classification's a gallery of its class averages (`write_class_gallery`); an initial
model's each class map's central slices and projections (`write_map_gallery`)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from cryorefine.io.atomic import atomic_path


def angular_histogram(rot_deg: npt.ArrayLike, tilt_deg: npt.ArrayLike, bins: tuple[int, int] = (36, 18)) -> np.ndarray:
    """Particle counts (n_tilt, n_rot) over rot −180…180 (columns) and tilt 0…180 (rows), in degrees."""
    rot = (np.asarray(rot_deg, dtype=np.float64) + 180.0) % 360.0 - 180.0
    counts, _, _ = np.histogram2d(np.asarray(tilt_deg, dtype=np.float64), rot, bins=(bins[1], bins[0]),
                                  range=((0.0, 180.0), (-180.0, 180.0)))
    return counts


def _resolution_axis(ax, inv_angstrom):
    """x ticks of a spectrum panel labelled in Å."""
    ticks = np.linspace(inv_angstrom[0], inv_angstrom[-1], 5) if len(inv_angstrom) else []
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{1 / t:.1f}" for t in ticks])
    ax.set_xlabel("resolution (Å)")


def _angular_panel(fig, ax, rot_deg, tilt_deg, title):
    counts = angular_histogram(rot_deg, tilt_deg)
    image = ax.imshow(counts, origin="lower", extent=(-180, 180, 0, 180), aspect="auto", cmap="viridis")
    fig.colorbar(image, ax=ax, label="particles")
    ax.set_xlabel("rot (°)")
    ax.set_ylabel("tilt (°)")
    ax.set_title(title, fontsize="small" if len(title) > 45 else None)


def write_iteration_report(path: Path | str, *, iteration: int, fsc: npt.ArrayLike, ori_size_px: int,
                           pixel_size_angstrom: float, resolution_angstrom: float, rot_deg: npt.ArrayLike,
                           tilt_deg: npt.ArrayLike, timings_seconds: Mapping[str, float],
                           halves_joined: bool = False) -> None:
    """Write the PNG atomically (matplotlib's Agg canvas; no pyplot, no global state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.5), dpi=80)
    FigureCanvasAgg(fig)
    ax_fsc, ax_ang, ax_time = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1.2, 1.4, 1.0]})

    fsc = np.asarray(fsc, dtype=np.float64)
    shells = np.arange(1, min(fsc.size, ori_size_px // 2 + 1))
    inv_angstrom = shells / (ori_size_px * pixel_size_angstrom)
    ax_fsc.plot(inv_angstrom, fsc[shells], color="tab:blue")
    for level in (0.5, 0.143):
        ax_fsc.axhline(level, color="grey", lw=0.8, ls="--")
    if np.isfinite(resolution_angstrom) and resolution_angstrom > 0:
        ax_fsc.axvline(1.0 / resolution_angstrom, color="tab:red", lw=1.0)
        ax_fsc.text(1.0 / resolution_angstrom, 0.95, f" {resolution_angstrom:.1f} Å", color="tab:red", va="top")
    _resolution_axis(ax_fsc, inv_angstrom)
    ax_fsc.set_ylabel("FSC")
    ax_fsc.set_ylim(-0.1, 1.05)
    criterion = "halves joined, FSC 0.143" if halves_joined else "gold standard, SSNR 1 (≈ FSC 0.5)"
    ax_fsc.set_title(f"iteration {iteration}: {criterion}")

    _angular_panel(fig, ax_ang, rot_deg, tilt_deg, f"best orientations of {np.asarray(rot_deg).size} particles")

    names = list(timings_seconds)
    ax_time.barh(names, [timings_seconds[n] for n in names], color="tab:green")
    ax_time.set_xlabel("seconds")
    ax_time.set_title("time per stage")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")


def write_classification_report(path: Path | str, *, iteration: int, class_distributions: npt.ArrayLike,
                                ssnr: npt.ArrayLike, ori_size_px: int, pixel_size_angstrom: float,
                                resolution_angstrom: float, rot_deg: npt.ArrayLike, tilt_deg: npt.ArrayLike,
                                timings_seconds: Mapping[str, float], class_changes: npt.ArrayLike | None = None,
                                class_resolutions_angstrom: npt.ArrayLike | None = None) -> None:
    """run_itNNN_report.png of a classification: the class distribution over the iterations so far
    (`class_distributions` (iterations, K)) with the share of particles that changed class in each
    (`class_changes` (iterations,)), each class's resolution over the iterations (`class_resolutions_angstrom`
    (iterations, K)), each class's SSNR now (K, n_shells), the angular distribution."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(19, 4.5), dpi=80)
    FigureCanvasAgg(fig)
    ax_dist, ax_res, ax_ssnr, ax_ang = fig.subplots(1, 4, gridspec_kw={"width_ratios": [1.1, 1.0, 1.2, 1.4]})

    history = np.atleast_2d(np.asarray(class_distributions, dtype=np.float64))
    its = np.arange(1, history.shape[0] + 1)
    for k in range(history.shape[1]):
        ax_dist.plot(its, history[:, k], marker="o", label=f"class {k + 1}")
    if class_changes is not None and len(class_changes):
        changes = np.asarray(class_changes, dtype=np.float64)
        ax_dist.plot(np.arange(1, changes.size + 1), changes, color="black", ls="--", marker=".",
                     label="changed class")
    ax_dist.set_xlabel("iteration")
    ax_dist.set_ylabel("fraction of particles")
    ax_dist.set_ylim(0, 1)
    ax_dist.legend(fontsize="small")
    ax_dist.set_title(f"iteration {iteration}: class distribution")

    if class_resolutions_angstrom is not None and np.size(class_resolutions_angstrom):
        per_class = np.atleast_2d(np.asarray(class_resolutions_angstrom, dtype=np.float64))
        for k in range(per_class.shape[1]):
            ax_res.plot(np.arange(1, per_class.shape[0] + 1), per_class[:, k], marker="o", label=f"class {k + 1}")
        ax_res.invert_yaxis()  # better resolution higher up
        ax_res.legend(fontsize="small")
    ax_res.set_xlabel("iteration")
    ax_res.set_ylabel("resolution (Å), SSNR > 1")
    ax_res.set_title("resolution per class")
    for ax in (ax_dist, ax_res):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))

    ssnr = np.atleast_2d(np.asarray(ssnr, dtype=np.float64))
    shells = np.arange(1, min(ssnr.shape[1], ori_size_px // 2 + 1))
    inv_angstrom = shells / (ori_size_px * pixel_size_angstrom)
    for k in range(ssnr.shape[0]):
        ax_ssnr.semilogy(inv_angstrom, np.maximum(ssnr[k, shells], 1e-3), label=f"class {k + 1}")
    ax_ssnr.axhline(1.0, color="grey", lw=0.8, ls="--")
    if np.isfinite(resolution_angstrom) and resolution_angstrom > 0:
        ax_ssnr.axvline(1.0 / resolution_angstrom, color="tab:red", lw=1.0)
    _resolution_axis(ax_ssnr, inv_angstrom)
    ax_ssnr.set_ylabel("SSNR (data vs prior)")
    ax_ssnr.set_title(f"resolution {resolution_angstrom:.1f} Å")

    seconds = ", ".join(f"{name} {value:.1f} s" for name, value in timings_seconds.items())
    _angular_panel(fig, ax_ang, rot_deg, tilt_deg, f"best orientations; {seconds}")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")


#: the PNG text key under which a class gallery records its panels (`gallery_panels`, as JSON), for programs and tests
GALLERY_PANELS_KEY = "cryorefine class gallery"


@dataclass(frozen=True)
class GalleryPanel:
    """One class average in a 2D classification's gallery: its class number (1-based), its share of the particles
    (model.star's rlnClassDistribution) and the particles whose best class it is (data.star's rlnClassNumber)."""

    class_number: int
    share: float
    n_particles: int | None = None

    @property
    def title(self) -> str:
        count = "" if self.n_particles is None else f" · {self.n_particles}"
        return f"{self.class_number}: {100 * self.share:.1f}%{count}"


def gallery_panels(class_distribution: npt.ArrayLike,
                   particle_counts: npt.ArrayLike | None = None) -> list[GalleryPanel]:
    """The gallery's panels in RELION's order of 2D class averages (its display sorted on rlnClassDistribution,
    largest first; equal shares by class number)."""
    share = np.asarray(class_distribution, dtype=np.float64)
    counts = None if particle_counts is None else np.asarray(particle_counts, dtype=np.int64)
    order = np.argsort(-share, kind="stable")
    return [GalleryPanel(int(k) + 1, float(share[k]), None if counts is None else int(counts[k])) for k in order]


def write_class_gallery(path: Path | str, images: npt.ArrayLike, class_distribution: npt.ArrayLike, *,
                        iteration: int, resolution_angstrom: float,
                        particle_counts: npt.ArrayLike | None = None) -> None:
    """run_itNNN_report.png of a 2D classification: the K class averages (`images` (K, N, N)) as a gallery in
    `gallery_panels`' order, each titled with its number, its share of the particles (`class_distribution` (K,)) and
    the particles whose best class it is (`particle_counts` (K,), if given), every image scaled to its own range, y
    up as RELION's display shows them. The panels are recorded in the PNG's text under GALLERY_PANELS_KEY."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    images = np.asarray(images, dtype=np.float64)
    panels = gallery_panels(class_distribution, particle_counts)
    columns = int(min(10, max(1, images.shape[0])))
    rows = -(-images.shape[0] // columns)
    fig = Figure(figsize=(1.6 * columns, 1.75 * rows + 0.5), dpi=80)
    FigureCanvasAgg(fig)
    axes = np.atleast_1d(fig.subplots(rows, columns, squeeze=False)).reshape(-1)
    for ax in axes:
        ax.set_axis_off()
    for ax, panel in zip(axes, panels):
        ax.imshow(images[panel.class_number - 1], cmap="gray", origin="lower")
        ax.set_title(panel.title, fontsize="small")
    counted = "" if particle_counts is None else " · particles whose best class it is"
    fig.suptitle(f"iteration {iteration}: class averages (class: share of particles{counted}), resolution "
                 f"{resolution_angstrom:.1f} Å", fontsize="small")
    record = json.dumps([dataclasses.asdict(panel) for panel in panels])
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", metadata={GALLERY_PANELS_KEY: record})


#: the views of a 3D map in the initial model's report (`map_views`), in its columns: central slices normal to z, y
#: and x, then projections along z, y and x
MAP_VIEWS = ("slice z", "slice y", "slice x", "projection z", "projection y", "projection x")
#: the gallery's geometry in pixels of the PNG: a view is drawn at least this large (an integer magnification of the
#: map's pixels), views and rows apart by GALLERY_GAP_PX, each row under a title band, all under a header
GALLERY_MIN_VIEW_PX = 96
GALLERY_GAP_PX = 6
GALLERY_ROW_TITLE_PX = 18
GALLERY_HEADER_PX = 40
GALLERY_DPI = 100


def map_views(volume: npt.ArrayLike) -> dict[str, np.ndarray]:
    """The views of a map (N, N, N) indexed (z, y, x) that the initial model's report draws (MAP_VIEWS): its central
    slices volume[N//2] (y, x), volume[:, N//2] (z, x) and volume[:, :, N//2] (z, y), and its sums along z, y and x
    (same axes)."""
    v = np.asarray(volume, dtype=np.float64)
    c = v.shape[0] // 2
    return {"slice z": v[c], "slice y": v[:, c], "slice x": v[:, :, c],
            "projection z": v.sum(axis=0), "projection y": v.sum(axis=1), "projection x": v.sum(axis=2)}


@dataclass(frozen=True)
class GalleryGeometry:
    """Where `write_map_gallery` draws: the PNG's size, the magnification of a map's pixels and each view's top-left
    pixel (x from the left, y from the top) by (row, column)."""

    width_px: int
    height_px: int
    magnification: int
    view_px: int

    def view_origin(self, row: int, column: int) -> tuple[int, int]:
        x = GALLERY_GAP_PX + column * (self.view_px + GALLERY_GAP_PX)
        y = GALLERY_HEADER_PX + row * (GALLERY_ROW_TITLE_PX + self.view_px + GALLERY_GAP_PX) + GALLERY_ROW_TITLE_PX
        return x, y


def gallery_geometry(n_classes: int, box_px: int) -> GalleryGeometry:
    """The geometry of the report of `n_classes` maps of `box_px` (`GalleryGeometry`)."""
    magnification = max(1, -(-GALLERY_MIN_VIEW_PX // int(box_px)))
    view = int(box_px) * magnification
    width = GALLERY_GAP_PX + len(MAP_VIEWS) * (view + GALLERY_GAP_PX)
    height = GALLERY_HEADER_PX + n_classes * (GALLERY_ROW_TITLE_PX + view + GALLERY_GAP_PX)
    return GalleryGeometry(width, height, magnification, view)


def write_map_gallery(path: Path | str, maps: Sequence[npt.ArrayLike], class_distribution: npt.ArrayLike, *,
                      iteration: int, resolution_angstrom: float) -> None:
    """run_itNNN_report.png of an initial model: a row per class (titled with its share of the particles) of its
    map's views (`map_views`: central slices and projections), each drawn pixel for pixel (magnified by a whole
    number, `gallery_geometry`), in grey from its own minimum (black) to its maximum (white), y (or z) up."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    share = np.asarray(class_distribution, dtype=np.float64)
    box = int(np.shape(maps[0])[0])
    geometry = gallery_geometry(len(maps), box)
    width, height = geometry.width_px, geometry.height_px
    fig = Figure(figsize=(width / GALLERY_DPI, height / GALLERY_DPI), dpi=GALLERY_DPI)
    FigureCanvasAgg(fig)
    fig.text(0.5, 1.0 - 4.0 / height, f"iteration {iteration}: resolution {resolution_angstrom:.1f} Å", ha="center",
             va="top", fontsize=10)
    for column, name in enumerate(MAP_VIEWS):
        x, _ = geometry.view_origin(0, column)
        fig.text((x + geometry.view_px / 2.0) / width, 1.0 - (GALLERY_HEADER_PX - 4.0) / height, name, ha="center",
                 va="bottom", fontsize=8)
    for row, volume in enumerate(maps):
        views = map_views(volume)
        x, y = geometry.view_origin(row, 0)
        fig.text(x / width, 1.0 - (y - 3.0) / height, f"class {row + 1}: {100 * share[row]:.1f} % of the particles",
                 ha="left", va="bottom", fontsize=8)
        for column, name in enumerate(MAP_VIEWS):
            view = views[name]
            magnified = np.kron(view, np.ones((geometry.magnification, geometry.magnification)))
            x, y = geometry.view_origin(row, column)
            fig.figimage(magnified, xo=x, yo=height - y - geometry.view_px, origin="lower", cmap="gray",
                         vmin=float(view.min()), vmax=float(view.max()))
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=GALLERY_DPI)
