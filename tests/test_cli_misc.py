"""Smaller CLI commands and public names from INTERFACE.md."""

import time

import pytest
import torch

import vitkit
from vitkit.cli.main import main


def test_summary_prints_torchinfo_table_with_params_and_macs(capsys):
    assert main(["summary", "--model", "vit_tiny_patch16_224", "--img-size", "32", "--patch-size", "8",
                 "--num-classes", "10"]) == 0
    out = capsys.readouterr().out
    model = vitkit.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, num_classes=10)
    assert f"parameters: {model.num_params:,}" in out
    assert "Attention" in out and "Total mult-adds" not in out  # torchinfo's count is per image, not per token
    assert "GFLOP per image" in out
    # ViT-B/16: 17.6 GMACs per 224x224 image (timm's model card); by hand, patches 196*768*768 plus 12 blocks of
    # qkv 197*768*2304, q k^T and A v 2*197^2*768, proj 197*768^2, MLP 2*197*768*3072, plus the head 768*1000
    block = 197 * 768 * 2304 + 2 * 197**2 * 768 + 197 * 768**2 + 2 * 197 * 768 * 3072
    by_hand = 196 * 768 * 768 + 12 * block + 768 * 1000
    assert vitkit.flops_per_image(vitkit.create_model("vit_base_patch16_224").config) == 2 * by_hand
    assert abs(by_hand / 1e9 - 17.6) < 0.05


def test_unknown_preset_is_a_clean_cli_error(capsys):
    assert main(["summary", "--model", "vit_giant_patch99"]) == 2
    assert "unknown model 'vit_giant_patch99'" in capsys.readouterr().err


def test_interface_names_exist():
    import vitkit.inspect as vi
    import vitkit.interop as io

    for name in ("attention_rollout", "mean_attention_distance", "pos_embed_similarity", "patch_embed_filters"):
        assert callable(getattr(vi, name))
    for name in ("from_timm", "from_hf", "from_jax_npz", "to_timm", "to_hf"):
        assert callable(getattr(io, name))
    assert "vit_base_patch16_224" in vitkit.list_models()


def test_optimize_for_inference_is_close_to_fp32_and_keeps_the_original():
    model = vitkit.create_model("vit_small_patch16_224", img_size=64, num_classes=10).eval()
    with torch.no_grad():
        model.head.weight.normal_(0, 0.02)
    x = torch.randn(4, 3, 64, 64)
    fast = vitkit.optimize_for_inference(model)
    with torch.no_grad():
        ref = model(x)
    out = fast(x)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert (out - ref).abs().max() < 0.05 * ref.abs().max() + 1e-3
    assert next(model.parameters()).dtype == torch.float32  # the original is untouched
    fp32 = vitkit.optimize_for_inference(model, dtype=None)
    torch.testing.assert_close(fp32(x), ref, rtol=1e-5, atol=1e-5)


def test_optimize_for_inference_with_compile_runs_and_agrees():
    # torch.compile under inference_mode failed ("Cannot set version_counter for inference tensor"): the compiled
    # path must run, agree with the eager model and still give attention maps
    model = vitkit.create_model("vit_small_patch16_224", img_size=32, depth=2, num_classes=10).eval()
    with torch.no_grad():
        model.head.weight.normal_(0, 0.02)
        ref = model(x := torch.randn(2, 3, 32, 32))
    fast = vitkit.optimize_for_inference(model, dtype=None, compile=True)
    torch.testing.assert_close(fast(x), ref, rtol=1e-4, atol=1e-4)
    logits, attns = fast.forward_attention(x)
    assert len(attns) == 2 and attns[0].shape == (2, 6, 5, 5) and fast.config.depth == 2
    assert "max-autotune" in fast.compile_note and "per input shape" in fast.compile_note  # said before it is paid
    from vitkit.runtime.inference import compile_mode
    # on a GPU the default mode: max-autotune took 168 s for ViT-B/16 on an H100 against 15 s, for 7%
    assert compile_mode(torch.device("cuda")) == "default" and compile_mode(torch.device("cpu")) == "max-autotune"


