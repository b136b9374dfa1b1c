"""The method-comparison study (issue 14): several RL methods, a few seeds each, one report.

``stats`` (mean +- std, Welch's t-test over seeds, a paired bootstrap / sign-flip test over
problems), ``collect`` (read a study directory into plain data), ``plots`` (pass@k and training
curves) and ``report`` (the Markdown results section of ``docs/STUDY.md``, ``results.md`` /
``results.json``, and the ``python -m medsrl.study.report`` CLI). Import the submodules directly.
"""
