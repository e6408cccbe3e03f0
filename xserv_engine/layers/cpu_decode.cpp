// A Qwen3 decode step of a few sequences on the CPU, every decoder layer in one call.
//
// Built at engine start by xserv_engine/layers/cpu_decode.py (g++ -O3 -march=native -fopenmp,
// cached per source, compiler and CPU) and called through ctypes. It does what the torch path
// does for a decode-only step - embedding, per layer RMSNorm, the fused q/k/v matmul, per-head
// q/k norm, rotary, the cache write, attention over the paged cache, o_proj, residual, RMSNorm,
// SwiGLU MLP, residual, the final norm and (for the caller's smallest batches) the LM head and the
// next token of plain rows - without ~40 torch ops per layer, each with its own dispatch and
// OpenMP fork.
//
// Numerics follow the torch path: fp32 arithmetic, with the result rounded to the model dtype
// wherever the torch path stores a tensor in it (after each matmul, norm, rotary, residual).
// Only the order of the sums differs, so logits agree to rounding, not bit for bit.
//
// Layouts are the torch attention backend's: k cache [Hkv, blocks, D, block_size] (keys stored
// transposed inside a block), v cache [Hkv, slots, D]; weights [out, in] row-major.
//
// The OpenMP runtime is libgomp (-fopenmp); torch's CPU wheel loads the same soname, so both
// share one thread team per calling thread instead of two teams fighting over the cores.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

typedef uint16_t bf16;