def test_bench_inference_times_vitkit_and_every_peer_on_the_same_weights(monkeypatch):
    from vitkit.bench.inference import bench_inference
    from vitkit.runtime import inference

    rows = bench_inference("vit_tiny_patch16_224", 2, "fp32", ("timm", "hf", "torchvision"), repeats=2,
                           log=lambda s: None, img_size=32, depth=1)
    assert [(r["impl"], r["mode"]) for r in rows] == [("vitkit", "optimized"), ("timm", "fp32"), ("hf", "fp32"),
                                                      ("torchvision", "fp32")]
    assert all(r["img_s"] > 0 and r["max_abs_diff"] < 1e-3 for r in rows)  # the same model in every library
    # the default group: vitkit as optimize_for_inference chooses (timed here), every peer in each of its dtypes
    for faster in ("bf16", "fp32"):
        monkeypatch.setattr(inference, "choose_inference_dtype",
                            lambda model, batch, refresh=False, f=faster: (
                                None if f == "fp32" else torch.bfloat16, None))
        auto = bench_inference("vit_tiny_patch16_224", 2, "auto", ("timm",), repeats=1, log=lambda s: None,
                               img_size=32, depth=1)
        assert [(r["impl"], r["mode"], r["compute"]) for r in auto] == [
            ("vitkit", f"optimized ({faster})", faster), ("timm", "fp32", "fp32"), ("timm", "bf16-autocast", "bf16"),
            ("timm", "bf16-weights", "bf16")]


def test_interleaved_throughput_times_each_function_in_turn_each_round_starting_one_further():
    from vitkit.bench.timing import interleaved_throughput

    calls = []
    fns = [lambda: calls.append("a"), lambda: calls.append("b"), lambda: (calls.append("c"), time.sleep(0.01))]
    speeds = interleaved_throughput(fns, items=4, warmup=1, repeats=3)
    assert calls == ["a", "b", "c"] + ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert len(speeds) == 3 and speeds[2] < min(speeds[:2])  # each speed is its own function's


@pytest.mark.cuda
def test_bench_inference_on_a_gpu_reports_memory_and_agrees_with_the_cpu():
    from vitkit.bench.inference import bench_inference

    rows = bench_inference("vit_tiny_patch16_224", 64, "bf16", ("timm", "hf", "torchvision", "onnxruntime"),
                           repeats=2, log=lambda s: None, int8=True, device="cuda")
    assert {r["impl"] for r in rows} == {"vitkit", "timm", "hf", "torchvision"}  # onnxruntime: CPU only
    assert all(r["device"].startswith("cuda") and r["gpu_mem_mb"] > 0 and r["img_s"] > 0 for r in rows)


