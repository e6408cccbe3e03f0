// Native CPU operations the torch model calls, registered as torch ops (namespace xserv_cpu).
//
// int8_linear: W8A8 int8, the scheme of SGLang's and vLLM's CPU `w8a8_int8`: weights quantized
// per output channel at load (symmetric, int8), activations per token at run time (symmetric,
// carried as uint8 = int8 + 128, the operand order of AVX512-VNNI's vpdpbusd), int32 sums, then
//   y[b, n] = x_scale[b] * w_scale[n] * (sum_k xu8[b, k] * w[n, k] - 128 * sum_k w[n, k]).
// Weights are held once, in the layout vpdpbusd reads without shuffles: blocks of 16 output
// channels, each a run of [K / 4][16 channels][4 k] bytes, so one 64-byte load feeds one
// instruction of 64 multiply-adds, and a decode step streams every weight byte exactly once.
// Built by layers/native.py with the system's g++ and torch's headers (-march=native); where the
// CPU has no AVX512-VNNI, has_vnni() says so and layers/int8.py runs the torch fallback instead.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define XSERV_VNNI 1
#else
#define XSERV_VNNI 0
#endif

namespace {

#if defined(__AVX512F__)
// 16 bf16 -> float: a widening load and a 16-bit shift. Written out: gcc (12, -march=native on
// Zen 5) splits the generic vector conversion into 256-bit halves, six instructions for two
// (decode attention from L2: 7-16 % faster with this).
inline __m512 widen_bf16(const void* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p))), 16));
}
#endif

constexpr int64_t BLOCK = 16;    // output channels per block
constexpr int64_t GROUP = 4;     // blocks a thread streams side by side (4 x 16 channels)
constexpr int64_t TOKENS = 6;    // tokens per register tile (6 x 4 accumulators + 4 weights)

int64_t padded(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// [N, K] int8 -> packed [ceil(N / 16), K4 / 4, 16, 4] int8 (K4 = K rounded up to 4; zeros pad),
// plus 128 * each channel's weight sum (int32 [N16]), which the uint8 activations' offset adds.
std::tuple<at::Tensor, at::Tensor> int8_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar, "int8_pack: an int8 [N, K] weight");
  auto plain = w.contiguous();
  const int64_t n = plain.size(0), k = plain.size(1), n16 = padded(n, BLOCK), k4 = padded(k, 4);
  auto packed = at::zeros({n16 / BLOCK, k4 / 4, BLOCK, 4}, plain.options());
  auto comp = at::zeros({n16}, plain.options().dtype(at::kInt));
  const int8_t* src = plain.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  int32_t* c = comp.data_ptr<int32_t>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      int8_t* block = dst + (row / BLOCK) * k4 * BLOCK;
      int64_t lane = row % BLOCK, sum = 0;
      for (int64_t i = 0; i < k; ++i) {
        block[(i / 4) * BLOCK * 4 + lane * 4 + i % 4] = src[row * k + i];
        sum += src[row * k + i];
      }
      c[row] = static_cast<int32_t>(128 * sum);
    }
  });
  return {packed, comp};
}

template <typename T>
float to_float(T v) { return static_cast<float>(v); }

#if XSERV_VNNI
inline __m512 ps16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 ps16(const at::BFloat16* p) { return widen_bf16(p); }

// Each token's row of x -> uint8 (int8 + 128, K rounded up to 4, padding 128: zero) and its scale.
// 16 elements at a time (scalar, it was a quarter of a 16-prompt int8 prefill's linears: 2.2 ms
// for 3040 x 1024); the same arithmetic: x / scale, not x * (1 / scale), the torch op's rounding,
// and _mm512_cvtps_epi32 rounds to nearest even as nearbyint does.
// OFFSET 0 (int4_linear's, whose weights are the unsigned operand): the int8 values as they are.
template <typename T, int OFFSET = 128>
void quantize_rows(const T* x, int64_t rows, int64_t k, int64_t k4, uint8_t* q, float* scales) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * k;
      __m512 amax16 = _mm512_setzero_ps();
      int64_t i = 0;
      for (; i + 16 <= k; i += 16) amax16 = _mm512_max_ps(amax16, _mm512_abs_ps(ps16(row + i)));
      float amax = _mm512_reduce_max_ps(amax16);
      for (; i < k; ++i) amax = std::max(amax, std::fabs(to_float(row[i])));
      const float scale = amax > 0.f ? amax / 127.f : 1.f;
      const __m512 s16 = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
      uint8_t* out = q + r * k4;
      for (i = 0; i + 16 <= k; i += 16) {
        const __m512 v = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_div_ps(ps16(row + i), s16)));
        const __m512i u = _mm512_add_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(OFFSET));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(u));
      }
      for (; i < k; ++i) {
        float v = std::nearbyint(to_float(row[i]) / scale);
        out[i] = static_cast<uint8_t>(static_cast<int32_t>(std::max(-127.f, std::min(127.f, v))) + OFFSET);
      }
      for (i = k; i < k4; ++i) out[i] = OFFSET;
      scales[r] = scale;
    }
  });
}

inline void store16(float* out, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(out, mask, v); }

inline void store16(at::BFloat16* out, __m512 v, __mmask16 mask) {
#if defined(__AVX512BF16__)
  __m256i bf = (__m256i)_mm512_cvtneps_pbh(v);
#else  // round to nearest even by hand
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  __m256i bf = _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
#endif
  _mm256_mask_storeu_epi16(out, mask, bf);
}

// What a packed matmul's tile multiplies and how it writes its sums, for the two weight formats
// held in the same blocked layout: a k step is 4 bytes of an x row broadcast against 64 bytes of
// a block (16 channels), `k4` the bytes of an x row. Int8: uint8 x (4 values) times int8 weights
// by vpdpbusd into int32, then offset, scales; bf16: 2 bf16 values of x times 2 of each channel by
// vdpbf16ps into fp32 (bf16_linear).
struct Int8Sums {
  using Acc = __m512i;
  const int32_t* comp;    // 128 * each channel's weight sum
  const float* wscale;    // each channel's scale
  const float* xs;        // each x row's scale
  static Acc zero() { return _mm512_setzero_si512(); }
  static Acc fma(Acc acc, __m512i x, __m512i w) { return _mm512_dpbusd_epi32(acc, x, w); }
  Int8Sums from(int64_t row) const { return {comp, wscale, xs + row}; }  // a tile's, from that row of x
  // row i's sums of the 16 channels from c0 (mask: those below n) into out
  template <typename T>
  void store(T* out, Acc acc, int64_t i, int64_t c0, __mmask16 mask) const {
    const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, _mm512_loadu_si512(comp + c0)));
    store16(out, _mm512_mul_ps(v, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, wscale + c0), _mm512_set1_ps(xs[i]))), mask);
  }
};

#if defined(__AVX512BF16__)
struct Bf16Sums {
  using Acc = __m512;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc fma(Acc acc, __m512i x, __m512i w) { return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w); }
  Bf16Sums from(int64_t) const { return {}; }
  template <typename T>
  void store(T* out, Acc acc, int64_t, int64_t, __mmask16 mask) const { store16(out, acc, mask); }
};
#endif

inline __mmask16 channels_mask(int64_t c0, int64_t n) {  // of the 16 channels from c0, those below n
  return c0 >= n ? (__mmask16)0 : n - c0 >= BLOCK ? (__mmask16)0xffff : (__mmask16)((1u << (n - c0)) - 1);
}

// One tile: MB tokens x NV blocks of 16 channels, over the whole K.
template <int MB, int NV, typename S, typename T>
inline void tile(const uint8_t* xq, int64_t k4, const S& sums, const int8_t* w, int64_t n, int64_t n0, T* y,
                 int64_t ldy) {
  // every loop over MB and NV fully unrolled, with no early exit, so that the accumulators live in
  // registers: an array indexed past a `break` stays in memory, a store and a load per vpdpbusd
  typename S::Acc acc[MB][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[i][j] = S::zero();
  const int64_t block_bytes = k4 * BLOCK;
  for (int64_t kk = 0; kk < k4 / 4; ++kk) {
    __m512i wv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) wv[j] = _mm512_loadu_si512(w + j * block_bytes + kk * 64);
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const __m512i xb = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xq + i * k4 + kk * 4));
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[i][j] = S::fma(acc[i][j], xb, wv[j]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < NV; ++j) {
    const int64_t c0 = n0 + j * BLOCK;  // < the padded width: comp and the packed weight have it
    const __mmask16 mask = channels_mask(c0, n);
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) sums.store(y + i * ldy + c0, acc[i][j], i, c0, mask);
  }
}

// How far ahead (in k steps of 64 bytes a block) the first tile of a group asks for its own four
// blocks into L2. One core's hardware prefetchers keep too few lines in flight to stream at the
// rate a plain sum reads: on a 2-core Zen 4 VM, 16 steps (4 KB across the blocks) read 3-10 %
// faster on one thread and 2-3 % on two (docs/benchmarks-log.md, 2026-12-06 afternoon).
constexpr int64_t STREAM_AHEAD = 16;

// The tile of a whole group (4 blocks, 64 channels) written out with named accumulators: gcc keeps
// a 2-D array of vectors in memory (a store and a load around every few vpdpbusd), named ones in
// registers (24 accumulators, 4 weights and a broadcast: 29 of the 32). With `ahead`, two cache
// lines from there are requested per k step (tokens_tiles); with `stream` (the tile that reads
// the group from memory), each block's line STREAM_AHEAD steps on.
template <int MB, typename S, typename T>
inline void tile_group(const uint8_t* xq, int64_t k4, const S& sums, const int8_t* w, int64_t n, int64_t n0, T* y,
                       int64_t ldy, const int8_t* ahead = nullptr, bool stream = false) {
  const typename S::Acc z = S::zero();
  typename S::Acc c00 = z, c01 = z, c02 = z, c03 = z, c10 = z, c11 = z, c12 = z, c13 = z, c20 = z, c21 = z, c22 = z,
                  c23 = z, c30 = z, c31 = z, c32 = z, c33 = z, c40 = z, c41 = z, c42 = z, c43 = z, c50 = z, c51 = z,
                  c52 = z, c53 = z;
  const int64_t bb = k4 * BLOCK;
  for (int64_t kk = 0; kk < k4 / 4; ++kk) {
    const int8_t* wk = w + kk * 64;
    if (ahead) __builtin_prefetch(ahead + kk * 128, 0, 2), __builtin_prefetch(ahead + kk * 128 + 64, 0, 2);
    if (stream) {  // past a block's end this asks for the next block's first lines: harmless
      const int8_t* on = wk + STREAM_AHEAD * 64;
      __builtin_prefetch(on, 0, 2), __builtin_prefetch(on + bb, 0, 2), __builtin_prefetch(on + 2 * bb, 0, 2),
          __builtin_prefetch(on + 3 * bb, 0, 2);
    }
    const __m512i w0 = _mm512_loadu_si512(wk), w1 = _mm512_loadu_si512(wk + bb), w2 = _mm512_loadu_si512(wk + 2 * bb),
                  w3 = _mm512_loadu_si512(wk + 3 * bb);
    const uint8_t* xk = xq + kk * 4;
#define XSERV_ROW(i)                                                                            \
    if constexpr (MB > i) {                                                                     \
      const __m512i xb = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xk + i * k4));     \
      c##i##0 = S::fma(c##i##0, xb, w0);                                                        \
      c##i##1 = S::fma(c##i##1, xb, w1);                                                        \
      c##i##2 = S::fma(c##i##2, xb, w2);                                                        \
      c##i##3 = S::fma(c##i##3, xb, w3);                                                        \
    }
    XSERV_ROW(0) XSERV_ROW(1) XSERV_ROW(2) XSERV_ROW(3) XSERV_ROW(4) XSERV_ROW(5)
#undef XSERV_ROW
  }
  const typename S::Acc acc[6][4] = {{c00, c01, c02, c03}, {c10, c11, c12, c13}, {c20, c21, c22, c23},
                                     {c30, c31, c32, c33}, {c40, c41, c42, c43}, {c50, c51, c52, c53}};
  for (int j = 0; j < 4; ++j) {
    const int64_t c0 = n0 + j * BLOCK;  // < the padded width: comp has it
    const __mmask16 mask = channels_mask(c0, n);
    for (int i = 0; i < MB; ++i) sums.store(y + i * ldy + c0, acc[i][j], i, c0, mask);
  }
}

template <int MB, int NV, typename S, typename T>
inline void any_tile(const uint8_t* xq, int64_t k4, const S& sums, const int8_t* w, int64_t n, int64_t n0, T* y,
                     int64_t ldy, const int8_t* ahead, bool stream) {
  if constexpr (NV == GROUP) tile_group<MB>(xq, k4, sums, w, n, n0, y, ldy, ahead, stream);
  else tile<MB, NV>(xq, k4, sums, w, n, n0, y, ldy);
}

// The rows against NV blocks, TOKENS rows a tile. With `next` (a whole group, at a decode step's
// few rows): the first tile reads the blocks from memory, the others from L2 while memory would
// idle, so those ask for `next` (the group this thread likely takes next), 128 bytes per k step,
// as far as that group goes.
template <int NV, typename S, typename T>
void tokens_tiles(const uint8_t* xq, int64_t rows, int64_t k4, const S& sums, const int8_t* w, int64_t n,
                  int64_t n0, T* y, const int8_t* next = nullptr) {
  const int64_t per_tile = k4 / 4 * 128, group_bytes = GROUP * k4 * BLOCK;
  int64_t b = 0, asked = 0;
  auto ahead = [&]() -> const int8_t* {
    if (b == 0 || !next || asked >= group_bytes) return nullptr;
    asked += per_tile;
    return next + asked - per_tile;
  };
  for (; b + TOKENS <= rows; b += TOKENS)
    any_tile<TOKENS, NV>(xq + b * k4, k4, sums.from(b), w, n, n0, y + b * n, n, ahead(), b == 0);
  switch (rows - b) {
#define XSERV_REST(r) \
    case r: any_tile<r, NV>(xq + b * k4, k4, sums.from(b), w, n, n0, y + b * n, n, ahead(), b == 0); break;
    XSERV_REST(5) XSERV_REST(4) XSERV_REST(3) XSERV_REST(2) XSERV_REST(1)
#undef XSERV_REST
    default: break;
  }
}

