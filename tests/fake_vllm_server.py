"""A stand-in for a vLLM server (``http.server`` in a thread) for the CPU tests of the server client.

It answers ``/health``, the RL endpoints (recording each call) and ``/inference/v1/generate`` with canned token ids
and log-probs in the shape of vLLM's answer; ``delay`` makes it slow, ``status`` makes it fail (as does an exception
in ``body``: HTTP 500 with its message), ``answer`` gives each choice its own tokens, ``fail_on`` fails these paths
(after ``fail_after`` more calls of them succeed), and ``stop`` closes it (a dead server). It keeps vLLM 0.32's update
state: ``paused`` (``/pause`` to ``/resume``) and ``active`` (``/start_weight_update`` to ``/finish_weight_update``),
and refuses out of order as vLLM's worker does (``Worker._start_weight_update``, ``update_weights``,
``finish_weight_update`` in vllm/v1/worker/gpu_worker.py): a second start while an update is active, an update or a
finish outside one. ``hold`` (an Event) keeps generation requests in flight until it is set: one whose weights changed
meanwhile (a push with ``pause?mode=keep``) answers two weight-version spans, its first token under the version it
arrived at, the rest under the new one, as vLLM does.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeServer:
    def __init__(self, delay: float = 0.0, status: int = 200, completion: list[int] | None = None) -> None:
        self.delay, self.status = delay, status
        self.completion = completion if completion is not None else [5, 6, 2]
        self.calls: list[tuple[str, Any]] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                self._answer(None)

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self._answer(json.loads(self.rfile.read(length) or b"null"))

            def _answer(self, payload: Any) -> None:
                with fake._lock:
                    fake.calls.append((self.path, payload))
                    fake.in_flight += 1
                    fake.most_in_flight = max(fake.most_in_flight, fake.in_flight)
                try:
                    time.sleep(fake.delay)
                    path = self.path.split("?")[0]
                    try:
                        body, status = fake.body(path, payload), fake.status
                    except Exception as err:  # the server's own failure: vLLM answers 500 with its message
                        body, status = {"error": {"message": f"{type(err).__name__}: {err}"}}, 500
                    data = json.dumps(body).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if path in fake.cut_on:  # the answer cut short: part of the body, then the connection closes
                        data, self.close_connection = data[: len(data) // 2], True
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                finally:
                    with fake._lock:
                        fake.in_flight -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.version = "default"
        self.hold: threading.Event | None = None
        self.fail_on: set[str] = set()  # paths answered with HTTP 500 (the others as usual)
        self.cut_on: set[str] = set()  # paths whose answer is cut short (the server died while answering)
        #: (request payload, choice index) -> that choice's token ids (None: ``completion`` for every choice)
        self.answer: Callable[[Any, int], list[int]] | None = None
        self.fail_after = 0  # calls of the fail_on paths that still succeed first
        self.pause_delay = 0.0  # seconds /pause takes on top of ``delay`` (vLLM's mode=wait: requests in flight finish)
        self.paused = self.active = False
        self.logprobs_mode = "processed_logprobs"  # what /server_info reports (vLLM's default: raw_logprobs)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def check_update(self, path: str) -> None:
        """vLLM 0.32's refusals of RL calls out of order (vllm/v1/worker/gpu_worker.py, each a RuntimeError that the
        server answers as HTTP 500 with its message)."""
        if path == "/start_weight_update" and self.active:  # Worker._start_weight_update
            raise RuntimeError("start_weight_update called while a weight update is already active. Call "
                               "finish_weight_update first.")  # fmt: skip
        if path == "/update_weights" and not self.active:  # Worker.update_weights
            raise RuntimeError("start_weight_update must be called before update_weights.")
        if path == "/finish_weight_update" and not self.active:  # Worker.finish_weight_update
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")

    def body(self, path: str, payload: Any) -> Any:
        if self.status != 200:
            return {"error": {"message": f"fake failure on {path}"}}
        self.check_update(path)
        if path in self.fail_on:
            if self.fail_after > 0:
                self.fail_after -= 1
            else:
                if path == "/update_weights":  # vLLM's worker ends the update when a chunk fails to load
                    self.active = False
                raise RuntimeError(f"fake failure on {path}")
        if path == "/pause":
            time.sleep(self.pause_delay)
        if path in ("/pause", "/resume"):
            self.paused = path == "/pause"
        if path == "/start_weight_update":
            self.active = True
        if path == "/weight_info":
            return {"weight_version": self.version}
        if path == "/server_info":  # vLLM's development endpoint, the parts sgrpo reads
            return {"vllm_config": {"model_config": {"logprobs_mode": self.logprobs_mode}}, "vllm_env": {}}
        if path == "/finish_weight_update":  # vLLM's trainer engines finish without a version, then set it
            self.active = False
            self.version = (payload or {}).get("weight_version", self.version)
            return {}
        if path == "/update_weight_version":
            self.version = payload["new_version"]
            return {}
        if path == "/inference/v1/generate":
            params = payload["sampling_params"]
            arrived = self.version
            if self.hold is not None:
                self.hold.wait(timeout=30)
            return {"choices": [self._choice(payload, index, arrived) for index in range(params.get("n", 1))]}
        return {}

    def _choice(self, payload: Any, index: int, arrived: str) -> dict:
        params = payload["sampling_params"]
        ids = (self.completion if self.answer is None else self.answer(payload, index))[: params["max_tokens"]]
        spans = [{"version": self.version, "start": 0, "end": len(ids)}]
        if arrived != self.version:
            spans = [{"version": arrived, "start": 0, "end": 1}, {"version": self.version, "start": 1,
                                                                  "end": len(ids)}]  # fmt: skip
        return {"finish_reason": "stop" if len(ids) < params["max_tokens"] else "length", "token_ids": ids,
                "logprobs": {"content": [{"token_id": i, "logprob": -0.5} for i in ids]}, "weight_versions": spans,
                "index": index}  # fmt: skip

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
