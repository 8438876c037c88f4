"""Test set-up: 8 simulated CPU devices for the parallel code, float64 off, CPU backend."""

import os

# Must happen before JAX initialises its backends.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_platforms", "cpu")


@pytest.fixture
def strict_promotion():
    """Run a test under JAX's strict dtype promotion so silent fp16/fp32 mixing fails loudly."""
    with jax.numpy_dtype_promotion("strict"):
        yield
