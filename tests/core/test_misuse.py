"""jaxmp/_misuse.py: each trace-time check on its own (marks, warnings, refusals, the constant scan)."""

import pickle
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from jaxmp import _misuse as misuse
from jaxmp._scaling._transform import LossScalingState, MasterWeightsState


@pytest.fixture
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error", misuse.MixedPrecisionWarning)
        yield


def test_scaled_marks_compare_equal_so_a_mark_never_changes_a_tree_structure():
    assert misuse.SCALED == misuse.UNSCALED and hash(misuse.SCALED) == hash(misuse.UNSCALED)
    assert misuse.SCALED != True  # noqa: E712 - a mark is not a bool
    with pytest.raises(AttributeError, match="immutable"):
        misuse.SCALED.scaled = False
    assert pickle.loads(pickle.dumps(misuse.SCALED)).scaled is True
    assert repr(misuse.UNSCALED) == "ScaledMark(False)"
    a, b = jaxmp.DynamicLossScale(), jaxmp.DynamicLossScale()
    misuse.note_scaled(a)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)


def test_note_scaled_marks_the_object_and_its_stored_original_only():
    ls, other = jaxmp.DynamicLossScale(), jaxmp.DynamicLossScale()
    assert not misuse.was_scaled(ls)
    misuse.note_scaled(ls)
    assert misuse.was_scaled(ls) and not misuse.was_scaled(other)
    copy, stored = jaxmp.DynamicLossScale(), jaxmp.DynamicLossScale()
    object.__setattr__(copy, "_jaxmp_stored", stored)
    misuse.note_scaled(copy)
    assert misuse.was_scaled(stored)
    misuse.note_scaled(object())  # no mark to set: nothing happens
    assert not misuse.was_scaled(object()) and not misuse.was_scaled(jaxmp.NoOpLossScale())
    # The mark is static data: it survives a jit round trip of the loss scale.
    assert misuse.was_scaled(jax.jit(lambda s: s)(ls))


def test_loss_scaled_grad_is_a_context_that_silences_unscaled_fp16_grad_and_restores():
    with pytest.warns(misuse.MixedPrecisionWarning, match="loss under 'O1-fp16' computes in float16"):
        assert misuse.unscaled_fp16_grad("loss under 'O1-fp16'") is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with misuse.loss_scaled_grad():
            assert misuse.unscaled_fp16_grad("x") is False
    with pytest.raises(RuntimeError), misuse.loss_scaled_grad():
        raise RuntimeError
    with pytest.warns(misuse.MixedPrecisionWarning):  # the flag was reset despite the exception
        assert misuse.unscaled_fp16_grad("x")


def test_check_gradients_refuses_integer_and_bool_leaves_by_path():
    with pytest.raises(TypeError, match=r"leaf at \['n'\] has dtype int32.*allow_int=True"):
        misuse.check_gradients({"w": jnp.ones(1), "n": jnp.int32(1)}, jaxmp.NoOpLossScale(), dynamic=False)
    with pytest.raises(TypeError, match="dtype bool"):
        misuse.check_gradients([np.array([True])], jaxmp.NoOpLossScale(), dynamic=False)


def test_check_gradients_warns_only_for_an_unmarked_dynamic_scale(no_warnings):
    # The caller says whether the scale is dynamic (a declared keyword, not the class's name).
    grads = {"w": jnp.ones(2)}
    misuse.check_gradients(grads, jaxmp.StaticLossScale(4.0), dynamic=False)
    misuse.check_gradients(grads, jaxmp.NoOpLossScale(), dynamic=False)
    marked = jaxmp.DynamicLossScale()
    misuse.note_scaled(marked)
    misuse.check_gradients(grads, marked, dynamic=True)
    warnings.simplefilter("always", misuse.MixedPrecisionWarning)
    with pytest.warns(misuse.MixedPrecisionWarning, match="never multiplied a loss: were they computed with jax.grad"):
        misuse.check_gradients(grads, jaxmp.DynamicLossScale(), dynamic=True)
    with pytest.warns(misuse.MixedPrecisionWarning, match="never multiplied a loss"):
        jaxmp.loss_scaling(optax.sgd(0.1), "dynamic").update(grads, jaxmp.loss_scaling(optax.sgd(0.1), "dynamic").init(
            grads), grads)


