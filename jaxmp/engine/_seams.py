"""The names other jaxmp units use from jaxmp.engine's private modules: the explicitly internal
face of jaxmp.engine (no stability promise; tests/_support/_import_graph.py lets other units import
``_seams`` modules and no other private module of a subpackage). Generated from the imports."""

from jaxmp.engine import _config as config
from jaxmp.engine import _contract as contract
from jaxmp.engine import _internals as internals
from jaxmp.engine import _tested as tested
from jaxmp.engine._api import explain_enabled
from jaxmp.engine._api import explaining
from jaxmp.engine._config import flax_config
from jaxmp.engine._config import resolve_config
from jaxmp.engine._entry import autocast
from jaxmp.engine._entry import engine_function
from jaxmp.engine._modules import install_call_hooks
from jaxmp.engine._modules import instance_rules
from jaxmp.engine._modules import module_interceptor
from jaxmp.engine._rules import AutocastRules
from jaxmp.engine._rules import COMBINER_OPS
from jaxmp.engine._rules import FLOAT32_OPS
from jaxmp.engine._rules import MARKER
from jaxmp.engine._rules import ModuleRule
from jaxmp.engine._rules import ModuleRules
from jaxmp.engine._rules import PURE_HALF_RULES
from jaxmp.engine._rules import merge_rules

__all__ = [
    "AutocastRules",
    "COMBINER_OPS",
    "FLOAT32_OPS",
    "MARKER",
    "ModuleRule",
    "ModuleRules",
    "PURE_HALF_RULES",
    "autocast",
    "config",
    "contract",
    "engine_function",
    "explain_enabled",
    "explaining",
    "flax_config",
    "install_call_hooks",
    "instance_rules",
    "internals",
    "merge_rules",
    "module_interceptor",
    "resolve_config",
    "tested",
]
