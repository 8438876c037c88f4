"""Loss scaling and the optax transform: scales, the skip, the fold, state checks and readers.

Private: ``jaxmp`` re-exports the public names (``jaxmp.loss_scaling``, ``jaxmp.value_and_grad``,
``jaxmp.scaling_stats``, ...). The folder groups the modules of the loss-scaling layer; nothing
is imported here, so reaching one module loads only what it needs.
"""
