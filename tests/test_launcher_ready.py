"""`TritonServer.wait_ready` returns only once every endpoint a caller may use answers: tritonserver opens its
metrics port after the HTTP one, and a test that scraped metrics right after "ready" was refused."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
import time

from inflight.launcher.server import TritonServer


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the handler's name
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


def _serve(port: int) -> http.server.HTTPServer:
    server = http.server.HTTPServer(("localhost", port), _Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_ready_waits_for_the_metrics_endpoint(monkeypatch):
    monkeypatch.setattr("inflight.launcher.server.find_server", lambda path=None: None)
    srv = TritonServer(http_port=0, grpc_port=0, metrics_port=0)
    srv.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])  # a live "server"
    http_server, late = _serve(srv.http_port), []
    opened = threading.Timer(1.0, lambda: late.append((_serve(srv.metrics_port), time.monotonic())))
    opened.start()
    try:
        srv.wait_ready(timeout_s=20)
        assert late, "ready before the metrics endpoint was up"
        assert time.monotonic() >= late[0][1]
    finally:
        opened.cancel()
        srv.process.kill()
        http_server.shutdown()
        for server, _ in late:
            server.shutdown()


class _Sockets:
    """socket.socket as the OS may behave: bind to port 0 gives the lowest port not bound right now, so a port
    released by one call can come back from the next."""

    def __init__(self):
        self.bound: set[int] = set()

    def __call__(self, *args, **kwargs):
        owner = self

        class _Socket:
            port = None

            def bind(self, addr):
                self.port = min(p for p in range(40000, 40100) if p not in owner.bound)
                owner.bound.add(self.port)

            def getsockname(self):
                return ("127.0.0.1", self.port)

            def close(self):
                owner.bound.discard(self.port)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.close()

        return _Socket()


def test_ports_picked_together_are_distinct(monkeypatch):
    # tritonserver failed to start once in CI ("Socket ... already in use"): its HTTP and metrics ports, each
    # picked by a free_port() call of its own, had come out the same.
    import inflight.launcher.server as server

    monkeypatch.setattr(server.socket, "socket", _Sockets())
    monkeypatch.setattr(server, "find_server", lambda path=None: None)
    assert len(set(server.free_ports(4))) == 4
    srv = TritonServer(http_port=0, grpc_port=0, metrics_port=0)
    assert len({srv.http_port, srv.grpc_port, srv.metrics_port}) == 3
