"""The engine's semi-public face: what the rest of jaxmp uses of ``jaxmp.engine``'s private modules.

As ``equinox.internal`` is to Equinox, this module is the one door through which other jaxmp
units (the Flax wrappers, the diagnostics, the self-check) reach the engine's internals; they
import no other private module of ``jaxmp.engine`` (tests/_support/_import_graph.py checks it).
It holds only what those units use (tests/cross/test_architecture.py checks that every name here
has a user outside the engine), grouped by who uses it.

No stability promise: these names change with the engine, in any release and without a
deprecation period. Code outside jaxmp should use the public names (``jaxmp.autocast``,
``jaxmp.AutocastRules``, ``jaxmp.engine.FLOAT32_OPS``) instead.
"""

# Module rules: the vocabulary both front doors compile to (jaxmp.flax builds and applies them).
from jaxmp.engine._rules import PURE_HALF_RULES, AutocastRules, merge_rules
# The precision search reads a rung (a preset name or recipe) as the rules read a matmul format.
from jaxmp.engine._rules import matmul_format
from jaxmp.engine._module_rules import ModuleRule
from jaxmp.engine._modules import install_call_hooks, instance_rules, module_interceptor

# The Flax door's way in: its own resolved config, run by the engine without autocast's wrapper.
from jaxmp.engine._config import TRACING, flax_config, resolve_config
from jaxmp.engine._autocast_fn import autocast, engine_function

# Reading back what the engine decided (the diagnostics' "explain", the fp8 layers' markers).
from jaxmp.engine._build import explain_enabled, explaining
# The debugger's trace: jaxmp's sharded steps run their loss outside the shard_map under it.
from jaxmp.engine._build import debugger_tracing, debugger_tracing_enabled
# The locator's fix for a jaxmp.autocast function: what it wraps, re-wrapped with the fix's rule.
from jaxmp.engine._build import autocast_given
from jaxmp.engine._rules import MARKER

# JAX's internals as the engine reads them, and the contract the self-check runs.
from jaxmp.engine import _contract as contract
from jaxmp.engine import _internals as internals
from jaxmp.engine import _tested as tested

__all__ = [
    # module rules
    "AutocastRules",
    "ModuleRule",
    "PURE_HALF_RULES",
    "merge_rules",
    "matmul_format",
    "install_call_hooks",
    "instance_rules",
    "module_interceptor",
    # the Flax door's way in
    "TRACING",
    "flax_config",
    "resolve_config",
    "autocast",
    "engine_function",
    # reading back what the engine decided
    "explain_enabled",
    "explaining",
    "debugger_tracing",
    "debugger_tracing_enabled",
    "autocast_given",
    "MARKER",
    # internals and the contract
    "contract",
    "internals",
    "tested",
]
