"""`lattice serve --shutdown-timeout`: SIGTERM with streams in flight ends them within the timeout, each with a
last chunk saying so and ``[DONE]``, and the process exits with status 0."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from .serve_harness import MODEL_NAME, free_port

TIMEOUT_S = 2.0
STREAMS = 4


def read_stream(port: int, events: list[object], started: threading.Event) -> None:
    """POST one long streamed completion and append each SSE payload (parsed JSON, or the string ``[DONE]``)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 1500, "stream": True}
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"content-type": "application/json"})
        answer = conn.getresponse()
    except OSError:  # connected after the signal: refused
        return
    events.append(answer.status)
    while line := answer.readline():
        if line.startswith(b"data: "):
            payload = line[6:].strip().decode()
            events.append(payload if payload == "[DONE]" else json.loads(payload))
            started.set()
    conn.close()


def wait_until_serving(proc: subprocess.Popen, port: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError("the server did not start")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_with_streams_in_flight_ends_them_within_the_timeout(sig):
    port = free_port()
    command = [sys.executable, "-m", "lattice_inference.cli", "serve", "--model", "bundled", "--dtype", "float32"]
    command += ["--port", str(port), "--served-model-name", MODEL_NAME, "--shutdown-timeout", str(TIMEOUT_S)]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        wait_until_serving(proc, port)
        streams = [([], threading.Event()) for _ in range(STREAMS)]
        threads = [threading.Thread(target=read_stream, args=(port, ev, st), daemon=True) for ev, st in streams]
        for thread in threads:
            thread.start()
        assert streams[0][1].wait(60), "the first stream did not start"
        signalled = time.monotonic()
        proc.send_signal(sig)
        rc = proc.wait(timeout=TIMEOUT_S + 30)
        took = time.monotonic() - signalled
        output = proc.stdout.read() if proc.stdout else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, output
    assert took < TIMEOUT_S + 8, took  # the timeout, one decode round, uvicorn's 0.1 s polls, interpreter exit
    for thread in threads:
        thread.join(timeout=10)
    ended = 0
    for events, _ in streams:
        if not events:
            continue
        assert events[0] == 200 and events[-1] == "[DONE]", events[-3:]
        last = events[-2]
        assert isinstance(last, dict)
        if "error" in last:
            assert last["error"]["code"] == "server_shutdown" and "shut down" in last["error"]["message"]
            ended += 1
        else:
            assert last["choices"][0]["finish_reason"] in ("stop", "length")
    assert ended >= 1  # 4 x 1500 tokens take longer than the timeout on the bundled model
    assert "shut down" in output