static inline float to_f(float x) { return x; }
static inline float to_f(bf16 x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

template <typename T> static inline T from_f(float f);
template <> inline float from_f<float>(float f) { return f; }
template <> inline bf16 from_f<bf16>(float f) {  // round to nearest even, as torch does
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}
// a float rounded to what T can hold (identity for float)
template <typename T> static inline float rnd(float f) { return to_f(from_f<T>(f)); }
// a matmul's result for a model in T, stored as a float (scratch) or as T (the logits)
template <typename T> static inline void put(float* y, float f) { *y = rnd<T>(f); }
template <typename T> static inline void put(bf16* y, float f) { *y = from_f<bf16>(f); }

extern "C" {

struct Layer {
    const void* input_norm;  // [H]
    const void* qkv;         // [(Hq + 2 Hkv) D, H]
    const void* q_norm;      // [D]
    const void* k_norm;      // [D]
    const void* o;           // [H, Hq D]
    const void* post_norm;   // [H]
    const void* gate_up;     // [2 I, H]
    const void* down;        // [H, I]
    void* k_cache;           // [Hkv, blocks, D, block_size]
    void* v_cache;           // [Hkv, slots, D]
};

struct Model {
    int64_t hidden, intermediate, heads, kv_heads, head_dim, layers, block_size, slots, max_context, vocab;
    float eps, scale;
    const void* embed;       // [V, H]
    const void* lm_head;     // [V, H] (the embedding when tied)
    const void* final_norm;  // [H]
    const float* cos;        // [P, D]
    const float* signed_sin; // [P, D]: the first half negated (rotate_half folded in)
    const Layer* layer;      // [layers]
};

struct Step {
    int64_t batch;
    const int64_t* token_ids;     // [B]
    const int64_t* positions;     // [B]: the new token's position; its context is positions + 1 long
    const int64_t* slots;         // [B]: where its key and value go
    const int32_t* block_tables;  // [B, table_stride]
    int64_t table_stride;
    void* hidden;                 // [B, H] in the model dtype: the final norm's output, when logits is null
    void* logits;                 // [B, V] in the model dtype, or null: the caller runs the LM head
    // with logits: each row's next token, when chosen is not null (Sampler's plain rows: no
    // penalties, biases, logprobs or grammar, a top-k of at most TOP_K_MAX)
    const float* temperature;     // [B]: 0 is greedy
    const float* uniform;         // [B]: the row's draw in [0, 1) (unused when greedy)
    const int32_t* top_k;         // [B]: 0 (none) or 1..TOP_K_MAX
    const float* top_p;           // [B]: 1 (none)
    const float* min_p;           // [B]: 0 (none)
    int64_t* chosen;              // [B]: out
    float* work;                  // cpu_decode_work_floats(model, B) floats
    int32_t threads;
};

static const int64_t SAMPLE_CHUNK = 1024;  // as Sampler's ARGMAX_CHUNK and CDF_CHUNK
static const int64_t TOP_K_MAX = 64;       // top-k rows up to this k sample here (cpu_decode.py says so too)
static int64_t sample_chunks(const Model* m) { return (m->vocab + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK; }

static int64_t row_floats(const Model* m) {
    int64_t qkv = (m->heads + 2 * m->kv_heads) * m->head_dim;
    return 3 * m->hidden + qkv + m->heads * m->head_dim + 3 * m->intermediate + m->heads * m->max_context +
           2 * sample_chunks(m) + 1 + 2 * sample_chunks(m) * TOP_K_MAX + sample_chunks(m) * SAMPLE_CHUNK;
}

static int64_t widest_input(const Model* m) {  // the longest row a matmul multiplies
    int64_t k = m->hidden > m->intermediate ? m->hidden : m->intermediate;
    return k > m->heads * m->head_dim ? k : m->heads * m->head_dim;
}

int64_t cpu_decode_work_floats(const Model* m, int64_t batch) {
    // per batch row: row_floats; then the matmul inputs as bf16 (two per float) for dpbf16
    return batch * row_floats(m) + (batch * widest_input(m) + 1) / 2;
}

}  // extern "C"

// 16 floats as one vector (gcc/clang vector extensions: one AVX-512 register, two AVX2 ones)
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

static inline f32x16 load16(const float* p) {
    f32x16 v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
static inline f32x16 load16(const bf16* p) {
    u16x16 h;
    std::memcpy(&h, p, sizeof h);
    u32x16 u = __builtin_convertvector(h, u32x16) << 16;
    f32x16 v;
    std::memcpy(&v, &u, sizeof v);
    return v;
}

// w . x over K, in four independent vector sums: one sum would wait on its own previous FMA
// every step (the latency, not the memory, then bounds a matvec)
template <typename T>
static inline float dot(const T* w, const float* x, int64_t K) {
    f32x16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        a0 += load16(w + k) * load16(x + k);
        a1 += load16(w + k + 16) * load16(x + k + 16);
        a2 += load16(w + k + 32) * load16(x + k + 32);
        a3 += load16(w + k + 48) * load16(x + k + 48);
    }
    for (; k + 16 <= K; k += 16) a0 += load16(w + k) * load16(x + k);
    f32x16 a = (a0 + a1) + (a2 + a3);
    float sum = 0.f;
    for (int i = 0; i < 16; i++) sum += a[i];
    for (; k < K; k++) sum += to_f(w[k]) * x[k];
    return sum;
}

// The rows [0, N) of a matmul, split over the team (call inside it) in chunks of ~64 KB of weights
// that a thread takes when it is free: on a machine whose cores also run the server (the REST
// front, the gRPC loop), a thread the OS pauses then delays the step by one chunk, where an even
// split (oneDNN's, `schedule(static)`) makes the other thread wait out the whole pause.
template <typename T, typename F>
static inline void for_rows(int64_t N, int64_t K, F&& row) {
    const int64_t chunk = (64 << 10) / (K * (int64_t)sizeof(T)) + 1;
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < N; c += chunk)
        for (int64_t n = c; n < N && n < c + chunk; n++) row(n);
}

// y[b, n] = W[n, :] . x[b, :] for n in [0, N), rounded to T (put); a weight row is read from
// memory once, then from L1 for the other rows of x. `packed` is scratch for B * K bf16 values.
template <typename T, typename O>
static void matvec(const T* W, const float* x, int64_t xs, O* y, int64_t ys, int64_t B, int64_t N, int64_t K,
                   bf16* packed) {
    (void)packed;
    for_rows<T>(N, K, [&](int64_t n) {
        for (int64_t b = 0; b < B; b++) put<T>(y + b * ys + n, dot(W + n * K, x + b * xs, K));
    });
}

#if defined(__AVX512BF16__)
// With AVX512-BF16 (Zen 4, Sapphire Rapids): vdpbf16ps multiplies 32 bf16 pairs per instruction,
// the instruction oneDNN's bf16 matmuls use. Widening bf16 to float in software first, as dot()
// does, caps a core at ~15 G multiply-adds/s, which a batch of 2 already hits. The inputs are
// bf16 values held in floats (rounded after every op), so taking their top half is exact.
// NB rows of x against one weight row, U independent sums per row of x: every vdpbf16ps waits
// on its accumulator's previous one (~6 cycles), so fewer than ~4 chains leave the core idle.
template <int NB, int U, typename O>
static inline void dot_rows(const bf16* w, const bf16* x, int64_t K, O* y, int64_t ys) {
    __m512 acc[NB][U];
    for (int b = 0; b < NB; b++)
        for (int u = 0; u < U; u++) acc[b][u] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 * U <= K; k += 32 * U) {
        for (int u = 0; u < U; u++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k + 32 * u);
            for (int b = 0; b < NB; b++)
                acc[b][u] = _mm512_dpbf16_ps(acc[b][u], wv, (__m512bh)_mm512_loadu_si512(x + b * K + k + 32 * u));
        }
    }
    for (; k + 32 <= K; k += 32) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k);
        for (int b = 0; b < NB; b++)
            acc[b][0] = _mm512_dpbf16_ps(acc[b][0], wv, (__m512bh)_mm512_loadu_si512(x + b * K + k));
    }
    for (int b = 0; b < NB; b++) {
        __m512 a = acc[b][0];
        for (int u = 1; u < U; u++) a = _mm512_add_ps(a, acc[b][u]);
        float sum = _mm512_reduce_add_ps(a);
        for (int64_t j = k; j < K; j++) sum += to_f(w[j]) * to_f(x[b * K + j]);
        put<bf16>(y + b * ys, sum);
    }
}

template <typename O>
static void matvec(const bf16* W, const float* x, int64_t xs, O* y, int64_t ys, int64_t B, int64_t N, int64_t K,
                   bf16* packed) {
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; b++)
        for (int64_t k = 0; k < K; k++) packed[b * K + k] = from_f<bf16>(x[b * xs + k]);
    for_rows<bf16>(N, K, [&](int64_t n) {
        const bf16* w = W + n * K;
        for (int64_t b0 = 0; b0 < B; b0 += 8) {  // at most 8 rows of x at a time (registers)
            const bf16* xb = packed + b0 * K;
            O* yb = y + b0 * ys + n;
            switch (B - b0 < 8 ? B - b0 : 8) {
                case 1: dot_rows<1, 4>(w, xb, K, yb, ys); break;
                case 2: dot_rows<2, 2>(w, xb, K, yb, ys); break;
                case 3: dot_rows<3, 2>(w, xb, K, yb, ys); break;
                case 4: dot_rows<4, 1>(w, xb, K, yb, ys); break;
                case 5: dot_rows<5, 1>(w, xb, K, yb, ys); break;
                case 6: dot_rows<6, 1>(w, xb, K, yb, ys); break;
                case 7: dot_rows<7, 1>(w, xb, K, yb, ys); break;
                default: dot_rows<8, 1>(w, xb, K, yb, ys); break;
            }
        }
    });
}
#endif

