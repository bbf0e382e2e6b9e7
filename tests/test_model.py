"""The model against the paper's equations, worked out by hand, and against timm's parameter layout."""
import math

import pytest
import torch
import torch.nn.functional as F

import vitkit
from vitkit import PRESETS, ViTConfig, VisionTransformer, create_model, resample_pos_embed
from vitkit.model.posembed import sincos_2d_pos_embed

from conftest import tiny_config


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_forward_shapes_at_small_size(name):
    c = PRESETS[name]
    p = c.patch_size if isinstance(c.patch_size, int) else c.patch_size[0]
    side = 2 * p * c.input_stride
    # the preset's width and heads, two layers to keep it quick
    model = create_model(name, img_size=side, num_classes=7, depth=2).eval()
    x = torch.randn(2, c.in_chans, side, side)
    with torch.no_grad():
        feats = model.forward_features(x)
        logits = model(x)
    assert feats.shape == (2, c.num_prefix_tokens + 4, c.embed_dim)
    assert logits.shape == (2, 7)
    assert torch.isfinite(logits).all()


def _count(model):
    return sum(p.numel() for p in model.parameters())


def test_vit_b16_parameter_count_matches_the_paper_and_timm():
    with torch.device("meta"):
        assert _count(create_model("vit_base_patch16_224")) == 86_567_656


def test_parameter_counts_and_names_equal_timm_for_every_shared_preset():
    timm = pytest.importorskip("timm")
    shared = [n for n in vitkit.list_models() if n in set(timm.list_models())]
    assert len(shared) >= 15, shared
    for name in shared:
        with torch.device("meta"):
            ours = create_model(name, num_classes=1000)
            ref = timm.create_model(name, pretrained=False, num_classes=1000)
        assert _count(ours) == _count(ref), name
        assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == \
               {k: tuple(v.shape) for k, v in ref.state_dict().items()}, name


