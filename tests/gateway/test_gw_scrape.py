"""Engine load from /metrics text, kvfleet's and vLLM's names."""

from __future__ import annotations

from kvfleet.gateway.load import EngineLoad
from kvfleet.gateway.scrape import parse_engine_load

KVFLEET = """# HELP kvfleet:num_requests_waiting Requests waiting to be scheduled (queue depth).
# TYPE kvfleet:num_requests_waiting gauge
kvfleet:num_requests_waiting{model_name="tiny"} 3.0
# TYPE kvfleet:num_requests_running gauge
kvfleet:num_requests_running{model_name="tiny"} 2.0
kvfleet:kv_cache_usage_perc{model_name="tiny"} 0.25
kvfleet:prefix_cache_hits_total{model_name="tiny"} 100.0
"""
VLLM = """vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
vllm:num_requests_running{engine="0",model_name="m"} 4.0
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.75
"""


def test_kvfleet_metrics() -> None:
    assert parse_engine_load(KVFLEET) == EngineLoad(3.0, 2.0, 0.25)


def test_vllm_metrics_sum_queues_and_take_the_fullest_cache() -> None:
    assert parse_engine_load(VLLM, "vllm") == EngineLoad(3.0, 4.0, 0.75)


def test_missing_queue_is_unreadable_not_idle() -> None:
    assert parse_engine_load("kvfleet:num_requests_running 1\n") is None
    assert parse_engine_load(KVFLEET, "vllm") is None
