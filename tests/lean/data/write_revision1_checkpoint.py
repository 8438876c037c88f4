"""Writes tests/lean/data/revision1_checkpoint: an orbax checkpoint of an 8-bit quantized_moments
state saved by jaxmp before map revision 2 (commit 3c6e54e^, whose QuantizedMomentsState has no
``map_revision`` and whose 8-bit maps are NumPy's, a float32 ulp off the peers' at 22 signed and
26 unsigned entries). tests/lean/test_lean_edges.py restores it with today's jaxmp.

Run with that revision's jaxmp first on the path, from the repository root::

    mkdir -p /tmp/rev1 && git archive 3c6e54e^ jaxmp | tar -x -C /tmp/rev1
    PYTHONPATH=/tmp/rev1 python tests/lean/data/write_revision1_checkpoint.py
"""

import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from jaxmp import lean

OUT = pathlib.Path(__file__).resolve().parent / "revision1_checkpoint"


def main() -> None:
    assert "map_revision" not in lean.QuantizedMomentsState._fields, "run with jaxmp of commit 3c6e54e^"
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(64, 64)), jnp.float32)}   # 4096 values: quantized
    tx = lean.quantized_moments(optax.adam(1e-2))
    state = tx.init(params)
    for seed in (1, 2):
        grads = {"w": jnp.asarray(np.random.default_rng(seed).normal(size=(64, 64)), jnp.float32)}
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    shutil.rmtree(OUT, ignore_errors=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(OUT, {"params": params, "opt_state": state})
        ckptr.wait_until_finished()


if __name__ == "__main__":
    main()
