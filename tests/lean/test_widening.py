"""The declared interface between jaxmp.lean's param recipes and what they wrap
(jaxmp/lean/_widening.py): a `WidensItself` inner transformation takes the wrapper's grads and
params unwidened, with a `Widening` as its ``update``'s keyword; any other gets float32 ones."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxmp import lean
from jaxmp.diagnostics import _locate
from jaxmp.lean import _chunked, _widening
from jaxmp.lean._widening import Widening, WidensItself

BF16 = jnp.bfloat16


def _recording(widens: bool, seen: list):
    """SGD(0.5) that records the dtype of the grads it gets and the ``widening`` keyword."""
    sgd = optax.sgd(0.5)

    def update(grads, state, params=None, *, widening=None, **extra):
        seen.append((jax.tree_util.tree_leaves(grads)[0].dtype, widening))
        if widening is not None:
            treedef = jax.tree_util.tree_structure(grads)
            grads, params = widening.grads.whole(treedef), widening.params.whole(treedef)
        return sgd.update(grads, state, params)

    return (WidensItself if widens else optax.GradientTransformationExtraArgs)(sgd.init, update)


def test_quantized_moments_declares_that_it_widens_itself_and_the_others_do_not():
    assert isinstance(lean.quantized_moments(optax.adam(1e-3)), WidensItself)
    assert not isinstance(lean.bf16_moments(optax.adam(1e-3), key=0), WidensItself)
    assert not isinstance(optax.adam(1e-3), WidensItself)


@pytest.mark.parametrize("recipe", ["bf16_params", "param_remainders"])
def test_a_param_recipe_hands_a_widens_itself_inner_its_inputs_unwidened(recipe):
    params = {"w": jnp.array([1.0, -2.0, 3.0], BF16)}
    grads = {"w": jnp.array([0.5, 0.25, -1.0], BF16)}
    outs = {}
    for widens in (False, True):
        seen = []
        inner = _recording(widens, seen)
        tx = lean.bf16_params(inner, rounding="nearest") if recipe == "bf16_params" else lean.param_remainders(inner)
        state = tx.init(params)
        outs[widens] = tx.update(grads, state, params)[0]
        dtype, widening = seen[-1]
        if widens:
            # bfloat16 as the wrapper holds them, and how to widen them: the float32 grads and masters.
            assert dtype == BF16 and isinstance(widening, Widening)
            treedef = jax.tree_util.tree_structure(grads)
            assert widening.grads.whole(treedef)["w"].dtype == jnp.float32
            np.testing.assert_array_equal(widening.params.whole(treedef)["w"], params["w"].astype(jnp.float32))
        else:
            assert dtype == jnp.float32 and widening is None
    # Either way the inner update is the same arithmetic.
    np.testing.assert_array_equal(outs[True]["w"], outs[False]["w"])


def test_quantized_moments_reads_a_widening_as_the_wrappers_pass_it():
    params = {"w": jnp.linspace(-1, 1, 8192, dtype=jnp.float32).reshape(64, 128).astype(BF16)}
    grads = jax.tree_util.tree_map(lambda p: (p * 0.5).astype(BF16), params)
    tx = lean.quantized_moments(optax.sgd(1e-2, momentum=0.9), slice_size=None)
    state = tx.init(params)
    widening = Widening(_chunked.Inputs((grads,), _widening.leaf_f32), _chunked.Inputs((params,), _widening.leaf_f32))
    given, given_state = tx.update(grads, state, params, widening=widening)
    wide, wide_state = tx.update(_widening.to_f32(grads), state, _widening.to_f32(params))
    assert given["w"].dtype == jnp.float32
    np.testing.assert_array_equal(given["w"], wide["w"])
    np.testing.assert_array_equal(given_state.inner_state[0].trace["w"], wide_state.inner_state[0].trace["w"])


def test_the_lean_files_that_run_the_inner_update_are_the_debuggers_optimizer_files():
    """An op the debugger locates in a file that runs the user's optimizer is reported as the optimizer
    update; every jaxmp.lean file that calls an inner ``update`` is one (a new recipe's file too)."""
    lean_dir = pathlib.Path(lean.__file__).parent
    running = {f"lean/{f.name}" for f in lean_dir.glob("*.py") if "inner.update(" in f.read_text()}
    assert running >= {"lean/_bf16.py", "lean/_widening.py", "lean/_quantized.py"}
    assert running <= set(_locate._OPTIMIZER_FILES), running - set(_locate._OPTIMIZER_FILES)
    # ... and every file named there exists (a moved function leaves no stale name behind).
    assert all((lean_dir.parent / f).is_file() for f in _locate._OPTIMIZER_FILES)