// y [rows, n] = x times the packed weight, the sums S makes of them (Int8Sums, Bf16Sums)
template <typename S, typename T>
void packed_matmul(const uint8_t* xq, int64_t rows, int64_t k4, const S& sums, const int8_t* w, int64_t n, T* y) {
  const int64_t blocks = padded(n, BLOCK) / BLOCK, groups = (blocks + GROUP - 1) / GROUP;
  const int64_t block_bytes = k4 * BLOCK;
  // groups of 64 channels in runs that shrink as they are taken (guided): each thread streams
  // long stretches of consecutive groups, which the hardware prefetches well, and the last runs
  // are small, so a thread the OS pauses (the server shares these cores) costs the others little.
  // Taking single groups in turns (dynamic, 1) read 10-13 % slower: each thread's reads jumped
  // 64 KB every group (docs/benchmarks-log.md, 2026-12-06)
#pragma omp parallel for schedule(guided) num_threads(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), groups)))
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t first = g * GROUP, count = std::min(GROUP, blocks - first);
    const int8_t* wg = w + first * block_bytes;
    if (count == GROUP) {
      const int64_t after = g + 1;  // a thread's groups come in runs (guided)
      const bool ask = rows > TOKENS && rows <= 4 * TOKENS && (after + 1) * GROUP <= blocks;
      tokens_tiles<GROUP>(xq, rows, k4, sums, wg, n, first * BLOCK, y, ask ? w + after * GROUP * block_bytes : nullptr);
    } else {
      for (int64_t j = 0; j < count; ++j)
        tokens_tiles<1>(xq, rows, k4, sums, wg + j * block_bytes, n, (first + j) * BLOCK, y);
    }
  }
}
#endif

bool has_vnni() { return XSERV_VNNI; }

// x [B, K] (bfloat16 or float32) -> [B, N] in x's dtype, with the weight as int8_pack made it.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& comp,
                       const at::Tensor& w_scale, int64_t n) {
  TORCH_CHECK(XSERV_VNNI, "int8_linear: this build has no AVX512-VNNI kernel");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "int8_linear: x must be [B, K] in bfloat16 or float32");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.size(2) == BLOCK &&
                  packed.size(3) == 4 && packed.is_contiguous(), "int8_linear: a weight from int8_pack");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.numel() >= n && w_scale.is_contiguous(),
              "int8_linear: float32 scales, one per output channel");
  const int64_t rows = x.size(0), k = x.size(1), k4 = packed.size(1) * 4;
  TORCH_CHECK(padded(k, 4) == k4 && packed.size(0) * BLOCK >= n, "int8_linear: x has ", k,
              " columns, the weight ", k4, " (rounded to 4)");
  auto xc = x.contiguous();
  auto y = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
  auto xq = at::empty({rows, k4}, x.options().dtype(at::kByte));
  auto xs = at::empty({rows}, x.options().dtype(at::kFloat));
#if XSERV_VNNI
  if (x.scalar_type() == at::kBFloat16) {
    quantize_rows(xc.data_ptr<at::BFloat16>(), rows, k, k4, xq.data_ptr<uint8_t>(), xs.data_ptr<float>());
    packed_matmul(xq.data_ptr<uint8_t>(), rows, k4, Int8Sums{comp.data_ptr<int32_t>(), w_scale.data_ptr<float>(),
                  xs.data_ptr<float>()}, packed.data_ptr<int8_t>(), n, y.data_ptr<at::BFloat16>());
  } else {
    quantize_rows(xc.data_ptr<float>(), rows, k, k4, xq.data_ptr<uint8_t>(), xs.data_ptr<float>());
    packed_matmul(xq.data_ptr<uint8_t>(), rows, k4, Int8Sums{comp.data_ptr<int32_t>(), w_scale.data_ptr<float>(),
                  xs.data_ptr<float>()}, packed.data_ptr<int8_t>(), n, y.data_ptr<float>());
  }
#endif
  return y;
}


// bf16_linear: a bf16 weight in the same blocked layout, two k values per channel where int8 has
// four ([N / 16, K2 / 2, 16, 2] bf16, K2 = K rounded up to 2), multiplied by vdpbf16ps (AVX512-BF16):
// pairs of bf16 products summed in fp32, the output rounded to bf16. The matmul above does the
// rest: one row reads every weight byte once, from 4 blocks side by side per thread.
bool has_bf16_linear() {
#if XSERV_VNNI && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

at::Tensor bf16_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "bf16_pack: a bfloat16 [N, K] weight");
  const int64_t n = w.size(0), k = w.size(1), n16 = padded(n, BLOCK), k2 = padded(k, 2);
  auto plain = at::constant_pad_nd(w, {0, k2 - k, 0, n16 - n});  // zeros past N and K
  return plain.view({n16 / BLOCK, BLOCK, k2 / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// x [B, K] bfloat16 -> [B, N] bfloat16, with the weight as bf16_pack made it
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(has_bf16_linear(), "bf16_linear: this build has no AVX512-BF16 kernel");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "bf16_linear: x must be [B, K] in bfloat16");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(2) == BLOCK &&
                  packed.size(3) == 2 && packed.is_contiguous(), "bf16_linear: a weight from bf16_pack");
  const int64_t rows = x.size(0), k = x.size(1), k2 = packed.size(1) * 2;
  TORCH_CHECK(padded(k, 2) == k2 && packed.size(0) * BLOCK >= n, "bf16_linear: x has ", k, " columns, the weight ",
              k2, " (rounded to 2)");
  auto xc = k == k2 ? x.contiguous() : at::constant_pad_nd(x, {0, k2 - k});
  auto y = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
#if XSERV_VNNI && defined(__AVX512BF16__)
  packed_matmul(reinterpret_cast<const uint8_t*>(xc.data_ptr<at::BFloat16>()), rows, k2 * 2, Bf16Sums{},
                reinterpret_cast<const int8_t*>(packed.data_ptr<at::BFloat16>()), n, y.data_ptr<at::BFloat16>());
#endif
  return y;
}

// ---- int4_linear: 4-bit weights (layers/int4.py), W[n, k] = (q[n, k] - z[n, k / G]) * s[n, k / G] with
// q and z in 0..15, one float32 scale and one zero per output channel and group of G input
// channels. Held once, in the layout int4_pack makes: blocks of 16 output channels, and per 8 k
// values from k0 one 64-byte line whose byte [lane * 4 + j] holds q[lane, k0 + j] in its low nibble
// and q[lane, k0 + 4 + j] in its high one. A line is two k steps of the int8 layout once its nibbles
// are split (an and, a shift and an and), so the weights are unpacked in registers and never written.
// The blocks go in runs of 4 (64 channels, a run's last may hold fewer), the unit a thread takes,
// whose lines are interleaved: the run's line 0 of each block, then line 1 of each, ..., and its
// scales and zeros likewise, group by group. A unit is so read from memory as one sequential stream
// (weights) and two slow ones (scales, zeros), where four blocks side by side were twelve streams:
// a decode step's few rows read faster so, the most where blocks are short (small K; see
// docs/benchmarks-log.md, 2026-12-07 afternoon). The tensors keep the blocks' shapes and sizes
// (qweight [N16 / 16, K / 8, 16, 4] uint8, scales and zeros [N16 / 16, K / G, 16]), their bytes in
// run order.
//
// bfloat16 x: W4A8. Each row of x quantized per token to int8 (symmetric, as int8_linear's), the
// nibbles the unsigned operand of vpdpbusd and x the signed one; per group an int32 sum, then
//   y[b, n] = xs[b] * sum_g s[n, g] * (sum_{k in g} q[n, k] * xq[b, k] - z[n, g] * sum_{k in g} xq[b, k]).
// float32 x: the weights exactly as the formula gives them ((q - z) in integers, one multiply) and
// fp32 products and sums (a decode step's few rows unpack them in registers; more rows dequantize
// 1,024 channels at a time into a matmul): the exact weights' product, up to the summation order.

// [blocks, X, 16, ...] from block order to run order (interleave) or back, the blocks [b0, b1): whole
// runs, b0 a run's first block and b1 a run's end or the last block
at::Tensor int4_runs(const at::Tensor& t, bool interleave, int64_t b0 = 0, int64_t b1 = -1) {
  const int64_t blocks = t.size(0), whole = blocks / GROUP * GROUP;
  if (b1 < 0) b1 = blocks;
  TORCH_CHECK(b0 % GROUP == 0 && (b1 % GROUP == 0 || b1 == blocks), "int4_runs: whole runs");
  const auto inner = t.sizes().slice(1).vec();  // X, 16, ...
  auto reorder = [&](int64_t r0, int64_t r1) {  // blocks [r0, r1) in runs of min(4, r1 - r0)
    const int64_t per = std::min(GROUP, r1 - r0);
    std::vector<int64_t> shape{(r1 - r0) / per, per, inner[0]};  // a run in block order: [per, X, ...]
    if (!interleave) std::swap(shape[1], shape[2]);              // in run order: [X, per, ...]
    shape.insert(shape.end(), inner.begin() + 1, inner.end());
    auto part = t.slice(0, r0, r1);
    return part.contiguous().view(shape).transpose(1, 2).contiguous().view(part.sizes());
  };
  std::vector<at::Tensor> parts;
  if (b0 < std::min(b1, whole)) parts.push_back(reorder(b0, std::min(b1, whole)));
  if (b1 > whole) parts.push_back(reorder(whole, b1));  // the last run, of fewer blocks
  return parts.size() == 1 ? parts[0] : at::cat(parts);
}

// canonical (qweight [N, K / 2] uint8, low nibble k = 2j, high 2j + 1; scales float32 [N, K / G];
// zeros uint8 [N, K / G]) -> the run-ordered layout above (zeros past N)
std::tuple<at::Tensor, at::Tensor, at::Tensor> int4_pack(const at::Tensor& qweight, const at::Tensor& scales,
                                                         const at::Tensor& zeros, int64_t group_size) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte, "int4_pack: a uint8 [N, K / 2] qweight");
  const int64_t n = qweight.size(0), k = qweight.size(1) * 2, n16 = padded(n, BLOCK);
  TORCH_CHECK(group_size > 0 && group_size % 8 == 0 && k % group_size == 0, "int4_pack: the group size (",
              group_size, ") must divide K (", k, ") and be a multiple of 8");
  const int64_t groups = k / group_size;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.sizes() == at::IntArrayRef({n, groups}),
              "int4_pack: float32 scales [N, K / G]");
  TORCH_CHECK(zeros.scalar_type() == at::kByte && zeros.sizes() == at::IntArrayRef({n, groups}),
              "int4_pack: uint8 zeros [N, K / G]");
  auto q = at::stack({at::bitwise_and(qweight, 15), at::bitwise_right_shift(qweight, 4)}, -1).view({n, k});
  q = at::constant_pad_nd(q, {0, 0, 0, n16 - n}).view({n16 / BLOCK, BLOCK, k / 8, 2, 4});
  auto lines = at::bitwise_or(q.select(3, 0), at::bitwise_left_shift(q.select(3, 1), 4));  // [blocks, 16, K/8, 4]
  auto blocked = [&](const at::Tensor& t) {
    return at::constant_pad_nd(t, {0, 0, 0, n16 - n}).view({n16 / BLOCK, BLOCK, groups}).permute({0, 2, 1});
  };
  return {int4_runs(lines.permute({0, 2, 1, 3}), true), int4_runs(blocked(scales.contiguous()), true),
          int4_runs(blocked(zeros.contiguous()), true)};
}

// The packed weight's channels [c0, c0 + count) (c0 a multiple of 64), dequantized: float32 [count, K]
at::Tensor int4_dequantize(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& zeros,
                           int64_t c0, int64_t count) {
  const int64_t b0 = c0 / BLOCK, b1 = (c0 + count + BLOCK - 1) / BLOCK, k = qweight.size(1) * 8;
  const int64_t groups = scales.size(1), group_size = k / groups;
  auto lines = int4_runs(qweight, false, b0, b1).to(at::kInt);  // [blocks, K/8, 16, 4]
  auto q = at::stack({at::bitwise_and(lines, 15), at::bitwise_right_shift(lines, 4)}, 3);  // [blocks, K/8, 16, 2, 4]
  q = q.permute({0, 2, 1, 3, 4}).reshape({(b1 - b0) * BLOCK, groups, group_size});
  auto z = int4_runs(zeros, false, b0, b1).permute({0, 2, 1}).reshape({(b1 - b0) * BLOCK, groups, 1}).to(at::kInt);
  auto s = int4_runs(scales, false, b0, b1).permute({0, 2, 1}).reshape({(b1 - b0) * BLOCK, groups, 1});
  return (q - z).to(at::kFloat).mul(s).view({(b1 - b0) * BLOCK, k}).slice(0, 0, count);
}

#if XSERV_VNNI
// W4A8: MB rows of x against a run of NV blocks (16 channels each) over the whole K. The int32
// sums of a group live in registers (MB x NV of them, the unpacked lines 2 x NV); the float sums
// across groups are touched once a group. The run is one stream, which the hardware prefetches
// well: a software prefetch ahead of it read slower.
template <int MB, int NV, typename T>
inline void int4_tile(const int8_t* xq, const float* xsum, const float* xs, int64_t k, int64_t groups,
                      const uint8_t* w, const float* sc, const uint8_t* zp, int64_t n, int64_t n0, T* y,
                      int64_t ldy) {
  const int64_t lines_per_group = k / groups / 8;
  const __m512i low = _mm512_set1_epi8(0x0f);
  __m512 out[MB][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) out[i][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[MB][NV];
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_si512();
    for (int64_t line = g * lines_per_group; line < (g + 1) * lines_per_group; ++line) {
      const uint8_t* wl = w + line * NV * 64;
      __m512i lo[NV], hi[NV];
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) {
        const __m512i v = _mm512_loadu_si512(wl + j * 64);
        lo[j] = _mm512_and_si512(v, low);
        hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i) {
        const int32_t* xi = reinterpret_cast<const int32_t*>(xq + i * k + line * 8);
        const __m512i xa = _mm512_set1_epi32(xi[0]), xb = _mm512_set1_epi32(xi[1]);
#pragma GCC unroll 8
        for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[i][j], lo[j], xa), hi[j], xb);
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) {
      const __m512 s = _mm512_loadu_ps(sc + (g * NV + j) * BLOCK);
      const __m512 z = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(zp + (g * NV + j) * BLOCK))));
      const __m512 sz = _mm512_mul_ps(s, z);
