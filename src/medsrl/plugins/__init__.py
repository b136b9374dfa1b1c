"""The extension point of the RL step: the plug-in protocol (``base.py``) and the host that calls
the hooks in order, generation rounds included (``host.py``). The methods are in
``medsrl.methods``; ``docs/PLUGINS.md`` shows how to write one."""

from medsrl.plugins.base import Plugin, StepContext
from medsrl.plugins.host import PluginHost

__all__ = ["Plugin", "PluginHost", "StepContext"]