// out = rnd(weight * rnd(x / rms(x))), as xserv_engine.layers.layernorm.rms_norm
template <typename T>
static void rms_norm(const float* x, const T* weight, float* out, int64_t n, float eps) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float inv = 1.f / std::sqrt(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = rnd<T>(to_f(weight[i]) * rnd<T>(x[i] * inv));
}

struct Candidate {  // a top-k row's logit and its id
    float value;
    int32_t id;
};

// The scratch of one call, per batch row (floats):
// x [H] | xn [H] | tmp [H] | qkv [(Hq + 2 Hkv) D] | attn [Hq D] | gu [2 I] | act [I] | scores [Hq, W]
// | the sampler's per-chunk maxima [C] and sums [C], the row's max [1], top-k candidates [C, k]
// and, for a top-p row without a top-k, its weights [C * SAMPLE_CHUNK]
struct Work {
    float* base;
    int64_t stride, H, I, NQKV, QD, S, C;
    float* x(int64_t b) const { return base + b * stride; }  // the residual stream
    float* xn(int64_t b) const { return x(b) + H; }          // its norm: a matmul's input
    float* tmp(int64_t b) const { return x(b) + 2 * H; }     // a matmul's output, added to x
    float* qkv(int64_t b) const { return x(b) + 3 * H; }
    float* attn(int64_t b) const { return qkv(b) + NQKV; }
    float* gu(int64_t b) const { return attn(b) + QD; }
    float* act(int64_t b) const { return gu(b) + 2 * I; }
    float* scores(int64_t b) const { return act(b) + I; }
    float* chunk_max(int64_t b) const { return scores(b) + S; }
    float* chunk_sum(int64_t b) const { return chunk_max(b) + C; }
    float* row_max(int64_t b) const { return chunk_sum(b) + C; }
    Candidate* candidates(int64_t b) const { return (Candidate*)(row_max(b) + 1); }
    float* weights(int64_t b) const { return row_max(b) + 1 + 2 * C * TOP_K_MAX; }
};

// Per q and k head of every row: its RMSNorm, then rotary; q scaled by 1/sqrt(D), k and v
// written to the cache at the row's slot.
template <typename T>
static void qk_norm_rotary_store(const Model* m, const Step* s, const Layer& L, const Work& w) {
    const int64_t D = m->head_dim, Hq = m->heads, Hkv = m->kv_heads, bs = m->block_size;
#pragma omp for collapse(2)
    for (int64_t b = 0; b < s->batch; b++) {
        for (int64_t h = 0; h < Hq + Hkv; h++) {
            float* v = w.qkv(b) + h * D;
            float normed[1024];  // head_dim <= 1024 (checked by the caller)
            rms_norm(v, (const T*)(h < Hq ? L.q_norm : L.k_norm), normed, D, m->eps);
            const float* c = m->cos + s->positions[b] * D;
            const float* sn = m->signed_sin + s->positions[b] * D;
            for (int64_t d = 0; d < D; d++) {
                float r = normed[(d + D / 2) % D];
                v[d] = rnd<T>(rnd<T>(normed[d] * rnd<T>(c[d])) + rnd<T>(r * rnd<T>(sn[d])));
            }
            if (h < Hq) {
                for (int64_t d = 0; d < D; d++) v[d] = rnd<T>(v[d] * m->scale);
                continue;
            }
            const int64_t kh = h - Hq, slot = s->slots[b];
            T* kc = (T*)L.k_cache + kh * m->slots * D + (slot / bs) * D * bs + slot % bs;
            T* vc = (T*)L.v_cache + kh * m->slots * D + slot * D;
            const float* vv = w.qkv(b) + (Hq + Hkv + kh) * D;
            for (int64_t d = 0; d < D; d++) {
                kc[d * bs] = from_f<T>(v[d]);
                vc[d] = from_f<T>(vv[d]);
            }
        }
    }
}

