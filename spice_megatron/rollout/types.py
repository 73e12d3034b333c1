"""What crosses between the self-play logic, the fleet client and the engines."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Completion:
    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # of the sampled tokens, from the engine
    finish_reason: str = ""
    # [[weights version, first token, end)]: which weights sampled which tokens (vLLM's spans); a
    # completion that was in flight during a weight update has two
    versions: list[list[int]] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SamplingSpec:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int | None = None  # prompt i of a request samples with seed + i: independent of batching
    logprobs: bool = True  # return the sampled tokens' log-probs
    role: str = ""  # which SPICE role asked (for per-role metrics); engines ignore it

    def validate(self) -> None:
        if self.n < 1:
            raise ValueError(f"sampling.n: must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p: must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"sampling.max_tokens: must be >= 1, got {self.max_tokens}")

    def to_json(self) -> dict:
        d = asdict(self)
        d["stop"] = list(self.stop)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "SamplingSpec":
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"sampling: unknown field(s) {sorted(unknown)}")
        d = dict(d)
        if "stop" in d:
            d["stop"] = tuple(d["stop"])
        spec = cls(**d)
        spec.validate()
        return spec
