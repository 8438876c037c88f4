"""An XLA:CPU layout workaround for the operands of the loss-scaling skip's ``lax.cond``.

XLA:CPU passes an operand into a conditional in the layout its producer wrote: a weight
gradient out of a transposed dot (``dot(x.T, cotangent)``, cast up from half precision)
stays column-major there, and the branch then copies it to row-major before the optimizer
reads it, a float32 matrix written and read once more than by the same step without the
skip. Flattened behind an optimization barrier (which keeps XLA from moving the reshape
into the branch), the producer's fusion writes it row-major, as the floor's does, and the
branch reads a bitcast. Only matrices: a convolution kernel's gradient has no such
transposed producer, and the barrier cost the CNN step 4% of its time (measured with
``benchmarks/overhead.py``). Other backends keep their layouts (a TPU's tiled layout would
make the reshape a copy). ``tests/cross/test_efficiency.py`` holds the step to the floor's passes.

Private: used by `jaxmp._scaling._transform` only.
"""

from __future__ import annotations

import jax


def cond_operands(grad_leaves: list) -> list:
    """The gradients as the taken branch's operands, laid out so that XLA writes them once.

    Args:
      grad_leaves: the gradient leaves, in tree order.

    Returns:
      The operands to hand ``lax.cond``; `restore` turns them back into ``grad_leaves``' shapes.
    """
    if jax.default_backend() != "cpu":
        return grad_leaves
    matrices = [i for i, g in enumerate(grad_leaves) if g.ndim == 2]
    flat = jax.lax.optimization_barrier([grad_leaves[i].reshape(-1) for i in matrices])
    operands = list(grad_leaves)
    for i, f in zip(matrices, flat):
        operands[i] = f
    return operands


def restore(operands: list, grad_leaves: list) -> list:
    """The branch's operands back in the gradients' shapes (a bitcast for the flattened matrices)."""
    return [x.reshape(g.shape) for x, g in zip(operands, grad_leaves)]
