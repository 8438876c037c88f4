"""Policies: the string grammar, presets, casting of floating leaves only, jmp drop-in, hardware advice."""

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxmp

F16, BF16, F32, F64 = (np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))
NAMES = {"f16": F16, "float16": F16, "bf16": BF16, "bfloat16": BF16, "f32": F32, "float32": F32,
         "full": F32, "f64": F64, "float64": F64, "half": F16}  # half is float16 off TPU


def _tree():
    return {
        "w": jnp.ones((2, 3), jnp.float32),
        "b16": jnp.ones(3, jnp.bfloat16),
        "step": jnp.int32(4),
        "mask": jnp.array([True, False]),
        "key": jax.random.key(0),
        "raw_key": jax.random.PRNGKey(1),
        "np": np.ones(2, np.float32),
        "py": 1.5,
        "name": "layer",
        "none": None,
    }


@pytest.mark.parametrize("name,dtype", sorted(NAMES.items()))
def test_bare_dtype_name_sets_all_three(name, dtype):
    p = jaxmp.get_policy(name)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (dtype, dtype, dtype)
    for cast in (p.cast_to_param, p.cast_to_compute, p.cast_to_output):
        out = cast(_tree())
        # JAX arrays hold float64 only with jax_enable_x64; numpy arrays always can.
        assert out["w"].dtype == out["b16"].dtype == jax.dtypes.canonicalize_dtype(dtype)
        assert out["np"].dtype == dtype


@pytest.mark.parametrize("name,dtype", sorted(NAMES.items()))
@pytest.mark.parametrize("keys", [("params", "compute", "output"), ("p", "c", "o")])
def test_keyed_grammar_every_name(name, dtype, keys):
    p = jaxmp.get_policy(f"{keys[0]}=f32,{keys[1]}={name},{keys[2]}=bf16")
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (F32, dtype, BF16)
    tree = _tree()
    assert p.cast_to_param(tree)["w"].dtype == F32
    assert p.cast_to_compute(tree)["w"].dtype == jax.dtypes.canonicalize_dtype(dtype)
    assert p.cast_to_output(tree)["b16"].dtype == BF16


def test_grammar_defaults_follow_jmp():
    # params default f32, compute follows params, output follows compute.
    assert str(jaxmp.get_policy("c=bf16")) == "p=f32,c=bf16,o=bf16"
    assert str(jaxmp.get_policy("p=f16")) == "p=f16,c=f16,o=f16"
    assert str(jaxmp.get_policy("o=f16")) == "p=f32,c=f32,o=f16"
    for s in ("c=bf16", "p=f16", "p=f16,c=f16", "p=f16,c=bf16", "p=f32,c=f16,o=f32", "half", "full"):
        ours, theirs = jaxmp.get_policy(s), jmp.get_policy(s)
        assert (ours.param_dtype, ours.compute_dtype, ours.output_dtype) == (
            theirs.param_dtype, theirs.compute_dtype, theirs.output_dtype)
        assert str(ours) == str(theirs).replace("full", "f32")


def test_non_floating_leaves_pass_through_unchanged():
    tree = _tree()
    out = jaxmp.get_policy("half").cast_to_compute(tree)
    for k in ("step", "mask", "key", "raw_key", "py", "name", "none"):
        assert out[k] is tree[k], k
    float0 = np.zeros((2,), dtype=jax.dtypes.float0)
    assert jaxmp.cast_floating(float0, jnp.float16) is float0


def test_with_output_dtype_and_str():
    p = jaxmp.get_policy("p=f32,c=f16").with_output_dtype(jnp.float32)
    assert str(p) == "p=f32,c=f16,o=f32" and p.uses_half
    assert not jaxmp.get_policy("f32").uses_half


@pytest.mark.parametrize("name,expected,master,scale,fp32", [
    ("O0", "p=f32,c=f32,o=f32", False, "none", ()),
    ("O1", "p=f32,c=f16,o=f32", False, "dynamic", ("norm", "softmax", "loss")),
    ("O2", "p=f16,c=f16,o=f32", True, "dynamic", ("norm", "loss")),
    ("O3", "p=f16,c=f16,o=f16", False, "none", ()),
    ("O1-bf16", "p=f32,c=bf16,o=f32", False, "none", ("norm", "softmax", "loss")),
    ("O2-bf16", "p=bf16,c=bf16,o=f32", True, "none", ("norm", "loss")),
    ("O2_fp16", "p=f16,c=f16,o=f32", True, "dynamic", ("norm", "loss")),
    ("o3-bf16", "p=bf16,c=bf16,o=bf16", False, "none", ()),
    ("float32", "p=f32,c=f32,o=f32", False, "none", ()),
    ("mixed_float16", "p=f32,c=f16,o=f32", False, "dynamic", ("norm", "softmax", "loss")),
    ("mixed_bfloat16", "p=f32,c=bf16,o=f32", False, "none", ("norm", "softmax", "loss")),
])
def test_presets(name, expected, master, scale, fp32):
    assert str(jaxmp.get_policy(name)) == expected
    r = jaxmp.get_recipe(name)
    assert (str(r.policy), r.master_weights, r.loss_scale, r.keep_float32) == (expected, master, scale, fp32)
    assert isinstance(jaxmp.make_loss_scale(r.loss_scale),
                      jaxmp.DynamicLossScale if scale == "dynamic" else jaxmp.NoOpLossScale)


