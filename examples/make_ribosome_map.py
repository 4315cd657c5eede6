"""Write examples/ribosome_64px.mrc: the M. pneumoniae 70S ribosome (PDB 7P6Z) as a 64³ map.

6 Å/px (a 384 Å box around the ~266 Å particle), electron density low-passed to 15 Å, centre of
mass on voxel 32. Run from the repository root:

    python examples/make_ribosome_map.py [--model 7p6z.cif.gz] [--o examples/ribosome_64px.mrc]

examples/ribosome_7p6z_10A_64px.mrc, state A of the classification tests' set B (4.57 Å/px, 10 Å, as
benchmarks/classify_accuracy.py --model makes it):

    python examples/make_ribosome_map.py --angpix 4.57 --resolution 10 --o examples/ribosome_7p6z_10A_64px.mrc

The model defaults to ../shared/data/real/models/7p6z.cif.gz beside the repository.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mrcfile

from cryorefine.density import density_from_model

REPO = Path(__file__).resolve().parents[1]
BOX_PX = 64
PIXEL_SIZE_ANGSTROM = 6.0
RESOLUTION_ANGSTROM = 15.0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO.parent / "shared/data/real/models/7p6z.cif.gz")
    parser.add_argument("--o", type=Path, default=REPO / "examples/ribosome_64px.mrc")
    parser.add_argument("--angpix", type=float, default=PIXEL_SIZE_ANGSTROM, help="Pixel size (Å).")
    parser.add_argument("--resolution", type=float, default=RESOLUTION_ANGSTROM, help="Low-pass resolution (Å).")
    args = parser.parse_args(argv)
    density = density_from_model(args.model, BOX_PX, args.angpix, args.resolution)
    with mrcfile.new(args.o, overwrite=True) as mrc:
        mrc.set_data(density)  # also updates the header's dimensions and min/max/mean/rms
        mrc.voxel_size = args.angpix
        mrc.update_header_stats()
    print(f"wrote {args.o}: {BOX_PX}³ at {args.angpix} Å/px, low-passed to {args.resolution} Å")


if __name__ == "__main__":
    main()
