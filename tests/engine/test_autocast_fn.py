"""jaxmp/engine/_autocast_fn.py: the two public ways to build an engine function, autocast and engine_function."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
from jaxmp.engine import _contract as contract
from jaxmp.engine._config import resolve_config
from jaxmp.engine._autocast_fn import autocast, engine_function

W, X = jnp.ones((3, 2)), jnp.ones((1, 3))


def test_autocast_is_the_public_jaxmp_autocast_with_fn_s_name():
    assert jaxmp.autocast is autocast

    def matmul(w, x):
        return x @ w

    f = autocast(matmul, "O1-bf16")
    assert f.__name__ == "matmul" and f(W, X).dtype == jnp.float32
    assert autocast(matmul, "O3-bf16")(W, X).dtype == jnp.bfloat16


def test_engine_function_honours_cast_outputs_and_cache():
    cfg = resolve_config("O1-bf16", None)
    raw = engine_function(lambda w, x: x @ w, cfg, cast_outputs=False)
    assert raw(W, X).dtype == jnp.bfloat16
    assert engine_function(lambda w, x: x @ w, cfg)(W, X).dtype == jnp.float32
    traces = []

    def f(w, x):
        traces.append(1)
        return x @ w

    cached, uncached = engine_function(f, cfg), engine_function(f, cfg, cache=False)
    cached(W, X), cached(W, X)
    assert len(traces) == 1
    uncached(W, X), uncached(W, X)
    assert len(traces) == 3  # traced on every call, as module.apply runs


def test_both_entries_start_the_canary_once(monkeypatch):
    calls = []
    monkeypatch.setattr(contract, "run_canary_once", lambda: calls.append(1))
    autocast(lambda x: x, "O1-bf16")
    engine_function(lambda x: x, resolve_config("O1-bf16", None))
    assert calls == [1, 1]


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="autocast expects a callable"):
        autocast(np.ones(2), "O1-bf16")
    with pytest.raises(TypeError, match="rules must be a jaxmp.AutocastRules"):
        autocast(lambda x: x, "O1-bf16", rules="fp32")