#pragma GCC unroll 8
      for (int i = 0; i < MB; ++i)
        out[i][j] = _mm512_fnmadd_ps(sz, _mm512_set1_ps(xsum[i * groups + g]),
                                     _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][j]), s, out[i][j]));
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NV; ++j) {
    const int64_t c0 = n0 + j * BLOCK;
    const __mmask16 mask = channels_mask(c0, n);
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) store16(y + i * ldy + c0, _mm512_mul_ps(out[i][j], _mm512_set1_ps(xs[i])), mask);
  }
}

// float32: MB rows against block j of a run of nv, the weights exact
template <int MB>
inline void int4_tile_fp32(const float* x, int64_t k, int64_t groups, const uint8_t* w, const float* sc,
                           const uint8_t* zp, int64_t nv, int64_t j, int64_t n, int64_t n0, float* y, int64_t ldy) {
  const int64_t lines_per_group = k / groups / 8;
  const __m512i low = _mm512_set1_epi32(0x0f);
  __m512 acc[MB];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 s = _mm512_loadu_ps(sc + (g * nv + j) * BLOCK);
    const __m512 z = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(zp + (g * nv + j) * BLOCK))));
    for (int64_t line = g * lines_per_group; line < (g + 1) * lines_per_group; ++line) {
      const __m512i v = _mm512_loadu_si512(w + (line * nv + j) * 64);
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {  // k = line * 8 + t: nibble (t / 4) of byte (t % 4) of each lane
        const __m512i q = _mm512_and_si512(_mm512_srli_epi32(v, 8 * (t % 4) + 4 * (t / 4)), low);
        const __m512 wt = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(q), z), s);
#pragma GCC unroll 8
        for (int i = 0; i < MB; ++i) acc[i] = _mm512_fmadd_ps(wt, _mm512_set1_ps(x[i * k + line * 8 + t]), acc[i]);
      }
    }
  }
  const int64_t c0 = n0 + j * BLOCK;
  const __mmask16 mask = channels_mask(c0, n);
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) store16(y + i * ldy + c0, acc[i], mask);
}

constexpr int INT4_ROWS = 4;  // rows per W4A8 tile: 16 int32 sums, 8 unpacked lines, 2 broadcasts

template <int NV, typename T>
void int4_rows(const int8_t* xq, const float* xsum, const float* xs, int64_t rows, int64_t k, int64_t groups,
               const uint8_t* w, const float* sc, const uint8_t* zp, int64_t n, int64_t n0, T* y) {
  int64_t b = 0;
  for (; b + INT4_ROWS <= rows; b += INT4_ROWS)
    int4_tile<INT4_ROWS, NV>(xq + b * k, xsum + b * groups, xs + b, k, groups, w, sc, zp, n, n0, y + b * n, n);
  switch (rows - b) {
    case 3: int4_tile<3, NV>(xq + b * k, xsum + b * groups, xs + b, k, groups, w, sc, zp, n, n0, y + b * n, n); break;
    case 2: int4_tile<2, NV>(xq + b * k, xsum + b * groups, xs + b, k, groups, w, sc, zp, n, n0, y + b * n, n); break;
    case 1: int4_tile<1, NV>(xq + b * k, xsum + b * groups, xs + b, k, groups, w, sc, zp, n, n0, y + b * n, n); break;
    default: break;
  }
}

void int4_rows_fp32(const float* x, int64_t rows, int64_t k, int64_t groups, const uint8_t* w, const float* sc,
                    const uint8_t* zp, int64_t nv, int64_t j, int64_t n, int64_t n0, float* y) {
  int64_t b = 0;
  for (; b + 4 <= rows; b += 4) int4_tile_fp32<4>(x + b * k, k, groups, w, sc, zp, nv, j, n, n0, y + b * n, n);
  switch (rows - b) {
    case 3: int4_tile_fp32<3>(x + b * k, k, groups, w, sc, zp, nv, j, n, n0, y + b * n, n); break;
    case 2: int4_tile_fp32<2>(x + b * k, k, groups, w, sc, zp, nv, j, n, n0, y + b * n, n); break;
    case 1: int4_tile_fp32<1>(x + b * k, k, groups, w, sc, zp, nv, j, n, n0, y + b * n, n); break;
    default: break;
  }
}

// y [rows, n] from the packed weight: its runs (4 blocks, 64 channels) over the threads, in runs
// of runs that shrink as they are taken, as packed_matmul: each thread reads long stretches of memory
template <typename F>
void int4_blocks(int64_t n, int64_t k, int64_t groups, const uint8_t* w, const float* sc, const uint8_t* zp,
                 const F& run) {
  const int64_t blocks = padded(n, BLOCK) / BLOCK, units = (blocks + GROUP - 1) / GROUP;
#pragma omp parallel for schedule(guided) num_threads(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units)))
  for (int64_t u = 0; u < units; ++u) {
    const int64_t first = u * GROUP, count = std::min(GROUP, blocks - first);
    run(first, count, w + first * k * 8, sc + first * groups * BLOCK, zp + first * groups * BLOCK);
  }
}
// Rows of x -> int8 (per token, symmetric, as int8_linear's but without the offset), their scales,
// and their sums per group of the weight (the zeros' term)
template <typename T>
void int4_quantize(const T* x, int64_t rows, int64_t k, int64_t groups, int8_t* xq, float* xs, float* xsum) {
  quantize_rows<T, 0>(x, rows, k, k, reinterpret_cast<uint8_t*>(xq), xs);
  const int64_t group_size = k / groups;
  at::parallel_for(0, rows * groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t rg = begin; rg < end; ++rg) {
      const int8_t* q = xq + rg * group_size;  // row rg / groups, group rg % groups: contiguous
      __m512i s = _mm512_setzero_si512();
      int64_t i = 0;
      for (; i + 16 <= group_size; i += 16)
        s = _mm512_add_epi32(s, _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i))));
      int32_t total = _mm512_reduce_add_epi32(s);
      for (; i < group_size; ++i) total += q[i];
      xsum[rg] = static_cast<float>(total);
    }
  });
}

// y [rows, n] = the quantized rows times the packed weight (W4A8)
template <typename T>
void int4_matmul_w4a8(const int8_t* xq, const float* xsum, const float* xs, int64_t rows, int64_t k, int64_t groups,
                      const uint8_t* w, const float* sc, const uint8_t* zp, int64_t n, T* y) {
  int4_blocks(n, k, groups, w, sc, zp, [&](int64_t first, int64_t count, const uint8_t* wb, const float* sb,
                                           const uint8_t* zb) {
    switch (count) {
      case 4: int4_rows<4>(xq, xsum, xs, rows, k, groups, wb, sb, zb, n, first * BLOCK, y); break;
      case 3: int4_rows<3>(xq, xsum, xs, rows, k, groups, wb, sb, zb, n, first * BLOCK, y); break;
      case 2: int4_rows<2>(xq, xsum, xs, rows, k, groups, wb, sb, zb, n, first * BLOCK, y); break;
      default: int4_rows<1>(xq, xsum, xs, rows, k, groups, wb, sb, zb, n, first * BLOCK, y); break;
    }
  });
}

// y [rows, n] = float32 rows times the packed weight's exact values
void int4_matmul_fp32(const float* x, int64_t rows, int64_t k, int64_t groups, const uint8_t* w, const float* sc,
                      const uint8_t* zp, int64_t n, float* y) {
  int4_blocks(n, k, groups, w, sc, zp, [&](int64_t first, int64_t count, const uint8_t* wb, const float* sb,
                                           const uint8_t* zb) {
    for (int64_t j = 0; j < count; ++j) int4_rows_fp32(x, rows, k, groups, wb, sb, zb, count, j, n, first * BLOCK, y);
  });
}
#endif

// x [B, K] (bfloat16: W4A8; float32: exact weights) -> [B, N] in x's dtype, the weight as int4_pack made it
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& zeros, int64_t n) {
  TORCH_CHECK(XSERV_VNNI, "int4_linear: this build has no AVX512-VNNI kernel");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "int4_linear: x must be [B, K] in bfloat16 or float32");
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 4 && qweight.size(2) == BLOCK &&
                  qweight.size(3) == 4 && qweight.is_contiguous(), "int4_linear: a weight from int4_pack");
  const int64_t rows = x.size(0), k = x.size(1), groups = scales.size(1);
  TORCH_CHECK(qweight.size(1) * 8 == k && qweight.size(0) * BLOCK >= n && n > qweight.size(0) * BLOCK - BLOCK,
              "int4_linear: x has ", k, " columns, the weight ", qweight.size(1) * 8);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 3 && scales.size(0) == qweight.size(0) &&
                  scales.is_contiguous() && zeros.scalar_type() == at::kByte && zeros.sizes() == scales.sizes() &&
                  zeros.is_contiguous() && groups > 0 && k % groups == 0, "int4_linear: scales and zeros from int4_pack");
  auto xc = x.contiguous();
  auto y = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
#if XSERV_VNNI
  const uint8_t *w = qweight.data_ptr<uint8_t>(), *zp = zeros.data_ptr<uint8_t>();
  const float* sc = scales.data_ptr<float>();
  if (x.scalar_type() == at::kFloat) {
    if (rows > 16) {  // a prompt's rows: 1,024 channels at a time dequantized, then a matmul
      for (int64_t c0 = 0; c0 < n; c0 += 1024) {
        const int64_t count = std::min<int64_t>(1024, n - c0);
        y.slice(1, c0, c0 + count).copy_(at::mm(xc, int4_dequantize(qweight, scales, zeros, c0, count).t()));
      }
      return y;
    }
    int4_matmul_fp32(xc.data_ptr<float>(), rows, k, groups, w, sc, zp, n, y.data_ptr<float>());
    return y;
  }
  auto xq = at::empty({rows, k}, x.options().dtype(at::kChar));
  auto xs = at::empty({rows}, x.options().dtype(at::kFloat));
  auto xsum = at::empty({rows, groups}, x.options().dtype(at::kFloat));
  int4_quantize(xc.data_ptr<at::BFloat16>(), rows, k, groups, xq.data_ptr<int8_t>(), xs.data_ptr<float>(),
                xsum.data_ptr<float>());
  int4_matmul_w4a8(xq.data_ptr<int8_t>(), xsum.data_ptr<float>(), xs.data_ptr<float>(), rows, k, groups, w, sc, zp, n,
                   y.data_ptr<at::BFloat16>());
#endif
  return y;
}

// ---- the small operations of a forward (layers/ops.py), in the torch path's numerics: fp32
// arithmetic, rounded to the model's dtype wherever the torch path stores a tensor in it. Each is
// written over 16 floats at a time (gcc/clang vector extensions: one AVX-512 register, two AVX2
// ones, NEON elsewhere): at one token a call is a few thousand elements, and scalar bf16
// conversions made these calls cost as much as the matmuls beside them ----

template <typename T> inline float ld(const T* p, int64_t i) { return static_cast<float>(p[i]); }
template <typename T> inline float rnd(float f) { return static_cast<float>(static_cast<T>(f)); }

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
using bf16 = at::BFloat16;

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline f32x16 load16(const bf16* p) {  // bf16 -> float is a 16-bit shift
#if defined(__AVX512F__)
  return (f32x16)widen_bf16(p);
#endif
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  u32x16 u = __builtin_convertvector(h, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }
inline u32x16 bf16_bits(f32x16 v) {  // round to nearest even (as torch), in the top 16 bits
  u32x16 u;
  std::memcpy(&u, &v, sizeof u);
  return (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
}
inline void store16(bf16* p, f32x16 v) {
  u16x16 h = __builtin_convertvector(bf16_bits(v) >> 16, u16x16);
  std::memcpy(p, &h, sizeof h);
}
template <typename T> inline f32x16 rnd16(f32x16 v) { return v; }
template <> inline f32x16 rnd16<bf16>(f32x16 v) {
  u32x16 u = bf16_bits(v);
  std::memcpy(&v, &u, sizeof v);
  return v;
}
inline f32x16 splat(float f) { return f32x16{} + f; }
inline float hsum(f32x16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// e^x to ~2 ulp (Cephes' expf: 2^n times a degree-6 polynomial on [-ln2/2, ln2/2])
inline f32x16 exp16(f32x16 x) {
  x = x < splat(88.3762626647949f) ? x : splat(88.3762626647949f);
  x = x > splat(-88.3762626647949f) ? x : splat(-88.3762626647949f);
  f32x16 fx = x * 1.44269504088896341f + 0.5f;
  i32x16 n = __builtin_convertvector(fx, i32x16);
  n += (__builtin_convertvector(n, f32x16) > fx);  // truncation -> floor (true is -1)
  fx = __builtin_convertvector(n, f32x16);
  x = x - fx * 0.693359375f - fx * -2.12194440e-4f;
  f32x16 y = splat(1.9875691500e-4f);
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * (x * x) + x + 1.f;
  i32x16 bits = (n + 127) << 23;
  f32x16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// sum of squares of x [n]
template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  f32x16 a = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    f32x16 v = load16(x + i);
    a += v * v;
  }
  float ss = hsum(a);
  for (; i < n; ++i) ss += ld(x, i) * ld(x, i);
  return ss;
}

// out = w * rnd(x / rms(x)) over a row of n, as layers/layernorm.rms_norm
template <typename T>
inline void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  const float inv = 1.f / std::sqrt(sum_squares(x, n) / n + eps);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store16(out + i, load16(w + i) * rnd16<T>(load16(x + i) * inv));
  for (; i < n; ++i) out[i] = static_cast<T>(ld(w, i) * rnd<T>(ld(x, i) * inv));
}

#define XSERV_DISPATCH(dtype, ...)                                  \
  [&] {                                                             \
    if ((dtype) == at::kBFloat16) { using T = at::BFloat16; return __VA_ARGS__(); } \
    TORCH_CHECK((dtype) == at::kFloat, "xserv_cpu: bfloat16 or float32 tensors"); \
    using T = float; return __VA_ARGS__();                          \
  }()

// Rows split over threads only where there is work enough to pay for waking them (a decode
// step's row of a few thousand elements is not).
inline int64_t grain(int64_t elements_per_row) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(elements_per_row, 1)); }

