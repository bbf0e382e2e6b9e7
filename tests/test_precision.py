"""bf16 only where the hardware computes in it: `precision: auto` for training, optimize_for_inference's fp32
fallback. Without AVX512-BF16/AMX a bf16 matmul is emulated (61 vs 305 GFLOP/s fp32 on a 2-core AVX-512 Xeon)."""
import json
import platform
from pathlib import Path

import pytest
import torch

import vitkit
from vitkit.runtime import precision as speed
from vitkit.training import trainer as trainer_mod
from vitkit.training.config import TrainConfig, recipe
from vitkit.training.trainer import Trainer

CPU = torch.device("cpu")


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists() or platform.machine() != "x86_64",
                    reason="compares with the flags in /proc/cpuinfo (Linux x86)")
def test_native_bf16_agrees_with_the_cpu_flags():
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
    assert speed.cpu_has_native_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)


@pytest.mark.parametrize("native", [True, False])
def test_auto_precision_follows_the_cpu_and_explicit_choices_are_kept(monkeypatch, native):
    monkeypatch.setattr(speed, "cpu_has_native_bf16", lambda: native)
    assert speed.resolve_precision("auto", CPU) == ("bf16" if native else "fp32")
    for p in ("fp32", "bf16", "fp16"):
        assert speed.resolve_precision(p, CPU) == p
    assert (speed.precision_note("bf16", CPU) is None) == native
    assert speed.precision_note("fp32", CPU) is None and speed.precision_note("auto", CPU) is None


def test_the_recipes_leave_bf16_to_the_hardware():
    for name in ("fashion-mnist", "mnist", "cifar10", "cifar100", "folder-large"):
        assert recipe(name)["precision"] == "auto", name
    assert TrainConfig(precision="auto").precision == "auto"
    with pytest.raises(ValueError, match="precision must be one of"):
        TrainConfig(precision="bf32")


@pytest.mark.parametrize("asked,native,runs,note", [
    ("auto", False, "fp32", False), ("auto", True, "bf16", False), ("bf16", False, "bf16", True)])
def test_the_trainer_trains_and_evaluates_in_the_resolved_precision(tmp_path, monkeypatch, asked, native, runs,
                                                                   note):
    monkeypatch.setattr(speed, "cpu_has_native_bf16", lambda: native)
    used = []
    real_autocast = trainer_mod.autocast_for
    monkeypatch.setattr(trainer_mod, "autocast_for", lambda d, p: (used.append(p), real_autocast(d, p))[1])
    logs: list[str] = []
    t = Trainer(TrainConfig(dataset="digits", epochs=1, batch_size=256, precision=asked, device="cpu",
                            output=str(tmp_path / "run")), log=logs.append, progress=False)
    t.fit()
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text())["precision"] == runs
    assert t.precision == runs and set(used) == {runs}  # every training step under the resolved precision
    said = "\n".join(logs)
    assert f"parameters on cpu in {runs}{' (auto)' if asked == 'auto' else ''};" in said
    assert ("no native bf16" in said) == note


@pytest.mark.parametrize("native", [True, False])
def test_optimize_for_inference_keeps_fp32_weights_without_native_bf16(monkeypatch, native):
    monkeypatch.setattr(speed, "cpu_has_native_bf16", lambda: native)
    model = vitkit.create_model("vit_tiny_patch16_224", img_size=32, depth=1, num_classes=4).eval()
    fast = vitkit.optimize_for_inference(model)
    want = torch.bfloat16 if native else torch.float32
    assert {p.dtype for p in fast.parameters()} == {want}
    assert fast(torch.randn(2, 3, 32, 32)).dtype == torch.float32


def test_eval_says_which_precision_it_ran(tmp_path, capsys, monkeypatch):
    from vitkit.cli.main import main

    out = tmp_path / "run"
    assert main(["train", "--epochs", "1", "--output", str(out)]) == 0
    for native, says in ((False, "360 images, fp32 (this CPU has no native bf16: fp32 is faster)"),
                         (True, "360 images, bf16\n")):
        monkeypatch.setattr(speed, "cpu_has_native_bf16", lambda: native)
        capsys.readouterr()
        assert main(["eval", "--checkpoint", str(out / "best"), "--precision", "bf16"]) == 0
        assert says in capsys.readouterr().out
