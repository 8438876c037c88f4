"""Input-pipeline overhead: the two-loop method, with a fake clock (exact) and real sleeps (loose)."""

import math
import time

import jax
import jax.numpy as jnp
import pytest

import jaxmp


class FakeClock:
    """A clock that only moves when the iterator yields or the step runs."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_exact_fractions_with_a_fake_clock():
    clock = FakeClock()
    drawn = []

    def batches():
        i = 0
        while True:
            clock.now += 1.0          # 1 s of data loading per batch
            drawn.append(i)
            yield i
            i += 1

    seen_in_model_loop = []

    def step(state, batch):
        clock.now += 3.0              # 3 s of compute per step
        seen_in_model_loop.append(batch)
        return state + 1

    ov = jaxmp.input_pipeline_overhead(step, 0, batches(), num_steps=10, warmup=2, device_put=False,
                                       timer=clock)
    assert ov.total_time == 40.0 and ov.model_time == 30.0 and ov.exposed_time == 10.0
    assert ov.exposed_fraction == 0.25 and ov.max_speedup == 4.0
    # Faster compute only shrinks the model part: 2x compute -> 40 / (10 + 15).
    assert ov.projected_speedup(2.0) == pytest.approx(40 / 25)
    assert len(drawn) == 2 + 10   # warm-up batches are drawn but not timed
    # The model loop reuses the last warm-up batch (index 1) every time.
    assert seen_in_model_loop[-10:] == [1] * 10
    assert "25.0%" in ov.summary() and "4.00x" in ov.summary()
    assert ov.to_dict()["max_speedup"] == 4.0


def test_repeats_keep_the_minimum_and_state_is_threaded_with_aux():
    clock = FakeClock()
    # warm-up, preloaded warm-up, then per repeat: 3 real-data steps and 3 preloaded steps.
    costs = iter([9.0, 9.0] + [4.0] * 3 + [3.0] * 3 + [5.0] * 3 + [1.0] * 3)
    states = []

    def step(state, batch):
        clock.now += next(costs)
        states.append(state)
        return state + 1, {"loss": float(state)}

    ov = jaxmp.input_pipeline_overhead(step, 0, iter(range(100)), num_steps=3, warmup=1, repeats=2,
                                       has_aux=True, device_put=False, timer=clock)
    assert states == list(range(14))  # every step got the previous step's state
    assert ov.total_time == 12.0 and ov.model_time == 3.0  # min over repeats, each loop separately
    assert ov.exposed_fraction == 0.75


def test_nothing_exposed_means_unbounded_speedup():
    clock = FakeClock()

    def step(state, batch):
        clock.now += 1.0
        return state

    ov = jaxmp.input_pipeline_overhead(step, 0, iter(range(100)), num_steps=4, device_put=False, timer=clock)
    assert ov.exposed_fraction == 0.0 and math.isinf(ov.max_speedup)
    assert ov.to_dict()["max_speedup"] is None and "unbounded" in ov.summary()


def test_slow_iterator_is_mostly_exposed():
    @jax.jit
    def step(state, batch):
        return state + jnp.sum(batch)

    def slow_batches():
        while True:
            time.sleep(0.02)
            yield jnp.ones((8, 8))

    ov = jaxmp.input_pipeline_overhead(step, jnp.float32(0), slow_batches(), num_steps=8)
    # ~20 ms of sleep against a tiny jitted step: most of the time is waiting for data.
    assert 0.5 < ov.exposed_fraction <= 1.0
    assert 1.0 <= ov.max_speedup < 2.0
    assert ov.total_time >= 8 * 0.02


def test_fast_iterator_with_slow_step_is_mostly_compute():
    data = [jnp.full((4,), float(i)) for i in range(20)]

    def step(state, batch):
        time.sleep(0.02)              # a host-side "model" that costs 20 ms
        return state + batch.sum()

    ov = jaxmp.input_pipeline_overhead(step, jnp.float32(0), data, num_steps=8, warmup=1)
    assert ov.exposed_fraction < 0.5
    assert ov.model_time >= 8 * 0.02


def test_bad_inputs_raise_clear_errors():
    step = lambda s, b: s
    with pytest.raises(TypeError, match="step_fn"):
        jaxmp.input_pipeline_overhead("step", 0, iter(range(10)))
    with pytest.raises(ValueError, match="num_steps"):
        jaxmp.input_pipeline_overhead(step, 0, iter(range(10)), num_steps=0)
    with pytest.raises(ValueError, match="warmup"):
        jaxmp.input_pipeline_overhead(step, 0, iter(range(10)), num_steps=1, warmup=0)
    with pytest.raises(TypeError, match="batches"):
        jaxmp.input_pipeline_overhead(step, 0, 5, num_steps=1)
    with pytest.raises(ValueError, match="ran out after 5 batches.*needs 12"):
        jaxmp.input_pipeline_overhead(step, 0, iter(range(5)), num_steps=10, warmup=2)