def test_check_loss_dtype_warns_for_a_float16_loss_with_a_scale_only(no_warnings):
    misuse.check_loss_dtype(jnp.float16(1), scaled=False)
    misuse.check_loss_dtype(jnp.bfloat16(1), scaled=True)
    misuse.check_loss_dtype(2.0, scaled=True)
    # jaxmp.value_and_grad says which: a NoOpLossScale multiplies nothing.
    jaxmp.value_and_grad(lambda w: jnp.sum(w).astype(jnp.float16), jaxmp.NoOpLossScale())(jnp.ones(2))
    warnings.simplefilter("always", misuse.MixedPrecisionWarning)
    with pytest.warns(misuse.MixedPrecisionWarning, match="the loss is float16"):
        misuse.check_loss_dtype(jnp.float16(1), scaled=True)
    with pytest.warns(misuse.MixedPrecisionWarning, match="the loss is float16"):
        jaxmp.value_and_grad(lambda w: jnp.sum(w).astype(jnp.float16), jaxmp.StaticLossScale(2.0))(jnp.ones(2))


def test_check_outermost_warns_for_optax_transforms_before_loss_scaling(no_warnings):
    params = {"w": jnp.ones(2)}
    ls = jaxmp.loss_scaling(optax.sgd(0.1), "none")
    first = optax.chain(ls, optax.scale(1.0)).init(params)
    misuse.check_outermost(first, LossScalingState)  # loss scaling first: fine
    misuse.check_outermost(ls.init(params), LossScalingState)  # not a chain
    misuse.check_outermost({"s": ls.init(params)}, LossScalingState)  # not a tuple
    # A non-optax state before it (a user's own container) is not judged.
    misuse.check_outermost(("mine", ls.init(params)), LossScalingState)
    warnings.simplefilter("always", misuse.MixedPrecisionWarning)
    before = optax.chain(optax.clip(1.0), optax.add_decayed_weights(1e-4), ls).init(params)
    with pytest.warns(misuse.MixedPrecisionWarning, match=r"2 transform\(s\) before jaxmp.loss_scaling"):
        misuse.check_outermost(before, LossScalingState)


def test_check_init_raises_on_nested_loss_scaling_and_warns_for_fp16_without_master(no_warnings):
    inner = jaxmp.loss_scaling(optax.sgd(0.1)).init({"w": jnp.ones(1)})
    with pytest.raises(ValueError, match="wraps another loss_scaling"):
        misuse.check_init({"w": jnp.ones(1)}, (inner,), LossScalingState, MasterWeightsState, scaled=True)
    half = {"a": jnp.ones(1, jnp.float16), "b": jnp.ones(1, jnp.float16), "c": jnp.ones(1)}
    master = MasterWeightsState((), {"a": jnp.ones(1)})
    misuse.check_init(half, (master,), LossScalingState, MasterWeightsState, scaled=True)
    misuse.check_init(half, (), LossScalingState, MasterWeightsState, scaled=False)
    jaxmp.loss_scaling(optax.sgd(0.1), "none").init(half)  # the transform says a NoOpLossScale scales nothing
    warnings.simplefilter("always", misuse.MixedPrecisionWarning)
    with pytest.warns(misuse.MixedPrecisionWarning, match=r"2 float16 param\(s\) \(first: \['a'\]\).*master_weights=True"):
        misuse.check_init(half, (), LossScalingState, MasterWeightsState, scaled=True)


