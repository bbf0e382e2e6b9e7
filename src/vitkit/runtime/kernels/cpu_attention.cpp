// Multi-head self-attention for bf16 inference on x86 CPUs with AMX (the paper's Appendix A, eq. 6-7):
//     out_h = softmax(q_h k_h^T * scale) v_h      for every image and head h
// read straight from the qkv linear's output, laid out (B, T, 3, H, D), and written as (B, T, H, D), so the
// projection that follows reads it as (B, T, H*D) with no copy. Built and loaded by vitkit/runtime/kernels/__init__.py;
// used by vitkit.optimize_for_inference(compile=True) (README, Speed, for the measurements).
//
// Per (image, head), on one core: k^T and v are repacked once into AMX's pair-interleaved layout; then for each
// block of 32 queries, S = q k^T on AMX tiles (fp32 out), the softmax of S's rows (row max, 2^x by a cubic and
// AVX-512 scalef, bf16 out, left unnormalised), O = P v on AMX tiles, and O's rows divided by their sums on the way
// out. S and P stay in L1/L2: PyTorch's flash kernel takes ≈1.5x as long here. The tiles are driven directly (not
// through oneDNN's brgemm, measured 3-5% slower for the whole compiled ViT-B/16): each call loads its own tile
// configuration and releases it at the end, and resets ATen's cached brgemm context so the next user of AMX
// (oneDNN, Inductor's GEMM templates, ATen's flash attention) configures the tiles afresh.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using at::BFloat16;
namespace cpublas = at::native::cpublas;

constexpr int64_t kQueryBlock = 32;  // query rows per block: two rows of tiles
constexpr int64_t kMaxHeadSize = 256;  // the per-thread buffers are sized from D: bounded

// k^T (D x Tp) in AMX's layout for bf16, [D/2][Tp][2]: out[d/2][t][d%2] = k[t][d] for t < T (row stride ld).
// Columns t >= T stay zero (the buffer is zeroed once). Plain loops over exactly T rows and D columns: O(T D) per
// head against the O(T^2 D) of the products, and nothing read outside the rows given (ATen's and fbgemm's internal
// packing helpers changed between torch versions; a kernel built against another torch must not depend on them).
void pack_keys(const BFloat16* k, int64_t ld, int64_t T, int64_t D, int64_t Tp, BFloat16* out) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < D; ++d) out[(d / 2) * Tp * 2 + t * 2 + d % 2] = k[t * ld + d];
}

// v (T x D, row stride ld) in AMX's layout, [T/2][D][2]: out[t/2][d][t%2] = v[t][d]. Rows t >= T stay zero.
void pack_values(const BFloat16* v, int64_t ld, int64_t T, int64_t D, BFloat16* out) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < D; ++d) out[(t / 2) * D * 2 + d * 2 + t % 2] = v[t * ld + d];
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

// AMX tiles, all 16 rows x 64 bytes: 0-3 accumulate a 32 x 32 fp32 block of C, 4-5 hold 32 rows of A (one
// K-chunk of 32 bf16), 6-7 two 16-column blocks of B (packed [K/2][N][2]).
struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// C (32 x N fp32, row stride ldc) = A (32 x K bf16, row stride lda) B (B packed [K/2][N][2]); K % 32 == 0,
// N % 16 == 0.
void gemm32(const BFloat16* A, int64_t lda, const BFloat16* Bp, int64_t K, int64_t N, float* C, int64_t ldc) {
  for (int64_t n = 0; n < N; n += 32) {
    const bool two = n + 16 < N;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < K; k += 32) {
      _tile_loadd(4, A + k, lda * 2);
      _tile_loadd(5, A + 16 * lda + k, lda * 2);
      _tile_loadd(6, Bp + k * N + n * 2, N * 4);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(2, 5, 6);
      if (two) {
        _tile_loadd(7, Bp + k * N + (n + 16) * 2, N * 4);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, C + n, ldc * 4);
    _tile_stored(2, C + 16 * ldc + n, ldc * 4);
    if (two) {
      _tile_stored(1, C + n + 16, ldc * 4);
      _tile_stored(3, C + 16 * ldc + n + 16, ldc * 4);
    }
  }
}

