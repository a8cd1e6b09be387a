"""Metric sources: parsing engine /metrics text, scraping loopback pods, the loopback guard."""

from __future__ import annotations

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest

from kvfleet.operator.autoscaler.metrics import (
    MetricsError,
    PodTarget,
    check_host,
    metric_names,
    parse_load,
    parse_prometheus_vector,
    prometheus_query,
    query_prometheus,
    scrape_pods,
)

KVFLEET_TEXT = """\
# HELP kvfleet:num_requests_running Number of requests in model execution batches.
# TYPE kvfleet:num_requests_running gauge
kvfleet:num_requests_running{model_name="tiny"} 3.0
# HELP kvfleet:num_requests_waiting Number of requests waiting to be processed.
# TYPE kvfleet:num_requests_waiting gauge
kvfleet:num_requests_waiting{model_name="tiny"} 7.0
# HELP kvfleet:kv_cache_usage_perc KV-cache usage.
# TYPE kvfleet:kv_cache_usage_perc gauge
kvfleet:kv_cache_usage_perc{model_name="tiny"} 0.25
"""

VLLM_TEXT = KVFLEET_TEXT.replace("kvfleet:", "vllm:")


def test_parse_kvfleet_names() -> None:
    assert parse_load(KVFLEET_TEXT) == (7.0, 3.0)


def test_parse_vllm_names_for_engine_kind_vllm() -> None:
    assert parse_load(VLLM_TEXT, "vllm") == (7.0, 3.0)
    with pytest.raises(MetricsError, match="missing: kvfleet:num_requests_waiting"):
        parse_load(VLLM_TEXT, "kvfleet")


def test_parse_sums_label_sets() -> None:
    text = KVFLEET_TEXT + 'kvfleet:num_requests_waiting{model_name="lora-a"} 2\n'
    assert parse_load(text) == (9.0, 3.0)


def test_renamed_metric_is_unknown_not_zero() -> None:
    renamed = KVFLEET_TEXT.replace("num_requests_waiting", "requests_queued")
    with pytest.raises(MetricsError, match="num_requests_waiting"):
        parse_load(renamed)


def test_malformed_text_is_an_error() -> None:
    with pytest.raises(MetricsError, match="malformed"):
        parse_load("kvfleet:num_requests_waiting{ not text")


def test_unknown_engine_kind_names_the_field() -> None:
    with pytest.raises(ValueError, match="engine.kind"):
        metric_names("tgi")


def test_loopback_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFLEET_LOOPBACK_ONLY", "1")
    for ok in ("127.0.0.1", "127.1.0.7", "::1", "localhost"):
        check_host(ok)
    for bad in ("10.0.0.5", "192.168.1.1", "8.8.8.8", "example.com"):
        with pytest.raises(MetricsError, match="refusing"):
            check_host(bad)
    monkeypatch.setenv("KVFLEET_LOOPBACK_ONLY", "0")
    check_host("10.0.0.5")  # the switch off: a real cluster's pod IPs are allowed


class _Engine(BaseHTTPRequestHandler):
    body = KVFLEET_TEXT
    status = 200

    def do_GET(self) -> None:  # noqa: N802
        data = self.body.encode()
        self.send_response(self.status if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def engine_port() -> Iterator[int]:
    """A loopback HTTP server that serves engine metrics text at /metrics."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_scrape_reads_good_pods_and_marks_bad_ones_unknown(
    engine_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVFLEET_LOOPBACK_ONLY", "1")
    targets = [
        PodTarget("good", "127.0.0.1", engine_port),
        PodTarget("closed-port", "127.0.0.1", 1),      # nothing listens on port 1
        PodTarget("off-loopback", "10.1.2.3", engine_port),  # refused, never contacted
    ]
    loads = asyncio.run(scrape_pods(targets, timeout=1.0))
    by_pod = {p.pod: p for p in loads}
    assert (by_pod["good"].waiting, by_pod["good"].running) == (7.0, 3.0)
    assert not by_pod["closed-port"].known and "ConnectError" in by_pod["closed-port"].error
    assert not by_pod["off-loopback"].known and "refusing" in by_pod["off-loopback"].error


def test_scrape_http_error_is_unknown(engine_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_Engine, "status", 503)
    [load] = asyncio.run(scrape_pods([PodTarget("p", "127.0.0.1", engine_port)]))
    assert not load.known and "503" in load.error


def test_prometheus_query_text() -> None:
    q = prometheus_query("kvfleet:num_requests_waiting", "team-a", ["md-1", "md-0"])
    assert q == 'sum by (pod) (kvfleet:num_requests_waiting{namespace="team-a",pod=~"md-0|md-1"})'


def test_parse_prometheus_vector() -> None:
    body = {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"pod": "md-0"}, "value": [1700000000.1, "4"]},
        {"metric": {"pod": "md-1"}, "value": [1700000000.1, "0"]},
    ]}}
    assert parse_prometheus_vector(body) == {"md-0": 4.0, "md-1": 0.0}
    with pytest.raises(MetricsError, match="bad_data"):
        parse_prometheus_vector({"status": "error", "error": "bad_data"})
    with pytest.raises(MetricsError, match="matrix"):
        parse_prometheus_vector({"status": "success", "data": {"resultType": "matrix"}})


def test_prometheus_off_loopback_is_refused_without_contact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVFLEET_LOOPBACK_ONLY", "1")
    loads = asyncio.run(query_prometheus("http://10.0.0.9:9090", "ns", ["a", "b"]))
    assert [(p.pod, p.known) for p in loads] == [("a", False), ("b", False)]
    assert all("refusing" in p.error for p in loads)


def test_parse_real_server_metrics_output() -> None:
    """The exact text `kvfleet serve` renders at /metrics (its own metrics module)."""
    from kvfleet.engine.server.metrics import ServerMetrics

    stats = {"num_waiting": 5, "num_running": 2, "kv_cache_usage": 0.5, "prompt_tokens": 100}
    server = ServerMetrics("tiny-llama", lambda: stats)
    server.observe_rejected("default", "queue_full")
    server.observe_itl(0.02, 3)
    assert parse_load(server.render().decode()) == (5.0, 2.0)
    stats.update(num_waiting=0, num_running=0)
    assert parse_load(server.render().decode()) == (0.0, 0.0)


def test_engine_still_loading_is_unknown() -> None:
    from kvfleet.engine.server.metrics import ServerMetrics

    with pytest.raises(MetricsError, match="missing"):
        parse_load(ServerMetrics("tiny-llama", lambda: None).render().decode())
