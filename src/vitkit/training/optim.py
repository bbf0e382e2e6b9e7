"""Optimiser with the usual ViT parameter groups, and the warmup + cosine learning-rate schedule."""
from __future__ import annotations

import math
from collections import defaultdict

import torch

from ..model.vit import HEADS
from .config import TrainConfig


def param_groups(model: torch.nn.Module, cfg: TrainConfig) -> list[dict]:
    """No weight decay on norms, biases, position embedding and class token; ``body_lr_scale`` for all but the head;
    with ``layer_decay`` (BEiT's and MAE's fine-tuning), block i's learning rate times decay^(depth - i), the
    embeddings' times decay^(depth + 1), the final norm's and the head's as given (``layer_id``). Around an
    objective's parts (``model.encoder``: MAE's decoder beside a classifier, --semi joint), the encoder's parameters
    are grouped as the encoder's own, the objective's parts as the head (at the rates given)."""
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    encoder = getattr(model, "encoder", model)
    depth = getattr(getattr(encoder, "config", None), "depth", None)
    groups: dict[tuple[bool, bool, int], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        no_decay = p.ndim <= 1 or name in skip
        own = name.removeprefix("encoder.") if encoder is not model else name  # (the encoder's own name)
        part = encoder is not model and own == name  # the objective's, not the encoder's
        head = part or own.split(".")[0] in HEADS + ("pre_logits",)  # §3.1's MLP head: its hidden layer is the head's
        layer = (depth + 1 if part else layer_id(own, depth)) if cfg.layer_decay and depth is not None else 0
        scale = (1.0 if head else cfg.body_lr_scale) * (cfg.layer_decay ** (depth + 1 - layer) if cfg.layer_decay
                                                        and depth is not None else 1.0)
        g = groups.setdefault((no_decay, head, layer), {
            "params": [], "weight_decay": 0.0 if no_decay else cfg.weight_decay, "lr_scale": scale})
        g["params"].append(p)
    return list(groups.values())


def layer_id(name: str, depth: int) -> int:
    """The layer a parameter is in, as BEiT and MAE number them for layer-wise decay: 0 the embeddings (patches,
    class and register tokens, E_pos), 1 + i block i, depth + 1 what ends the model (the final norm, pooling, head)."""
    if name.startswith(("patch_embed.", "cls_token", "reg_token", "dist_token", "pos_embed")):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return depth + 1


def freeze_body(model: torch.nn.Module) -> int:
    """Train the head alone (the paper's linear evaluation of pretrained features): every other parameter is frozen.
    Returns how many parameters still train."""
    for name, p in model.named_parameters():
        p.requires_grad_(name.split(".")[0] in HEADS)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> "torch.optim.Optimizer | MuonAdamW":
    """AdamW, SGD with momentum, or Muon for the blocks' weight matrices with AdamW for the rest; fused into one
    kernel per step on CPU and CUDA: for the 5-minute Fashion-MNIST model AdamW's step takes 0.6 ms fused vs
    2.0 ms with the default for-each path, and the whole compiled training step runs at 2,214 vs 2,042 img/s
    (benchmarks/train_step_ab.py, batch 128)."""
    groups = param_groups(model, cfg)
    first = next(model.parameters())
    fused = first.device.type in ("cpu", "cuda")
    if cfg.opt == "sgd":  # (a sharded model's parameters are DTensors: torch shards a fused AdamW, not a fused SGD)
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=False,
                               fused=fused and not hasattr(first, "placements"))
    if cfg.opt == "muon":
        ns = torch.bfloat16 if cfg.precision == "bf16" else torch.float32  # the run's own precision (planned)
        return MuonAdamW(model, groups, cfg.lr, fused, stem=cfg.muon_stem, embed=cfg.muon_embed, ns_dtype=ns)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, cfg.adam_beta2), fused=fused)


