"""jaxmp/diagnostics/_gradient_stats.py: the records and helpers around gradient_stats, unit by unit
(the counts themselves are in test_gradient_stats.py)."""

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp.diagnostics import _format
from jaxmp.diagnostics._gradient_stats import GroupStats, gradient_stats, suggest_loss_scale


def test_underflow_at_reads_the_histogram_exactly_at_every_power_of_two_scale():
    x = np.array([2.0**-30, 2.0**-25, 2.0**-24, 2.0**-10, 1.0], np.float32)
    stats = gradient_stats({"w": jnp.asarray(x)})
    for s in range(-4, 30):
        scaled = np.abs(x.astype(np.float64)) * 2.0**s
        assert stats.total.underflow_at(s) == int(np.count_nonzero((scaled > 0) & (scaled < 2.0**-24))), s


def test_fractions_of_an_empty_group_are_zero_not_a_division_error():
    empty = GroupStats("g", 0, 0, 0, math.nan, 0.0, (), (), 0, 0, 0)
    assert (empty.underflow_fraction, empty.subnormal_fraction, empty.overflow_fraction, empty.zero_fraction) == (0,) * 4


def test_a_single_leaf_or_a_bare_array_is_one_group_named_by_its_path():
    assert [g.name for g in gradient_stats({"only": jnp.ones(3)}).groups] == ["only"]
    assert [g.name for g in gradient_stats(jnp.ones(3)).groups] == ["<root>"]
    assert [g.name for g in gradient_stats([jnp.ones(2), jnp.ones(2)]).groups] == ["0", "1"]


def test_an_all_zero_gradient_suggests_the_largest_scale_and_has_no_minimum():
    stats = gradient_stats({"w": jnp.zeros(4)})
    assert stats.total.zeros == 4 and math.isnan(stats.total.min_abs) and stats.total.max_abs == 0.0
    assert stats.suggested_loss_scale == 2.0**24 and stats.suggested_underflow_fraction == 0.0


def test_to_dict_is_json_with_groups_total_and_suggestion():
    stats = gradient_stats({"a": jnp.array([1.0, 2.0**-30]), "b": jnp.array([0.0])}, loss_scale=jnp.float32(4.0))
    d = json.loads(json.dumps(stats.to_dict()))
    assert d["loss_scale"] == 4.0 and [g["name"] for g in d["groups"]] == ["a", "b"]
    assert d["total"]["size"] == 3 and d["total"]["zeros"] == 1
    assert str(stats) == stats.table() and _format.wrap(stats.summary(), _format.WIDTH) in stats.table()  # 88 by default
    # the one-line summary (for logs) is wrapped under the table like the table's own width
    narrow = stats.table(width=60)
    assert " ".join(stats.summary().split()) in " ".join(narrow.split())
    assert max(map(len, narrow.split("\n"))) <= 60


def test_an_empty_floating_leaf_is_a_clear_error():
    with pytest.raises(ValueError, match="no elements"):
        gradient_stats({"w": jnp.zeros((0, 3))})


@pytest.mark.parametrize("max_abs, headroom, match", [
    (1.0, 0.0, "headroom"), (1.0, 0.5, "headroom"), (1.0, float("nan"), "headroom"),
    (-1.0, 8.0, "max_abs"), (float("nan"), 8.0, "max_abs"), (float("inf"), 8.0, "max_abs"),
])
def test_suggest_loss_scale_refuses_what_it_cannot_read(max_abs, headroom, match):
    with pytest.raises(ValueError, match=match):
        suggest_loss_scale(max_abs, headroom)