// (h, rms_norm(h)) with h = residual + delta: a decoder layer's residual add and the next norm
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& residual, const at::Tensor& delta,
                                                const at::Tensor& w, double eps) {
  TORCH_CHECK(residual.sizes() == delta.sizes() && residual.scalar_type() == delta.scalar_type(),
              "add_rms_norm: residual and delta of one shape and dtype");
  const int64_t n = residual.size(-1), rows = residual.numel() / std::max<int64_t>(n, 1);
  auto rc = residual.contiguous(), dc = delta.contiguous(), wc = w.to(residual.scalar_type()).contiguous();
  auto h = at::empty_like(rc), out = at::empty_like(rc);
  XSERV_DISPATCH(residual.scalar_type(), [&] {
    const T *pr = rc.data_ptr<T>(), *pd = dc.data_ptr<T>(), *pw = wc.data_ptr<T>();
    T *ph = h.data_ptr<T>(), *po = out.data_ptr<T>();
    at::parallel_for(0, rows, grain(n), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const T *x = pr + r * n, *d = pd + r * n;
        T* y = ph + r * n;
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) store16(y + i, load16(x + i) + load16(d + i));
        for (; i < n; ++i) y[i] = static_cast<T>(ld(x, i) + ld(d, i));
        norm_row(y, pw, po + r * n, n, (float)eps);
      }
    });
  });
  return {h, out};
}

// [T, 2I] -> [T, I]: silu(gate) * up, as layers/activation.SiluAndMul
at::Tensor silu_and_mul(const at::Tensor& x) {
  const int64_t two = x.size(-1), half = two / 2, rows = x.numel() / std::max<int64_t>(two, 1);
  auto xc = x.contiguous();
  auto sizes = xc.sizes().vec();
  sizes.back() = half;
  auto out = at::empty(sizes, xc.options());
  XSERV_DISPATCH(x.scalar_type(), [&] {
    const T* px = xc.data_ptr<T>();
    T* po = out.data_ptr<T>();
    at::parallel_for(0, rows, grain(two), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const T *gate = px + r * two, *up = gate + half;
        T* o = po + r * half;
        int64_t i = 0;
        for (; i + 16 <= half; i += 16) {
          const f32x16 g = load16(gate + i);
          store16(o + i, rnd16<T>(g / (1.f + exp16(-g))) * load16(up + i));
        }
        for (; i < half; ++i) {
          const float g = ld(gate, i);
          o[i] = static_cast<T>(rnd<T>(g / (1.f + std::exp(-g))) * ld(up, i));
        }
      }
    });
  });
  return out;
}

// The q and k heads of qkv [T, (Hq + 2 Hkv) D]: each head's RMSNorm (weight [Hq + Hkv, D]), then
// neox rotary at its position (cos, signed_sin: float32 tables [P, D], cast to the dtype as
// RotaryEmbedding.cos_sin does) -> [T, Hq + Hkv, D], as Qwen3Attention's torch path computes it
at::Tensor qk_norm_rope(const at::Tensor& qkv, const at::Tensor& weight, const at::Tensor& cos,
                        const at::Tensor& signed_sin, const at::Tensor& positions, double eps, int64_t heads) {
  const int64_t t = qkv.size(0), d = weight.size(1), width = qkv.size(1), half = d / 2;
  TORCH_CHECK(weight.size(0) == heads && heads * d <= width && d % 2 == 0 && d <= 1024,
              "qk_norm_rope: weight [Hq + Hkv, D] inside qkv's rows");
  auto qc = qkv.contiguous(), wc = weight.to(qkv.scalar_type()).contiguous();
  auto pos = positions.to(at::kLong).contiguous();
  auto cc = cos.contiguous(), sc = signed_sin.contiguous();
  auto out = at::empty({t, heads, d}, qc.options());
  XSERV_DISPATCH(qkv.scalar_type(), [&] {
    const T *px = qc.data_ptr<T>(), *pw = wc.data_ptr<T>();
    const float *pc = cc.data_ptr<float>(), *ps = sc.data_ptr<float>();
    const int64_t* pp = pos.data_ptr<int64_t>();
    T* po = out.data_ptr<T>();
    at::parallel_for(0, t * heads, grain(d), [&](int64_t b, int64_t e) {
      T normed[1024];
      for (int64_t i = b; i < e; ++i) {
        const int64_t row = i / heads, h = i % heads;
        norm_row(px + row * width + h * d, pw + h * d, normed, d, (float)eps);
        const float *c = pc + pp[row] * d, *s = ps + pp[row] * d;
        T* o = po + i * d;
        // o[j] = rnd(n[j] * rnd(c[j])) + rnd(r[j] * rnd(s[j])), r the other half of n (rotate_half)
        auto rotate = [&](int64_t j0, int64_t j1, int64_t other) {
          int64_t j = j0;
          for (; j + 16 <= j1; j += 16)
            store16(o + j, rnd16<T>(load16(normed + j) * rnd16<T>(load16(c + j))) +
                               rnd16<T>(load16(normed + j + other) * rnd16<T>(load16(s + j))));
          for (; j < j1; ++j)
            o[j] = static_cast<T>(rnd<T>(ld(normed, j) * rnd<T>(c[j])) + rnd<T>(ld(normed, j + other) * rnd<T>(s[j])));
        };
        rotate(0, half, half);
        rotate(half, d, -half);
      }
    });
  });
  return out;
}

// k, v [T, Hkv, D] (views: the rows of qkv) into the torch backend's cache at slot_mapping [T]:
// keys [Hkv, blocks, D, bs] (transposed inside a block), values [Hkv, slots, D]
void write_kv(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping, int64_t block_size) {
  const int64_t t = k.size(0), hkv = k.size(1), d = k.size(2), slots = k_cache.size(1);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k.scalar_type() == k_cache.scalar_type() &&
                  v.scalar_type() == v_cache.scalar_type() && k.stride(2) == 1 && v.stride(2) == 1 &&
                  k_cache.size(0) == hkv && k_cache.size(2) == d && v.sizes() == k.sizes(),
              "write_kv: k and v [T, Hkv, D] with unit last stride, contiguous caches [Hkv, slots, D] of their dtype");
  auto slot_c = slot_mapping.to(at::kLong).contiguous();
  XSERV_DISPATCH(k.scalar_type(), [&] {
    const T *pk = k.data_ptr<T>(), *pv = v.data_ptr<T>();
    T *kc = k_cache.data_ptr<T>(), *vc = v_cache.data_ptr<T>();
    const int64_t* ps = slot_c.data_ptr<int64_t>();
    at::parallel_for(0, t * hkv, grain(2 * d), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const int64_t row = i / hkv, h = i % hkv, slot = ps[row];
        TORCH_CHECK(slot >= 0 && slot < slots, "write_kv: slot ", slot, " outside the cache");
        const T* ks = pk + row * k.stride(0) + h * k.stride(1);
        const T* vs = pv + row * v.stride(0) + h * v.stride(1);
        T* kd = kc + h * slots * d + (slot / block_size) * d * block_size + slot % block_size;
        for (int64_t j = 0; j < d; ++j) kd[j * block_size] = ks[j];
        std::memcpy(vc + (h * slots + slot) * d, vs, d * sizeof(T));
      }
    });
  });
}

inline float hmax(f32x16 v) {
  float m = -INFINITY;
  for (int i = 0; i < 16; ++i) m = std::max(m, v[i]);
  return m;
}

// f[x] <- e^(f[x] - mx) over [0, len); their sum
inline float exp_sum(float* f, int64_t len, float mx) {
  f32x16 sum16 = {};
  int64_t x = 0;
  for (; x + 16 <= len; x += 16) {
    const f32x16 e = exp16(load16(f + x) - mx);
    store16(f + x, e);
    sum16 += e;
  }
  float sum = hsum(sum16);
  for (; x < len; ++x) sum += f[x] = std::exp(f[x] - mx);
  return sum;
}

// Ask for `bytes` at p, a cache line at a time, ahead of their use: a paged cache block is 16 KB
// (64 positions x 128 dims x 2 bytes) of 4 KB pages that the hardware prefetchers take one at a
// time, each from a cold start; requested together they arrive in parallel.
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}

// The next block's cache lines, requested a few at a time between the sums of this one (a loop
// step of the kernels below asks for `per_step`), so that it streams in while this one is summed.
// Asked for all at once (prefetch above), the requests fill the core's miss buffers and it stalls
// until they drain: memory and arithmetic took turns (decode attention from memory took their sum).
struct Ahead {
  const char* p = nullptr;
  const char* end = nullptr;
  int64_t per_step = 0;
  void set(const void* start, int64_t bytes, int64_t steps) {
    steps = std::max<int64_t>(steps, 1);
    p = static_cast<const char*>(start), end = p + bytes, per_step = (bytes / 64 + steps - 1) / steps;
  }
  inline void step() {
    for (int64_t i = 0; i < per_step && p < end; ++i, p += 64) __builtin_prefetch(p, 0, 2);
  }
  void rest() {  // what the steps did not ask for
    for (; p < end; p += 64) __builtin_prefetch(p, 0, 2);
  }
};

// 16 positions' scores for G query heads: keys k[j * block_size + x] (16 positions side by side
// per dim), queries qs[g * d + j]. G a constant so that the accumulators live in registers (a
// runtime count keeps them in memory: a store and a load around every FMA), two per head so that
// each FMA chain waits on every other step's instead of the one before.
template <int G, typename T>
inline void scores16(const float* qs, int64_t d, const T* k, int64_t block_size, float* s, int64_t width,
                     Ahead& ahead) {
  f32x16 a[G], b[G];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) a[g] = b[g] = f32x16{};
  int64_t j = 0;
  for (; j + 2 <= d; j += 2) {
    ahead.step();
    const f32x16 k0 = load16(k + j * block_size), k1 = load16(k + (j + 1) * block_size);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) a[g] += qs[g * d + j] * k0, b[g] += qs[g * d + j + 1] * k1;
  }
  for (; j < d; ++j) {
    const f32x16 k0 = load16(k + j * block_size);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) a[g] += qs[g * d + j] * k0;
  }
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) store16(s + g * width, a[g] + b[g]);
}

// acc[g * d + j] += sum over the block's n positions of p[g * width + x] * v[x * d + j], for G
// heads at once over V vectors of dims at a time: G * V accumulators in registers, each value
// vector loaded once for all G heads. The same sums in the same order as the loop it replaces.
template <int G, int V, typename T>
inline void pv_heads(const float* p, int64_t width, const T* v, int64_t n, int64_t d, float* acc, Ahead& ahead) {
  static_assert(G * V <= 16, "16 accumulators");
  for (int64_t j = 0; j < d; j += 16 * V) {
    f32x16 a[G][V];
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
      for (int c = 0; c < V; ++c) a[g][c] = load16(acc + g * d + j + 16 * c);
    for (int64_t x = 0; x < n; ++x) {
      ahead.step();
      f32x16 vv[V];
#pragma GCC unroll 8
      for (int c = 0; c < V; ++c) vv[c] = load16(v + x * d + j + 16 * c);
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        const float px = p[g * width + x];
#pragma GCC unroll 8
        for (int c = 0; c < V; ++c) a[g][c] += px * vv[c];
      }
    }
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
      for (int c = 0; c < V; ++c) store16(acc + g * d + j + 16 * c, a[g][c]);
  }
}

// pv_heads for the group sizes models have; false where d or the group does not fit
template <typename T>
inline bool pv_block(int64_t group, const float* p, int64_t width, const T* v, int64_t n, int64_t d, float* acc,
                     Ahead& ahead) {
  if (d % 64) return false;
  switch (group) {
    case 1: pv_heads<1, 4>(p, width, v, n, d, acc, ahead); return true;
    case 2: pv_heads<2, 4>(p, width, v, n, d, acc, ahead); return true;
    case 4: pv_heads<4, 4>(p, width, v, n, d, acc, ahead); return true;
    case 8: pv_heads<8, 2>(p, width, v, n, d, acc, ahead); return true;
    default: return false;
  }
}

