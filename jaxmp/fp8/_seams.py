"""The names other jaxmp units use from jaxmp.fp8's private modules: the explicitly internal
face of jaxmp.fp8 (no stability promise; tests/_support/_import_graph.py lets other units import
``_seams`` modules and no other private module of a subpackage). Generated from the imports."""

from jaxmp.fp8 import _recipes as recipes
from jaxmp.fp8 import _state as state
from jaxmp.fp8._state import FP8_COLLECTION

__all__ = [
    "FP8_COLLECTION",
    "recipes",
    "state",
]
