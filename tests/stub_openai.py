"""A small OpenAI-compatible completions server in a thread, for fault and resume tests.

Greedy completions are a pure function of the prompt ids (so solo and batched agree unless a
test asks otherwise), with vLLM's response shape (`token_ids`, top logprobs keyed `token_id:N`) or,
with `llamacpp=True`, llama.cpp's (`logprobs.content[i] = {id, logprob, top_logprobs: [{id,
logprob}]}`, GET /props and no /version).
`mode` picks a fault: "ok", "not-openai", "no-logprobs", "text-keys", "http-500", "drop"
(close the connection without an answer), "slow" (sleep `delay` seconds, then answer),
"not-json" (HTTP 200 with an HTML body), "unstable" (a prompt's every answer differs from its
last one at step 1: a server not deterministic alone), "strict" (HTTP 422 for a request that
carries cache_salt, as a server that refuses fields it does not know), "strict-text" (the same,
and HTTP 400 for a token-id prompt, checked first); `short_at` ends every answer after that
many tokens (finish_reason "stop");
`fail_after` lets that many completions succeed first. Bound to 127.0.0.1 on a free port;
`stop()` shuts it down.

PLANTED BATCH VARIANCE (`flip_when_concurrent`), certain on a loaded machine: an audit sends each
request alone, then in batches of `batch` released together, then alone again. A run starts with
GET /v1/models, which restarts the count; a prompt's second full-length completion in a run is its
batched one, and it waits at a barrier until `batch` such requests are in flight together (no
guess at how close in time they arrive). Released together, they are answered with drift and a
flip at step 2; a barrier that breaks (the batch was not sent together, or a partner failed)
answers as alone, and the test that expected the variance fails.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def greedy_tokens(prompt: list[int], max_tokens: int, flip_at: int | None = None) -> list[int]:
    tokens = [(sum(prompt) * 31 + 7 * step) % 997 + 3 for step in range(max_tokens)]
    if flip_at is not None and flip_at < max_tokens:
        tokens[flip_at] += 1
    return tokens


class StubState:
    def __init__(
        self,
        mode: str = "ok",
        fail_after: int = 0,
        models=("stub-model",),
        flip_when_concurrent=False,
        llamacpp=False,
        shift_at: int | None = None,
        batch: int = 2,
        delay: float = 3.0,
        short_at: int | None = None,
        warm_flip: tuple[int, float] | None = None,
        flip_on_sending: int | None = None,
    ):
        self.mode, self.fail_after, self.models = mode, fail_after, list(models)
        self.flip_when_concurrent, self.llamacpp = flip_when_concurrent, llamacpp
        # PLANTED OUTPUT CHANGE: every answer's token at step `shift_at` is moved by one, alone or not
        # (as another node's server might answer).
        self.shift_at = shift_at
        self.delay, self.short_at = delay, short_at
        # PLANTED PREFIX-CACHE VARIANCE (`warm_flip` = (step, margin)): a completion that finds its
        # prompt cached moves its token at `step` by one, with a top-1/top-2 margin of `margin`.
        # llama.cpp-shaped: a cache_prompt request whose prompt was answered before in this run
        # (either way, as a slot keeps every prompt). vLLM-shaped (prefix cache on): any request
        # whose prompt an earlier one with the same cache_salt, or none, left cached.
        self.warm_flip, self.cached = warm_flip, set()
        # PLANTED RUN-TO-RUN VARIANCE (`flip_on_sending` = n): a prompt's n-th full-length completion
        # of a run (its load's second run, in an audit of the repeat axis alone) flips at step 2, as a
        # load batched otherwise the second time would.
        self.flip_on_sending = flip_on_sending
        self.answers: Counter = Counter()  # completions answered per prompt ("unstable")
        self.bodies: list[dict] = []  # every completion request received
        self.completions = 0
        self.seen: Counter = Counter()  # full-length completions of each prompt in this run
        self.batch = batch
        self.barrier = threading.Barrier(batch)
        self.lock = threading.Lock()

    def break_barrier(self) -> None:
        """A failed request: whoever waits for it is answered as alone; later batches get a new barrier."""
        with self.lock:
            self.barrier.abort()
            self.barrier = threading.Barrier(self.batch)

    def released_together(self, body: dict) -> bool:
        """Whether this request is its prompt's batched one and `batch` of them were in flight together."""
        prompt = body["prompt"]
        key = (tuple(prompt) if isinstance(prompt, list) else prompt, int(body["max_tokens"]))
        with self.lock:
            self.seen[key] += 1
            batched = self.seen[key] == 2 and int(body["max_tokens"]) > 2  # not the start check's 2 tokens
            barrier = self.barrier
        if not (self.flip_when_concurrent and batched):
            return False
        try:
            barrier.wait(timeout=120)
        except threading.BrokenBarrierError:
            return False
        return True


def _warm_flip(state: StubState, body: dict, ids: list[int]) -> tuple[int, float] | None:
    """(step, margin) of the planted prefix-cache flip where this completion hits the stub's cache."""
    if state.warm_flip is None or int(body["max_tokens"]) <= 2:
        return None
    key = (body.get("cache_salt"), tuple(ids))
    with state.lock:
        hit = key in state.cached and (bool(body.get("cache_prompt")) or not state.llamacpp)
        state.cached.add(key)
    return state.warm_flip if hit else None


