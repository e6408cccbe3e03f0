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

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define XSERV_VNNI 1
#else
#define XSERV_VNNI 0
#endif

namespace {

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

// Each token's row of x -> uint8 (int8 + 128, K rounded up to 4, padding 128: zero) and its scale.
template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, int64_t k4, uint8_t* q, float* scales) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * k;
      float amax = 0.f;
      for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(to_float(row[i])));
      float scale = amax > 0.f ? amax / 127.f : 1.f;
      uint8_t* out = q + r * k4;
      for (int64_t i = 0; i < k; ++i) {  // x / scale, not x * (1 / scale): the torch op's rounding
        float v = std::nearbyint(to_float(row[i]) / scale);
        out[i] = static_cast<uint8_t>(static_cast<int32_t>(std::max(-127.f, std::min(127.f, v))) + 128);
      }
      for (int64_t i = k; i < k4; ++i) out[i] = 128;
      scales[r] = scale;
    }
  });
}

#if XSERV_VNNI
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

// One tile: MB tokens x NV blocks of 16 channels, over the whole K.
template <int MB, int NV, typename T>
inline void tile(const uint8_t* xq, int64_t k4, const float* xs, const int8_t* w, const int32_t* comp,
                 const float* wscale, int64_t n, int64_t n0, T* y, int64_t ldy) {
  __m512i acc[MB][NV];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_si512();
  const int64_t block_bytes = k4 * BLOCK;
  for (int64_t kk = 0; kk < k4 / 4; ++kk) {
    __m512i wv[NV];
    for (int j = 0; j < NV; ++j) wv[j] = _mm512_loadu_si512(w + j * block_bytes + kk * 64);
    for (int i = 0; i < MB; ++i) {
      int32_t four;
      std::memcpy(&four, xq + i * k4 + kk * 4, 4);
      __m512i xb = _mm512_set1_epi32(four);
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], xb, wv[j]);
    }
  }
  for (int j = 0; j < NV; ++j) {
    const int64_t c0 = n0 + j * BLOCK;
    if (c0 >= n) break;
    const __mmask16 mask = n - c0 >= BLOCK ? (__mmask16)0xffff : (__mmask16)((1u << (n - c0)) - 1);
    __m512i cv = _mm512_loadu_si512(comp + c0);
    __m512 sv = _mm512_maskz_loadu_ps(mask, wscale + c0);
    for (int i = 0; i < MB; ++i) {
      __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][j], cv));
      v = _mm512_mul_ps(v, _mm512_mul_ps(sv, _mm512_set1_ps(xs[i])));
      store16(y + i * ldy + c0, v, mask);
    }
  }
}

template <int NV, typename T>
void tokens_tiles(const uint8_t* xq, int64_t rows, int64_t k4, const float* xs, const int8_t* w,
                  const int32_t* comp, const float* wscale, int64_t n, int64_t n0, T* y) {
  int64_t b = 0;
  for (; b + TOKENS <= rows; b += TOKENS)
    tile<TOKENS, NV>(xq + b * k4, k4, xs + b, w, comp, wscale, n, n0, y + b * n, n);
  switch (rows - b) {
    case 5: tile<5, NV>(xq + b * k4, k4, xs + b, w, comp, wscale, n, n0, y + b * n, n); break;
    case 4: tile<4, NV>(xq + b * k4, k4, xs + b, w, comp, wscale, n, n0, y + b * n, n); break;
    case 3: tile<3, NV>(xq + b * k4, k4, xs + b, w, comp, wscale, n, n0, y + b * n, n); break;
    case 2: tile<2, NV>(xq + b * k4, k4, xs + b, w, comp, wscale, n, n0, y + b * n, n); break;
    case 1: tile<1, NV>(xq + b * k4, k4, xs + b, w, comp, wscale, n, n0, y + b * n, n); break;
    default: break;
  }
}