// One query head over its sequence's context in the paged cache: out [D] = softmax(q . K) V,
// scores rounded to T as the torch path's (scratch: sc [context])
template <typename T>
static void attend_head(const Model* m, const T* kbase, const T* vbase, const int32_t* table, int64_t ctx,
                        const float* q, float* sc, float* out) {
    const int64_t D = m->head_dim, bs = m->block_size;
    float mx = -INFINITY;
    for (int64_t j = 0; j * bs < ctx; j++) {
        const int64_t n = ctx - j * bs < bs ? ctx - j * bs : bs;
        const T* k = kbase + (int64_t)table[j] * D * bs;  // [D, bs]: keys stored transposed
        float* sj = sc + j * bs;
        for (int64_t t = 0; t < n; t++) sj[t] = 0.f;
        for (int64_t d = 0; d < D; d++) {
            const float qd = q[d];
            const T* kd = k + d * bs;
#pragma omp simd
            for (int64_t t = 0; t < n; t++) sj[t] += qd * to_f(kd[t]);
        }
        for (int64_t t = 0; t < n; t++) {
            sj[t] = rnd<T>(sj[t]);
            mx = sj[t] > mx ? sj[t] : mx;
        }
    }
    float sum = 0.f;
    for (int64_t t = 0; t < ctx; t++) {
        sc[t] = std::exp(sc[t] - mx);
        sum += sc[t];
    }
    for (int64_t d = 0; d < D; d++) out[d] = 0.f;
    for (int64_t t = 0; t < ctx; t++) {
        const float p = rnd<T>(sc[t] / sum);
        const T* vr = vbase + ((int64_t)table[t / bs] * bs + t % bs) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) out[d] += p * to_f(vr[d]);
    }
    for (int64_t d = 0; d < D; d++) out[d] = rnd<T>(out[d]);
}

template <typename T>
static void attend(const Model* m, const Step* s, const Layer& L, const Work& w) {
    const int64_t D = m->head_dim, G = m->heads / m->kv_heads;
#pragma omp for collapse(2)
    for (int64_t b = 0; b < s->batch; b++) {
        for (int64_t h = 0; h < m->heads; h++) {
            const int64_t kv = (h / G) * m->slots * D;  // the head's KV head, GQA
            attend_head(m, (const T*)L.k_cache + kv, (const T*)L.v_cache + kv, s->block_tables + b * s->table_stride,
                        s->positions[b] + 1, w.qkv(b) + h * D, w.scores(b) + h * m->max_context, w.attn(b) + h * D);
        }
    }
}

// x += tmp (the residual), then xn = norm(x) when a norm weight is given
template <typename T>
static void add_and_norm(const Step* s, const Work& w, const T* norm, float eps) {
#pragma omp for
    for (int64_t b = 0; b < s->batch; b++) {
        for (int64_t i = 0; i < w.H; i++) w.x(b)[i] = rnd<T>(w.x(b)[i] + w.tmp(b)[i]);
        if (norm) rms_norm(w.x(b), norm, w.xn(b), w.H, eps);
    }
}

// act = silu(gate) * up, with gate and up side by side in gu
template <typename T>
static void swiglu(const Step* s, const Work& w) {
#pragma omp for collapse(2)
    for (int64_t b = 0; b < s->batch; b++) {
        for (int64_t i = 0; i < w.I; i++) {
            const float g = w.gu(b)[i];
            w.act(b)[i] = rnd<T>(rnd<T>(g / (1.f + std::exp(-g))) * w.gu(b)[w.I + i]);
        }
    }
}

// exp(x) for x <= 0 (a logit minus its row's max), 16 at a time: 2^n p(r) with r = x - n ln 2,
// |r| <= ln 2 / 2, p Taylor's to r^6 (relative error ~1e-7, what torch's exp gives to ~1 ulp);
// 0 below -87, where a float's exp is a subnormal or 0
static inline f32x16 exp16(f32x16 x) {
    typedef int32_t i32x16 __attribute__((vector_size(64)));
    const f32x16 zero = {}, floor_ = zero - 87.f;
    const auto tiny = x < floor_;
    x = tiny ? floor_ : x;
    const f32x16 magic = zero + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
    const f32x16 n = (x * 1.44269504f + magic) - magic;
    const f32x16 r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
    f32x16 p = zero + (1.f / 720);
    p = p * r + (1.f / 120);
    p = p * r + (1.f / 24);
    p = p * r + (1.f / 6);
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const i32x16 bits = (__builtin_convertvector(n, i32x16) + 127) << 23;
    f32x16 scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return tiny ? zero : p * scale;
}

// logit i of row b divided by its temperature (none when greedy or 1, as Sampler._sample)
template <typename T>
static inline float scaled(const T* row, int64_t i, float t) {
    return t == 0.f || t == 1.f ? to_f(row[i]) : to_f(row[i]) / t;
}

// weight[i] = exp(logit / t - mx) of the n logits from i0 (n <= SAMPLE_CHUNK, padded to 16),
// 0 below the row's min-p (relative to its top token, whose weight is 1: Sampler._sample)
template <typename T>
static inline void chunk_weights(const T* row, int64_t i0, int64_t n, float t, float mx, float min_p, float* weight) {
    float x[SAMPLE_CHUNK];
    for (int64_t i = 0; i < n; i++) x[i] = scaled(row, i0 + i, t) - mx;
    for (int64_t i = n; i < (n + 15) / 16 * 16; i++) x[i] = -INFINITY;
    const f32x16 zero = {}, floor_ = zero + min_p;
    for (int64_t i = 0; i < n; i += 16) {
        f32x16 e = exp16(load16(x + i));
        e = e < floor_ ? zero : e;
        std::memcpy(weight + i, &e, sizeof e);
    }
}

// The first index whose running sum of weight[0, n) passes u * its total, never one of weight 0
// (Sampler.inverse_cdf over one chunk: just below the total at most)
static inline int64_t draw(const float* weight, int64_t n, float target) {
    float last = 0.f;  // the running sum rounds differently from a sum taken apart: stay below it
    for (int64_t i = 0; i < n; i++) last += weight[i];
    const float inside = std::fmin(std::fmax(target, 0.f), std::nextafter(last, 0.f));
    float run = 0.f;
    int64_t i = 0;
    while (i + 1 < n && (run += weight[i]) <= inside) i++;
    return i;
}

