"""The extension point of the RL step: the plug-in protocol (``base.py``), the host that calls
the hooks in order (``host.py``) and the generation rounds (``rounds.py``). The methods are in
``medsrl.methods``; ``docs/PLUGINS.md`` shows how to write one."""

from medsrl.plugins.base import Plugin, StepContext
from medsrl.plugins.host import PluginHost

__all__ = ["Plugin", "PluginHost", "StepContext"]
