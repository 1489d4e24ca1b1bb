"""opguard-run: the MPI-aware launcher wrapper (never imports torch, never initialises MPI)."""
