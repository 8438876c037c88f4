"""jaxmp/_precision/_platform.py: recommended_policy's choice per platform and compute capability, and its refusals."""

import jax
import pytest

from jaxmp._precision._platform import Recommendation, recommended_policy


@pytest.mark.parametrize("cc,recipe,policy", [
    ("9.0", "mixed_bfloat16", "p=f32,c=bf16,o=f32"), ("8.0", "mixed_bfloat16", "p=f32,c=bf16,o=f32"),
    (8.6, "mixed_bfloat16", "p=f32,c=bf16,o=f32"), ("7.5", "mixed_float16", "p=f32,c=f16,o=f32"),
    ("7.0", "mixed_float16", "p=f32,c=f16,o=f32"), ("6.1", "float32", "p=f32,c=f32,o=f32"),
    ("12", "mixed_bfloat16", "p=f32,c=bf16,o=f32")])
def test_gpus_get_bf16_from_ampere_fp16_on_volta_and_float32_before(cc, recipe, policy):
    rec = recommended_policy(platform="gpu", compute_capability=cc)
    assert isinstance(rec, Recommendation) and rec.recipe.name == recipe and str(rec.policy) == policy
    assert f"compute capability {cc}" in rec.reason
    assert (rec.recipe.loss_scale == "dynamic") == (recipe == "mixed_float16")


@pytest.mark.parametrize("platform", ["cuda", "CUDA", "rocm"])
def test_every_gpu_platform_spelling_is_a_gpu(platform):
    assert recommended_policy(platform=platform, compute_capability="8.0").recipe.name == "mixed_bfloat16"


def test_tpu_and_cpu():
    tpu = recommended_policy(platform="TPU")
    assert tpu.recipe.name == "mixed_bfloat16" and "no loss scaling" in tpu.reason
    cpu = recommended_policy(platform="cpu")
    assert cpu.recipe.name == "float32" and str(cpu.policy) == "p=f32,c=f32,o=f32"


def test_the_default_device_and_a_given_device_are_read():
    device = jax.devices()[0]  # the tests run on CPU
    assert recommended_policy().recipe.name == "float32"
    rec = recommended_policy(device)
    assert rec.recipe.name == "float32" and rec.reason.startswith(device.device_kind)
    # platform= overrides the device's own.
    assert recommended_policy(device, platform="tpu").recipe.name == "mixed_bfloat16"


def test_bad_inputs_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match="unknown platform 'metal': expected cpu, gpu or tpu"):
        recommended_policy(platform="metal")
    with pytest.raises(ValueError, match="cannot tell the compute capability of gpu; pass compute_capability="):
        recommended_policy(platform="gpu")
    with pytest.raises(ValueError, match="compute_capability must look like '8.0', got 'ampere'"):
        recommended_policy(platform="gpu", compute_capability="ampere")


def test_a_platform_name_given_as_the_device_is_refused_with_the_keyword_to_use():
    # recommended_policy("gpu") reads naturally but "gpu" lands in `device`.
    with pytest.raises(TypeError, match=r"device must be a jax.Device, got the str 'gpu': .*platform='gpu'"):
        recommended_policy("gpu")
    with pytest.raises(TypeError, match=r"platform must be a str \('cpu', 'gpu' or 'tpu'\), got int"):
        recommended_policy(platform=3)
