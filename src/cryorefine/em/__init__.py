"""The iteration loop and what it is made of: the E-step batch loop, M-step pieces, run state, schedule."""
