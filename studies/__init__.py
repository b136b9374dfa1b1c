"""The method-comparison studies (docs/STUDY.md): scripts beside the library, not installed with it.
A protocol (``protocols/<name>.yaml``) is run by ``runner`` and written up by ``report``; ``collect``
reads a study back, ``stats``, ``mechanism``, ``error_modes``, ``routes`` and ``audit`` compute."""
