"""`cryorefine info`: what a particle STAR file or an MRC file holds, as a plain dict."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cryorefine.data import load_particles
from cryorefine.errors import InputError
from cryorefine.io import mrc
from cryorefine.io.star import read_star

MRC_SUFFIXES = (".mrc", ".mrcs", ".map", ".st", ".rec")


def describe(path, check_images=False):
    """A dict describing a .star or .mrc(s) file; with `check_images`, every image is read and checked."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: file not found; check the path (relative paths start from {Path.cwd()})")
    if path.suffix.lower() in MRC_SUFFIXES:
        return describe_mrc(path)
    if path.suffix.lower() == ".star":
        return describe_star(path, check_images)
    raise InputError(f"{path}: unknown file type '{path.suffix}'; give a .star, .mrc or .mrcs file")


def describe_mrc(path):
    with mrc.open_mrc(path) as m:
        data = m.data
        stats = _running_stats(data)
        return {
            "file": str(path), "kind": "mrc",
            "shape_zyx": [int(s) for s in data.shape],
            "mode": int(m.header.mode),
            "is_stack": Path(path).suffix.lower() == ".mrcs" or data.ndim == 2 or data.shape[0] != data.shape[1],
            "pixel_size_angstrom": mrc.header_pixel_size(m),
            **stats,
        }


def _running_stats(data):
    """min/max/mean/rms computed from the data (headers are often wrong), a slab at a time."""
    lo, hi, total, total_sq, count = np.inf, -np.inf, 0.0, 0.0, 0
    slabs = data if data.ndim == 3 else data[None]
    for start in range(0, slabs.shape[0], 64):
        slab = np.asarray(slabs[start:start + 64], dtype=np.float64)
        lo, hi = min(lo, float(slab.min())), max(hi, float(slab.max()))
        total += float(slab.sum())
        total_sq += float((slab * slab).sum())
        count += slab.size
    mean = total / count
    return {"min": lo, "max": hi, "mean": mean, "rms": float(np.sqrt(max(total_sq / count - mean * mean, 0.0)))}


def describe_star(path, check_images=False):
    blocks = read_star(path)
    if not blocks:
        raise InputError(f"{path}: no data_ block in it; not a STAR file (or an empty one)")
    if not any(getattr(b, "columns", None) is not None and "rlnImageName" in b.columns for b in blocks.values()):
        return {"file": str(path), "kind": "star",
                "blocks": {name: (f"{len(b)} rows × {b.shape[1]} columns" if hasattr(b, "shape")
                                  else f"{len(b)} values")
                           for name, b in blocks.items()}}
    particles = load_particles(path, check_stacks=check_images)
    if check_images:
        particles.geometry()
        with mrc.StackReader() as reader:
            for batch in particles.batches(512):
                particles.read_images(batch, reader)
    stacks = particles.stacks
    table = particles.star.particles
    defocus = None
    if "rlnDefocusU" in table.columns:
        both = np.concatenate([particles.defocus_u_angstrom, particles.defocus_v_angstrom])
        defocus = [float(np.nanmin(both)), float(np.nanmax(both))]
    return {
        "file": str(path), "kind": "particles",
        "star_version": particles.star.source_version,
        "n_particles": len(particles),
        "optics_groups": [
            {"number": g.number, "name": g.name, "pixel_size_angstrom": g.pixel_size_angstrom, "box_px": g.box_px,
             "voltage_kv": g.voltage_kv, "cs_mm": g.cs_mm, "amplitude_contrast": g.amplitude_contrast,
             "n_particles": int((particles.optics_index == i).sum())}
            for i, g in enumerate(particles.optics_groups)],
        "stacks": {"count": len(stacks), "missing": [s for s in stacks if not Path(s).is_file()]},
        "defocus_range_angstrom": defocus,
        "pose_columns": particles.pose_columns,
        "has_random_subset": "rlnRandomSubset" in table.columns,
        "other_columns": [c for c in table.columns if c not in ("rlnImageName",)],
        "images_checked": bool(check_images),
    }


def format_text(info):
    """Human-readable lines for a `describe` dict."""
    lines = [f"{info['file']}"]
    if info["kind"] == "mrc":
        z, y, x = info["shape_zyx"]
        what = f"stack of {z} images {x}×{y} px" if info["is_stack"] else f"map {x}×{y}×{z} voxels"
        pix = info["pixel_size_angstrom"]
        lines += [f"  {what}, mode {info['mode']}",
                  f"  pixel size: {pix:.4f} Å" if pix else "  pixel size: not set in the header (0 or 1.0)",
                  f"  min {info['min']:.6g}  max {info['max']:.6g}  mean {info['mean']:.6g}  rms {info['rms']:.6g}"]
        return "\n".join(lines)
    if info["kind"] == "star":
        lines += [f"  data_{name}: {desc}" for name, desc in info["blocks"].items()]
        return "\n".join(lines)
    lines.append(f"  RELION {info['star_version']} particle file, {info['n_particles']} particles")
    lines.append("  optics groups:")
    for g in info["optics_groups"]:
        lines.append(f"    {g['number']:>3} {g['name']:<16} {g['n_particles']:>8} particles  "
                     f"{g['pixel_size_angstrom']:.4f} Å/px  box {g['box_px'] or '?'} px  "
                     f"{_fmt(g['voltage_kv'], 'kV')}  Cs {_fmt(g['cs_mm'], 'mm')}  "
                     f"Q0 {_fmt(g['amplitude_contrast'], '')}")
    st = info["stacks"]
    status = "all present" if not st["missing"] else f"{len(st['missing'])} missing, e.g. {st['missing'][0]}"
    lines.append(f"  image stacks: {st['count']} ({status})")
    if info["images_checked"]:
        lines.append(f"  images: all {info['n_particles']} images readable and finite")
    d = info["defocus_range_angstrom"]
    lines.append(f"  defocus: {d[0]:.0f} – {d[1]:.0f} Å" if d else "  defocus: no CTF columns")
    poses = info["pose_columns"]
    lines.append(f"  pose columns: {', '.join(poses) if poses else 'none'}")
    return "\n".join(lines)


def _fmt(value, unit):
    return "?" if value is None else f"{value:g}{(' ' + unit) if unit else ''}"
