"""The Prometheus metric source against a real Prometheus (Debian's `prometheus`) scraping loopback engines'
metrics text as `kvfleet serve` renders it. Skipped when no `prometheus` binary is installed, except in CI."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

import httpx
import pytest

from kvfleet.operator.autoscaler.metrics import query_prometheus

PROMETHEUS = shutil.which("prometheus")
# `make test` installs Debian's prometheus (make system-deps); only outside CI may it be missing.
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(PROMETHEUS is None and not os.environ.get("CI"),
                                 reason="no prometheus binary (make system-deps)")]


def _engine_server(stats: dict[str, Any]) -> ThreadingHTTPServer:
    """A loopback HTTP server whose /metrics is the server's own rendering of `stats`."""
    from kvfleet.engine.server.metrics import CONTENT_TYPE, ServerMetrics

    metrics = ServerMetrics("tiny", lambda: stats)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = metrics.render()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, dict[str, Any]]]]:
    """Prometheus scraping two engines every 0.5 s, labelled with namespace and pod; yields (url, stats)."""
    tmp_path = tmp_path_factory.mktemp("prometheus")
    stats = {"md-0": {"num_waiting": 5, "num_running": 2}, "md-1": {"num_waiting": 0, "num_running": 1}}
    servers = {pod: _engine_server(s) for pod, s in stats.items()}
    targets = "\n".join(
        f"      - targets: ['127.0.0.1:{srv.server_address[1]}']\n"
        f"        labels: {{namespace: team-a, pod: {pod}}}" for pod, srv in servers.items())
    config = tmp_path / "prometheus.yml"
    config.write_text("global: {scrape_interval: 500ms, evaluation_interval: 1s}\n"
                      "scrape_configs:\n  - job_name: engines\n    static_configs:\n" + targets + "\n")
    port = _free_port()
    proc = subprocess.Popen([str(PROMETHEUS), f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'db'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:  # ready, and both engines scraped at least once
            try:
                r = httpx.get(f"{url}/api/v1/query", params={"query": "count(up == 1)"}, timeout=1)
                result = r.json()["data"]["result"]
                if result and result[0]["value"][1] == "2":
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            assert time.monotonic() < deadline, "prometheus did not scrape both engines in 20 s"
            time.sleep(0.2)
        yield url, stats
    finally:
        proc.terminate()
        proc.wait(10)
        for srv in servers.values():
            srv.shutdown()
            srv.server_close()


def test_query_reads_each_pod_and_marks_missing_ones_unknown(
    prometheus: tuple[str, dict[str, dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ = prometheus
    monkeypatch.setenv("KVFLEET_LOOPBACK_ONLY", "1")
    loads = asyncio.run(query_prometheus(url, "team-a", ["md-0", "md-1", "md-2"]))
    by_pod = {p.pod: p for p in loads}
    assert (by_pod["md-0"].waiting, by_pod["md-0"].running) == (5.0, 2.0)
    assert (by_pod["md-1"].waiting, by_pod["md-1"].running) == (0.0, 1.0)
    assert not by_pod["md-2"].known and "no series" in by_pod["md-2"].error
    # Another namespace's pods of the same name are not ours.
    assert not any(p.known for p in asyncio.run(query_prometheus(url, "team-b", ["md-0"])))


def test_vllm_names_are_absent_here_so_unknown(prometheus: tuple[str, dict[str, dict[str, Any]]]) -> None:
    url, _ = prometheus
    loads = asyncio.run(query_prometheus(url, "team-a", ["md-0"], engine_kind="vllm"))
    assert not loads[0].known
