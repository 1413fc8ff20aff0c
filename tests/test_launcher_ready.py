"""`TritonServer.wait_ready` returns only once every endpoint a caller may use answers: tritonserver opens its
metrics port after the HTTP one, and a test that scraped metrics right after "ready" was refused."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
import time

from inflight.launcher.server import TritonServer, free_port


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
    srv = TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
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