template <typename T>
void int8_matmul(const uint8_t* xq, int64_t rows, int64_t k4, const float* xs, const int8_t* w,
                 const int32_t* comp, const float* wscale, int64_t n, T* y) {
  const int64_t blocks = padded(n, BLOCK) / BLOCK, groups = (blocks + GROUP - 1) / GROUP;
  const int64_t block_bytes = k4 * BLOCK;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t first = g * GROUP, count = std::min(GROUP, blocks - first);
      const int8_t* wg = w + first * block_bytes;
      if (count == GROUP) {
        tokens_tiles<GROUP>(xq, rows, k4, xs, wg, comp, wscale, n, first * BLOCK, y);
      } else {
        for (int64_t j = 0; j < count; ++j)
          tokens_tiles<1>(xq, rows, k4, xs, wg + j * block_bytes, comp, wscale, n, (first + j) * BLOCK, y);
      }
    }
  });
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
    int8_matmul(xq.data_ptr<uint8_t>(), rows, k4, xs.data_ptr<float>(), packed.data_ptr<int8_t>(),
                comp.data_ptr<int32_t>(), w_scale.data_ptr<float>(), n, y.data_ptr<at::BFloat16>());
  } else {
    quantize_rows(xc.data_ptr<float>(), rows, k, k4, xq.data_ptr<uint8_t>(), xs.data_ptr<float>());
    int8_matmul(xq.data_ptr<uint8_t>(), rows, k4, xs.data_ptr<float>(), packed.data_ptr<int8_t>(),
                comp.data_ptr<int32_t>(), w_scale.data_ptr<float>(), n, y.data_ptr<float>());
  }
#endif
  return y;
}


// ---- the small operations of a forward (layers/ops.py), in the torch path's numerics: fp32
// arithmetic, rounded to the model's dtype wherever the torch path stores a tensor in it ----

template <typename T> inline float ld(const T* p, int64_t i) { return static_cast<float>(p[i]); }
template <typename T> inline float rnd(float f) { return static_cast<float>(static_cast<T>(f)); }

// out = w * rnd(x / rms(x)) over rows of n, as layers/layernorm.rms_norm
template <typename T>
inline void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += ld(x, i) * ld(x, i);
  const float inv = 1.f / std::sqrt(ss / n + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(ld(w, i) * rnd<T>(ld(x, i) * inv));
}

#define XSERV_DISPATCH(dtype, ...)                                  \
  [&] {                                                             \
    if ((dtype) == at::kBFloat16) { using T = at::BFloat16; return __VA_ARGS__(); } \
    TORCH_CHECK((dtype) == at::kFloat, "xserv_cpu: bfloat16 or float32 tensors"); \
    using T = float; return __VA_ARGS__();                          \
  }()

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
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        for (int64_t i = 0; i < n; ++i) ph[r * n + i] = static_cast<T>(ld(pr, r * n + i) + ld(pd, r * n + i));
        norm_row(ph + r * n, pw, po + r * n, n, (float)eps);
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
    at::parallel_for(0, rows, 8, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        for (int64_t i = 0; i < half; ++i) {
          const float g = ld(px, r * two + i);
          po[r * half + i] = static_cast<T>(rnd<T>(g / (1.f + std::exp(-g))) * ld(px, r * two + half + i));
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
  const int64_t t = qkv.size(0), d = weight.size(1), width = qkv.size(1);
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
    at::parallel_for(0, t * heads, 16, [&](int64_t b, int64_t e) {
      T normed[1024];
      for (int64_t i = b; i < e; ++i) {
        const int64_t row = i / heads, h = i % heads;
        norm_row(px + row * width + h * d, pw + h * d, normed, d, (float)eps);
        const float *c = pc + pp[row] * d, *s = ps + pp[row] * d;
        T* o = po + i * d;
        for (int64_t j = 0; j < d; ++j) {
          const float r = static_cast<float>(normed[(j + d / 2) % d]);
          o[j] = static_cast<T>(rnd<T>(static_cast<float>(normed[j]) * rnd<T>(c[j])) + rnd<T>(r * rnd<T>(s[j])));
        }
      }
    });
  });
  return out;
}