def test_patch_embedding_conv_equals_linear_map_of_flattened_patches():
    """Eq. 1: x_p^i E with x_p^i the i-th flattened P x P x C patch."""
    c = tiny_config(img_size=(12, 8), patch_size=4, in_chans=3)
    model = VisionTransformer(c)
    x = torch.randn(2, 3, 12, 8)
    B, C, H, W, P = 2, 3, 12, 8, 4
    patches = x.reshape(B, C, H // P, P, W // P, P).permute(0, 2, 4, 1, 3, 5).reshape(B, -1, C * P * P)
    # b c (h p) (w q) -> b (h w) (c p q), row-major over the grid as the paper's sequence
    E = model.patch_embed.proj.weight.reshape(c.embed_dim, -1)  # d c p q -> d (c p q)
    expected = patches @ E.T + model.patch_embed.proj.bias
    torch.testing.assert_close(model.patch_embed(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hybrid", [None, "conv:8,8"])
def test_patch_embedding_equals_the_stride_p_convolution_in_either_memory_layout(hybrid):
    """E is stored as timm's P x P stride-P convolution; the matmul over (P, P, C)-ordered patches must give the
    convolution's numbers, for images and for a CNN feature map (§3.1), with NCHW or channels-last weights."""
    from vitkit.training.build import apply_layout

    model = VisionTransformer(tiny_config(img_size=(12, 8), hybrid=hybrid)).eval()  # eval: BN's running statistics
    pe, x = model.patch_embed, torch.randn(2, 3, 12, 8)
    feats = pe.backbone(x) if hybrid else x
    expected = F.conv2d(feats, pe.proj.weight, pe.proj.bias, stride=4).flatten(2).transpose(1, 2)
    torch.testing.assert_close(pe(x), expected, rtol=1e-5, atol=1e-5)
    apply_layout(model, "sdpa", channels_last=True)
    assert pe.proj.weight.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(pe(x), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pe(x.contiguous(memory_format=torch.channels_last)), expected, rtol=1e-5, atol=1e-5)


def _reference_msa(attn_module, x):
    """softmax(q k^T / sqrt(D_h)) v per head (Appendix A, Eq. 5-8), written out with loops over heads."""
    D = x.shape[-1]
    h = attn_module.num_heads
    dh = D // h
    W, b = attn_module.qkv.weight, attn_module.qkv.bias
    qkv = x @ W.T + b
    q, k, v = qkv[..., :D], qkv[..., D:2 * D], qkv[..., 2 * D:]
    outs = []
    for i in range(h):
        s = slice(i * dh, (i + 1) * dh)
        A = torch.softmax(q[..., s] @ k[..., s].transpose(-1, -2) / math.sqrt(dh), dim=-1)
        outs.append(A @ v[..., s])
    return torch.cat(outs, -1) @ attn_module.proj.weight.T + attn_module.proj.bias


def test_attention_scales_before_softmax_as_in_the_paper():
    model = VisionTransformer(tiny_config()).eval()
    attn = model.blocks[0].attn
    x = torch.randn(2, 17, 32) * 3  # large enough that the scaling matters
    with torch.no_grad():
        for impl in ("sdpa", "exact"):
            attn.impl = impl
            out = attn(x)
            torch.testing.assert_close(out, _reference_msa(attn, x), rtol=1e-5, atol=1e-5)
        # the "scale after the softmax by sqrt(embed_dim)" variant from our notes gives something else
        qkv = attn.qkv(x).reshape(2, 17, 3, 4, 8).permute(2, 0, 3, 1, 4)
        wrong = (torch.softmax(qkv[0] @ qkv[1].transpose(-1, -2), -1) / math.sqrt(32)) @ qkv[2]
        wrong = attn.proj(wrong.transpose(1, 2).reshape(2, 17, 32))
        assert (wrong - out).abs().max() > 1e-2


def test_block_is_pre_norm_with_residual_on_the_unnormalised_input():
    """Eq. 2-3: z' = MSA(LN(z)) + z ; z_out = MLP(LN(z')) + z'."""
    model = VisionTransformer(tiny_config()).eval()
    blk = model.blocks[0]
    with torch.no_grad():
        for p in blk.norm1.parameters():  # non-trivial LayerNorm so LN(z) != z
            p.normal_()
        z = torch.randn(2, 17, 32) * 2 + 1
        z1 = _reference_msa(blk.attn, F.layer_norm(z, (32,), blk.norm1.weight, blk.norm1.bias, 1e-6)) + z
        h = F.layer_norm(z1, (32,), blk.norm2.weight, blk.norm2.bias, 1e-6)
        z2 = F.gelu(h @ blk.mlp.fc1.weight.T + blk.mlp.fc1.bias) @ blk.mlp.fc2.weight.T + blk.mlp.fc2.bias + z1
        out = blk(z)
        torch.testing.assert_close(out, z2, rtol=1e-5, atol=1e-5)
        # the variant that adds the residual to the normalised input differs
        ln = F.layer_norm(z, (32,), blk.norm1.weight, blk.norm1.bias, 1e-6)
        wrong = _reference_msa(blk.attn, ln) + ln
        assert (wrong - z1).abs().max() > 1e-2


@pytest.mark.parametrize("pool", ["cls", "gap"])
@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "vit_base_patch32_224"])
def test_fused_attention_equals_exact_path(pool, name):
    model = create_model(name, img_size=64, num_classes=10, pool=pool, depth=3).eval()
    with torch.no_grad():
        for p in model.head.parameters():
            p.normal_(0, 0.02)
        x = torch.randn(2, 3, 64, 64)
        fused = model(x)
        exact, attns = model.forward_attention(x)
    torch.testing.assert_close(fused, exact, rtol=1e-5, atol=1e-5)
    T = model.patch_embed.num_patches + (pool == "cls")
    assert len(attns) == 3 and attns[0].shape == (2, model.config.num_heads, T, T)
    torch.testing.assert_close(attns[1].sum(-1), torch.ones(2, model.config.num_heads, T))


def test_forward_head_follows_eq4_and_gap():
    model = VisionTransformer(tiny_config(pool="cls")).eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        tokens = model.forward_features(x)
        torch.testing.assert_close(model(x), model.head(tokens[:, 0]))
    gap = VisionTransformer(tiny_config(pool="gap")).eval()
    with torch.no_grad():
        tokens = gap.forward_features(x)
        assert tokens.shape == (2, 16, 32)
        torch.testing.assert_close(gap(x), gap.head(tokens.mean(1)))


@pytest.mark.parametrize("kw", [dict(pool="cls"), dict(pool="gap"), dict(pos_embed="sincos2d"),
                                dict(pos_embed="none", pool="gap"), dict(fc_norm=True, pool="gap"),
                                dict(qkv_bias=False), dict(drop_path_rate=0.1, attn_drop_rate=0.1, drop_rate=0.1)])
def test_every_parameter_receives_a_gradient(kw):
    model = VisionTransformer(tiny_config(**kw))
    with torch.no_grad():
        model.head.weight.normal_(0, 0.02)  # the zero head would block every other gradient
    model(torch.randn(4, 3, 16, 16)).logsumexp(-1).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing


def test_hybrid_resnet_stem_gives_the_feature_map_grid_and_gradients():
    model = create_model("vit_base_tvresnet50_s16_224", img_size=64, depth=1, num_classes=3)
    assert model.patch_embed.grid_size == (4, 4) and model.pos_embed.shape == (1, 17, 768)
    with torch.no_grad():
        model.head.weight.normal_(0, 0.02)
    out = model(torch.randn(2, 3, 64, 64))
    assert out.shape == (2, 3)
    out.sum().backward()
    assert model.patch_embed.backbone[0].weight.grad.abs().sum() > 0


def test_conv_hybrid_stem_is_conv_bn_relu_at_full_resolution_then_patches():
    model = VisionTransformer(tiny_config(img_size=16, patch_size=4, hybrid="conv:8,12", in_chans=1, num_classes=3))
    model.eval()
    assert model.patch_embed.grid_size == (4, 4) and model.config.input_stride == 1
    x = torch.randn(2, 1, 16, 16)
    # the same computation written out with plain functional ops
    h, bb = x, model.patch_embed.backbone
    for conv, bn in ((bb[0], bb[1]), (bb[3], bb[4])):
        h = F.relu(F.batch_norm(F.conv2d(h, conv.weight, padding=1), bn.running_mean, bn.running_var, bn.weight,
                                bn.bias, eps=bn.eps))
    proj = model.patch_embed.proj
    tokens = F.conv2d(h, proj.weight, proj.bias, stride=4).flatten(2).transpose(1, 2)
    assert torch.allclose(model.patch_embed(x), tokens, atol=1e-6)
    for bad in ("conv:", "conv:8,x", "conv:0", "conv:M"):
        with pytest.raises(ValueError, match="conv:32,64"):
            tiny_config(hybrid=bad)


def test_conv_hybrid_stem_with_max_pooling_quarters_the_token_grid():
    model = VisionTransformer(tiny_config(img_size=16, patch_size=1, hybrid="conv:8,M,12,M", in_chans=3,
                                          num_classes=3)).eval()
    assert model.config.input_stride == 4 and model.patch_embed.grid_size == (4, 4)
    x = torch.randn(2, 3, 16, 16)
    h, bb = x, model.patch_embed.backbone
    for conv, bn in ((bb[0], bb[1]), (bb[4], bb[5])):
        h = F.max_pool2d(F.relu(F.batch_norm(F.conv2d(h, conv.weight, padding=1), bn.running_mean, bn.running_var,
                                             bn.weight, bn.bias, eps=bn.eps)), 2)
    tokens = F.conv2d(h, model.patch_embed.proj.weight, model.patch_embed.proj.bias).flatten(2).transpose(1, 2)
    assert torch.allclose(model.patch_embed(x), tokens, atol=1e-6)
    assert model(x).shape == (2, 3)
    with pytest.raises(ValueError, match="multiple of the patch size"):
        model(torch.randn(1, 3, 18, 18))


@pytest.mark.parametrize("pool", ["cls", "gap"])
def test_class_token_and_gap_models_train(pool):
    torch.manual_seed(0)
    model = VisionTransformer(tiny_config(pool=pool, num_classes=3))
    x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 3, (16,))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    losses = []
    for _ in range(10):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert losses[-1] < losses[0]