def test_jmp_drop_in_names_and_policy_acceptance():
    for name in ("Policy", "get_policy", "half_dtype", "NoOpLossScale", "StaticLossScale", "DynamicLossScale",
                 "all_finite", "select_tree", "cast_to_full", "cast_to_half", "LossScale"):
        assert hasattr(jaxmp, name), name
    p = jaxmp.as_policy(jmp.get_policy("p=f32,c=bf16,o=f32"))
    assert isinstance(p, jaxmp.Policy) and p.compute_dtype == BF16
    # jmp-style construction with scalar types and comparison against them.
    q = jaxmp.Policy(jnp.float32, jnp.float16, jnp.float32)
    assert q.compute_dtype == jnp.float16 and q == jaxmp.get_policy("p=f32,c=f16,o=f32")
    assert jaxmp.half_dtype() == jmp.half_dtype()
    assert jaxmp.cast_to_half(jnp.ones(2)).dtype == jmp.half_dtype()
    assert jaxmp.cast_to_full(jnp.ones(2, jnp.bfloat16)).dtype == F32


@pytest.mark.parametrize("platform,cc,expected,scale", [
    ("tpu", None, "p=f32,c=bf16,o=f32", "none"),
    ("gpu", "9.0", "p=f32,c=bf16,o=f32", "none"),
    ("gpu", "8.0", "p=f32,c=bf16,o=f32", "none"),
    ("gpu", "7.5", "p=f32,c=f16,o=f32", "dynamic"),
    ("gpu", "7.0", "p=f32,c=f16,o=f32", "dynamic"),
    ("gpu", "6.0", "p=f32,c=f32,o=f32", "none"),
    ("cpu", None, "p=f32,c=f32,o=f32", "none"),
])
def test_recommended_policy(platform, cc, expected, scale):
    rec = jaxmp.recommended_policy(platform=platform, compute_capability=cc)
    assert str(rec.policy) == expected and rec.recipe.loss_scale == scale
    assert isinstance(rec.reason, str) and len(rec.reason) > 20
    if cc:
        assert cc in rec.reason


def test_recommended_policy_for_this_machine_is_fp32_on_cpu():
    rec = jaxmp.recommended_policy()
    assert str(rec.policy) == "p=f32,c=f32,o=f32" and "cpu" in rec.reason.lower()


# ---------------------------------------------------------------------------------------------
# Property-based tests.

_dtype_names = st.sampled_from(sorted(NAMES))


@settings(max_examples=80, deadline=None)
@given(p=st.one_of(st.none(), _dtype_names), c=st.one_of(st.none(), _dtype_names),
       o=st.one_of(st.none(), _dtype_names), short=st.booleans(), order=st.permutations([0, 1, 2]))
def test_grammar_property(p, c, o, short, order):
    keys = ("p", "c", "o") if short else ("params", "compute", "output")
    parts = [f"{keys[i]}={v}" for i, v in zip(range(3), (p, c, o)) if v is not None]
    if not parts:
        return
    parts = [parts[i] for i in order if i < len(parts)]
    pol = jaxmp.get_policy(",".join(parts))
    want_p = NAMES[p] if p else F32
    want_c = NAMES[c] if c else want_p
    want_o = NAMES[o] if o else want_c
    assert (pol.param_dtype, pol.compute_dtype, pol.output_dtype) == (want_p, want_c, want_o)


_leaf = st.one_of(
    st.sampled_from([jnp.float16, jnp.bfloat16, jnp.float32]).map(lambda d: jnp.ones((2,), d)),
    st.sampled_from([np.float16, np.float32, np.float64]).map(lambda d: np.zeros((1, 2), d)),
    st.integers(-5, 5).map(jnp.int32),
    st.booleans().map(jnp.asarray),
    st.integers(0, 3).map(jax.random.key),
    st.floats(allow_nan=False, width=32),
    st.text(max_size=3),
    st.none(),
)
_trees = st.recursive(_leaf, lambda kids: st.one_of(st.lists(kids, max_size=3),
                                                    st.dictionaries(st.text("abc", min_size=1, max_size=2), kids, max_size=3)),
                      max_leaves=8)


@settings(max_examples=60, deadline=None)
@given(tree=_trees, target=st.sampled_from([jnp.float16, jnp.bfloat16, jnp.float32]))
def test_cast_property(tree, target):
    out = jaxmp.cast_floating(tree, target)
    leaves_in = jax.tree_util.tree_leaves(tree)
    leaves_out = jax.tree_util.tree_leaves(out)
    assert jax.tree_util.tree_structure(tree) == jax.tree_util.tree_structure(out)
    for a, b in zip(leaves_in, leaves_out):
        if isinstance(a, (np.ndarray, jax.Array)) and jnp.issubdtype(a.dtype, jnp.floating):
            assert b.dtype == np.dtype(target) and b.shape == a.shape
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        else:
            assert b is a


class _FakeDevice:
    def __init__(self, platform, cc=None):
        self.platform, self.compute_capability, self.device_kind = platform, cc, platform


@pytest.mark.parametrize("platform,cc,expected", [("tpu", None, BF16), ("gpu", "9.0", BF16), ("gpu", "8.0", BF16),
                                                  ("gpu", "7.5", F16), ("cpu", None, F16)])
def test_preset_half_follows_the_hardware(platform, cc, expected):
    assert jaxmp._precision._presets.preset_half_dtype(_FakeDevice(platform, cc)) == expected


@pytest.mark.parametrize("dtypes", [(None, None, None), (jnp.float32, None, jnp.float32)])
def test_a_missing_dtype_is_refused_not_read_as_float64(dtypes):
    """Issue 37 item 4: ``Policy(None, None, None)`` was ``Policy(float64, float64, float64)``
    (``np.dtype(None)`` is float64)."""
    with pytest.raises(TypeError, match=r"_dtype must be a floating dtype .*got None: pass one"):
        jaxmp.Policy(*dtypes)
