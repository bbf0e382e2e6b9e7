"""The paper's analyses on hand-built inputs whose answers are known, and the plots on a real model."""
import math

import numpy as np
import torch

from vitkit import ViTConfig, VisionTransformer
from vitkit.inspect import (attention_rollout, filter_components, mean_attention_distance,
                            mean_distance_from_attentions, pos_embed_similarity, rollout_from_attentions)

from conftest import tiny_config


def test_rollout_of_identity_attention_stays_on_itself():
    T, grid = 1 + 4, (2, 2)
    eye = torch.eye(T).expand(1, 3, T, T)
    r = rollout_from_attentions([eye] * 4, num_prefix_tokens=0, grid=(1, 5))
    # with every token attending only to itself, the GAP output (mean of tokens) draws uniformly on all tokens
    torch.testing.assert_close(r, torch.full((1, 1, 5), 0.2))
    eye4 = torch.eye(4).expand(2, 3, 4, 4)
    torch.testing.assert_close(rollout_from_attentions([eye4] * 3, 0, grid), torch.full((2, 2, 2), 0.25))


def test_rollout_of_uniform_attention_is_uniform_over_patches():
    T = 1 + 9
    uni = torch.full((1, 2, T, T), 1 / T)
    r = rollout_from_attentions([uni] * 3, num_prefix_tokens=1, grid=(3, 3))
    torch.testing.assert_close(r, torch.full((1, 3, 3), 1 / 9))


def test_rollout_follows_a_chain_of_attention():
    """cls attends to patch 0 in layer 2; patch 0 attends to patch 3 in layer 1: rollout (no residual) puts
    everything on patch 3."""
    T = 5
    a1 = torch.eye(T)
    a1[1] = 0
    a1[1, 4] = 1  # token 1 (patch 0) <- token 4 (patch 3)
    a2 = torch.eye(T)
    a2[0] = 0
    a2[0, 1] = 1  # cls <- token 1
    r = rollout_from_attentions([a1[None, None], a2[None, None]], 1, (2, 2), residual=0.0)
    torch.testing.assert_close(r[0], torch.tensor([[0.0, 0.0], [0.0, 1.0]]))


def test_mean_distance_of_a_head_that_always_looks_at_one_patch():
    grid, patch = (3, 4), (8, 8)
    N = 12
    a = torch.zeros(1, 2, 1 + N, 1 + N)
    a[:, 0, :, 1] = 1.0  # head 0: every query attends to patch (0, 0)
    a[:, 1, 1:, 1:] = torch.eye(N)  # head 1: every patch attends to itself
    a[:, 1, 0, 0] = 1.0
    d = mean_distance_from_attentions([a], 1, grid, patch)
    rows, cols = np.meshgrid(np.arange(3), np.arange(4), indexing="ij")
    expected = np.mean(np.hypot(rows * 8, cols * 8))
    assert d.shape == (1, 2)
    assert math.isclose(d[0, 0], expected, rel_tol=1e-9) and d[0, 1] == 0.0


def test_sincos_position_embeddings_are_most_similar_to_their_neighbours():
    model = VisionTransformer(ViTConfig(img_size=32, patch_size=4, embed_dim=64, num_heads=4, depth=1,
                                        pos_embed="sincos2d", num_classes=2))
    sim = pos_embed_similarity(model)
    assert sim.shape == (8, 8, 8, 8)
    for r in range(8):
        for c in range(8):
            s = sim[r, c].copy()
            assert math.isclose(s[r, c], 1.0, rel_tol=1e-5)
            s[r, c] = -np.inf
            nr, nc = np.unravel_index(np.argmax(s), s.shape)
            assert abs(nr - r) + abs(nc - c) == 1  # the most similar other patch is adjacent
    # similarity falls with distance along a row
    assert sim[4, 0, 4, 1] > sim[4, 0, 4, 3] > sim[4, 0, 4, 7]


def test_filter_pca_recovers_the_patterns_of_a_known_weight_matrix():
    g = torch.Generator().manual_seed(0)
    p1 = torch.zeros(3, 4, 4)
    p1[:, :2] = 1
    p1[:, 2:] = -1  # horizontal edge
    p2 = torch.zeros(3, 4, 4)
    p2[..., :2] = 1
    p2[..., 2:] = -1  # vertical edge (orthogonal to p1)
    coef = torch.randn(64, 2, generator=g) * torch.tensor([5.0, 1.0])
    w = coef[:, :1, None, None, None] * p1 + coef[:, 1:, None, None, None] * p2  # d c p q
    comps, var = filter_components(w, n=3)
    c1, c2 = (torch.from_numpy(c).flatten() for c in comps[:2])
    assert abs(torch.nn.functional.cosine_similarity(c1, p1.flatten(), 0)) > 0.99
    assert abs(torch.nn.functional.cosine_similarity(c2, p2.flatten(), 0)) > 0.99
    assert var[0] > var[1] > 0.0 and var[2] < 1e-10


def test_model_level_functions_and_cli_plots(tmp_path):
    from vitkit.cli.main import main

    model = VisionTransformer(tiny_config(num_classes=10, in_chans=1, img_size=8, patch_size=2))
    x = torch.randn(3, 1, 8, 8)
    r = attention_rollout(model, x)
    assert r.shape == (3, 4, 4) and np.allclose(r.sum((1, 2)), 1, atol=1e-5)
    d = mean_attention_distance(model, x, batch_size=2)
    assert d.shape == (2, 4) and (d > 0).all()
    model.save_pretrained(tmp_path / "m", mean=[0.5], std=[0.25])
    for kind in ("attention", "rollout", "distance", "posemb", "filters"):
        out = tmp_path / f"{kind}.png"
        assert main(["inspect", kind, "--checkpoint", str(tmp_path / "m"), "--dataset", "digits",
                     "--num-images", "16", "--out", str(out)]) == 0
        assert out.stat().st_size > 5000


def test_filters_of_a_hybrid_show_the_stems_first_convolution(tmp_path, capsys):
    """A hybrid's patch embedding sees CNN channels (here 1x1 over 16), which are no picture: the CLI plots the
    principal components of the stem's first 3x3 convolution over the RGB pixels instead, and says so."""
    from vitkit.cli.main import main
    from vitkit.inspect.analysis import pixel_filters

    model = VisionTransformer(tiny_config(img_size=16, patch_size=1, hybrid="conv:8,M,16,M"))
    weight, what = pixel_filters(model)
    assert weight is model.patch_embed.backbone[0].weight and weight.shape == (8, 3, 3, 3)
    assert "first convolution (conv:8,M,16,M)" in what
    plain = VisionTransformer(tiny_config())
    assert pixel_filters(plain)[0] is plain.patch_embed.proj.weight
    model.save_pretrained(tmp_path / "m", mean=[0.5] * 3, std=[0.25] * 3)
    out = tmp_path / "filters.png"
    assert main(["inspect", "filters", "--checkpoint", str(tmp_path / "m"), "--out", str(out)]) == 0
    assert "sees 16 CNN feature channels, not pixels" in capsys.readouterr().out
    assert out.stat().st_size > 5000
