"""jaxmp/engine/_build.py: build, the per-signature program cache, output checks, weights and explain mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp.engine._build import build, explain_enabled, explaining, weight_mask
from jaxmp.engine._config import resolve_config
from jaxmp._jaxpr import walk

W, X = jnp.ones((3, 2)), jnp.ones((1, 3))


def test_o0_builds_a_plain_wrapper_and_other_policies_an_engine_function():
    def f(w, x):
        return x @ w

    ident = build(f, "O0")
    assert ident.__wrapped__ is f and ident(W, X).dtype == jnp.float32
    jx = jax.make_jaxpr(build(f, "O1-bf16"))(W, X)
    assert [e.params.get("new_dtype") for e in walk(jx) if e.primitive == "convert_element_type"]


def test_a_program_is_traced_once_per_signature_and_static_arguments_are_part_of_it():
    traces = []

    def f(x, n):
        traces.append(n)
        return x * n

    g = build(f, "O1-bf16")
    g(jnp.ones(2), 2), g(jnp.ones(2), 2), g(jnp.ones(2), 3), g(jnp.ones(3), 3), g(jnp.ones(2, jnp.float16), 2)
    assert traces == [2, 3, 3, 2]
    build(f, "O1-bf16")(jnp.ones(2), 2)  # rebuilt from the same function: the traced programs are shared
    assert traces == [2, 3, 3, 2]


def test_an_output_that_is_not_an_array_is_a_type_error_naming_the_function_and_the_place():
    def labelled(x):
        return {"y": x, "name": "logits"}

    with pytest.raises(TypeError, match=r"labelled .*returned a str at \['name'\]"):
        build(labelled, "O1-bf16")(jnp.ones(2))
    out = build(lambda x: (x, 3, np.int32(2), True), "O1-bf16")(jnp.ones(2))
    assert out[1] == 3 and int(out[2]) == 2 and bool(out[3])


def test_weight_mask_flags_inputs_used_only_by_half_list_ops():
    def f(w, b, x):
        return x @ w + b  # w: only a matmul operand; b: an add; x: a matmul operand too

    jx = jax.make_jaxpr(f)(W, jnp.ones(2), X)
    assert weight_mask(jx.jaxpr, resolve_config("O2-bf16", None)) == [True, False, True]

    def g(w, x):
        return x @ w, w  # also an output: not only a weight
    assert weight_mask(jax.make_jaxpr(g)(W, X).jaxpr, resolve_config("O2-bf16", None)) == [False, True]


def test_explaining_is_scoped_and_labels_ops_with_their_rule():
    assert not explain_enabled()
    with explaining():
        assert explain_enabled()
        jx = jax.make_jaxpr(build(lambda a: jnp.exp(a @ a), "O1-bf16"))(jnp.ones((2, 2)))
    assert not explain_enabled()
    names = [e.name for e in walk(jx)]
    assert any("jaxmp.rule=half list" in n for n in names) and any("jaxmp.rule=float32 list" in n for n in names)