// larger first; equal values in vocabulary order
static inline bool before(const Candidate& a, const Candidate& b) {
    return a.value > b.value || (a.value == b.value && a.id < b.id);
}

// A top-k row (k <= TOP_K_MAX) from its chunks' own top k (cands [C, k]): the row's k best
// logits in vocabulary order, weights exp(x - max), min-p, then top-p over them (the most likely
// tokens whose mass before them is at most p, Sampler._apply_top_p), then the draw at u
static int64_t pick_top_k(const Candidate* cands, int64_t C, int64_t k, float min_p, float top_p, float u) {
    Candidate best[TOP_K_MAX];
    int64_t n = 0;
    for (int64_t j = 0; j < C * k; j++) {  // keep the k best seen so far, sorted
        const Candidate c = cands[j];
        if (c.id < 0 || (n == k && !before(c, best[k - 1]))) continue;
        int64_t at = n < k ? n++ : k - 1;
        while (at > 0 && before(c, best[at - 1])) {
            best[at] = best[at - 1];
            at--;
        }
        best[at] = c;
    }
    if (n == 0) return 0;  // no comparable logit (NaNs): a valid id, as the greedy scan gives
    float weight[TOP_K_MAX];
    double total = 0.0;
    for (int64_t i = 0; i < n; i++) {
        weight[i] = std::exp(best[i].value - best[0].value);
        if (weight[i] < min_p) weight[i] = 0.f;
        total += weight[i];
    }
    if (top_p < 1.f) {  // best is sorted most likely first, ties in vocabulary order
        double mass = 0.0;
        for (int64_t i = 0; i < n; i++) {
            const double prob = weight[i] / total;
            if (mass > top_p) weight[i] = 0.f;
            mass += prob;
        }
    }
    // the draw runs over the candidates in vocabulary order, as over the full row masked to them
    int64_t order[TOP_K_MAX];
    for (int64_t i = 0; i < n; i++) order[i] = i;
    for (int64_t i = 1; i < n; i++)
        for (int64_t j = i; j > 0 && best[order[j]].id < best[order[j - 1]].id; j--) std::swap(order[j], order[j - 1]);
    float sorted[TOP_K_MAX];
    float sum = 0.f;
    for (int64_t i = 0; i < n; i++) sum += sorted[i] = weight[order[i]];
    return best[order[draw(sorted, n, std::fmin(u * sum, std::nextafter(sum, 0.f)))]].id;
}

