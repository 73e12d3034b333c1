"""What crosses between the self-play logic, the fleet client and the engines."""
from __future__ import annotations

import base64
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class Completion:
    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # of the sampled tokens, from the engine
    finish_reason: str = ""
    # [[weights version, first token, end)]: which weights sampled which tokens (vLLM's spans); a
    # completion that was in flight during a weight update has two
    versions: list[list[int]] = field(default_factory=list)
    # mixture-of-experts engines: the experts chosen for each token the engine ran (prompt and
    # completion but the last sampled token), int16 [tokens, MoE layers, top-k]; routing replay
    routed_experts: np.ndarray | None = None

    def to_json(self) -> dict:
        d = asdict(self)
        if self.routed_experts is not None:
            d["routed_experts"] = np.asarray(self.routed_experts).tolist()
        return d


@dataclass(frozen=True)
class SamplingSpec:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int | None = None  # prompt i of a request samples with seed + i: independent of batching
    # one seed per prompt (overrides `seed`): sample k of prompt i samples with seeds[i] + k (vLLM's
    # rule for n > 1), so a caller's seeds give the same completions however prompts are batched
    seeds: tuple[int, ...] = ()
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
        if not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**63 for s in self.seeds):
            raise ValueError(f"sampling.seeds: expected non-negative integers, got {list(self.seeds)[:4]}...")

    def prompt_seed(self, i: int) -> int | None:
        """The seed of prompt i of this request (its sample k: that + k)."""
        if self.seeds:
            return self.seeds[i]
        return None if self.seed is None else self.seed + i

    def to_json(self) -> dict:
        d = asdict(self)
        d["stop"] = list(self.stop)
        d["seeds"] = list(self.seeds)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "SamplingSpec":
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"sampling: unknown field(s) {sorted(unknown)}")
        d = dict(d)
        for name in ("stop", "seeds"):
            if name in d:
                if not isinstance(d[name], (list, tuple)):
                    raise ValueError(f"sampling.{name}: expected a list, got {type(d[name]).__name__}")
                d[name] = tuple(d[name])
        spec = cls(**d)
        spec.validate()
        return spec


# /generate's packed response: the token ids (int32) and log-probs (float32) of every completion,
# concatenated and base64-encoded, beside small per-completion records. JSON lists of numbers cost
# the engine's interpreter ~0.2 s per 64k tokens to encode (tools/bench/bench_rollout.py), under the lock
# that also steps the engine.
PACKED = "packed-v1"


def pack_completions(out: list[list[Completion]]) -> dict:
    flat = [c for comps in out for c in comps]
    ids = np.fromiter((t for c in flat for t in c.token_ids), dtype=np.int32)
    logprobs = np.fromiter((x for c in flat for x in c.logprobs), dtype=np.float32)
    routed = [np.asarray(c.routed_experts) for c in flat if c.routed_experts is not None]
    # vLLM's dtype (uint8 up to 256 experts): int16 only when some completion needs it
    dtype = np.dtype(np.uint8) if all(r.dtype == np.uint8 for r in routed) else np.dtype(np.int16)
    body = {"encoding": PACKED,
            "completions": [[{"text": c.text, "finish_reason": c.finish_reason, "versions": c.versions,
                              "tokens": len(c.token_ids), "logprobs": len(c.logprobs),
                              "routing": None if c.routed_experts is None else list(np.shape(c.routed_experts))}
                             for c in comps] for comps in out],
            "token_ids": base64.b64encode(ids.tobytes()).decode("ascii"),
            "logprobs": base64.b64encode(logprobs.tobytes()).decode("ascii")}
    if routed:  # expert indices, completion after completion
        body["routed_experts"] = base64.b64encode(
            b"".join(np.ascontiguousarray(r, dtype=dtype).tobytes() for r in routed)).decode("ascii")
        body["routing_dtype"] = dtype.name
    return body


def unpack_completions(body: dict) -> list[list[Completion]]:
    """Either encoding: packed, or JSON lists (an engine of an older version)."""
    if body.get("encoding") != PACKED:
        return [[Completion(**c) for c in comps] for comps in body["completions"]]
    ids = np.frombuffer(base64.b64decode(body["token_ids"]), dtype=np.int32).tolist()
    logprobs = np.frombuffer(base64.b64decode(body["logprobs"]), dtype=np.float32).tolist()
    routed = np.frombuffer(base64.b64decode(body.get("routed_experts", "")),
                           dtype=np.dtype(body.get("routing_dtype", "int16")))
    out, i, j, k = [], 0, 0, 0
    for comps in body["completions"]:
        row = []
        for c in comps:
            routing = None
            if c.get("routing") is not None:
                size = int(np.prod(c["routing"]))
                routing = routed[k:k + size].reshape(c["routing"]).copy()
                k += size
            row.append(Completion(c["text"], ids[i:i + c["tokens"]], logprobs[j:j + c["logprobs"]], c["finish_reason"],
                                  c["versions"], routing))
            i, j = i + c["tokens"], j + c["logprobs"]
        out.append(row)
    if i != len(ids) or j != len(logprobs) or k != routed.size:
        raise ValueError(f"packed response: {len(ids)} token ids, {len(logprobs)} log-probs and {routed.size} expert "
                         f"indices for {i}, {j} and {k} declared")
    return out