def test_init_follows_the_official_scheme():
    model = create_model("vit_small_patch16_224")
    assert model.head.weight.abs().sum() == 0 and model.head.bias.abs().sum() == 0
    assert 0.015 < model.pos_embed.std() < 0.025 and model.pos_embed.abs().max() <= 0.04
    w = model.blocks[0].attn.qkv.weight
    bound = math.sqrt(6 / (w.shape[0] + w.shape[1]))  # Xavier-uniform
    assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound
    pw = model.patch_embed.proj.weight
    pbound = math.sqrt(6 / (pw.shape[0] + pw[0].numel()))  # as a linear layer from (c p q) to d
    assert pw.abs().max() <= pbound and pw.abs().max() > 0.9 * pbound


# ---------------------------------------------------------------------------------------------- §3.2 resampling
def test_resample_to_the_same_grid_is_the_identity():
    pe = torch.randn(1, 1 + 49, 16)
    assert torch.equal(resample_pos_embed(pe, 7, 1), pe)


def test_resample_keeps_prefix_and_interpolates_sensibly():
    rows, cols = torch.meshgrid(torch.arange(4.0), torch.arange(4.0), indexing="ij")
    grid = torch.stack([rows, cols], -1).reshape(1, 16, 2)  # each token holds its own (row, col)
    cls = torch.tensor([[[42.0, -42.0]]])
    out = resample_pos_embed(torch.cat([cls, grid], 1), (8, 8), num_prefix_tokens=1, interpolation="bilinear")
    assert out.shape == (1, 65, 2)
    assert torch.equal(out[:, 0], cls[:, 0])
    new = out[0, 1:].reshape(8, 8, 2)
    assert torch.allclose(new[0, 0], torch.tensor([0.0, 0.0])) and torch.allclose(new[-1, -1], torch.tensor([3.0, 3.0]))
    # the new centre maps to the old centre, (1.5, 1.5); interior points are the linear ramp at their position
    centre = new[3:5, 3:5].mean((0, 1))
    torch.testing.assert_close(centre, torch.tensor([1.5, 1.5]))
    torch.testing.assert_close(new[2, 5], torch.tensor([(2 + 0.5) / 2 - 0.5, (5 + 0.5) / 2 - 0.5]))
    assert (new[1:, :, 0] >= new[:-1, :, 0]).all()  # still increasing down the rows


