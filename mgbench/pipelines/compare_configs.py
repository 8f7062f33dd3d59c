"""`mgbench compare`'s configurations (what is decoded and against which reference) and the
per-configuration sums over batches."""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from mgbench.engines.inprocess.verification.spec import PolicySpec
from mgbench.errors import UserError
from mgbench.runs.options import reference_of

WINDOWS = (64, 32)  # LLM-42's W: its server default, and its throughput artifact's
VERIFY_BATCHES = (8, 16, 1)  # its N: server default, artifact, and each row replayed alone


@dataclass
class Decoded:
    """One configuration's figures in one repeat, summed over the batches decoded so far."""

    seconds: float = 0.0
    triggers: int = 0
    repairs: int = 0
    outputs: dict = field(default_factory=dict)
    counts: dict = field(default_factory=lambda: {"replayed": 0, "discarded": 0})
    per_sequence: dict = field(default_factory=dict)

    def add(self, seconds, outputs, triggers, repairs, counts) -> None:
        self.seconds += seconds
        self.triggers += triggers
        self.repairs += repairs
        self.outputs.update(outputs)
        self.per_sequence.update(counts.pop("per_sequence", {}))
        for key, value in counts.items():
            self.counts[key] = self.counts.get(key, 0) + value


@dataclass(frozen=True)
class Config:
    name: str
    spec: PolicySpec | None  # None: a baseline (solo, batch-invariant, fixed-order kernels)

    @property
    def replays(self) -> bool:
        """Verified (or, `none (start-aligned)`, decoded) as the replay policies are, against fixed-order solo."""
        return self.spec is not None and self.spec.repair == "replay"


def replay_specs(tau: float, unit: str) -> list[PolicySpec]:
    """LLM-42's window at W = 64 and 32 in verify batches of N = 8, 16 and 1 (per row); MarginGate
    on the same reference in batches of N = 8, verifying at once or waiting for company, with and
    without the end check, and per row; and the same stock decoding unverified (what the replays'
    increments are made of)."""
    margin = [
        PolicySpec("margin", "replay", tau, unit),
        PolicySpec("margin", "replay", tau, unit, wait=True),
        PolicySpec("margin", "replay", tau, unit, end_check=False),
        PolicySpec("margin", "replay", tau, unit, rows=1),
    ]
    windows = [PolicySpec("window", "replay", window=w, rows=n) for w in WINDOWS for n in VERIFY_BATCHES]
    return [PolicySpec("none", "replay"), *windows, *margin]


def replay_pairs(specs: list[PolicySpec]) -> list[tuple[PolicySpec, PolicySpec]]:
    """(window, MarginGate) pairs whose reduction is reported: the same verify batch rows N (packed
    against packed, per row against per row)."""
    windows = [s for s in specs if s.kind == "window"]
    return [(w, g) for w in windows for g in specs if g.kind == "margin" and g.rows == w.rows]


def selected(name: str, prefix: str) -> bool:
    """`--only`'s match: the name starts with the prefix, where `*` stands for any run of characters
    (`margin*/exact` picks MarginGate's exact repair whatever its TAU, and none of its replays)."""
    return fnmatchcase(name, prefix.replace("[", "[[]") + "*")


def configurations(tau: float, unit: str, only: tuple[str, ...] | None = None) -> list[Config]:
    """Every configuration, or (`only`) `none` and those whose names start with one of the prefixes."""
    configs = [Config("none", PolicySpec("none"))]
    for kind in ("always", "margin", "oracle"):
        for repair in ("column", "exact"):
            spec = PolicySpec(kind, repair, tau if kind == "margin" else None, unit)
            configs.append(Config(spec.label, spec))
    configs += [Config("fixed-order kernels", None)]
    configs += [Config(spec.label, spec) for spec in replay_specs(tau, unit)]
    configs += [Config("batch-invariant", None), Config("solo", None)]
    if only is None:
        return configs
    unmatched = [p for p in only if not any(selected(c.name, p) for c in configs)]
    if unmatched:
        names = ", ".join(c.name for c in configs)
        raise UserError(f"--only {','.join(unmatched)}: no configuration starts with it (they are: {names})")
    chosen = [c for c in configs if c.name == "none" or any(selected(c.name, p) for p in only)]
    if any(c.replays for c in chosen):  # the replays' own base: the same decoding unverified
        chosen = [c for c in configs if c in chosen or c.name == "none (start-aligned)"]
    return chosen


def config_reference(config: Config) -> str:
    return reference_of("fixed-order" if config.name == "fixed-order kernels" or config.replays else "stock")
