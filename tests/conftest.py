"""Test set-up: 8 simulated CPU devices for the parallel code, float64 off, CPU backend."""

import os

# Must happen before JAX initialises its backends.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_platforms", "cpu")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "standard_promotion(reason): the test goes through third-party code that is not strict-dtype-promotion "
        "clean (optax's Adam, Flax internals ...), so it runs under JAX's standard promotion; reason= says where",
    )


@pytest.fixture(autouse=True)
def _strict_promotion_by_default(request):
    """Every test runs under JAX's strict dtype promotion unless marked ``standard_promotion``.

    jaxmp's own code must never mix dtypes implicitly (an accidental fp16 + fp32 promotion is
    exactly the bug a mixed-precision library exists to prevent), so strict is the default; a test
    whose path crosses non-strict third-party code says so with a mark and a reason.
    """
    marker = request.node.get_closest_marker("standard_promotion")
    if marker is not None:
        if not marker.kwargs.get("reason"):
            raise pytest.UsageError(f"{request.node.nodeid}: @pytest.mark.standard_promotion needs reason='...'")
        with jax.numpy_dtype_promotion("standard"):
            yield
        return
    with jax.numpy_dtype_promotion("strict"):
        yield


@pytest.fixture
def strict_promotion():
    """Kept for readability where a test is about strict promotion (strict is already the default)."""
    with jax.numpy_dtype_promotion("strict"):
        yield
