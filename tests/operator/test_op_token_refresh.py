"""A token the API server refuses (401) is dropped, not sent again until it would have expired: the operator's
client reads its token file again and retries once; the gateway's client drops it so that its informer's next try
sends the new one. Against a real HTTP server on loopback that accepts only the token now in a file, as an API
server accepts only a token it has not revoked."""
from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest

from kvfleet.gateway.kube import KubeClient, KubeError
from kvfleet.operator.credentials import Credentials, StaticToken, TokenFile
from kvfleet.operator.kube import Kube
from kvfleet.operator.kube import KubeError as OperatorKubeError


class ApiServer:
    """Accepts `Authorization: Bearer <valid>`; counts the requests it saw with each token."""

    def __init__(self, valid: str) -> None:
        self.valid = valid
        self.seen: list[str] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                token = self.headers.get("Authorization", "").removeprefix("Bearer ")
                api.seen.append(token)
                ok = token == api.valid
                body = json.dumps({"kind": "NamespaceList", "items": [], "metadata": {"resourceVersion": "7"}}
                                  if ok else {"kind": "Status", "code": 401, "message": "Unauthorized"}).encode()
                self.send_response(200 if ok else 401)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: object) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"


@pytest.fixture
def api() -> Iterator[ApiServer]:
    server = ApiServer("new")
    thread = threading.Thread(target=server.http.serve_forever, daemon=True)
    thread.start()
    yield server
    server.http.shutdown()
    server.http.server_close()


def rotated_token_file(tmp_path: Path) -> TokenFile:
    """A token file read once ("old"), then rotated on disk ("new") within the re-read interval."""
    path = tmp_path / "token"
    path.write_text("old")
    token = TokenFile(path, clock=lambda: 0.0)   # a clock that never moves: only `forget` makes it read again
    assert token() == "old"
    path.write_text("new")
    assert token() == "old"
    return token


def test_operator_client_reads_the_token_again_and_retries_once(api: ApiServer, tmp_path: Path) -> None:
    kube = Kube(api.url, False, rotated_token_file(tmp_path))
    assert kube.list("v1", "namespaces") == []
    assert api.seen == ["old", "new"]
    assert kube.list("v1", "namespaces") == [] and api.seen == ["old", "new", "new"]


def test_operator_client_gives_a_401_it_cannot_cure_to_its_caller(api: ApiServer, tmp_path: Path) -> None:
    kube = Kube(api.url, False, StaticToken("revoked"))
    with pytest.raises(OperatorKubeError, match="Unauthorized") as caught:
        kube.list("v1", "namespaces")
    assert caught.value.status == 401 and api.seen == ["revoked"]   # a kubeconfig's literal token: not sent again
    path = tmp_path / "token"
    path.write_text("revoked")
    with pytest.raises(OperatorKubeError, match="Unauthorized"):
        Kube(api.url, False, TokenFile(path, clock=lambda: 0.0)).list("v1", "namespaces")
    assert api.seen == ["revoked", "revoked", "revoked"]   # a file read again, still refused: one retry, no loop


def test_gateway_client_drops_a_refused_token(api: ApiServer, tmp_path: Path) -> None:
    token = rotated_token_file(tmp_path)
    client = KubeClient(Credentials(api.url, None, False, None, None, token))

    async def run() -> dict:
        try:
            with pytest.raises(KubeError, match="HTTP 401"):
                await client.list("/api/v1/namespaces", {})
            return await client.list("/api/v1/namespaces", {})   # the informer's next try
        finally:
            await client.close()

    assert asyncio.run(run())["metadata"]["resourceVersion"] == "7"
    assert api.seen == ["old", "new"]
