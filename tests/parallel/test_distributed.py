"""jaxmp/parallel/_distributed.py: how initialize_distributed resolves its settings, with JAX's
``jax.distributed.initialize`` replaced by a recorder (nothing connects anywhere)."""

import jax
import pytest

from jaxmp.parallel import _distributed as distributed
from jaxmp.parallel._distributed import DistributedInfo, distributed_info, initialize_distributed

ENV = ("JAXMP_COORDINATOR_ADDRESS", "JAXMP_NUM_PROCESSES", "JAXMP_PROCESS_ID", "JAXMP_LOCAL_DEVICE_IDS")


@pytest.fixture
def calls(monkeypatch):
    """The keyword arguments each ``jax.distributed.initialize`` call got; the environment cleared."""
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    seen = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: seen.append(kw))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    return seen


def test_distributed_info_describes_this_single_process():
    info = distributed_info()
    assert isinstance(info, DistributedInfo)
    assert info == (0, 1, jax.local_device_count(), jax.device_count(), None)


def test_arguments_are_passed_to_jax_as_given(calls):
    info = initialize_distributed("10.0.0.1:1234", 4, 3, [0, 1], cpu_collectives=None, initialization_timeout=7,
                                  heartbeat_timeout_seconds=9)
    assert calls == [dict(coordinator_address="10.0.0.1:1234", num_processes=4, process_id=3, local_device_ids=[0, 1],
                          initialization_timeout=7, heartbeat_timeout_seconds=9)]
    assert info.coordinator_address == "10.0.0.1:1234" and info.process_count == 1


def test_the_environment_fills_in_what_the_arguments_leave_out(calls, monkeypatch):
    monkeypatch.setenv("JAXMP_COORDINATOR_ADDRESS", "host.example:99")
    monkeypatch.setenv("JAXMP_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAXMP_PROCESS_ID", "1")
    monkeypatch.setenv("JAXMP_LOCAL_DEVICE_IDS", " 2, 3,")
    initialize_distributed(process_id=0, cpu_collectives=None)  # an argument beats its variable
    kw = calls[0]
    assert (kw["coordinator_address"], kw["num_processes"], kw["process_id"], kw["local_device_ids"]) == \
        ("host.example:99", 2, 0, [2, 3])


def test_nothing_given_leaves_everything_to_jax_and_blank_variables_count_as_unset(calls, monkeypatch):
    monkeypatch.setenv("JAXMP_NUM_PROCESSES", "  ")
    initialize_distributed(cpu_collectives=None)
    assert calls[0]["coordinator_address"] is None and calls[0]["num_processes"] is None
    assert calls[0]["local_device_ids"] is None


def test_a_single_local_device_id_becomes_a_list(calls):
    initialize_distributed("h:1", 2, 0, 5, cpu_collectives=None)
    assert calls[0]["local_device_ids"] == [5]


@pytest.mark.parametrize("address", ["localhost", ":1234", "host:", "host:port", "host:0", "host:70000"])
def test_a_malformed_address_is_refused_before_anything_connects(calls, address):
    with pytest.raises(ValueError, match="host:port"):
        initialize_distributed(address, 2, 0, cpu_collectives=None)
    assert calls == []


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(coordinator_address=1234), TypeError, "coordinator_address"),
    (dict(num_processes=0), ValueError, "num_processes must be >= 1"),
    (dict(num_processes=True), TypeError, "num_processes must be an int"),
    (dict(process_id=-1), ValueError, "process_id must be >= 0"),
    (dict(local_device_ids=[0, -1]), ValueError, "local_device_ids entry must be >= 0"),
    (dict(local_device_ids=["0"]), TypeError, "local_device_ids entry must be an int"),
    (dict(local_device_ids=True), TypeError, "local_device_ids must be an int or a sequence"),
    (dict(local_device_ids="0,1"), TypeError, "local_device_ids must be an int or a sequence"),
    (dict(local_device_ids=1.0), TypeError, "local_device_ids must be an int or a sequence"),
])
def test_bad_settings_are_named(calls, kwargs, error, match):
    with pytest.raises(error, match=match):
        initialize_distributed(**{"coordinator_address": "h:1", "num_processes": 2, "process_id": 0, **kwargs},
                               cpu_collectives=None)
    assert calls == []


def test_a_bad_device_id_list_in_the_environment_is_named(calls, monkeypatch):
    monkeypatch.setenv("JAXMP_LOCAL_DEVICE_IDS", "0;1")
    with pytest.raises(ValueError, match="JAXMP_LOCAL_DEVICE_IDS='0;1' is not a comma-separated list"):
        initialize_distributed(cpu_collectives=None)


def test_no_cluster_found_says_which_variables_to_set(calls, monkeypatch):
    def refuse(**kw):
        raise ValueError("coordinator_address should be defined.")

    monkeypatch.setattr(jax.distributed, "initialize", refuse)
    with pytest.raises(ValueError, match="JAXMP_COORDINATOR_ADDRESS.*JAXMP_PROCESS_ID.*single process"):
        initialize_distributed(cpu_collectives=None)


def test_a_second_call_does_not_connect_again(calls, monkeypatch):
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    info = initialize_distributed("h:1", 2, 0)
    assert calls == [] and info.coordinator_address == "h:1" and info.process_index == 0
    assert distributed.ENV_PROCESS_ID == "JAXMP_PROCESS_ID"
