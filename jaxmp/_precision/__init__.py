"""Precision policies: the ``Policy`` record, the presets and the hardware's recommendation.

Private: ``jaxmp`` re-exports the public names (``jaxmp.Policy``, ``jaxmp.get_policy``,
``jaxmp.recommended_policy``, ...). The folder groups the policy layer's modules; nothing is
imported here, so reaching one module loads only what it needs.
"""
