"""HTTP to vLLM servers: one call with a timeout, a pool of servers with least-outstanding routing, health checks.

Standard library only (``urllib``), so the client imports on any machine. Every call has a timeout and every
failure raises ``ServerError`` naming the server's URL: a dead, hung or restarted server makes the trainer raise,
never wait. ``ServerPool.map`` sends many requests at once (threads), each to the server with the fewest requests
in flight when it leaves, and returns the answers in request order, each tagged with the URL that served it.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any


class ServerError(RuntimeError):
    """A vLLM server did not answer, answered an error, or answered something else than expected; names its URL."""


def call(url: str, payload: Any = None, timeout: float = 30.0, method: str | None = None) -> Any:
    """One HTTP call: POST ``payload`` as JSON (GET without one); the JSON answer (None for an empty body).

    Raises ``ServerError`` naming ``url`` on a refused connection, a timeout (``timeout`` seconds per socket
    operation), an HTTP error status (with the start of the server's message), an answer cut short or garbled, or a
    body that is not JSON.
    """
    data = None if payload is None else json.dumps(payload).encode()
    method = method or ("GET" if payload is None else "POST")
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as err:
        try:
            detail = err.read()[:300].decode(errors="replace").strip()
        except (http.client.HTTPException, OSError):  # the error's body cut short too
            detail = "(its message cut short)"
        raise ServerError(f"{url}: HTTP {err.code} {err.reason}: {detail}{_missing_endpoint(url, err.code)}") from None
    except TimeoutError as err:
        raise ServerError(f"{url}: no answer within {timeout:g} s ({err or 'timed out'})") from None
    except urllib.error.URLError as err:
        if isinstance(err.reason, TimeoutError):
            raise ServerError(f"{url}: no answer within {timeout:g} s") from None
        if isinstance(err.reason, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)):  # while sending
            raise ServerError(f"{url}: connection lost ({err.reason}); did the vLLM server stop?") from None
        where = f"is the vLLM server running there?{_proxied(url)}"
        raise ServerError(f"{url}: unreachable ({err.reason}); {where}") from None
    except (ConnectionError, OSError) as err:  # reset or closed mid-answer: the server died
        raise ServerError(f"{url}: connection lost ({err}); did the vLLM server stop?") from None
    except http.client.HTTPException as err:  # an answer cut short (IncompleteRead) or garbled (BadStatusLine)
        raise ServerError(f"{url}: broken answer ({type(err).__name__}: {err}); did the vLLM server stop?") from None
    if not body.strip():
        return None
    try:
        return json.loads(body)
    except ValueError:
        raise ServerError(f"{url}: answered something that is not JSON: {body[:200]!r}") from None


#: vLLM's endpoints that sgrpo calls and a server serves only when started so (docs/servers.md)
SCALE_OUT_PATHS = ("/inference/v1/generate",)
DEV_MODE_PATHS = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
                  "/update_weight_version", "/weight_info", "/get_world_size", "/pause", "/resume")  # fmt: skip


def _missing_endpoint(url: str, status: int) -> str:
    """The fix for a 404 on an endpoint vLLM serves only when started with it: a server started by hand without
    the flag answered a bare "Not Found"."""
    if status != 404:
        return ""
    path = urllib.parse.urlsplit(url).path
    if path in SCALE_OUT_PATHS:
        return "; the server serves it only when started with --enable-scale-out (docs/servers.md)"
    if path in DEV_MODE_PATHS:
        return "; the server serves it only with VLLM_SERVER_DEV_MODE=1 in its environment (docs/servers.md)"
    return ""


def _proxied(url: str) -> str:
    """Where a proxy carries the call (``http_proxy`` set, the host not in ``no_proxy``), the note that names it: a
    cluster shell's proxy refuses a server that is up, and the error read as if the server were down."""
    proxy = urllib.request.getproxies().get(urllib.parse.urlsplit(url).scheme)
    host = urllib.parse.urlsplit(url).hostname or ""
    if not proxy or urllib.request.proxy_bypass(host):
        return ""
    return f" (the call went through the proxy {proxy}: add {host} to no_proxy)"


def rank_world() -> tuple[int, int]:
    """This process's rank and the number of processes (torch.distributed's; 0 and 1 without a process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@dataclass
class Answer:
    """One request's JSON answer and the server (base URL) that gave it."""

    url: str
    body: Any


class ServerPool:
    """Base URLs of vLLM servers; requests go to the one with the fewest requests in flight (ties: the one given
    fewest so far, then the first in this process's order: the list rotated by the process's rank, ``rank``).

    Every data-parallel process has a pool of its own and they all start a step at 0 in flight: with the list's
    order alone every process sent its first requests to the first servers (4 processes x 2 prompts on 4 servers:
    4, 4, 0 and 0 requests, half the servers idle each step; found by a review).

    Args:
        urls: Base URLs (``http://host:port``), without a trailing path.
        request_timeout: Seconds a generation request may take (per socket operation and in all).
        timeout: Seconds any other call (health, weight transfer steps) may take.
        rank: This process's rank (default: torch.distributed's, read at the first request, once the process
            group exists).
    """

    def __init__(
        self, urls: Sequence[str], request_timeout: float = 600.0, timeout: float = 60.0, rank: int | None = None
    ) -> None:
        if not urls:
            raise ValueError("urls: give at least one vLLM server URL (http://host:port)")
        self.urls = [u.rstrip("/") for u in urls]
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"urls: a server is listed twice: {self.urls}")
        self.request_timeout, self.timeout = request_timeout, timeout
        self._lock = threading.Lock()
        self._outstanding = dict.fromkeys(self.urls, 0)
        self._given = dict.fromkeys(self.urls, 0)
        self._rank, self._place = rank, None

    def _order(self) -> dict[str, int]:
        """Each server's place in this process's order: the list rotated by the rank."""
        if self._place is None:
            rank = self._rank if self._rank is not None else rank_world()[0]
            n = len(self.urls)
            self._place = {u: (i - rank) % n for i, u in enumerate(self.urls)}
        return self._place

    def acquire(self, url: str | None = None) -> str:
        """The least-outstanding server (or ``url``), its count raised by one (``release`` lowers it)."""
        with self._lock:
            place = self._order()
            url = url or min(self.urls, key=lambda u: (self._outstanding[u], self._given[u], place[u]))
            self._outstanding[url] += 1
            self._given[url] += 1
            return url

    def release(self, url: str) -> None:
        with self._lock:
            self._outstanding[url] -= 1

    def outstanding(self) -> dict[str, int]:
        with self._lock:
            return dict(self._outstanding)

    def post(self, url: str, path: str, payload: Any = None, timeout: float | None = None) -> Any:
        """``call`` on one server's ``path`` with this pool's timeout (or ``timeout``)."""
        return call(url + path, payload, self.timeout if timeout is None else timeout, method="POST")

    def get(self, url: str, path: str, timeout: float | None = None) -> Any:
        return call(url + path, None, self.timeout if timeout is None else timeout)

    def check_health(self, timeout: float | None = None) -> None:
        """GET ``/health`` of every server; a ``ServerError`` naming the first that does not answer 200."""
        for url in self.urls:
            self.get(url, "/health", timeout)

    def map(
        self, path: str, payloads: Sequence[Any], workers: int = 64, urls: Sequence[str | None] | None = None
    ) -> list[Answer]:
        """POST each payload to ``path`` of the least-outstanding server (or its entry of ``urls``, where not None:
        an episode's turns go to one server, its prefix cache); the answers in payload order.

        The first failure raises (its ``ServerError``) at once; the requests in flight go on in the background
        until they end or time out (``request_timeout``), and those not yet sent are dropped.
        """
        if not payloads:
            return []

        def send(payload: Any, url: str | None = None) -> Answer:
            url = self.acquire(url)
            try:
                return Answer(url, call(url + path, payload, self.request_timeout, method="POST"))
            finally:
                self.release(url)

        pool = ThreadPoolExecutor(max_workers=max(1, min(workers, len(payloads))), thread_name_prefix="vllm-http")
        try:
            chosen = urls if urls is not None else [None] * len(payloads)
            futures = [pool.submit(send, p, u) for p, u in zip(payloads, chosen)]
            done, pending = wait(futures, timeout=None, return_when=FIRST_EXCEPTION)
            for future in done:
                if future.exception() is not None:
                    raise future.exception()
            return [f.result() for f in futures]
        finally:
            pool.shutdown(wait=False, cancel_futures=True)


def wait_until_healthy(
    urls: Sequence[str], timeout: float, alive: Callable[[], str | None] | None = None, poll: float = 0.5
) -> None:
    """Poll ``/health`` of each URL until all answer, at most ``timeout`` seconds in all.

    ``alive`` (optional) returns None while the servers' processes run, else why one stopped (checked at each
    poll: a server that exits while starting raises at once). Raises ``ServerError`` naming the URL.
    """
    deadline = time.monotonic() + timeout
    for url in urls:
        while True:
            try:
                call(url + "/health", None, timeout=min(5.0, timeout))
                break
            except ServerError as err:
                last = str(err)
            stopped = alive() if alive is not None else None
            if stopped:
                raise ServerError(f"{url}: the server stopped while starting: {stopped}")
            if time.monotonic() > deadline:
                raise ServerError(f"{url}: not healthy within {timeout:g} s (last: {last})")
            time.sleep(poll)
