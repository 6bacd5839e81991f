"""What a rolling update relies on: SIGTERM to ``llmctl serve`` while requests stream. In-flight
requests finish, new work is refused (503 on an open connection, refused connections once the
socket is closed), and the process exits 0 well within the pod's grace period."""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "router"))
from router_helpers import start_replicas  # noqa: E402

DRAIN_TIMEOUT_S = 30


def _stream(url: str, results: list[dict], started: threading.Event) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True, "temperature": 0, "stream": True}
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 3:
                    started.set()
    results.append({"status": response.status_code, "events": events})


def _raw_request(sock: socket.socket, request: bytes) -> bytes:
    """Send one HTTP/1.1 request on an open connection; whatever comes back before it closes."""
    sock.sendall(request)
    received = b""
    sock.settimeout(30)
    try:
        while chunk := sock.recv(65536):
            received += chunk
            if b"\r\n\r\n" in received and b'"error"' in received and received.rstrip().endswith(b"}"):
                break
    except (ConnectionResetError, TimeoutError):
        pass
    return received


def _late_request(server_url: str, keep_alive: socket.socket) -> bytes:
    host = server_url.removeprefix("http://").split(":")[0]
    body = json.dumps({"prompt": "new work", "max_tokens": 4}).encode()
    return _raw_request(
        keep_alive,
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
        f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body,
    )


def _open_idle_connection(server_url: str) -> socket.socket:
    host, port = server_url.removeprefix("http://").split(":")
    keep_alive = socket.create_connection((host, int(port)))
    assert b'"ok"' in _raw_request(keep_alive, f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    return keep_alive


def _start_streams(url: str, count: int) -> tuple[list[threading.Thread], list[dict]]:
    results: list[dict] = []
    started = [threading.Event() for _ in range(count)]
    streams = [threading.Thread(target=_stream, args=(url, results, s)) for s in started]
    for thread in streams:
        thread.start()
    for event in started:
        assert event.wait(timeout=120)
    return streams, results


def test_sigterm_finishes_streams_refuses_new_work_and_exits_0(tmp_path):
    (server,) = start_replicas(1, tmp_path, "--drain-timeout", str(DRAIN_TIMEOUT_S))
    try:
        keep_alive = _open_idle_connection(server.url)
        streams, results = _start_streams(server.url, 2)

        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        late = _late_request(server.url, keep_alive)
        keep_alive.close()
        # new work never runs: no 200 on the open connection, and new connections are refused
        assert b" 200 " not in late.split(b"\r\n", 1)[0], late
        refused = False
        for _ in range(100):
            try:
                httpx.get(f"{server.url}/health", timeout=2)
            except httpx.ConnectError:
                refused = True
                break
            time.sleep(0.1)
        assert refused

        exit_code = server.proc.wait(timeout=DRAIN_TIMEOUT_S + 30)
        elapsed = time.monotonic() - signalled
        for thread in streams:
            thread.join(timeout=30)
        assert exit_code == 0, server.log()
        assert elapsed < DRAIN_TIMEOUT_S, f"exit took {elapsed:.1f}s"  # the streams ended, not the timeout
        assert len(results) == 2
        for result in results:  # both in-flight streams ran to their end
            assert result["status"] == 200 and result["events"][-1] == "[DONE]"
            chunks = [json.loads(e) for e in result["events"][:-1]]
            assert sum(len(c["choices"]) and c["choices"][0]["finish_reason"] == "length" for c in chunks) == 1
            assert len(chunks) >= 48
    finally:
        server.kill()
