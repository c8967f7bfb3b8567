"""Fixtures for the tool tests: a fake Bright Data endpoint on 127.0.0.1 and the seeds' YAML."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def seeds_yaml():
    return FIXTURES / "seeds_tool_config.yaml"


class FakeBrightData:
    """A real HTTP server: records each request, answers from a script of responses.

    ``script`` items are (status, body, headers, delay_s); body may be bytes, str or a JSON-able
    object. When the script is empty the ``default`` response is used.
    """

    def __init__(self):
        self.requests = []
        self.script = []
        self.default = (200, {"organic": []}, {}, 0.0)
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server naming
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with fake._lock:
                    fake.requests.append({"path": self.path, "headers": dict(self.headers), "body": raw})
                    status, body, headers, delay = fake.script.pop(0) if fake.script else fake.default
                if delay:
                    time.sleep(delay)
                if callable(body):
                    body = body(self.headers)
                if not isinstance(body, (bytes, str)):
                    body = json.dumps(body)
                if isinstance(body, str):
                    body = body.encode()
                try:
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout tests)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/request"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    def respond(self, *items):
        with self._lock:
            self.script.extend(items)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def brightdata():
    server = FakeBrightData()
    yield server
    server.close()