def test_resample_non_square_grids_and_constant_field():
    pe = torch.full((1, 6, 8), 0.25)
    out = resample_pos_embed(pe, (4, 6), num_prefix_tokens=0, old_grid=(2, 3))
    assert out.shape == (1, 24, 8)
    torch.testing.assert_close(out, torch.full((1, 24, 8), 0.25))
    with pytest.raises(ValueError, match="not a square grid"):
        resample_pos_embed(pe, 4, num_prefix_tokens=0)


def test_model_at_a_new_resolution_resamples_on_the_fly():
    model = VisionTransformer(tiny_config()).eval()
    with torch.no_grad():
        out = model(torch.randn(1, 3, 24, 32))
    assert out.shape == (1, 5)


def test_sincos_matches_hand_computed_values():
    pe = sincos_2d_pos_embed((2, 3), 8)[0]  # 4 frequencies: omega = 1/10000^(i/1), i in {0, 1}
    # token (row 1, col 2): x=2, y=1; omega = [1, 1e-4]
    expected = torch.tensor([math.sin(2), math.sin(2e-4), math.cos(2), math.cos(2e-4),
                             math.sin(1), math.sin(1e-4), math.cos(1), math.cos(1e-4)])
    torch.testing.assert_close(pe[1 * 3 + 2], expected)


