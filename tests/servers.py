"""The real servers the selected tests talk to, started as the session starts (conftest's
`pytest_collection_finish`) and stopped when it ends, each on a free loopback port and by its PID.

A vLLM CPU server takes about 45 s to start on 2 cores, nearly all of it one core's Python
imports and warm-up; llama.cpp's two take about 12 s. Started before the first test rather than
when the first test that needs them runs, they come up while the in-process tests run, which
mostly keep one core busy. Only the servers some selected test asks for (by fixture name) are
started: the fast loop starts none.
"""

from __future__ import annotations

from pathlib import Path

from mgbench.engines.endpoint.local_server import VLLM_VENV, LocalServer, llamacpp_build

# fixture name -> what it needs; the fixtures themselves (conftest) wait for the servers.
VLLM, LLAMACPP = "vllm", "llamacpp_servers"
_started: dict[str, object] = {}
_missing: dict[str, str] = {}


def start_for(fixtures: set[str], logs: Path) -> None:
    """Start (not wait for) the servers that `fixtures` name; what cannot start is kept as a reason."""
    if VLLM in fixtures:
        if (VLLM_VENV / "bin" / "python").exists():
            _started[VLLM] = LocalServer.vllm_cpu(logs / "vllm.log", extra_args=["--prefix-caching"]).start()
        else:
            _missing[VLLM] = f"no vLLM venv at {VLLM_VENV}: run `make vllm` (make test does) before these tests"
    if LLAMACPP in fixtures:
        server, gguf = llamacpp_build()
        if server.exists() and gguf.exists():
            _started[LLAMACPP] = {
                "np1": LocalServer.llamacpp(logs / "llamacpp-np1.log", extra_args=["-np", "1"]).start(),
                "np8": LocalServer.llamacpp(logs / "llamacpp-np8.log").start(),
            }
        else:
            _missing[LLAMACPP] = f"no llama.cpp build at {server} (or no GGUF at {gguf}): run `make llamacpp`"


def ready(name: str, timeout: float = 900.0):
    """The started server(s) of fixture `name`, once they answer; a failure (not a skip) where
    they could not start."""
    import pytest

    if name in _missing:
        pytest.fail(_missing[name])
    started = _started.get(name)
    if started is None:
        pytest.fail(f"{name} was not started at the session's start (conftest's pytest_collection_finish)")
    for server in started.values() if isinstance(started, dict) else [started]:
        server.wait_ready(timeout=timeout)
    return started


def stop_all() -> None:
    for started in _started.values():
        for server in started.values() if isinstance(started, dict) else [started]:
            server.stop()
    _started.clear()