// A top-p row without a top-k, from its weights [V] (exp(x - max) after min-p): the nucleus - the
// most likely tokens whose mass before them is at most p of the total, equal weights in
// vocabulary order (Sampler._apply_top_p) - then the draw at u over it in vocabulary order. The
// nucleus is found without sorting the vocabulary: the weights' float bits bin them (sign,
// exponent and 4 mantissa bits: 16 bins per octave), the bins from the top add up to the one the
// boundary falls in; that bin's tokens are binned again by their next 12 bits, and only the
// tokens of the sub-bin the boundary falls in are sorted. The last kept token in that order
// (w*, i*) says it all: token i is kept when w_i > w*, or w_i == w* and i <= i*.
static int64_t pick_top_p(const float* weight, int64_t V, float top_p, float u, Candidate* scratch, int64_t room) {
    static const int BINS = 2048, SHIFT = 19;  // weights are in [0, 1]: 1.0f's bits >> 19 is 2032
    static const int SUB_BINS = 4096, SUB_SHIFT = SHIFT - 12;
    auto bits_of = [](float x) {
        uint32_t bits;
        std::memcpy(&bits, &x, sizeof bits);
        return bits;
    };
    double mass[SUB_BINS];
    int64_t count[SUB_BINS];
    std::fill(mass, mass + BINS, 0.0);
    std::fill(count, count + BINS, 0);
    double total = 0.0;
    for (int64_t i = 0; i < V; i++) {
        const float x = weight[i];
        const uint32_t key = bits_of(x) >> SHIFT;
        if (!(x > 0.f) || key >= (uint32_t)BINS) continue;  // 0 (below min-p, or underflow) or NaN
        mass[key] += x;
        count[key]++;
        total += x;
    }
    if (total == 0.0) return 0;  // no comparable logit (NaNs): a valid id, as pick_top_k
    const double limit = (double)top_p * total;
    double above = 0.0;  // the mass of the tokens above the boundary's bin: all kept
    int at = BINS - 1;
    while (at > 0 && above + mass[at] <= limit) above += mass[at--];
    const int64_t in_bin = count[at];
    // the row's unused top-k scratch holds it, unless it is a large part of the vocabulary
    Candidate* bin = in_bin <= room ? scratch : new Candidate[in_bin];
    int64_t n = 0;
    for (int64_t i0 = 0; i0 < V && n < in_bin; i0 += 16) {  // 16 at a time: most blocks hold none
        if (i0 + 16 <= V) {
            u32x16 bits;
            std::memcpy(&bits, weight + i0, sizeof bits);
            const auto hit = (bits >> SHIFT) == (uint32_t)at;
            uint32_t any = 0;
            for (int k = 0; k < 16; k++) any |= hit[k];
            if (!any) continue;
        }
        for (int64_t i = i0; i < V && i < i0 + 16; i++) {
            const float x = weight[i];
            if (x > 0.f && (int)(bits_of(x) >> SHIFT) == at) bin[n++] = {x, (int32_t)i};
        }
    }
    // the same again inside the bin, by the next 12 bits (the candidates are in vocabulary order)
    std::fill(mass, mass + SUB_BINS, 0.0);
    std::fill(count, count + SUB_BINS, 0);
    for (int64_t j = 0; j < n; j++) {
        const uint32_t key = (bits_of(bin[j].value) >> SUB_SHIFT) & (SUB_BINS - 1);
        mass[key] += bin[j].value;
        count[key]++;
    }
    int sub = SUB_BINS - 1;
    while (sub > 0 && above + mass[sub] <= limit) above += mass[sub--];
    int64_t m = 0;
    for (int64_t j = 0; j < n; j++)
        if ((int)((bits_of(bin[j].value) >> SUB_SHIFT) & (SUB_BINS - 1)) == sub) bin[m++] = bin[j];
    std::sort(bin, bin + m, before);
    // No candidate only if the sums' rounding carried a walk past its last non-empty bin: then
    // the whole bin is kept (its last token in order is the boundary), or, with no bin, every
    // token of weight > 0
    Candidate last = m ? bin[0] : n ? *std::max_element(bin, bin + n, before) : Candidate{0.f, -1};
    double kept = above;
    for (int64_t j = 0; j < m && kept <= limit; j++) {  // kept while the mass before it is <= p
        last = bin[j];
        kept += bin[j].value;
    }
    if (bin != scratch) delete[] bin;
    // the draw: the first kept token whose running sum passes u * the kept mass
    const double target = std::fmin((double)u * kept, std::nextafter(kept, 0.0));
    const f32x16 zero = {}, one = zero + 1.f, floor_ = zero + last.value;
    double run = 0.0;
    int64_t seen = last.id >= 0 ? last.id : 0;  // a kept token, should rounding carry the sum past the end
    for (int64_t i0 = 0; i0 < V; i0 += SAMPLE_CHUNK) {
        const int64_t n1 = V - i0 < SAMPLE_CHUNK ? V - i0 : SAMPLE_CHUNK;
        f32x16 acc = {};  // the chunk's kept mass: above w*, and the tokens equal to it up to i*
        int64_t i = 0;
        f32x16 ties = {};  // lanes that saw w* (rare: one bf16 or float value among ~150k)
        for (; i + 16 <= n1; i += 16) {
            const f32x16 x = load16(weight + i0 + i);
            acc += x > floor_ ? x : zero;
            ties += x == floor_ ? one : zero;
        }
        float sum = 0.f, tied = 0.f;
        for (int k = 0; k < 16; k++) sum += acc[k], tied += ties[k];
        for (int64_t j = tied > 0.f ? 0 : i; j < n1; j++) {
            const float x = weight[i0 + j];
            if ((j >= i && x > last.value) || (x == last.value && i0 + j <= last.id)) sum += x;
        }
        if (run + sum <= target) {
            run += sum;
            continue;
        }
        for (int64_t j = 0; j < n1; j++) {
            const float x = weight[i0 + j];
            if (x > last.value || (x == last.value && i0 + j <= last.id)) {
                seen = i0 + j;
                if ((run += x) > target) return seen;
            }
        }
    }
    return seen;
}

// Each row's next token from its logits, as Sampler does for plain rows: greedy (temperature 0)
// the first maximum; otherwise a draw from softmax(logits / t), after min-p, top-k and top-p
// (pick_top_k, pick_top_p), by inverse CDF at the row's uniform number - over the whole
// vocabulary, the sums of SAMPLE_CHUNK-wide chunks pick the chunk and a running sum inside it the
// token, never one of weight 0 (Sampler.inverse_cdf). Call inside the team, after the logits.
template <typename T>
static void sample(const Model* m, const Step* s, const Work& w) {
    const int64_t B = s->batch, V = m->vocab, C = w.C;
#pragma omp for collapse(2) schedule(dynamic, 8)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t c = 0; c < C; c++) {  // each chunk's max, and its own top k for a top-k row
            const T* row = (const T*)s->logits + b * V;
            const float t = s->temperature[b];
            const int64_t k = t == 0.f ? 0 : s->top_k[b];
            Candidate* top = w.candidates(b) + c * k;
            for (int64_t j = 0; j < k; j++) top[j] = {-INFINITY, -1};
            float mx = -INFINITY;
            for (int64_t i = c * SAMPLE_CHUNK; i < V && i < (c + 1) * SAMPLE_CHUNK; i++) {
                const float x = scaled(row, i, t);
                mx = x > mx ? x : mx;
                if (k && x > top[k - 1].value) {  // ascending ids: an equal one stays out
                    int64_t at = k - 1;
                    while (at > 0 && x > top[at - 1].value) {
                        top[at] = top[at - 1];
                        at--;
                    }
                    top[at] = {x, (int32_t)i};
                }
            }
            w.chunk_max(b)[c] = mx;
        }
    }
