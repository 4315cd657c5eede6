"""cryorefine: RELION-compatible cryo-EM 3D refinement with a CuPy E-step.

Importing the package has no side effects: no CuPy import, no logging set-up.
"""

__version__ = "0.1.0"