def _completion(state: StubState, body: dict, concurrent: bool) -> dict:
    prompt = body["prompt"]
    ids = prompt if isinstance(prompt, list) else [ord(c) for c in prompt]
    varies = state.flip_when_concurrent and concurrent  # the planted batch variance: drift, then a flip
    key = (tuple(ids) if isinstance(prompt, list) else prompt, int(body["max_tokens"]))
    if state.flip_on_sending is not None and state.seen[key] == state.flip_on_sending:
        varies = True
    warm = _warm_flip(state, body, ids)
    flip_at = 2 if varies else warm[0] if warm else None
    tokens = greedy_tokens(ids, int(body["max_tokens"]), flip_at)
    if state.shift_at is not None and state.shift_at < len(tokens):
        tokens[state.shift_at] += 1
    if state.mode == "unstable" and len(tokens) > 1:
        with state.lock:
            state.answers[tuple(ids)] += 1
            tokens[1] += state.answers[tuple(ids)]
    if state.short_at is not None:
        tokens = tokens[: state.short_at]
    k = int(body.get("logprobs") or 0)
    top = [
        {f"token_id:{t + j}": -0.25 * (j + 1) + (0.125 if varies and j == 1 else 0.0) for j in range(k)} for t in tokens
    ]
    if warm and warm[0] < len(tokens) and k > 1:  # the cached answer's flipped step: a near-tie of `margin`
        top[warm[0]] = {f"token_id:{tokens[warm[0]] + j}": -0.25 - warm[1] * j for j in range(k)}
    if state.mode == "text-keys":
        top = [{f"tok{j}": v for j, v in enumerate(entry.values())} for entry in top]
    logprobs = (
        None
        if state.mode == "no-logprobs" or k == 0
        else {"tokens": [f"token_id:{t}" for t in tokens], "top_logprobs": top}
    )
    if state.llamacpp:
        return {"choices": [{"index": 0, "text": "", "logprobs": _content(tokens, top) if logprobs else None}]}
    return {
        "id": "cmpl-stub",
        "object": "text_completion",
        "model": body["model"],
        "system_fingerprint": "stub-1",
        "choices": [
            {
                "index": 0,
                "text": "",
                "token_ids": tokens,
                "logprobs": logprobs,
                "finish_reason": "length" if len(tokens) == int(body["max_tokens"]) else "stop",
            }
        ],
    }


def _content(tokens: list[int], top: list[dict]) -> dict:
    """llama.cpp's logprobs: one entry per emitted token, ids beside the text."""
    entries = []
    for token, entry in zip(tokens, top):
        ranked = [{"id": int(key.split(":")[1]), "token": "", "bytes": [], "logprob": v} for key, v in entry.items()]
        entries.append({"id": token, "token": "", "bytes": [], "logprob": ranked[0]["logprob"], "top_logprobs": ranked})
    return {"content": entries}


class _Handler(BaseHTTPRequestHandler):
    state: StubState

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, status: int, payload, content_type: str = "application/json") -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            with self.state.lock:
                self.state.seen.clear()  # a new run
                self.state.cached.clear()
        if self.state.mode == "not-openai":
            self._send(404, b"<html><body>Not Found</body></html>", "text/html")
        elif self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in self.state.models]})
        elif self.path == "/version" and not self.state.llamacpp:
            self._send(200, {"version": "0.0-stub"})
        elif self.path == "/props" and self.state.llamacpp:
            self._send(200, {"total_slots": 8, "build_info": "b1-stub", "model_path": "stub.gguf"})
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        state = self.state
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/completions":
            self._send(404, {"detail": "Not Found"})
            return
        if body["model"] not in state.models:
            self._send(404, {"error": {"message": f"The model `{body['model']}` does not exist.", "code": 404}})
            return
        if state.mode == "strict-text" and isinstance(body["prompt"], list):  # checked first: ids, then fields
            self._send(400, {"error": {"message": "prompt: Input should be a valid string"}})
            return
        if state.mode in ("strict", "strict-text") and "cache_salt" in body:  # refuses fields it does not know
            self._send(422, {"detail": [{"loc": ["body", "cache_salt"], "msg": "Extra inputs are not permitted"}]})
            return
        with state.lock:
            state.bodies.append(body)
            state.completions += 1
            failing = state.mode in ("http-500", "drop", "slow", "not-json") and state.completions > state.fail_after
        if failing and state.mode == "http-500":
            state.break_barrier()
            self._send(
                500,
                {
                    "error": {
                        "message": "TypeError: 'function' object is not subscriptable",
                        "type": "InternalServerError",
                        "code": 500,
                    }
                },
            )
            return
        if failing and state.mode == "drop":
            state.break_barrier()
            self.close_connection = True
            self.connection.close()
            return
        if failing and state.mode == "slow":
            time.sleep(state.delay)
        if failing and state.mode == "not-json":
            self._send(200, b"<html><body>Bad Gateway</body></html>", "text/html")
            return
        self._send(200, _completion(state, body, state.released_together(body)))


class _QuietServer(ThreadingHTTPServer):
    allow_reuse_address = True  # a restart on the same port (resume tests)
    daemon_threads = True

    def handle_error(self, request, client_address):
        """A client that hung up (the audit stopping at a fault while another request is in flight)
        is not the stub's error: socketserver would print its traceback to sys.stderr, which an
        in-process CLI run under test may be capturing."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class StubServer:
    def __init__(self, state: StubState | None = None, port: int = 0):
        self.state = state or StubState()
        handler = type("Handler", (_Handler,), {"state": self.state})
        self.httpd = _QuietServer(("127.0.0.1", port), handler)
        # shutdown() waits for the serve loop's next poll: 0.5 s by default, at every stub's stop
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> "StubServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