// One query per sequence over its paged context, in the torch backend's cache layout: q [B, Hq,
// D] (GQA: Hq / Hkv query heads per KV head) -> [B, Hq, D]. A KV head's query heads are taken
// together, so each key and value is read from memory once per step. Scores and probabilities
// rounded to the dtype as the torch path's embedding_bag sums are; softmax in float32.
template <typename T>
void decode_attention_impl(const T* pq, const T* pk, const T* pv, const int32_t* pt, const int32_t* pl, T* po,
                           int64_t batch, int64_t hq, int64_t hkv, int64_t d, int64_t slots, int64_t nb,
                           int64_t block_size, float scale) {
  const int64_t group = hq / hkv, width = nb * block_size;
  const int64_t items = batch * hkv;  // (sequence, KV head) pairs, taken by whichever thread is free
#pragma omp parallel num_threads(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items)))
  {
    // scores: only the context's are written and read, so not zeroed (width is the table's, up to
    // max_model_len: zeroing it was a 64 KB memset a thread a layer)
    std::unique_ptr<float[]> scores(new float[group * width]);
    float* const sc = scores.get();
    std::vector<float> qs(group * d), acc(group * d), tail(group * 16);
    const int64_t team = omp_get_num_threads();
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < items; ++i) {
      const int64_t b = i / hkv, h = i % hkv, ctx = pl[b];
      const T* kbase = pk + h * slots * d;
      const T* vbase = pv + h * slots * d;
      const int32_t* table = pt + b * nb;
      const T* qrow = pq + (b * hq + h * group) * d;  // the group's query heads, one after another
      for (int64_t j = 0; j < group * d; ++j) qs[j] = rnd<T>(ld(qrow, j) * (float)scale);
      const int64_t nblk = (ctx + block_size - 1) / block_size, block_bytes = d * block_size * sizeof(T);
      prefetch(kbase + (int64_t)table[0] * d * block_size, block_bytes);
      Ahead ahead;
      for (int64_t blk = 0; blk * block_size < ctx; ++blk) {
        const int64_t n = std::min(block_size, ctx - blk * block_size);
        const T* k = kbase + (int64_t)table[blk] * d * block_size;
        float* s = sc + blk * block_size;
        // the next block of keys, or the first of values, requested while this one is summed
        ahead.set(blk + 1 < nblk ? kbase + (int64_t)table[blk + 1] * d * block_size : vbase + (int64_t)table[0] * d * block_size,
                  block_bytes, (n + 15) / 16 * d / 2);
        int64_t x0 = 0;
        // 16 positions x the group's heads at once; a block's last few positions too, read as 16
        // (the slots past the context are in the block, their lanes computed and dropped)
        for (; x0 < n && x0 + 16 <= block_size; x0 += 16) {
          const bool whole = x0 + 16 <= n;
          float* dst = whole ? s + x0 : tail.data();
          const int64_t ldw = whole ? width : 16;
          switch (group) {
            case 1: scores16<1>(qs.data(), d, k + x0, block_size, dst, ldw, ahead); break;
            case 2: scores16<2>(qs.data(), d, k + x0, block_size, dst, ldw, ahead); break;
            case 4: scores16<4>(qs.data(), d, k + x0, block_size, dst, ldw, ahead); break;
            case 8: scores16<8>(qs.data(), d, k + x0, block_size, dst, ldw, ahead); break;
            default:
              for (int64_t g0 = 0; g0 < group; g0 += 8) {  // other group sizes: 8 heads at a time, then 1
                if (group - g0 >= 8) scores16<8>(qs.data() + g0 * d, d, k + x0, block_size, dst + g0 * ldw, ldw, ahead);
                else for (int64_t g = g0; g < group; ++g)
                  scores16<1>(qs.data() + g * d, d, k + x0, block_size, dst + g * ldw, ldw, ahead);
              }
          }
          if (!whole)
            for (int64_t g = 0; g < group; ++g) std::memcpy(s + g * width + x0, dst + g * 16, (n - x0) * sizeof(float));
        }
        for (int64_t g = 0; g < group; ++g) {
          for (int64_t x = x0; x < n; ++x) {
            float sum = 0.f;
            for (int64_t j = 0; j < d; ++j) sum += qs[g * d + j] * ld(k, j * block_size + x);
            s[g * width + x] = sum;
          }
        }
        ahead.rest();
      }
      for (int64_t g = 0; g < group; ++g) {  // softmax of each query head's rounded scores
        float* s = sc + g * width;
        int64_t x = 0;
        f32x16 mx16 = splat(-INFINITY);
        for (; x + 16 <= ctx; x += 16) {
          const f32x16 v = rnd16<T>(load16(s + x));
          store16(s + x, v);
          mx16 = mx16 > v ? mx16 : v;
        }
        float mx = hmax(mx16);
        for (int64_t r = x; r < ctx; ++r) mx = std::max(mx, s[r] = rnd<T>(s[r]));
        const float sum = exp_sum(s, ctx, mx);
        for (x = 0; x + 16 <= ctx; x += 16) store16(s + x, rnd16<T>(load16(s + x) / sum));
        for (; x < ctx; ++x) s[x] = rnd<T>(s[x] / sum);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t blk = 0; blk * block_size < ctx; ++blk) {  // out = probabilities . values
        const int64_t n = std::min(block_size, ctx - blk * block_size);
        const T* v = vbase + (int64_t)table[blk] * block_size * d;
        if (blk + 1 < nblk) ahead.set(vbase + (int64_t)table[blk + 1] * block_size * d, block_bytes, n * d / 64);
        else if (i + team < items) {  // the item this thread likely takes next (dynamic, 1): its first keys
          const int64_t nh = (i + team) % hkv, nbat = (i + team) / hkv;
          ahead.set(pk + nh * slots * d + (int64_t)pt[nbat * nb] * d * block_size, block_bytes, n * d / 64);
        } else ahead.set(nullptr, 0, 1);
        const float* pb = sc + blk * block_size;
        const bool done = pv_block(group, pb, width, v, n, d, acc.data(), ahead);
        ahead.rest();
        if (done) continue;
        for (int64_t g = 0; g < group; ++g) {  // the block's values, re-read from L1 for each head
          const float* pr = sc + g * width + blk * block_size;
          float* a = acc.data() + g * d;
          int64_t j = 0;
          for (; j + 64 <= d; j += 64) {
            f32x16 a0 = load16(a + j), a1 = load16(a + j + 16), a2 = load16(a + j + 32), a3 = load16(a + j + 48);
            for (int64_t x = 0; x < n; ++x) {
              const T* vr = v + x * d + j;
              const float px = pr[x];
              a0 += px * load16(vr), a1 += px * load16(vr + 16), a2 += px * load16(vr + 32), a3 += px * load16(vr + 48);
            }
            store16(a + j, a0), store16(a + j + 16, a1), store16(a + j + 32, a2), store16(a + j + 48, a3);
          }
          for (; j < d; ++j)
            for (int64_t x = 0; x < n; ++x) a[j] += pr[x] * ld(v, x * d + j);
        }
      }
      T* orow = po + (b * hq + h * group) * d;
      for (int64_t j = 0; j < group * d; ++j) orow[j] = static_cast<T>(acc[j]);
    }
  }
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                            double scale) {
  const int64_t batch = q.size(0), hq = q.size(1), d = q.size(2), hkv = k_cache.size(0), slots = k_cache.size(1);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == q.scalar_type(),
              "decode_attention: contiguous caches in q's dtype");
  TORCH_CHECK(hq % hkv == 0 && k_cache.size(2) == d && d <= 1024, "decode_attention: head counts and head_dim");
  auto qc = q.contiguous();
  auto tables = block_tables.to(at::kInt).contiguous(), lens = context_lens.to(at::kInt).contiguous();
  auto out = at::empty_like(qc);
  XSERV_DISPATCH(q.scalar_type(), [&] {
    decode_attention_impl(qc.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), tables.data_ptr<int32_t>(),
                          lens.data_ptr<int32_t>(), out.data_ptr<T>(), batch, hq, hkv, d, slots, tables.size(1),
                          block_size, (float)scale);
  });
  return out;
}

// A prompt's attention probabilities, in place (layers/ops.py prefill_attention): scores [R, Lk]
// (rows of a matmul's output, `stride` apart) of queries whose positions are
// first + r % chunk (a chunk of consecutive queries per head, heads one after another) over keys
// 0..Lk-1. Each row: rounded to the dtype after the scale (as `scores * scale` in it), keys past
// the query's position dropped, softmax in fp32, probabilities rounded to the dtype, zeros past
// the position. torch's softmax over the same masked scores is the reference (tests).
template <typename T>
void causal_softmax_impl(T* sc, int64_t rows, int64_t lk, int64_t stride, int64_t chunk, int64_t first, float scale) {
#pragma omp parallel num_threads(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows / 16)))
  {
    std::vector<float> buf(lk + 16);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      T* row = sc + r * stride;
      float* f = buf.data();
      const int64_t len = std::min(lk, first + r % chunk + 1);
      int64_t x = 0;
      f32x16 mx16 = splat(-INFINITY);
      for (; x + 16 <= len; x += 16) {
        const f32x16 v = rnd16<T>(load16(row + x) * scale);
        store16(f + x, v);
        mx16 = mx16 > v ? mx16 : v;
      }
      float mx = hmax(mx16);
      for (int64_t t = x; t < len; ++t) mx = std::max(mx, f[t] = rnd<T>(ld(row, t) * scale));
      const float sum = exp_sum(f, len, mx);
      for (x = 0; x + 16 <= len; x += 16) store16(row + x, load16(f + x) / sum);
      for (; x < len; ++x) row[x] = static_cast<T>(f[x] / sum);
      std::memset(static_cast<void*>(row + len), 0, (lk - len) * sizeof(T));
    }
  }
}

// scores [..., R, Lk] (the last dim contiguous, the rest one stride apart), in place
void causal_softmax(at::Tensor& scores, double scale, int64_t chunk, int64_t first) {
  TORCH_CHECK(scores.dim() >= 2 && scores.stride(-1) == 1 && chunk > 0 && first >= 0,
              "causal_softmax: scores [..., R, Lk] with contiguous rows");
  const int64_t lk = scores.size(-1), rows = scores.numel() / std::max<int64_t>(lk, 1), stride = scores.stride(-2);
  for (int64_t i = 0; i + 2 < scores.dim(); ++i)
    TORCH_CHECK(scores.stride(i) == scores.size(i + 1) * scores.stride(i + 1) || scores.size(i) == 1,
                "causal_softmax: scores whose rows are evenly spaced");
  XSERV_DISPATCH(scores.scalar_type(), [&] {
    causal_softmax_impl(scores.data_ptr<T>(), rows, lk, stride, chunk, first, (float)scale);
  });
}

// ---- vision_attention: full (bidirectional) attention within one image of a vision tower
// (models/qwen3_vision.py), bf16, with the tile of bf16_linear. Per head, K is packed as a
// weight of n channels over D ([n / 16, D / 2, 16, 2]) and V^T as one of D channels over n; then
// each (head, block of query rows) is one task of a single parallel loop: scores = Q K^T summed in
// fp32 by vdpbf16ps, the softmax of each row in fp32 (scaled, max, exp, sum), the probabilities
// rounded to bf16, out = P V summed in fp32 and rounded to bf16. The scores stay fp32, as torch's
// CPU flash kernel keeps them (eager attention rounds them to bf16); the whole row fits in L2, so
// there is no running max to rescale by. At 3,072 patches x 12 heads x 64 it takes ~0.7 of the CPU
// time of torch's SDPA, which calls its GEMMs per 256 x 512 block.
#if XSERV_VNNI && defined(__AVX512BF16__)
constexpr int64_t VISION_ROWS = 48;  // query rows a task: 8 tiles of 6; [48, n] fp32 scores in L2

// x [H, n, D] bf16 (each head's rows contiguous) -> per head the packed [ceil(n / 16), D / 2, 16, 2]
at::Tensor pack_heads(const at::Tensor& x) {
  const int64_t h = x.size(0), n = x.size(1), d = x.size(2), n16 = padded(n, BLOCK);
  auto plain = at::constant_pad_nd(x, {0, 0, 0, n16 - n});
  return plain.view({h, n16 / BLOCK, BLOCK, d / 2, 2}).permute({0, 1, 3, 2, 4}).contiguous();
}

void vision_attention_rows(const bf16* q, int64_t rows, int64_t n, int64_t d, const int8_t* kp, const int8_t* vp,
                           float scale, float* s, bf16* p, float* o) {
  packed_matmul(reinterpret_cast<const uint8_t*>(q), rows, d * 2, Bf16Sums{}, kp, n, s);
  for (int64_t r = 0; r < rows; ++r) {
    float* f = s + r * n;
    f32x16 mx16 = splat(-INFINITY);
    int64_t x = 0;
    for (; x + 16 <= n; x += 16) {
      const f32x16 v = load16(f + x) * scale;
      store16(f + x, v);
      mx16 = mx16 > v ? mx16 : v;
    }
    float mx = hmax(mx16);
    for (; x < n; ++x) mx = std::max(mx, f[x] *= scale);
    const float inv = 1.f / exp_sum(f, n, mx);
    bf16* pr = p + r * n;
    for (x = 0; x + 16 <= n; x += 16) store16(pr + x, load16(f + x) * inv);
    for (; x < n; ++x) pr[x] = static_cast<bf16>(f[x] * inv);
  }
  packed_matmul(reinterpret_cast<const uint8_t*>(p), rows, n * 2, Bf16Sums{}, vp, d, o);
}
#endif

// q, k, v [H, n, D] bfloat16 (each head's rows contiguous, D even; n even) -> [n, H, D] bfloat16
at::Tensor vision_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(has_bf16_linear(), "vision_attention: this build has no AVX512-BF16 kernel");
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.sizes() == q.sizes(), "vision_attention: q, k, v [H, n, D]");
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->stride(2) == 1 && t->stride(1) == t->size(2),
                "vision_attention: bfloat16 heads of contiguous rows");
  const int64_t h = q.size(0), n = q.size(1), d = q.size(2);
  TORCH_CHECK(d % 2 == 0 && n % 2 == 0, "vision_attention: an even head dim and an even number of patches");
  auto out = at::empty({n, h, d}, q.options());
#if XSERV_VNNI && defined(__AVX512BF16__)
  const auto kp = pack_heads(k), vp = pack_heads(v.transpose(1, 2).contiguous());
  const int64_t blocks = (n + VISION_ROWS - 1) / VISION_ROWS, d16 = padded(d, BLOCK);
  const auto* qd = q.data_ptr<bf16>();
  const auto* kd = reinterpret_cast<const int8_t*>(kp.data_ptr<bf16>());
  const auto* vd = reinterpret_cast<const int8_t*>(vp.data_ptr<bf16>());
  bf16* od = out.data_ptr<bf16>();
  at::parallel_for(0, h * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(VISION_ROWS * n), o(VISION_ROWS * d16);
    std::vector<bf16> p(VISION_ROWS * n);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t head = t / blocks, r0 = t % blocks * VISION_ROWS, rows = std::min(VISION_ROWS, n - r0);
      vision_attention_rows(qd + head * q.stride(0) + r0 * d, rows, n, d, kd + head * kp.stride(0) * 2,
                            vd + head * vp.stride(0) * 2, (float)scale, s.data(), p.data(), o.data());
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < d; ++c) od[((r0 + r) * h + head) * d + c] = static_cast<bf16>(o[r * d + c]);
    }
  });
#endif
  return out;
}

// ---- the experts of a mixture-of-experts layer over a few rows each (decode steps, short
// prefills; layers/fused_moe.py), on plain [out, in] weights, where a matmul library would reorder
// the weight on every call. A decode step is bound by reading the weights of the experts it hits
// (at 16 tokens of a top-8 model, most of a layer's), so each weight row is read from memory once
// for all of its expert's rows (up to 8 of them at a time), and the layer's work is one list of
// (expert, block of weight rows) items that the threads take as they come free ----

constexpr int64_t MOE_NB = 8;      // rows of x taken against a weight row at once (accumulators)
constexpr int64_t MOE_GATE = 16;   // gate_up: an item's intermediate channels (16 gate + 16 up rows)
constexpr int64_t MOE_DOWN = 32;   // down: an item's output channels

// w . x over K, in four independent vector sums: one sum would wait on its own previous FMA
// every step (the latency, not the memory, then bounds a matvec)
template <typename T>
inline float dot(const T* w, const T* x, int64_t K) {
  f32x16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    a0 += load16(w + k) * load16(x + k);
    a1 += load16(w + k + 16) * load16(x + k + 16);
    a2 += load16(w + k + 32) * load16(x + k + 32);
    a3 += load16(w + k + 48) * load16(x + k + 48);
  }
  for (; k + 16 <= K; k += 16) a0 += load16(w + k) * load16(x + k);
  float sum = hsum((a0 + a1) + (a2 + a3));
  for (; k < K; k++) sum += ld(w, k) * ld(x, k);
  return sum;
}