class MuonAdamW:
    """``Muon`` for the 2-D weight matrices inside the transformer blocks, AdamW for everything else (embeddings, the
    CNN stem, norms, biases, the head), the split Muon's authors use. ``stem``: Muon for the convolution filters of a
    hybrid's CNN stem too, as the CIFAR-10 speed records train a CNN's filters (batch norm follows each of them).
    ``embed``: Muon for the patch embedding's projection E of Eq. 1 as well (its (D, C, P, P) weight as the D x C·P·P
    matrix), the last linear map of the stem.
    Muon's step is scaled to match AdamW's update size, so both share the recipe's learning rate and weight decay.
    Behaves as one optimiser: ``param_groups`` (the learning-rate schedule sets them), ``step``, ``zero_grad``,
    ``state_dict``."""

    def __init__(self, model: torch.nn.Module, groups: list[dict], lr: float, fused: bool,
                 stem: bool = False, embed: bool = False, ns_dtype: torch.dtype = torch.float32) -> None:
        encoder = getattr(model, "encoder", model)  # (around an objective's parts: the encoder's own; the parts AdamW)
        hidden = {id(p) for name, p in encoder.named_parameters() if name.startswith("blocks.") and p.ndim == 2
                  or stem and name.startswith("patch_embed.backbone.") and p.ndim == 4
                  or embed and name == "patch_embed.proj.weight"}
        muon_groups, adamw_groups = [], []
        for g in groups:
            for part, keep in ((muon_groups, True), (adamw_groups, False)):
                params = [p for p in g["params"] if (id(p) in hidden) == keep]
                if params:
                    part.append({**g, "params": params})
        if not muon_groups:
            raise ValueError("opt muon: the model has no trainable weight matrices in its transformer blocks "
                             "(depth 0, or a frozen body); use --opt adamw")
        self.muon = Muon(muon_groups, lr=lr, ns_dtype=ns_dtype)
        self.adamw = torch.optim.AdamW(adamw_groups, lr=lr, betas=(0.9, 0.999), fused=fused) if adamw_groups \
            else None
        self.optimizers = [o for o in (self.muon, self.adamw) if o is not None]
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]

    # fp16's GradScaler hands an optimizer that says it takes them the loss scale and the inf flag as tensors
    # (``grad_scale``, ``found_inf``), where it would otherwise read the flag on the host before every step: a wait
    # for a GPU at each step (issue 80 N12). Muon takes them below; fused AdamW does in its kernel.
    _step_supports_amp_scaling = True

    def step(self) -> None:
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        self.muon.step(grad_scale=grad_scale, found_inf=found_inf)
        if self.adamw is None:
            return
        if getattr(self.adamw, "_step_supports_amp_scaling", False):  # fused: unscales and skips on the device
            self.adamw.grad_scale, self.adamw.found_inf = grad_scale, found_inf
            try:
                self.adamw.step()
            finally:
                del self.adamw.grad_scale, self.adamw.found_inf
            return
        if found_inf is not None and found_inf.item():  # (unfused AdamW: as GradScaler itself does, on the host)
            return
        if grad_scale is not None:
            torch._foreach_div_([p.grad for g in self.adamw.param_groups for p in g["params"]
                                 if p.grad is not None], grad_scale)
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict() if self.adamw else None}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != {"muon", "adamw"}:
            raise ValueError(f"optimizer state has keys {sorted(state)}; a run trained with --opt muon has "
                             "['adamw', 'muon'] (was this run trained with another --opt?)")
        saved = sum(len(g["params"]) for g in state["muon"]["param_groups"])
        here = sum(len(g["params"]) for g in self.muon.param_groups)
        if saved != here:
            raise ValueError(f"optimizer state: Muon trained {saved} weight matrices in the saved run, {here} here "
                             "(was the run trained with another --muon-stem / --muon-embed setting, or another model?)")
        self.muon.load_state_dict(state["muon"])
        if self.adamw:
            self.adamw.load_state_dict(state["adamw"])


NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Jordan et al.'s quintic, as torch.optim.Muon


