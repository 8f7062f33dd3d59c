"""Is mgbench's client ever what limits the server? Its batched pass against a bare client.

Same server, same prompts (chat-templated token ids), same concurrency: mgbench's endpoint
client (httpx pool, batches released together: exactly the code of the batched pass) against
a bare client (urllib in threads, no pool). Repeats alternate between the two; prints tokens/s
of each and the ratio (target: mgbench >= 0.95 of bare).

    python examples/bench_endpoint.py --endpoint http://127.0.0.1:8000/v1 --limit 16 --batch-size 8
    python examples/bench_endpoint.py              # starts vLLM's CPU build itself (make vllm)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mgbench.assets import datasets
from mgbench.assets.models import load_tokenizer
from mgbench.engines.endpoint.client import EndpointClient, EndpointOptions
from mgbench.engines.endpoint.local_server import LocalServer
from mgbench.engines.endpoint.release import release_together


def bare_pass(url: str, model: str, prompts: list[list[int]], batch: int, tokens: int) -> tuple[int, float]:
    """(completion tokens, seconds) with plain urllib, `batch` requests at a time in threads."""

    def one(prompt):
        body = json.dumps(
            {
                "model": model,
                "prompt": prompt,
                "max_tokens": tokens,
                "temperature": 0,
                "logprobs": 5,
                "return_token_ids": True,
                "return_tokens_as_token_ids": True,
                # computed afresh, as mgbench's requests are (vLLM's prefix cache is on by default)
                "cache_salt": uuid.uuid4().hex,
            }
        ).encode()
        request = urllib.request.Request(url + "/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            return len(json.load(response)["choices"][0]["token_ids"])

    total, seconds = 0, 0.0
    with ThreadPoolExecutor(batch) as pool:
        for start in range(0, len(prompts), batch):
            began = time.perf_counter()
            total += sum(pool.map(one, prompts[start : start + batch]))
            seconds += time.perf_counter() - began
    return total, seconds


async def mgbench_pass(client: EndpointClient, prompts, batch: int, tokens: int) -> tuple[int, float]:
    total, seconds = 0, 0.0
    for start in range(0, len(prompts), batch):
        calls = [lambda p=p: client.complete(p, "", tokens) for p in prompts[start : start + batch]]
        answers, elapsed = await release_together(calls)
        total, seconds = total + sum(len(a.token_ids) for a in answers), seconds + elapsed
    return total, seconds


def bench(url: str, args) -> None:
    tokenizer, _ = load_tokenizer(args.model)
    config = datasets.load_config(args.dataset)
    requests = datasets.select_requests(config, datasets.read_records(config), args.limit, 0)
    prompts = [datasets.encode(tokenizer, config, r.text) for r in requests]
    loop = asyncio.new_event_loop()
    client = EndpointClient(EndpointOptions(url), args.batch_size)
    info = loop.run_until_complete(client.start(prompts[0], ""))
    loop.run_until_complete(mgbench_pass(client, prompts[: args.batch_size], args.batch_size, 4))  # warm-up
    rates = {"mgbench": [], "bare": []}
    for repeat in range(args.repeats):
        for name in ("mgbench", "bare") if repeat % 2 == 0 else ("bare", "mgbench"):
            if name == "mgbench":
                tokens, seconds = loop.run_until_complete(
                    mgbench_pass(client, prompts, args.batch_size, args.max_new_tokens)
                )
            else:
                tokens, seconds = bare_pass(url, info.served_model, prompts, args.batch_size, args.max_new_tokens)
            rates[name].append(tokens / seconds)
            print(
                f"repeat {repeat}: {name:8s} {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.2f} tok/s",
                flush=True,
            )
    loop.run_until_complete(client.http.aclose())
    loop.close()
    ours, bare = statistics.median(rates["mgbench"]), statistics.median(rates["bare"])
    print(
        f"\n{info.served_model} at {url} ({info.version or 'version unknown'}), {len(prompts)} requests, "
        f"concurrency {args.batch_size}, {args.max_new_tokens} tokens, {args.repeats} repeats"
    )
    print(f"{'client':10s} {'median tok/s':>14s} {'min':>8s} {'max':>8s}")
    for name, values in rates.items():
        print(f"{name:10s} {statistics.median(values):14.2f} {min(values):8.2f} {max(values):8.2f}")
    print(f"mgbench / bare = {ours / bare:.3f} (target >= 0.95)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", default=None, help="server base URL (default: start vLLM's CPU build)")
    parser.add_argument("--model", default="smollm2-135m", help="tokenizer source (alias or folder)")
    parser.add_argument("--dataset", default="math500")
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    if args.endpoint:
        bench(args.endpoint, args)
        return 0
    log = Path("reports") / f"bench-endpoint-vllm-{time.strftime('%Y%m%d-%H%M%S')}.log"
    with LocalServer.vllm_cpu(log) as server:
        print(f"vLLM ready after {server.wait_ready():.0f} s on {server.url}", flush=True)
        bench(server.url, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
