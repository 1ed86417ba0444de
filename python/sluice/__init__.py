"""Pieces shared by the engine core, the workers and the CLI: config, errors, seam types."""