// One query per sequence over its paged context, in the torch backend's cache layout (keys
// [Hkv, blocks, D, bs]: transposed inside a block; values [Hkv, slots, D]): q [B, Hq, D] (GQA:
// Hq / Hkv query heads per KV head) -> [B, Hq, D]. Scores and probabilities rounded to the dtype
// as the torch path's embedding_bag sums are; softmax in float32.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                            double scale) {
  const int64_t batch = q.size(0), hq = q.size(1), d = q.size(2), hkv = k_cache.size(0), slots = k_cache.size(1);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == q.scalar_type(),
              "decode_attention: contiguous caches in q's dtype");
  TORCH_CHECK(hq % hkv == 0 && k_cache.size(2) == d, "decode_attention: head counts and head_dim");
  auto qc = q.contiguous();
  auto tables = block_tables.to(at::kInt).contiguous(), lens = context_lens.to(at::kInt).contiguous();
  const int64_t nb = tables.size(1), group = hq / hkv, width = nb * block_size;
  auto out = at::empty_like(qc);
  XSERV_DISPATCH(q.scalar_type(), [&] {
    const T *pq = qc.data_ptr<T>(), *pk = k_cache.data_ptr<T>(), *pv = v_cache.data_ptr<T>();
    const int32_t *pt = tables.data_ptr<int32_t>(), *pl = lens.data_ptr<int32_t>();
    T* po = out.data_ptr<T>();
    at::parallel_for(0, batch * hq, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> sc(width), qs(d), acc(d);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / hq, h = i % hq, ctx = pl[b];
        const T* kbase = pk + (h / group) * slots * d;
        const T* vbase = pv + (h / group) * slots * d;
        const int32_t* table = pt + b * nb;
        for (int64_t j = 0; j < d; ++j) qs[j] = rnd<T>(ld(pq, i * d + j) * (float)scale);
        float mx = -INFINITY;
        for (int64_t blk = 0; blk * block_size < ctx; ++blk) {
          const int64_t n = std::min(block_size, ctx - blk * block_size);
          const T* k = kbase + (int64_t)table[blk] * d * block_size;
          float* s = sc.data() + blk * block_size;
          for (int64_t x = 0; x < n; ++x) s[x] = 0.f;
          for (int64_t j = 0; j < d; ++j) {
            const float qj = qs[j];
            const T* kj = k + j * block_size;
            for (int64_t x = 0; x < n; ++x) s[x] += qj * ld(kj, x);
          }
          for (int64_t x = 0; x < n; ++x) {
            s[x] = rnd<T>(s[x]);
            mx = std::max(mx, s[x]);
          }
        }
        float sum = 0.f;
        for (int64_t x = 0; x < ctx; ++x) {
          sc[x] = std::exp(sc[x] - mx);
          sum += sc[x];
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t x = 0; x < ctx; ++x) {
          const float p = rnd<T>(sc[x] / sum);
          const T* vr = vbase + ((int64_t)table[x / block_size] * block_size + x % block_size) * d;
          for (int64_t j = 0; j < d; ++j) acc[j] += p * ld(vr, j);
        }
        for (int64_t j = 0; j < d; ++j) po[i * d + j] = static_cast<T>(acc[j]);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(xserv_cpu, m) {
  m.def("has_vnni() -> bool", &has_vnni);
  m.def("int8_pack(Tensor w) -> (Tensor, Tensor)", &int8_pack);
  m.def("int8_linear(Tensor x, Tensor packed, Tensor comp, Tensor w_scale, int n) -> Tensor", &int8_linear);
  m.def("add_rms_norm(Tensor residual, Tensor delta, Tensor w, float eps) -> (Tensor, Tensor)", &add_rms_norm);
  m.def("silu_and_mul(Tensor x) -> Tensor", &silu_and_mul);
  m.def("qk_norm_rope(Tensor qkv, Tensor weight, Tensor cos, Tensor signed_sin, Tensor positions, float eps, "
        "int heads) -> Tensor", &qk_norm_rope);
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "int block_size, float scale) -> Tensor", &decode_attention);
}
