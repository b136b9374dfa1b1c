"""The extension point of the RL step: the plug-in protocol and its host; ``docs/PLUGINS.md`` shows
how to write one (the methods are in ``medsrl.methods``)."""

from medsrl.plugins.base import Plugin, StepContext
from medsrl.plugins.host import PluginHost

__all__ = ["Plugin", "PluginHost", "StepContext"]