// sums[b] = w . x[b] over K for NB rows of x (U: independent sums per row, where vdpbf16ps has them)
template <int NB, int U, typename T>
inline void dots(const T* w, int64_t K, const T* const* x, float (&sums)[NB]) {
  for (int b = 0; b < NB; b++) sums[b] = dot(w, x[b], K);
}

#if defined(__AVX512BF16__)
// With AVX512-BF16 (Zen 4, Sapphire Rapids): vdpbf16ps multiplies 32 bf16 pairs per instruction;
// widening bf16 to float in software first, as dot() does, caps a core at ~15 G multiply-adds/s.
// NB rows of x against one weight row (read from memory once, front to back: one stream the
// hardware prefetches well; 4-row tiles, 4 streams 4 KB apart, read ~10 % slower), U independent
// sums per row: every vdpbf16ps waits on its accumulator's previous one (~6 cycles).
template <bool Tail>
inline __m512bh load32(const bf16* p, __mmask32 m) {
  if constexpr (Tail) return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
  else return (__m512bh)_mm512_loadu_si512(p);
}

template <int NB, int U>
inline void dots(const bf16* w, int64_t K, const bf16* const* x, float (&sums)[NB]) {
  __m512 acc[NB][U];
#pragma GCC unroll 8
  for (int b = 0; b < NB; b++)
#pragma GCC unroll 4
    for (int u = 0; u < U; u++) acc[b][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 * U <= K; k += 32 * U) {
#pragma GCC unroll 4
    for (int u = 0; u < U; u++) {
      const __m512bh wv = load32<false>(w + k + 32 * u, 0);
#pragma GCC unroll 8
      for (int b = 0; b < NB; b++) acc[b][u] = _mm512_dpbf16_ps(acc[b][u], wv, load32<false>(x[b] + k + 32 * u, 0));
    }
  }
  for (; k + 32 <= K; k += 32) {
    const __m512bh wv = load32<false>(w + k, 0);
#pragma GCC unroll 8
    for (int b = 0; b < NB; b++) acc[b][0] = _mm512_dpbf16_ps(acc[b][0], wv, load32<false>(x[b] + k, 0));
  }
  if (k < K) {
    const __mmask32 m = _cvtu32_mask32((1u << (K - k)) - 1);
    const __m512bh wv = load32<true>(w + k, m);
#pragma GCC unroll 8
    for (int b = 0; b < NB; b++) acc[b][0] = _mm512_dpbf16_ps(acc[b][0], wv, load32<true>(x[b] + k, m));
  }
  for (int b = 0; b < NB; b++) {
    __m512 a = acc[b][0];
    for (int u = 1; u < U; u++) a = _mm512_add_ps(a, acc[b][u]);
    sums[b] = _mm512_reduce_add_ps(a);
  }
}
#endif

// out(b, n, sum) for the weight rows [n0, n1) (each K long) against the `rows` rows of x, up to
// MOE_NB of them at a time (the weight row re-read from L1 for the next ones)
template <typename T, typename F>
inline void rows_times(const T* w, int64_t K, int64_t n0, int64_t n1, const T* const* x, int64_t rows, F&& out) {
  auto some = [&](const T* wn, int64_t n, int64_t b0, auto nb, auto u) {
    constexpr int NB = decltype(nb)::value, U = decltype(u)::value;
    float sums[NB];
    dots<NB, U>(wn, K, x + b0, sums);
    for (int b = 0; b < NB; b++) out(b0 + b, n, sums[b]);
  };
  using std::integral_constant;
  for (int64_t n = n0; n < n1; n++) {
    const T* wn = w + n * K;
    for (int64_t b0 = 0; b0 < rows; b0 += MOE_NB) {
      switch (std::min(rows - b0, MOE_NB)) {
        case 1: some(wn, n, b0, integral_constant<int, 1>{}, integral_constant<int, 4>{}); break;
        case 2: some(wn, n, b0, integral_constant<int, 2>{}, integral_constant<int, 2>{}); break;
        case 3: some(wn, n, b0, integral_constant<int, 3>{}, integral_constant<int, 2>{}); break;
        case 4: some(wn, n, b0, integral_constant<int, 4>{}, integral_constant<int, 1>{}); break;
        case 5: some(wn, n, b0, integral_constant<int, 5>{}, integral_constant<int, 1>{}); break;
        case 6: some(wn, n, b0, integral_constant<int, 6>{}, integral_constant<int, 1>{}); break;
        case 7: some(wn, n, b0, integral_constant<int, 7>{}, integral_constant<int, 1>{}); break;
        default: some(wn, n, b0, integral_constant<int, 8>{}, integral_constant<int, 1>{}); break;
      }
    }
  }
}

// The T*K (token, expert) pairs sorted by expert (order[p]: the pair's index t*K+k; counts[e]:
// expert e's pairs). Two passes over the experts that got pairs, each a list of (expert, block of
// weight rows) items that the threads take in shrinking runs of consecutive items (guided, as
// packed_matmul: one thread's reads then stream through an expert's rows instead of jumping a
// block every item, 1.1-1.45x faster at 1-16 tokens; the small last runs let a paused thread
// cost the others little), with one barrier after each: gate_up with silu(gate)*up (an item owns
// its channels' gate and up rows), then down; then each token's sum of its pairs' outputs times
// their router weights. Rounded as the torch path rounds: gate and up, silu(gate), the product,
// down's output to T; the sum in fp32.
template <typename T>
void moe_experts_impl(const T* x, const T* w13, const T* w2, const float* weights, const int64_t* order,
                      const int64_t* counts, T* out, int64_t tokens, int64_t K, int64_t E, int64_t H, int64_t I) {
  const int64_t P = tokens * K;
  std::unique_ptr<T[]> act(new T[P * I]), y(new T[P * H]);  // pair order
  std::vector<const T*> rows(P), act_rows(P);  // each sorted pair's row of x, of act
  std::vector<int64_t> slot(P), hit, start;  // slot: pair index t*K+k -> its row in pair order
  int64_t most = 0;
  for (int64_t p = 0; p < P; p++) {
    slot[order[p]] = p;
    rows[p] = x + order[p] / K * H;
    act_rows[p] = act.get() + p * I;
  }
  for (int64_t e = 0, s = 0; e < E; s += counts[e], e++)
    if (counts[e]) hit.push_back(e), start.push_back(s), most = std::max(most, counts[e]);
  const int64_t n_hit = hit.size(), gate_items = (I + MOE_GATE - 1) / MOE_GATE, down_items = (H + MOE_DOWN - 1) / MOE_DOWN;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> gate(most * MOE_GATE);  // silu(gate) of an item's channels, [pair][channel]
#pragma omp for schedule(guided)
    for (int64_t item = 0; item < n_hit * gate_items; item++) {
      const int64_t j = item / gate_items, e = hit[j], s = start[j], c = counts[e];
      const int64_t i0 = item % gate_items * MOE_GATE, i1 = std::min(I, i0 + MOE_GATE);
      const T* we = w13 + e * 2 * I * H;
      rows_times(we, H, i0, i1, rows.data() + s, c, [&](int64_t b, int64_t i, float g) {
        g = rnd<T>(g);
        gate[b * MOE_GATE + i - i0] = rnd<T>(g / (1.f + std::exp(-g)));
      });
      rows_times(we + I * H, H, i0, i1, rows.data() + s, c, [&](int64_t b, int64_t i, float u) {
        act[(s + b) * I + i] = static_cast<T>(gate[b * MOE_GATE + i - i0] * rnd<T>(u));
      });
    }
#pragma omp for schedule(guided)
    for (int64_t item = 0; item < n_hit * down_items; item++) {
      const int64_t j = item / down_items, e = hit[j], s = start[j], c = counts[e];
      const int64_t h0 = item % down_items * MOE_DOWN, h1 = std::min(H, h0 + MOE_DOWN);
      rows_times(w2 + e * H * I, I, h0, h1, act_rows.data() + s, c,
                 [&](int64_t b, int64_t n, float v) { y[(s + b) * H + n] = static_cast<T>(v); });
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
      int64_t h = 0;
      for (; h + 16 <= H; h += 16) {
        f32x16 sum = {};
        for (int64_t k = 0; k < K; k++) sum += weights[t * K + k] * load16(y.get() + slot[t * K + k] * H + h);
        store16(out + t * H + h, sum);
      }
      for (; h < H; h++) {
        float sum = 0.f;
        for (int64_t k = 0; k < K; k++) sum += weights[t * K + k] * ld(y.get(), slot[t * K + k] * H + h);
        out[t * H + h] = static_cast<T>(sum);
      }
    }
  }
}

// x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; topk_weights [T, K]; order
// [T*K] (the pairs sorted by expert, stable); counts [E] -> [T, H]
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                       const at::Tensor& topk_weights, const at::Tensor& order, const at::Tensor& counts) {
  TORCH_CHECK(x.dim() == 2 && w13.dim() == 3 && w2.dim() == 3 && w13.scalar_type() == x.scalar_type() &&
                  w2.scalar_type() == x.scalar_type() && w13.is_contiguous() && w2.is_contiguous(),
              "moe_experts: x [T, H], contiguous w13 [E, 2I, H] and w2 [E, H, I] in x's dtype");
  const int64_t tokens = x.size(0), H = x.size(1), E = w13.size(0), I = w13.size(1) / 2, K = topk_weights.size(1);
  TORCH_CHECK(w13.size(2) == H && w2.size(1) == H && w2.size(2) == I && order.numel() == tokens * K &&
                  counts.numel() == E, "moe_experts: shapes");
  auto xc = x.contiguous(), wc = topk_weights.to(at::kFloat).contiguous();
  auto oc = order.to(at::kLong).contiguous(), cc = counts.to(at::kLong).contiguous();
  auto out = at::empty_like(xc);
  XSERV_DISPATCH(x.scalar_type(), [&] {
    moe_experts_impl(xc.data_ptr<T>(), w13.data_ptr<T>(), w2.data_ptr<T>(), wc.data_ptr<float>(),
                     oc.data_ptr<int64_t>(), cc.data_ptr<int64_t>(), out.data_ptr<T>(), tokens, K, E, H, I);
  });
  return out;
}


// The same experts with int8 weights (W8A8, as int8_linear): w13 and w2 packed per expert by
// int8_pack and stacked ([E, N16 / 16, K4 / 4, 16, 4]), their sums ([E, N16]) and scales ([E, N]).
// Each expert's pairs are one int8 matmul per projection (a decode step's: matvecs at memory
// speed; a prefill's: register tiles), each pair's activations quantized per row as the dense
// op does; gate_up's and down's outputs and silu(gate)*up rounded to T as the torch path's.
#if XSERV_VNNI
// The pairs' steps around the two projections, which the weight format's code gives (pair order:
// the pairs sorted by expert, order[p] the pair t*K+k at row p): gather each pair's token row,
// gate_up(rows, gu), SwiGLU in fp32 rounded to T, down(act, y), each pair's output weighed back
// into its token
template <typename T, typename GateUp, typename Down>
void experts_pairs(const T* x, const float* weights, const int64_t* order, T* out, int64_t tokens, int64_t K,
                   int64_t H, int64_t I, const GateUp& gate_up, const Down& down) {
  const int64_t P = tokens * K;
  std::vector<T> rows(P * H), gu(P * 2 * I), act(P * I), y(P * H);
  std::vector<int64_t> slot(P);  // pair index t*K+k -> its row in pair order
  for (int64_t p = 0; p < P; p++) {
    slot[order[p]] = p;
    std::memcpy(rows.data() + p * H, x + order[p] / K * H, H * sizeof(T));
  }
  gate_up(rows.data(), gu.data());
  at::parallel_for(0, P, grain(2 * I), [&](int64_t b, int64_t end) {
    for (int64_t r = b; r < end; ++r)
      for (int64_t i = 0; i < I; ++i) {
        const float g = ld(gu.data(), r * 2 * I + i);
        act[r * I + i] = static_cast<T>(rnd<T>(g / (1.f + std::exp(-g))) * ld(gu.data(), r * 2 * I + I + i));
      }
  });
  down(act.data(), y.data());
  at::parallel_for(0, tokens, grain(K * H), [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t)
      for (int64_t h = 0; h < H; ++h) {
        float sum = 0.f;
        for (int64_t k = 0; k < K; ++k) sum += weights[t * K + k] * ld(y.data(), slot[t * K + k] * H + h);
        out[t * H + h] = static_cast<T>(sum);
      }
  });
}

template <typename T>
void moe_experts_int8_impl(const T* x, const int8_t* p13, const int32_t* c13, const float* s13, const int8_t* p2,
                           const int32_t* c2, const float* s2, const float* weights, const int64_t* order,
                           const int64_t* counts, T* out, int64_t tokens, int64_t K, int64_t E, int64_t H, int64_t I) {
  const int64_t P = tokens * K, H4 = padded(H, 4), I4 = padded(I, 4), N13 = padded(2 * I, BLOCK),
                N2 = padded(H, BLOCK);
  std::vector<uint8_t> xq(P * std::max(H4, I4));
  std::vector<float> xs(P);
  experts_pairs(x, weights, order, out, tokens, K, H, I, [&](const T* rows, T* gu) {
    quantize_rows(rows, P, H, H4, xq.data(), xs.data());
    for (int64_t e = 0, start = 0; e < E; start += counts[e], ++e)
      if (counts[e])
        packed_matmul(xq.data() + start * H4, counts[e], H4, Int8Sums{c13 + e * N13, s13 + e * 2 * I, xs.data() + start},
                      p13 + e * N13 * H4, 2 * I, gu + start * 2 * I);
  }, [&](const T* act, T* y) {
    quantize_rows(act, P, I, I4, xq.data(), xs.data());
    for (int64_t e = 0, start = 0; e < E; start += counts[e], ++e)
      if (counts[e])
        packed_matmul(xq.data() + start * I4, counts[e], I4, Int8Sums{c2 + e * N2, s2 + e * H, xs.data() + start},
                      p2 + e * N2 * I4, H, y + start * H);
  });
}
#endif

