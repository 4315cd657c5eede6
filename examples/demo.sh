#!/usr/bin/env bash
# The built-in example, end to end on whatever this machine has (the CPU engine without a GPU):
# simulate 2,000 particles of the 70S ribosome map shipped in examples/, check them, and
# reconstruct a map from their true poses with half maps and the gold-standard FSC, then
# refine a 32 px version from a 50 Å low-pass to convergence, as a RELION auto-refine would.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${DEMO_OUT:-demo_out}"
mkdir -p "$out"

echo "== the reference map"
cryorefine info "$here/ribosome_64px.mrc"

echo "== simulate 2,000 particles (CTF, SNR 0.1, ground-truth poses in the STAR file)"
cryorefine simulate --ref "$here/ribosome_64px.mrc" --n 2000 --snr 0.1 --seed 1 --o "$out/sim"

echo "== what was written"
cryorefine info --check-images "$out/sim/particles.star"

echo "== reconstruct from the true poses, with half maps and their FSC"
cryorefine reconstruct --i "$out/sim/particles.star" --o "$out/reconstruction.mrc" --ctf --half_maps

echo "== refine 400 particles at 32 px (12 Å/px) from the map low-passed to 50 Å, to convergence"
python - "$here/ribosome_64px.mrc" "$out/ribosome_32px.mrc" <<'PY'
import sys
from cryorefine.core.fourier import downsample_volume
from cryorefine.io.mrc import read_volume, write_volume
volume, pixel = read_volume(sys.argv[1])
write_volume(sys.argv[2], downsample_volume(volume, 32), pixel * volume.shape[0] / 32)
PY
cryorefine simulate --ref "$out/ribosome_32px.mrc" --n 400 --snr 0.3 --seed 2 --o "$out/sim32"
# RELION's auto-refine schedule; local searches from HEALPix order 3 (3.75°) keep the late iterations short;
# --overwrite: a second `make demo` replaces the first one's run instead of being refused
cryorefine refine --i "$out/sim32/particles.star" --ref "$out/ribosome_32px.mrc" --o "$out/refine/run" \
    --ini_high 50 --particle_diameter 320 --ctf --flatten_solvent --zero_mask --offset_range 3 --offset_step 1 \
    --norm --scale --auto_local_healpix_order 3 --overwrite

echo "== done"
echo "refined map:      $out/refine/run_class001.mrc (half maps run_half1/2_class001_unfil.mrc)"
echo "report:           $out/refine/run_report.png (FSC, resolution, angular distribution, stage times)"
echo "particles, poses: $out/refine/run_data.star"
