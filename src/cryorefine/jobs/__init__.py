"""One module per command: refine, classify, reconstruct, simulate, plan, info."""
