"""jaxmp/fp8/_hardware.py: where fp8 is native, and what each recipe's ``emulate`` allows where."""

from types import SimpleNamespace

import pytest

from jaxmp import fp8
from jaxmp.fp8._hardware import check_hardware, native_fp8


def _gpu(cc, kind="NVIDIA X"):
    return SimpleNamespace(platform="gpu", compute_capability=cc, device_kind=kind)


@pytest.mark.parametrize("cc,native", [("8.9", True), ("9.0", True), ("10.0", True), ("8.6", False),
                                       ("8.0", False), ("7.5", False)])
def test_native_fp8_from_compute_capability_8_9(cc, native):
    ok, reason = native_fp8(_gpu(cc))
    assert ok is native and f"compute capability {cc}" in reason
    assert ("needs >= 8.9" in reason) is (not native)


def test_native_fp8_elsewhere_is_emulated_with_the_reason():
    assert native_fp8() == (False, "cpu has no fp8 Tensor Cores: fp8 is emulated (fp8 rounding, matmul in the "
                                   "operand dtype)")
    ok, reason = native_fp8(SimpleNamespace(platform="tpu"))
    assert not ok and reason.startswith("tpu has no fp8 Tensor Cores")
    ok, reason = native_fp8(_gpu(None, "Mystery GPU"))
    assert not ok and "Mystery GPU: compute capability unknown (None)" in reason


@pytest.mark.parametrize("recipe", [fp8.CurrentScaling(), fp8.DelayedScaling(history_length=4)])
def test_check_hardware_default_emulate_runs_native_on_fp8_gpus_emulated_on_cpu_and_refuses_elsewhere(recipe):
    assert check_hardware(recipe, _gpu("9.0")) == "native"
    assert check_hardware(recipe) == "emulated"  # the CPU the tests run on
    with pytest.raises(ValueError, match="not supported natively here.*opt in with emulate=True"):
        check_hardware(recipe, _gpu("8.0"))
    with pytest.raises(ValueError, match="opt in with emulate=True"):
        check_hardware(recipe, SimpleNamespace(platform="tpu"))


def test_check_hardware_honours_an_explicit_emulate():
    emulate, native_only = fp8.CurrentScaling(emulate=True), fp8.CurrentScaling(emulate=False)
    assert check_hardware(emulate, _gpu("9.0")) == "emulated"
    assert check_hardware(emulate, _gpu("7.0")) == "emulated"
    assert check_hardware(emulate, SimpleNamespace(platform="tpu")) == "emulated"
    assert check_hardware(native_only, _gpu("9.0")) == "native"
    with pytest.raises(ValueError, match="emulate=False needs fp8 Tensor Cores: cpu has no fp8 Tensor Cores"):
        check_hardware(native_only)


def test_check_hardware_refuses_what_is_not_a_recipe():
    with pytest.raises(TypeError, match="expected a jaxmp.fp8 recipe .*got str"):
        check_hardware("delayed")


def test_block_scaled_recipes_are_native_only_on_blackwell_with_jax_0_12(monkeypatch):
    import jax.numpy as jnp
    import jaxmp
    from jaxmp.fp8 import _hardware

    mx, nvfp4 = jaxmp.get_recipe("O2-mxfp8").fp8, jaxmp.get_recipe("O2-nvfp4").fp8
    assert check_hardware(mx) == "emulated" and check_hardware(nvfp4) == "emulated"  # CPU
    on_h100 = check_hardware(mx, _gpu("9.0", "H100"))  # fp8 Tensor Cores, but no block-scaled GEMMs
    assert on_h100 == "emulated" and "only on Blackwell" in on_h100.reason and "JAX >= 0.12" in on_h100.reason
    assert check_hardware(fp8.CurrentScaling(), _gpu("9.0", "H100")) == "native"  # per-tensor fp8 is
    monkeypatch.setattr(_hardware, "_jax_version", lambda: (0, 10))
    ok, reason = _hardware.native_block(mx, _gpu("10.0", "B200"))
    assert not ok and "has no block-scaled GEMM" in reason and "no faster than bf16" in reason
    monkeypatch.setattr(_hardware, "_jax_version", lambda: (0, 12))
    assert check_hardware(mx, _gpu("10.0", "B200")) == "native"
    ok, reason = _hardware.native_block(nvfp4, _gpu("10.0", "B200"))
    assert not ok and "only MXFP8" in reason  # NVFP4 stays emulated (JAX's has no second-level scale by default)
    floor = fp8.CurrentScaling(block=(1, 32), bwd_dtype=jnp.float8_e4m3fn, scale_format="e8m0", scale_rule="floor")
    assert not _hardware.native_block(floor, _gpu("10.0", "B200"))[0]  # JAX rounds scales up: not the floor rule
    with pytest.raises(ValueError, match="emulate=False needs native block-scaled matmuls"):
        check_hardware(fp8.CurrentScaling(block=(1, 32), scale_format="e8m0", scale_rule="rceil", emulate=False))