def test_check_bf16_without_master_accepts_a_master_or_an_exact_half_keeper(no_warnings):
    params = {"w": jnp.ones(1, jnp.bfloat16)}
    misuse.check_bf16_without_master(params, (MasterWeightsState((), params),), MasterWeightsState)

    @misuse.KeepsHalfParamsExact.register
    class Rounded:  # stands for a jaxmp.lean stochastic-rounding state
        pass

    class Undeclared:  # an attribute is no declaration (the hidden channel this replaced)
        keeps_half_params_exact = True

    misuse.check_bf16_without_master(params, (Rounded(),), MasterWeightsState)
    # jaxmp.lean's states declare it: their bfloat16 params learn without a master.
    from jaxmp import lean
    assert issubclass(lean.Bf16ParamsState, misuse.KeepsHalfParamsExact)
    assert issubclass(lean.ParamRemaindersState, misuse.KeepsHalfParamsExact)
    assert not issubclass(lean.Bf16MomentsState, misuse.KeepsHalfParamsExact)
    jaxmp.loss_scaling(lean.bf16_params(optax.sgd(0.1), key=0), "none").init(params)
    misuse.check_bf16_without_master({"w": jnp.ones(1)}, (), MasterWeightsState)
    warnings.simplefilter("always", misuse.MixedPrecisionWarning)
    with pytest.warns(misuse.MixedPrecisionWarning, match="1 bfloat16 param.*master_weights=False.*jaxmp.lean"):
        misuse.check_bf16_without_master(params, (), MasterWeightsState)
    with pytest.warns(misuse.MixedPrecisionWarning, match="1 bfloat16 param"):
        misuse.check_bf16_without_master(params, (Undeclared(),), MasterWeightsState)


def _update_jaxpr(tx, params=None):
    params = params or {"w": jnp.ones(3)}
    state = tx.init(params)
    return jax.make_jaxpr(lambda g, s: tx.update(g, s, params))(params, state)


@pytest.mark.parametrize("tx", [optax.sgd(float("nan")), optax.sgd(float("inf")), optax.chain(optax.clip(1.0), optax.scale(float("nan")))],
                         ids=["sgd-nan", "sgd-inf", "chain-scale-nan"])
def test_check_update_constants_refuses_a_non_finite_learning_rate(tx):
    with pytest.raises(ValueError, match="non-finite constant .*learning rate"):
        misuse.check_update_constants(_update_jaxpr(tx))


@pytest.mark.parametrize("tx", [optax.sgd(0.1), optax.chain(optax.clip_by_global_norm(float("inf")), optax.sgd(0.1)),
                                optax.chain(optax.clip_by_block_rms(float("inf")), optax.sgd(0.1))],
                         ids=["sgd", "clip-global-inf", "clip-block-rms-inf"])
def test_check_update_constants_accepts_finite_and_guarded_infinite_constants(tx):
    misuse.check_update_constants(_update_jaxpr(tx))


def test_check_update_constants_sees_a_nan_inside_a_nested_call():
    inner = jax.jit(lambda g: g * jnp.float32(float("nan")))
    closed = jax.make_jaxpr(lambda g: inner(g))(jnp.ones(2))
    with pytest.raises(ValueError, match=r"\(nan in a mul\)"):
        misuse.check_update_constants(closed)


def test_check_inner_state_refuses_nan_anywhere_and_inf_in_hyperparameters():
    params = {"w": jnp.ones(2)}
    misuse.check_inner_state(optax.inject_hyperparams(optax.sgd)(0.1).init(params))
    misuse.check_inner_state(optax.contrib.reduce_on_plateau().init(params))  # its best value starts at inf
    with pytest.raises(ValueError, match=r"inf/NaN at .*hyperparams.*learning_rate"):
        misuse.check_inner_state(optax.inject_hyperparams(optax.sgd)(float("inf")).init(params))
    with pytest.raises(ValueError, match="inf/NaN at"):
        misuse.check_inner_state({"mu": jnp.float32(float("nan"))})
    misuse.check_inner_state({"big": jnp.full((4,), jnp.nan)})  # buffers are not read back, only scalars
