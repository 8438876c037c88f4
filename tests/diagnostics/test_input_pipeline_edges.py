"""jaxmp/diagnostics/_input_pipeline.py: the PipelineOverhead record and the measurement's edges
(the two-loop method itself is in test_input_pipeline.py)."""

import json
import math

import jax
import numpy as np
import pytest

from jaxmp.diagnostics import _format
from jaxmp.diagnostics._input_pipeline import PipelineOverhead, input_pipeline_overhead


def test_projected_speedup_is_amdahls_law():
    ov = PipelineOverhead(10, total_time=10.0, model_time=8.0, exposed_time=2.0, exposed_fraction=0.2, max_speedup=5.0)
    assert ov.projected_speedup(1.0) == 1.0
    assert ov.projected_speedup(2.0) == pytest.approx(10 / 6)
    assert ov.projected_speedup(math.inf) == pytest.approx(5.0)  # infinitely fast compute hits the cap


def test_projected_speedup_with_nothing_exposed_and_infinitely_fast_compute_is_unbounded():
    ov = PipelineOverhead(4, 1.0, 1.0, 0.0, 0.0, math.inf)
    assert ov.projected_speedup(4.0) == pytest.approx(4.0)
    assert math.isinf(ov.projected_speedup(math.inf))


@pytest.mark.parametrize("bad", [0.0, -2.0, float("nan")])
def test_projected_speedup_refuses_a_non_positive_speedup(bad):
    with pytest.raises(ValueError, match="compute_speedup"):
        PipelineOverhead(1, 1.0, 1.0, 0.0, 0.0, math.inf).projected_speedup(bad)


def test_to_dict_is_json_and_str_is_the_summary():
    ov = PipelineOverhead(4, 0.4, 0.1, 0.3, 0.75, 4 / 3)
    d = json.loads(json.dumps(ov.to_dict()))
    assert d["num_steps"] == 4 and d["exposed_fraction"] == 0.75 and d["summary"] == ov.summary()
    assert str(ov) == _format.wrap(ov.summary()) and max(map(len, str(ov).split("\n"))) <= 88
    assert "100.00 ms/step total" in ov.summary() and "25.00 ms/step model" in ov.summary()


def test_a_zero_duration_clock_gives_no_exposed_time_instead_of_dividing_by_zero():
    ov = input_pipeline_overhead(lambda s, b: s, 0, range(10), num_steps=2, device_put=False, timer=lambda: 0.0)
    assert ov.exposed_fraction == 0.0 and math.isinf(ov.max_speedup)


def test_the_preloaded_batch_is_put_on_the_device_once_with_device_put():
    seen = []

    def step(state, batch):
        seen.append(type(batch))
        return state

    input_pipeline_overhead(step, 0, (np.ones(2) for _ in range(10)), num_steps=2, warmup=1)
    assert seen[0] is np.ndarray  # warm-up: the iterator's own batch
    assert all(issubclass(t, jax.Array) for t in seen[1:2]) and all(t is np.ndarray for t in seen[2:4])
    assert all(issubclass(t, jax.Array) for t in seen[4:])  # the model loop: the preloaded device batch


@pytest.mark.parametrize("kw", [{"num_steps": 2.0}, {"warmup": True}, {"repeats": "1"}])
def test_counts_must_be_ints(kw):
    with pytest.raises(TypeError, match=next(iter(kw))):
        input_pipeline_overhead(lambda s, b: s, 0, range(10), **{"num_steps": 1, **kw})