# ---------------------------------------------------------------------------------------------- bad input
def test_bad_inputs_raise_clear_value_errors():
    model = VisionTransformer(tiny_config())
    with pytest.raises(ValueError, match=r"\(17, 16\) is not a multiple of the patch size \(4, 4\)"):
        model(torch.randn(1, 3, 17, 16))
    with pytest.raises(ValueError, match=r"expected images of shape \(B, 3, H, W\), got \(1, 1, 16, 16\)"):
        model(torch.randn(1, 1, 16, 16))
    with pytest.raises(ValueError, match=r"got \(3, 16, 16\)"):
        model(torch.randn(3, 16, 16))
    with pytest.raises(ValueError, match="unknown model 'vit_base_patch15_224'.*did you mean"):
        create_model("vit_base_patch15_224")
    with pytest.raises(ValueError, match=r"unknown ViTConfig key\(s\) \['embed_size'\]"):
        create_model("vit_tiny_patch16_224", embed_size=3)
    with pytest.raises(ValueError, match="must be a multiple of the patch size"):
        ViTConfig(img_size=30, patch_size=16)
    with pytest.raises(ValueError, match="pool must be one of"):
        ViTConfig(pool="max")
    with pytest.raises(ValueError, match="divisible by num_heads"):
        ViTConfig(embed_dim=100, num_heads=3)


def test_config_round_trips_through_dict_and_is_frozen():
    c = tiny_config(img_size=(16, 24))
    assert ViTConfig.from_dict(c.to_dict()) == c
    with pytest.raises(Exception):
        c.depth = 3  # type: ignore[misc]


def test_attention_is_chosen_by_name_and_recorded_by_a_hook():
    model = create_model("vit_tiny_patch16_224", img_size=32, depth=2, num_classes=3).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        model.head.weight.normal_(0, 0.02)
        ref = model(x)
        assert model.set_attention("exact") is model and {b.attn.impl for b in model.blocks} == {"exact"}
        torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)  # how, never what
        model.set_attention("sdpa")
        with pytest.raises(ValueError, match="'flash3' is not available here; expected one of"):
            model.set_attention("flash3")
        with vitkit.record_attention(model) as maps:
            out = model(x)
        assert {b.attn.impl for b in model.blocks} == {"sdpa"}  # back to its own path afterwards
        assert len(maps) == 2 and maps[0].shape == (2, 3, 5, 5)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        # the recorded maps are softmax(q k^T / sqrt(D_h)) of the first layer, computed here by hand
        blk = model.blocks[0]
        z = blk.norm1(model.embed(x))
        q, k, _ = blk.attn.qkv(z).reshape(2, 5, 3, 3, 64).permute(2, 0, 3, 1, 4)
        torch.testing.assert_close(maps[0], torch.softmax(q @ k.transpose(-2, -1) / 8.0, -1), rtol=1e-5, atol=1e-6)
        assert model(x).shape == (2, 3) and len(maps) == 2  # nothing recorded outside the context


@pytest.mark.parametrize("kw", [{}, dict(pool="gap"), dict(dist_token=True, reg_tokens=2),
                                dict(hybrid="conv:32,M,64,M", patch_size=1),
                                dict(hybrid="resnet18:1", patch_size=1, img_size=64)])
def test_flops_per_image_is_what_pytorchs_flop_counter_counts(kw):
    """The formula against torch.utils.flop_counter over the forward on the exact attention path (whose matmuls it
    counts). A hybrid's tokens come from its CNN's map: the CIFAR-10 recipe's 8x8 grid was counted as 32x32, 12x
    its FLOPs, and the planner refused budgets from that (issue 79)."""
    from torch.utils.flop_counter import FlopCounterMode

    from vitkit.model.vit import flops_per_image

    m = vitkit.create_model("vit_tiny_patch16_224", **{"img_size": 32, "patch_size": 8, "num_classes": 5, **kw})
    m.eval().set_attention("exact")
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        m(torch.randn(1, 3, *(m.config.img_size,) * 2))
    assert flops_per_image(m.config) == pytest.approx(counter.get_total_flops(), rel=1e-6)
