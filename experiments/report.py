"""jaxmp's diagnostics on a trained run (``--report``): what the run's numbers do not show.

A diagnostic that fails is reported as failed; it never fails the run.
"""

from __future__ import annotations

import os
import sys

import jax

import jaxmp
import jaxmp.flax


def run_report(prog, compiled, state, batches, rng, policy: str, workdir: str,
               pipeline_steps: int = 20) -> dict:
    """Runs jaxmp's diagnostics on the trained state; writes ``report.txt`` (+ a gradient PNG).

    * ``jaxmp.precision_report`` of the train step: dtype, FLOPs and Tensor-Core eligibility
      of every matmul/conv, risky half-precision reductions, missed half ops;
    * ``jaxmp.gradient_stats`` of one batch's (unscaled) gradients: what fp16 would flush to
      zero or overflow at the current loss scale, and a suggested static scale;
    * ``jaxmp.input_pipeline_overhead``: how much of a step waits for data (a
      two-vCPU host can starve a GPU).

    A diagnostic that fails is reported as failed; it never fails the run. The state is
    consumed (the timed steps donate it), so call this last.
    """
    lines, out = [], {}

    def section(name, fn):
        try:
            value = fn()
            out[name] = value if isinstance(value, (str, float, int)) else str(value)
            lines.append(f"== {name} ==\n{value}")
        except Exception as e:  # noqa: BLE001 - a diagnostic must never fail the run
            lines.append(f"== {name} == failed: {type(e).__name__}: {e}")

    batch = next(batches)
    # Traced without the dropout key: PRNG-key values in the jaxpr trip the report's dtype checks,
    # and the matmul/conv precision it reports does not depend on dropout.
    section("precision_report", lambda: jaxmp.precision_report(
        jax.jit(lambda s, b: prog.train_step(s, b, None)), state, batch, policy=policy).summary())

    def grads():
        x, y = jaxmp.flax._losses.split_batch(batch)

        def loss_fn(params):
            logits = state.model.apply({"params": params, **state.model_state}, x, train=False)
            return jaxmp.flax.softmax_cross_entropy(logits, y)

        scale = jaxmp.get_loss_scale(state.opt_state)
        _, g = jax.jit(jaxmp.value_and_grad(loss_fn, scale))(state.params)
        g = scale.unscale(g)  # what the optimizer sees
        stats = jaxmp.gradient_stats(g, loss_scale=scale)
        stats.plot(os.path.join(workdir, "gradient_stats.png"))
        return stats.summary()

    section("gradient_stats", grads)
    section("input_pipeline_overhead", lambda: jaxmp.input_pipeline_overhead(
        lambda s, b: compiled(s, b, rng), state, batches, num_steps=pipeline_steps, has_aux=True,
        device_put=False).summary())
    with open(os.path.join(workdir, "report.txt"), "w") as fh:
        fh.write("\n\n".join(lines) + "\n")
    print("\n\n".join(lines), file=sys.stderr, flush=True)
    return out