// x [T, H]; p13/c13/s13: gate_up [E, 2I, H] as int8_pack made it per expert, stacked; p2/c2/s2:
// down [E, H, I] likewise; topk_weights [T, K]; order [T*K]; counts [E] -> [T, H]
at::Tensor moe_experts_int8(const at::Tensor& x, const at::Tensor& p13, const at::Tensor& c13, const at::Tensor& s13,
                            const at::Tensor& p2, const at::Tensor& c2, const at::Tensor& s2,
                            const at::Tensor& topk_weights, const at::Tensor& order, const at::Tensor& counts) {
  TORCH_CHECK(XSERV_VNNI, "moe_experts_int8: this build has no AVX512-VNNI kernel");
  TORCH_CHECK(x.dim() == 2 && p13.dim() == 5 && p2.dim() == 5 && p13.is_contiguous() && p2.is_contiguous() &&
                  c13.is_contiguous() && c2.is_contiguous() && s13.is_contiguous() && s2.is_contiguous() &&
                  s13.scalar_type() == at::kFloat && s2.scalar_type() == at::kFloat,
              "moe_experts_int8: x [T, H] and stacked int8_pack weights");
  const int64_t tokens = x.size(0), H = x.size(1), E = p13.size(0), I = s13.size(1) / 2, K = topk_weights.size(1);
  TORCH_CHECK(p13.size(2) * 4 == padded(H, 4) && p2.size(2) * 4 == padded(I, 4) && s2.size(1) == H &&
                  order.numel() == tokens * K && counts.numel() == E, "moe_experts_int8: shapes");
  auto xc = x.contiguous(), wc = topk_weights.to(at::kFloat).contiguous();
  auto oc = order.to(at::kLong).contiguous(), cc = counts.to(at::kLong).contiguous();
  auto out = at::empty_like(xc);
#if XSERV_VNNI
  XSERV_DISPATCH(x.scalar_type(), [&] {
    moe_experts_int8_impl(xc.data_ptr<T>(), p13.data_ptr<int8_t>(), c13.data_ptr<int32_t>(), s13.data_ptr<float>(),
                          p2.data_ptr<int8_t>(), c2.data_ptr<int32_t>(), s2.data_ptr<float>(), wc.data_ptr<float>(),
                          oc.data_ptr<int64_t>(), cc.data_ptr<int64_t>(), out.data_ptr<T>(), tokens, K, E, H, I);
  });
#endif
  return out;
}

// The experts with 4-bit weights (layers/int4.py's Int4Experts): gate_up [E, 2I, H] and down
// [E, H, I] packed by int4_pack per expert and stacked ([E, ...] each part). As moe_experts_int8:
// the pairs gathered in expert order, each expert's pairs one matmul per projection (bfloat16:
// W4A8, the pairs quantized once per projection; float32: the exact weights), SwiGLU between, the
// pairs' outputs weighed back into their tokens.
#if XSERV_VNNI
template <typename T>
void moe_experts_int4_impl(const T* x, const uint8_t* q13, const float* s13, const uint8_t* z13, const uint8_t* q2,
                           const float* s2, const uint8_t* z2, const float* weights, const int64_t* order,
                           const int64_t* counts, T* out, int64_t tokens, int64_t K, int64_t E, int64_t H, int64_t I,
                           int64_t g13, int64_t g2) {
  const int64_t P = tokens * K;
  std::vector<int8_t> xq(P * std::max(H, I));
  std::vector<float> xs(P), xsum(P * std::max(g13, g2));
  // one projection of every expert's pairs: in [P, k] -> result [P, n], the weight n x k in groups
  auto project = [&](const T* in, int64_t k, int64_t groups, const uint8_t* q, const float* s, const uint8_t* z,
                     int64_t n, T* result) {
    const int64_t n16 = padded(n, BLOCK);
    if constexpr (std::is_same_v<T, float>) {
      for (int64_t e = 0, start = 0; e < E; start += counts[e], ++e)
        if (counts[e])
          int4_matmul_fp32(in + start * k, counts[e], k, groups, q + e * n16 * k / 2, s + e * n16 * groups,
                           z + e * n16 * groups, n, result + start * n);
    } else {
      int4_quantize(in, P, k, groups, xq.data(), xs.data(), xsum.data());
      for (int64_t e = 0, start = 0; e < E; start += counts[e], ++e)
        if (counts[e])
          int4_matmul_w4a8(xq.data() + start * k, xsum.data() + start * groups, xs.data() + start, counts[e], k,
                           groups, q + e * n16 * k / 2, s + e * n16 * groups, z + e * n16 * groups, n,
                           result + start * n);
    }
  };
  experts_pairs(x, weights, order, out, tokens, K, H, I,
                [&](const T* rows, T* gu) { project(rows, H, g13, q13, s13, z13, 2 * I, gu); },
                [&](const T* act, T* y) { project(act, I, g2, q2, s2, z2, H, y); });
}
#endif

// x [T, H]; q13/s13/z13: gate_up's parts as int4_pack made them per expert, stacked ([E, 2I16 / 16,
// H / 8, 16, 4], [E, 2I16 / 16, H / G, 16] twice); q2/s2/z2: down's likewise; topk_weights [T, K];
// order [T*K]; counts [E] -> [T, H]
at::Tensor moe_experts_int4(const at::Tensor& x, const at::Tensor& q13, const at::Tensor& s13, const at::Tensor& z13,
                            const at::Tensor& q2, const at::Tensor& s2, const at::Tensor& z2,
                            const at::Tensor& topk_weights, const at::Tensor& order, const at::Tensor& counts) {
  TORCH_CHECK(XSERV_VNNI, "moe_experts_int4: this build has no AVX512-VNNI kernel");
  TORCH_CHECK(x.dim() == 2 && q13.dim() == 5 && q2.dim() == 5 && s13.dim() == 4 && s2.dim() == 4 &&
                  q13.scalar_type() == at::kByte && q2.scalar_type() == at::kByte && s13.scalar_type() == at::kFloat &&
                  s2.scalar_type() == at::kFloat && z13.sizes() == s13.sizes() && z2.sizes() == s2.sizes() &&
                  q13.is_contiguous() && q2.is_contiguous() && s13.is_contiguous() && s2.is_contiguous() &&
                  z13.is_contiguous() && z2.is_contiguous(), "moe_experts_int4: x [T, H] and stacked int4_pack parts");
  const int64_t tokens = x.size(0), H = x.size(1), E = q13.size(0), I = q2.size(2) * 8, K = topk_weights.size(1);
  TORCH_CHECK(q13.size(2) * 8 == H && q13.size(1) * BLOCK == padded(2 * I, BLOCK) && q2.size(1) * BLOCK == padded(H, BLOCK) &&
                  order.numel() == tokens * K && counts.numel() == E, "moe_experts_int4: shapes");
  auto xc = x.contiguous(), wc = topk_weights.to(at::kFloat).contiguous();
  auto oc = order.to(at::kLong).contiguous(), cc = counts.to(at::kLong).contiguous();
  auto out = at::empty_like(xc);
#if XSERV_VNNI
  XSERV_DISPATCH(x.scalar_type(), [&] {
    moe_experts_int4_impl(xc.data_ptr<T>(), q13.data_ptr<uint8_t>(), s13.data_ptr<float>(), z13.data_ptr<uint8_t>(),
                          q2.data_ptr<uint8_t>(), s2.data_ptr<float>(), z2.data_ptr<uint8_t>(), wc.data_ptr<float>(),
                          oc.data_ptr<int64_t>(), cc.data_ptr<int64_t>(), out.data_ptr<T>(), tokens, K, E, H, I,
                          s13.size(2), s2.size(2));
  });
#endif
  return out;
}

// Grammar masks (structured/bitmask.py): logits [B, V] float32, rows [R] int64 into them,
// bitmask [R, W] int32 (bit t of row j allows token t). Row rows[j] keeps the tokens that bitmask
// row j allows; every other one, and every one past W * 32 (a model's padding rows), becomes
// -inf. A word that allows all 32 tokens is skipped, one that allows none is two stores.
void apply_token_bitmask(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "apply_token_bitmask: logits must be [B, V] float32 with contiguous rows");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "apply_token_bitmask: bitmask must be a contiguous [R, W] int32 tensor");
  const auto idx = rows.to(at::kLong).contiguous();
  TORCH_CHECK(idx.numel() == bitmask.size(0), "apply_token_bitmask: one row index per bitmask row");
  const int64_t vocab = logits.size(1), words = bitmask.size(1), width = std::min(vocab, words * 32);
  const int64_t* r = idx.data_ptr<int64_t>();
  for (int64_t j = 0; j < idx.numel(); ++j)
    TORCH_CHECK(r[j] >= 0 && r[j] < logits.size(0), "apply_token_bitmask: row index out of range");
  float* base = logits.data_ptr<float>();
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, idx.numel(), 1, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) {
      float* row = base + r[j] * logits.stride(0);
      const uint32_t* w = bits + j * words;
      int64_t t = 0;
      for (; t + 32 <= width; t += 32) {
        const uint32_t word = w[t / 32];
        if (word == 0xffffffffu) continue;
#if defined(__AVX512F__)
        const __m512 blocked = _mm512_set1_ps(inf);
        _mm512_mask_storeu_ps(row + t, static_cast<__mmask16>(~word & 0xffff), blocked);
        _mm512_mask_storeu_ps(row + t + 16, static_cast<__mmask16>(~word >> 16), blocked);
#else
        for (int k = 0; k < 32; ++k)
          if (!(word >> k & 1)) row[t + k] = inf;
#endif
      }
      for (; t < width; ++t)
        if (!(w[t / 32] >> (t % 32) & 1)) row[t] = inf;
      for (; t < vocab; ++t) row[t] = inf;
    }
  });
}

// The first maximum of a row of v logits, or its first NaN where it has one (torch.argmax's
// answer: NaN counts as the largest). Each of 16 lanes keeps its first maximum; the lanes'
// maxima then give the row's, the smallest index among equals.
template <typename T>
int64_t argmax_row(const T* x, int64_t v) {
  int64_t i = 0, at = 0;
  float best = -INFINITY;
  bool nan = false;
  if (v >= 16) {
    f32x16 bv = splat(-INFINITY);
    i32x16 bi, idx, step;
    for (int l = 0; l < 16; ++l) bi[l] = idx[l] = l, step[l] = 16;
    i32x16 unordered = {};
    for (; i + 16 <= v; i += 16, idx += step) {
      const f32x16 xv = load16(x + i);
      const i32x16 gt = xv > bv;
      bv = gt ? xv : bv;
      bi = gt ? idx : bi;
      unordered |= xv != xv;
    }
    for (int l = 0; l < 16; ++l) nan |= unordered[l] != 0;
    for (int l = 0; l < 16; ++l) best = std::max(best, bv[l]);
    at = v;
    for (int l = 0; l < 16; ++l)
      if (bv[l] == best) at = std::min<int64_t>(at, bi[l]);
  }
  for (; i < v; ++i) {
    const float f = ld(x, i);
    nan |= f != f;
    if (f > best) best = f, at = i;
  }
  if (nan)
    for (int64_t j = 0; j < v; ++j)
      if (ld(x, j) != ld(x, j)) return j;
  return at;
}

// Row-wise argmax of [R, V] logits (bfloat16 or float32, unit last stride) -> [R] int64, as
// torch.argmax(dim=-1). One pass over each row: torch's argmax over a bf16 row is a scalar
// index-tracking loop, and the chunked amax the sampler used instead took ~6 ops (~0.1 ms a row
// alone, ~0.3 in a decode step where each op woke the other thread).
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.stride(1) == 1 && logits.size(1) < (1LL << 31),
              "argmax_rows: logits must be [R, V] with V > 0 and unit last stride");
  const int64_t rows = logits.size(0), v = logits.size(1), ld_row = logits.stride(0);
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* po = out.data_ptr<int64_t>();
  XSERV_DISPATCH(logits.scalar_type(), [&] {
    const T* px = logits.data_ptr<T>();
    at::parallel_for(0, rows, 4, [&](int64_t b, int64_t e) {  // under 4 rows (~20 us each): this thread
      for (int64_t r = b; r < e; ++r) po[r] = argmax_row(px + r * ld_row, v);
    });
  });
  return out;
}

// Allowed tokens per bitmask row [R, W] int32 -> [R] int64 (every set bit, as numpy's
// bitwise_count over the row; structured/bitmask.py picks the rows to narrow by it).
at::Tensor count_allowed(const at::Tensor& bitmask) {
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "count_allowed: bitmask must be a contiguous [R, W] int32 tensor");
  const int64_t rows = bitmask.size(0), words = bitmask.size(1);
  auto out = at::empty({rows}, bitmask.options().dtype(at::kLong));
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  int64_t* po = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain(words), [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) {
      const uint32_t* w = bits + j * words;
      int64_t n = 0;
      for (int64_t i = 0; i < words; ++i) n += __builtin_popcount(w[i]);
      po[j] = n;
    }
  });
  return out;
}

// The allowed ids below `vocab` of bitmask rows `rows`, ascending: (ids [n, K] int64, valid
// [n, K] bool), each row padded to the longest (id 0, valid false), K at least 1. Zero words,
// most of a narrow row, cost one test each.
std::tuple<at::Tensor, at::Tensor> allowed_ids(const at::Tensor& bitmask, const at::Tensor& rows, int64_t vocab) {
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "allowed_ids: bitmask must be a contiguous [R, W] int32 tensor");
  const auto idx = rows.to(at::kLong).contiguous();
  const int64_t n = idx.numel(), words = bitmask.size(1), width = std::min<int64_t>(vocab, words * 32);
  const int64_t* r = idx.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j)
    TORCH_CHECK(r[j] >= 0 && r[j] < bitmask.size(0), "allowed_ids: row index out of range");
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const int64_t full = width / 32, tail = width % 32;  // whole words below vocab, bits of the next
  auto word_at = [&](const uint32_t* w, int64_t i) { return i < full ? w[i] : w[i] & ((1u << tail) - 1); };
  const int64_t last = full + (tail ? 1 : 0);
  std::vector<int64_t> counts(n);
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t* w = bits + r[j] * words;
    int64_t c = 0;
    for (int64_t i = 0; i < last; ++i) c += __builtin_popcount(word_at(w, i));
    counts[j] = c;
  }
  const int64_t k = std::max<int64_t>(1, n ? *std::max_element(counts.begin(), counts.end()) : 0);
  auto ids = at::zeros({n, k}, idx.options());
  auto valid = at::zeros({n, k}, idx.options().dtype(at::kBool));
  int64_t* pi = ids.data_ptr<int64_t>();
  bool* pv = valid.data_ptr<bool>();
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t* w = bits + r[j] * words;
    int64_t* out = pi + j * k;
    bool* ok = pv + j * k;
    int64_t c = 0;
    for (int64_t i = 0; i < last; ++i) {
      for (uint32_t word = word_at(w, i); word; word &= word - 1) {
        out[c] = i * 32 + __builtin_ctz(word);
        ok[c++] = true;
      }
    }
  }
  return {ids, valid};
}


