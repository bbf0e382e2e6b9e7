// Multi-head self-attention for bf16 inference on x86 CPUs with AMX (the paper's Appendix A, eq. 6-7):
//     out_h = softmax(q_h k_h^T * scale) v_h      for every image and head h
// read straight from the qkv linear's output, laid out (B, T, 3, H, D), and written as (B, T, H, D), so the
// projection that follows reads it as (B, T, H*D) with no copy. Built and loaded by vitkit/kernels/__init__.py;
// used by vitkit.optimize_for_inference(compile=True) (README, Speed, for the measurements).
//
// Per (image, head), on one core: k^T and v are repacked once into AMX's pair-interleaved layout; then for each
// block of 64 queries, S = q k^T (oneDNN's brgemm through ATen's cpublas, fp32 out), the softmax of S's rows
// (row max, 2^x by a cubic and AVX-512 scalef, bf16 out, left unnormalised), O = P v (brgemm), and O's rows
// divided by their sums on the way out. S and P stay in L1/L2: PyTorch's flash kernel takes ≈1.5x as long here.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/vec_half.h>
#include <ATen/native/CPUBlas.h>
#include <fbgemm/Utils.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using at::BFloat16;
namespace cpublas = at::native::cpublas;

constexpr int64_t kQueryBlock = 64;  // rows of S per brgemm: 48-64 measured best for T = 197

// k^T (D x Tp) in the layout brgemm wants for bf16, [D/2][Tp][2]: a transpose of k seen as T x D/2 pairs of
// bf16, i.e. of 32-bit words (fbgemm's SIMD transpose, moved as floats: bit for bit). Columns t >= T stay zero
// (the buffer is zeroed once).
void pack_keys(const BFloat16* k, int64_t ld, int64_t T, int64_t D, int64_t Tp, BFloat16* out) {
  fbgemm::transpose_simd<float>(T, D / 2, reinterpret_cast<const float*>(k), ld / 2, reinterpret_cast<float*>(out),
                                Tp);
}

// Softmax numerator of one row of S (T scores, Tp - T padding): p = 2^((s - max) * scale * log2 e) in bf16.
// Returns the row's sum. 2^y for y <= 0: 2^frac(y) by a cubic (relative error < 2.5e-4, under bf16's 3.9e-3),
// times 2^floor(y) by scalef; y is clamped at -100 so the padding (-inf) gives 2^-100 * p(0), i.e. ~0.
float softmax_row(float* s, int64_t T, int64_t Tp, float scale, BFloat16* p) {
  for (int64_t j = T; j < Tp; ++j) s[j] = -std::numeric_limits<float>::infinity();
  __m512 m0 = _mm512_loadu_ps(s), m1 = m0;
  int64_t j = 16;
  for (; j + 32 <= Tp; j += 32) {
    m0 = _mm512_max_ps(m0, _mm512_loadu_ps(s + j));
    m1 = _mm512_max_ps(m1, _mm512_loadu_ps(s + j + 16));
  }
  if (j < Tp) m0 = _mm512_max_ps(m0, _mm512_loadu_ps(s + j));
  const float c = scale * 1.4426950408889634f, mx = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
  const __m512 vc = _mm512_set1_ps(c), voff = _mm512_set1_ps(mx * c), lo = _mm512_set1_ps(-100.f);
  const __m512 c1 = _mm512_set1_ps(0.69542852f), c2 = _mm512_set1_ps(0.22694611f), c3 = _mm512_set1_ps(0.07737539f);
  const __m512 one = _mm512_set1_ps(1.f);
  auto exp2 = [&](__m512 x) {
    const __m512 y = _mm512_max_ps(_mm512_fmsub_ps(x, vc, voff), lo);
    const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(y, n);
    return _mm512_scalef_ps(_mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_fmadd_ps(c3, f, c2), f, c1), f, one), n);
  };
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  for (j = 0; j + 32 <= Tp; j += 32) {
    const __m512 e0 = exp2(_mm512_loadu_ps(s + j)), e1 = exp2(_mm512_loadu_ps(s + j + 16));
    s0 = _mm512_add_ps(s0, e0);
    s1 = _mm512_add_ps(s1, e1);
    _mm512_storeu_si512(p + j, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
  }
  if (j < Tp) {
    const __m512 e0 = exp2(_mm512_loadu_ps(s + j));
    s0 = _mm512_add_ps(s0, e0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), (__m256i)_mm512_cvtneps_pbh(e0));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}

at::Tensor vit_attention(const at::Tensor& qkv_in, double scale) {
  TORCH_CHECK(qkv_in.dim() == 5 && qkv_in.size(2) == 3 && qkv_in.scalar_type() == at::kBFloat16 &&
                  qkv_in.device().is_cpu() && qkv_in.size(4) % 16 == 0,
              "vitkit::vit_attention: expected a bf16 CPU tensor (B, T, 3, H, D) with D a multiple of 16, got ",
              qkv_in.scalar_type(), " ", qkv_in.sizes());
  const at::Tensor qkv = qkv_in.contiguous();
  const int64_t B = qkv.size(0), T = qkv.size(1), H = qkv.size(3), D = qkv.size(4);
  const int64_t Tp = (T + 15) / 16 * 16, ld = 3 * H * D;  // keys padded to whole AVX-512 vectors
  at::Tensor out = at::empty({B, T, H, D}, qkv.options());
  const BFloat16* src = qkv.const_data_ptr<BFloat16>();
  BFloat16* dst = out.mutable_data_ptr<BFloat16>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<BFloat16> kt(D * Tp, BFloat16(0.f)), vt(Tp * D, BFloat16(0.f)), p(kQueryBlock * Tp);
    std::vector<float> s(kQueryBlock * Tp), o(kQueryBlock * D), inv(kQueryBlock);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const BFloat16* q = src + b * T * ld + h * D;
      pack_keys(q + H * D, ld, T, D, Tp, kt.data());
      at::vec::pack_vnni2(q + 2 * H * D, vt.data(), ld, T, D);  // v: [T/2][D][2]; rows >= T stay zero
      for (int64_t t0 = 0; t0 < T; t0 += kQueryBlock) {
        const int64_t m = std::min(kQueryBlock, T - t0);
        cpublas::brgemm(m, Tp, D, ld, Tp, Tp, false, q + t0 * ld, kt.data(), s.data());
        for (int64_t i = 0; i < m; ++i) inv[i] = 1.f / softmax_row(&s[i * Tp], T, Tp, sc, &p[i * Tp]);
        cpublas::brgemm(m, D, Tp, Tp, D, D, false, p.data(), vt.data(), o.data());
        for (int64_t i = 0; i < m; ++i) {
          BFloat16* row = dst + ((b * T + t0 + i) * H + h) * D;
          const __m512 r = _mm512_set1_ps(inv[i]);
          for (int64_t d = 0; d < D; d += 16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(&o[i * D + d]), r)));
        }
      }
    }
    cpublas::brgemm_release();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(vitkit, m) { m.def("vit_attention(Tensor qkv, float scale) -> Tensor"); }
TORCH_LIBRARY_IMPL(vitkit, CPU, m) { m.impl("vit_attention", &vit_attention); }
