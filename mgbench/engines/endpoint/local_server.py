"""A server process on a free loopback port, started and stopped by its own PID (demo, tests, bench).

`examples/serve_vllm_cpu.sh` and `examples/serve_llamacpp.sh` exec their server in the foreground;
this starts one in a new session, so stopping it (SIGTERM to its process group, SIGKILL after a
grace period) also stops the engine processes vLLM spawns, and nothing else on the machine is
touched.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SERVE_VLLM_CPU = ROOT / "examples" / "serve_vllm_cpu.sh"
VLLM_VENV = ROOT / ".venv-vllm"
SERVE_LLAMACPP = ROOT / "examples" / "serve_llamacpp.sh"
BUILD_LLAMACPP = ROOT / "examples" / "build_llamacpp.sh"
LLAMACPP_VARIANTS = ("default", "nollamafile")  # the build with GGML_LLAMAFILE=OFF


def llamacpp_build(variant: str = "default") -> tuple[Path, Path]:
    """(llama-server binary, bf16 GGUF) of `make llamacpp`'s cached build; they may not exist yet."""
    server = subprocess.run([str(BUILD_LLAMACPP), "--server", variant], capture_output=True, text=True, check=True)
    gguf = subprocess.run([str(BUILD_LLAMACPP), "--gguf"], capture_output=True, text=True, check=True)
    return Path(server.stdout.strip()), Path(gguf.stdout.strip())


# Ports picked below Linux's ephemeral range (32768-60999): the kernel hands those to every outgoing
# connection and port-0 bind, so a port it just reported free may be taken again before the server
# binds it; a random port here is only taken by another explicit pick.
PICKED_PORTS = range(20000, 32000)
BIND_FAILURES = ("address already in use", "couldn't bind", "failed to bind", "errno 98")


def free_port() -> int:
    """A loopback port nothing listens on now, picked at random outside the ephemeral range."""
    pick = random.Random(os.urandom(8))
    for _ in range(50):
        port = pick.choice(PICKED_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LocalServer:
    """One server process; `url` is its OpenAI base (http://127.0.0.1:PORT/v1)."""

    def __init__(self, command: list[str], port: int, log: Path, env: dict | None = None, picked: bool = False):
        self.command, self.port, self.log, self.env = command, port, log, env
        self.picked = picked  # the port was picked here: a bind that fails moves to another one
        self.process: subprocess.Popen | None = None

    @classmethod
    def vllm_cpu(cls, log: Path, port: int | None = None, extra_args: list[str] = (), env: dict | None = None):
        """The default model on vLLM's CPU build (`make vllm`), eager unless extra_args say otherwise."""
        picked, port = port is None, port or free_port()
        return cls([str(SERVE_VLLM_CPU), str(port), *extra_args], port, log, env, picked)

    @classmethod
    def llamacpp(
        cls, log: Path, port: int | None = None, extra_args: list[str] = (), variant: str = "default"
    ) -> "LocalServer":
        """The default model on llama.cpp's server (`make llamacpp`), -np 8 unless extra_args say
        otherwise; `variant` nollamafile: the build with GGML_LLAMAFILE=OFF."""
        picked, port = port is None, port or free_port()
        env = {"MGBENCH_LLAMACPP_VARIANT": variant}
        return cls([str(SERVE_LLAMACPP), str(port), *extra_args], port, log, env, picked)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> "LocalServer":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.log, "ab")
        env = {**os.environ, **(self.env or {})}
        self.process = subprocess.Popen(
            self.command, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=ROOT
        )
        handle.close()
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_ready(self, timeout: float = 900.0) -> float:
        """Seconds until GET /v1/models answers 200; RuntimeError (with the log's tail) if the
        process exits or the time runs out."""
        started, moves = time.monotonic(), 0
        while time.monotonic() - started < timeout:
            if not self.alive() and self.picked and moves < 3 and self.lost_its_port():
                self.move_to(free_port())  # taken between the pick and the bind: another port
                moves += 1
                continue
            if not self.alive():
                raise RuntimeError(
                    f"server exited with code {self.process.returncode} before answering; log tail:\n{self.log_tail()}"
                )
            try:
                # A ready server lists its models in milliseconds; a short wait keeps a port that
                # accepts but never answers (taken by another process) from stalling the port check.
                with urllib.request.urlopen(self.url + "/models", timeout=1) as response:
                    if response.status == 200:
                        return time.monotonic() - started
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server did not answer within {timeout:.0f} s; log tail:\n{self.log_tail()}")

    def lost_its_port(self) -> bool:
        return any(failure in self.log_tail(40).lower() for failure in BIND_FAILURES)

    def move_to(self, port: int) -> None:
        """Start again on `port` (the command names its port as its first argument)."""
        self.stop()
        self.command = [self.command[0], str(port), *self.command[2:]]
        self.port = port
        self.start()

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM to the server's process group (its PID leads it), SIGKILL after `grace` s; then
        SIGKILL to whatever of the group outlived its leader (engine workers)."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=grace)

    def kill(self) -> None:
        """SIGKILL the whole process group at once: a server that dies mid-run."""
        if self.alive():
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> "LocalServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
