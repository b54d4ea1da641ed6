"""Mixture-of-experts routing (Mixtral): router logits, top-k, softmax over the chosen k.

  logits = G x  (G: (n_experts, dim) float32);  chosen = the k largest (ties: lower index first)
  weights = softmax(logits[chosen]);  out = sum_j weights_j * w2_e(silu(w1_e x) * w3_e x)
Only the chosen experts' weights are read.
"""

from __future__ import annotations

import numpy as np


def moe_route_ref(gate: np.ndarray, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (expert ids (k,) int32 in descending logit order, weights (k,) float32 summing to 1)."""
    logits = (gate.astype(np.float32) @ x.astype(np.float32)).astype(np.float32)
    order = np.argsort(-logits, kind="stable")[:k]
    chosen = logits[order]
    w = np.exp(chosen - chosen.max())
    return order.astype(np.int32), (w / w.sum()).astype(np.float32)
