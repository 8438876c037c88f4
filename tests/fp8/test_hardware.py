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
    with pytest.raises(ValueError, match="only on Blackwell.*JAX >= 0.12.*opt in with emulate=True"):
        check_hardware(mx, _gpu("9.0", "H100"))  # fp8 Tensor Cores, but no block-scaled GEMMs
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
