"""A fake SandboxFusion server for the tests: answers POST /run_code in SandboxFusion's documented response format
from canned outputs (the clients under test are real; this server is not)."""
from __future__ import annotations

import contextlib
import http.server
import json
import threading
import time

CANNED_STDOUT = {"print(6 * 7)": "42\n", "print('é' * 20)": "é" * 20 + "\n", "print(1)": "1\n", "print(2)": "2\n",
                 "print(5)": "5\n"}


class FakeSandboxFusion(http.server.BaseHTTPRequestHandler):
    """Answers POST /run_code the way SandboxFusion documents it (a fake server; the client under test is real)."""

    requests: list[dict] = []

    def log_message(self, *args):
        pass

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append({"path": self.path, **req})
        code = req["code"]
        if self.path != "/run_code":
            return self._send(404, b'{"detail": "Not Found"}')
        if code == "http500":
            return self._send(500, b"Internal Server Error")
        if code == "garbage":
            return self._send(200, b"<html>not json</html>")
        if code == "sandbox_error":
            return self._send(200, json.dumps({"status": "SandboxError", "message": "no executor",
                                               "run_result": None}).encode())
        if code == "slow":
            time.sleep(2.0)
        run = {"status": "Finished", "execution_time": 0.01, "return_code": 0, "stdout": "", "stderr": ""}
        status = "Success"
        if code in CANNED_STDOUT:
            run["stdout"] = CANNED_STDOUT[code]
        elif code == "raise":
            run.update(status="Error", return_code=1, stderr="Traceback ...\nValueError: x\n")
            status = "Failed"
        elif code == "loop":
            run.update(status="TimeLimitExceeded", return_code=None, stdout="partial")
            status = "Failed"
        self._send(200, json.dumps({"status": status, "message": "", "compile_result": None, "run_result": run,
                                    "executor_pod_name": None, "files": {}}).encode())


@contextlib.contextmanager
def fake_sandbox_fusion_server():
    """Yields the base URL of a FakeSandboxFusion on 127.0.0.1 (its requests recorded in FakeSandboxFusion.requests)."""
    FakeSandboxFusion.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeSandboxFusion)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
