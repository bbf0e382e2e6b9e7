"""Why did it say that? Class-specific maps for a ViT's prediction, and how far to trust them.

``explain(model, images, target, method)`` draws a map per image at the image's resolution:

- ``rollout``: attention rollout (Abnar & Zuidema 2020; the paper's Fig. 6). Class-agnostic: the same map
  whichever class is asked about. Here for comparison.
- ``attention-last``: the last layer's attention from the output token to the patches, averaged over heads.
  Class-agnostic too.
- ``grad-rollout``: Chefer, Gur & Wolf (ICCV 2021, "Generic Attention-model Explainability", Eq. 5-6). Each
  layer's attention A is weighted by the gradient of the target class's logit y_t:
  Ā = E_h[(∇A ⊙ A)^+], and the relevance R (from I) is carried through the layers by R <- R + Ā R.
- ``gradcam``: Grad-CAM (Selvaraju et al. 2017) from the ``grad-cam`` package (pytorch-grad-cam), on the last
  block's first LayerNorm, with the tokens reshaped to the patch grid (the reshape that package documents for ViTs).

For a class-token model the output token is the class token; for GAP the head sees the mean of the patch tokens,
so the map is the mean over their rows; for MAP the probe's attention over the tokens plays that part in
``attention-last``, and the token mean in the two rollouts.

``faithfulness(model, images, method)`` measures a map instead of admiring it: the deletion and insertion curves
(Petsiuk et al., RISE, BMVC 2018). Patches are removed from the image (or added to a blank one) in the order the map
ranks them, and the target class's probability recorded; the area under each curve is compared with the same
curves for random orders. A map worth believing makes deletion fall faster (lower area) and insertion rise faster
(higher area) than chance, by more than two standard errors over the images (``better_than_random``).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..model.vit import record_attention
from . import CLASS_SPECIFIC, METHODS
from .analysis import readout_rows, rollout_from_attentions

PER_IMAGE = (list, tuple, np.ndarray, torch.Tensor)  # a target of these kinds gives one class per image


@dataclass
class Explanation:
    """One method's maps for a batch: ``maps`` (B, H, W) in [0, 1] (each image's own min to max), the class each
    map explains (``target``) and the model's probability for it (``prob``)."""
    method: str
    maps: np.ndarray
    target: np.ndarray
    prob: np.ndarray


# ------------------------------------------------------------------------------------------------ targets
def class_names_of(model) -> list[str]:  # type: ignore[no-untyped-def]
    names = (getattr(model, "preprocessing", None) or {}).get("class_names")
    return list(names) if names else [str(i) for i in range(model.config.num_classes)]


def resolve_target(names: list[str], target: int | str) -> int:
    """A class index, or a class name (or its index written as a string), checked against the classes ``names``."""
    n = len(names)
    if isinstance(target, str):
        if target in names:
            return names.index(target)
        if not target.lstrip("-").isdigit():
            close = difflib.get_close_matches(target, names, n=3)
            raise ValueError(f"unknown class {target!r}: the model's classes are "
                             f"{_listing(names)}{'; did you mean ' + ', '.join(close) + '?' if close else ''}")
        target = int(target)
    if isinstance(target, bool) or not isinstance(target, (int, np.integer)) or not 0 <= int(target) < n:
        raise ValueError(f"class index {target!r} is out of range: the model has {n} classes (0 to {n - 1})")
    return int(target)


def _listing(names: list[str], k: int = 12) -> str:
    return ", ".join(names[:k]) + (f", ... ({len(names)} in all)" if len(names) > k else "")


def _targets(model, target, logits: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """(B,) class indices: the predicted class where ``target`` is None, else one class for every image or one
    per image."""
    B = logits.shape[0]
    if target is None:
        return logits.argmax(-1).cpu()
    if isinstance(target, PER_IMAGE):
        ts = [resolve_target(class_names_of(model), t.item() if hasattr(t, "item") else t) for t in target]
        if len(ts) != B:
            raise ValueError(f"{len(ts)} targets for {B} images: give one class, or one per image")
        return torch.tensor(ts)
    return torch.full((B,), resolve_target(class_names_of(model), target), dtype=torch.long)


def check_method(method: str) -> str:
    if method not in METHODS:
        close = difflib.get_close_matches(str(method).replace("_", "-"), METHODS, n=1)
        raise ValueError(f"unknown explanation method {method!r}; expected one of {', '.join(METHODS)}"
                         + (f" (did you mean {close[0]!r}?)" if close else ""))
    return method


def check_images(model, images: torch.Tensor) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """The patch grid of ``images``, or one line saying what the model can take."""
    c = model.config
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[1] != c.in_chans:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"expected normalised images of shape (B, {c.in_chans}, H, W), got {shape}")
    if images.shape[0] == 0:
        raise ValueError("no images to explain")
    try:
        return model.patch_embed.grid_for((images.shape[-2], images.shape[-1]))
    except (ValueError, AssertionError) as e:
        raise ValueError(f"the model cannot take {images.shape[-2]}x{images.shape[-1]} images: {e}") from None


