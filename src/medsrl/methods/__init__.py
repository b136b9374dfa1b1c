"""Training methods, one module or package each (rule, plug-in, settings): docs/PLUGINS.md."""
