"""Where the Spark application's status REST API answers (runtime.phases): the job counts of
every phase and the plan checks of the tests read it."""

from __future__ import annotations

import http.server
import json
import socket
import threading
from contextlib import ExitStack

from cdc_lakehouse.runtime.phases import _answering_ui

APP = "app-20261129-0001"


def _serve(port: int, body: dict | None) -> http.server.HTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            if body is None or not self.path.endswith(body["id"]):
                self.send_error(404)
                return
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _three_free_ports() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + 2 > 65535:
            continue
        try:
            for p in (base, base + 1, base + 2):
                with socket.socket() as t:
                    t.bind(("127.0.0.1", p))
        except OSError:
            continue
        return base
    raise AssertionError("no three free ports in a row")


def test_a_ui_that_moved_to_a_later_port_is_found_and_another_programs_answer_is_not_taken():
    """spark.ui.port names the port the UI tried first; when another program held it, the UI
    bound a later one. The program's 404 (what failed a plan check in CI) is passed over."""
    base = _three_free_ports()
    with ExitStack() as stack:
        for port, body in ((base, None), (base + 2, {"id": APP})):  # base + 1: nothing listens
            server = _serve(port, body)
            stack.callback(server.server_close)
            stack.callback(server.shutdown)
        assert _answering_ui("127.0.0.1", base, APP) == f"http://127.0.0.1:{base + 2}/api/v1/applications/{APP}"
        assert _answering_ui("127.0.0.1", base, "app-other") is None