#pragma omp for
    for (int64_t b = 0; b < B; b++) {
        float mx = -INFINITY;
        for (int64_t c = 0; c < C; c++) mx = w.chunk_max(b)[c] > mx ? w.chunk_max(b)[c] : mx;
        *w.row_max(b) = mx;
        if (s->temperature[b] != 0.f) {
            if (s->top_k[b])
                s->chosen[b] = pick_top_k(w.candidates(b), C, s->top_k[b], s->min_p[b], s->top_p[b], s->uniform[b]);
            continue;
        }
        const T* row = (const T*)s->logits + b * V;
        int64_t c = 0;
        while (c + 1 < C && w.chunk_max(b)[c] != mx) c++;
        int64_t i = c * SAMPLE_CHUNK;
        while (i + 1 < V && to_f(row[i]) != mx) i++;
        s->chosen[b] = i;
    }
#pragma omp for collapse(2) schedule(dynamic, 8)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t c = 0; c < C; c++) {
            const float t = s->temperature[b];
            if (t == 0.f || s->top_k[b]) continue;
            const int64_t i0 = c * SAMPLE_CHUNK, n = V - i0 < SAMPLE_CHUNK ? V - i0 : SAMPLE_CHUNK;
            if (s->top_p[b] < 1.f) {  // a top-p row keeps its weights; pick_top_p adds them up itself
                chunk_weights((const T*)s->logits + b * V, i0, n, t, *w.row_max(b), s->min_p[b], w.weights(b) + i0);
                continue;
            }
            float weight[SAMPLE_CHUNK];
            chunk_weights((const T*)s->logits + b * V, i0, n, t, *w.row_max(b), s->min_p[b], weight);
            f32x16 acc = {};
            for (int64_t i = 0; i < n; i += 16) acc += load16(weight + i);
            float sum = 0.f;
            for (int k = 0; k < 16; k++) sum += acc[k];
            w.chunk_sum(b)[c] = sum;
        }
    }
#pragma omp for
    for (int64_t b = 0; b < B; b++) {
        const float t = s->temperature[b];
        if (t == 0.f || s->top_k[b]) continue;
        if (s->top_p[b] < 1.f) {
            s->chosen[b] = pick_top_p(w.weights(b), V, s->top_p[b], s->uniform[b], w.candidates(b), C * TOP_K_MAX);
            continue;
        }
        const float* sums = w.chunk_sum(b);
        float total = 0.f;
        for (int64_t c = 0; c < C; c++) total += sums[c];
        // just below the total at most: the chunk the running sum passes then has weight
        const float target = std::fmin(s->uniform[b] * total, std::nextafter(total, 0.f));
        float before = 0.f;
        int64_t c = 0;
        while (c + 1 < C && before + sums[c] <= target) before += sums[c++];
        const int64_t i0 = c * SAMPLE_CHUNK, n = V - i0 < SAMPLE_CHUNK ? V - i0 : SAMPLE_CHUNK;
        float weight[SAMPLE_CHUNK];
        chunk_weights((const T*)s->logits + b * V, i0, n, t, *w.row_max(b), s->min_p[b], weight);
        s->chosen[b] = i0 + draw(weight, n, target - before);
    }
}

static Work work_of(const Model* m, const Step* s) {
    return Work{s->work, row_floats(m), m->hidden, m->intermediate, (m->heads + 2 * m->kv_heads) * m->head_dim,
                m->heads * m->head_dim, m->heads * m->max_context, sample_chunks(m)};
}

template <typename T>
static void decode(const Model* m, const Step* s) {
    const int64_t B = s->batch, H = m->hidden, I = m->intermediate;
    const int64_t NQKV = (m->heads + 2 * m->kv_heads) * m->head_dim, QD = m->heads * m->head_dim, rows = row_floats(m);
    const Work w = work_of(m, s);
    bf16* const packed = (bf16*)(s->work + B * rows);  // the matmuls' bf16 inputs (dpbf16)
#pragma omp parallel num_threads(s->threads)
    {
#pragma omp for
        for (int64_t b = 0; b < B; b++) {
            const T* row = (const T*)m->embed + s->token_ids[b] * H;
            for (int64_t i = 0; i < H; i++) w.x(b)[i] = to_f(row[i]);
            rms_norm(w.x(b), (const T*)m->layer[0].input_norm, w.xn(b), H, m->eps);
        }
        for (int64_t l = 0; l < m->layers; l++) {
            const Layer& L = m->layer[l];
            // h = x + o_proj(attention(qkv_proj(norm(x))))
            matvec((const T*)L.qkv, w.xn(0), rows, w.qkv(0), rows, B, NQKV, H, packed);
            qk_norm_rotary_store<T>(m, s, L, w);
            attend<T>(m, s, L, w);
            matvec((const T*)L.o, w.attn(0), rows, w.tmp(0), rows, B, H, QD, packed);
            add_and_norm(s, w, (const T*)L.post_norm, m->eps);
            // x = h + down(swiglu(gate_up(norm(h)))), then the next layer's input norm
            matvec((const T*)L.gate_up, w.xn(0), rows, w.gu(0), rows, B, 2 * I, H, packed);
            swiglu<T>(s, w);
            matvec((const T*)L.down, w.act(0), rows, w.tmp(0), rows, B, H, I, packed);
            const T* next = (const T*)(l + 1 < m->layers ? m->layer[l + 1].input_norm : m->final_norm);
            add_and_norm(s, w, next, m->eps);
        }
        if (s->logits) {  // the LM head: logits [B, V] in T, from the final norm's output
            matvec((const T*)m->lm_head, w.xn(0), rows, (T*)s->logits, m->vocab, B, m->vocab, H, packed);
            if (s->chosen) sample<T>(m, s, w);
        } else {
#pragma omp for
            for (int64_t b = 0; b < B; b++)
                for (int64_t i = 0; i < H; i++) ((T*)s->hidden)[b * H + i] = from_f<T>(w.xn(b)[i]);
        }
    }
}