# -- issue 59, item 14: a platform name is a device description ------------------------------

def test_check_hardware_takes_a_platform_name_and_names_what_to_pass_otherwise():
    recipe = fp8.CurrentScaling()
    assert check_hardware(recipe, "cpu") == check_hardware(recipe, " CPU ") == "emulated"
    assert check_hardware(recipe, "cpu").reason == native_fp8()[1]
    with pytest.raises(ValueError, match="tpu has no fp8 Tensor Cores"):  # no TPU here: the name stands for one
        check_hardware(recipe, "tpu")
    with pytest.raises(ValueError, match="compute capability unknown"):  # "gpu" alone: which GPU is not known
        check_hardware(recipe, "cuda")
    assert check_hardware(fp8.CurrentScaling(emulate=True), "gpu") == "emulated"
    with pytest.raises(ValueError, match=r"unknown platform 'cpux': pass one of \['cpu', 'cuda', 'gpu'"):
        check_hardware(recipe, "cpux")
    with pytest.raises(TypeError, match=r"device must be a jax.Device .*a platform name .*got int"):
        check_hardware(recipe, 0)


# -- issue 59, item 16: block formats off Blackwell run emulated, say why and what it costs, and
# every way out keeps the recipe (as code that runs when pasted) --------------------------------

_BLOCK_PRESETS = ("O2-mxfp8", "O2-fp8-rowwise", "O2-fp8-block128", "O2-nvfp4")


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    from jaxmp.fp8 import _hardware

    monkeypatch.setattr(_hardware, "_WARNED", set(), raising=False)  # the doors warn once per recipe and device


def _pasted(message: str):
    """The ``rules=...`` a message proposes, run as pasted."""
    import jax.numpy as jnp
    import jaxmp
    import re

    code = re.search(r"rules=(jaxmp\.AutocastRules\(.*\)\)) to jaxmp\.autocast", message).group(1)
    return eval(code, {"jaxmp": jaxmp, "jnp": jnp})


@pytest.mark.parametrize("name", _BLOCK_PRESETS)
@pytest.mark.parametrize("kind", ["NVIDIA H100 80GB HBM3", "NVIDIA H200"])
def test_block_presets_on_hopper_run_emulated_with_the_reason_the_cost_and_one_warning_that_keeps_the_recipe(
        name, kind, monkeypatch, recwarn):
    import dataclasses
    import warnings

    import jaxmp
    from jaxmp.fp8 import _hardware

    recipe = jaxmp.get_recipe(name).fp8
    hopper = _gpu("9.0", kind)
    verdict = check_hardware(recipe, hopper)
    assert verdict == "emulated" and kind in verdict.reason and "only on Blackwell" in verdict.reason
    assert "slower than bf16" in verdict.cost and verdict.platform == "gpu"
    monkeypatch.setattr(_hardware, "_first_device", lambda: hopper)  # the doors check the first device
    with pytest.warns(jaxmp.MixedPrecisionWarning, match="runs emulated here.*Cost: .*slower than bf16") as caught:
        _hardware.check_for_run(recipe)
    assert len(caught) == 1 and caught[0].filename == __file__  # pointed at the caller, not at jaxmp
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _hardware.check_for_run(recipe)  # said once: not again for the same recipe on the same device
    rules = _pasted(str(caught[0].message))
    assert rules.fp8_matmuls == dataclasses.replace(recipe, emulate=True)  # the recipe kept, opted in
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the pasted way out runs it emulated, silently
        assert _hardware.check_for_run(rules.fp8_matmuls) == "emulated"
    # Per-tensor fp8 runs natively there; on an A100 it is refused, and that way out keeps it too.
    assert check_hardware(jaxmp.get_recipe("O2-fp8-current").fp8, hopper) == "native"
    a100 = _gpu("8.0", "NVIDIA A100")
    with pytest.raises(ValueError, match="opt in with emulate=True, keeping the recipe") as refused:
        check_hardware(fp8.CurrentScaling(margin=1.0), a100)
    kept = _pasted(str(refused.value)).fp8_matmuls
    assert kept == fp8.CurrentScaling(margin=1.0, emulate=True) and check_hardware(kept, a100) == "emulated"


