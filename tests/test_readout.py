"""The last layer computed for the readout tokens only (model/readout.py): the logits of timm's model of the same
weights, where inference and evaluation use it, and the whole forward wherever the head reads more than them."""
import pytest
import torch

import vitkit
import vitkit.model.readout as readout
from vitkit.interop import from_timm
from vitkit.model.readout import readout_logits, reads_few_tokens
from vitkit.runtime import inference

timm = pytest.importorskip("timm")


def _random(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model.eval()


def _spy(monkeypatch):
    """Counts the calls of ``last_layer`` (a forward hook would itself switch the short path off)."""
    calls = []
    real = readout.last_layer
    monkeypatch.setattr(readout, "last_layer", lambda *a: calls.append(a[2]) or real(*a))
    return calls


@pytest.mark.parametrize("impl", ["sdpa", "exact"])
@pytest.mark.parametrize("kw", [dict(class_token=True), dict(qk_norm=True, init_values=0.1)])
def test_readout_logits_are_timms_logits(kw, impl):
    """timm computes every token of every layer: the same weights give its logits to rounding."""
    ref = _random(timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, num_classes=5, **kw))
    ours = from_timm(ref).eval().set_attention(impl)
    assert reads_few_tokens(ours)
    x = torch.randn(3, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(readout_logits(ours, x), ref(x), rtol=1e-4, atol=1e-5)


def test_the_distillation_token_and_registers_read_their_own_rows(monkeypatch):
    """DeiT's distilled head reads two tokens, registers none: the last layer computes the two (against the whole
    forward, itself checked against timm in tests/test_interop.py)."""
    m = _random(vitkit.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, num_classes=3,
                                    dist_token=True, reg_tokens=4))
    calls = _spy(monkeypatch)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(readout_logits(m, x), m(x), rtol=1e-5, atol=1e-6)
    assert calls == [2]


@pytest.mark.parametrize("why", ["gap", "map", "training", "hook", "kernel"])
def test_the_whole_forward_where_the_head_reads_more_or_someone_watches(why, monkeypatch):
    pool = why if why in ("gap", "map") else "cls"
    m = _random(vitkit.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, num_classes=3, pool=pool))
    if why == "training":
        m.train()
    seen = []
    if why == "hook":
        m.blocks[-1].mlp.register_forward_hook(lambda _m, _i, out: seen.append(out.shape))
    if why == "kernel":
        from vitkit.model import vit as vit_mod
        monkeypatch.setitem(vit_mod.ATTENTION_KERNELS, "mine", lambda qkv, scale: qkv[:, :, 2])
        monkeypatch.setitem(vit_mod._TAKES_HEAD_SIZE, "mine", lambda d: True)
        m.set_attention("mine")
    calls = _spy(monkeypatch)
    x = torch.randn(2, 3, 32, 32)
    assert not reads_few_tokens(m)
    with torch.no_grad():
        readout_logits(m, x)
    assert calls == []
    if why == "hook":
        assert seen == [torch.Size([2, 17, 192])]  # every token, as the hook's owner expects


def test_inference_and_evaluation_take_it_and_compiled_models_hold_one_state_dict(monkeypatch):
    from vitkit.data.augment import BatchAugment
    from vitkit.data.splits import ImageTensors
    from vitkit.training.evaluate import evaluate

    m = _random(vitkit.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, num_classes=3))
    calls = _spy(monkeypatch)
    fast = inference.optimize_for_inference(m, dtype=None)
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), m(x), rtol=1e-5, atol=1e-6)
    assert calls == [1]
    # a compiled model's state dict is the model's (it held the weights twice, under "_compiled._orig_mod.")
    compiled = inference.optimize_for_inference(m, dtype=None, compile=True)
    assert list(compiled.state_dict()) == list(fast.state_dict())
    # the trainer's evaluation: top-1 and loss of the whole forward
    images = torch.randint(0, 256, (10, 3, 32, 32), dtype=torch.uint8)
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0])
    data = ImageTensors(images, labels)
    aug = BatchAugment([0.5] * 3, [0.25] * 3, (32, 32), 3)
    calls.clear()
    got = evaluate(m, data, aug, 3, torch.device("cpu"), batch_size=4)
    assert calls == [1, 1, 1]
    with torch.no_grad():
        logits = m(aug(images.float(), labels, train=False)[0])
    want = torch.nn.functional.cross_entropy(logits, labels).item()
    assert got["loss"] == pytest.approx(want, rel=1e-5)
    assert got["top1"] == pytest.approx(100 * (logits.argmax(1) == labels).float().mean().item())