// out [B, N] = x [B, K] W [N, K]^T in T, through the matvec decode() runs the LM head with: for
// benchmarks/roofline.py, whose LM-head ceiling is the fastest matmul there is for it
template <typename T>
static void matmul(const T* W, const float* x, T* out, int64_t B, int64_t N, int64_t K, int32_t threads) {
    bf16* packed = new bf16[B * K];
#pragma omp parallel num_threads(threads)
    matvec(W, x, K, out, N, B, N, K, packed);
    delete[] packed;
}

// Mixture-of-experts experts over a few rows each (decode steps; layers/fused_moe.py): the T*K
// (token, expert) pairs sorted by expert (order[p]: the pair's index t*K+k; counts[e]: expert e's
// pairs), each expert's gate_up and down as matvecs over its pairs (a weight row read once for
// all of them), silu(gate)*up rounded as torch rounds it, then each token's sum of its pairs'
// outputs times their router weights. Only the experts that got pairs are read.
template <typename T>
static void moe_experts(const T* x, const T* w13, const T* w2, const float* weights, const int64_t* order,
                        const int64_t* counts, T* out, int64_t tokens, int64_t K, int64_t E, int64_t H,
                        int64_t I, int32_t threads) {
    const int64_t P = tokens * K;
    float* rows = new float[P * H];     // [P, H]: each pair's token, in pair order
    float* gu = new float[P * 2 * I];   // [P, 2I]
    float* act = new float[P * I];      // [P, I]
    float* y = new float[P * H];        // [P, H]: each pair's expert output
    int64_t* slot = new int64_t[P];     // pair index t*K+k -> its row in pair order
    bf16* packed = new bf16[P * (H > I ? H : I)];
    for (int64_t p = 0; p < P; p++) slot[order[p]] = p;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for
        for (int64_t p = 0; p < P; p++)
            for (int64_t h = 0; h < H; h++) rows[p * H + h] = to_f(x[order[p] / K * H + h]);
        int64_t start = 0;
        for (int64_t e = 0; e < E; e++) {
            const int64_t c = counts[e];
            if (c == 0) continue;
            matvec(w13 + e * 2 * I * H, rows + start * H, H, gu + start * 2 * I, 2 * I, c, 2 * I, H, packed);
#pragma omp for collapse(2)
            for (int64_t r = start; r < start + c; r++) {
                for (int64_t i = 0; i < I; i++) {
                    const float g = gu[r * 2 * I + i];
                    act[r * I + i] = rnd<T>(rnd<T>(g / (1.f + std::exp(-g))) * gu[r * 2 * I + I + i]);
                }
            }
            matvec(w2 + e * H * I, act + start * I, I, y + start * H, H, c, H, I, packed);
            start += c;
        }
#pragma omp for collapse(2)
        for (int64_t t = 0; t < tokens; t++) {
            for (int64_t h = 0; h < H; h++) {
                float sum = 0.f;
                for (int64_t k = 0; k < K; k++) sum += weights[t * K + k] * y[slot[t * K + k] * H + h];
                out[t * H + h] = from_f<T>(sum);
            }
        }
    }
    delete[] rows; delete[] gu; delete[] act; delete[] y; delete[] slot; delete[] packed;
}

// sample() alone, over logits the caller computed (steps whose LM head is oneDNN's)
template <typename T>
static void sample_logits(const Model* m, const Step* s) {
    const Work w = work_of(m, s);
#pragma omp parallel num_threads(s->threads)
    sample<T>(m, s, w);
}

extern "C" {
void cpu_decode_bf16(const Model* m, const Step* s) { decode<bf16>(m, s); }
void cpu_decode_f32(const Model* m, const Step* s) { decode<float>(m, s); }
void cpu_sample_bf16(const Model* m, const Step* s) { sample_logits<bf16>(m, s); }
void cpu_sample_f32(const Model* m, const Step* s) { sample_logits<float>(m, s); }
void cpu_matmul_bf16(const void* W, const float* x, void* out, int64_t B, int64_t N, int64_t K, int32_t threads) {
    matmul((const bf16*)W, x, (bf16*)out, B, N, K, threads);
}
void cpu_matmul_f32(const void* W, const float* x, void* out, int64_t B, int64_t N, int64_t K, int32_t threads) {
    matmul((const float*)W, x, (float*)out, B, N, K, threads);
}
void cpu_moe_experts_bf16(const void* x, const void* w13, const void* w2, const float* weights, const int64_t* order,
                          const int64_t* counts, void* out, int64_t T, int64_t K, int64_t E, int64_t H, int64_t I,
                          int32_t threads) {
    moe_experts((const bf16*)x, (const bf16*)w13, (const bf16*)w2, weights, order, counts, (bf16*)out, T, K, E, H, I,
                threads);
}
void cpu_moe_experts_f32(const void* x, const void* w13, const void* w2, const float* weights, const int64_t* order,
                         const int64_t* counts, void* out, int64_t T, int64_t K, int64_t E, int64_t H, int64_t I,
                         int32_t threads) {
    moe_experts((const float*)x, (const float*)w13, (const float*)w2, weights, order, counts, (float*)out, T, K, E, H,
                I, threads);
}
}
