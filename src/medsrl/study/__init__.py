"""The method-comparison study (issue 14, docs/STUDY.md): several RL methods, a few seeds each,
one report. ``runner`` runs it, ``collect`` reads it back, ``stats`` / ``mechanism`` /
``error_modes`` compute, ``plots`` and ``report`` present. Import the submodules directly."""