at::Tensor vit_attention(const at::Tensor& qkv_in, double scale) {
  TORCH_CHECK(qkv_in.dim() == 5 && qkv_in.size(2) == 3 && qkv_in.scalar_type() == at::kBFloat16 &&
                  qkv_in.device().is_cpu() && qkv_in.size(4) % 16 == 0 && qkv_in.size(4) <= kMaxHeadSize &&
                  qkv_in.size(0) > 0 && qkv_in.size(1) > 0 && qkv_in.size(3) > 0,
              "vitkit::vit_attention: expected a bf16 CPU tensor (B, T, 3, H, D) with D a multiple of 16 (at most ",
              kMaxHeadSize, ") and B, T, H at least 1, got ", qkv_in.scalar_type(), " ", qkv_in.sizes());
  // Every index below assumes this dense layout: a strided or overlapping input is copied into it first.
  const at::Tensor qkv = qkv_in.contiguous();
  TORCH_CHECK(qkv.is_contiguous() && qkv.storage_offset() >= 0, "vitkit::vit_attention: could not make qkv dense");
  const int64_t B = qkv.size(0), T = qkv.size(1), H = qkv.size(3), D = qkv.size(4);
  // keys padded: to whole AVX-512 vectors for S and the softmax (Ts), to whole 32-key tile chunks for P v (Tk);
  // the head size to whole 32-element chunks for q k^T (Dp), by copying q when D is not a multiple of 32
  const int64_t Ts = (T + 15) / 16 * 16, Tk = (T + 31) / 32 * 32, Dp = (D + 31) / 32 * 32, ld = 3 * H * D;
  at::Tensor out = at::empty({B, T, H, D}, qkv.options());
  const BFloat16* src = qkv.const_data_ptr<BFloat16>();
  BFloat16* dst = out.mutable_data_ptr<BFloat16>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    TileConfig cfg;
    for (int i = 0; i < 8; ++i) cfg.rows[i] = 16, cfg.colsb[i] = 64;
    _tile_loadconfig(&cfg);
    std::vector<BFloat16> kt(Dp * Ts, BFloat16(0.f)), vt(Tk * D, BFloat16(0.f)), p(kQueryBlock * Tk, BFloat16(0.f)),
        qcopy(kQueryBlock * Dp, BFloat16(0.f));
    std::vector<float> s(kQueryBlock * Ts), o(kQueryBlock * D), inv(kQueryBlock);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const BFloat16* q = src + b * T * ld + h * D;
      pack_keys(q + H * D, ld, T, D, Ts, kt.data());  // rows >= D/2 and columns >= T stay zero
      pack_values(q + 2 * H * D, ld, T, D, vt.data());  // rows >= T stay zero
      for (int64_t t0 = 0; t0 < T; t0 += kQueryBlock) {
        const int64_t m = std::min(kQueryBlock, T - t0);
        const BFloat16* qb = q + t0 * ld;
        int64_t ldq = ld;
        if (m < kQueryBlock || Dp != D) {  // tiles read 32 rows of Dp: copy into a zero-padded block
          for (int64_t i = 0; i < m; ++i) std::copy(qb + i * ld, qb + i * ld + D, &qcopy[i * Dp]);
          qb = qcopy.data(), ldq = Dp;
        }
        gemm32(qb, ldq, kt.data(), Dp, Ts, s.data(), Ts);
        for (int64_t i = 0; i < m; ++i) inv[i] = 1.f / softmax_row(&s[i * Ts], T, Ts, sc, &p[i * Tk]);
        gemm32(p.data(), Tk, vt.data(), Tk, D, o.data(), D);
        for (int64_t i = 0; i < m; ++i) {
          BFloat16* row = dst + ((b * T + t0 + i) * H + h) * D;
          const __m512 r = _mm512_set1_ps(inv[i]);
          for (int64_t d = 0; d < D; d += 16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(&o[i * D + d]), r)));
        }
      }
    }
    _tile_release();
    cpublas::brgemm_release();  // ATen's cached brgemm must configure the tiles again before its next use
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(vitkit, m) { m.def("vit_attention(Tensor qkv, float scale) -> Tensor"); }
TORCH_LIBRARY_IMPL(vitkit, CPU, m) { m.impl("vit_attention", &vit_attention); }
