"""vitkit's AMX attention kernel (vitkit/kernels): checked against exact fp32 attention and PyTorch's own bf16
SDPA on the same inputs. Skipped where it cannot be built (no AMX, no compiler): there the model keeps SDPA."""
import pytest
import torch
import torch.nn.functional as F

import vitkit
from vitkit.runtime import kernels
from vitkit.runtime.inference import use_cpu_attention_kernel



def kernel_layers(model):
    return sum(getattr(m, "impl", None) == "cpu_kernel" for m in model.modules())


needs_kernel = pytest.mark.skipif(not kernels.load(), reason="the AMX attention kernel cannot be built here")


def exact_attention(qkv: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v in fp32, (B, T, 3, H, D) -> (B, T, H, D)."""
    q, k, v = qkv.float().permute(2, 0, 3, 1, 4).unbind(0)
    return (torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, dim=-1) @ v).transpose(1, 2)


@needs_kernel
@pytest.mark.parametrize("B,T,H,D", [(2, 197, 3, 64), (3, 50, 4, 32), (1, 5, 2, 16), (1, 1, 1, 16), (1, 577, 2, 64),
                                     (2, 65, 2, 80)])
def test_kernel_matches_exact_attention_as_closely_as_pytorch_sdpa(B, T, H, D):
    torch.manual_seed(T)
    qkv = (torch.randn(B, T, 3, H, D) * 2).bfloat16()  # * 2: peaked softmaxes too
    ref = exact_attention(qkv)
    out = kernels.vit_attention(qkv, D ** -0.5)
    assert out.shape == (B, T, H, D) and out.dtype == torch.bfloat16
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    sdpa_err = (F.scaled_dot_product_attention(q, k, v).transpose(1, 2).float() - ref).abs().max().item()
    err = (out.float() - ref).abs().max().item()
    assert err <= 1.5 * sdpa_err + 2e-3, f"kernel {err} vs SDPA {sdpa_err}"


@needs_kernel
def test_kernel_takes_a_strided_qkv_and_refuses_what_it_cannot_do():
    qkv = torch.randn(2, 9, 3, 2, 32).bfloat16()
    strided = torch.randn(2, 3, 9, 2, 32).bfloat16().transpose(1, 2)  # same shape, not contiguous
    err = (kernels.vit_attention(strided, 32 ** -0.5).float() - exact_attention(strided)).abs().max().item()
    assert err < 0.02
    with pytest.raises(RuntimeError, match="bf16 CPU tensor .* multiple of 16"):
        kernels.vit_attention(qkv.float(), 0.2)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernels.vit_attention(torch.randn(2, 9, 3, 2, 24).bfloat16(), 0.2)


@needs_kernel
def test_compiled_bf16_inference_uses_the_kernel_and_agrees_with_the_fp32_model():
    model = vitkit.create_model("vit_small_patch16_224", img_size=32, depth=2, num_classes=10).eval()
    with torch.no_grad():
        model.head.weight.normal_(0, 0.02)
        ref = model(x := torch.randn(3, 3, 32, 32))
    eager = vitkit.optimize_for_inference(model)
    assert kernel_layers(eager) == 0  # eager: SDPA unless asked
    fast = vitkit.optimize_for_inference(model, compile=True)
    assert kernel_layers(fast) == 2
    out = fast(x)
    assert out.dtype == torch.float32
    assert (out - ref).abs().max() <= 2 * (eager(x) - ref).abs().max() + 1e-3  # as close as bf16 SDPA is
    _, attns = fast.forward_attention(x)  # attention maps take the exact path
    assert len(attns) == 2 and attns[0].shape == (3, 6, 5, 5)
    assert kernel_layers(model) == 0  # the user's model is untouched


@needs_kernel
def test_kernel_attention_trains_and_keeps_head_sizes_it_cannot_take():
    model = vitkit.create_model("vit_tiny_patch16_224", img_size=32, depth=1, num_classes=4).bfloat16()
    assert use_cpu_attention_kernel(model) == 1
    model.train()  # training takes Attention's own path (the kernel has no backward)
    model(torch.randn(2, 3, 32, 32).bfloat16()).float().sum().backward()
    odd = vitkit.create_model("vit_tiny_patch16_224", img_size=32, depth=1, embed_dim=72, num_heads=3)
    assert use_cpu_attention_kernel(odd) == 0  # head size 24


def test_kernel_is_off_without_a_compiler_or_when_turned_off(monkeypatch):
    for patch in (lambda m: m.setenv("VITKIT_CPU_KERNELS", "0"),
                  lambda m: m.setattr(kernels, "has_cxx_compiler", lambda: False),
                  lambda m: m.setattr(kernels, "cpu_supported", lambda: False)):
        kernels.load.cache_clear()
        with monkeypatch.context() as m:
            patch(m)
            assert kernels.load() is False
            model = vitkit.create_model("vit_tiny_patch16_224", img_size=32, depth=1)
            assert use_cpu_attention_kernel(model.bfloat16()) == 0
    kernels.load.cache_clear()


@needs_kernel
def test_other_amx_users_still_agree_after_the_kernel():
    # the kernel drives AMX tiles itself: oneDNN's matmuls and ATen's flash attention (cached brgemm) must still
    # configure their own tiles afterwards, alternating with it
    torch.manual_seed(0)
    qkv = torch.randn(2, 197, 3, 4, 64).bfloat16()
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    a, b = torch.randn(300, 768).bfloat16(), torch.randn(768, 512).bfloat16()
    mm_ref, sdpa_ref = (a.float() @ b.float()), F.scaled_dot_product_attention(q, k, v).float()
    for _ in range(3):
        kernels.vit_attention(qkv, 0.125)
        torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v).float(), sdpa_ref)
        kernels.vit_attention(qkv, 0.125)
        assert ((a @ b).float() - mm_ref).abs().max() <= 0.01 * mm_ref.abs().max()


def test_a_kernel_that_crashes_or_errs_in_its_proof_is_refused_and_the_verdict_kept(monkeypatch, tmp_path):
    """The proof runs in a child process: a segfault there (as on the 16-core AMX host) is a refusal with the
    signal named, never the user's process going down; the verdict is remembered."""
    monkeypatch.setenv("VITKIT_CACHE_DIR", str(tmp_path))
    segfault = "import ctypes; ctypes.string_at(0)"
    with pytest.warns(UserWarning, match="failed its proof on this machine .*SIGSEGV"):
        assert kernels.proven(segfault) is False
    assert kernels.proven("pass") is False  # remembered: not run again
    for f in tmp_path.glob("kernel-*.json"):
        f.unlink()
    with pytest.warns(UserWarning, match="exit 1: AssertionError: 16 threads"):
        assert kernels.proven("raise AssertionError('16 threads, (B, T, H, D) = (1, 1, 1, 16)')") is False
    for f in tmp_path.glob("kernel-*.json"):
        f.unlink()
    assert kernels.proven("pass") is True


def test_the_proof_catches_a_wrong_kernel_and_passes_exact_attention():
    def exact(qkv, scale):
        q, k, v = qkv.float().permute(2, 0, 3, 1, 4).unbind(0)
        return (torch.softmax(q @ k.transpose(-2, -1) * scale, -1) @ v).transpose(1, 2).bfloat16()

    def keys_as_queries(qkv, scale):  # a plausible indexing slip: k read where q is
        return exact(qkv[:, :, [1, 1, 2]], scale)

    def contiguous_only(qkv, scale):  # ignores strides: reads the storage as if dense
        return exact(torch.as_strided(qkv, qkv.shape, qkv.contiguous().stride()), scale)

    kernels.run_proof(exact)
    for wrong in (keys_as_queries, contiguous_only):
        with pytest.raises(AssertionError, match="max error"):
            kernels.run_proof(wrong)


@pytest.mark.skipif(not kernels.has_cxx_compiler(), reason="no C++ compiler")
def test_the_kernel_source_compiles_against_this_torch(tmp_path):
    """Built for AMX whatever this CPU is (not run: only an AMX CPU can), so every CI run compiles it against the
    torch it tests, with every warning shown."""
    import subprocess
    import sys

    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        pytest.skip("no ninja")
    code = ("from torch.utils import cpp_extension; from vitkit.runtime.kernels import SOURCE; "
            "cpp_extension.load(name='vitkit_compile_check', sources=[str(SOURCE)], "
            f"build_directory={str(tmp_path)!r}, "
            "is_python_module=False, extra_cflags=['-O1', '-mavx512f', '-mavx512bf16', '-mamx-tile', '-mamx-bf16', "
            "'-fopenmp', '-Wall'], extra_ldflags=['-fopenmp'])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
