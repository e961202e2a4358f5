"""Mixture-of-Experts routing on the trainer side: recording which experts each token was routed
to, Routing Replay, routing metrics, and the auxiliary load-balancing loss.

Works on transformers MoE models whose router is a module with ``top_k`` and ``num_experts``
returning ``(router_logits, top_k_weights, top_k_indices)`` (Qwen3-MoE's and Qwen2-MoE's
``TopKRouter``). Everything hooks the routers' outputs, so the model's forward is untouched:

* record: each router's chosen experts per token, laid out (B, L, layers, k) like the batch;
* replay (``router_replay``): each router returns the recorded experts instead of its own top-k,
  with weights taken from its current probabilities at those experts (so the router still gets
  gradients), as Routing Replay does in the GSPO paper's GRPO baseline;
* router logits with their autograd graph, for the load-balancing loss (``moe_aux_loss_coef``).
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional

import torch


def find_routers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The model's top-k routers in layer order (empty for a dense model)."""
    return [module for module in model.modules()
            if hasattr(module, "top_k") and hasattr(module, "num_experts")
            and isinstance(getattr(module, "weight", None), torch.Tensor) and not isinstance(module, torch.nn.Linear)
            and type(module).__name__.endswith("Router")]


def folder_is_moe(model_dir: str) -> bool:
    """True when the Hugging Face config in model_dir declares routed experts (Qwen2/3-MoE's
    `num_experts`, Mixtral's `num_local_experts`, DeepSeek's `n_routed_experts`)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    return any((getattr(config, key, None) or 0) > 0 for key in ("num_experts", "num_local_experts", "n_routed_experts"))


def expert_set_change_fraction(old: torch.Tensor, new: torch.Tensor, mask: torch.Tensor) -> float:
    """Fraction of (token, layer) whose set of top-k experts differs between two routings.

    old, new: (B, L, layers, k) expert indices; mask: (B, L), 1 on tokens that count. The order
    inside a top-k set does not matter.
    """
    changed = (old.sort(-1).values != new.sort(-1).values).any(-1).float()  # (B, L, layers)
    weights = mask.float()[:, :, None].expand_as(changed)
    total = weights.sum()
    return float((changed * weights).sum() / total) if total > 0 else 0.0


def load_balance_max_over_mean(indices: torch.Tensor, mask: torch.Tensor, num_experts: int) -> float:
    """Max over experts of routed (token, slot) counts divided by their mean, averaged over
    layers: 1.0 is a perfectly balanced load, `num_experts / k` means one set of k experts
    takes every token.

    indices: (B, L, layers, k); mask: (B, L).
    """
    flat = indices[mask.bool()]  # (tokens, layers, k)
    if flat.numel() == 0:
        return float("nan")
    ratios = []
    for layer in range(flat.shape[1]):
        counts = torch.bincount(flat[:, layer].reshape(-1), minlength=num_experts).float()
        ratios.append(float(counts.max() / counts.mean()))
    return sum(ratios) / len(ratios)


def load_balancing_loss(router_logits: List[torch.Tensor], mask: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch-Transformer auxiliary loss (num_experts * sum_e f_e * P_e, averaged over layers),
    over the tokens of `mask`: f_e the fraction of routed slots sent to expert e, P_e its mean
    router probability. 1.0 when balanced. router_logits: per layer (B*L, E); mask: (B, L)."""
    keep = mask.reshape(-1).bool()
    losses = []
    for logits in router_logits:
        probs = torch.softmax(logits[keep].float(), dim=-1)  # (tokens, E)
        num_experts = probs.shape[-1]
        chosen = torch.topk(probs, top_k, dim=-1).indices
        fraction = torch.nn.functional.one_hot(chosen, num_experts).float().sum(1).mean(0) / top_k
        losses.append(num_experts * (fraction * probs.mean(0)).sum())
    return torch.stack(losses).mean() if losses else torch.zeros(())