def test_bench_cli_reports_against_the_higher_of_two_ceiling_measurements(tmp_path, capsys, monkeypatch,
                                                                          bf16_keeps_up):
    import json

    import vitkit.bench.timing as timing

    ceilings = iter([100e9, 200e9, 300e9, 150e9])  # fp32, bf16 at the start; fp32, bf16 at the end
    monkeypatch.setattr(timing, "matmul_ceiling", lambda dtype, n=2048, device="cpu": next(ceilings))
    out = tmp_path / "b.json"
    assert main(["bench", "--models", "vit_tiny_patch16_224", "--batches", "1", "--dtypes", "fp32", "--peers",
                 "timm", "--repeats", "1", "--no-compile", "--no-int8", "--no-train", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["ceiling_flop_s"] == {"fp32": 300e9, "bf16": 200e9}
    for r in result["rows"]:
        assert r["frac_of_ceiling"] == pytest.approx(r["gflop_per_img"] * 1e9 * r["img_s"] / 300e9)
    assert {r["impl"] for r in result["rows"]} == {"vitkit", "timm"}
    assert "the higher of the two is used" in capsys.readouterr().out


def test_bench_does_not_time_the_bf16_ceiling_where_bf16_is_emulated(tmp_path, capsys, monkeypatch):
    """On an AVX2-only EPYC the bf16 ceiling's 2048^3 matmuls ran for over 6 minutes with nothing printed."""
    import json
    import math

    import vitkit.bench.timing as timing
    import vitkit.runtime.cpu as cpu_mod

    monkeypatch.setattr(cpu_mod, "bf16_matmul_slowdown", lambda: 36.6)
    asked = []
    monkeypatch.setattr(timing, "matmul_ceiling", lambda dtype, n=2048, device="cpu": asked.append(dtype) or 50e9)
    out = tmp_path / "b.json"
    assert main(["bench", "--models", "vit_tiny_patch16_224", "--batches", "1", "--dtypes", "fp32", "--peers",
                 "timm", "--repeats", "1", "--no-compile", "--no-int8", "--no-train", "--json", str(out)]) == 0
    assert asked == [torch.float32, torch.float32]  # the two fp32 measurements, no bf16 one
    assert "bf16 matmul ceiling not timed: its matmuls take 36.6x fp32's on this CPU" in capsys.readouterr().out
    ceiling = json.loads(out.read_text())["ceiling_flop_s"]
    assert ceiling["fp32"] == 50e9 and math.isnan(ceiling["bf16"])


@pytest.mark.long  # (17-43 s on a 2-core AVX2 EPYC: the default suite is kept under 10 minutes)
def test_bench_times_onnxruntime_as_a_peer_and_vitkits_int8_export_beside_it():
    pytest.importorskip("onnxruntime")
    from vitkit.bench import inference

    small = {"img_size": 32, "patch_size": 8, "num_classes": 10}
    inference._ONNX.clear()
    for batch in (1, 3):  # the second batch size reuses the first one's export
        rows = inference.bench_inference("vit_tiny_patch16_224", batch, "fp32", peers=("timm", "onnxruntime"),
                                         repeats=1, int8=True, log=lambda _: None, **small)
        by = {(r["impl"], r["compute"]): r for r in rows}
        assert set(by) == {("vitkit", "fp32"), ("vitkit", "int8"), ("timm", "fp32"), ("onnxruntime", "fp32")}
        assert by[("onnxruntime", "fp32")]["max_abs_diff"] <= 1e-3  # the same model (checked before timing)
        assert 0 < by[("vitkit", "int8")]["max_abs_diff"] <= 0.1  # relative: moved, but not broken
    assert len(inference._ONNX) == 1


def test_bench_cli_default_rates_vitkits_chosen_dtype_against_that_dtypes_ceiling(tmp_path, capsys, monkeypatch,
                                                                                  bf16_keeps_up):
    import json

    import vitkit.bench.timing as timing
    from vitkit.runtime import inference

    monkeypatch.setattr(timing, "matmul_ceiling",
                        lambda dtype, n=2048, device="cpu": 300e9 if dtype == torch.float32 else 60e9)
    monkeypatch.setattr(inference, "choose_inference_dtype", lambda model, batch, refresh=False: (None, None))
    out = tmp_path / "b.json"
    assert main(["bench", "--models", "vit_tiny_patch16_224", "--batches", "1", "--peers", "timm", "--repeats", "1",
                 "--no-compile", "--no-int8", "--no-train", "--json", str(out)]) == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"optimized (fp32)", "fp32", "bf16-autocast", "bf16-weights"}
    for mode, r in rows.items():  # each row against the ceiling of the dtype it computes in
        ceiling = 300e9 if r["compute"] == "fp32" else 60e9
        assert r["frac_of_ceiling"] == pytest.approx(r["gflop_per_img"] * 1e9 * r["img_s"] / ceiling)
        assert r["dtype"] == "auto" and r["ratio_to_best_peer"] > 0
    said = capsys.readouterr().out
    assert "[1/1] inference vit_tiny_patch16_224 batch 1 auto" in said
    assert main(["bench", "--dtypes", "fp16", "--no-train"]) == 2

@pytest.mark.long
def test_bench_time_to_accuracy_runs_the_readme_command_cold_and_reports_its_final_line(tmp_path, monkeypatch,
                                                                                          capsys):
    import json

    user_cache = tmp_path / "my-inductor-cache"
    user_cache.mkdir()
    (user_cache / "keep.txt").write_text("mine")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(user_cache))
    assert main(["bench", "--time-to-accuracy", "digits", "--runs-dir", str(tmp_path / "runs"),
                 "--json", str(tmp_path / "tta.json")]) == 0
    (row,) = json.loads((tmp_path / "tta.json").read_text())["rows"]
    (run_dir,) = (tmp_path / "runs").iterdir()
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["val_top1"] == pytest.approx(last["val_top1"], abs=0.005) and row["val_top1"] >= 90
    assert row["epochs"] == last["epoch"] == 40
    assert row["wall_s"] >= row["elapsed_s"] > 0 and row["cold_cache"] and row["output"] == str(run_dir)
    assert (user_cache / "keep.txt").read_text() == "mine"  # the cold start used its own cache folder
    assert "digits " in capsys.readouterr().out


def test_bench_refuses_counts_below_one_before_timing_anything(capsys):
    for flag in ("--repeats", "--train-steps"):
        with pytest.raises(SystemExit) as e:
            main(["bench", flag, "0"])
        assert e.value.code == 2
        assert f"argument {flag}: expected a whole number of at least 1, got '0'" in capsys.readouterr().err


def test_bench_time_to_accuracy_checks_names_and_data_before_running(tmp_path, capsys):
    assert main(["bench", "--time-to-accuracy", "digits,fmnist7"]) == 2
    assert "'fmnist7': expected one of digits, fmnist5, fmnist30, cifar30" in capsys.readouterr().err
    assert main(["bench", "--time-to-accuracy", "digits,cifar30", "--data-dir", str(tmp_path / "no.zip"),
                 "--runs-dir", str(tmp_path / "runs")]) == 2
    assert "cifar30: " + str(tmp_path / "no.zip") + " not found" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # not even the digits run started
