"""`make demo-vllm`: a real vLLM audit on this machine, start to finish.

Serves the default model with vLLM's CPU build (examples/serve_vllm_cpu.sh, eager) on a free
loopback port, waits until it answers, audits it on math500 with `mgbench flips --endpoint`,
prints the report, renders report.md, and stops the server by its PID (also on failure).

    python examples/demo_vllm.py [--limit 8] [--batch-size 8] [--max-new-tokens 32] [-- EXTRA VLLM ARGS]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from mgbench.engines.endpoint.local_server import VLLM_VENV, LocalServer

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None, help="run directory (default: reports/flips-vllm-TIME)")
    parser.add_argument("vllm_args", nargs="*", help="extra vLLM arguments (after --), e.g. --no-enforce-eager")
    args = parser.parse_args()
    if not (VLLM_VENV / "bin" / "python").exists():
        print(f"error: no vLLM venv at {VLLM_VENV}; run `make vllm` first", file=sys.stderr)
        return 2
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or ROOT / "reports" / f"flips-vllm-math500-{stamp}"
    server = LocalServer.vllm_cpu(ROOT / "reports" / f"vllm-server-{stamp}.log", extra_args=args.vllm_args)
    print(f"starting vLLM on {server.url} (log: {server.log}); the CPU build takes one to three minutes", flush=True)
    with server:
        print(f"vLLM answers after {server.wait_ready():.0f} s", flush=True)
        mgbench = [sys.executable, "-m", "mgbench"]
        label = "vLLM compiled" if "--no-enforce-eager" in args.vllm_args else "vLLM eager"
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
