"""jaxmp/fp8/_recipes.py: the two recipes' fields and checks, Fp8Recipe, init_meta and describe."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp._formats import E4M3, E5M2
from jaxmp.fp8._recipes import CurrentScaling, DelayedScaling, Fp8Meta, Fp8Recipe, _ScalingRecipe, describe


def test_defaults_are_transformer_engines():
    d = DelayedScaling()
    assert (d.history_length, d.reduction, d.margin, d.fwd_dtype, d.bwd_dtype, d.emulate) == \
        (1024, "max", 0.0, E4M3, E5M2, None)
    c = CurrentScaling(margin=1, fwd_dtype="float8_e5m2")
    assert c.margin == 1.0 and type(c.margin) is float and c.fwd_dtype == E5M2


def test_the_recipes_are_distinct_types_under_one_union():
    c, d = CurrentScaling(), DelayedScaling()
    assert isinstance(c, Fp8Recipe) and isinstance(d, Fp8Recipe)
    assert not isinstance(d, CurrentScaling) and not isinstance(c, DelayedScaling)
    with pytest.raises(TypeError, match="use jaxmp.fp8.CurrentScaling or jaxmp.fp8.DelayedScaling"):
        _ScalingRecipe()
    # Frozen and hashable: a recipe is static configuration (a jit cache key).
    assert hash(c) == hash(CurrentScaling()) and c == CurrentScaling()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.margin = 2.0


@pytest.mark.parametrize("kwargs,error,match", [
    ({"emulate": "yes"}, ValueError, "emulate must be None, True or False, got 'yes'"),
    ({"margin": -1}, ValueError, "margin must be a finite number >= 0"),
    ({"fwd_dtype": jnp.bfloat16}, ValueError, "fwd_dtype must be an fp8 dtype"),
    ({"bwd_dtype": "e5m2"}, TypeError, "bwd_dtype must be an fp8 dtype"),
    ({"history_length": 0}, ValueError, "history_length must be an int >= 1, got 0"),
    ({"history_length": True}, ValueError, "history_length must be an int >= 1, got True"),
    ({"history_length": 16.0}, ValueError, "history_length must be an int >= 1, got 16.0"),
    ({"reduction": "mean"}, ValueError, r"reduction must be one of \('max', 'most_recent'\), got 'mean'")])
def test_bad_fields_are_refused_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        DelayedScaling(**kwargs)


def test_init_meta_is_scale_one_and_a_zero_history_of_the_recipes_length():
    meta = DelayedScaling(history_length=np.int64(8)).init_meta()
    assert isinstance(meta, Fp8Meta)
    assert meta.scale.dtype == jnp.float32 and float(meta.scale) == 1.0 and meta.scale.shape == ()
    assert meta.amax_history.shape == (8,) and meta.amax_history.dtype == jnp.float32
    assert not np.any(np.asarray(meta.amax_history))


def test_describe_names_the_formats_and_the_kind_of_scaling():
    assert describe(DelayedScaling(fwd_dtype=E5M2)) == \
        "half list, fp8 (float8_e5m2 forward, float8_e5m2 backward, delayed scaling)"
    assert describe(CurrentScaling()).endswith("current scaling)")
    with pytest.raises(TypeError, match="got NoneType"):
        describe(None)
