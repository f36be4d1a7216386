"""A mixture of experts' routing, seen and steered from outside the model: hooks on its routers
that record each token's router probabilities and can send one token of one layer to its
runner-up expert. Verification uses them to measure a sample under the routing a quantized node
may have taken (`evidence.measure`).

A router here is transformers' top-k router module (Qwen3-MoE's): it returns
(router logits, top-k weights, top-k expert indices) for the flattened (batch x sequence) tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Flip:
    """Token `row` (of the flattened batch) at router `layer` goes to its (k+1)-th expert instead of
    its k-th; `gap` is their router logit difference in the unflipped forward (the log of their
    probability ratio: the same scale for 4 experts or 128)."""

    row: int
    layer: int
    gap: float


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's expert routers in layer order; [] for a dense model."""
    return [m for m in model.modules() if hasattr(m, "top_k") and hasattr(m, "num_experts") and hasattr(m, "weight")]


class Routing:
    """While entered: `probs` holds each router's (tokens, experts) probabilities of the last
    forward, and `flip`, when set, is applied to it."""

    def __init__(self, model: torch.nn.Module):
        self.routers = routers(model)
        self.probs: list[torch.Tensor] = []
        self.flip: Flip | None = None
        self._hooks = []

    def __enter__(self) -> Routing:
        self._hooks = [r.register_forward_hook(self._hook(layer)) for layer, r in enumerate(self.routers)]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def near_ties(self, rows, below: float) -> list[Flip]:
        """Flips at tokens `rows` whose k-th and (k+1)-th experts' router logits are within `below`
        of each other in the last forward, nearest first."""
        rows, found = list(rows), []
        for layer, (router, probs) in enumerate(zip(self.routers, self.probs)):
            if not rows or router.top_k >= probs.shape[-1]:  # every expert is used: nothing to flip
                continue
            top = torch.log(torch.topk(probs[rows], router.top_k + 1, dim=-1).values)
            gaps = (top[:, -2] - top[:, -1]).tolist()
            found += [Flip(row, layer, gap) for row, gap in zip(rows, gaps) if gap < below]
        return sorted(found, key=lambda f: f.gap)

    def _hook(self, layer: int):
        def hook(router, inputs, outputs):
            logits, weights, experts = outputs
            probs = torch.softmax(logits.float(), dim=-1)
            if layer == 0:
                self.probs = []
            self.probs.append(probs.detach())
            flip = self.flip
            if flip is None or flip.layer != layer:
                return None
            order = torch.argsort(probs[flip.row], descending=True)
            chosen = torch.cat([order[: router.top_k - 1], order[router.top_k : router.top_k + 1]])
            share = probs[flip.row, chosen]
            if getattr(router, "norm_topk_prob", True):
                share = share / share.sum()
            experts, weights = experts.clone(), weights.clone()
            experts[flip.row] = chosen
            weights[flip.row] = share.to(weights.dtype)
            return logits, weights, experts

        return hook