class RouterHooks:
    """Forward hooks on every router of a model. Use `capture()` around forward passes."""

    def __init__(self, model: torch.nn.Module):
        self.routers = find_routers(model)
        if not self.routers:
            raise ValueError("model has no top-k routers (not a Mixture-of-Experts model)")
        self.num_experts = int(self.routers[0].num_experts)
        self.top_k = int(self.routers[0].top_k)
        self._natural: Dict[int, torch.Tensor] = {}  # the router's own top-k
        self._used: Dict[int, torch.Tensor] = {}  # what the experts got (replayed or natural)
        self._logits: Dict[int, torch.Tensor] = {}
        self._replay: Optional[torch.Tensor] = None  # (B, L, layers, k)
        self._active = False
        self._handles = [router.register_forward_hook(self._hook(i)) for i, router in enumerate(self.routers)]

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            if not self._active:
                return None
            logits, weights, indices = output
            self._natural[layer] = indices.detach()
            if self._replay is not None:
                indices = self._replay[:, :, layer].reshape(-1, indices.shape[-1]).to(indices.device, indices.dtype)
                probs = torch.softmax(logits, dtype=torch.float, dim=-1)
                weights = probs.gather(-1, indices)
                if getattr(module, "norm_topk_prob", False):
                    weights = weights / weights.sum(-1, keepdim=True)
                weights = weights.to(logits.dtype)
                output = (logits, weights, indices)
            # Overwritten, not appended: activation checkpointing re-runs the forward in backward.
            self._used[layer] = indices.detach()
            self._logits[layer] = logits
            return output if self._replay is not None else None
        return hook

    @contextlib.contextmanager
    def capture(self, replay: Optional[torch.Tensor] = None) -> Iterator["RouterHooks"]:
        """Record routing during the block; with `replay` (B, L, layers, k), force those experts."""
        self._natural, self._used, self._logits = {}, {}, {}
        self._replay, self._active = replay, True
        try:
            yield self
        finally:
            self._active, self._replay = False, None

    def routed_experts(self, batch_size: int, seq_len: int, used: bool = False) -> torch.Tensor:
        """(B, L, layers, k) experts of the last captured forward (int16): the routers' own
        top-k, or with `used` what the experts were given (the replayed ones under replay)."""
        captured = self._used if used else self._natural
        if len(captured) != len(self.routers):
            raise RuntimeError(f"captured {len(captured)} of {len(self.routers)} routers")
        return torch.stack([captured[i].reshape(batch_size, seq_len, -1) for i in range(len(self.routers))],
                           dim=2).to(torch.int16).cpu()

    def router_logits(self) -> List[torch.Tensor]:
        """Per layer (B*L, E) router logits of the last captured forward, with their graph."""
        return [self._logits[i] for i in range(len(self.routers))]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class TrainerRouting:
    """What the training ranks do for an MoE policy: record routing with the old log-probs,
    replay it (`router_replay`), add the load-balancing loss (`moe_aux_loss_coef`), and measure
    routing metrics. `attach` returns None for a dense model (and refuses MoE keys for one)."""

    def __init__(self, hooks: RouterHooks, router_replay: bool, aux_loss_coef: float, infer_batch_size: int = 64):
        self.hooks = hooks
        self.router_replay = router_replay
        self.aux_loss_coef = aux_loss_coef
        self.infer_batch_size = infer_batch_size  # rows per no-grad pass of `step_metrics`

    @classmethod
    def attach(cls, model: torch.nn.Module, router_replay: bool, aux_loss_coef: float,
               infer_batch_size: int = 64) -> Optional["TrainerRouting"]:
        if not find_routers(model):
            used = [key for key, on in (("router_replay", router_replay), ("moe_aux_loss_coef", aux_loss_coef)) if on]
            if used:
                raise ValueError(f"{', '.join(used)} set, but the model has no Mixture-of-Experts routers "
                                 f"(top-k router modules); these keys act on MoE models only")
            return None
        return cls(RouterHooks(model), router_replay, aux_loss_coef, infer_batch_size)

    def capture(self, replay: Optional[torch.Tensor] = None):
        return self.hooks.capture(replay)

    def recorded(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hooks.routed_experts(*input_ids.shape)

    def train_forward_extras(self, micro, num_seqs: float) -> "tuple[Optional[torch.Tensor], Dict[str, float]]":
        """After a captured training forward on `micro`: the aux loss term to add (its share of
        the mini-batch: sequence-weighted over ranks and micro-batches) and metrics."""
        mask = micro["attention_mask"]
        aux = load_balancing_loss(self.hooks.router_logits(), mask, self.hooks.top_k)
        metrics = {"moe/aux_loss": float(aux.detach())}
        old = micro["routed_experts"] if "routed_experts" in micro else None
        if old is not None:
            natural = self.hooks.routed_experts(*micro["input_ids"].shape)
            metrics["moe/expert_volatility_train"] = expert_set_change_fraction(old.long(), natural.long(), mask)
        term = self.aux_loss_coef * aux * (len(micro) / max(num_seqs, 1.0)) if self.aux_loss_coef else None
        return term, metrics

    def step_metrics(self, batch, forward) -> Dict[str, float]:
        """Routing metrics of a step: volatility between the routing recorded with the old
        log-probs and the policy after the step's updates (`forward(micro)` runs one no-grad
        pass), and the old policy's load balance, over non-padding tokens."""
        old, mask = batch["routed_experts"].long(), batch["attention_mask"]
        new = []
        for start in range(0, len(batch), self.infer_batch_size):
            micro = batch.select(range(start, min(start + self.infer_batch_size, len(batch))))
            with self.capture():
                forward(micro)
            new.append(self.hooks.routed_experts(*micro["input_ids"].shape))
        return {"moe/expert_volatility": expert_set_change_fraction(old, torch.cat(new).long(), mask),
                "moe/load_balance_max_over_mean": load_balance_max_over_mean(old, mask, self.hooks.num_experts),
                "moe/aux_loss_coef": self.aux_loss_coef, "moe/router_replay": float(self.router_replay)}
