#!/usr/bin/env bash
# The built-in example, end to end on whatever this machine has (the CPU engine without a GPU):
# simulate 2,000 particles of the 70S ribosome map shipped in examples/, check them, and
# reconstruct a map from their true poses with half maps and the gold-standard FSC.
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

echo "== done: outputs in $out/"
ls -l "$out"
