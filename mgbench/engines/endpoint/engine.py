"""The endpoint engine: an OpenAI-compatible server behind the flips audit's engine interface."""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from importlib.metadata import version as package_version

from mgbench.assets import datasets
from mgbench.assets.needle import filler_prompts
from mgbench.engines.endpoint.audit import audit_group
from mgbench.engines.endpoint.client import EndpointClient, EndpointOptions, ServerInfo
from mgbench.engines.interface import run_options
from mgbench.runs.groups import wanted_groups

FILLERS = 16  # needle mode: filler requests drawn from outside the audited selection


class EndpointEngine:
    method = "first-divergence"

    def __init__(self, options: EndpointOptions, tokenizer, model_source: str, concurrency: int):
        self.options, self.tokenizer, self.model_source = options, tokenizer, model_source
        self.loop = asyncio.new_event_loop()
        self.client = EndpointClient(options, concurrency)
        self.info: ServerInfo | None = None
        self.label = options.label or "endpoint"

    @classmethod
    def open(cls, options: EndpointOptions, tokenizer, model_source: str, run) -> "EndpointEngine":
        """Connect, discover the served model and check one short completion (all before any pass)."""
        concurrency = max(run.options.batch_sizes)
        engine = cls(options, tokenizer, model_source, concurrency)
        try:
            first = datasets.encode(tokenizer, run.config, run.requests[0].text)
            engine.info = engine.loop.run_until_complete(engine.client.start(first, engine.text(first)))
        except BaseException:
            engine.close()
            raise
        engine.label = options.label or describe_server(engine.info)
        if options.replica is not None:
            engine.label += f", replica {options.replica}"
        return engine

    def text(self, prompt_ids: list[int]) -> str:
        """The prompt as text, for a server that refuses token ids (special tokens kept)."""
        return self.tokenizer.decode(prompt_ids, skip_special_tokens=False)

    def audit(self, run, prompts, wanted, on_progress, on_split):
        texts = [self.text(p) for p in prompts] if self.info.prompt_format == "text" else [""] * len(prompts)
        fillers = []
        if run.endpoint.needle:
            filler_ids = filler_prompts(run, self.tokenizer, FILLERS)
            fillers = [(ids, self.text(ids) if self.info.prompt_format == "text" else "") for ids in filler_ids]
        for index, group in wanted_groups(prompts, run.options, wanted, on_progress):
            yield (
                index,
                self.loop.run_until_complete(
                    audit_group(self.client, index, group, run, prompts, texts, fillers, on_progress)
                ),
            )

    def manifest(self, run) -> dict:
        from mgbench.runs import rundir

        return rundir.manifest(
            "flips",
            run_options(run),
            "endpoint",
            {
                "engine": {"kind": "endpoint", "label": self.label, "method": self.method},
                "endpoint": {
                    **self.info.to_dict(),
                    "top_logprobs": self.options.top_logprobs,
                    "request_timeout_s": self.options.request_timeout,
                    "needle": self.options.needle,
                    **({"replica": self.options.replica} if self.options.replica is not None else {}),
                },
                "model_source": self.model_source,
                "dataset_config": asdict(run.config),
                "client": {"httpx": package_version("httpx")},
                "device_name": self.label,
            },
            inputs=run.inputs,
        )  # the machine that decoded is the server's

    def close(self) -> None:
        if not self.loop.is_closed():
            self.loop.run_until_complete(self.client.http.aclose())
            self.loop.close()


def describe_server(info: ServerInfo) -> str:
    """'vllm 0.32.0' from the fingerprint or /version where the server reports one; llama.cpp
    (it answers /props) with its build and slots."""
    if info.props is not None:
        slots = info.props.get("total_slots")
        return f"llama.cpp {info.version or 'server'}" + (f", {slots} slots" if slots else "")
    fingerprint = info.system_fingerprint or ""
    name = fingerprint.split("-")[0] if "-" in fingerprint else "server"
    return f"{name} {info.version}" if info.version else f"{name} at {info.url}"
