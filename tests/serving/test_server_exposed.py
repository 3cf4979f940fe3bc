"""``hf-pipeline serve --num-processes 2`` as it stands on a network: the API key from
``HF_PIPELINE_API_KEY`` asked on every route but /health, the launcher's rendezvous store listening
where the HTTP server does (127.0.0.1), not on every interface, and SIGKILL of the launcher ending
its processes (the port closes). The test stops what it started, always."""

from __future__ import annotations

import socket
import time

import pytest
from live_server import start_server

from hf_pipeline.tools.default_model import default_model_path

pytestmark = [pytest.mark.dist, pytest.mark.slow]

KEY = "a-key-for-this-test"
DEADLINE_S = 120.0  # SIGTERM at once (parent-death signal), a drain of nothing, then exit; generous for 2 loaded cores


def _alive(processes) -> list[int]:
    import psutil

    alive = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_the_server_asks_its_key_keeps_its_store_local_and_ends_with_its_launcher(tmp_path):
    httpx = pytest.importorskip("httpx")
    psutil = pytest.importorskip("psutil")
    server = start_server(default_model_path(), tmp_path / "server.log", env={"HF_PIPELINE_API_KEY": KEY})
    try:
        server.wait_up()  # /health answers without the key
        ranks = server.ranks()
        assert len(ranks) == 2
        body = {"model": "tiny", "prompt": "Return the", "max_tokens": 3, "temperature": 0}
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                       timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text

        # The launcher holds the job's store (its only listening socket): on 127.0.0.1, as the HTTP server.
        listening = [c.laddr for c in psutil.Process(server.proc.pid).net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN]
        assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening

        server.proc.kill()  # SIGKILL: the launcher cannot pass anything on
        server.proc.wait(timeout=30)
        end = time.monotonic() + DEADLINE_S
        while (_alive(ranks) or _listening(server.port)) and time.monotonic() < end:
            time.sleep(0.5)
        assert not _alive(ranks), f"the processes outlived their launcher:\n{server.tail()}"
        assert not _listening(server.port)
    finally:
        server.stop()
