"""Training-method plug-ins (one module and one ``configs/plugins/*.yaml`` each) and their protocol.

See ``base.py`` for the hooks and ``docs/PLUGINS.md`` for how to write one.
"""

from medsrl.plugins.base import Plugin, StepContext
from medsrl.plugins.host import PluginHost

__all__ = ["Plugin", "PluginHost", "StepContext"]
