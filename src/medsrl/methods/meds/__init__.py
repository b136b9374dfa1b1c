"""MEDS reward shaping. Import the submodules directly: the re-fit workers import ``refit`` and
must not pay for torch."""