// ---- The Gated DeltaNet of the hybrid models (layers/gated_delta_net.py) ----

// One decode token per sequence, in place on the sequences' states: the depthwise causal conv
// (conv_state [S, C, K-1] of the dtype, weight [C, K]) and SiLU on mixed [B, C] (q, k, v side by
// side), then per value head the gated delta rule on ssm_state [S, Hv, Dk, Dv] (fp32), each row
// at its slot; g (the log decay) and beta [B, Hv] -> o [B, Hv, Dv]. The arithmetic of
// layers/gated_delta_rule.py (causal_conv1d_step, recurrent_gated_delta_rule): the conv's output
// rounded to the dtype, q and k L2-normalized in fp32, q scaled by Dk^-1/2; value head h reads
// key head h / (Hv / Hk). Two passes over each head's state, which stays in L2 between them.
at::Tensor gdn_decode(const at::Tensor& mixed, const at::Tensor& g, const at::Tensor& beta, at::Tensor& conv_state,
                      const at::Tensor& conv_weight, at::Tensor& ssm_state, const at::Tensor& slots,
                      int64_t num_key_heads) {
  const int64_t b = mixed.size(0), c = mixed.size(1), k = conv_weight.size(1);
  const int64_t hv = ssm_state.size(1), dk = ssm_state.size(2), dv = ssm_state.size(3);
  const int64_t key_dim = num_key_heads * dk, group = hv / num_key_heads;
  TORCH_CHECK(c == 2 * key_dim + hv * dv && conv_weight.size(0) == c && conv_state.size(1) == c &&
              conv_state.size(2) == k - 1 && k >= 2, "gdn_decode: mixed [B, 2 Hk Dk + Hv Dv], states of its layer");
  TORCH_CHECK(conv_state.is_contiguous() && ssm_state.is_contiguous() && ssm_state.scalar_type() == at::kFloat &&
              conv_state.scalar_type() == mixed.scalar_type(), "gdn_decode: contiguous states, fp32 recurrent");
  auto mc = mixed.contiguous(), wc = conv_weight.to(mixed.scalar_type()).contiguous();
  auto gc = g.to(at::kFloat).contiguous(), bc = beta.to(at::kFloat).contiguous(), sl = slots.to(at::kLong).contiguous();
  auto conv = at::empty({b, c}, mc.options().dtype(at::kFloat));
  auto out = at::empty({b, hv, dv}, mc.options());
  XSERV_DISPATCH(mixed.scalar_type(), [&] {
    const T *pm = mc.data_ptr<T>(), *pw = wc.data_ptr<T>();
    T* pcs = conv_state.data_ptr<T>();
    const float *pg = gc.data_ptr<float>(), *pb = bc.data_ptr<float>();
    const int64_t* ps = sl.data_ptr<int64_t>();
    float* pc = conv.data_ptr<float>();
    float* pss = ssm_state.data_ptr<float>();
    T* po = out.data_ptr<T>();
    at::parallel_for(0, b * c, 8192, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = i / c, ch = i % c;
        T* st = pcs + (ps[r] * c + ch) * (k - 1);
        const T* w = pw + ch * k;
        const T x = pm[i];
        float acc = static_cast<float>(x) * static_cast<float>(w[k - 1]);
        for (int64_t j = 0; j < k - 1; ++j) acc += static_cast<float>(st[j]) * static_cast<float>(w[j]);
        for (int64_t j = 0; j + 1 < k - 1; ++j) st[j] = st[j + 1];
        st[k - 2] = x;
        const float a = rnd<T>(acc);  // the conv's output, then SiLU's, each rounded to the dtype
        pc[i] = rnd<T>(a / (1.f + std::exp(-a)));
      }
    });
    const float scale = 1.f / std::sqrt(static_cast<float>(dk));
    at::parallel_for(0, b * hv, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> q(dk), key(dk), delta(dv), o(dv);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = i / hv, h = i % hv, kh = h / group;
        const float *row = pc + r * c, *qs = row + kh * dk, *ks = row + key_dim + kh * dk;
        const float* vs = row + 2 * key_dim + h * dv;
        float qq = 0.f, kk = 0.f;
        for (int64_t d = 0; d < dk; ++d) { qq += qs[d] * qs[d]; kk += ks[d] * ks[d]; }
        const float qn = 1.f / std::sqrt(qq + 1e-6f), kn = 1.f / std::sqrt(kk + 1e-6f);
        for (int64_t d = 0; d < dk; ++d) { q[d] = qs[d] * qn * scale; key[d] = ks[d] * kn; }
        float* s = pss + (ps[r] * hv + h) * dk * dv;
        const float decay = std::exp(pg[i]), bt = pb[i];
        std::fill(delta.begin(), delta.end(), 0.f);
        for (int64_t d = 0; d < dk; ++d) {  // decay the state and read what it predicts for k
          float* sr = s + d * dv;
          const float kd = key[d];
          for (int64_t j = 0; j < dv; ++j) { sr[j] *= decay; delta[j] += sr[j] * kd; }
        }
        for (int64_t j = 0; j < dv; ++j) delta[j] = (vs[j] - delta[j]) * bt;
        std::fill(o.begin(), o.end(), 0.f);
        for (int64_t d = 0; d < dk; ++d) {  // write the correction, then read with q
          float* sr = s + d * dv;
          const float kd = key[d], qd = q[d];
          for (int64_t j = 0; j < dv; ++j) { sr[j] += kd * delta[j]; o[j] += sr[j] * qd; }
        }
        T* dst = po + i * dv;
        for (int64_t j = 0; j < dv; ++j) dst[j] = static_cast<T>(o[j]);
      }
    });
  });
  return out;
}

// One sequence's prompt chunk through the depthwise causal conv and SiLU, after the K-1 inputs its
// slot's state holds: x [n, C] -> [n, C]; the state (conv_state[slot], [C, K-1] of the dtype)
// becomes the chunk's last K-1 inputs. As layers/gated_delta_rule.causal_conv1d: fp32 sums, the
// conv's output and SiLU's each rounded to the dtype. Rows split over threads; channels are the
// contiguous (vectorized) axis.
at::Tensor gdn_conv_prefill(const at::Tensor& x, at::Tensor& conv_state, const at::Tensor& conv_weight, int64_t slot) {
  const int64_t n = x.size(0), c = x.size(1), k = conv_weight.size(1), keep = k - 1;
  TORCH_CHECK(conv_state.is_contiguous() && conv_state.size(1) == c && conv_state.size(2) == keep &&
              conv_state.scalar_type() == x.scalar_type() && k >= 2 && k <= 8, "gdn_conv_prefill: states of its layer");
  auto xc = x.contiguous(), wc = conv_weight.to(at::kFloat).t().contiguous();  // [K, C]
  auto out = at::empty({n, c}, xc.options());
  XSERV_DISPATCH(x.scalar_type(), [&] {
    const T* px = xc.data_ptr<T>();
    const float* pw = wc.data_ptr<float>();
    T* st = conv_state.data_ptr<T>() + slot * c * keep;
    T* po = out.data_ptr<T>();
    // the K-1 inputs before the chunk, as rows [K-1, C]
    std::vector<float> before(keep * c);
    for (int64_t ch = 0; ch < c; ++ch)
      for (int64_t j = 0; j < keep; ++j) before[j * c + ch] = static_cast<float>(st[ch * keep + j]);
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(c);
      for (int64_t t = begin; t < end; ++t) {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t j = 0; j < k; ++j) {  // input t + j - (K-1) times tap j
          const int64_t src = t + j - keep;
          const float* w = pw + j * c;
          if (src >= 0) {
            const T* row = px + src * c;
            int64_t ch = 0;
            for (; ch + 16 <= c; ch += 16) store16(acc.data() + ch, load16(acc.data() + ch) + load16(row + ch) * load16(w + ch));
            for (; ch < c; ++ch) acc[ch] += ld(row, ch) * w[ch];
          } else {
            const float* row = before.data() + (src + keep) * c;
            for (int64_t ch = 0; ch < c; ++ch) acc[ch] += row[ch] * w[ch];
          }
        }
        T* o = po + t * c;
        int64_t ch = 0;
        for (; ch + 16 <= c; ch += 16) {
          const f32x16 a = rnd16<T>(load16(acc.data() + ch));
          store16(o + ch, a / (1.f + exp16(-a)));
        }
        for (; ch < c; ++ch) {
          const float a = rnd<T>(acc[ch]);
          o[ch] = static_cast<T>(a / (1.f + std::exp(-a)));
        }
      }
    });
    for (int64_t j = 0; j < keep; ++j) {  // the new state: the last K-1 of (before, x)
      const int64_t src = n - keep + j;
      for (int64_t ch = 0; ch < c; ++ch)
        st[ch * keep + j] = src >= 0 ? px[src * c + ch] : static_cast<T>(before[(src + keep) * c + ch]);
    }
  });
  return out;
}

// The Gated DeltaNet's output norm per row of D: rmsnorm(o) * w * silu(z), o and z [N, D] of the
// dtype, as GatedDeltaNet._gated_norm (normalized in fp32, scaled by w in the dtype, gated in fp32)
at::Tensor gated_rms_norm(const at::Tensor& o, const at::Tensor& z, const at::Tensor& w, double eps) {
  const int64_t d = w.size(0), rows = o.numel() / d;
  TORCH_CHECK(z.numel() == o.numel() && o.scalar_type() == z.scalar_type(), "gated_rms_norm: o and z alike");
  auto oc = o.contiguous(), zc = z.contiguous(), wc = w.to(o.scalar_type()).contiguous();
  auto out = at::empty({rows, d}, oc.options());
  XSERV_DISPATCH(o.scalar_type(), [&] {
    const T *px = oc.data_ptr<T>(), *pz = zc.data_ptr<T>(), *pw = wc.data_ptr<T>();
    T* py = out.data_ptr<T>();
    at::parallel_for(0, rows, grain(d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T *x = px + r * d, *zr = pz + r * d;
        float ss = 0.f;
        for (int64_t j = 0; j < d; ++j) ss += ld(x, j) * ld(x, j);
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + static_cast<float>(eps));
        for (int64_t j = 0; j < d; ++j) {
          const float zj = ld(zr, j);
          const float scaled = rnd<T>(ld(pw, j) * rnd<T>(ld(x, j) * inv));
          py[r * d + j] = static_cast<T>(scaled * (zj / (1.f + std::exp(-zj))));
        }
      }
    });
  });
  return out;
}
}  // namespace

TORCH_LIBRARY(xserv_cpu, m) {
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()", &apply_token_bitmask);
  m.def("count_allowed(Tensor bitmask) -> Tensor", &count_allowed);
  m.def("argmax_rows(Tensor logits) -> Tensor", &argmax_rows);
  m.def("allowed_ids(Tensor bitmask, Tensor rows, int vocab) -> (Tensor, Tensor)", &allowed_ids);
  m.def("has_vnni() -> bool", &has_vnni);
  m.def("int8_pack(Tensor w) -> (Tensor, Tensor)", &int8_pack);
  m.def("int8_linear(Tensor x, Tensor packed, Tensor comp, Tensor w_scale, int n) -> Tensor", &int8_linear);
  m.def("has_bf16_linear() -> bool", &has_bf16_linear);
  m.def("bf16_pack(Tensor w) -> Tensor", &bf16_pack);
  m.def("bf16_linear(Tensor x, Tensor packed, int n) -> Tensor", &bf16_linear);
  m.def("int4_pack(Tensor qweight, Tensor scales, Tensor zeros, int group_size) -> (Tensor, Tensor, Tensor)",
        &int4_pack);
  m.def("int4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor zeros, int n) -> Tensor", &int4_linear);
  m.def("add_rms_norm(Tensor residual, Tensor delta, Tensor w, float eps) -> (Tensor, Tensor)", &add_rms_norm);
  m.def("silu_and_mul(Tensor x) -> Tensor", &silu_and_mul);
  m.def("qk_norm_rope(Tensor qkv, Tensor weight, Tensor cos, Tensor signed_sin, Tensor positions, float eps, "
        "int heads) -> Tensor", &qk_norm_rope);
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping, int block_size) "
        "-> ()", &write_kv);
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "int block_size, float scale) -> Tensor", &decode_attention);
  m.def("causal_softmax(Tensor(a!) scores, float scale, int chunk, int first) -> ()", &causal_softmax);
  m.def("vision_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor", &vision_attention);
  m.def("moe_experts(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor order, Tensor counts) -> Tensor",
        &moe_experts);
  m.def("moe_experts_int8(Tensor x, Tensor p13, Tensor c13, Tensor s13, Tensor p2, Tensor c2, Tensor s2, "
        "Tensor topk_weights, Tensor order, Tensor counts) -> Tensor", &moe_experts_int8);
  m.def("moe_experts_int4(Tensor x, Tensor q13, Tensor s13, Tensor z13, Tensor q2, Tensor s2, Tensor z2, "
        "Tensor topk_weights, Tensor order, Tensor counts) -> Tensor", &moe_experts_int4);
  m.def("gdn_decode(Tensor mixed, Tensor g, Tensor beta, Tensor(a!) conv_state, Tensor conv_weight, "
        "Tensor(b!) ssm_state, Tensor slots, int num_key_heads) -> Tensor", &gdn_decode);
  m.def("gated_rms_norm(Tensor o, Tensor z, Tensor w, float eps) -> Tensor", &gated_rms_norm);
  m.def("gdn_conv_prefill(Tensor x, Tensor(a!) conv_state, Tensor conv_weight, int slot) -> Tensor", &gdn_conv_prefill);
}
