"""Offline evaluation: pass@k and maj@n, diversity, tables, resumable sampling; import the submodules."""