def test_the_doors_warn_once_on_hopper_and_the_pasted_rules_run_the_block_recipe(monkeypatch):
    import warnings

    import jax.numpy as jnp
    import jaxmp
    from jaxmp.fp8 import _hardware

    monkeypatch.setattr(_hardware, "_first_device", lambda: _gpu("9.0", "NVIDIA H100"))
    x, w = jnp.linspace(-1, 1, 2 * 64).reshape(2, 64), jnp.linspace(-1, 1, 64 * 3).reshape(64, 3)

    def f(x, w):
        return x @ w

    with pytest.warns(jaxmp.MixedPrecisionWarning, match="runs emulated here") as caught:
        warned = jaxmp.autocast(f, "O2-mxfp8")(x, w)
    assert len(caught) == 1
    rules = _pasted(str(caught[0].message))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pasted = jaxmp.autocast(f, "O2-mxfp8", rules=rules)(x, w)
    # Still MXFP8 (not a per-tensor recipe in its place): bit-equal, and unlike bf16 and per-tensor fp8.
    assert (pasted == warned).all()
    assert not (pasted == jaxmp.autocast(f, "O2-bf16")(x, w)).all()
    assert not (pasted == jaxmp.autocast(f, "O2-fp8-current", rules=_pasted(
        _hardware.way_out(fp8.CurrentScaling())))(x, w)).all()
    # The Flax door: the same warning when the model is wrapped, and the same pasted rules silence it.
    import flax.linen as nn
    import jaxmp.flax

    with pytest.warns(jaxmp.MixedPrecisionWarning, match="runs emulated here") as caught:
        jaxmp.flax.mixed_precision(nn.Dense(3), "O2-nvfp4")
    assert len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = jaxmp.flax.mixed_precision(nn.Dense(3), "O2-nvfp4", rules=_pasted(str(caught[0].message)))
    assert model.rules.fp8_matmuls == jaxmp.fp8.CurrentScaling(**{
        **{f: getattr(jaxmp.get_recipe("O2-nvfp4").fp8, f) for f in ("fwd_dtype", "bwd_dtype", "block", "rhs_block",
                                                                      "scale_format", "stochastic_rounding", "hadamard")},
        "emulate": True})


def test_autocast_refuses_delayed_scaling_through_one_fp8_helper():
    """Delayed scaling reaches autocast from its rules or its preset; both refusals are fp8's one
    text, naming where it came from and the current-scaling spelling of that place."""
    import pathlib
    import re

    import jax.numpy as jnp

    import jaxmp
    from jaxmp.fp8._hardware import refuse_delayed_in_a_function

    refuse_delayed_in_a_function(None, "x", "y")
    refuse_delayed_in_a_function(fp8.CurrentScaling(), "x", "y")  # current scaling passes
    with pytest.raises(ValueError, match=r"^here: delayed fp8 scaling .* use 'that' here \(current scaling\)"):
        refuse_delayed_in_a_function(fp8.DelayedScaling(), "here", "'that'")
    f, x = (lambda a: a @ a), jnp.ones((2, 2))
    rules = jaxmp.AutocastRules(fp8_matmuls=fp8.DelayedScaling())
    with pytest.raises(ValueError) as from_rules:
        jaxmp.autocast(f, "O1-bf16", rules=rules)(x)
    with pytest.raises(ValueError) as from_preset:
        jaxmp.autocast(f, "O2-fp8")(x)
    assert str(from_rules.value).startswith("AutocastRules.fp8_matmuls: delayed fp8 scaling keeps amax histories")
    assert "use rules=jaxmp.AutocastRules(fp8_matmuls=jaxmp.fp8.CurrentScaling()) here" in str(from_rules.value)
    assert str(from_preset.value).startswith("O2-fp8: delayed fp8 scaling keeps amax histories")
    assert "use 'O2-fp8-current' here" in str(from_preset.value)
    # The pasted way out runs.
    out = jaxmp.autocast(f, "O1-bf16", rules=jaxmp.AutocastRules(fp8_matmuls=jaxmp.fp8.CurrentScaling()))(x)
    assert out.shape == (2, 2) and jaxmp.autocast(f, "O2-fp8-current")(x).shape == (2, 2)
    # The engine's config holds no refusal text of its own.
    config = (pathlib.Path(jaxmp.__file__).parent / "engine" / "_config.py").read_text()
    assert not re.search(r"DelayedScaling|amax histor", config)
