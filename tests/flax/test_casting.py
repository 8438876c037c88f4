"""jaxmp/flax/_casting.py: float32 rules, the enclosing float32 block, and casting a params tree by module path."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp.engine._module_rules import ModuleRule
from jaxmp.flax._casting import cast_by_path, enclosing_float32, is_float32_rule

F32, F64, BF16, F16 = (np.dtype(d) for d in ("float32", "float64", jnp.bfloat16, "float16"))


def _rule(compute, param=None):
    return ModuleRule(compute, param or compute, "input", "float32")


def test_is_float32_rule_means_32_bits_or_wider():
    assert is_float32_rule(_rule(F32)) and is_float32_rule(_rule(F64))
    assert not is_float32_rule(_rule(BF16)) and not is_float32_rule(_rule(F16))


def test_enclosing_float32_is_the_nearest_ruled_module_strictly_above():
    outer, inner = _rule(F32), _rule(F64)
    rules = {("enc",): outer, ("enc", "block"): inner}
    assert enclosing_float32(("enc", "block", "dense"), rules) is inner  # the nearest, not the outermost
    assert enclosing_float32(("enc", "other"), rules) is outer
    assert enclosing_float32(("enc", "block"), rules) is outer  # strictly above: its own rule does not count
    assert enclosing_float32(("dec", "dense"), rules) is None and enclosing_float32((), rules) is None
    assert enclosing_float32(("x",), {(): outer}) is outer  # a rule on the root covers everything below


def test_cast_by_path_takes_the_longest_ruled_prefix_and_leaves_other_leaves_alone():
    rules = {("enc",): _rule(F32), ("enc", "half"): _rule(BF16)}
    tree = {"enc": {"w": jnp.ones(2), "half": {"w": jnp.ones(2), "deep": {"w": jnp.ones(2)}}},
            "head": {"w": jnp.ones(2, F16), "count": jnp.int32(3)}, "encoder": {"w": jnp.ones(2)}}
    out = cast_by_path(tree, rules, BF16, "compute_dtype")
    assert out["enc"]["w"].dtype == F32
    assert out["enc"]["half"]["w"].dtype == BF16 and out["enc"]["half"]["deep"]["w"].dtype == BF16
    assert out["head"]["w"].dtype == BF16 and out["head"]["count"].dtype == jnp.int32
    assert out["encoder"]["w"].dtype == BF16  # a name prefix is not a path prefix
    same = tree["enc"]["w"]
    assert cast_by_path({"enc": {"w": same}}, rules, BF16, "compute_dtype")["enc"]["w"] is same  # no copy


def test_cast_by_path_reads_the_field_it_is_asked_for_and_sequence_paths():
    rules = {("layers", "1"): _rule(BF16, param=F32)}
    tree = {"layers": [{"w": jnp.ones(2, F16)}, {"w": jnp.ones(2, F16)}]}
    compute = cast_by_path(tree, rules, F16, "compute_dtype")
    storage = cast_by_path(tree, rules, F16, "param_dtype")
    assert [l["w"].dtype for l in compute["layers"]] == [F16, BF16]
    assert [l["w"].dtype for l in storage["layers"]] == [F16, F32]


def test_cast_by_path_is_differentiable_back_to_the_stored_dtype():
    rules = {("fp32",): _rule(F32)}

    def loss(p):
        c = cast_by_path(p, rules, BF16, "compute_dtype")
        return jnp.sum(c["fp32"]["w"]) + jnp.sum(c["half"]["w"]).astype(jnp.float32)

    g = jax.grad(loss)({"fp32": {"w": jnp.ones(2, BF16)}, "half": {"w": jnp.ones(2)}})
    assert g["fp32"]["w"].dtype == BF16 and g["half"]["w"].dtype == F32
    assert g["half"]["w"].tolist() == [1.0, 1.0]
