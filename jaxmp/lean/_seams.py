"""The semi-public face of ``jaxmp.lean``: what the rest of jaxmp uses of its private modules.

The one door through which other jaxmp units reach the lean recipes' internals (as
``jaxmp.fp8._seams`` is fp8's). No stability promise: these names change in any release.
"""

from jaxmp.lean._chunked import whole_leaves

__all__ = ["whole_leaves"]