# ------------------------------------------------------------------------------------------------ the methods
def _output_rows(model, rel: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """(B, T, T) token-to-token relevance -> (B, N) relevance of the output token(s) on the patches."""
    return readout_rows(rel, model.num_prefix_tokens, model.num_readout_tokens)


def grad_rollout(attns: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Chefer et al. (2021b), Eq. 5-6: R = I; for each layer R <- R + E_h[(∇A ⊙ A)^+] R. (B, T, T)."""
    B, _, T, _ = attns[0].shape
    R = torch.eye(T, dtype=torch.float64).expand(B, T, T).clone()
    for a, g in zip(attns, grads):
        cam = (g.double() * a.double()).clamp_min(0).mean(dim=1)  # E_h[(∇A ⊙ A)^+]
        R = R + cam @ R
    return R


def _attentions_and_grads(model, x: torch.Tensor, target):  # type: ignore[no-untyped-def]
    """The logits, each layer's attention (exact path) and the gradient of the target logits with respect to it."""
    with torch.enable_grad(), record_attention(model) as attns:
        logits = model(x)
        targets = _targets(model, target, logits.detach())
        score = logits.gather(1, targets.to(logits.device)[:, None]).sum()  # y_t of every image
        grads = torch.autograd.grad(score, attns)
    # on the CPU from here: (B, h, T, T) per layer is small, and float64 is not on every device (MPS)
    return logits.detach(), targets, [a.detach().cpu() for a in attns], [g.cpu() for g in grads]


def _map_probe_attention(model, x: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """A MAP head's attention from its probe to the patch tokens, averaged over heads: (B, N)."""
    pool = model.attn_pool
    seen: list[torch.Tensor] = []
    hook = pool.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        logits = model(x)
    finally:
        hook.remove()
    tokens = seen[0]
    B, T, D = tokens.shape
    h = pool.num_heads
    q = pool.q(pool.latent).reshape(1, h, 1, D // h)
    k = pool.kv(tokens).reshape(B, T, 2, h, D // h)[:, :, 0].transpose(1, 2)  # b h t d
    a = torch.softmax((q * (D // h) ** -0.5) @ k.transpose(-2, -1), dim=-1)  # b h 1 t
    return logits, a[:, :, 0].mean(1)


def _gradcam(model, x: torch.Tensor, targets: torch.Tensor, grid: tuple[int, int]) -> np.ndarray:  # type: ignore
    """Grad-CAM from the ``grad-cam`` package, called as its ViT tutorial does."""
    try:
        from pytorch_grad_cam import GradCAM  # optional dependencies: pip install "vitkit[explain]"
        from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget  # (the same package)
    except ImportError:
        raise ImportError("method 'gradcam' needs the grad-cam package: pip install 'vitkit[explain]'") from None
    n0 = model.num_prefix_tokens

    def reshape_transform(tokens: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, D, gh, gw), fp32 for numpy
        return tokens[:, n0:].float().reshape(tokens.shape[0], *grid, -1).permute(0, 3, 1, 2)

    with torch.enable_grad(), GradCAM(model=model, target_layers=[model.blocks[-1].norm1],
                                      reshape_transform=reshape_transform) as cam:
        return cam(input_tensor=x, targets=[ClassifierOutputTarget(int(t)) for t in targets])


def _to_image(maps: torch.Tensor, hw: tuple[int, int]) -> np.ndarray:
    """(B, gh, gw) -> (B, H, W) bilinear, each scaled to [0, 1] (as grad-cam scales its own)."""
    up = F.interpolate(maps.float()[:, None], size=hw, mode="bilinear", align_corners=False)[:, 0]
    lo = up.flatten(1).min(1).values[:, None, None]
    hi = up.flatten(1).max(1).values[:, None, None]
    return ((up - lo) / (hi - lo).clamp_min(1e-12)).numpy()


def _explain_batch(model, x: torch.Tensor, target, method: str, grid: tuple[int, int]):  # type: ignore
    B = x.shape[0]
    if method == "grad-rollout":
        logits, targets, attns, grads = _attentions_and_grads(model, x, target)
        patch = _output_rows(model, grad_rollout(attns, grads))
        maps = _to_image(patch.reshape(B, *grid), tuple(x.shape[-2:]))
    elif method == "gradcam":
        with torch.no_grad():
            logits = model(x)
        targets = _targets(model, target, logits)
        maps = _gradcam(model, x, targets, grid)
    else:
        with torch.no_grad():
            if method == "attention-last" and model.attn_pool is not None:
                logits, probe = _map_probe_attention(model, x)
                patch = probe  # the probe attends over the patch tokens alone
            else:
                with record_attention(model) as attns:
                    logits = model(x)
                if method == "rollout":
                    patch = rollout_from_attentions([a.float().cpu() for a in attns], model.num_prefix_tokens,
                                                    grid, readout=model.num_readout_tokens).reshape(B, -1)
                else:
                    patch = _output_rows(model, attns[-1].float().mean(1))
        targets = _targets(model, target, logits)
        maps = _to_image(patch.cpu().reshape(B, *grid), tuple(x.shape[-2:]))
    prob = torch.softmax(logits.float(), -1).cpu().gather(1, targets[:, None])[:, 0]
    return maps, targets, prob


def explain(model, images: torch.Tensor, target: int | str | Sequence | None = None,  # type: ignore
            method: str = "grad-rollout", batch_size: int = 16) -> Explanation:
    """Maps of why ``model`` gives ``target`` (a class index or name, one per image, or None: the predicted class)
    for ``images`` (normalised, (B, C, H, W)): an ``Explanation`` whose ``maps`` are (B, H, W) in [0, 1]. The model
    is run as it is (its dtype and device) in eval mode; its parameters' gradients are left as they were."""
    check_method(method)
    grid = check_images(model, images)
    if isinstance(target, PER_IMAGE) and len(target) != len(images):
        raise ValueError(f"{len(target)} targets for {len(images)} images: give one class, or one per image")
    p = next(model.parameters())
    was_training = model.training
    saved_grads = [q.grad for q in model.parameters()]
    model.eval()
    parts = []
    try:
        for i in range(0, len(images), batch_size):
            t = target[i:i + batch_size] if isinstance(target, PER_IMAGE) else target
            x = images[i:i + batch_size].to(p.device, p.dtype)
            parts.append(_explain_batch(model, x, t, method, grid))
    finally:
        model.train(was_training)
        for q, g in zip(model.parameters(), saved_grads):
            q.grad = g
    maps, targets, prob = (np.concatenate([np.asarray(part[k]) for part in parts]) for k in range(3))
    return Explanation(method, maps.astype(np.float32), targets.astype(np.int64), prob.astype(np.float32))


# ------------------------------------------------------------------------------------------------ faithfulness
@dataclass
class Faithfulness:
    """Deletion and insertion curves (B, steps + 1) of the target class's probability, by the fraction of patches
    removed / added (``fractions``), in the method's order and in random orders (mean over ``random_orders``)."""
    method: str
    fractions: np.ndarray
    deletion: np.ndarray
    insertion: np.ndarray
    random_deletion: np.ndarray
    random_insertion: np.ndarray

    def _auc(self, curves: np.ndarray) -> float:
        return float(np.trapezoid(curves.mean(0), self.fractions))

    @property
    def deletion_auc(self) -> float:
        """Area under the mean deletion curve: lower is better."""
        return self._auc(self.deletion)

    @property
    def insertion_auc(self) -> float:
        """Area under the mean insertion curve: higher is better."""
        return self._auc(self.insertion)

    @property
    def random_deletion_auc(self) -> float:
        return self._auc(self.random_deletion)

    @property
    def random_insertion_auc(self) -> float:
        return self._auc(self.random_insertion)

    def gain(self, curve: str) -> tuple[float, float]:
        """How much better than random order the map does on ``curve`` ("deletion" or "insertion"), in area: the
        mean over images of (random - map) for deletion, (map - random) for insertion, and its standard error."""
        per_image = np.trapezoid(getattr(self, "random_" + curve) - getattr(self, curve), self.fractions, axis=1)
        per_image = per_image if curve == "deletion" else -per_image
        se = per_image.std(ddof=1) / np.sqrt(len(per_image)) if len(per_image) > 1 else float("inf")
        return float(per_image.mean()), float(se)

    @property
    def better_than_random(self) -> bool:
        """Both gains at least two standard errors above zero: the map beats chance on these images, not by luck."""
        return all(g > 2 * se for g, se in (self.gain("deletion"), self.gain("insertion")))

    def row(self) -> dict[str, object]:
        """One line of faithfulness.csv."""
        (dg, dse), (ig, ise) = self.gain("deletion"), self.gain("insertion")
        return {"method": self.method, "images": len(self.deletion), "deletion_auc": round(self.deletion_auc, 4),
                "random_deletion_auc": round(self.random_deletion_auc, 4),
                "insertion_auc": round(self.insertion_auc, 4),
                "random_insertion_auc": round(self.random_insertion_auc, 4),
                "deletion_gain": round(dg, 4), "deletion_gain_se": round(dse, 4), "insertion_gain": round(ig, 4),
                "insertion_gain_se": round(ise, 4), "better_than_random": self.better_than_random}


def patch_scores(maps: np.ndarray | torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """(B, H, W) maps -> (B, gh * gw): each patch's mean over the pixels it covers."""
    m = torch.as_tensor(np.asarray(maps), dtype=torch.float32)
    return F.adaptive_avg_pool2d(m[:, None], grid).flatten(1)


@torch.no_grad()
def _curves(model, images: torch.Tensor, targets: torch.Tensor, orders: torch.Tensor,  # type: ignore
            grid: tuple[int, int], fractions: np.ndarray, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Deletion and insertion curves (B, len(fractions)) for patch ``orders`` (B, N), most important first.
    A removed patch (and every patch of the blank canvas insertion starts from) is 0 in the normalised image: the
    dataset's mean colour."""
    p = next(model.parameters())
    B, N = orders.shape
    H, W = images.shape[-2:]
    counts = [round(f * N) for f in fractions]
    rank = torch.empty_like(orders)
    rank.scatter_(1, orders, torch.arange(N).expand(B, N))  # rank[b, patch] = its place in the order
    dele, ins = np.zeros((B, len(counts))), np.zeros((B, len(counts)))
    jobs = [(b, j) for b in range(B) for j in range(len(counts))]
    for s in range(0, len(jobs), batch_size):
        chunk = jobs[s:s + batch_size]
        b_idx = torch.tensor([b for b, _ in chunk])
        k = torch.tensor([counts[j] for _, j in chunk])
        chosen = (rank[b_idx] < k[:, None]).float().reshape(-1, 1, *grid)  # the first k patches of each order
        mask = F.interpolate(chosen, size=(H, W), mode="nearest").to(images.device)  # (images may be on a GPU)
        x = images[b_idx]
        for curve, keep in ((dele, 1 - mask), (ins, mask)):
            logits = model((x * keep).to(p.device, p.dtype)).float()
            prob = torch.softmax(logits, -1).cpu().gather(1, targets[b_idx][:, None])[:, 0].numpy()
            for (b, j), v in zip(chunk, prob):
                curve[b, j] = v
    return dele, ins


def faithfulness(model, images: torch.Tensor, method: str | Sequence[str] | np.ndarray = "grad-rollout",  # type: ignore
                 target: int | str | Sequence | None = None, *, steps: int = 16, random_orders: int = 4,
                 seed: int = 0, batch_size: int = 32):
    """Deletion / insertion curves for ``method`` (a name, a list of names: a dict of results, or a (B, H, W) array
    of maps made elsewhere) against random patch orders, on ``images`` for ``target`` (None: each image's predicted
    class). The random orders are drawn once (from ``seed``) and shared by every method. The curves have
    ``min(steps, patches) + 1`` points: a patch is the smallest unit removed."""
    if steps < 1 or random_orders < 1:
        raise ValueError(f"steps and random_orders must be at least 1, got {steps} and {random_orders}")
    grid = check_images(model, images)
    names = [method] if isinstance(method, str) else None if isinstance(method, np.ndarray) else list(method)
    for m in names or []:
        check_method(m)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            p = next(model.parameters())
            logits = torch.cat([model(images[i:i + batch_size].to(p.device, p.dtype)).float().cpu()
                                for i in range(0, len(images), batch_size)])
        targets = _targets(model, target, logits)
        B, N = len(images), grid[0] * grid[1]
        # at most a point per patch: more only repeat the same curve (a million steps ran for minutes on 16 patches)
        fractions = np.linspace(0.0, 1.0, min(steps, N) + 1)
        g = torch.Generator().manual_seed(seed)
        rand = [_curves(model, images, targets, torch.stack([torch.randperm(N, generator=g) for _ in range(B)]),
                        grid, fractions, batch_size) for _ in range(random_orders)]
        rand_del, rand_ins = (np.mean([r[k] for r in rand], axis=0) for k in range(2))

        def measure(name: str, maps: np.ndarray) -> Faithfulness:
            if maps.shape[0] != B:
                raise ValueError(f"{maps.shape[0]} maps for {B} images")
            orders = torch.argsort(patch_scores(maps, grid), dim=1, descending=True, stable=True)
            d, i = _curves(model, images, targets, orders, grid, fractions, batch_size)
            return Faithfulness(name, fractions, d, i, rand_del, rand_ins)

        if names is None:
            return measure("given", np.asarray(method))
        results = {m: measure(m, explain(model, images, targets, m).maps) for m in names}
    finally:
        model.train(was_training)
    return results[names[0]] if isinstance(method, str) else results