def newton_schulz(G: torch.Tensor, steps: int = 5, eps: float = 1e-7,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Orthogonalise each matrix of the batch ``G`` (k, m, n): ``steps`` Newton-Schulz iterations X <- aX + (bA +
    cA²)X with A = XXᵀ, from X = G / ||G||_F, computed in ``dtype`` as torch.optim.Muon does (the same fused
    multiply-adds). Gives about U Vᵀ of G's SVD (singular values near, not at, 1), as Muon wants."""
    a, b, c = NS_COEFFICIENTS
    X = G.to(dtype)
    tall = G.size(-2) > G.size(-1)
    if tall:  # iterate on the smaller Gram matrix
        X = X.mT
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        A = X @ X.mT
        X = torch.baddbmm(X, torch.baddbmm(A, A, A, beta=b, alpha=c), X, beta=a)
    return (X.mT if tall else X).to(G.dtype)


class Muon(torch.optim.Optimizer):
    """Muon as ``torch.optim.Muon(..., adjust_lr_fn="match_rms_adamw")`` computes it: momentum (Nesterov) on the
    gradient, the update orthogonalised by five Newton-Schulz iterations, scaled by 0.2 sqrt(max(m, n)) to AdamW's
    update size, decoupled weight decay. Two differences, both for speed: the iterations run in ``ns_dtype``, the
    run's own precision (bf16 only where the planner timed bf16 faster; torch.optim.Muon always uses bf16, which a CPU
    without native bf16 emulates, many times slower: results/muon-step.csv), and matrices of one shape go through
    the iterations together, as batched matmuls. A convolution's filters (out, in, k, k) are updated as the
    out x (in k k) matrix.
    The state (``momentum_buffer``) is torch.optim.Muon's."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, eps: float = 1e-7,
                 ns_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "momentum": momentum,
                                  "nesterov": nesterov, "ns_steps": ns_steps, "eps": eps})
        for g in self.param_groups:
            if any(p.ndim < 2 for p in g["params"]):
                raise ValueError("Muon updates weight matrices (a convolution's filters as out x in*k*k) only")
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None, grad_scale: torch.Tensor | None = None,  # type: ignore[no-untyped-def]
             found_inf: torch.Tensor | None = None):
        """One update; with fp16's ``grad_scale`` (the gradients are still multiplied by it) and ``found_inf``
        (nonzero: an overflow, so nothing changes), both tensors on the device, as GradScaler gives fused
        optimizers: no value is read by the host."""
        keep = None if found_inf is None else found_inf == 0
        for g in self.param_groups:
            lr, momentum = g["lr"], g["momentum"]
            dtype = self.ns_dtype
            by_shape: dict[torch.Size, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
            for p in g["params"]:
                if p.grad is None:
                    continue
                grad = p.grad if grad_scale is None else p.grad / grad_scale
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                if keep is None:
                    buf.lerp_(grad, 1 - momentum)
                else:  # (an overflow's inf or NaN must not reach the buffer: where, not a multiply by 0)
                    buf.copy_(torch.where(keep, buf.lerp(grad, 1 - momentum), buf))
                update = grad.lerp(buf, momentum) if g["nesterov"] else buf
                by_shape[p.shape].append((p, update.reshape(len(p), -1)))
            for shape, pairs in by_shape.items():
                params, updates = zip(*pairs)
                ortho = newton_schulz(torch.stack(updates), g["ns_steps"], g["eps"], dtype)
                m, n = ortho.shape[1:]
                alpha = -lr * 0.2 * math.sqrt(max(m, n))
                if keep is None:
                    torch._foreach_mul_(params, 1 - lr * g["weight_decay"])
                    torch._foreach_add_(params, [o.view(shape) for o in ortho.unbind(0)], alpha=alpha)
                    continue
                for p, o in zip(params, ortho.unbind(0)):
                    p.copy_(torch.where(keep, p * (1 - lr * g["weight_decay"]) + alpha * o.view(shape), p))


def lr_at(step: int, total: int, warmup: int, lr: float, min_lr: float) -> float:
    """Linear warmup for ``warmup`` steps, then cosine decay from ``lr`` to ``min_lr`` at ``total``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
