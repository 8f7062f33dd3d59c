"""An async client for an OpenAI-compatible completions server (vLLM, SGLang, TGI, llama.cpp).

One httpx connection pool for the whole audit, sized to the largest batch, so concurrent
requests are never queued on the client side. Every way a server can fail (nothing listening,
not OpenAI-compatible, unknown model, no logprobs, HTTP errors, a dropped connection, a
timeout) becomes one EndpointError line that names the server and what to do.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from mgbench.analysis.divergence import Decoded
from mgbench.errors import UserError

TOKEN_ID_PREFIX = "token_id:"  # vLLM's key for top logprobs with return_tokens_as_token_ids


class EndpointError(UserError):
    """The server could not be audited: one line, exit code 2, committed groups kept for --resume."""


@dataclass(frozen=True)
class EndpointOptions:
    """What the endpoint audit needs beyond RunOptions; validated once at the edge."""

    url: str  # the server's base, e.g. http://127.0.0.1:8000/v1
    served_model: str | None = None  # None: the one model /v1/models lists
    top_logprobs: int = 5
    request_timeout: float = 300.0  # seconds per completion
    needle: bool = False
    label: str | None = None  # the engine's name in reports (default: server, version, model)
    replica: int | None = None  # its index among the replicas of `--endpoint URL1,URL2,...` (None: one server)

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise UserError(f"--endpoint {self.url!r}: give the server's base URL, e.g. http://127.0.0.1:8000/v1")
        if self.top_logprobs < 2:
            raise UserError(f"--top-logprobs {self.top_logprobs}: the margin needs the top 2 at least")
        if not self.request_timeout > 0:
            raise UserError(f"--request-timeout {self.request_timeout}: use a positive number of seconds")

    @property
    def base(self) -> str:
        return self.url.rstrip("/")

    def fingerprint(self) -> dict:
        """What a --resume must keep (a longer timeout after a timeout is fine)."""
        return {
            "url": self.base,
            "served_model": self.served_model,
            "top_logprobs": self.top_logprobs,
            "needle": self.needle,
        }


@dataclass
class ServerInfo:
    """What the server says about itself, for the manifest."""

    url: str
    served_model: str
    model_entry: dict
    version: str | None = None
    system_fingerprint: str | None = None
    prompt_format: str = "token-ids"  # or "text", for a server that refuses token-id prompts
    notes: list[str] = field(default_factory=list)
    props: dict | None = None  # llama.cpp's GET /props (slots, build, generation defaults)
    salt_refused: bool = False  # the first completion was refused for its cache_salt

    @property
    def takes_cache_prompt(self) -> bool:
        """llama.cpp (it answers /props) reuses a cached prompt prefix unless told not to."""
        return self.props is not None

    @property
    def takes_cache_salt(self) -> bool:
        """Any other server (vLLM's prefix cache is on by default) is sent a cache_salt, which
        vLLM hashes into every cached block: a request can only hit what one with its salt left."""
        return not self.takes_cache_prompt and not self.salt_refused

    @property
    def cold_requests(self) -> str:
        """How a request meant to be computed afresh is kept off the server's prefix cache."""
        if self.takes_cache_prompt:
            return "cache_prompt false"
        return "cache_salt of its own" if self.takes_cache_salt else "as the server caches (cache_salt refused)"

    def to_dict(self) -> dict:
        return {
            "url": self.url,
            "served_model": self.served_model,
            "models_entry": self.model_entry,
            "server_version": self.version,
            "system_fingerprint": self.system_fingerprint,
            "prompt_format": self.prompt_format,
            "notes": self.notes,
            "cold_requests": self.cold_requests,
            **({"props": self.props} if self.props is not None else {}),
        }


def _first_line(text: str, limit: int = 300) -> str:
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def server_message(response: httpx.Response) -> str:
    """The server's own error message (OpenAI error JSON, FastAPI detail, or the body's first line)."""
    try:
        body = response.json()
    except ValueError:
        return _first_line(response.text) or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return _first_line(str(error["message"]))
        if isinstance(error, str):
            return _first_line(error)
        if body.get("detail"):
            return _first_line(str(body["detail"]))
        if body.get("message"):
            return _first_line(str(body["message"]))
    return _first_line(response.text)


class EndpointClient:
    """Completions against one served model; use inside one event loop (`async with`)."""

    def __init__(self, options: EndpointOptions, concurrency: int):
        self.options = options
        limits = httpx.Limits(max_connections=max(concurrency, 1), max_keepalive_connections=max(concurrency, 1))
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(options.request_timeout, connect=10.0), limits=limits, trust_env=False
        )
        self.info: ServerInfo | None = None

    async def __aenter__(self) -> "EndpointClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.aclose()

    # -- transport ---------------------------------------------------------------------------------

    async def _request(self, method: str, path: str, what: str, **kwargs) -> httpx.Response:
        url = self.options.base + path
        try:
            return await self.http.request(method, url, **kwargs)
        except httpx.ConnectError as exc:
            raise EndpointError(
                f"nothing is listening at {self.options.base} ({_reason(exc)}): start the server "
                "or fix --endpoint" + self._resume_hint()
            ) from None
        except httpx.TimeoutException:
            raise EndpointError(
                f"{what}: no answer from {self.options.base} within --request-timeout "
                f"{self.options.request_timeout:g} s; raise it (a busy CPU server is slow)" + self._resume_hint()
            ) from None
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            raise EndpointError(
                f"{what}: the server at {self.options.base} dropped the connection mid-run "
                f"({_reason(exc)}); was it stopped?" + self._resume_hint()
            ) from None
        except httpx.HTTPError as exc:
            raise EndpointError(
                f"{what}: {type(exc).__name__} talking to {self.options.base} ({_reason(exc)})" + self._resume_hint()
            ) from None

    def _resume_hint(self) -> str:
        # Once the audit began, finished groups are committed: say how to finish the run.
        return " (finished groups are kept: restart the server, then rerun with --resume)" if self.info else ""

    # -- discovery ---------------------------------------------------------------------------------

    async def discover(self) -> ServerInfo:
        """The served model from /v1/models, the server's version where it reports one."""
        response = await self._request("GET", "/models", "GET /models")
        entries = None
        if response.status_code == 200:
            try:
                body = response.json()
                entries = body.get("data") if isinstance(body, dict) else None
            except ValueError:
                entries = None
        if not isinstance(entries, list) or not all(isinstance(e, dict) and "id" in e for e in entries):
            raise EndpointError(
                f"{self.options.base} answered GET /models with HTTP {response.status_code} "
                f"({server_message(response)[:120]}), not an OpenAI model list: is --endpoint an "
                "OpenAI-compatible server's base URL (ending in /v1)?"
            )
        ids = [str(e["id"]) for e in entries]
        wanted = self.options.served_model
        if wanted is None:
            if len(ids) != 1:
                listed = ", ".join(ids) if ids else "none"
                raise EndpointError(
                    f"{self.options.base} serves {len(ids)} models ({listed}): choose one with --served-model NAME"
                )
            wanted = ids[0]
        if wanted not in ids:
            raise EndpointError(
                f"{self.options.base} does not serve {wanted!r} (it serves {', '.join(ids)}): fix --served-model"
            )
        info = ServerInfo(self.options.base, wanted, entries[ids.index(wanted)])
        version = await self._root_json("/version")
        info.version = str(version["version"]) if version and version.get("version") is not None else None
        info.props = await self._root_json("/props")
        if info.props is not None and info.version is None and info.props.get("build_info"):
            info.version = str(info.props["build_info"])
        return info

    async def _root_json(self, path: str) -> dict | None:
        """A JSON object the server answers beside /v1 (vLLM and SGLang: /version; llama.cpp:
        /props), or None where it has none."""
        parts = urlsplit(self.options.base)
        try:
            response = await self.http.get(f"{parts.scheme}://{parts.netloc}{path}", timeout=10.0)
            body = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        return body if isinstance(body, dict) else None

    async def start(self, first_prompt: list[int], prompt_text: str) -> ServerInfo:
        """Discover the server and check, with one short completion, that it takes token-id
        prompts (else text, said in the manifest) and returns top-k logprobs by token id."""
        info = await self.discover()
        for _ in range(3):  # a refused cache_salt and refused token ids, in whichever order they come
            prompt = first_prompt if info.prompt_format == "token-ids" else prompt_text
            response = await self._request(
                "POST", "/completions", "the first completion", json=self._body(info, prompt, 2)
            )
            if response.status_code not in (400, 422):
                break
            if info.takes_cache_salt and "cache_salt" in response.text:  # the whole body: pydantic lists fields
                info.salt_refused = True
                info.notes.append(
                    f"cache_salt refused ({server_message(response)[:120]}): a request repeated may be "
                    "answered from the server's prefix cache, if it has one on"
                )
            elif info.prompt_format == "token-ids" and _refuses_token_ids(server_message(response)):
                info.prompt_format = "text"
                info.notes.append(f"token-id prompts refused ({server_message(response)[:120]}): prompts sent as text")
            else:
                break
        self._parse(response, "the first completion", info)
        self.info = info
        return info

    # -- completions -------------------------------------------------------------------------------

    def _body(self, info: ServerInfo, prompt, max_tokens: int, warm: str | None = None, fill: bool = False) -> dict:
        return {
            "model": info.served_model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": self.options.top_logprobs,
            "stream": False,
            # vLLM: the emitted ids, and top logprobs keyed by id (ids that decode alike do not collapse).
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            # Every request is computed afresh (a cached prefix would make "solo twice" trivial and
            # the batched answer partly warm), except a `warm` request of the prefix-cache axis,
            # which reuses its pair's first. llama.cpp: cache_prompt false; its pair's `fill` is
            # false too, since a slot keeps every prompt all the same and a first true would reuse
            # whatever prefix the requests before it left. Other servers (vLLM): a cache_salt of
            # the request's own, the warm pair one they share.
            **({"cache_prompt": warm is not None and not fill} if info.takes_cache_prompt else {}),
            **({"cache_salt": warm or uuid.uuid4().hex} if info.takes_cache_salt else {}),
        }

    async def complete(
        self, prompt_ids: list[int], prompt_text: str, max_tokens: int, warm: str | None = None, fill: bool = False
    ) -> Decoded:
        """One greedy completion; `warm` (a key that requests sharing a cache share): the server may
        reuse the prompt cached by an earlier request with the same key (llama.cpp's cache_prompt;
        vLLM's cache_salt; a server that refused cache_salt caches as it was started to); `fill`:
        the key's first request, its prompt computed afresh and left cached for the next."""
        info = self.info
        prompt = prompt_ids if info.prompt_format == "token-ids" else prompt_text
        response = await self._request(
            "POST", "/completions", "a completion", json=self._body(info, prompt, max_tokens, warm, fill)
        )
        return self._parse(response, "a completion", info)

    def _parse(self, response: httpx.Response, what: str, info: ServerInfo) -> Decoded:
        hint = self._resume_hint()
        if response.status_code != 200:
            cause = "; the server's log has the cause" if response.status_code >= 500 else ""
            raise EndpointError(
                f"{what}: {info.url} answered HTTP {response.status_code}: {server_message(response)}{cause}" + hint
            )
        try:
            body = response.json()
            choice = body["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            raise EndpointError(f"{what}: {info.url} answered without an OpenAI completion (no choices)") from None
        info.system_fingerprint = body.get("system_fingerprint") or info.system_fingerprint
        logprobs = choice.get("logprobs") or {}
        # Two shapes, told apart by the response: llama.cpp's per-token `content` entries carry
        # ids; vLLM's parallel lists carry top logprobs keyed "token_id:N".
        content = logprobs.get("content") if isinstance(logprobs, dict) else None
        if isinstance(content, list):
            ids, tops = _content_entries(content, what, info.url)
        else:
            ids, tops = _parallel_lists(choice, logprobs, what, info.url)
        if not tops or any(not entry for entry in tops):
            raise EndpointError(
                f"{what}: {info.url} returned no top logprobs (asked for "
                f"{self.options.top_logprobs}); margins need them: enable logprobs on the server "
                "(vLLM: --max-logprobs)"
            )
        if any(len(entry) < 2 for entry in tops):
            raise EndpointError(f"{what}: {info.url} returned fewer than 2 top logprobs per token; margins need 2")
        if len(ids) != len(tops):
            raise EndpointError(f"{what}: {info.url} returned {len(ids)} token ids but {len(tops)} logprob entries")
        return Decoded(ids, tops)


def _reason(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    return _first_line(text, 160)


def _refuses_token_ids(message: str) -> bool:
    lowered = message.lower()
    return "prompt" in lowered and ("token" in lowered or "list" in lowered or "string" in lowered)


def _token_id(key: str, what: str, url: str) -> int:
    if isinstance(key, str) and key.startswith(TOKEN_ID_PREFIX):
        return int(key[len(TOKEN_ID_PREFIX) :])
    raise EndpointError(
        f"{what}: {url} keys its logprobs by token text ({key!r}), not by id: ids that decode "
        "alike would collapse; use a server that honours return_tokens_as_token_ids (vLLM)"
    )


def _by_token_id(entry: dict, what: str, url: str) -> dict[int, float]:
    return {_token_id(key, what, url): float(value) for key, value in entry.items()}


def _parallel_lists(choice: dict, logprobs, what: str, url: str) -> tuple[list[int], list[dict[int, float]]]:
    """vLLM's shape: `token_ids` beside `logprobs.top_logprobs`, a list of {"token_id:N": logprob}."""
    top = logprobs.get("top_logprobs") if isinstance(logprobs, dict) else None
    if not top:
        return [], []
    tops = [_by_token_id(entry, what, url) if entry else {} for entry in top]
    ids = choice.get("token_ids")
    if ids is None:  # servers without return_token_ids: the emitted tokens, keyed like the top logprobs
        ids = [_token_id(t, what, url) for t in logprobs.get("tokens") or []]
    return [int(i) for i in ids], tops


def _content_entries(content: list, what: str, url: str) -> tuple[list[int], list[dict[int, float]]]:
    """llama.cpp's shape: `logprobs.content[i] = {id, token, logprob, top_logprobs: [{id, logprob}]}`."""
    try:
        ids = [int(entry["id"]) for entry in content]
        tops = [{int(t["id"]): float(t["logprob"]) for t in entry.get("top_logprobs") or []} for entry in content]
    except (KeyError, TypeError, ValueError):
        raise EndpointError(
            f"{what}: {url} returned logprobs.content entries without token ids (id, top_logprobs[].id)"
        ) from None
    return ids, tops
