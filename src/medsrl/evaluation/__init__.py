"""Offline evaluation: ``passk`` (unbiased pass@k, maj@n), ``diversity``, ``tables`` (tidy rows as
Markdown / CSV / JSON and a pass@k plot), and ``responses`` / ``store`` / ``response_features``
(sampling n graded responses per problem, resumably). Import the submodules directly."""
