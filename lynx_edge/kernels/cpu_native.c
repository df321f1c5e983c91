/* Native CPU kernels, one call per MoE layer, projection, attention step or norm:
 * lynx_edge/kernels/native.py builds this file with the machine's C compiler for its own ISA
 * (-march=native) the first time it is needed and caches the library; without a compiler the
 * numba (INT4) and torch paths run.
 *
 * lynx_moe: a whole MoE layer over INT4 blocks, stacked fp32/bf16 experts, block-scaled FP8 (e4m3)
 * codes, or MXFP4 codes (gpt-oss, with biases and its clamped SwiGLU). Plan (slots sorted expert-major), gather, gate/up rows with
 * the activation, down rows times the routing weight, then each token's K slots summed in slot
 * order (as moe_ref). Each active expert's weights are read once per call however many tokens
 * share it; up to four tokens share each loaded vector.
 * lynx_linear: a dense projection for decode-sized T (bf16 weights widen exactly by a shift, so
 * bf16 costs half the bytes of fp32 on a CPU without native bf16 math); lynx_linear_int4 the same
 * for an INT4 linear read packed (GPTQ / AWQ attention).
 * lynx_attn_decode: one decode token per row after the fused q/k/v projection (norm, RoPE, cache
 * write, GQA, gpt-oss's sinks). lynx_rmsnorm: RMSNorm with the torch path's roundings.
 *
 * INT4 layout, as cpu_kernels._moe (read that docstring): packed codes [N, Kin/2] (low nibble =
 * even input column), fp16 scales [Kin/G, N], uint8 zeros [Kin/G, N] (sym: 8) in one block per
 * expert; inputs split into even/odd columns so a byte's two nibbles meet their two inputs in two
 * vector lanes without shuffles. Why native and not numba: LLVM through numba left the unpack
 * narrow and reduced every group horizontally (2.2 GB/s of packed weights on one AVX-512 core);
 * here each group adds s_g * (lane partials) into per-lane totals, reduced once per row.
 *
 * Numerics: fp32 products and sums, lanes reassociated: within a few fp32 ulps of the output
 * scale of the fp32 reference (tests/test_cpu_native.py states the bounds).
 *
 * Threads: work items (expert or block of ROW_BLOCK rows) shared through OpenMP's guided
 * schedule on torch's own OpenMP pool (see parallel()); nthreads = 1, or a build without OpenMP,
 * runs on the caller. Glossary: T tokens, D hidden, K top-k, I expert intermediate, G group,
 * S = T*K slots. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#include <cpuid.h>
#endif
/* the vector paths (AVX-512, or AVX2 with FMA); without them the portable loops */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define VEC_PATHS 1
#else
#define VEC_PATHS 0
#endif

#define ROW_BLOCK 16 /* output rows per work item */
#ifndef PREFETCH
#define PREFETCH 4096 /* bytes ahead the one-token row loops prefetch (the next rows of the block) */
#endif
#ifndef TILE_PREFETCH
#define TILE_PREFETCH 8192 /* the least distance the dense and INT4 row tiles prefetch ahead */
#endif
/* Where the row loops' software prefetches land. L2 (T1), not L1 (T0): a core has few L1 miss
 * buffers, and prefetches into L1 queued behind them, so one-token rows streamed from DRAM read at
 * about half a plain sum's rate on an AMD EPYC (Zen4): one-token 1024-wide rows, one thread, T0 ->
 * T1 fp32 17.6 -> 25.3 GB/s, bf16 12.4 -> 21.2 GB/s (sum 25-28), L3-resident 1.1-1.2x, L2-resident
 * equal (benchmarks/results/prefetch_hint_s17.json). The load itself then finds the line in L2. */
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1
#endif
/* The prefetch distance of a tile of `tile` bytes of rows: its rows' places in a later tile, whole
 * tiles, at least `least` bytes ahead. A fixed distance shorter than the tile (4 KB against four
 * 2 KB rows) fetched rows the tile was already reading and left the next tile's last rows to miss:
 * on an AMD EPYC (Zen4) 1.15-1.35x end to end for 512-wide fp32 rows
 * (benchmarks/results/dense_prefetch.json), 1.1-1.3x for INT4 rows read from DRAM at one token
 * (int4_prefetch.json); the AVX2 paths, which prefetched nothing, 1.2-2.5x (avx2_prefetch.json). */
static inline long tile_ahead(long tile, long least) {
    return tile >= least ? tile : (least + tile - 1) / tile * tile;
}

static inline float h2f(uint16_t h) { /* fp16 bits -> fp32, exactly (normal and subnormal; no inf/NaN) */
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t e = (h >> 10) & 0x1F, m = h & 0x3FF;
    union { uint32_t u; float f; } p = {(uint32_t)(127 + (int)(e ? e : 1) - 25) << 23}; /* 2^(max(e,1)-25) */
    const float v = (float)(m + (e ? 1024u : 0u)) * p.f;
    return (h & 0x8000) ? -v : v;
#endif
}

#if defined(__AVX2__)
static inline float hsum256(__m256 t) { /* the sum of 8 lanes */
    const __m128 v = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    const __m128 w = _mm_add_ps(v, _mm_movehl_ps(v, v));
    return _mm_cvtss_f32(_mm_add_ss(w, _mm_shuffle_ps(w, w, 1)));
}

static inline float hmax256(__m256 m) { /* the max of 8 lanes */
    const __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
}
#endif
static inline float bf16_f(uint16_t b) { /* bf16 bits -> fp32, exactly */
    union { uint32_t u; float f; } c = {(uint32_t)b << 16};
    return c.f;
}

/* Up to four sums reduced at once, each lane's result through the same fixed tree whatever the
 * other inputs (absent ones are zero vectors): so a row x token sum does not depend on which rows
 * or tokens share the call, and decode stays batch-invariant (a row alone equals it in a batch). */
#if defined(__AVX2__)
/* [sum a, sum b, sum c, sum d] of four 8-lane vectors: three hadds and one fold (one reduction each
 * would cost ~2.5x the shuffles; with short rows the reductions rival the multiply-adds) */
static inline __m128 sum4_256(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
/* out[k] = sum of v[k] - corr[k] for k < n (1..8) */
static inline __attribute__((always_inline)) void reduce_256(const __m256 *v, const float *corr, const int n,
                                                             float *out) {
    const __m256 z = _mm256_setzero_ps();
    for (int k = 0; k < n; k += 4) {
        float r[4];
        _mm_storeu_ps(r, sum4_256(v[k], k + 1 < n ? v[k + 1] : z, k + 2 < n ? v[k + 2] : z, k + 3 < n ? v[k + 3] : z));
        for (int i = 0; i < 4 && k + i < n; i++) out[k + i] = r[i] - corr[k + i];
    }
}
#endif
#if defined(__AVX512F__)
static inline __m256 fold512(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
static inline __attribute__((always_inline)) void reduce_512(const __m512 *v, const float *corr, const int n,
                                                             float *out) {
    __m256 h[8];
    for (int k = 0; k < n; k++) h[k] = fold512(v[k]);
    reduce_256(h, corr, n, out);
}
#endif

#if defined(__AVX512F__)
/* out[n] = the sum of v[n]'s 16 lanes, n < 16: one transposing tree (45 shuffles and adds for all
 * 16, against ~6 each reduced alone); each sum's order is fixed, whatever the others */
static inline __attribute__((always_inline)) void sum_lanes(const __m512 *v, float *out) {
    __m512 t[8], u[4], w[2];
    for (int k = 0; k < 8; k++) /* 16 lanes -> 8: [v_2k folded | v_2k+1 folded] */
        t[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int k = 0; k < 4; k++) /* 8 -> 4: 128-bit lane m holds v_4k+m */
        u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int k = 0; k < 2; k++) /* 4 -> 2 within each 128-bit lane */
        w[k] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    float o[16]; /* o[4 (n % 4) + n / 4] = the sum of v[n] */
    _mm512_storeu_ps(o, _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1))));
    for (int n = 0; n < 16; n++) out[n] = o[4 * (n % 4) + n / 4];
}
#elif defined(__AVX2__) && defined(__FMA__)
/* out[n] = the sum of v[n]'s 8 lanes, n < 8: the horizontal-add tree of sum4_256, for all 8 at once */
static inline __attribute__((always_inline)) void sum_lanes(const __m256 *v, float *out) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
}
#endif

/* --- INT4 rows ------------------------------------------------------------------------------- */

/* acc[r * ald + t] = sum_g s_g * sum_j (q_j - z_g) * x_t[j] for R adjacent packed rows (row r's
 * Kin/2 code bytes at q + r * rs; s and z point at row 0's entry of group 0, stride N between
 * groups, row r one entry on) and NT tokens, R * NT <= 4; xe[t] / xo[t] are token t's even / odd
 * input columns and xs[t][g] the sum of its inputs in group g. The vector paths compute
 * s_g * (sum_j q_j x_j - z_g * xs[t][g]): the zero point leaves the inner loop (two fewer vector
 * ops per 32 weights in a loop that is bound by its vector ops, not by memory). NT tokens share
 * each decoded vector of weights; R rows share each load of the inputs and one reduction (the
 * demo's 256-wide rows are only 8 vector steps, so a lone row paid its reduction and its loop
 * set-up about as much as its multiply-adds). Each row x token sums the same way in any tile. */
static inline __attribute__((always_inline)) void dot_tile_h(
    const uint8_t *q, const long rs, const uint16_t *s, const uint8_t *z, long N, int Kin, const int H, const int R,
    const float *const *xe, const float *const *xo, const float *const *xs, const int NT, float *acc, const long ald) {
    const int ng = Kin / (2 * H), RN = R * NT;
    /* the prefetch distance: one-token tiles whole tiles ahead, at least TILE_PREFETCH (the
     * fixed 2 KB fell inside a tile of four rows of 1 KB and more); tiles of several tokens, whose
     * decoding outlasts the memory, keep the 2 KB (8 KB there measured 0.87-0.96x at B=16) */
    const long pf = NT > 1 ? PREFETCH / 2 : tile_ahead(R * rs, TILE_PREFETCH);
    float corr[4] = {0.0f, 0.0f, 0.0f, 0.0f}, out[4];
    int t, r;
    (void)pf;
/* one body for both widths: P the intrinsics' prefix, V / VI float / int vectors of BITS bits,
 * LOAD8(p) BITS / 32 code bytes widened to int32 lanes, LO(b) / HI(b) the low / high nibble of each
 * lane as fp32 (exact small integers), PREF(r, g) the prefetch of group g of row r, REDUCE reduce_512 /
 * reduce_256 */
#define DOT_TILE_VEC(P, V, VI, BITS, LOAD8, LO, HI, PREF, REDUCE) \
    if (H % ((BITS) / 32) == 0) { \
        V tot[4]; \
        for (t = 0; t < RN; t++) tot[t] = P##_setzero_ps(); \
        for (int g = 0; g < ng; g++) { \
            V ae[4], ao[4]; \
            for (t = 0; t < RN; t++) { ae[t] = P##_setzero_ps(); ao[t] = P##_setzero_ps(); } \
            for (r = 0; r < R; r++) PREF(r, g); \
            for (int j = 0; j < H; j += (BITS) / 32) \
                for (r = 0; r < R; r++) { \
                    const VI b = LOAD8(q + r * rs + (long)g * H + j); \
                    const V we = LO(b), wo = HI(b); \
                    for (t = 0; t < NT; t++) { \
                        ae[r * NT + t] = P##_fmadd_ps(we, P##_loadu_ps(xe[t] + g * H + j), ae[r * NT + t]); \
                        ao[r * NT + t] = P##_fmadd_ps(wo, P##_loadu_ps(xo[t] + g * H + j), ao[r * NT + t]); \
                    } \
                } \
            for (r = 0; r < R; r++) { \
                const float sg = h2f(s[g * N + r]), zg = (float)(z ? z[g * N + r] : 8); \
                const V sv = P##_set1_ps(sg); \
                for (t = 0; t < NT; t++) { \
                    tot[r * NT + t] = P##_fmadd_ps(sv, P##_add_ps(ae[r * NT + t], ao[r * NT + t]), tot[r * NT + t]); \
                    corr[r * NT + t] += sg * zg * xs[t][g]; \
                } \
            } \
        } \
        REDUCE(tot, corr, RN, out); \
        for (r = 0; r < R; r++) \
            for (t = 0; t < NT; t++) acc[r * ald + t] = out[r * NT + t]; \
        return; \
    }
#define PREF_ROWS(r, g) _mm_prefetch((const char *)q + (r) * rs + (long)(g) * H + pf, PF_HINT) /* the rows after these */
#if defined(__AVX512F__)
#define LOAD8_512(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
/* a nibble as fp32 by table: vpermps reads the low 4 bits of each lane, so the low nibble needs no
 * mask and neither needs a conversion (two ops fewer per 32 weights than and + shift + 2 cvt, on a
 * loop bound by its vector ops; the values are the same exact integers) */
#define NIB_512(b) _mm512_permutexvar_ps((b), _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15))
#define LO_512(b) NIB_512(b)
#define HI_512(b) NIB_512(_mm512_srli_epi32((b), 4))
    DOT_TILE_VEC(_mm512, __m512, __m512i, 512, LOAD8_512, LO_512, HI_512, PREF_ROWS, reduce_512)
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define LOAD8_256(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define LO_256(b) _mm256_cvtepi32_ps(_mm256_and_si256((b), _mm256_set1_epi32(15)))
#define HI_256(b) _mm256_cvtepi32_ps(_mm256_srli_epi32((b), 4))
    DOT_TILE_VEC(_mm256, __m256, __m256i, 256, LOAD8_256, LO_256, HI_256, PREF_ROWS, reduce_256)
#endif
    /* portable: the compiler vectorises what it can (the zero point stays in the loop) */
    (void)xs; (void)corr; (void)out; (void)RN;
    for (r = 0; r < R; r++) {
        const uint8_t *qr = q + r * rs;
        for (t = 0; t < NT; t++) acc[r * ald + t] = 0.0f;
        for (int g = 0; g < ng; g++) {
            const int zz = z ? z[g * N + r] : 8;
            const float sc = h2f(s[g * N + r]);
            for (t = 0; t < NT; t++) {
                const float *a = xe[t] + g * H, *c = xo[t] + g * H;
                const uint8_t *qg = qr + (long)g * H;
                float p = 0.0f;
                for (int j = 0; j < H; j++) p += (float)((qg[j] & 15) - zz) * a[j] + (float)((qg[j] >> 4) - zz) * c[j];
                acc[r * ald + t] += sc * p;
            }
        }
    }
}

/* dot_tile_h with the group's half-width H a compile-time constant for the usual group sizes */
static inline __attribute__((always_inline)) void dot_tile(
    const uint8_t *q, long rs, const uint16_t *s, const uint8_t *z, long N, int Kin, int G, const int R,
    const float *const *xe, const float *const *xo, const float *const *xs, const int NT, float *acc, long ald) {
    if (G == 128) dot_tile_h(q, rs, s, z, N, Kin, 64, R, xe, xo, xs, NT, acc, ald);
    else if (G == 64) dot_tile_h(q, rs, s, z, N, Kin, 32, R, xe, xo, xs, NT, acc, ald);
    else if (G == 32) dot_tile_h(q, rs, s, z, N, Kin, 16, R, xe, xo, xs, NT, acc, ald);
    else dot_tile_h(q, rs, s, z, N, Kin, G / 2, R, xe, xo, xs, NT, acc, ald);
}

/* The tile walk of the row kernels (dot_block; q8_block, q16_block and i8q8_block, whose sums are
 * one accumulator each, wider where 32 vector registers hold 8 of them) over R (1..4) rows and n
 * tokens: one token, all R rows at once; two, all R rows with `two` (else two rows at a time);
 * more, two (`pairs`) or one rows x four tokens. TOKENS(t0, m) points the token arrays at tokens
 * t0..t0+m, TILE(RR, M, r0, t0) runs one tile of that compile-time shape. */
#define TILE_R(TILE, RR, M, r0, t0) /* RR rows, 1..4 at run time, as a compile-time shape */ \
    do { \
        if ((RR) == 4) TILE(4, M, r0, t0); else if ((RR) == 3) TILE(3, M, r0, t0); \
        else if ((RR) == 2) TILE(2, M, r0, t0); else TILE(1, M, r0, t0); \
    } while (0)
#define TILE_M(TILE, RR, M, r0, t0) /* M tokens, 1..4 at run time */ \
    do { \
        if ((M) == 4) TILE(RR, 4, r0, t0); else if ((M) == 3) TILE(RR, 3, r0, t0); \
        else if ((M) == 2) TILE(RR, 2, r0, t0); else TILE(RR, 1, r0, t0); \
    } while (0)
#define WALK_TILES(TILE, TOKENS, R, n, two, pairs) \
    do { \
        if ((n) == 1 || ((n) == 2 && (two))) { \
            TOKENS(0, n) \
            if ((n) == 1) TILE_R(TILE, R, 1, 0, 0); else TILE_R(TILE, R, 2, 0, 0); \
            break; \
        } \
        if ((n) == 2) { \
            TOKENS(0, 2) \
            int r_ = 0; \
            for (; r_ + 2 <= (R); r_ += 2) TILE(2, 2, r_, 0); \
            if (r_ < (R)) TILE(1, 2, r_, 0); \
            break; \
        } \
        for (int t_ = 0; t_ < (n); t_ += 4) { /* tokens outer: four tokens' inputs stay in L1 across the \
                                                 * rows (rows outer re-read every token's from L2 per row) */ \
            const int m_ = (n) - t_ < 4 ? (n) - t_ : 4; \
            TOKENS(t_, m_) \
            for (int r_ = 0; r_ < (R); r_ += 1 + (pairs)) \
                if ((pairs) && r_ + 1 < (R)) TILE_M(TILE, 2, m_, r_, t_); else TILE_M(TILE, 1, m_, r_, t_); \
        } \
    } while (0)

/* acc[r * ROWS_LD + t] for R (1..4) adjacent rows (as dot_tile_h) and n tokens whose even/odd rows
 * start at xe0/xo0 with row stride ld (group sums at xs0, row stride Kin/G). Tiles: WALK_TILES
 * without pairs (one token: all R rows, as at B=1 or for an expert with one slot; two: two rows at a
 * time; more: one row, four tokens sharing each weight vector). */
#define ROWS_LD 64 /* tokens per call (acc's row stride) */
static void dot_block(const uint8_t *q, long rs, const uint16_t *s, const uint8_t *z, long N, int Kin, int G, int R,
                      const float *xe0, const float *xo0, long ld, const float *xs0, int n, float *acc) {
    const long ng = Kin / G;
    const float *xe[4], *xo[4], *xs[4];
#define DOT_TOKENS(t0, m) \
    for (int i = 0; i < (m); i++) { xe[i] = xe0 + ((t0) + i) * ld; xo[i] = xo0 + ((t0) + i) * ld; xs[i] = xs0 + ((t0) + i) * ng; }
#define DOT_TILE(RR, M, r0, t0) \
    dot_tile(q + (r0) * rs, rs, s + (r0), z ? z + (r0) : NULL, N, Kin, G, RR, xe, xo, xs, M, acc + (r0) * ROWS_LD + (t0), \
             ROWS_LD)
    WALK_TILES(DOT_TILE, DOT_TOKENS, R, n, 0, 0);
#undef DOT_TILE
#undef DOT_TOKENS
}

/* a row's even / odd input columns (through the act-order permutation perm when not NULL: code
 * column j reads input perm[j]) into de / dd [h] */
static inline void split_row(const float *xt, const int32_t *perm, long h, float *de, float *dd) {
    if (perm) for (long j = 0; j < h; j++) { de[j] = xt[perm[2 * j]]; dd[j] = xt[perm[2 * j + 1]]; }
    else for (long j = 0; j < h; j++) { de[j] = xt[2 * j]; dd[j] = xt[2 * j + 1]; }
}

/* sums [S, Kin/G]: per row of the even/odd inputs (row stride Kin/2), the sum over each group */
static void group_sums(const float *xe, const float *xo, long S, int Kin, int G, float *sums) {
    const int H = G / 2, ng = Kin / G;
    for (long r = 0; r < S; r++)
        for (int g = 0; g < ng; g++) {
            float a = 0.0f;
            const float *e = xe + r * (Kin / 2) + g * H, *o = xo + r * (Kin / 2) + g * H;
            for (int j = 0; j < H; j++) a += e[j] + o[j];
            sums[r * ng + g] = a;
        }
}

/* --- INT4 rows against int8 activations (Q8: llama.cpp's Q4_0 x Q8_0 idea, on our layout) ---------
 *
 * The activations of a row are quantized in blocks of QB = 32 code-order inputs (16 even + 16 odd
 * columns): d_b = max|x| / 127, xq = round(x / d_b) (int8), so a row of weights multiplies int8 by
 * u4 in integer lanes: acc_b = sum_j q_j * xq_j exactly (vpdpbusd with AVX512-VNNI; maddubs + madd
 * otherwise), then y = sum_g s_g * (sum_{b in g} d_b * acc_b - z_g * zx_g) with zx_g = sum_{b in g}
 * d_b * sum_{j in b} xq_j. Approximate: the activation rounding adds a relative error of ~2^-8 per
 * input (far below the 4-bit weights' own), which is why it is an option (native.INT4_ACTS).
 * Needs Kin % 128 == 0 (64-byte weight chunks); other widths use the fp32 rows above. */
#define QB 32
/* Floats per activation block in the block scales d: the AVX2 build stores each block's scale 4 times,
 * so a 64-weight chunk's two scales are one 8-lane load in q8_tile (AVX-512 and the portable build: 1) */
#if !(defined(__AVX512F__) && defined(__AVX512BW__)) && defined(__AVX2__) && defined(__FMA__)
#define QD 4
#else
#define QD 1
#endif
#define Q8_DS(K) ((K) / QB * QD) /* floats of block scales per row of K inputs (d's row stride) */
#define Q8_MAX_GROUPS 512 /* groups per row the q8 tiles take (K <= 16384 at G = 32, 65536 at G = 128) */

/* The int8 rule of every activation block (llama.cpp's Q8_0 / Q8_K): scale amax / 127, codes
 * round-to-nearest-even(x * 127 / amax) (an all-zero block: scale 0, codes 0) → the scale, its
 * inverse in *id. */
static inline float q8_scale(float amax, float *id) {
    *id = amax > 0.0f ? 127.0f / amax : 0.0f;
    return amax / 127.0f;
}
#if defined(__AVX512F__) && defined(__AVX512BW__)
/* 16 codes of that rule at dst from v (id the block's inverse scale) → them as int32 lanes */
static inline __m512i q8_codes16(const float *v, float id, int8_t *dst) {
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v), _mm512_set1_ps(id)));
    _mm_storeu_si128((__m128i *)dst, _mm512_cvtepi32_epi8(q));
    return q;
}
#endif

/* xq [S, Kin/2] even and odd columns (int8), d [S, Q8_DS(Kin)] (each block's scale QD times), zx [S, Kin/G]
 * of fp32 rows xe/xo */
static void quant_q8(const float *xe, const float *xo, long S, int Kin, int G, int8_t *qe, int8_t *qo, float *d,
                     float *zx) {
    const int h = Kin / 2, nb = Kin / QB, bpg = G / QB;
    for (long r = 0; r < S; r++) {
        const float *e = xe + r * h, *o = xo + r * h;
        int8_t *ge = qe + r * h, *go = qo + r * h;
        float zsum = 0.0f;
        for (int b = 0; b < nb; b++) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
            { /* the scalar loop below in vector lanes, to the same bits: |x| max is exact, x * id is
               * the same fp32 product, and cvtps rounds to nearest-even as nearbyintf does */
                const __m512 ve = _mm512_loadu_ps(e + b * (QB / 2)), vo = _mm512_loadu_ps(o + b * (QB / 2));
                float id;
                const float db = q8_scale(_mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(ve), _mm512_abs_ps(vo))), &id);
                const __m512i qe8 = q8_codes16(e + b * (QB / 2), id, ge + b * (QB / 2));
                const __m512i qo8 = q8_codes16(o + b * (QB / 2), id, go + b * (QB / 2));
                d[r * nb + b] = db; /* QD == 1 here */
                zsum += db * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qe8, qo8));
                if ((b + 1) % bpg == 0) {
                    zx[r * (Kin / G) + b / bpg] = zsum;
                    zsum = 0.0f;
                }
                continue;
            }
#endif
            float amax = 0.0f;
            for (int j = b * (QB / 2); j < (b + 1) * (QB / 2); j++) {
                const float a = fabsf(e[j]), c = fabsf(o[j]);
                amax = a > amax ? a : amax;
                amax = c > amax ? c : amax;
            }
            float id;
            const float db = q8_scale(amax, &id);
            int isum = 0;
            for (int j = b * (QB / 2); j < (b + 1) * (QB / 2); j++) {
                const int a = (int)nearbyintf(e[j] * id), c = (int)nearbyintf(o[j] * id);
                ge[j] = (int8_t)a;
                go[j] = (int8_t)c;
                isum += a + c;
            }
            for (int i = 0; i < QD; i++) d[(r * nb + b) * QD + i] = db;
            zsum += db * (float)isum;
            if ((b + 1) % bpg == 0) {
                zx[r * (Kin / G) + b / bpg] = zsum;
                zsum = 0.0f;
            }
        }
    }
}

/* The scale preamble of the integer-activation tiles (q8_tile, q16_tile): each row's group scales as
 * fp32 into sgf[g * R + r] (converted once per tile; the AVX2 loops broadcast them from there), and
 * the zero-point terms corr[r * NT + t] = sum_g s_g * z_g * zx_t,g (z NULL: symmetric, 8). */
static inline __attribute__((always_inline)) void tile_scales(const uint16_t *s, const uint8_t *z, long N, int ng,
                                                              const int R, const float *const *zx, const int NT,
                                                              float *sgf, float *corr) {
#if defined(__F16C__) && defined(__FMA__)
    if (R == 4) { /* the loop below with a group's four rows in one vector (one-token tiles: ~1/4 of the
                   * tile's instructions at K = 2048 were this preamble): the same products and fmas */
        __m128 c[8];
        for (int t = 0; t < NT; t++) c[t] = _mm_setzero_ps();
        for (int g = 0; g < ng; g++) {
            const __m128 sg = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(s + g * N)));
            int32_t zb = 0;
            if (z) memcpy(&zb, z + g * N, 4);
            const __m128 zg = z ? _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(zb))) : _mm_set1_ps(8.0f);
            _mm_storeu_ps(sgf + g * 4, sg);
            const __m128 sz = _mm_mul_ps(sg, zg);
            for (int t = 0; t < NT; t++) c[t] = _mm_fmadd_ps(sz, _mm_set1_ps(zx[t][g]), c[t]);
        }
        for (int t = 0; t < NT; t++) {
            float v[4];
            _mm_storeu_ps(v, c[t]);
            for (int r = 0; r < 4; r++) corr[r * NT + t] += v[r];
        }
        return;
    }
#endif
    for (int g = 0; g < ng; g++)
        for (int r = 0; r < R; r++) {
            const float sg = h2f(s[g * N + r]), zg = (float)(z ? z[g * N + r] : 8);
            sgf[g * R + r] = sg;
#if defined(__FMA__)
            for (int t = 0; t < NT; t++) corr[r * NT + t] = fmaf(sg * zg, zx[t][g], corr[r * NT + t]); /* as above */
#else
            for (int t = 0; t < NT; t++) corr[r * NT + t] += sg * zg * zx[t][g];
#endif
        }
}

/* acc[r * ald + t] for R adjacent packed rows (as dot_tile_h) and NT tokens, R * NT <= 8 (q8_block); s / z at
 * row 0's group 0 entry (stride N between groups, row r one entry on) */
static inline __attribute__((always_inline)) void q8_tile(
    const uint8_t *q, const long rs, const uint16_t *s, const uint8_t *z, long N, int Kin, int G, const int R,
    const int8_t *const *xe, const int8_t *const *xo, const float *const *d, const float *const *zx, const int NT,
    float *acc, const long ald) {
    const int ng = Kin / G, RN = R * NT;
    /* one-token tiles prefetch whole tiles ahead, at least PREFETCH (8 KB measured 0.93-1.2x against
     * 4 KB where 4 KB was already a tile ahead); tiles of several tokens keep the constant distance
     * (a run-time one took a register there: 0.73-0.81x at four tokens) */
    const long pf = NT > 1 ? PREFETCH : tile_ahead(R * rs, PREFETCH);
    float corr[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f}, out[8];
    float sgf[Q8_MAX_GROUPS * 4]; /* the tile's group scales as fp32, [g * R + r]: the AVX2 loop broadcasts
                                   * them from here (one load) instead of converting at every scale step */
    int t, r;
    (void)pf;
    tile_scales(s, z, N, ng, R, zx, NT, sgf, corr);
#if defined(__AVX512F__) && defined(__AVX512BW__)
    {
        __m512 tot[8];
        for (t = 0; t < RN; t++) tot[t] = _mm512_setzero_ps();
        const __m512i m4 = _mm512_set1_epi8(15);
        const __m512i quarter = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
#if !defined(__AVX512VNNI__)
        const __m512i ones = _mm512_set1_epi16(1);
#endif
        for (int c = 0; c < Kin / 128; c++) { /* 64 bytes: 128 weights, 4 blocks of QB */
            __m512 dv[4];
            for (t = 0; t < NT; t++) dv[t] = _mm512_permutexvar_ps(quarter, _mm512_castps128_ps512(_mm_loadu_ps(d[t] + 4L * c)));
            for (r = 0; r < R; r++) {
                const uint8_t *qr = q + r * rs;
                const uint16_t *sr = s + r;
                const __m512i w = _mm512_loadu_si512((const void *)(qr + 64L * c));
                _mm_prefetch((const char *)qr + 64L * c + pf, PF_HINT);
                const __m512i lo = _mm512_and_si512(w, m4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
                __m512 sv; /* s_g per lane: a group covers G/8 lanes */
                if (G >= 128) sv = _mm512_set1_ps(h2f(sr[(long)(c * 128 / G) * N]));
                else if (G == 64)
                    sv = _mm512_insertf32x8(_mm512_set1_ps(h2f(sr[(long)(2 * c) * N])), _mm256_set1_ps(h2f(sr[(long)(2 * c + 1) * N])), 1);
                else
                    sv = _mm512_permutexvar_ps(quarter, _mm512_castps128_ps512(_mm_setr_ps(
                             h2f(sr[(long)(4 * c) * N]), h2f(sr[(long)(4 * c + 1) * N]), h2f(sr[(long)(4 * c + 2) * N]),
                             h2f(sr[(long)(4 * c + 3) * N]))));
                for (t = 0; t < NT; t++) {
                    const __m512i ve = _mm512_loadu_si512((const void *)(xe[t] + 64L * c));
                    const __m512i vo = _mm512_loadu_si512((const void *)(xo[t] + 64L * c));
#if defined(__AVX512VNNI__)
                    const __m512i a = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, ve), hi, vo);
#else
                    const __m512i a = _mm512_madd_epi16(_mm512_add_epi16(_mm512_maddubs_epi16(lo, ve),
                                                                         _mm512_maddubs_epi16(hi, vo)), ones);
#endif
                    tot[r * NT + t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(dv[t], sv), tot[r * NT + t]);
                }
            }
        }
        reduce_512(tot, corr, RN, out);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    { /* per scale step (a group of G >= 64 weights, or one 64-weight chunk when G = 32): ga = sum over its
       * chunks of the integer dots times the token's block scales (one 8-lane load: QD = 4), then
       * tot += ga * s_g once per step, not once per chunk (a multiply and three scale shuffles fewer per
       * row x token x chunk: on an AMD EPYC Zen3, one thread, codes from DRAM T = 4 1.07-1.18x, T = 1
       * 1.01-1.03x; benchmarks/results/q8_avx2_s22.json) */
        __m256 tot[8], ga[8];
        for (t = 0; t < RN; t++) tot[t] = _mm256_setzero_ps();
        const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
        const int cw = G >= 64 ? G / 64 : 1; /* chunks per scale step */
        for (int c0 = 0, k = 0; c0 < Kin / 64; c0 += cw, k++) { /* k: the step (G = 32: groups 2k and 2k + 1) */
            for (t = 0; t < RN; t++) ga[t] = _mm256_setzero_ps();
            for (int c = c0; c < c0 + cw; c++) /* 32 bytes: 64 weights, 2 blocks of QB */
                for (r = 0; r < R; r++) {
                    const uint8_t *qr = q + r * rs;
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(qr + 32L * c));
                    if ((c & 1) == 0) _mm_prefetch((const char *)qr + 32L * c + pf, PF_HINT);
                    const __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
                    for (t = 0; t < NT; t++) {
                        const __m256i ve = _mm256_loadu_si256((const __m256i *)(xe[t] + 32L * c));
                        const __m256i vo = _mm256_loadu_si256((const __m256i *)(xo[t] + 32L * c));
                        const __m256i a = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, ve),
                                                                             _mm256_maddubs_epi16(hi, vo)), ones);
                        ga[r * NT + t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_loadu_ps(d[t] + 8L * c), ga[r * NT + t]);
                    }
                }
            for (r = 0; r < R; r++) {
                const __m256 sv = G >= 64 ? _mm256_broadcast_ss(sgf + k * R + r)
                                          : _mm256_set_m128(_mm_broadcast_ss(sgf + (2 * k + 1) * R + r),
                                                            _mm_broadcast_ss(sgf + 2 * k * R + r));
                for (t = 0; t < NT; t++) tot[r * NT + t] = _mm256_fmadd_ps(ga[r * NT + t], sv, tot[r * NT + t]);
            }
        }
        reduce_256(tot, corr, RN, out);
    }
#else
    (void)RN;
    for (r = 0; r < R; r++)
        for (t = 0; t < NT; t++) {
            const uint8_t *qr = q + r * rs;
            float tot = 0.0f;
            for (int b = 0; b < Kin / QB; b++) {
                int a = 0;
                for (int j = b * (QB / 2); j < (b + 1) * (QB / 2); j++)
                    a += (qr[j] & 15) * xe[t][j] + (qr[j] >> 4) * xo[t][j];
                tot += (float)a * d[t][b * QD] * h2f(s[(long)(b * QB / G) * N + r]);
            }
            out[r * NT + t] = tot - corr[r * NT + t];
        }
#endif
    for (r = 0; r < R; r++)
        for (t = 0; t < NT; t++) acc[r * ald + t] = out[r * NT + t];
}

/* acc[r * ROWS_LD + t] for R (1..4) adjacent rows and n tokens (rows of stride h / nb / ng from
 * xe0, xo0, d0, zx0). A q8 row x token sum is one accumulator, so with AVX-512's 32 vector registers
 * a tile holds up to 8 of them: one token, all R rows; two tokens, all R rows; more, two rows x four
 * tokens (each weight load serves four tokens, each input load two rows). With 16 registers (AVX2)
 * the tiles of dot_block. Each row x token sums the same way in any tile (batch-invariant). */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define Q8_PAIRS 1
#else
#define Q8_PAIRS 0
#endif
static void q8_block(const uint8_t *q, long rs, const uint16_t *s, const uint8_t *z, long N, int Kin, int G, int R,
                     const int8_t *xe0, const int8_t *xo0, const float *d0, const float *zx0, int n, float *acc) {
    const long h = Kin / 2, ng = Kin / G;
    const int8_t *xe[4], *xo[4];
    const float *d[4], *zx[4];
#define Q8_TOKENS(t0, m) \
    for (int i = 0; i < (m); i++) { \
        xe[i] = xe0 + ((t0) + i) * h; xo[i] = xo0 + ((t0) + i) * h; d[i] = d0 + ((t0) + i) * Q8_DS(Kin); zx[i] = zx0 + ((t0) + i) * ng; }
#define Q8_TILE(RR, M, r0, t0) \
    q8_tile(q + (r0) * rs, rs, s + (r0), z ? z + (r0) : NULL, N, Kin, G, RR, xe, xo, d, zx, M, acc + (r0) * ROWS_LD + (t0), \
            ROWS_LD)
    WALK_TILES(Q8_TILE, Q8_TOKENS, R, n, Q8_PAIRS, Q8_PAIRS);
#undef Q8_TILE
#undef Q8_TOKENS
}

/* --- INT4 rows against int16 activations (Q16: the default, near-exact) ----------------------------
 *
 * The fp32 rows above are bound by their vector ops, not by memory (an AMD EPYC Zen3, one thread,
 * rows from DRAM: ~5-7 GB/s of codes against ~20 GB/s the memory gives): each 16 weights cost a
 * widening load, two nibble splits and two conversions before the two multiply-adds per token. With
 * the activations as int16 — each weight group's code-order inputs scaled by their largest
 * magnitude, xq = round(x * 32767 / amax) — 16 weights are one widening
 * load and two nibble splits, and each token multiplies them with two vpmaddwd (16 products each,
 * summed in pairs into int32) and two integer adds, exact; a group's integer sum meets its two scales
 * once: y = sum_g s_g * d_g * (acc_g - z_g * sum_{j in g} xq_j).
 * The only rounding is the activations': |x - d * xq| <= d / 2 = amax / 65534 per input, 2^-16 of the
 * group's largest input — 128 times finer than the bf16 rounding a 16-bit model applies to every
 * activation (2^-9 of the value itself), and 256 times finer than q8's. int32 is exact: a lane sums
 * G / 8 <= 16 products of |15 * 32767|. Takes the checkpoints' groups of 32, 64 and 128 (quant/int4.py
 * GROUP_SIZES); other shapes run the fp32 rows. */
#define Q16_DS(K, G) ((K) / (G)) /* block scales per row of K inputs: one per weight group */
#define Q16_MAX_GROUPS 1024 /* groups per row the q16 tiles take (K <= 32768 at G = 32) */
#if defined(__AVX512VL__)
/* 32 vector registers: tiles of three or more tokens take two rows at a time (R * NT <= 8), the two
 * rows sharing each token's loaded inputs */
#define Q16_PAIRS 1
#define Q16_RN 8
#else
#define Q16_PAIRS 0
#define Q16_RN 4
#endif
static inline int q16_ok(int Kin, int G) {
    return (G == 32 || G == 64 || G == 128) && Kin % G == 0 && Kin / G <= Q16_MAX_GROUPS;
}

/* xq [S, Kin/2] even and odd columns (int16), d [S, Q16_DS(Kin, G)], zx [S, Kin/G] of fp32 rows xe/xo
 * (row stride Kin/2): quant_q8's rule at 32767 */
static void quant_q16(const float *xe, const float *xo, long S, int Kin, int G, int16_t *qe, int16_t *qo, float *d,
                      float *zx) {
    const int h = Kin / 2, L = G, nb = Kin / G;
    for (long r = 0; r < S; r++) {
        const float *e = xe + r * h, *o = xo + r * h;
        int16_t *ge = qe + r * h, *go = qo + r * h;
        for (int b = 0; b < nb; b++) {
            const int j0 = b * (L / 2), j1 = j0 + L / 2;
#if defined(__AVX2__)
            { /* the scalar loop below 8 inputs at a time, to the same bits (G / 2 is a multiple of 8): the
               * max of |x| is exact, x * id the same fp32 product, cvtps rounds to nearest-even as
               * nearbyintf does, and the int32 code sum does not depend on its order */
                const __m256 sign = _mm256_set1_ps(-0.0f);
                __m256 m = _mm256_setzero_ps();
                for (int j = j0; j < j1; j += 8)
                    m = _mm256_max_ps(m, _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(e + j)),
                                                       _mm256_andnot_ps(sign, _mm256_loadu_ps(o + j))));
                const float amax = hmax256(m), id = amax > 0.0f ? 32767.0f / amax : 0.0f, db = amax / 32767.0f;
                const __m256 vid = _mm256_set1_ps(id);
                __m256i isum = _mm256_setzero_si256();
                for (int j = j0; j < j1; j += 8) {
                    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(e + j), vid));
                    const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(o + j), vid));
                    _mm_storeu_si128((__m128i *)(ge + j), _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1)));
                    _mm_storeu_si128((__m128i *)(go + j), _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1)));
                    isum = _mm256_add_epi32(isum, _mm256_add_epi32(a, c));
                }
                const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(isum), _mm256_extracti128_si256(isum, 1));
                const __m128i s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
                d[r * nb + b] = db;
                zx[r * nb + b] = db * (float)_mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1)));
                continue;
            }
#endif
            float amax = 0.0f;
            for (int j = j0; j < j1; j++) {
                const float a = fabsf(e[j]), c = fabsf(o[j]);
                amax = a > amax ? a : amax;
                amax = c > amax ? c : amax;
            }
            const float id = amax > 0.0f ? 32767.0f / amax : 0.0f, db = amax / 32767.0f;
            int isum = 0;
            for (int j = j0; j < j1; j++) {
                const int a = (int)nearbyintf(e[j] * id), c = (int)nearbyintf(o[j] * id);
                ge[j] = (int16_t)a;
                go[j] = (int16_t)c;
                isum += a + c;
            }
            d[r * nb + b] = db;
            zx[r * nb + b] = db * (float)isum;
        }
    }
}

#if defined(__AVX2__)
/* acc + the int16 products of a and b, each int32 lane summing its pair: one vpdpwssd with
 * AVX512-VNNI (and VL), else vpmaddwd and an add; exact int32 either way, so the same sums (the q16
 * and MXFP4 int16 rows; on a Zen4 the q16 rows from DRAM 1.01-1.09x, int4_rows_vnni_s40.json) */
static inline __m256i dot16_add(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
#endif
/* acc[r * ald + t] for R adjacent packed rows and NT tokens (R * NT <= Q16_RN), HB the 16-byte halves of
 * a group (G / 32), a compile-time constant */
static inline __attribute__((always_inline)) void q16_tile(
    const uint8_t *q, const long rs, const uint16_t *s, const uint8_t *z, long N, int Kin, int G, const int HB,
    const int R, const int16_t *const *xe, const int16_t *const *xo, const float *const *d, const float *const *zx,
    const int NT, float *acc, const long ald) {
    const int ng = Kin / G, RN = R * NT;
    const long pf = NT > 1 ? PREFETCH : tile_ahead(R * rs, PREFETCH); /* as q8_tile's */
    float corr[Q16_RN] = {0.0f}, out[Q16_RN];
    float sgf[Q16_MAX_GROUPS * 4]; /* the tile's group scales as fp32 (tile_scales) */
    int t, r;
    (void)pf;
    tile_scales(s, z, N, ng, R, zx, NT, sgf, corr);
#if defined(__AVX2__) && defined(__FMA__)
    {
        __m256 tot[Q16_RN];
        for (t = 0; t < RN; t++) tot[t] = _mm256_setzero_ps();
        const __m256i m4 = _mm256_set1_epi16(15);
        for (int b = 0; b < ng; b++) { /* group b: bytes 16 HB b .. of each row */
            __m256i ai[Q16_RN];
            for (t = 0; t < RN; t++) ai[t] = _mm256_setzero_si256();
            for (int hh = 0; hh < HB; hh++) {
                const long o = 16L * (b * HB + hh);
#if Q16_PAIRS
                /* every row's codes widened, then tokens outer: each token's inputs loaded once for
                 * all R rows (one row of four tokens reloaded them for every row; from DRAM the
                 * row pairs ran T=3 1.01-1.35x, T=4 1.02-1.33x, T=16 1.26-1.41x on a Zen4,
                 * int4_pairs_s41.json; in cache about even: the multiply pipes bound it there) */
                __m256i lo[4], hi[4];
                for (r = 0; r < R; r++) {
                    const uint8_t *qr = q + r * rs;
                    if ((o & 63) == 0) _mm_prefetch((const char *)qr + o + pf, PF_HINT);
                    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qr + o)));
                    lo[r] = _mm256_and_si256(w, m4);
                    hi[r] = _mm256_srli_epi16(w, 4);
                }
                for (t = 0; t < NT; t++) {
                    __m256i ve = _mm256_loadu_si256((const __m256i *)(xe[t] + o)),
                            vo = _mm256_loadu_si256((const __m256i *)(xo[t] + o));
                    if (R > 1) __asm__("" : "+x"(ve), "+x"(vo)); /* kept: gcc folds the load into each row's product */
                    for (r = 0; r < R; r++)
                        ai[r * NT + t] = dot16_add(dot16_add(ai[r * NT + t], lo[r], ve), hi[r], vo);
                }
#else
                /* 16 registers: one row's codes at a time */
                for (r = 0; r < R; r++) {
                    const uint8_t *qr = q + r * rs;
                    if ((o & 63) == 0) _mm_prefetch((const char *)qr + o + pf, PF_HINT);
                    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qr + o)));
                    const __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_srli_epi16(w, 4);
                    for (t = 0; t < NT; t++) {
                        ai[r * NT + t] = dot16_add(dot16_add(ai[r * NT + t], lo, _mm256_loadu_si256((const __m256i *)(xe[t] + o))),
                                                   hi, _mm256_loadu_si256((const __m256i *)(xo[t] + o)));
                        /* the sum in its register now: left free, gcc hoists a group's 32 products ahead of
                         * the adds and spills them (multi-token tiles 0.5x) */
                        __asm__("" : "+x"(ai[r * NT + t]));
                    }
                }
#endif
            }
            for (r = 0; r < R; r++) {
                const __m256 sv = _mm256_broadcast_ss(sgf + b * R + r);
                for (t = 0; t < NT; t++)
                    tot[r * NT + t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ai[r * NT + t]),
                                                      _mm256_mul_ps(_mm256_broadcast_ss(d[t] + b), sv), tot[r * NT + t]);
            }
        }
        reduce_256(tot, corr, RN, out);
    }
#else
    (void)RN;
    for (r = 0; r < R; r++)
        for (t = 0; t < NT; t++) {
            const uint8_t *qr = q + r * rs;
            float tot = 0.0f;
            for (int b = 0; b < ng; b++) {
                int a = 0;
                for (int j = 16 * HB * b; j < 16 * HB * (b + 1); j++)
                    a += (qr[j] & 15) * xe[t][j] + (qr[j] >> 4) * xo[t][j];
                tot += (float)a * (d[t][b] * h2f(s[(long)b * N + r]));
            }
            out[r * NT + t] = tot - corr[r * NT + t];
        }
#endif
    for (r = 0; r < R; r++)
        for (t = 0; t < NT; t++) acc[r * ald + t] = out[r * NT + t];
}

/* acc[r * ROWS_LD + t] for R (1..4) adjacent rows and n tokens (rows of stride h / Q16_DS / ng from
 * xe0, xo0, d0, zx0): dot_block's tiles. Each row x token sums the same way in any tile. */
static void q16_block(const uint8_t *q, long rs, const uint16_t *s, const uint8_t *z, long N, int Kin, int G, int R,
                      const int16_t *xe0, const int16_t *xo0, const float *d0, const float *zx0, int n, float *acc) {
    const long h = Kin / 2, ng = Kin / G, nd = Q16_DS(Kin, G);
    const int16_t *xe[4], *xo[4];
    const float *d[4], *zx[4];
#define Q16_TOKENS(t0, m) \
    for (int i = 0; i < (m); i++) { \
        xe[i] = xe0 + ((t0) + i) * h; xo[i] = xo0 + ((t0) + i) * h; d[i] = d0 + ((t0) + i) * nd; zx[i] = zx0 + ((t0) + i) * ng; }
#define Q16_TILE_HB(HB, RR, M, r0, t0) \
    q16_tile(q + (r0) * rs, rs, s + (r0), z ? z + (r0) : NULL, N, Kin, G, HB, RR, xe, xo, d, zx, M, \
             acc + (r0) * ROWS_LD + (t0), ROWS_LD)
#define Q16_TILE(RR, M, r0, t0) \
    do { \
        if (G == 128) Q16_TILE_HB(4, RR, M, r0, t0); else if (G == 64) Q16_TILE_HB(2, RR, M, r0, t0); \
        else Q16_TILE_HB(1, RR, M, r0, t0); \
    } while (0)
    /* two tokens two rows at a time: all four rows x two ran 0.7x (K = 4096) */
    WALK_TILES(Q16_TILE, Q16_TOKENS, R, n, 0, Q16_PAIRS);
#undef Q16_TILE
#undef Q16_TILE_HB
#undef Q16_TOKENS
}

/* The activation modes (the kernels' `act` argument): for INT4 rows 0 fp32 (dot_block), 1 int8
 * (q8_block), 2 int16 (q16_block); for bf16 rows 0 fp32 (dense_block), 3 bf16 (dp_block, where the
 * build has AVX512-BF16: lynx_bf16_dp), 4 the same for a projection whose rows stream from DRAM */
enum { ACT_F32 = 0, ACT_Q8 = 1, ACT_Q16 = 2, ACT_BF16 = 3, ACT_BF16S = 4 };
#define ACT_DS(q16, K, G) ((q16) ? Q16_DS(K, G) : Q8_DS(K)) /* block scales per row */

/* the mode rows of Kin inputs in groups of G run: act, or ACT_F32 where its kernel does not take the shape */
static inline int act_for(int act, int Kin, int G) {
    if (act == ACT_Q8) return Kin % 128 == 0 && Kin / G <= Q8_MAX_GROUPS ? ACT_Q8 : ACT_F32;
    if (act == ACT_Q16) return q16_ok(Kin, G) ? ACT_Q16 : ACT_F32;
    return ACT_F32;
}

/* bytes of integer activations and floats of scales (block scales, then the zero sums) for S rows of
 * Kin inputs in mode a (0 for ACT_F32) */
static inline size_t act_bytes(int a, long S, int Kin) { return a == ACT_F32 ? 0 : (size_t)S * Kin * (a == ACT_Q16 ? 2 : 1); }
static inline size_t act_floats(int a, long S, int Kin, int G) {
    return a == ACT_F32 ? 0 : (size_t)S * (ACT_DS(a == ACT_Q16, Kin, G) + Kin / G) + 1;
}

/* the odd codes of S rows of Kin inputs in mode a, after the even ones at xq */
static inline void *act_odd(int a, void *xq, long S, int Kin) { return (char *)xq + act_bytes(a, S, Kin) / 2; }

/* quantize S rows of even / odd inputs xe / xo (row stride Kin/2) in mode a: codes even | odd at xq
 * ([S, Kin/2] each; act_odd), block scales at d, zero sums after them */
static void quant_act(int a, const float *xe, const float *xo, long S, int Kin, int G, void *xq, float *d) {
    if (a == ACT_Q16) quant_q16(xe, xo, S, Kin, G, xq, act_odd(a, xq, S, Kin), d, d + S * Q16_DS(Kin, G));
    else quant_q8(xe, xo, S, Kin, G, xq, act_odd(a, xq, S, Kin), d, d + S * Q8_DS(Kin));
}

/* q8_block or q16_block (q16) over the codes from element o of xe / xo */
static inline void act_block(int q16, const uint8_t *q, long rs, const uint16_t *s, const uint8_t *z, long N, int Kin,
                             int G, int R, const void *xe, const void *xo, long o, const float *d, const float *zx, int n,
                             float *acc) {
    if (q16) q16_block(q, rs, s, z, N, Kin, G, R, (const int16_t *)xe + o, (const int16_t *)xo + o, d, zx, n, acc);
    else q8_block(q, rs, s, z, N, Kin, G, R, (const int8_t *)xe + o, (const int8_t *)xo + o, d, zx, n, acc);
}

/* --- 16/32-bit rows --------------------------------------------------------------------------- */

enum { FMT_INT4 = 0, FMT_F32 = 1, FMT_BF16 = 2, FMT_MXFP4 = 3, FMT_FP8 = 4, FMT_I8 = 5 };

/* acc[r * ald + t] = sum_j w_r[j] * x_t[j] for R adjacent rows (row r at w + r * rs bytes; fp32,
 * bf16 — it widens exactly by a shift — or int8 codes, FMT_I8, whose row scale the caller applies)
 * and NT tokens, R * NT <= DT_A (the accumulators of one tile), NT <= DT_TOK. One accumulator per row x
 * token (a 4 x 4 tile loads 8 vectors per 16 multiply-adds; the earlier four partial sums per row x
 * token allowed only one row x 4 tokens, 20 loads per 16). Each tile prefetches its rows' places in
 * the tiles after it (tile_ahead). */
/* One-token bf16 tiles with at least ROW_RUN_MIN_K inputs read each row's next ROW_RUN inputs
 * before moving to the next row, instead of interleaving the rows 16 inputs (32 bytes) at a time:
 * longer runs per row stream better from DRAM. A row's sum keeps its order (the same accumulator,
 * inputs ascending), so results are bit-equal to the interleaved loop and to every other tile shape.
 * Measured on an AMD EPYC (Zen4), one-token rows from DRAM, one thread (benchmarks/results/
 * row_run_s18.json): 1024 inputs 21.5 -> 25.8 GB/s at 128 (64: 22.6, 256: 24.6; a torch sum 28.1),
 * 768 inputs 19.7 -> 22.8 (256: 24.0). Short rows keep the interleaved loop: with the demo's 128-
 * and 256-wide rows, mostly in cache, runs cost 6-18% of a decode step; fp32 rows lose with runs
 * (23.3 -> 18.8 GB/s). The run loops are unrolled so a[r] stays in a register (a runtime index
 * spills the accumulators for the whole tile).
 * The AVX2 path runs ROW_RUN_AVX2 (64) inputs per row, measured on the same host built for haswell
 * (benchmarks/results/row_run_avx2_s19.json, one thread, GB/s interleaved -> runs of 64): 1024 inputs
 * 17.1 -> 25.4 (128: 20.8), 1408 21.7 -> 22.5, 2048 16.2 -> 18.4, 2880 20.7 -> 22.4; 768 27.1 -> 24.9
 * in one sweep and 22.8 -> 22.1 in another (the only width where runs do not win; kept one rule);
 * random qwen3_moe bf16 end to end 1.26x at B = 1, 1.07x at B = 16 (row_run_avx2_e2e_s19.json). */
#ifndef ROW_RUN_MIN_K
#define ROW_RUN_MIN_K 512
#endif
#ifndef ROW_RUN
#define ROW_RUN 128
#endif
#ifndef ROW_RUN_AVX2
#define ROW_RUN_AVX2 64
#endif
/* One-token fp32 rows of at most ROW_WHOLE_F32_AVX2 inputs on the AVX2 path are read whole, one row
 * after another (the tile's bytes in address order), instead of interleaving the tile's rows 8 inputs
 * (32 bytes) at a time: the demo's rows (256 and 128 inputs, 1 KB and 512 B) stream from DRAM far
 * below the read rate when four rows are walked side by side. Bit-equal to the interleaved loop (each
 * row's accumulator, inputs ascending). One thread, built for the host, GB/s interleaved -> whole
 * (benchmarks/results/row_whole_f32_avx2_s21.json, benchmarks/prefetch_sweep.py --defines
 * ROW_WHOLE_F32_AVX2=0,ROW_WHOLE_F32_AVX2=512 --k K --dtype float32):
 *   AMD EPYC Zen3 (L3 32 MiB; torch sum ~22.5): 128 inputs 11.5 -> 18.8, 256 13.2 -> 19.6,
 *     512 15.8 -> 19.8; 768 18.6 -> 20.3 and 1024 20.7 -> 20.3 (about even); demo fp32 end to end,
 *     whole rows for the experts only, B=1 1.25x, B=4 1.27x (benchmarks/dense_tiles.py --base 4ce1487
 *     --model demo --dtype float32 --batch 1,4,16 --threads 1 -r 15);
 *   AMD EPYC Zen1 (L3 8 MiB; torch sum ~13): 128 8.8 -> 12.3, 256 8.7 -> 12.0, 512 10.2 -> 11.5;
 *     768 12.6 -> 12.0 and 1024 11.9 -> 11.2 lose, and so do bf16 rows at every width (0.81-0.96x:
 *     their widening shift, not the read, bounds them there).
 * Hence rows of <= 512 inputs only, and only rows that come from DRAM at each use (dense_block's
 * `stream`: experts that outgrow the last-level cache, native.streamed): rows that stay in cache run slower whole — the demo's fp32 head (4096 x 256,
 * 4 MB) read 42 GB/s interleaved against 18-26 whole on the Zen3 (one latency-bound accumulator per
 * row at a time). The AVX-512 path takes the same rule (DT_WHOLE_F32; session 41, AMD EPYC Zen4, one
 * thread, benchmarks/expert_rows.py --dtypes float32 --tokens 1, results/expert_rows_f32_whole_s41.json):
 * the zero-padded demo's 256-input gate/up rows 1.14x, Qwen3-Next's 512-input down rows 1.04x; whole
 * rows of 2048 inputs measured 0.89x (Qwen3-30B-A3B's gate/up). bf16 rows there are read whole at
 * one token only (three tokens measured 0.77-0.85x; ROW_WHOLE_BF16_AVX512 below). */
#ifndef ROW_WHOLE_F32_AVX2
#define ROW_WHOLE_F32_AVX2 512
#endif
/* bf16 expert rows of <= ROW_WHOLE_BF16_AVX2 inputs that come from DRAM (stream) are read whole too,
 * at one to three tokens (each row's 1-3 sums, then the next row). One thread on an AMD EPYC Zen3
 * (benchmarks/expert_rows.py, results/expert_rows_s27.json, GB/s interleaved -> whole): 256-input
 * rows (the zero-padded demo's gate/up) 12.1 -> 14.0 at one token, 10.7 -> 11.3 at two, 10.3 -> 11.1
 * at three (1.05-1.23x over runs); 512 inputs (Qwen3-Next's down) 1.02-1.04x; four tokens whole
 * measured 0.96-0.98x and keep the interleaved tile. The padded demo end to end 1.07x at B = 1,
 * 1.13-1.15x at B = 4 (results/padded_stream_s27.json). From cache (the bf16 demo, 25 MB of experts
 * in a 32 MB L3) whole rows measured 0.94-1.0x, so the builder marks experts streamed only when they
 * outgrow the last-level cache (native.streamed). */
#ifndef ROW_WHOLE_BF16_AVX2
#define ROW_WHOLE_BF16_AVX2 512
#endif
/* AVX-512: one-token bf16 expert rows of <= ROW_WHOLE_BF16_AVX512 inputs that come from DRAM are read
 * whole too (session 42, AMD EPYC Zen4, one thread, benchmarks/expert_rows.py --base <before>
 * --dtypes bfloat16 --tokens 1,2, results/expert_rows_bf16_whole_s42.json, GB/s interleaved ->
 * whole): the zero-padded demo's 256-input gate/up 21.4 -> 23.3 (1.11x; 1.12x in a first run),
 * Qwen3-30B-A3B 1.08x (1.05x), Qwen3-Next 1.02x (1.05x), OLMoE 1.03x (0.99x) — their 2048-input
 * gate/up, 512-1024-input down; two tokens keep the interleaved tile (0.99-1.03x, unchanged); the
 * random 1.28 GB qwen3_moe's decode at B = 1 1.04x, B = 16 1.00x (decode_ab_s42.json). Bit-equal:
 * the same accumulator per row over the same steps. */
#ifndef ROW_WHOLE_BF16_AVX512
#define ROW_WHOLE_BF16_AVX512 2048
#endif
/* Packed rows (ROWS_PACKED, the `stream` mode of 16/32-bit experts that come from DRAM): a matrix's
 * rows in groups of PK_ROWS (4), each group's inputs interleaved 8 at a time — row 0's inputs 0..7,
 * row 1's 0..7, .., row 3's, then row 0's 8..15 — so a tile of four rows (or two, then the other
 * two from cache) reads its bytes in address order, one stream the hardware prefetcher follows,
 * where row-major tiles walk four streams a row apart (short rows) or each row whole with one
 * latency-bound accumulator. The same multiply-adds in the same order: bit-equal to row-major.
 * Needs rows % 4 == 0 and inputs % 8 == 0 (native.packable); not on the AVX-512 path, whose
 * 16-wide loads would span two slots (lynx_pack_rows says where). Which matrices are packed, and
 * the figures: native.pack_choice. */
#define ROWS_PACKED 2
#define MOE_GU_PACKED 2 /* lynx_moe's stream bits: gate_up / down hold packed rows */
#define MOE_DN_PACKED 4
#define PK_ROWS 4
/* the byte offset of row r's input j from its group's first row (r may run past the group) */
#define PK_OFF(r, j, Kin, ES) \
    ((((long)((r) / PK_ROWS) * PK_ROWS * (Kin)) + ((r) % PK_ROWS) * 8 + ((long)((j) >> 3) * 8 * PK_ROWS) + ((j) & 7)) * (ES))
#ifndef PK_PREFETCH
#define PK_PREFETCH TILE_PREFETCH /* bytes ahead in the packed stream */
#endif
#if defined(__AVX512F__)
#define PACK_OK 0
#else
#define PACK_OK 1
#endif
/* the rows per group of the packed rows this build reads; 0: none (AVX-512) */
int lynx_pack_rows(void) { return PACK_OK ? PK_ROWS : 0; }
/* dst <- src [R, K] (es bytes a weight, R % PK_ROWS == 0, K % 8 == 0) in packed rows: each group's
 * rows read in step, written in address order (the loader's sink; a permuted torch copy ran ~2 GB/s) */
void lynx_pack_copy(uint8_t *dst, const uint8_t *src, long R, long K, int es, int nthreads) {
    const long cw = 8L * es, rb = K * es;
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && R * rb >= (1L << 20))
#endif
    for (long g = 0; g < R / PK_ROWS; g++) {
        const uint8_t *s = src + g * PK_ROWS * rb;
        uint8_t *d = dst + g * PK_ROWS * rb;
        for (long c = 0; c < K / 8; c++)
            for (int r = 0; r < PK_ROWS; r++, d += cw) memcpy(d, s + r * rb + c * cw, cw);
    }
    (void)nthreads;
}
#define DT_PRAGMA(x) _Pragma(#x)
/* dense_tile's vector macros: DT_N accumulators of DT_VL lanes, one weight vector of row r at input
 * jj widened to fp32 (DT_WAT: fp32 loads, int8 codes convert, bf16 widens by a shift), runs of
 * DT_RUN inputs unrolled by DT_UNROLL_RUN (the measured unrolls of each path) */
#if defined(__AVX512F__)
#define DT_N 16
#define DT_A 16
#define DT_TOK 4
#define DT_LONG_RT 4 /* rows a tile of 3+ tokens over rows of 1024+ inputs (see dense_tiles) */
#define DT_VL 16
#define DT_VEC __m512
#define DT_VZERO _mm512_setzero_ps
#define DT_VLOAD _mm512_loadu_ps
#define DT_VFMA _mm512_fmadd_ps
#define DT_RUN ROW_RUN
#define DT_UNROLL_RUN DT_PRAGMA(GCC unroll 4)
#define DT_WHOLE_F32 ROW_WHOLE_F32_AVX2 /* the AVX2 rule, measured on a Zen4 too (see there) */
#define DT_WHOLE_BF16 ROW_WHOLE_BF16_AVX512
#define DT_WHOLE_BF16_NT 1 /* tokens up to which streamed bf16 rows are read whole (see there) */
#define DT_WAT(r, jj) (FMT == FMT_F32 ? _mm512_loadu_ps((const float *)WP(r, jj)) \
                : FMT == FMT_I8 ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)WP(r, jj)))) \
                : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)WP(r, jj))), 16)))
#elif defined(__AVX2__) && defined(__FMA__)
#define DT_N 8
#define DT_A 12
#define DT_TOK 5
#define DT_LONG_RT 2
#define DT_VL 8
#define DT_VEC __m256
#define DT_VZERO _mm256_setzero_ps
#define DT_VLOAD _mm256_loadu_ps
#define DT_VFMA _mm256_fmadd_ps
#define DT_RUN ROW_RUN_AVX2
#define DT_UNROLL_RUN DT_PRAGMA(GCC unroll 8)
#define DT_WHOLE_F32 ROW_WHOLE_F32_AVX2
#define DT_WHOLE_BF16 ROW_WHOLE_BF16_AVX2
#define DT_WHOLE_BF16_NT 3
#define DT_WAT(r, jj) (FMT == FMT_F32 ? _mm256_loadu_ps((const float *)WP(r, jj)) \
                : FMT == FMT_I8 ? _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)WP(r, jj)))) \
                : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)WP(r, jj))), 16)))
#else
#define DT_N 16
#define DT_A 16
#define DT_TOK 4
#define DT_LONG_RT 2
#endif
static inline __attribute__((always_inline)) void dense_tile(const uint8_t *w, const long rs, const int FMT, int Kin,
                                                             const int R, const float *const *x, const int NT,
                                                             float *acc, const long ald, const int STREAM) {
    int t, r, j = 0;
    float out[DT_A];
    const int PK = STREAM == ROWS_PACKED; /* w: the tile's first row's slot in packed rows (PK_OFF) */
    (void)STREAM; /* the vector paths' whole-row loops and PK read it */
#define WP(r, j) (w + (PK ? PK_OFF(r, j, Kin, ES) : (long)(r) * rs + (long)(j) * ES)) /* row r's input j */
#define WS(r, j) (FMT == FMT_F32 ? *(const float *)WP(r, j) : FMT == FMT_I8 ? (float)*(const int8_t *)WP(r, j) \
                  : bf16_f(*(const uint16_t *)WP(r, j))) /* one weight */
    const long ES = FMT == FMT_F32 ? 4 : FMT == FMT_BF16 ? 2 : 1; /* bytes per weight */
#if VEC_PATHS
    /* one accumulator per row x token over the inputs' VL-wide vectors in order, then sum_lanes's
     * fixed tree: every row x token sums the same way in any tile, so a token's result does not
     * depend on which tokens or rows share the call (decode is batch-invariant). The AVX-512 and
     * AVX2 paths are one body over the vector macros (DT_V*) defined before this function. */
    DT_VEC a[DT_A];
    for (t = 0; t < DT_A; t++) a[t] = DT_VZERO();
    /* each row prefetches its place in a later tile; packed rows are one stream, read in address order */
    const long pf = PK ? PK_PREFETCH : tile_ahead(R * rs, TILE_PREFETCH);
    if (STREAM == 1 && ((NT == 1 && FMT == FMT_F32 && Kin <= DT_WHOLE_F32)
                        || (FMT == FMT_BF16 && NT <= DT_WHOLE_BF16_NT && Kin <= DT_WHOLE_BF16))) {
        /* short streamed rows: each row whole, for all NT tokens */
#pragma GCC unroll 16
        for (r = 0; r < R; r++) /* unrolled: a[r] a register; j ends where the interleaved loop would */
            for (j = 0; j + DT_VL <= Kin; j += DT_VL) {
                if (((j * ES) & 63) == 0) _mm_prefetch((const char *)(w + r * rs) + (long)j * ES + pf, PF_HINT);
                const DT_VEC wv = DT_WAT(r, j);
                for (t = 0; t < NT; t++) a[r * NT + t] = DT_VFMA(wv, DT_VLOAD(x[t] + j), a[r * NT + t]);
            }
    } else if (!PK && NT == 1 && FMT == FMT_BF16 && DT_RUN > 0 && Kin >= ROW_RUN_MIN_K) { /* bf16, one token: a run of each row in turn */
        /* whole runs only, with constant trip counts, so the rows' accumulators stay in registers;
         * the interleaved loop below goes on from the first input no run covered */
        for (; j + DT_RUN <= Kin; j += DT_RUN)
#pragma GCC unroll 16
            for (r = 0; r < R; r++) {
                DT_UNROLL_RUN
                for (int u = 0; u < DT_RUN; u += DT_VL) {
                    if ((((j + u) * ES) & 63) == 0) _mm_prefetch((const char *)(w + r * rs) + (long)(j + u) * ES + pf, PF_HINT);
                    a[r] = DT_VFMA(DT_WAT(r, j + u), DT_VLOAD(x[0] + j + u), a[r]);
                }
            }
    }
    for (; j + DT_VL <= Kin; j += DT_VL) {
        DT_VEC xv[DT_TOK];
        for (t = 0; t < NT; t++) xv[t] = DT_VLOAD(x[t] + j);
        for (r = 0; r < R; r++) {
            if (PK ? ((uintptr_t)WP(r, j) & 63) == 0 : ((j * ES) & 63) == 0) _mm_prefetch((const char *)WP(r, j) + pf, PF_HINT);
            const DT_VEC wv = DT_WAT(r, j);
            for (t = 0; t < NT; t++) a[r * NT + t] = DT_VFMA(wv, xv[t], a[r * NT + t]);
        }
    }
    sum_lanes(a, out);
#if DT_A > DT_N /* AVX2's 2 x 5 and 4 x 3 tiles: the last sums by the same tree (sum4_256 is sum_lanes's) */
    if (R * NT > DT_N) _mm_storeu_ps(out + DT_N, sum4_256(a[8], a[9], a[10], a[11]));
#endif
#else
    /* portable: eight partial sums per row x token (as vector lanes would; the compiler may
     * vectorise them) — one running sum over a long row would lose more to rounding */
    for (r = 0; r < R; r++)
        for (t = 0; t < NT; t++) {
            float lane[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f}, sum = 0.0f;
            int jj = 0;
            for (; jj + 8 <= Kin; jj += 8)
                for (int l = 0; l < 8; l++) lane[l] += WS(r, jj + l) * x[t][jj + l];
            for (int l = 0; l < 8; l++) sum += lane[l];
            out[r * NT + t] = sum;
            j = jj;
        }
#endif
    for (r = 0; r < R; r++)
        for (t = 0; t < NT; t++) acc[r * ald + t] = out[r * NT + t];
    for (; j < Kin; j++) /* the tail */
        for (r = 0; r < R; r++) {
            const float wj = WS(r, j);
            for (t = 0; t < NT; t++) acc[r * ald + t] += wj * x[t][j];
        }
    (void)ES;
#undef WP
#undef WS
}

/* one tile of RT rows from w x the m (1..4) tokens x[] into acc[r * ROWS_LD + t] */
static inline __attribute__((always_inline)) void dense_tile_m(const uint8_t *w, long rs, const int FMT, int Kin,
                                                               const int RT, const float *const *x, int m, float *acc,
                                                               const int STREAM) {
    if (m == 4) dense_tile(w, rs, FMT, Kin, RT, x, 4, acc, ROWS_LD, STREAM);
    else if (m == 3) dense_tile(w, rs, FMT, Kin, RT, x, 3, acc, ROWS_LD, STREAM);
    else if (m == 2) dense_tile(w, rs, FMT, Kin, RT, x, 2, acc, ROWS_LD, STREAM);
    else dense_tile(w, rs, FMT, Kin, RT, x, 1, acc, ROWS_LD, STREAM);
}

/* acc[r * ROWS_LD + t] for R (1..ROW_BLOCK) adjacent rows (stride rs bytes) and n tokens (rows x0 +
 * t*ld). Tile shapes, measured (benchmarks/results/dense_tiles.md):
 * - four or more tokens: tiles of DT_N / 4 rows (rows under 1024 inputs: the reductions and loop
 *   set-up rival their multiply-adds) or 2 rows (longer rows, streamed from memory), each serving
 *   every group of four tokens before the next rows load; on AVX2 (2-row tiles, DT_TOK 5) a last
 *   lone token joins the group before it: 5 tokens are one 2 x 5 tile, not 4 + 1, whose one-token
 *   tile loads and widens each weight vector for a single multiply-add (one thread on a Zen3, the
 *   demo's head at T = 5: bf16 1.29x, fp32 1.51x; T = 9: 1.16x, 1.24x; other T within 2%;
 *   benchmarks/results/dense_tail_s26.json). A 2 x 6 tile for two-token tails measured 0.77-0.84x
 *   (its 6 inputs, 2 weights and 12 sums overflow AVX2's 16 registers) and 3 + 3 the same as 4 + 2.
 *   An expert's token count at B = 16 (2-8 with top-4 of 32) lands on such tails;
 * - three tokens: 4 rows (on AVX2 12 sums, DT_A: 4 rows share each input load and reduction; at
 *   T = 3 the demo's bf16 head and q/k/v 1.10-1.24x, Qwen3-30B-A3B's bf16 o_proj from DRAM 1.22x and
 *   expert gate/up 1.07x, fp32 0.96-1.02x; a variant keeping fp32 at 2 x 3 measured bf16 0.80-0.87x
 *   with near-identical bf16 code: loop placement, so read these within ~10%); AVX-512 takes 4 rows
 *   for long rows too (DT_LONG_RT; so do its tiles of four tokens and more), where 2 measured slower on
 *   an AVX-512 Xeon (benchmarks/results/long_rows_s39.json: experts from DRAM at 3-4 tokens each,
 *   bf16 at 3 / 4 tokens: zero-padded demo 9.6 / 8.9 -> 10.1 / 9.6 GB/s, Qwen3-Next 10.4 / 9.8 ->
 *   11.1 / 10.7, Qwen3-30B-A3B 11.0 / 10.6 -> 11.2 / 11.0; 6 tokens 1.06-1.13x, fp32 1.01-1.13x, 1-2
 *   tokens unchanged, bit-equal; the padded demo end to end B=16 LYNX 1.045x, exact 1.01x); AVX2
 *   keeps 2 (its 16 registers); two: DT_N / 2 rows (short) or 4 (long);
 * - one token: 4 rows (16 at once measured 0.91x end to end at B = 1).
 * A last partial tile runs row by row. */
static inline __attribute__((always_inline)) void dense_tiles(const uint8_t *w, long rs, const int FMT, int Kin, int R,
                                                              const float *x0, long ld, int n, float *acc,
                                                              const int STREAM) {
    /* a tile's first row r: row-major, or its slot in packed rows (tiles never straddle a group of
     * PK_ROWS: ROW_BLOCK and the tiles of 4 and 2 rows keep to them; wider ones start on one) */
    const long ES = FMT == FMT_F32 ? 4 : FMT == FMT_BF16 ? 2 : 1;
    const int PKD = STREAM == ROWS_PACKED ? ROWS_PACKED : 0;
#define TB(r) (w + (PKD ? PK_OFF(r, 0, Kin, ES) : (long)(r) * rs))
    const float *x[DT_TOK];
    const int wide = Kin < 1024;
    for (int i = 0; i < n && i < 4; i++) x[i] = x0 + i * ld;
    if (n < 4) { /* one token group: tiles of RT rows */
        const int RT = n == 1 ? 4 : n == 2 ? (wide ? DT_N / 2 : 4) : (wide || DT_N == 8 ? 4 : DT_LONG_RT);
        for (int r = 0; r < R;) {
            const int one = R - r < RT;
            if (one) dense_tile_m(TB(r), rs, FMT, Kin, 1, x, n, acc + r * ROWS_LD, STREAM);
            else if (n == 1) dense_tile(TB(r), rs, FMT, Kin, 4, x, 1, acc + r * ROWS_LD, ROWS_LD, STREAM);
            else if (n == 2 && wide) dense_tile(TB(r), rs, FMT, Kin, DT_N / 2, x, 2, acc + r * ROWS_LD, ROWS_LD, STREAM);
            else if (n == 2) dense_tile(TB(r), rs, FMT, Kin, 4, x, 2, acc + r * ROWS_LD, ROWS_LD, STREAM);
            else if (RT == 4) dense_tile(TB(r), rs, FMT, Kin, 4, x, 3, acc + r * ROWS_LD, ROWS_LD, STREAM);
            else dense_tile(TB(r), rs, FMT, Kin, 2, x, 3, acc + r * ROWS_LD, ROWS_LD, STREAM);
            r += one ? 1 : RT;
        }
        return;
    }
    if (PKD) { /* packed: each group of four rows serves the tokens three at a time (4 x 3 tiles, four as
                * 3 + 1), from cache after the first three */
        for (int r = 0; r < R; r += PK_ROWS) { /* R whole groups: lynx_moe takes no other packed shape */
            for (int t = 0; t < n;) {
                const int m = n - t > 3 ? 3 : n - t;
                for (int i = 0; i < m; i++) x[i] = x0 + (t + i) * ld;
                float *a = acc + r * ROWS_LD + t;
                if (m == 3) dense_tile(TB(r), rs, FMT, Kin, 4, x, 3, a, ROWS_LD, PKD);
                else if (m == 2) dense_tile(TB(r), rs, FMT, Kin, 4, x, 2, a, ROWS_LD, PKD);
                else dense_tile(TB(r), rs, FMT, Kin, 4, x, 1, a, ROWS_LD, PKD);
                t += m;
            }
        }
        return;
    }
    const int RT = wide ? DT_N / 4 : DT_LONG_RT; /* each tile's rows serve every token group before the next load */
    const int n4 = DT_TOK > 4 && n % 4 == 1 ? n - 5 : n; /* tokens in groups of four: a one-token tail joins (above) */
    for (int r = 0; r < R;) {
        const int one = R - r < RT;
        for (int t = 0; t < n4; t += 4) {
            const int m = n4 - t < 4 ? n4 - t : 4;
            for (int i = 0; i < m; i++) x[i] = x0 + (t + i) * ld;
            float *a = acc + r * ROWS_LD + t;
            /* not streamed: the group of four before has brought these rows into cache, where
             * the whole-row loop reads slower (Mixtral-shaped bf16 experts at B = 16: 0.92x) */
            if (one) dense_tile_m(TB(r), rs, FMT, Kin, 1, x, m, a, 0);
            else if (wide) dense_tile_m(TB(r), rs, FMT, Kin, DT_N / 4, x, m, a, 0);
            else dense_tile_m(TB(r), rs, FMT, Kin, DT_LONG_RT, x, m, a, 0);
        }
#if DT_TOK > 4
        if (n4 < n) { /* the last five tokens in one tile (RT is 2 here) */
            for (int i = 0; i < 5; i++) x[i] = x0 + (n4 + i) * ld;
            if (one) dense_tile(TB(r), rs, FMT, Kin, 1, x, 5, acc + r * ROWS_LD + n4, ROWS_LD, STREAM);
            else dense_tile(TB(r), rs, FMT, Kin, 2, x, 5, acc + r * ROWS_LD + n4, ROWS_LD, STREAM);
        }
#endif
        r += one ? 1 : RT;
    }
#undef TB
}
static __attribute__((noinline)) void dense_f32(const uint8_t *w, long rs, int Kin, int R, const float *x0, long ld,
                                                int n, float *acc) {
    dense_tiles(w, rs, FMT_F32, Kin, R, x0, ld, n, acc, 0);
}
static __attribute__((noinline)) void dense_f32_stream(const uint8_t *w, long rs, int Kin, int R, const float *x0,
                                                       long ld, int n, float *acc) {
    dense_tiles(w, rs, FMT_F32, Kin, R, x0, ld, n, acc, 1);
}
static __attribute__((noinline)) void dense_bf16(const uint8_t *w, long rs, int Kin, int R, const float *x0, long ld,
                                                 int n, float *acc) {
    dense_tiles(w, rs, FMT_BF16, Kin, R, x0, ld, n, acc, 0);
}
static __attribute__((noinline)) void dense_bf16_stream(const uint8_t *w, long rs, int Kin, int R, const float *x0,
                                                        long ld, int n, float *acc) {
    dense_tiles(w, rs, FMT_BF16, Kin, R, x0, ld, n, acc, 1);
}
static __attribute__((noinline)) void dense_f32_packed(const uint8_t *w, long rs, int Kin, int R, const float *x0,
                                                       long ld, int n, float *acc) {
    dense_tiles(w, rs, FMT_F32, Kin, R, x0, ld, n, acc, ROWS_PACKED);
}
static __attribute__((noinline)) void dense_bf16_packed(const uint8_t *w, long rs, int Kin, int R, const float *x0,
                                                        long ld, int n, float *acc) {
    dense_tiles(w, rs, FMT_BF16, Kin, R, x0, ld, n, acc, ROWS_PACKED);
}
static __attribute__((noinline)) void dense_i8(const uint8_t *w, long rs, int Kin, int R, const float *x0, long ld,
                                               int n, float *acc) {
    dense_tiles(w, rs, FMT_I8, Kin, R, x0, ld, n, acc, 0);
}

/* acc[r * ROWS_LD + t] for R (1..ROW_BLOCK) adjacent rows (stride rs bytes) and n tokens (rows x0 + t*ld).
 * stream: rows that come from DRAM at each use (the experts: a step reads a few of many) rather than
 * from cache (projections, the head, the KV cache of a small model): only such fp32 rows take the
 * whole-row loop (ROW_WHOLE_F32_AVX2), which streams DRAM faster but runs cache-resident rows slower;
 * ROWS_PACKED: w is the first row's slot in packed rows (fp32 or bf16). */
static void dense_block(const uint8_t *w, long rs, int fmt, int Kin, int R, const float *x0, long ld, int n,
                        float *acc, int stream) {
    if (stream == ROWS_PACKED && fmt == FMT_F32) dense_f32_packed(w, rs, Kin, R, x0, ld, n, acc);
    else if (stream == ROWS_PACKED) dense_bf16_packed(w, rs, Kin, R, x0, ld, n, acc);
    else if (fmt == FMT_F32 && stream) dense_f32_stream(w, rs, Kin, R, x0, ld, n, acc);
    else if (fmt == FMT_F32) dense_f32(w, rs, Kin, R, x0, ld, n, acc);
    else if (fmt == FMT_I8) dense_i8(w, rs, Kin, R, x0, ld, n, acc);
    else if (stream) dense_bf16_stream(w, rs, Kin, R, x0, ld, n, acc);
    else dense_bf16(w, rs, Kin, R, x0, ld, n, acc);
}

/* --- bf16 rows x bf16 activations (vdpbf16ps) ----------------------------------------------------
 *
 * On a CPU with AVX512-BF16 a bf16 weight row can meet the activations rounded to bf16 in
 * vdpbf16ps: 32 multiply-adds an instruction (pairs of inputs into each of 16 fp32 lanes), no
 * widening, where the fp32 rows widen each weight vector and multiply 16 at a time. The activations'
 * rounding (2^-9 relative, as llama.cpp's BF16 rows and torch's bf16 matmuls round them) is the
 * approximation, chosen per engine (bf16_act, native.default_bf16_act): the callers pass act
 * ACT_BF16, and the inputs are rounded once per call (to_bf16_rows), not per tile. Each row x
 * token: one accumulator over the inputs' 32-wide steps in order (the last masked), then
 * sum_lanes's tree — the same in any tile, so a token's result does not depend on its batch. */
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) /* BW: the masked 16-bit loads */
#define BF16_DP 1
#else
#define BF16_DP 0
#endif
/* 1 when this build runs bf16 rows on bf16 activations (ACT_BF16), else 0 (they stay fp32) */
int lynx_bf16_dp(void) { return BF16_DP; }
/* 1 where ACT_BF16 measured faster than the fp32 rows: AVX512-BF16 on an AMD CPU (a Zen4 EPYC, one
 * thread: in L1 22.5 multiply-adds a cycle against 11.4 for the widened fp32 rows; the demo's
 * decode 1.10-1.38x, benchmarks/results/bf16_act_s42.md) — for a model whose weights stay in the
 * last-level cache (native.default_bf16_act). Intel's AVX512-BF16 is unmeasured. */
int lynx_bf16_pays(void) {
#if BF16_DP
    unsigned a, b, c, d;
    return __get_cpuid(0, &a, &b, &c, &d) && b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u; /* "AuthenticAMD" */
#else
    return 0;
#endif
}
/* dst [n, Kin] bf16 <- x [n, Kin] fp32 (row stride ld), round to nearest even */
static void to_bf16_rows(const float *x, long ld, long n, int Kin, uint16_t *dst) {
    for (long t = 0; t < n; t++) {
        const float *xt = x + t * ld;
        uint16_t *d = dst + t * Kin;
        int j = 0;
#if BF16_DP
        for (; j + 16 <= Kin; j += 16) _mm256_storeu_si256((__m256i *)(d + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xt + j)));
#endif
        for (; j < Kin; j++) { /* round to nearest even (NaN stays NaN) */
            uint32_t u;
            memcpy(&u, xt + j, 4);
            d[j] = (u & 0x7fffffff) > 0x7f800000 ? (uint16_t)((u >> 16) | 0x40) : (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
        }
    }
}
/* x [n] <- x rounded to bf16 (nearest even), kept fp32: the same inputs dp_block's rows see, for the
 * fp32 rows (streamed experts under ACT_BF16) */
static void round_to_bf16(float *x, long n) {
    long j = 0;
#if BF16_DP
    for (; j + 16 <= n; j += 16)
        _mm512_storeu_ps(x + j, _mm512_castsi512_ps(_mm512_slli_epi32(
                                    _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + j))), 16)));
#endif
    for (; j < n; j++) {
        uint16_t b;
        to_bf16_rows(x + j, 1, 1, 1, &b);
        const uint32_t u = (uint32_t)b << 16;
        memcpy(x + j, &u, 4);
    }
}
#if BF16_DP
static inline __attribute__((always_inline)) void dp_tile(const uint8_t *w, const long rs, const int Kin, const int R,
                                                          const uint16_t *const *x, const int NT, float *acc,
                                                          const int STREAM) {
    __m512 a[16];
    for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();
    const long pf = tile_ahead(R * rs, TILE_PREFETCH);
    int j = 0;
    for (; j + 32 <= Kin; j += 32) {
        __m512bh xv[4];
        for (int t = 0; t < NT; t++) xv[t] = (__m512bh)_mm512_loadu_si512(x[t] + j);
        for (int r = 0; r < R; r++) {
            _mm_prefetch((const char *)(w + r * rs) + (long)j * 2 + pf, PF_HINT);
            if (STREAM) _mm_prefetch((const char *)(w + r * rs) + (long)j * 2 + pf + 64, PF_HINT); /* see dp_block */
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + r * rs + (long)j * 2);
            for (int t = 0; t < NT; t++) a[r * NT + t] = _mm512_dpbf16_ps(a[r * NT + t], wv, xv[t]);
        }
    }
    if (j < Kin) { /* the last inputs, masked: zero pairs add nothing */
        const __mmask32 mk = (__mmask32)((1ull << (Kin - j)) - 1);
        __m512bh xv[4];
        for (int t = 0; t < NT; t++) xv[t] = (__m512bh)_mm512_maskz_loadu_epi16(mk, x[t] + j);
        for (int r = 0; r < R; r++) {
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mk, w + r * rs + (long)j * 2);
            for (int t = 0; t < NT; t++) a[r * NT + t] = _mm512_dpbf16_ps(a[r * NT + t], wv, xv[t]);
        }
    }
    float out[16];
    sum_lanes(a, out);
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++) acc[r * ROWS_LD + t] = out[r * NT + t];
}
#endif
/* acc[r * ROWS_LD + t] for R (1..ROW_BLOCK) adjacent bf16 rows (stride rs bytes) and n tokens whose
 * bf16 inputs are rows xb0 + t * ld: tokens in groups of four, rows in tiles of four (16 sums).
 * stream: the rows come from DRAM at each use (the projections of a model whose weights outgrow the
 * last-level cache: build._bf16_activations): each step prefetches a second line, one further on.
 * Measured on a Zen4, one thread, one token, GB/s of bf16 rows, the fp32 rows -> these: from DRAM
 * without it 1024 inputs 22.5 -> 20.1 (768: 20.6 -> 19.2), with it 22.1 -> 22.2, 768 20.3 -> 20.5,
 * 4096 20.0 -> 21.5, four tokens 17.5 -> 19.3; from cache it costs (the demo's 4096 x 256 head
 * 57 -> 51 GB/s), so rows that stay in cache go without it (57 against the fp32 rows' 41; 36
 * against 20 at four tokens). Streamed experts run the fp32 rows on the rounded inputs: in
 * lynx_moe's 16-row items these tiles read them slower still (the random 1.28 GB qwen3_moe's decode 0.79-0.91x at B = 1,
 * 0.96-1.04x at B = 16, with or without the second prefetch; its projections alone on these tiles
 * 0.99x and 1.10x). Runs of a row before the next (the fp32 rows' ROW_RUN), a longer distance and
 * T0 did not help either. Shape-dependent, not taken: the zero-padded demo's streamed experts (256-
 * and 8192-input rows) on these tiles ran 1.15x at 16 tokens (1.2x with LYNX's ~3 tokens an expert),
 * 0.99-1.02x at 1-4 — where the random model's 1024- and 768-input rows lose at one token. */
static inline __attribute__((always_inline)) void dp_tiles(const uint8_t *w, long rs, int Kin, int R,
                                                           const uint16_t *xb0, long ld, int n, float *acc,
                                                           const int STREAM) {
#if BF16_DP
    const uint16_t *x[4];
#define DP_TILE(RR, M, r0_, t0_) dp_tile(w + (long)(r0_) * rs, rs, Kin, RR, x, M, acc + (r0_) * ROWS_LD + (t0_), STREAM)
#define DP_TILE_RM(RR, M, r0_, t0_) TILE_M(DP_TILE, RR, M, r0_, t0_)
    for (int t0 = 0; t0 < n; t0 += 4) {
        const int m = n - t0 < 4 ? n - t0 : 4;
        for (int i = 0; i < m; i++) x[i] = xb0 + (long)(t0 + i) * ld;
        for (int r0 = 0; r0 < R; r0 += 4) {
            const int rr = R - r0 < 4 ? R - r0 : 4;
            TILE_R(DP_TILE_RM, rr, m, r0, t0);
        }
    }
#undef DP_TILE_RM
#undef DP_TILE
#else
    (void)w; (void)rs; (void)Kin; (void)R; (void)xb0; (void)ld; (void)n; (void)acc; (void)STREAM;
#endif
}
static __attribute__((noinline)) void dp_cached(const uint8_t *w, long rs, int Kin, int R, const uint16_t *xb0, long ld,
                                                int n, float *acc) {
    dp_tiles(w, rs, Kin, R, xb0, ld, n, acc, 0);
}
static __attribute__((noinline)) void dp_stream(const uint8_t *w, long rs, int Kin, int R, const uint16_t *xb0, long ld,
                                                int n, float *acc) {
    dp_tiles(w, rs, Kin, R, xb0, ld, n, acc, 1);
}
static void dp_block(const uint8_t *w, long rs, int Kin, int R, const uint16_t *xb0, long ld, int n, float *acc,
                     int stream) {
    if (stream) dp_stream(w, rs, Kin, R, xb0, ld, n, acc);
    else dp_cached(w, rs, Kin, R, xb0, ld, n, acc);
}

/* --- AMX bf16 tiles (bf16 experts on a CPU with AMX-BF16) --------------------------------------
 *
 * tdpbf16ps multiplies a 16 x 32 tile of bf16 weights (16 rows of an expert, 32 inputs: a plain
 * row-major load, stride one row) by a 32 x n tile of bf16 activations laid out in input pairs
 * ([16 pairs][n tokens][2]) into 16 x n fp32 sums: 8192 multiply-adds an instruction against 16 for
 * an AVX-512 FMA. Opt-in (LYNX_EDGE_AMX=1): measured against the AVX-512 rows on a Xeon
 * (benchmarks/results/amx_experts_s39.json), experts from DRAM, the tiles lose at decode's 1-4 tokens
 * an expert (0.76-1.00x: each tile load of 16 rows waits on memory, where the row loop keeps more
 * misses in flight) and win from 6 (1.1-1.2x) to 32 (1.6-2.3x). The activations are fp32 here, so each is split
 * exactly into three bf16 parts, x = hi + mid + lo (each the fp32 remainder of the ones before it
 * rounded to bf16: 8 + 8 + 8 significant bits), and the tile sums the three products (bf16 x bf16
 * products are exact in fp32); where every input of a pass is already a bf16 value (a bf16 model's
 * normed hidden state) mid and lo are zero and one part runs. The sums are fp32 in the tile's own
 * order — not the row kernels' 16-lane order — so a result differs from theirs within fp32 rounding;
 * every token of a row runs this path at any token count, so a row's result does not depend on the
 * batch. Linux only: the process asks the kernel for the tile state once (lynx_amx_enable). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define AMX_PATH 1
#include <sys/syscall.h>
#include <unistd.h>
typedef struct {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tilecfg_t;
#else
#define AMX_PATH 0
#endif
#define AMX_PARTS 3 /* hi, mid, lo */
static int g_amx = 0; /* lynx_amx_enable's answer */
#ifndef AMX_PF_SHORT
#define AMX_PF_SHORT 16384
#endif
#ifndef AMX_PF_LONG
#define AMX_PF_LONG 1024
#endif
#ifndef AMX_HINT
#define AMX_HINT PF_HINT
#endif

/* on: use the AMX tiles where they apply (asks Linux for the tile state: arch_prctl
 * ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); 0 turns them off → whether they are on */
int lynx_amx_enable(int on) {
#if AMX_PATH
    g_amx = on && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return g_amx;
#else
    (void)on;
    return 0;
#endif
}

#if AMX_PATH
/* the pair layout of n rows of X (fp32, stride ld, Kin % 32 == 0) in AMX_PARTS parts:
 * dst[p][k / 2][t][k % 2] (n tokens a pair row), part p at dst + p * Kin * n; → 1 when every input
 * is a bf16 value (the parts after hi are zero), else AMX_PARTS */
static int amx_pairs(const float *X, long ld, int Kin, int n, uint16_t *dst) {
    const long plane = (long)Kin * n;
    __m512 any = _mm512_setzero_ps();
    for (int t = 0; t < n; t++)
        for (int k = 0; k < Kin; k += 16) {
            __m512 v = _mm512_loadu_ps(X + t * ld + k);
            for (int p = 0; p < AMX_PARTS; p++) {
                const __m256bh b = _mm512_cvtneps_pbh(v);
                const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)b), 16));
                uint32_t pr[8];
                _mm256_storeu_si256((__m256i *)pr, (__m256i)b);
                uint32_t *d = (uint32_t *)(dst + p * plane) + (long)(k / 2) * n + t;
                for (int i = 0; i < 8; i++) d[(long)i * n] = pr[i];
                v = _mm512_sub_ps(v, back);
                if (p == 0) any = _mm512_or_ps(any, v);
            }
        }
    return _mm512_cmpneq_ps_mask(any, _mm512_setzero_ps()) ? AMX_PARTS : 1;
}

/* each of the A active experts' slots (rows cnt[e] .. cnt[e + 1] of X [S, Kin], expert-major) in
 * amx_pairs's layout at dst + cnt[e] * Kin * AMX_PARTS → the parts the layer's inputs need (the most
 * any expert needs: an expert whose inputs are bf16 values adds exact zeros for the others) */
static int amx_layer_pairs(const float *X, int Kin, const int64_t *cnt, const int64_t *act, long A, uint16_t *dst) {
    int parts = 1;
    for (long a = 0; a < A; a++) {
        const int64_t r0 = cnt[act[a]], n = cnt[act[a] + 1] - r0;
        const int p = amx_pairs(X + r0 * Kin, Kin, Kin, (int)n, dst + r0 * (long)Kin * AMX_PARTS);
        parts = p > parts ? p : parts;
    }
    return parts;
}

/* acc[r * ROWS_LD + t - tb] for 16 adjacent bf16 rows at w (stride rs bytes, Kin % 32 == 0) and
 * tokens [tb, tb + m) of the n whose pairs amx_pairs laid out at xv with `parts` parts; the tokens in
 * tiles of up to 16 columns (m <= ROWS_LD).
 * stream: rows that come from DRAM: short rows (a block of 16 within 16 KB) prefetch the blocks ahead
 * in address order, long ones each row ahead of its own read. */
static void amx_rows(const uint8_t *w, long rs, int Kin, const uint16_t *xv, int parts, int n, int tb, int m,
                     float *acc, int stream) {
    const long plane = (long)Kin * n;
    const int steps = Kin / 32, shortrows = 16 * rs <= 16384;
    for (int t0 = tb; t0 < tb + m; t0 += 16) {
        const int nc = tb + m - t0 < 16 ? tb + m - t0 : 16;
        tilecfg_t cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        cfg.rows[0] = 16, cfg.colsb[0] = (uint16_t)(4 * nc); /* sums [16 rows][nc] fp32 */
        cfg.rows[1] = 16, cfg.colsb[1] = 64;                 /* weights [16 rows][32] bf16 */
        for (int p = 0; p < parts; p++) cfg.rows[2 + p] = 16, cfg.colsb[2 + p] = (uint16_t)(4 * nc); /* [16 pairs][nc][2] */
        _tile_loadconfig(&cfg);
        _tile_zero(0);
        /* this chunk's pairs: pair row k of token t0 + j at xv + p * plane + (k * n + t0 + j) * 2 */
        for (int s = 0; s < steps; s++) {
            if (stream) {
                if (shortrows)
                    for (int l = 0; l < 16; l++) _mm_prefetch((const char *)w + AMX_PF_SHORT + (long)s * 1024 + 64 * l, AMX_HINT);
                else
                    for (int r = 0; r < 16; r++) _mm_prefetch((const char *)w + r * rs + (long)s * 64 + AMX_PF_LONG, AMX_HINT);
            }
            _tile_loadd(1, w + (long)s * 64, rs);
            const uint16_t *b = xv + ((long)s * 16 * n + t0) * 2;
            _tile_loadd(2, b, 4L * n);
            _tile_dpbf16ps(0, 1, 2);
            if (parts > 1) {
                _tile_loadd(3, b + plane, 4L * n);
                _tile_dpbf16ps(0, 1, 3);
                _tile_loadd(4, b + 2 * plane, 4L * n);
                _tile_dpbf16ps(0, 1, 4);
            }
        }
        _tile_stored(0, acc + (t0 - tb), ROWS_LD * sizeof(float));
    }
    _tile_release();
}
#endif

/* --- MXFP4 rows (gpt-oss) ---------------------------------------------------------------------- */

static inline float e8m0(uint8_t s) { /* 2^(s - 127); s = 0 is the subnormal 2^-127 */
    union { uint32_t u; float f; } c = {s ? (uint32_t)s << 23 : 0x00400000u};
    return c.f;
}

/* acc[t] = sum over blocks of 32 inputs: 2^(s_b - 127) * sum_j e2m1(q_j) * x_t[j], for one row of
 * Kin/2 code bytes q (low nibble = even input) and Kin/32 scale bytes sc; xe/xo as dot_rows_h. */
static inline __attribute__((always_inline)) void mx_rows(const uint8_t *q, const uint8_t *sc, int Kin,
                                                          const float *const *xe, const float *const *xo,
                                                          const int NT, float *acc) {
    const int nb = Kin / 32;
    int t;
#if defined(__AVX512F__)
    const __m512 lut = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                      -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
    const __m512i m15 = _mm512_set1_epi32(15);
    __m512 tot[4];
    for (t = 0; t < NT; t++) tot[t] = _mm512_setzero_ps();
    for (int g = 0; g < nb; g++) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 16 * g)));
        const __m512 we = _mm512_permutexvar_ps(_mm512_and_si512(b, m15), lut);
        const __m512 wo = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut);
        const __m512 sv = _mm512_set1_ps(e8m0(sc[g]));
        for (t = 0; t < NT; t++) {
            const __m512 p = _mm512_fmadd_ps(wo, _mm512_loadu_ps(xo[t] + 16 * g),
                                             _mm512_mul_ps(we, _mm512_loadu_ps(xe[t] + 16 * g)));
            tot[t] = _mm512_fmadd_ps(sv, p, tot[t]);
        }
    }
    for (t = 0; t < NT; t++) acc[t] = _mm512_reduce_add_ps(tot[t]);
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 lut = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f); /* magnitudes */
    const __m256i m15 = _mm256_set1_epi32(15);
    __m256 tot[4];
    for (t = 0; t < NT; t++) tot[t] = _mm256_setzero_ps();
    for (int g = 0; g < nb; g++) {
        const __m256 sv = _mm256_set1_ps(e8m0(sc[g]));
        for (int h = 0; h < 2; h++) {
            const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 16 * g + 8 * h)));
            const __m256i lo = _mm256_and_si256(b, m15), hi = _mm256_srli_epi32(b, 4);
            /* magnitude from the low 3 bits (permutevar reads idx & 7), sign from bit 3 */
            const __m256 we = _mm256_xor_ps(_mm256_permutevar8x32_ps(lut, lo),
                                            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(lo, 3), 31)));
            const __m256 wo = _mm256_xor_ps(_mm256_permutevar8x32_ps(lut, hi),
                                            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(hi, 3), 31)));
            for (t = 0; t < NT; t++) {
                const __m256 p = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xo[t] + 16 * g + 8 * h),
                                                 _mm256_mul_ps(we, _mm256_loadu_ps(xe[t] + 16 * g + 8 * h)));
                tot[t] = _mm256_fmadd_ps(sv, p, tot[t]);
            }
        }
    }
    for (t = 0; t < NT; t++) {
        const __m128 v = _mm_add_ps(_mm256_castps256_ps128(tot[t]), _mm256_extractf128_ps(tot[t], 1));
        const __m128 u = _mm_add_ps(v, _mm_movehl_ps(v, v));
        acc[t] = _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps(u, u, 1)));
    }
#else
    static const float lut[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                  -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
    for (t = 0; t < NT; t++) {
        float a = 0.0f;
        for (int g = 0; g < nb; g++) {
            float p = 0.0f;
            for (int j = 0; j < 16; j++)
                p += lut[q[16 * g + j] & 15] * xe[t][16 * g + j] + lut[q[16 * g + j] >> 4] * xo[t][16 * g + j];
            a += e8m0(sc[g]) * p;
        }
        acc[t] = a;
    }
#endif
}

static void mx_slots(const uint8_t *q, const uint8_t *sc, int Kin, const float *xe0, const float *xo0, long ld, int n,
                     float *acc) {
    const float *xe[4], *xo[4];
    int t = 0;
    for (; t + 4 <= n; t += 4) {
        for (int i = 0; i < 4; i++) { xe[i] = xe0 + (t + i) * ld; xo[i] = xo0 + (t + i) * ld; }
        mx_rows(q, sc, Kin, xe, xo, 4, acc + t);
    }
    const int r = n - t;
    for (int i = 0; i < r; i++) { xe[i] = xe0 + (t + i) * ld; xo[i] = xo0 + (t + i) * ld; }
    if (r == 3) mx_rows(q, sc, Kin, xe, xo, 3, acc + t);
    else if (r == 2) mx_rows(q, sc, Kin, xe, xo, 2, acc + t);
    else if (r == 1) mx_rows(q, sc, Kin, xe, xo, 1, acc + t);
}

/* MXFP4 rows against int16 activations (ACT_Q16, the INT4 rows' default mode on AVX2). The fp32 rows
 * above widen every code through a float table and a sign xor: bound by those vector ops, not by
 * memory (a gpt-oss-20b-shaped layer on an AMD EPYC Zen3, one thread: ~4 GB/s of codes against the
 * ~18 GB/s the memory gives). Doubled, the e2m1 values are the integers 0, 1, 2, 3, 4, 6, 8, 12 (sign
 * from bit 3), so one byte shuffle turns 16 code nibbles into int8 weights, and a token takes a block's
 * 32 products with two vpmaddwd against its int16 inputs (quant_q16 over blocks of 32: the block's own
 * scale d), exact in int32 (|12 * 32767| * 32 < 2^31); the block's integer sum meets 2^(s - 128) * d
 * once. The only rounding is the activations' (as q16_tile: 2^-16 of each block's largest input).
 * Each token sums the same way whatever NT (batch-invariant). */
static const int8_t MX_I8[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline float e8m0_half(uint8_t s) { /* 2^(s - 128), the doubled codes' scale: s 1 and 0 subnormal */
    union { uint32_t u; float f; } c = {s > 1 ? (uint32_t)(s - 1) << 23 : s ? 0x00400000u : 0x00200000u};
    return c.f;
}

#if defined(__AVX2__) && defined(__FMA__)
/* e8m0_half of eight scale bytes, the same values: the bytes as exponents, halved; s = 0 (the exponent
 * field's 0) is 2^-128 */
static inline __m256 e8m0_half8(const uint8_t *sc) {
    const __m256i e = _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc)), 23);
    return _mm256_max_ps(_mm256_mul_ps(_mm256_castsi256_ps(e), _mm256_set1_ps(0.5f)), _mm256_set1_ps(0x1p-128f));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* mxq_rows takes two blocks a step: one 256-bit load holds both blocks' 32 code bytes, two shuffles
 * give their 64 int8 weights (low lane block g, high lane g + 1; even inputs from the low nibbles, odd
 * from the high), and the weights widen to int16 in place by shifts (a word's low byte: slli 8, srai 8;
 * its high byte: srai 8) instead of a cross-lane vpmovsxbw per 16. Each lane then holds one block's
 * products (each lane 8 of them, |12 * 32767| * 8 < 2^24: its conversion to fp32 exact), so one
 * conversion and one multiply-add with (d_g x4, d_g+1 x4) apply both blocks' scales: the row's two
 * e8m0 values from one permute of its eight, times the token's block scales, which mx_lanes lays out
 * four times over once a layer (rebuilding them per row and token cost a fifth of a four-token step).
 * The activations must sit in that order: per pair of blocks, each plane's 32 int16 values as
 * [g: 0 2 .. 14 | g+1: 0 2 .. 14 | g: 1 3 .. 15 | g+1: 1 3 .. 15] (mx16_order after quant_q16; a last
 * unpaired block keeps its order and runs alone). Against the one-block step (vpmovsxbw, one scale
 * multiply-add per block) on an AMD EPYC Zen3 (benchmarks/results/mxfp4_pairs_s29.json): in cache
 * 1.57 -> 1.16 ns per block and token; a gpt-oss-20b layer from DRAM, one thread, against the fp32
 * rows' speed: 2.05 -> 2.37x at one token, 1.96 -> 2.29x at four, 1.67 -> 1.84x at sixteen (level
 * with q8 at each); gpt-oss-20b at full size, B = 1, two threads, 1.11x end to end. */
static const int MX_PAIR_IDX[4][8] = {{0, 0, 0, 0, 1, 1, 1, 1}, {2, 2, 2, 2, 3, 3, 3, 3}, {4, 4, 4, 4, 5, 5, 5, 5},
                                      {6, 6, 6, 6, 7, 7, 7, 7}};
#endif

/* rows of h int16 activations (one plane, S rows) into mxq_rows's pair order (above); a no-op where
 * mxq_rows reads them in input order (the portable build) */
static void mx16_order(int16_t *x, long S, int h) {
#if defined(__AVX2__) && defined(__FMA__)
    for (long s = 0; s < S; s++)
        for (int p = 0; p + 32 <= h; p += 32) {
            int16_t *v = x + s * h + p, t[32];
            for (int k = 0; k < 8; k++) {
                t[k] = v[2 * k];
                t[8 + k] = v[16 + 2 * k];
                t[16 + k] = v[2 * k + 1];
                t[24 + k] = v[16 + 2 * k + 1];
            }
            memcpy(v, t, sizeof t);
        }
#else
    (void)x, (void)S, (void)h;
#endif
}

/* each block scale four times over, the lanes of its block in mxq_rows's pair step: out[4 i + l] = d[i]
 * (per activation row, once a layer, so no row of weights rebuilds them per token) */
static void mx_lanes(const float *d, long n, float *out) {
    for (long i = 0; i < n; i++) out[4 * i] = out[4 * i + 1] = out[4 * i + 2] = out[4 * i + 3] = d[i];
}

/* S rows of quant_q16's output for mxq_rows: both planes of xq ([S, Kin/2] each) into mx16_order's
 * order, the block scales d [S, Kin/32] four times over into lanes [S, Kin/8] */
static void mxq_prepare(int16_t *xq, const float *d, long S, int Kin, float *lanes) {
    for (int h = 0; h < 2; h++) mx16_order(xq + h * S * (Kin / 2), S, Kin / 2);
    mx_lanes(d, S * (Kin / 32), lanes);
}

/* acc[t] for one row of Kin/2 code bytes q and Kin/32 scale bytes sc against NT (1..4) tokens' int16
 * codes xe / xo (even / odd inputs, in mx16_order's order) with block scales d (mx_lanes: d[t][4 g]) */
static inline __attribute__((always_inline)) void mxq_rows(const uint8_t *q, const uint8_t *sc, int Kin,
                                                           const int16_t *const *xe, const int16_t *const *xo,
                                                           const float *const *d, const int NT, float *acc) {
    const int nb = Kin / 32;
    int t;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)MX_I8)), m4 = _mm256_set1_epi8(15);
    const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    __m256 tot[4]; /* one chain per token: its pairs' multiply-adds are 4+ cycles apart anyway */
    for (t = 0; t < NT; t++) tot[t] = _mm256_setzero_ps();
    for (int g0 = 0; g0 < nb; g0 += 8) {
        const int gn = nb - g0 < 8 ? nb - g0 : 8;
        float es[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        if (gn < 8) /* the row's last, partial group (e8m0_half8 reads eight) */
            for (int j = 0; j < gn; j++) es[j] = e8m0_half(sc[g0 + j]);
        const __m256 ev = gn == 8 ? e8m0_half8(sc + g0) : _mm256_loadu_ps(es); /* eight blocks' 2^(s - 128) */
        int j = 0;
        for (; j + 2 <= gn; j += 2) {
            const int g = g0 + j;
            if ((g & 3) == 0) _mm_prefetch((const char *)q + 16L * g + PREFETCH, PF_HINT);
            const __m256i b = _mm256_loadu_si256((const __m256i *)(q + 16 * g));
            const __m256i wl = _mm256_shuffle_epi8(lut, _mm256_and_si256(b, m4));
            const __m256i wh = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(b, 4), m4));
            const __m256i le = _mm256_srai_epi16(_mm256_slli_epi16(wl, 8), 8), lo = _mm256_srai_epi16(wl, 8);
            const __m256i he = _mm256_srai_epi16(_mm256_slli_epi16(wh, 8), 8), ho = _mm256_srai_epi16(wh, 8);
            /* the pair's row scales, (2^(s_g - 128) x4, 2^(s_g+1 - 128) x4), met by each token's lanes */
            const __m256 ex = _mm256_permutevar8x32_ps(ev, _mm256_loadu_si256((const __m256i *)MX_PAIR_IDX[j >> 1]));
            for (t = 0; t < NT; t++) {
                const __m256i *ve = (const __m256i *)(xe[t] + 16 * g), *vo = (const __m256i *)(xo[t] + 16 * g);
                const __m256i p = dot16_add(dot16_add(dot16_add(_mm256_madd_epi16(le, _mm256_loadu_si256(ve)), lo,
                                                                _mm256_loadu_si256(ve + 1)), he, _mm256_loadu_si256(vo)),
                                            ho, _mm256_loadu_si256(vo + 1));
                tot[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(ex, _mm256_loadu_ps(d[t] + 4 * g)), tot[t]);
            }
        }
        if (j < gn) { /* the row's last block, unpaired: its 16 even and 16 odd inputs in order */
            const int g = g0 + j;
            const __m128i lut1 = _mm_loadu_si128((const __m128i *)MX_I8), m41 = _mm_set1_epi8(15);
            const __m128i b = _mm_loadu_si128((const __m128i *)(q + 16 * g));
            const __m256i we = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(lut1, _mm_and_si128(b, m41)));
            const __m256i wo = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(lut1, _mm_and_si128(_mm_srli_epi16(b, 4), m41)));
            for (t = 0; t < NT; t++) {
                const __m256i p = dot16_add(_mm256_madd_epi16(we, _mm256_loadu_si256((const __m256i *)(xe[t] + 16 * g))),
                                            wo, _mm256_loadu_si256((const __m256i *)(xo[t] + 16 * g)));
                tot[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(es[j] * d[t][4 * g]), tot[t]);
            }
        }
    }
    reduce_256(tot, zero, NT, acc);
#else
    for (t = 0; t < NT; t++) {
        float a = 0.0f;
        for (int g = 0; g < nb; g++) {
            int p = 0;
            for (int j = 16 * g; j < 16 * g + 16; j++) p += MX_I8[q[j] & 15] * xe[t][j] + MX_I8[q[j] >> 4] * xo[t][j];
            a += (float)p * (e8m0_half(sc[g]) * d[t][4 * g]);
        }
        acc[t] = a;
    }
#endif
}

/* MXFP4 rows against int8 activations (ACT_Q8: llama.cpp's MXFP4 x Q8_0 scheme, approximate). The
 * doubled codes offset by 12 are 0..24, unsigned, so vpmaddubsw multiplies 32 of them with a block's
 * signed int8 inputs at once (pairs summed in int16: |24 * 127 * 2| fits) and vpmaddwd sums on in
 * int32; the offset comes off once per row: 12 * sum over blocks of 2^(s - 128) * d * sum(codes).
 * One byte shuffle and no widening per 16 weights, against mxq_rows' two widenings: ~1.4x its speed
 * in cache. Codes [S, Kin] in blocks of 32 (the block's 16 even inputs, then its 16 odd ones: the
 * order the two nibble shuffles give), d [S, Kin/32], zs [S, Kin/32] each block's code sum. */
static const uint8_t MX_U8[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

/* xq8 / d / zs of S rows of even / odd inputs xe / xo (row stride Kin/2), quant_q8's rule per block */
static void quant_mx8(const float *xe, const float *xo, long S, int Kin, int8_t *xq, float *d, float *zs) {
    const int h = Kin / 2, nb = Kin / 32;
    for (long r = 0; r < S; r++)
        for (int b = 0; b < nb; b++) {
            const float *e = xe + r * h + 16 * b, *o = xo + r * h + 16 * b;
            int8_t *c = xq + r * Kin + 32 * b;
            float amax = 0.0f, id;
            for (int j = 0; j < 16; j++) {
                amax = fabsf(e[j]) > amax ? fabsf(e[j]) : amax;
                amax = fabsf(o[j]) > amax ? fabsf(o[j]) : amax;
            }
            d[r * nb + b] = q8_scale(amax, &id);
            int isum = 0;
            for (int j = 0; j < 16; j++) {
                c[j] = (int8_t)nearbyintf(e[j] * id);
                c[16 + j] = (int8_t)nearbyintf(o[j] * id);
                isum += c[j] + c[16 + j];
            }
            zs[r * nb + b] = (float)isum;
        }
}

/* acc[t] for one row of Kin/2 code bytes q and Kin/32 scale bytes sc against NT (1..4) tokens' codes
 * x8 (quant_mx8's rows) with block scales d and code sums zs */
static inline __attribute__((always_inline)) void mx8_rows(const uint8_t *q, const uint8_t *sc, int Kin,
                                                           const int8_t *const *x8, const float *const *d,
                                                           const float *const *zs, const int NT, float *acc) {
    const int nb = Kin / 32;
    int t;
#if defined(__AVX2__) && defined(__FMA__)
    const __m128i lut = _mm_loadu_si128((const __m128i *)MX_U8), m4 = _mm_set1_epi8(15);
    const __m256i ones = _mm256_set1_epi16(1);
    const float zero4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float sd[4][8], tail[4] = {0.0f, 0.0f, 0.0f, 0.0f}, out[4], cor[4];
    __m256 tot[4], odd[4], off[4]; /* even and odd blocks' sums; the offsets' sum */
    for (t = 0; t < NT; t++) tot[t] = odd[t] = off[t] = _mm256_setzero_ps();
    for (int g0 = 0; g0 < nb; g0 += 8) {
        const int gn = nb - g0 < 8 ? nb - g0 : 8;
        if (gn == 8) {
            const __m256 sv = e8m0_half8(sc + g0);
            for (t = 0; t < NT; t++) {
                const __m256 sdv = _mm256_mul_ps(sv, _mm256_loadu_ps(d[t] + g0));
                _mm256_storeu_ps(sd[t], sdv);
                off[t] = _mm256_fmadd_ps(sdv, _mm256_loadu_ps(zs[t] + g0), off[t]);
            }
        } else
            for (int j = 0; j < gn; j++)
                for (t = 0; t < NT; t++) {
                    sd[t][j] = e8m0_half(sc[g0 + j]) * d[t][g0 + j];
                    tail[t] += sd[t][j] * zs[t][g0 + j];
                }
#define MX8_BLOCK(j, ACC) /* block g0 + j into ACC[t] */ \
    do { \
        const int g = g0 + (j); \
        if ((g & 3) == 0) _mm_prefetch((const char *)q + 16L * g + PREFETCH, PF_HINT); \
        const __m128i b = _mm_loadu_si128((const __m128i *)(q + 16 * g)); \
        const __m256i w = _mm256_set_m128i(_mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(b, 4), m4)), \
                                           _mm_shuffle_epi8(lut, _mm_and_si128(b, m4))); \
        for (t = 0; t < NT; t++) { \
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i *)(x8[t] + 32 * g))), ones); \
            ACC[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(sd[t] + (j)), ACC[t]); \
        } \
    } while (0)
        int j = 0;
        for (; j + 2 <= gn; j += 2) {
            MX8_BLOCK(j, tot);
            MX8_BLOCK(j + 1, odd);
        }
        if (j < gn) MX8_BLOCK(j, tot);
#undef MX8_BLOCK
    }
    for (t = 0; t < NT; t++) tot[t] = _mm256_add_ps(tot[t], odd[t]);
    reduce_256(off, zero4, NT, cor);
    reduce_256(tot, zero4, NT, out);
    for (t = 0; t < NT; t++) acc[t] = out[t] - 12.0f * (cor[t] + tail[t]);
#else
    for (t = 0; t < NT; t++) {
        float a = 0.0f;
        for (int g = 0; g < nb; g++) {
            int p = 0;
            for (int j = 0; j < 16; j++)
                p += MX_I8[q[16 * g + j] & 15] * x8[t][32 * g + j] + MX_I8[q[16 * g + j] >> 4] * x8[t][32 * g + 16 + j];
            a += (float)p * (e8m0_half(sc[g]) * d[t][g]);
        }
        acc[t] = a;
    }
    (void)zs;
#endif
}

/* MXFP4 rows on integer activations over R rows (codes rs bytes apart, scales ss bytes apart) and n
 * tokens -> acc[r * ROWS_LD + t], the tokens' tiles outermost: a tile's activations (four tokens of a
 * gpt-oss row: 23 KB of int16 codes, 11.5 KB of int8) stay in L1 while the R rows pass over them, where
 * rows outermost streamed every tile's activations from L2 once per row, and at 32+ tokens an expert
 * (a prompt) the rows waited on L2: one gpt-oss-20b layer, 256 tokens, int16, one thread, Zen3, 50 ->
 * 59 GFLOP/s. q16: mxq_rows on int16 planes xe / xo (ld int16 apart per token) and scale lanes d
 * (Kin/8 per token: mx_lanes); else mx8_rows on int8 codes xe (Kin per token), block scales d and code
 * sums zs (Kin/32 per token). */
static void mx_block(int q16, const uint8_t *q, long rs, const uint8_t *sc, long ss, int R, int Kin, const void *xe0,
                     const void *xo0, const float *d0, const float *zs0, long ld, int n, float *acc) {
    const int16_t *xe[4], *xo[4];
    const int8_t *x8[4];
    const float *d[4], *zs[4];
    const long nd = q16 ? Kin / 8 : Kin / 32;
    for (int t = 0; t < n; t += 4) {
        const int nt = n - t < 4 ? n - t : 4;
        for (int i = 0; i < nt; i++) {
            d[i] = d0 + (t + i) * nd;
            if (q16) {
                xe[i] = (const int16_t *)xe0 + (t + i) * ld;
                xo[i] = (const int16_t *)xo0 + (t + i) * ld;
            } else {
                x8[i] = (const int8_t *)xe0 + (t + i) * (long)Kin;
                zs[i] = zs0 + (t + i) * nd;
            }
        }
        for (int r = 0; r < R; r++) {
            const uint8_t *qr = q + r * rs, *sr = sc + r * ss;
            float *a = acc + (long)r * ROWS_LD + t;
            if (q16) {
                if (nt == 4) mxq_rows(qr, sr, Kin, xe, xo, d, 4, a);
                else if (nt == 3) mxq_rows(qr, sr, Kin, xe, xo, d, 3, a);
                else if (nt == 2) mxq_rows(qr, sr, Kin, xe, xo, d, 2, a);
                else mxq_rows(qr, sr, Kin, xe, xo, d, 1, a);
            } else if (nt == 4) mx8_rows(qr, sr, Kin, x8, d, zs, 4, a);
            else if (nt == 3) mx8_rows(qr, sr, Kin, x8, d, zs, 3, a);
            else if (nt == 2) mx8_rows(qr, sr, Kin, x8, d, zs, 2, a);
            else mx8_rows(qr, sr, Kin, x8, d, zs, 1, a);
        }
    }
}

/* --- FP8 rows (e4m3fn codes with one fp32 scale per block of bk inputs: Qwen3 / DeepSeek "fp8") -- */

/* An e4m3fn byte as fp16 bits: sign to bit 15, the 4 exponent and 3 mantissa bits to bits 13..7.
 * As fp16 that is the e4m3 value times 2^-8 for normal and subnormal codes alike (both formats
 * put a subnormal's mantissa below an exponent field of 0, and 15 - 7 = 8), so the hardware's
 * exact fp16 → fp32 conversion decodes it and the 2^8 goes into the block scale (exact). The
 * sign-extending widen puts the sign in bits 15 and 14; the mask clears bit 14. NaN codes
 * (0x7f/0xff) decode as 480: weights never hold them. */
#define F8_UNIT 256.0f
static inline uint16_t f8_h(uint8_t b) { return (uint16_t)(((int16_t)(int8_t)b * 128) & 0xBFFF); }

/* acc[t] = sum over blocks of bk inputs: s_b * sum_j e4m3(q_j) * x_t[j], for one row of Kin code
 * bytes q and Kin/bk fp32 scales sc (bk a multiple of 32). Each token sums the same way whatever
 * NT (batch-invariant, as dense_rows). */
static inline __attribute__((always_inline)) void f8_rows(const uint8_t *q, const float *sc, int Kin, int bk,
                                                          const float *const *x, const int NT, float *acc) {
    const int nb = Kin / bk;
    int t;
#if defined(__AVX512F__)
    const __m256i keep = _mm256_set1_epi16((short)0xBFFF);
#define F8X16(p) _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16( \
                     _mm_loadu_si128((const __m128i *)(p))), 7), keep))
    __m512 tot[4];
    for (t = 0; t < NT; t++) tot[t] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *qb = q + (long)b * bk;
        const float *xb[4];
        __m512 p0[4], p1[4];
        for (t = 0; t < NT; t++) { xb[t] = x[t] + (long)b * bk; p0[t] = p1[t] = _mm512_setzero_ps(); }
        for (int j = 0; j < bk; j += 32) {
            _mm_prefetch((const char *)qb + j + PREFETCH, PF_HINT);
            const __m512 w0 = F8X16(qb + j), w1 = F8X16(qb + j + 16);
            for (t = 0; t < NT; t++) {
                p0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb[t] + j), p0[t]);
                p1[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb[t] + j + 16), p1[t]);
            }
        }
        const __m512 sv = _mm512_set1_ps(sc[b] * F8_UNIT);
        for (t = 0; t < NT; t++) tot[t] = _mm512_fmadd_ps(sv, _mm512_add_ps(p0[t], p1[t]), tot[t]);
    }
#undef F8X16
    for (t = 0; t < NT; t++) acc[t] = _mm512_reduce_add_ps(tot[t]);
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    const __m128i keep = _mm_set1_epi16((short)0xBFFF);
#define F8X8(p) _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16( \
                    _mm_loadl_epi64((const __m128i *)(p))), 7), keep))
    __m256 tot[4];
    for (t = 0; t < NT; t++) tot[t] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *qb = q + (long)b * bk;
        const float *xb[4];
        __m256 p0[4], p1[4];
        for (t = 0; t < NT; t++) { xb[t] = x[t] + (long)b * bk; p0[t] = p1[t] = _mm256_setzero_ps(); }
        for (int j = 0; j < bk; j += 16) {
            if ((j & 63) == 0) _mm_prefetch((const char *)qb + j + PREFETCH, PF_HINT); /* as AVX-512's */
            const __m256 w0 = F8X8(qb + j), w1 = F8X8(qb + j + 8);
            for (t = 0; t < NT; t++) {
                p0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xb[t] + j), p0[t]);
                p1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb[t] + j + 8), p1[t]);
            }
        }
        const __m256 sv = _mm256_set1_ps(sc[b] * F8_UNIT);
        for (t = 0; t < NT; t++) tot[t] = _mm256_fmadd_ps(sv, _mm256_add_ps(p0[t], p1[t]), tot[t]);
    }
#undef F8X8
    for (t = 0; t < NT; t += 4) {
        const __m256 z = _mm256_setzero_ps();
        float r[4];
        _mm_storeu_ps(r, sum4_256(tot[t], t + 1 < NT ? tot[t + 1] : z, t + 2 < NT ? tot[t + 2] : z,
                                  t + 3 < NT ? tot[t + 3] : z));
        for (int i = 0; i < 4 && t + i < NT; i++) acc[t + i] = r[i];
    }
#else
    for (t = 0; t < NT; t++) { /* eight partial sums per block, as vector lanes would */
        float a = 0.0f;
        for (int b = 0; b < nb; b++) {
            float lane[8] = {0};
            for (int j = 0; j < bk; j++) lane[j & 7] += h2f(f8_h(q[(long)b * bk + j])) * x[t][(long)b * bk + j];
            float p = 0.0f;
            for (int l = 0; l < 8; l++) p += lane[l];
            a += sc[b] * F8_UNIT * p;
        }
        acc[t] = a;
    }
#endif
}

static void f8_slots(const uint8_t *q, const float *sc, int Kin, int bk, const float *x0, long ld, int n, float *acc) {
    const float *x[4];
    int t = 0;
    for (; t + 4 <= n; t += 4) {
        for (int i = 0; i < 4; i++) x[i] = x0 + (t + i) * ld;
        f8_rows(q, sc, Kin, bk, x, 4, acc + t);
    }
    const int r = n - t;
    for (int i = 0; i < r; i++) x[i] = x0 + (t + i) * ld;
    if (r == 3) f8_rows(q, sc, Kin, bk, x, 3, acc + t);
    else if (r == 2) f8_rows(q, sc, Kin, bk, x, 2, acc + t);
    else if (r == 1) f8_rows(q, sc, Kin, bk, x, 1, acc + t);
}

/* --- one MoE layer ---------------------------------------------------------------------------- */

typedef struct {
    int fmt; /* FMT_*: INT4 blocks (data/nbytes/offs) or stacked 16/32-bit gate_up [E, 2I, D], down [E, D, I] */
    const uint8_t *data;
    long nbytes; /* int4: bytes per expert block; dense: bytes per weight */
    const long *offs; /* int4: gu_q, gu_s, gu_z, dn_q, dn_s, dn_z */
    const uint8_t *gu, *dn;
    int sym, G, D, I, T, K;
    const int64_t *ids, *cnt, *order, *act;
    const float *w;
    float *xe, *xo, *he, *ho, *y; /* dense: xe [S, D] and he [S, I] whole rows (xo, ho unused) */
    float *ue; /* the up products laid out as he / ho [S I], for lynx_silu_mul; NULL: activate() per element */
    float *xsum, *hsum; /* int4: group sums of xe/xo [S, D/G] and he/ho [S, I/G] */
    /* gpt-oss: MXFP4 scales gus [E, 2I, D/32], dns [E, D, I/32]; fp32 biases gub [E, 2I], dnb [E, D]
     * (NULL: none); act 1 = the clamped SwiGLU (limit, alpha), 0 = silu(gate) * up */
    const uint8_t *gus, *dns;
    const float *gub, *dnb;
    int act_kind;
    float limit, alpha;
    /* int4 with integer activations (int8 q8_rows, or int16 when q16): xq/hq even|odd [S, D/2] / [S, I/2],
     * block scales xd/hd, zero sums xz/hz; NULL where the fp32 rows run */
    const void *xqe, *xqo, *hqe, *hqo;
    const float *xd, *xz, *hd, *hz;
    /* fp8: gu [E, 2I, D] / dn [E, D, I] e4m3 codes, fp32 scales [E, 2I/bn, D/bk] / [E, D/bn, I/bk] in
     * gus / dns (read as float), one per block of bn rows × bk inputs */
    int bn, bk;
    int xq16, hq16; /* the codes at xqe / hqe are int16 (q16_block), else int8 */
    int stream; /* 16/32-bit experts that come from DRAM at each use (dense_block's stream), not from cache */
    /* bf16 experts on AMX (amx_rows): xe's / he's pairs, each expert's at its first slot r0
     * (xv + r0 * D * AMX_PARTS, hv + r0 * I * AMX_PARTS), with xparts / hparts parts; NULL: the row kernels */
    const uint16_t *xv, *hv;
    int xparts, hparts;
    const uint16_t *xb, *hb; /* bf16 experts with bf16 activations (dp_block): xe / he rounded; else NULL */
} layer_t;

/* e^x in fp32, Cephes' expf: x = n ln2 + r (|r| <= ln2/2), a degree-6 polynomial in r, times 2^n
 * built in the exponent bits; x is clamped to [-87, 88] first so 2^n stays a normal number (below
 * -87 it returns ~e^-87 = 1.6e-38 instead of less; NaN stays NaN). Within 2 ulp of expf. The vector
 * forms run the same operations in every lane (and masked tails), so an element's value never
 * depends on where it sits in a vector: the callers stay batch-invariant. */
#define EXP_HI 88.0f
#define EXP_LO -87.0f
#define EXP_P0 1.9875691500E-4f
#define EXP_P1 1.3981999507E-3f
#define EXP_P2 8.3334519073E-3f
#define EXP_P3 4.1665795894E-2f
#define EXP_P4 1.6666665459E-1f
#define EXP_P5 5.0000001201E-1f
#define EXP_C1 0.693359375f
#define EXP_C2 -2.12194440E-4f
#define EXP_LOG2E 1.44269504088896341f

/* exp512 / exp256: one body for both widths (P: the intrinsics' prefix, V / VI: float / int vectors) */
#define EXP_VEC(NAME, V, VI, P, FLOOR, CAST) \
    static inline V NAME(V x) { \
        x = P##_max_ps(P##_set1_ps(EXP_LO), P##_min_ps(P##_set1_ps(EXP_HI), x)); /* NaN: the 2nd operand */ \
        const V n = FLOOR(P##_fmadd_ps(x, P##_set1_ps(EXP_LOG2E), P##_set1_ps(0.5f))); \
        V r = P##_fnmadd_ps(n, P##_set1_ps(EXP_C1), x); \
        r = P##_fnmadd_ps(n, P##_set1_ps(EXP_C2), r); \
        V y = P##_fmadd_ps(P##_set1_ps(EXP_P0), r, P##_set1_ps(EXP_P1)); \
        y = P##_fmadd_ps(y, r, P##_set1_ps(EXP_P2)); \
        y = P##_fmadd_ps(y, r, P##_set1_ps(EXP_P3)); \
        y = P##_fmadd_ps(y, r, P##_set1_ps(EXP_P4)); \
        y = P##_fmadd_ps(y, r, P##_set1_ps(EXP_P5)); \
        y = P##_add_ps(P##_fmadd_ps(y, P##_mul_ps(r, r), r), P##_set1_ps(1.0f)); \
        const VI e = P##_slli_epi32(P##_add_epi32(P##_cvtps_epi32(n), P##_set1_epi32(127)), 23); \
        return P##_mul_ps(y, CAST(e)); \
    }
#if defined(__AVX512F__)
#define FLOOR512(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
EXP_VEC(exp512, __m512, __m512i, _mm512, FLOOR512, _mm512_castsi512_ps)
#endif
#if defined(__AVX2__) && defined(__FMA__)
EXP_VEC(exp256, __m256, __m256i, _mm256, _mm256_floor_ps, _mm256_castsi256_ps)
#endif
static inline float exp_s(float x) { /* the portable build's form (no vectors) */
    x = x > EXP_HI ? EXP_HI : (x < EXP_LO ? EXP_LO : x);
    const float n = floorf(x * EXP_LOG2E + 0.5f);
    const float r = (x - n * EXP_C1) - n * EXP_C2;
    float y = ((((EXP_P0 * r + EXP_P1) * r + EXP_P2) * r + EXP_P3) * r + EXP_P4) * r + EXP_P5;
    y = y * (r * r) + r + 1.0f;
    union { uint32_t u; float f; } p = {(uint32_t)((int)n + 127) << 23};
    return y * p.f;
}

/* v[i] = e^(v[i] - m) for i < n → their sum (the lanes' partial sums folded the same way for any n) */
static float exp_sub_sum(float *v, long n, float m) {
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (long i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, v + i), _mm512_set1_ps(m)));
        _mm512_mask_storeu_ps(v + i, k, e);
        acc = _mm512_mask_add_ps(acc, k, acc, e);
    }
    return _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(v + i), _mm256_set1_ps(m)));
        _mm256_storeu_ps(v + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    if (i < n) { /* the tail through a zero-padded vector: the same lanes' arithmetic */
        float b[8] = {0};
        const int c = (int)(n - i);
        memcpy(b, v + i, c * sizeof(float));
        _mm256_storeu_ps(b, exp256(_mm256_sub_ps(_mm256_loadu_ps(b), _mm256_set1_ps(m))));
        memcpy(v + i, b, c * sizeof(float));
        for (int j = c; j < 8; j++) b[j] = 0.0f;
        acc = _mm256_add_ps(acc, _mm256_loadu_ps(b));
    }
    return hsum256(acc);
#else
    float sum = 0.0f;
    for (long i = 0; i < n; i++) sum += v[i] = exp_s(v[i] - m);
    return sum;
#endif
}

/* out[i] = e^x[i], i < n: the kernels' exp, for the tests */
void lynx_exp(const float *x, long n, float *out) {
    memcpy(out, x, n * sizeof(float));
    exp_sub_sum(out, n, 0.0f);
}

/* h[i] = silu(h[i]) * u[i] = h / (1 + e^-h) * u, i < n (the experts' SwiGLU, one pass over a
 * layer's slots once every gate and up row is done: 16 lanes at a time instead of one libm expf
 * per element); exported for the tests */
void lynx_silu_mul(float *h, const float *u, long n) {
#if defined(__AVX512F__)
    for (long i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        const __m512 g = _mm512_maskz_loadu_ps(k, h + i), v = _mm512_maskz_loadu_ps(k, u + i);
        const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g)));
        _mm512_mask_storeu_ps(h + i, k, _mm512_mul_ps(_mm512_div_ps(g, d), v));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (long i = 0; i < n; i += 8) {
        const int m = n - i >= 8 ? 8 : (int)(n - i);
        float gb[8] = {0}, ub[8] = {0}; /* the tail through zero-padded vectors: the same lanes' arithmetic */
        float *hp = m == 8 ? h + i : gb;
        const float *up = m == 8 ? u + i : ub;
        if (m < 8) {
            memcpy(gb, h + i, m * sizeof(float));
            memcpy(ub, u + i, m * sizeof(float));
        }
        const __m256 g = _mm256_loadu_ps(hp);
        const __m256 d = _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), g)));
        _mm256_storeu_ps(hp, _mm256_mul_ps(_mm256_div_ps(g, d), _mm256_loadu_ps(up)));
        if (m < 8) memcpy(h + i, gb, m * sizeof(float));
    }
#else
    for (long i = 0; i < n; i++) h[i] = h[i] / (1.0f + exp_s(-h[i])) * u[i];
#endif
}

/* h_i of expert e from its gate and up rows' products (bias added first where there is one) */
static inline float activate(const layer_t *L, int64_t e, int i, float g, float u) {
    if (L->gub) {
        g += L->gub[e * 2L * L->I + i];
        u += L->gub[e * 2L * L->I + L->I + i];
    }
    if (L->act_kind == 1) { /* gpt-oss: (clamp(up, ±limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit) */
        g = g < L->limit ? g : L->limit;
        u = u < -L->limit ? -L->limit : (u > L->limit ? L->limit : u);
        return (u + 1.0f) * (g / (1.0f + expf(-L->alpha * g)));
    }
    return g / (1.0f + expf(-g)) * u;
}

/* h at dst (inside he / ho) from gate g and up u: activated now, or, where the layer defers the
 * plain SwiGLU to one vector pass (L->ue), g stays at dst and u goes to the same place in ue / uo */
static inline void put_h(const layer_t *L, int64_t e, int i, float *dst, float g, float u) {
    if (L->ue) {
        *dst = g;
        L->ue[dst - L->he] = u;
    } else
        *dst = activate(L, e, i, g, u);
}

static void gate_up_item(const void *arg, long item) {
    const layer_t *L = arg;
    const long nb = (L->I + ROW_BLOCK - 1) / ROW_BLOCK;
    const int64_t e = L->act[item / nb], r0 = L->cnt[e], n = L->cnt[e + 1] - r0;
    const int I = L->I, D = L->D, i0 = (int)(item % nb) * ROW_BLOCK;
    float gate[64], up[64];
    if (L->fmt == FMT_MXFP4 && L->xqe) { /* integer activations: the item's rows a token tile at a time */
        const uint8_t *gu = L->gu + e * 2L * I * (D / 2), *gs = L->gus + e * 2L * I * (D / 32);
        const int R = I - i0 < ROW_BLOCK ? I - i0 : ROW_BLOCK, q16 = L->xq16;
        float gate4[ROW_BLOCK * ROWS_LD], up4[ROW_BLOCK * ROWS_LD];
        for (int64_t c = 0; c < n; c += ROWS_LD) {
            const int m = (int)(n - c < ROWS_LD ? n - c : ROWS_LD);
            /* int16: both planes, four scale lanes a block (mx_lanes); int8: whole rows, block scales and sums */
            const void *xe = q16 ? (const void *)((const int16_t *)L->xqe + (r0 + c) * (D / 2))
                                 : (const void *)((const int8_t *)L->xqe + (r0 + c) * D);
            const void *xo = q16 ? (const void *)((const int16_t *)L->xqo + (r0 + c) * (D / 2)) : NULL;
            const float *xd = L->xd + (r0 + c) * (q16 ? D / 8 : D / 32), *xz = q16 ? NULL : L->xz + (r0 + c) * (D / 32);
            for (int h = 0; h < 2; h++)
                mx_block(q16, gu + (long)(h * I + i0) * (D / 2), D / 2, gs + (long)(h * I + i0) * (D / 32), D / 32, R, D,
                         xe, xo, xd, xz, D / 2, m, h ? up4 : gate4);
            for (int t = 0; t < m; t++)
                for (int r = 0; r < R; r++) {
                    const int i = i0 + r;
                    put_h(L, e, i, ((i & 1) ? L->ho : L->he) + (r0 + c + t) * (I / 2) + i / 2, gate4[r * ROWS_LD + t],
                          up4[r * ROWS_LD + t]);
                }
        }
        return;
    }
    if (L->fmt == FMT_MXFP4) { /* fp32 activations (exact) */
        const uint8_t *gu = L->gu + e * 2L * I * (D / 2), *gs = L->gus + e * 2L * I * (D / 32);
        for (int i = i0; i < I && i < i0 + ROW_BLOCK; i++)
            for (int64_t c = 0; c < n; c += 64) {
                const int m = (int)(n - c < 64 ? n - c : 64);
                const float *xe = L->xe + (r0 + c) * (D / 2), *xo = L->xo + (r0 + c) * (D / 2);
                mx_slots(gu + (long)i * (D / 2), gs + (long)i * (D / 32), D, xe, xo, D / 2, m, gate);
                mx_slots(gu + (long)(I + i) * (D / 2), gs + (long)(I + i) * (D / 32), D, xe, xo, D / 2, m, up);
                float *dst = ((i & 1) ? L->ho : L->he) + (r0 + c) * (I / 2) + i / 2;
                for (int t = 0; t < m; t++) put_h(L, e, i, dst + (long)t * (I / 2), gate[t], up[t]);
            }
        return;
    }
    if (L->fmt == FMT_FP8) {
        const int nk = D / L->bk;
        const uint8_t *gu = L->gu + e * 2L * I * D;
        const float *gs = (const float *)L->gus + e * (2L * I / L->bn) * nk;
        for (int i = i0; i < I && i < i0 + ROW_BLOCK; i++)
            for (int64_t c = 0; c < n; c += 64) {
                const int m = (int)(n - c < 64 ? n - c : 64);
                const float *x = L->xe + (r0 + c) * D;
                f8_slots(gu + (long)i * D, gs + (long)(i / L->bn) * nk, D, L->bk, x, D, m, gate);
                f8_slots(gu + (long)(I + i) * D, gs + (long)((I + i) / L->bn) * nk, D, L->bk, x, D, m, up);
                for (int t = 0; t < m; t++) put_h(L, e, i, L->he + (r0 + c + t) * I + i, gate[t], up[t]);
            }
        return;
    }
    if (L->fmt != FMT_INT4) {
        const long es = L->nbytes;
        const uint8_t *gu = L->gu + e * 2L * I * D * es;
        float gate4[ROW_BLOCK * ROWS_LD], up4[ROW_BLOCK * ROWS_LD];
        { /* the item's rows in one dense_block */
            const int i = i0, R = I - i < ROW_BLOCK ? I - i : ROW_BLOCK;
            for (int64_t c = 0; c < n; c += ROWS_LD) { /* slots of this expert, 64 at a time */
                const int m = (int)(n - c < ROWS_LD ? n - c : ROWS_LD);
                const float *x = L->xe + (r0 + c) * D;
                const int mode = L->stream & MOE_GU_PACKED ? ROWS_PACKED : L->stream & 1;
#if AMX_PATH
                if (L->xv && R == ROW_BLOCK) { /* a whole block of rows: the tiles (see amx_rows) */
                    const uint16_t *xv = L->xv + r0 * (long)D * AMX_PARTS;
                    amx_rows(gu + (long)i * D * es, (long)D * es, D, xv, L->xparts, (int)n, (int)c, m, gate4, mode);
                    amx_rows(gu + (long)(I + i) * D * es, (long)D * es, D, xv, L->xparts, (int)n, (int)c, m, up4, mode);
                } else
#endif
                if (L->xb) {
                    const uint16_t *xb = L->xb + (r0 + c) * D;
                    dp_block(gu + (long)i * D * 2, (long)D * 2, D, R, xb, D, m, gate4, L->stream & 1);
                    dp_block(gu + (long)(I + i) * D * 2, (long)D * 2, D, R, xb, D, m, up4, L->stream & 1);
                } else {
                    dense_block(gu + (long)i * D * es, (long)D * es, L->fmt, D, R, x, D, m, gate4, mode);
                    dense_block(gu + (long)(I + i) * D * es, (long)D * es, L->fmt, D, R, x, D, m, up4, mode);
                }
                for (int t = 0; t < m; t++) /* token by token (see linear_item) */
                    for (int r = 0; r < R; r++)
                        put_h(L, e, i + r, L->he + (r0 + c + t) * I + i + r, gate4[r * ROWS_LD + t], up4[r * ROWS_LD + t]);
            }
        }
        return;
    }
    const uint8_t *blk = L->data + e * L->nbytes;
    const uint8_t *q = blk + L->offs[0];
    const uint16_t *s = (const uint16_t *)(blk + L->offs[1]);
    const uint8_t *z = L->sym ? NULL : blk + L->offs[2];
    const long rs = D / 2;
    float gate4[4 * ROWS_LD], up4[4 * ROWS_LD];
    for (int i = i0; i < I && i < i0 + ROW_BLOCK; i += 4) { /* four rows at a time: dot_block */
        const int R = I - i < 4 ? I - i : 4;
        for (int64_t c = 0; c < n; c += ROWS_LD) {
            const int m = (int)(n - c < ROWS_LD ? n - c : ROWS_LD);
            if (L->xqe) {
                const long o = (r0 + c) * (D / 2);
                const float *xd = L->xd + (r0 + c) * ACT_DS(L->xq16, D, L->G), *xz = L->xz + (r0 + c) * (D / L->G);
                act_block(L->xq16, q + i * rs, rs, s + i, z ? z + i : NULL, 2L * I, D, L->G, R, L->xqe, L->xqo, o, xd,
                          xz, m, gate4);
                act_block(L->xq16, q + (I + i) * rs, rs, s + I + i, z ? z + I + i : NULL, 2L * I, D, L->G, R, L->xqe,
                          L->xqo, o, xd, xz, m, up4);
            } else {
                const float *xe = L->xe + (r0 + c) * (D / 2), *xo = L->xo + (r0 + c) * (D / 2);
                const float *xs = L->xsum + (r0 + c) * (D / L->G);
                dot_block(q + i * rs, rs, s + i, z ? z + i : NULL, 2L * I, D, L->G, R, xe, xo, D / 2, xs, m, gate4);
                dot_block(q + (I + i) * rs, rs, s + I + i, z ? z + I + i : NULL, 2L * I, D, L->G, R, xe, xo, D / 2,
                          xs, m, up4);
            }
            for (int t = 0; t < m; t++) /* token by token (see linear_item) */
                for (int r = 0; r < R; r++)
                    put_h(L, e, i + r, (((i + r) & 1) ? L->ho : L->he) + (r0 + c + t) * (I / 2) + (i + r) / 2,
                          gate4[r * ROWS_LD + t], up4[r * ROWS_LD + t]);
        }
    }
}

static void down_item(const void *arg, long item) {
    const layer_t *L = arg;
    const long nb = (L->D + ROW_BLOCK - 1) / ROW_BLOCK;
    const int64_t e = L->act[item / nb], r0 = L->cnt[e], n = L->cnt[e + 1] - r0;
    const int I = L->I, D = L->D, d0 = (int)(item % nb) * ROW_BLOCK, K = L->K;
    const int int4 = L->fmt == FMT_INT4;
    const uint8_t *blk = int4 ? L->data + e * L->nbytes : NULL;
    const uint8_t *q = int4 ? blk + L->offs[3] : NULL;
    const uint16_t *s = int4 ? (const uint16_t *)(blk + L->offs[4]) : NULL;
    const uint8_t *z = int4 && !L->sym ? blk + L->offs[5] : NULL;
    const long es = L->nbytes;
    float acc[ROW_BLOCK * ROWS_LD];
    const int mxi = L->fmt == FMT_MXFP4 && L->hqe; /* mx_block: the item's rows a token tile at a time */
    const int step = L->fmt == FMT_F32 || L->fmt == FMT_BF16 || mxi ? ROW_BLOCK : 4; /* rows per tile call */
    for (int d = d0; d < D && d < d0 + ROW_BLOCK; d += step) {
        const int R = D - d < step ? D - d : step;
        for (int64_t c = 0; c < n; c += ROWS_LD) {
            const int m = (int)(n - c < ROWS_LD ? n - c : ROWS_LD);
            if (int4 && L->hqe)
                act_block(L->hq16, q + (long)d * (I / 2), I / 2, s + d, z ? z + d : NULL, D, I, L->G, R, L->hqe,
                          L->hqo, (r0 + c) * (I / 2), L->hd + (r0 + c) * ACT_DS(L->hq16, I, L->G),
                          L->hz + (r0 + c) * (I / L->G), m, acc);
            else if (int4)
                dot_block(q + (long)d * (I / 2), I / 2, s + d, z ? z + d : NULL, D, I, L->G, R,
                          L->he + (r0 + c) * (I / 2), L->ho + (r0 + c) * (I / 2), I / 2,
                          L->hsum + (r0 + c) * (I / L->G), m, acc);
            else if (mxi && L->hq16)
                mx_block(1, L->dn + (e * (long)D + d) * (I / 2), I / 2, L->dns + (e * (long)D + d) * (I / 32), I / 32, R, I,
                         (const int16_t *)L->hqe + (r0 + c) * (I / 2), (const int16_t *)L->hqo + (r0 + c) * (I / 2),
                         L->hd + (r0 + c) * (I / 8), NULL, I / 2, m, acc);
            else if (mxi)
                mx_block(0, L->dn + (e * (long)D + d) * (I / 2), I / 2, L->dns + (e * (long)D + d) * (I / 32), I / 32, R, I,
                         (const int8_t *)L->hqe + (r0 + c) * I, NULL, L->hd + (r0 + c) * (I / 32),
                         L->hz + (r0 + c) * (I / 32), I / 2, m, acc);
#if AMX_PATH
            else if (L->hv && R == ROW_BLOCK) /* a whole block of rows: the tiles (see amx_rows) */
                amx_rows(L->dn + (e * (long)D * I + (long)d * I) * es, (long)I * es, I, L->hv + r0 * (long)I * AMX_PARTS,
                         L->hparts, (int)n, (int)c, m, acc, L->stream & 1);
#endif
            else if (L->hb)
                dp_block(L->dn + (e * (long)D * I + (long)d * I) * 2, (long)I * 2, I, R, L->hb + (r0 + c) * I, I, m, acc,
                         L->stream & 1);
            else if (L->fmt == FMT_F32 || L->fmt == FMT_BF16)
                dense_block(L->dn + (e * (long)D * I + (long)d * I) * es, (long)I * es, L->fmt, I, R,
                            L->he + (r0 + c) * I, I, m, acc, L->stream & MOE_DN_PACKED ? ROWS_PACKED : L->stream & 1);
            else
                for (int r = 0; r < R; r++) {
                    if (L->fmt == FMT_MXFP4)
                        mx_slots(L->dn + (e * (long)D + d + r) * (I / 2), L->dns + (e * (long)D + d + r) * (I / 32), I,
                                 L->he + (r0 + c) * (I / 2), L->ho + (r0 + c) * (I / 2), I / 2, m, acc + r * ROWS_LD);
                    else
                        f8_slots(L->dn + (e * (long)D + d + r) * I,
                                 (const float *)L->dns + (e * (long)(D / L->bn) + (d + r) / L->bn) * (I / L->bk), I,
                                 L->bk, L->he + (r0 + c) * I, I, m, acc + r * ROWS_LD);
                }
            for (int t = 0; t < m; t++) { /* token by token (see linear_item: rows D apart alias in L1) */
                const int64_t sl = L->order[r0 + c + t];
                const float wt = L->w[(sl / K) * K + sl % K];
                float *yt = L->y + (r0 + c + t) * D + d;
                for (int r = 0; r < R; r++) yt[r] = (acc[r * ROWS_LD + t] + (L->dnb ? L->dnb[e * (long)D + d + r] : 0.0f)) * wt;
            }
        }
    }
}

/* --- threads --------------------------------------------------------------------------------- */

/* items [0, n_items) of fn over nthreads threads, guided schedule: large contiguous runs of items
 * first (each thread streams through neighbouring rows, which the hardware prefetchers follow, with
 * few trips to the shared counter), smaller ones at the end to even out experts of unequal load.
 * Measured against dynamic-1 (one counter trip per 16-row item, threads interleaving items) on 2
 * cores: an INT4 MoE layer at one token 384 -> 299 us, 2-thread speed-up 1.38x -> 1.79x
 * (benchmarks/results/cpu_native.md). Built with -fopenmp, this links libgomp.so.1 —
 * the soname torch's own OpenMP runtime is loaded under — so the loader binds it to torch's copy:
 * one runtime and one pool of already-warm threads for torch's ops and these kernels (a second
 * pool of our own measured 0.1-0.2 ms per call to wake on a 2-core VM, and two pools spinning
 * against each other collapse; see the module docstring of native.py). */
static void parallel(void (*fn)(const void *, long), const void *arg, long n_items, int nthreads) {
#if defined(_OPENMP)
    if (nthreads > 1 && n_items > 1) {
#pragma omp parallel for schedule(guided) num_threads(nthreads)
        for (long it = 0; it < n_items; it++) fn(arg, it);
        return;
    }
#else
    (void)nthreads;
#endif
    for (long it = 0; it < n_items; it++) fn(arg, it);
}

/* --- entry points (ctypes) -------------------------------------------------------------------- */

/* Scratch blocks of 1 MiB and more are kept for the next call (KEEP_SLOTS of them, KEEP_MAX bytes in
 * all; a call that finds none free, or would pass the cap, mallocs and frees as before). A prompt's
 * MoE call needs tens to hundreds of MB (the random 1.28 GB qwen3_moe at 2048 slots: 36 MB; gpt-oss-20b
 * at 4096: ~200 MB), which glibc maps fresh at every call (past its 32 MB mmap threshold), so every
 * page faulted in again, serially and under the kernel's mm lock: ~2.3 us a page on this VM, a 512-token
 * prefill of the random model's 4-bit checkpoint ~170 ms of its ~1 s on two threads. The cost: up to
 * KEEP_MAX of resident memory after the first long prompt (as llama.cpp keeps its compute buffer);
 * lynx_scratch_release() gives it back. Blocks are reused dirty: no kernel reads scratch it did not
 * write (every buffer is written, or memset, before it is read). */
#define KEEP_MIN ((size_t)1 << 20)
#define KEEP_MAX ((size_t)256 << 20)
#define KEEP_SLOTS 4
static struct {
    uint8_t *p;
    size_t n;
    int busy;
} keep_slot[KEEP_SLOTS];
static pthread_mutex_t keep_mu = PTHREAD_MUTEX_INITIALIZER;

/* a block of at least total bytes: a kept one that is free and large enough (the smallest such), a
 * free slot's block grown to total (within KEEP_MAX), else malloc */
static uint8_t *take_block(size_t total) {
    if (total >= KEEP_MIN) {
        pthread_mutex_lock(&keep_mu);
        int fit = -1, grow = -1;
        size_t kept = 0;
        for (int i = 0; i < KEEP_SLOTS; i++) {
            kept += keep_slot[i].n;
            if (keep_slot[i].busy) continue;
            if (keep_slot[i].n >= total) {
                if (fit < 0 || keep_slot[i].n < keep_slot[fit].n) fit = i;
            } else if (grow < 0 || keep_slot[i].n < keep_slot[grow].n)
                grow = i;
        }
        if (fit < 0 && grow >= 0 && kept - keep_slot[grow].n + total <= KEEP_MAX) {
            free(keep_slot[grow].p);
            keep_slot[grow].p = malloc(total);
            keep_slot[grow].n = keep_slot[grow].p ? total : 0;
            if (keep_slot[grow].p) fit = grow;
        }
        uint8_t *p = NULL;
        if (fit >= 0) {
            keep_slot[fit].busy = 1;
            p = keep_slot[fit].p;
        }
        pthread_mutex_unlock(&keep_mu);
        if (p) return p;
    }
    return malloc(total ? total : 1);
}

/* the block of a scratch() call back: to its slot if it is a kept one, else free */
static void scratch_free(void *mem) {
    if (!mem) return;
    pthread_mutex_lock(&keep_mu);
    for (int i = 0; i < KEEP_SLOTS; i++)
        if (keep_slot[i].p == mem && keep_slot[i].busy) {
            keep_slot[i].busy = 0;
            pthread_mutex_unlock(&keep_mu);
            return;
        }
    pthread_mutex_unlock(&keep_mu);
    free(mem);
}

/* bytes of scratch kept for the next call */
long lynx_scratch_kept(void) {
    size_t n = 0;
    pthread_mutex_lock(&keep_mu);
    for (int i = 0; i < KEEP_SLOTS; i++) n += keep_slot[i].n;
    pthread_mutex_unlock(&keep_mu);
    return (long)n;
}

/* free the kept scratch blocks no call is using → bytes freed */
long lynx_scratch_release(void) {
    size_t n = 0;
    pthread_mutex_lock(&keep_mu);
    for (int i = 0; i < KEEP_SLOTS; i++)
        if (!keep_slot[i].busy && keep_slot[i].p) {
            n += keep_slot[i].n;
            free(keep_slot[i].p);
            keep_slot[i].p = NULL;
            keep_slot[i].n = 0;
        }
    pthread_mutex_unlock(&keep_mu);
    return (long)n;
}

/* One allocation carved into n scratch buffers of sz[i] bytes (64-byte steps; out[i] NULL where
 * sz[i] == 0) → the block to give back with scratch_free, or NULL when out of memory: a kernel call's
 * many buffers cost one malloc, not one each (the demo's decode step made ~180) */
static uint8_t *scratch(const size_t *sz, int n, void **out) {
    size_t total = 0;
    for (int i = 0; i < n; i++) total += (sz[i] + 63) & ~(size_t)63;
    uint8_t *mem = take_block(total);
    if (!mem) return NULL;
    for (size_t i = 0, off = 0; i < (size_t)n; off += (sz[i] + 63) & ~(size_t)63, i++) out[i] = sz[i] ? mem + off : NULL;
    return mem;
}

/* One MoE layer. x [T, D] fp32, ids [T, K] int64 (each in [0, E)), w [T, K] fp32 → out [T, D] fp32.
 * fmt FMT_INT4: data [E, nbytes] blocks with offs [6], perm [E, D] int32 or NULL (act order), sym, G.
 * fmt FMT_F32 / FMT_BF16: gu [E, 2I, D] and dn [E, D, I] contiguous (data, offs, perm unused).
 * fmt FMT_MXFP4: gu [E, 2I, D/2] and dn [E, D, I/2] code bytes, gus / dns their e8m0 scales.
 * fmt FMT_FP8: gu [E, 2I, D] and dn [E, D, I] e4m3fn codes, gus / dns fp32 scales [E, 2I/bn, D/bk] and
 * [E, D/bn, I/bk] (bn | I and D, bk | D and I, bk % 32 == 0: the caller checks).
 * gub [E, 2I] / dnb [E, D] fp32 biases or NULL; act_kind 1: gpt-oss's clamped SwiGLU.
 * amode: the INT4 rows' activations, ACT_F32 / ACT_Q8 / ACT_Q16 (each side falls back to fp32 where
 * its mode does not take the shape: act_for); MXFP4 rows take either integer mode (mxq_rows, mx8_rows);
 * bf16 experts ACT_BF16: x and h rounded to bf16 once each, then dp_block (experts read from cache)
 * or the fp32 rows (streamed ones, packed rows; see dp_block): the same inputs, sums within fp32
 * rounding of each other.
 * stream: bit 0, the 16/32-bit experts come from DRAM at each use (they outgrow the last-level cache;
 * the caller decides, native.streamed): their short rows are read whole (dense_block); MOE_GU_PACKED /
 * MOE_DN_PACKED: gate_up / down hold packed rows (ROWS_PACKED: its rows whole groups of PK_ROWS, its
 * inputs a multiple of 8).
 * Returns 0; -1 when out of memory; -3 for an expert id outside [0, E); -4 for packed rows this
 * build does not read (lynx_pack_rows). */
int lynx_moe(int fmt, const float *x, const int64_t *ids, const float *w, const int32_t *perm, const uint8_t *data,
             long E, long nbytes, const long *offs, const uint8_t *gu, const uint8_t *dn, int sym, int G, int D, int I,
             int T, int K, float *out, int nthreads, const uint8_t *gus, const uint8_t *dns, const float *gub,
             const float *dnb, int act_kind, float limit, float alpha, int amode, int bn, int bk, int stream) {
    const long S = (long)T * K;
    const int dense = fmt == FMT_F32 || fmt == FMT_BF16 || fmt == FMT_FP8, int4 = fmt == FMT_INT4, mx = fmt == FMT_MXFP4;
    if ((stream & (MOE_GU_PACKED | MOE_DN_PACKED)) && (!PACK_OK || (fmt != FMT_F32 && fmt != FMT_BF16)
                                                       || ((stream & MOE_GU_PACKED) && (I % PK_ROWS || D % 8))
                                                       || ((stream & MOE_DN_PACKED) && (D % PK_ROWS || I % 8)))) return -4;
    /* the INT4 rows' activation mode on each side (ACT_*: fp32, int8, int16); MXFP4 rows take int16
     * (mxq_rows) or int8 (mx8_rows) activations in its blocks of 32, else fp32 */
    if (mx) G = 32;
    const int ax = int4 ? act_for(amode, D, G) : mx ? amode : ACT_F32, ah = int4 ? act_for(amode, I, G) : mx ? amode : ACT_F32;
    for (long i = 0; i < S; i++)
        if (ids[i] < 0 || ids[i] >= E) return -3; /* nothing written: the caller names the bad id */
    const int defer = act_kind == 0 && !gub; /* plain SwiGLU: one pass (lynx_silu_mul) */
    /* bf16 experts in row-major rows on AMX: the tiles take whole blocks of 16 rows of 32-input steps */
    const int amx = AMX_PATH && g_amx && fmt == FMT_BF16 && !(stream & (MOE_GU_PACKED | MOE_DN_PACKED)) && D % 32 == 0
                    && I % 32 == 0;
    /* bf16 activations: dp_block for experts read from cache; streamed ones (and packed rows) run the
     * fp32 rows on the same rounded inputs (dp_block reads them slower from DRAM) */
    const int b16 = BF16_DP && !amx && fmt == FMT_BF16 && amode == ACT_BF16;
    const int dp = b16 && !stream;
    const size_t f4 = sizeof(float), i8 = sizeof(int64_t);
    const size_t sz[] = {(E + 1) * i8, E * i8, S * i8, S * i8, E * i8,          /* cnt fill order pos act */
                         S * D * f4, S * I * f4, S * D * f4, defer ? S * I * f4 : 0, /* xe he y ue */
                         int4 ? (S * (D / G) + 1) * f4 : 0, int4 ? (S * (I / G) + 1) * f4 : 0, /* xsum hsum */
                         act_bytes(ax, S, D), act_bytes(ah, S, I),                      /* xq hq */
                         act_floats(ax, S, D, G) * f4, act_floats(ah, S, I, G) * f4,    /* xd hd */
                         mx && ax == ACT_Q16 ? S * (D / 8) * f4 : 0, mx && ah == ACT_Q16 ? S * (I / 8) * f4 : 0, /* mx_lanes */
                         amx ? S * D * AMX_PARTS * 2 : 0, amx ? S * I * AMX_PARTS * 2 : 0, /* xv hv */
                         dp ? S * D * 2 : 0, dp ? S * I * 2 : 0}; /* xb hb */
    void *b[21];
    uint8_t *mem = scratch(sz, 21, b);
    if (!mem) return -1;
    int64_t *cnt = b[0], *fill = b[1], *order = b[2], *pos = b[3], *act = b[4];
    float *xe = b[5], *he = b[6], *y = b[7], *ue = b[8], *xsum = b[9], *hsum = b[10];
    void *xq = b[11], *hq = b[12];
    float *xd = b[13], *hd = b[14];
    /* MXFP4 on int16 activations: mxq_rows reads the block scales four times over (mx_lanes) */
    float *xds = mx && ax == ACT_Q16 ? b[15] : xd, *hds = mx && ah == ACT_Q16 ? b[16] : hd;
    memset(cnt, 0, (E + 1) * i8);
    float *xo = xe + S * (D / 2), *ho = he + S * (I / 2); /* int4: the odd halves after the even ones */
    /* plan: expert-major slot order (stable), active experts ascending */
    for (long i = 0; i < S; i++) cnt[ids[i] + 1]++;
    for (long e = 0; e < E; e++) cnt[e + 1] += cnt[e];
    memcpy(fill, cnt, E * sizeof(int64_t));
    for (long i = 0; i < S; i++) order[fill[ids[i]]++] = i;
    long A = 0;
    for (long e = 0; e < E; e++)
        if (cnt[e + 1] > cnt[e]) act[A++] = e;
    /* gather each sorted slot's input: whole rows (dense), or split even/odd through the act-order
     * permutation (int4) */
    for (long r = 0; r < S; r++) {
        const long t = order[r] / K;
        const float *xt = x + t * D;
        if (dense) {
            memcpy(xe + r * D, xt, D * sizeof(float));
            continue;
        }
        split_row(xt, perm ? perm + ids[order[r]] * D : NULL, D / 2, xe + r * (D / 2), xo + r * (D / 2));
    }
    if (mx && ax == ACT_Q8) quant_mx8(xe, xo, S, D, xq, xd, xd + S * Q8_DS(D)); /* the layer's xz */
    else if (ax) quant_act(ax, xe, xo, S, D, G, xq, xd);
    else if (int4) group_sums(xe, xo, S, D, G, xsum);
    if (mx && ax == ACT_Q16) mxq_prepare(xq, xd, S, D, xds);
    layer_t L = {fmt, data, nbytes, offs, gu, dn, sym, G, D, I, T, K, ids, cnt, order, act, w, xe, xo, he, ho, y, ue,
                 xsum, hsum, gus, dns, gub, dnb, act_kind, limit, alpha,
                 ax ? xq : NULL, ax ? act_odd(ax, xq, S, D) : NULL, /* hq: written after the gate/up pass */
                 ah ? hq : NULL, ah ? act_odd(ah, hq, S, I) : NULL,
                 xds, ax ? xd + S * ACT_DS(ax == ACT_Q16, D, G) : NULL, hds, ah ? hd + S * ACT_DS(ah == ACT_Q16, I, G) : NULL,
                 bn, bk, ax == ACT_Q16, ah == ACT_Q16, stream, NULL, NULL, 0, 0};
#if AMX_PATH
    if (amx) { /* each active expert's inputs in pairs */
        L.xv = b[17];
        L.xparts = amx_layer_pairs(xe, D, cnt, act, A, b[17]);
    }
#endif
    if (dp) {
        to_bf16_rows(xe, D, S, D, b[19]);
        L.xb = b[19];
    } else if (b16)
        round_to_bf16(xe, S * (long)D);
    parallel(gate_up_item, &L, A * ((I + ROW_BLOCK - 1) / ROW_BLOCK), nthreads);
    if (ue) lynx_silu_mul(he, ue, S * (long)I);
    if (dp) {
        to_bf16_rows(he, I, S, I, b[20]);
        L.hb = b[20];
    } else if (b16)
        round_to_bf16(he, S * (long)I);
#if AMX_PATH
    if (amx) { /* h in pairs, as x above */
        L.hv = b[18];
        L.hparts = amx_layer_pairs(he, I, cnt, act, A, b[18]);
    }
#endif
    if (mx && ah == ACT_Q8) quant_mx8(he, ho, S, I, hq, hd, hd + S * Q8_DS(I)); /* the layer's hz */
    else if (ah) quant_act(ah, he, ho, S, I, G, hq, hd);
    else if (int4) group_sums(he, ho, S, I, G, hsum);
    if (mx && ah == ACT_Q16) mxq_prepare(hq, hd, S, I, hds);
    parallel(down_item, &L, A * ((D + ROW_BLOCK - 1) / ROW_BLOCK), nthreads);
    /* combine: out[t] = sum over k in slot order (k = 0 first) */
    for (long r = 0; r < S; r++) pos[order[r]] = r;
    for (long t = 0; t < T; t++) {
        float *o = out + t * D;
        memcpy(o, y + pos[t * K] * D, D * sizeof(float));
        for (int k = 1; k < K; k++) {
            const float *yr = y + pos[t * K + k] * D;
            for (int d = 0; d < D; d++) o[d] += yr[d];
        }
    }
    scratch_free(mem);
    return 0;
}

/* --- int8 rows against int8 activations (the int8 head with --int4-act q8) ---------------------
 *
 * With AVX512-VNNI: the activations of a row in natural order, blocks of QH = 256 (llama.cpp's Q8_K,
 * which its Q6_K output matrices read: the last block may be shorter): d_b = max|x| / 127,
 * xq = round(x / d_b) (s8). vpdpbusd takes its unsigned operand from the weights: a 64-byte chunk of
 * w (s8) flipped to w + 128 (u8, one xor per row chunk, shared by the tokens), so each int32 lane sums
 * 4 products (w + 128) * xq over the block's (up to) four chunks, then is scaled by the block's d
 * once, and the row sum takes off the token's ct = 128 * sum_b d_b * sum_{j in b} xq_j at the end.
 * Approximate as the INT4 q8 path is (~2^-8 of the block's largest input per input). On AVX2
 * without AVX-512 (llama.cpp's Q8_0 x Q8_0 trick there): maddubs takes |w| (u8, <= 128) and xq with
 * w's sign (s8, |.| <= 127), so a pair of products stays within int16 (<= 32512, no saturation) and
 * no offset is needed (ct = 0); madd widens to int32 per 32-byte chunk. Needs Kin % 64 == 0. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define I8_Q8 1
#define I8_AVX512 1
#elif !(defined(__AVX512F__) && defined(__AVX512BW__)) && defined(__AVX2__) && defined(__FMA__)
#define I8_Q8 1
#define I8_AVX512 0
#else
#define I8_Q8 0
#endif
#if I8_Q8
#define QH 256
/* On AVX2 a one-token tile of int8 rows reads each row whole, row after row, when the matrix is at
 * least this big, instead of R rows interleaved 32 bytes at a time: a head that streams from DRAM
 * each step (Qwen3-30B-A3B's 151936 x 2048 int8 rows, one thread on a Zen3: 14 -> 17.6 GB/s), as the
 * experts' fp32 rows do (ROW_WHOLE_F32_AVX2); a head that stays in cache (the demo's 1 MB) runs
 * slower whole (0.78x), so it keeps the interleaved tiles. Same sums, same order either way. */
#ifndef I8_WHOLE_BYTES
#define I8_WHOLE_BYTES (8L << 20)
#endif
/* xq [T, Kin] s8, dl [T, ceil(Kin/QH)] fp32 and ct [T] of x [T, Kin] fp32 (quant_q8's rounding) */
static void quant_i8(const float *x, long T, int Kin, int8_t *xq, float *dl, float *ct) {
    const int nb = (Kin + QH - 1) / QH;
#if !I8_AVX512
    /* AVX2: the same rule 32 inputs at a time (x * id rounded to nearest-even by cvtps, as nearbyintf);
     * the codes stay signed (see above), so each token's offset ct is 0 */
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* packs' lane order back to input order */
    for (long t = 0; t < T; t++) {
        for (int b = 0; b < nb; b++) {
            const float *v = x + t * Kin + b * QH;
            const int len = Kin - b * QH < QH ? Kin - b * QH : QH; /* a multiple of 64 */
            __m256 m = _mm256_setzero_ps();
            for (int j = 0; j < len; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + j)));
            float id;
            const float db = q8_scale(hmax256(m), &id);
            const __m256 vid = _mm256_set1_ps(id);
            for (int j = 0; j < len; j += 32) {
                __m256i c[4];
                for (int i = 0; i < 4; i++) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + j + 8 * i), vid));
                const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
                _mm256_storeu_si256((__m256i *)(xq + t * Kin + b * QH + j), _mm256_permutevar8x32_epi32(p, order));
            }
            dl[t * nb + b] = db;
        }
        ct[t] = 0.0f;
    }
#else
    for (long t = 0; t < T; t++) {
        float c = 0.0f;
        for (int b = 0; b < nb; b++) {
            const float *v = x + t * Kin + b * QH;
            const int len = Kin - b * QH < QH ? Kin - b * QH : QH; /* a multiple of 64 */
            __m512 m = _mm512_setzero_ps();
            for (int j = 0; j < len; j += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(v + j)));
            float id;
            const float db = q8_scale(_mm512_reduce_max_ps(m), &id);
            __m512i sum = _mm512_setzero_si512();
            for (int j = 0; j < len; j += 16) sum = _mm512_add_epi32(sum, q8_codes16(v + j, id, xq + t * Kin + b * QH + j));
            dl[t * nb + b] = db;
            c += db * (float)(128 * _mm512_reduce_add_epi32(sum));
        }
        ct[t] = c;
    }
#endif
}

/* acc[r * ald + t] = sum over the row of w * (dequantised xq) for R adjacent int8 rows (stride rs)
 * and NT tokens (xq[t], block scales dl[t], ct[t]), R * NT <= 8; the row scale is the caller's */
static inline __attribute__((always_inline)) void i8q8_tile(const int8_t *w, const long rs, int Kin, const int R,
                                                           const int8_t *const *xq, const float *const *dl,
                                                           const float *const *ct, const int NT, float *acc,
                                                           const long ald, const int whole) {
    const int RN = R * NT;
    const long pf = NT > 1 ? PREFETCH : tile_ahead(R * rs, PREFETCH); /* as q8_tile's */
    float corr[8], out[8];
    for (int k = 0; k < RN; k++) corr[k] = *ct[k % NT];
#if I8_AVX512
    (void)whole; /* AVX-512: the tiles below whatever the size (whole rows measured on AVX2 only) */
    const int nc = Kin / 64;
    __m512 tot[8];
    __m512i ai[8];
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int k = 0; k < RN; k++) tot[k] = _mm512_setzero_ps();
    for (int b = 0; b * (QH / 64) < nc; b++) {
        const int c1 = (b + 1) * (QH / 64) < nc ? (b + 1) * (QH / 64) : nc;
        for (int k = 0; k < RN; k++) ai[k] = _mm512_setzero_si512();
        for (int c = b * (QH / 64); c < c1; c++)
            for (int r = 0; r < R; r++) {
                const __m512i wu = _mm512_xor_si512(_mm512_loadu_si512((const void *)(w + r * rs + 64L * c)), flip);
                _mm_prefetch((const char *)(w + r * rs + 64L * c) + pf, PF_HINT);
                for (int t = 0; t < NT; t++)
                    ai[r * NT + t] = _mm512_dpbusd_epi32(ai[r * NT + t], wu, _mm512_loadu_si512((const void *)(xq[t] + 64L * c)));
            }
        for (int k = 0; k < RN; k++)
            tot[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[k]), _mm512_set1_ps(dl[k % NT][b]), tot[k]);
    }
    reduce_512(tot, corr, RN, out);
#else
    /* AVX2, R * NT <= 4 (16 registers): per 32-byte chunk of a row, |w| once, then per token xq with
     * w's sign, maddubs (pairs exact in int16) and madd into the block's int32 lanes */
    const int nc = Kin / 32;
    __m256 tot[8];
    __m256i ai[8];
    const __m256i ones = _mm256_set1_epi16(1);
    for (int k = 0; k < RN; k++) tot[k] = _mm256_setzero_ps();
    /* one token from DRAM: each row whole, row after row (the same sums, same order). Its own loop on
     * purpose: folding it into the interleaved one below (a run-time row range) left the accumulators
     * in memory — 1.8x the time on a 151936 x 2048 head, and 1.4x on the demo's interleaved one */
    if (whole && NT == 1) {
        for (int r = 0; r < R; r++)
            for (int b = 0; b * (QH / 32) < nc; b++) {
                const int c1 = (b + 1) * (QH / 32) < nc ? (b + 1) * (QH / 32) : nc;
                __m256i a = _mm256_setzero_si256();
                for (int c = b * (QH / 32); c < c1; c++) {
                    const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + r * rs + 32L * c));
                    if ((c & 1) == 0) _mm_prefetch((const char *)(w + r * rs + 32L * c) + pf, PF_HINT);
                    const __m256i xs = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xq[0] + 32L * c)), wv);
                    a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(wv), xs), ones));
                }
                tot[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_set1_ps(dl[0][b]), tot[r]);
            }
        reduce_256(tot, corr, RN, out);
        for (int r = 0; r < R; r++) acc[r * ald] = out[r];
        return;
    }
    for (int b = 0; b * (QH / 32) < nc; b++) {
        const int c1 = (b + 1) * (QH / 32) < nc ? (b + 1) * (QH / 32) : nc;
        for (int k = 0; k < RN; k++) ai[k] = _mm256_setzero_si256();
        for (int c = b * (QH / 32); c < c1; c++)
            for (int r = 0; r < R; r++) {
                const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + r * rs + 32L * c));
                if ((c & 1) == 0) _mm_prefetch((const char *)(w + r * rs + 32L * c) + pf, PF_HINT);
                const __m256i aw = _mm256_abs_epi8(wv);
                for (int t = 0; t < NT; t++) {
                    const __m256i xs = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xq[t] + 32L * c)), wv);
                    ai[r * NT + t] = _mm256_add_epi32(ai[r * NT + t], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), ones));
                }
            }
        for (int k = 0; k < RN; k++)
            tot[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ai[k]), _mm256_set1_ps(dl[k % NT][b]), tot[k]);
    }
    reduce_256(tot, corr, RN, out);
#endif
    for (int r = 0; r < R; r++)
        for (int t = 0; t < NT; t++) acc[r * ald + t] = out[r * NT + t];
}

/* acc[r * ROWS_LD + t] for R (1..4) adjacent rows and n tokens: q8_block's tiles */
static void i8q8_block(const int8_t *w, long rs, int Kin, int R, const int8_t *xq0, const float *dl0,
                       const float *ct0, int n, float *acc, int whole) {
    const int8_t *xq[4];
    const float *dl[4], *ct[4];
    const int nb = (Kin + QH - 1) / QH;
#define I8_TOKENS(t0, m) \
    for (int i = 0; i < (m); i++) { \
        xq[i] = xq0 + (long)((t0) + i) * Kin; dl[i] = dl0 + (long)((t0) + i) * nb; ct[i] = ct0 + (t0) + i; }
#define I8_TILE(RR, M, r0, t0) \
    i8q8_tile(w + (r0) * rs, rs, Kin, RR, xq, dl, ct, M, acc + (r0) * ROWS_LD + (t0), ROWS_LD, whole)
    WALK_TILES(I8_TILE, I8_TOKENS, R, n, I8_AVX512, I8_AVX512); /* AVX2: tiles of <= 4 sums (its 16 registers) */
#undef I8_TILE
#undef I8_TOKENS
}
#endif

typedef struct {
    int fmt, T, Kin, N;
    const float *x, *bias;
    const uint8_t *w;
    long es;
    float *out;
    const float *scale; /* FMT_I8: fp32 [N], one per row; else NULL */
    const int8_t *xq; /* FMT_I8 with int8 activations (i8q8_block): xq [T, Kin], dl [T, Kin/QH], ct [T]; else NULL */
    const float *dl, *ct;
    int whole; /* i8q8_block: one-token rows read whole; dp_block: stream (a matrix that streams from DRAM) */
    const uint16_t *xb; /* FMT_BF16 with bf16 activations (dp_block): x rounded [T, Kin]; else NULL */
} linear_t;

static void linear_item(const void *arg, long item) {
    const linear_t *P = arg;
    float acc[ROW_BLOCK * ROWS_LD];
    const int step = P->xq ? 4 : ROW_BLOCK;
    for (int n = (int)item * ROW_BLOCK; n < P->N && n < (item + 1) * ROW_BLOCK; n += step) {
        const int R = P->N - n < step ? P->N - n : step;
        for (int c = 0; c < P->T; c += ROWS_LD) {
            const int m = P->T - c < ROWS_LD ? P->T - c : ROWS_LD;
#if I8_Q8
            if (P->xq)
                i8q8_block((const int8_t *)P->w + (long)n * P->Kin, P->Kin, P->Kin, R, P->xq + (long)c * P->Kin,
                           P->dl + (long)c * ((P->Kin + QH - 1) / QH), P->ct + c, m, acc, P->whole);
            else
#endif
            if (P->xb)
                dp_block(P->w + (long)n * P->Kin * 2, (long)P->Kin * 2, P->Kin, R, P->xb + (long)c * P->Kin, P->Kin, m, acc,
                         P->whole);
            else
                dense_block(P->w + (long)n * P->Kin * P->es, (long)P->Kin * P->es, P->fmt, P->Kin, R,
                            P->x + (long)c * P->Kin, P->Kin, m, acc, 0);
            /* token by token: a token's R outputs are adjacent, while its neighbours' are N apart (a
             * multiple of 4 KiB for most heads and projections, so row by row their stores all fell
             * in one L1 set: the demo's head at 16 tokens ran 1.4x slower than with 4000 rows) */
            for (int t = 0; t < m; t++) {
                float *o = P->out + (long)(c + t) * P->N + n;
                for (int r = 0; r < R; r++)
                    o[r] = acc[r * ROWS_LD + t] * (P->scale ? P->scale[n + r] : 1.0f) + (P->bias ? P->bias[n + r] : 0.0f);
            }
        }
    }
}

/* out [T, N] = x [T, Kin] fp32 @ w [N, Kin]^T (+ bias [N] fp32 or NULL); fmt FMT_F32 / FMT_BF16. act
 * ACT_BF16 / ACT_BF16S (rows from DRAM): bf16 rows meet x rounded to bf16 (dp_block) where this build
 * has it, else fp32 x. */
void lynx_linear(int fmt, const float *x, const uint8_t *w, const float *bias, int T, int Kin, int N, float *out,
                 int nthreads, int act) {
    linear_t P = {fmt, T, Kin, N, x, bias, w, fmt == FMT_F32 ? 4 : 2, out, NULL, NULL, NULL, NULL, 0, NULL};
    uint8_t *mem = NULL;
    uint16_t small[4096]; /* a decode step's inputs (up to 8 KB) without a malloc per call */
    if (fmt == FMT_BF16 && (act == ACT_BF16 || act == ACT_BF16S) && BF16_DP) { /* out of memory: the fp32 rows (exact) */
        const size_t sz[1] = {(size_t)T * Kin * 2};
        void *b[1] = {small};
        if (sz[0] <= sizeof small || (mem = scratch(sz, 1, b))) {
            to_bf16_rows(x, Kin, T, Kin, b[0]);
            P.xb = b[0];
            P.whole = act == ACT_BF16S; /* dp_block's stream */
        }
    }
    parallel(linear_item, &P, (N + ROW_BLOCK - 1) / ROW_BLOCK, nthreads);
    scratch_free(mem);
}

/* out [T, N] = (x [T, Kin] fp32 @ q [N, Kin]^T) * scale [N] (+ bias [N] fp32 or NULL) for int8 rows
 * with one fp32 scale each (quant/int8.py: the int8 head); products and sums in fp32, or with q8 int8
 * activations (i8q8_block) where this build has them (lynx_i8_q8) and Kin % 64 == 0. Returns 0, or -1
 * when out of memory. */
int lynx_linear_int8(const float *x, const int8_t *q, const float *scale, const float *bias, int T, int Kin, int N,
                     float *out, int nthreads, int q8) {
    linear_t P = {FMT_I8, T, Kin, N, x, bias, (const uint8_t *)q, 1, out, scale, NULL, NULL, NULL, 0};
    uint8_t *mem = NULL;
#if I8_Q8
    if (q8 && Kin % 64 == 0) {
        const size_t nb = (size_t)(Kin + QH - 1) / QH, sz[2] = {(size_t)T * Kin, (size_t)T * (nb + 1) * sizeof(float)};
        void *b[2];
        if (!(mem = scratch(sz, 2, b))) return -1;
        int8_t *xq = b[0];
        float *dl = b[1];
        quant_i8(x, T, Kin, xq, dl, dl + (size_t)T * nb);
        P.xq = xq;
        P.dl = dl;
        P.ct = dl + (size_t)T * nb;
        P.whole = !I8_AVX512 && (long)N * Kin >= I8_WHOLE_BYTES;
    }
#else
    (void)q8;
#endif
    parallel(linear_item, &P, (N + ROW_BLOCK - 1) / ROW_BLOCK, nthreads);
    scratch_free(mem);
    return 0;
}

/* 1 when lynx_linear_int8 can run int8 activations (AVX512-VNNI or AVX2), else 0 */
int lynx_i8_q8(void) { return I8_Q8; }

/* whether q16 is measured to beat the fp32 rows on this build and CPU, so native.default_int4_act
 * picks it:
 * - AVX2 + FMA without AVX-512 (an AMD EPYC Zen3: 1.38-1.80x, benchmarks/results/int4_act_rows.json);
 * - AVX-512 on an AMD CPU, whose 512-bit ops run as two 256-bit halves (an AMD EPYC Zen4: the q16
 *   rows, 256-bit integer dot products, 1.24-2.51x the fp32 rows at 1-16 tokens from DRAM,
 *   int4_act_rows_s40.json; end to end at B=1 on a 4-bit checkpoint 1.6x: vs_llamacpp_s40_int4.json
 *   against vs_llamacpp_s40.json's f32 rows).
 * AVX-512 on other CPUs (an Intel Xeon's full-width FMAs) is unmeasured against q16 and keeps f32,
 * as do the portable loops. */
int lynx_q16_pays(void) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    return 1;
#elif defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && (defined(__x86_64__) || defined(__i386__))
    unsigned a, b, c, d;
    return __get_cpuid(0, &a, &b, &c, &d) && b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u; /* "AuthenticAMD" */
#else
    return 0;
#endif
}

typedef struct {
    int T, Kin, N, G;
    const uint8_t *q, *z;
    const uint16_t *s;
    const float *xe, *xo, *xs, *bias;
    float *out;
    const void *qe, *qo; /* integer activations (int8, or int16 when q16) or NULL */
    const float *d, *zx;
    int q16;
} qlinear_t;

static void qlinear_item(const void *arg, long item) {
    const qlinear_t *P = arg;
    float acc[4 * ROWS_LD];
    const int Kin = P->Kin, h = Kin / 2, ng = Kin / P->G;
    for (int n = (int)item * ROW_BLOCK; n < P->N && n < (item + 1) * ROW_BLOCK; n += 4) {
        const int R = P->N - n < 4 ? P->N - n : 4;
        for (int c = 0; c < P->T; c += ROWS_LD) {
            const int m = P->T - c < ROWS_LD ? P->T - c : ROWS_LD;
            if (P->qe)
                act_block(P->q16, P->q + (long)n * h, h, P->s + n, P->z ? P->z + n : NULL, P->N, Kin, P->G, R, P->qe,
                          P->qo, (long)c * h, P->d + (long)c * ACT_DS(P->q16, Kin, P->G), P->zx + (long)c * ng, m, acc);
            else
                dot_block(P->q + (long)n * h, h, P->s + n, P->z ? P->z + n : NULL, P->N, Kin, P->G, R,
                          P->xe + (long)c * h, P->xo + (long)c * h, h, P->xs + (long)c * ng, m, acc);
            for (int t = 0; t < m; t++) /* token by token (see linear_item) */
                for (int r = 0; r < R; r++)
                    P->out[(long)(c + t) * P->N + n + r] = acc[r * ROWS_LD + t] + (P->bias ? P->bias[n + r] : 0.0f);
        }
    }
}

/* out [T, N] = x [T, Kin] fp32 @ W^T (+ bias [N] fp32 or NULL) for one INT4 linear W [N, Kin] kept
 * packed (a GPTQ / AWQ attention or dense projection): codes q [N, Kin/2], fp16 scales s [Kin/G, N],
 * zeros z [Kin/G, N] or NULL (symmetric: 8), perm [Kin] int32 or NULL (act order: code column j
 * multiplies input perm[j]). The input is split into even/odd columns once, then every row block
 * is one work item (as the MoE kernel's rows). amode: ACT_F32, or integer activations, ACT_Q8 (int8,
 * q8_rows) or ACT_Q16 (int16, q16_block), where they take the shape (act_for).
 * Returns 0, or -1 when out of memory. */
int lynx_linear_int4(const float *x, const uint8_t *q, const uint16_t *s, const uint8_t *z, const int32_t *perm,
                     const float *bias, int T, int Kin, int N, int G, float *out, int nthreads, int amode) {
    const long h = Kin / 2;
    const int a = act_for(amode, Kin, G);
    const size_t sz[4] = {2L * T * h * sizeof(float), a ? 0 : ((size_t)T * (Kin / G) + 1) * sizeof(float), /* xe xo, xs */
                          act_bytes(a, T, Kin), act_floats(a, T, Kin, G) * sizeof(float)};          /* xq, d zx */
    void *b[4];
    uint8_t *mem = scratch(sz, 4, b);
    if (!mem) return -1;
    float *xe = b[0], *xs = b[1], *d = b[3];
    float *xo = xe + (long)T * h;
    for (long t = 0; t < T; t++) split_row(x + t * Kin, perm, h, xe + t * h, xo + t * h);
    if (a) quant_act(a, xe, xo, T, Kin, G, b[2], d); /* zero sums after the block scales */
    else group_sums(xe, xo, T, Kin, G, xs);
    qlinear_t P = {T, Kin, N, G, q, z, s, xe, xo, xs, bias, out, a ? b[2] : NULL, a ? act_odd(a, b[2], T, Kin) : NULL, d,
                   a ? d + (long)T * ACT_DS(a == ACT_Q16, Kin, G) : NULL, a == ACT_Q16};
    parallel(qlinear_item, &P, (N + ROW_BLOCK - 1) / ROW_BLOCK, nthreads);
    scratch_free(mem);
    return 0;
}

typedef struct {
    const uint8_t *q, *z;
    const uint16_t *s;
    int Kin, N, G;
    float *out;
} dequant_t;

static void dequant_item(const void *arg, long item) {
    const dequant_t *P = arg;
    const int h = P->Kin / 2, ng = P->Kin / P->G;
    for (int n = (int)item * ROW_BLOCK; n < P->N && n < (item + 1) * ROW_BLOCK; n++) {
        const uint8_t *q = P->q + (long)n * h;
        float *o = P->out + (long)n * P->Kin;
        for (int g = 0; g < ng; g++) {
            const float sg = h2f(P->s[(long)g * P->N + n]), zg = (float)(P->z ? P->z[(long)g * P->N + n] : 8);
            for (int j = g * (P->G / 2); j < (g + 1) * (P->G / 2); j++) {
                o[2 * j] = ((float)(q[j] & 15) - zg) * sg;
                o[2 * j + 1] = ((float)(q[j] >> 4) - zg) * sg;
            }
        }
    }
}

/* w [N, Kin] fp32 = s * (q - z) for one INT4 linear (layout as lynx_linear_int4; columns in code
 * order, act order not applied): exact, as int4.dequant. Prefill widens row chunks with it. */
void lynx_dequant_int4(const uint8_t *q, const uint16_t *s, const uint8_t *z, int Kin, int N, int G, float *out,
                       int nthreads) {
    dequant_t P = {q, z, s, Kin, N, G, out};
    parallel(dequant_item, &P, (N + ROW_BLOCK - 1) / ROW_BLOCK, nthreads);
}

typedef struct {
    int T, Kin, N, bn, bk;
    const uint8_t *q;
    const float *s, *x, *bias;
    float *out;
} f8linear_t;

static void f8linear_item(const void *arg, long item) {
    const f8linear_t *P = arg;
    float acc[ROW_BLOCK * 64];
    const int nk = P->Kin / P->bk, n0 = (int)item * ROW_BLOCK, R = P->N - n0 < ROW_BLOCK ? P->N - n0 : ROW_BLOCK;
    for (int c = 0; c < P->T; c += 64) {
        const int m = P->T - c < 64 ? P->T - c : 64;
        for (int r = 0; r < R; r++)
            f8_slots(P->q + (long)(n0 + r) * P->Kin, P->s + (long)((n0 + r) / P->bn) * nk, P->Kin, P->bk,
                     P->x + (long)c * P->Kin, P->Kin, m, acc + r * 64);
        for (int t = 0; t < m; t++) /* token by token (see linear_item) */
            for (int r = 0; r < R; r++)
                P->out[(long)(c + t) * P->N + n0 + r] = acc[r * 64 + t] + (P->bias ? P->bias[n0 + r] : 0.0f);
    }
}

/* out [T, N] = x [T, Kin] fp32 @ W^T (+ bias [N] fp32 or NULL) for one block-scaled FP8 linear W
 * [N, Kin] read in place (an FP8 checkpoint's attention): e4m3 codes q [N, Kin], fp32 scales s
 * [ceil(N/bn), Kin/bk] (bk | Kin, bk % 32 == 0: the caller checks). */
void lynx_linear_fp8(const float *x, const uint8_t *q, const float *s, int bn, int bk, const float *bias, int T,
                     int Kin, int N, float *out, int nthreads) {
    f8linear_t P = {T, Kin, N, bn, bk, q, s, x, bias, out};
    parallel(f8linear_item, &P, (N + ROW_BLOCK - 1) / ROW_BLOCK, nthreads);
}

typedef struct {
    const uint8_t *q;
    const float *s;
    int bn, bk, N, K;
    float *out;
} f8deq_t;

static void f8deq_item(const void *arg, long item) {
    const f8deq_t *P = arg;
    const int nk = P->K / P->bk;
    for (int n = (int)item * ROW_BLOCK; n < P->N && n < (item + 1) * ROW_BLOCK; n++) {
        const uint8_t *q = P->q + (long)n * P->K;
        float *o = P->out + (long)n * P->K;
        for (int b = 0; b < nk; b++) {
            const float sv = P->s[(long)(n / P->bn) * nk + b] * F8_UNIT;
            int j = b * P->bk;
#if defined(__AVX512F__)
            const __m256i keep = _mm256_set1_epi16((short)0xBFFF);
            for (; j + 16 <= (b + 1) * P->bk; j += 16)
                _mm512_storeu_ps(o + j, _mm512_mul_ps(_mm512_set1_ps(sv), _mm512_cvtph_ps(_mm256_and_si256(
                    _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + j))), 7), keep))));
#endif
            for (; j < (b + 1) * P->bk; j++) o[j] = h2f(f8_h(q[j])) * sv;
        }
    }
}

/* w [N, K] fp32 = e4m3(q) * s for one block-scaled FP8 weight (codes q [N, K], fp32 scales s
 * [ceil(N/bn), K/bk], bk | K): exact, as quant/fp8.dequant (the loader's and prefill's widening). */
void lynx_dequant_fp8(const uint8_t *q, const float *s, int bn, int bk, int N, int K, float *out, int nthreads) {
    f8deq_t P = {q, s, bn, bk, N, K, out};
    parallel(f8deq_item, &P, (N + ROW_BLOCK - 1) / ROW_BLOCK, nthreads);
}

/* --- decode attention ------------------------------------------------------------------------- */

/* One decode token per row after the fused q/k/v projection: q/k RMSNorm per head (optional),
 * rotate-half RoPE over the first rd dims, the new K/V written into the cache, then grouped-query
 * attention of each q head over its row's positions [pos - window + 1, pos] (all of 0..pos
 * without a window). One work item per (row, kv head): the group's q heads share each K/V row
 * read. Cache [Bmax, Hkv, S, hd] per tensor, fp32 or bf16 (written round-to-nearest-even). */
typedef struct {
    const float *qkv; /* [B, (H + 2 Hkv) hd] */
    int B, H, Hkv, hd, rd, window, cfmt;
    const float *qn, *kn; /* [hd] RMSNorm weights, or NULL */
    float eps, scale;
    const float *cos, *sin; /* [B, rd] */
    const int64_t *pos, *rows;
    uint8_t *kc, *vc;
    long S;
    float *out; /* [B, H hd] */
    float *scores; /* [B Hkv, Lmax G] scratch */
    long Lmax;
    const float *sinks; /* [H] learned sink logits (gpt-oss: one more softmax logit per head, no value), or NULL */
    long ring; /* > 0: the cache is a window layer's ring, S = 2 ring: position p at slots p % ring and + ring */
    long nchunk; /* > 1: rows past ATTN_CHUNK positions attend in chunks (attn_chunk_item), this many an item */
    float *part, *ml; /* the chunks' unnormalised outputs [items, G, hd] and (max, sum) [items, G, 2] */
} attn_t;

/* sum of v[j]^2, j < n, in 16 interleaved partial sums (lane l takes j = l mod 16; the tail after
 * the last full 16 goes to lanes 0.. too) folded in a fixed order: one vector FMA chain instead of a
 * serial scalar one (~4 cycles per element), the same sum for a row wherever it sits in a batch */
static inline float sum_sq(const float *v, int n) {
    float acc[16] = {0.0f};
    int j = 0;
    for (; j + 16 <= n; j += 16)
        for (int l = 0; l < 16; l++) acc[l] += v[j + l] * v[j + l];
    for (int l = 0; j + l < n; l++) acc[l] += v[j + l] * v[j + l];
    for (int w = 8; w > 0; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

static void norm_rope(float *v, int hd, const float *nw, float eps, const float *cos, const float *sin, int rd) {
    if (nw) {
        const float r = 1.0f / sqrtf(sum_sq(v, hd) / (float)hd + eps);
        for (int j = 0; j < hd; j++) v[j] = nw[j] * (v[j] * r);
    }
    const int h = rd / 2;
    for (int j = 0; j < h; j++) { /* x * cos + cat(-x2, x1) * sin */
        const float a = v[j], b = v[j + h];
        v[j] = a * cos[j] - b * sin[j];
        v[j + h] = b * cos[j + h] + a * sin[j + h];
    }
}

static inline void store_row(uint8_t *dst, int cfmt, const float *v, int n) {
    if (cfmt == FMT_F32) {
        memcpy(dst, v, n * sizeof(float));
        return;
    }
    uint16_t *d = (uint16_t *)dst;
    for (int j = 0; j < n; j++) {
        union { float f; uint32_t u; } c = {v[j]};
        d[j] = (uint16_t)((c.u + 0x7FFFu + ((c.u >> 16) & 1u)) >> 16); /* round to nearest even */
    }
}

static inline void load_row(const uint8_t *src, int cfmt, float *v, int n) {
    if (cfmt == FMT_F32) {
        memcpy(v, src, n * sizeof(float));
        return;
    }
    const uint16_t *s = (const uint16_t *)src;
    for (int j = 0; j < n; j++) {
        union { uint32_t u; float f; } c = {(uint32_t)s[j] << 16};
        v[j] = c.f;
    }
}

#define MAX_HD 256   /* head dims and q heads per kv head the stack buffers hold (larger: torch) */
#define MAX_GROUP 16

/* the new key (normed, rotated) and value of (row b, kv head g) into the cache at its position */
static void kv_write(const attn_t *A, int b, int g) {
    const int hd = A->hd;
    const long es = A->cfmt == FMT_F32 ? 4 : 2, width = (long)(A->H + 2 * A->Hkv) * hd;
    const float *row = A->qkv + b * width, *cs = A->cos + (long)b * A->rd, *sn = A->sin + (long)b * A->rd;
    const long base = ((long)A->rows[b] * A->Hkv + g) * A->S;
    float kv[MAX_HD];
    memcpy(kv, row + (long)(A->H + g) * hd, hd * sizeof(float));
    norm_rope(kv, hd, A->kn, A->eps, cs, sn, A->rd);
    const long at = A->ring ? A->pos[b] % A->ring : A->pos[b];
    for (long s = at; s < A->S; s += A->ring ? A->ring : A->S) { /* a ring keeps each position twice */
        store_row(A->kc + (base + s) * hd * es, A->cfmt, kv, hd);
        store_row(A->vc + (base + s) * hd * es, A->cfmt, row + (long)(A->H + A->Hkv + g) * hd, hd);
    }
}

/* the largest of v[0..n), NaNs passed over (as `v[s] > m ? v[s] : m` from -inf would: vmaxps(v, m)
 * returns m where v is NaN); a max is exact, so the lanes' order does not change it */
static inline float max_of(const float *v, long n) {
    float m = -INFINITY;
    long s = 0;
#if defined(__AVX512F__)
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (; s + 16 <= n; s += 16) mv = _mm512_max_ps(_mm512_loadu_ps(v + s), mv);
    m = _mm512_reduce_max_ps(mv);
#elif defined(__AVX2__)
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (; s + 8 <= n; s += 8) mv = _mm256_max_ps(_mm256_loadu_ps(v + s), mv);
    float l[8];
    _mm256_storeu_ps(l, mv);
    for (int i = 0; i < 8; i++) m = l[i] > m ? l[i] : m;
#endif
    for (; s < n; s++) m = v[s] > m ? v[s] : m;
    return m;
}

#if VEC_PATHS
/* the vector ops of attention's value pass (pv_*) and score pass (qk_*), one set per width */
#if defined(__AVX512F__)
#define PVW 16 /* fp32 lanes per vector */
#define PV_VEC __m512
#define PV_ZERO _mm512_setzero_ps()
#define PV_SET1 _mm512_set1_ps
#define PV_FMA _mm512_fmadd_ps
#define PV_STORE _mm512_storeu_ps
#define PV_LOADF(p) _mm512_loadu_ps(p)
#define PV_LOADB(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define PV_JB 4 /* vectors of dims per tile: HB x PV_JB <= 16 accumulators of 32 registers */
#else
#define PVW 8
#define PV_VEC __m256
#define PV_ZERO _mm256_setzero_ps()
#define PV_SET1 _mm256_set1_ps
#define PV_FMA _mm256_fmadd_ps
#define PV_STORE _mm256_storeu_ps
#define PV_LOADF(p) _mm256_loadu_ps(p)
#define PV_LOADB(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define PV_JB 2 /* HB x PV_JB <= 8 accumulators of 16 registers (pv_vec widens it for fewer heads) */
#endif
#define PV_JB_MAX (PV_JB == 2 ? 8 : PV_JB) /* the widest tile pv_tile takes: AVX2's one head x 8 vectors */
#define PV_ROWS 64 /* value rows per block: every tile's pass over a block reads it from L1 (hd 128 fp32: 32 KB) */
/* o[i][j0*PVW .. (j0+JB)*PVW) for HB heads from head i0: the sum over the L positions of p_is v_s
 * in position order, one multiply-add per position into accumulators that stay in registers, so
 * each value vector loaded serves HB heads and o is stored once, not read and written per
 * position. The same fused sums as the generic loop below (0 + p_0 v_0, then + p_1 v_1, ...):
 * measured 1.2-1.3x on the whole attention call (benchmarks/attn_decode.py). FAR (rows of 4 blocks
 * or more): each position prefetches this pass's line of the row a block on (PV_ROWS), so the next
 * block streams in while this one goes through its ~16 tiles, where eight rows on hid only ~30
 * cycles of a DRAM read (Qwen3-30B-A3B's group of 8 from DRAM: 40 -> 56 GFLOP/s in a harness,
 * 1.1-1.2x on the call); short rows (the demo's 144) keep the eight, 5% faster there. */
static inline __attribute__((always_inline)) void pv_tile(const uint8_t *v0, int cfmt, int hd, long L, const float *sc,
                                                          long s0, long s1, int i0, const int HB, int j0, const int JB,
                                                          const int FAR, float *o) {
    const long es = cfmt == FMT_F32 ? 4 : 2, rs = hd * es;
    PV_VEC a[4][PV_JB_MAX];
    for (int i = 0; i < HB; i++) /* positions s0.. go on from the sums of the positions before */
        for (int j = 0; j < JB; j++) a[i][j] = s0 ? PV_LOADF(o + (long)(i0 + i) * hd + (j0 + j) * PVW) : PV_ZERO;
    for (long s = s0; s < s1; s++) {
        const uint8_t *row = v0 + s * rs;
        if (!FAR) __builtin_prefetch(row + 8 * rs + j0 * PVW * es, 0, 3); /* (the first line this pass reads) */
        /* L is the scores' stride, the whole window: a chunk's prefetches run on into the next chunk's
         * rows (which this thread usually takes next; bounding them by the chunk measured 0.96x) and the
         * last chunk's up to PV_ROWS rows past the window (harmless: a prefetch never faults) */
        else if (s + PV_ROWS < L) __builtin_prefetch(row + PV_ROWS * rs + j0 * PVW * es, 0, 3);
        PV_VEC vv[PV_JB_MAX];
        for (int j = 0; j < JB; j++)
            vv[j] = cfmt == FMT_F32 ? PV_LOADF((const float *)row + (j0 + j) * PVW)
                                    : PV_LOADB((const uint16_t *)row + (j0 + j) * PVW);
        for (int i = 0; i < HB; i++) {
            const PV_VEC p = PV_SET1(sc[(long)(i0 + i) * L + s]);
            for (int j = 0; j < JB; j++) a[i][j] = PV_FMA(p, vv[j], a[i][j]);
        }
    }
    for (int i = 0; i < HB; i++)
        for (int j = 0; j < JB; j++) PV_STORE(o + (long)(i0 + i) * hd + (j0 + j) * PVW, a[i][j]);
}

/* o [G, hd] = p [G, L] (scores rows, stride ld) times the L value rows from v0 (hd % PVW == 0):
 * blocks of PV_ROWS positions, in order, each through tiles of up to 4 heads x PV_JB vectors of
 * dims (AVX2: up to 8 / heads vectors; pv_tile), so the value rows come from memory once whatever
 * the number of tiles */
static void pv_vec(const uint8_t *v0, int cfmt, int hd, long L, const float *sc, long ld, int G, float *o) {
    const int far = L >= 4 * PV_ROWS;
/* the tile of h heads x j vectors, its prefetch distance (far) a compile-time constant */
#define PV(h, j) \
    if (HB == h && JB == j) { \
        if (far) pv_tile(v0, cfmt, hd, ld, sc, s0, s1, i0, h, j0, j, 1, o); \
        else pv_tile(v0, cfmt, hd, ld, sc, s0, s1, i0, h, j0, j, 0, o); \
    }
    for (long s0 = 0; s0 < L; s0 += PV_ROWS) {
        const long s1 = L - s0 < PV_ROWS ? L : s0 + PV_ROWS;
#if PV_JB == 2
        /* AVX2: eight accumulators whatever the heads (one head x 8 vectors, two x 4, three or four x 2):
         * with HB x 2 only, the demo's two heads per kv head ran four multiply-add chains, each
         * position waiting on the FMA latency (benchmarks/results/attn_pv_s26.json). Each output
         * keeps its one sum over the positions in order: bit-equal to any other tiling. */
        for (int i0 = 0; i0 < G; i0 += 4) {
            const int HB = G - i0 < 4 ? G - i0 : 4, nv = hd / PVW;
            int JB = HB == 1 ? 8 : HB == 2 ? 4 : 2;
            while (nv % JB) JB /= 2;
            for (int j0 = 0; j0 < nv; j0 += JB) {
                PV(2, 4) else PV(1, 8) else PV(4, 2) else PV(1, 4) else PV(2, 2) else PV(3, 2)
                else PV(1, 2) else PV(1, 1) else PV(2, 1) else PV(3, 1) else PV(4, 1)
            }
        }
#else
        for (int j0 = 0; j0 < hd / PVW; j0 += PV_JB) {
            const int JB = hd / PVW - j0 < PV_JB ? hd / PVW - j0 : PV_JB;
            for (int i0 = 0; i0 < G; i0 += 4) {
                const int HB = G - i0 < 4 ? G - i0 : 4;
                PV(4, PV_JB) else PV(2, PV_JB) else PV(1, PV_JB) else PV(3, PV_JB)
                else PV(4, 1) else PV(2, 1) else PV(1, 1) else PV(3, 1)
#if PV_JB == 4
                else PV(4, 2) else PV(2, 2) else PV(1, 2) else PV(3, 2)
                else PV(4, 3) else PV(2, 3) else PV(1, 3) else PV(3, 3)
#endif
            }
        }
#endif
    }
#undef PV
}

#if defined(__AVX512F__)
#define QK_N 16 /* scores per tile: one accumulator each (sum_lanes) */
#else
#define QK_N 8
#endif

/* scores of RK keys (rows k0 + r * rs, r < RK; rows past n_k repeat the last) against HB heads (q
 * rows i0.., past G repeat the last), RK * HB == QK_N: one accumulator per key x head over hd / PVW
 * vectors (QK_N independent multiply-add chains: one key's few would wait on the FMA latency), keys
 * prefetched 16 rows ahead, then sum_lanes. sc[i * L + r] for the real keys and heads. */
static inline __attribute__((always_inline)) void qk_tile(const uint8_t *k0, int cfmt, int hd, const float *q, int G,
                                                          int i0, const int HB, const int RK, long n_k, float *sc,
                                                          long L) {
    const long es = cfmt == FMT_F32 ? 4 : 2, rs = hd * es;
    PV_VEC a[QK_N];
    const uint8_t *kr[QK_N];
    const float *qi[4];
    for (int r = 0; r < RK; r++) kr[r] = k0 + (r < n_k ? r : n_k - 1) * rs;
    for (int i = 0; i < HB; i++) qi[i] = q + (long)(i0 + i < G ? i0 + i : G - 1) * hd;
    for (int n = 0; n < QK_N; n++) a[n] = PV_ZERO;
    for (int j = 0; j < hd; j += PVW) {
        PV_VEC qv[4];
        for (int i = 0; i < HB; i++) qv[i] = PV_LOADF(qi[i] + j);
        for (int r = 0; r < RK; r++) {
            if ((j * es & 63) == 0) __builtin_prefetch(kr[r] + j * es + 16 * rs, 0, 3);
            const PV_VEC kv = cfmt == FMT_F32 ? PV_LOADF((const float *)kr[r] + j) : PV_LOADB((const uint16_t *)kr[r] + j);
            for (int i = 0; i < HB; i++) a[r * HB + i] = PV_FMA(kv, qv[i], a[r * HB + i]);
        }
    }
    float out[QK_N];
    sum_lanes(a, out);
    for (int r = 0; r < RK && r < n_k; r++)
        for (int i = 0; i < HB && i0 + i < G; i++) sc[(long)(i0 + i) * L + r] = out[r * HB + i];
}

/* sc [G, L] (rows ld apart) = the G (scaled) query rows q [G, hd] against the L key rows from k0 (hd % PVW == 0):
 * tiles of QK_N / 4 keys x 4 heads (G >= 3), or of QK_N / G keys x G heads */
static void qk_vec(const uint8_t *k0, int cfmt, int hd, long L, const float *q, int G, float *sc, long ld) {
    const long rs = (cfmt == FMT_F32 ? 4 : 2) * (long)hd;
    const int HB = G >= 3 ? 4 : G, RK = QK_N / HB;
    for (long s = 0; s < L; s += RK)
        for (int i0 = 0; i0 < G; i0 += HB) {
            if (HB == 4) qk_tile(k0 + s * rs, cfmt, hd, q, G, i0, 4, QK_N / 4, L - s, sc + s, ld);
            else if (HB == 2) qk_tile(k0 + s * rs, cfmt, hd, q, G, i0, 2, QK_N / 2, L - s, sc + s, ld);
            else qk_tile(k0 + s * rs, cfmt, hd, q, G, i0, 1, QK_N, L - s, sc + s, ld);
        }
}
#endif

/* the positions row b attends to: its window's (all of 0..pos without one) */
static inline long attn_len(const attn_t *A, int b) {
    const int64_t p = A->pos[b];
    return p - (A->window > 0 && p - A->window + 1 > 0 ? p - A->window + 1 : 0) + 1;
}

/* (row b, kv head g): its window's first key and value rows (kc, vc: the window's keys from there
 * on, in position order; a ring's are contiguous from lo % ring, kv_cache.py) and the group's G
 * queries q [G, hd], normed, rotated and scaled (this step's keys are already cached) */
static void attn_setup(const attn_t *A, int b, int g, float *q, uint8_t **kc, uint8_t **vc) {
    const int hd = A->hd, G = A->H / A->Hkv;
    const long es = A->cfmt == FMT_F32 ? 4 : 2, width = (long)(A->H + 2 * A->Hkv) * hd, L = attn_len(A, b);
    const long lo = A->pos[b] - L + 1, s0 = A->ring ? lo % A->ring : lo;
    const long base = ((long)A->rows[b] * A->Hkv + g) * A->S; /* this (row, kv head)'s [S, hd] */
    const float *row = A->qkv + b * width, *cs = A->cos + (long)b * A->rd, *sn = A->sin + (long)b * A->rd;
    *kc = A->kc + (base + s0) * hd * es;
    *vc = A->vc + (base + s0) * hd * es;
    for (int i = 0; i < G; i++) {
        float *qi = q + i * hd;
        memcpy(qi, row + (long)(g * G + i) * hd, hd * sizeof(float));
        norm_rope(qi, hd, A->qn, A->eps, cs, sn, A->rd);
        for (int j = 0; j < hd; j++) qi[j] *= A->scale;
    }
}

static void attn_item(const void *arg, long item) {
    const attn_t *A = arg;
    const int b = (int)(item / A->Hkv), g = (int)(item % A->Hkv), hd = A->hd, G = A->H / A->Hkv;
    const long es = A->cfmt == FMT_F32 ? 4 : 2, L = attn_len(A, b);
    uint8_t *kc, *vc; /* the window's first key and value rows */
    float q[MAX_GROUP * MAX_HD], o[MAX_GROUP * MAX_HD], vr[4 * MAX_HD], acc[4 * ROWS_LD];
    attn_setup(A, b, g, q, &kc, &vc);
    float *sc = A->scores + item * A->Lmax * G; /* scores [G, L]: q head i's at sc + i * L */
#if VEC_PATHS
    if (hd % PVW == 0) qk_vec(kc, A->cfmt, hd, L, q, G, sc, L);
    else
#endif
    for (long s = 0; s < L; s += 4) { /* four keys at a time (adjacent rows of the cache) */
        const int R = L - s < 4 ? (int)(L - s) : 4;
        dense_block(kc + s * hd * es, hd * es, A->cfmt, hd, R, q, hd, G, acc, 0);
        for (int r = 0; r < R; r++)
            for (int i = 0; i < G; i++) sc[i * L + s + r] = acc[r * ROWS_LD + i];
    }
    for (int i = 0; i < G; i++) { /* softmax over the L positions (and the head's sink), fp32 */
        float *v = sc + i * L;
        float m = max_of(v, L);
        const float sink = A->sinks ? A->sinks[g * G + i] : 0.0f;
        if (A->sinks && sink > m) m = sink;
        const float inv = 1.0f / (exp_sub_sum(v, L, m) + (A->sinks ? expf(sink - m) : 0.0f));
        for (long s = 0; s < L; s++) v[s] *= inv;
    }
    float *dst = A->out + (long)b * A->H * hd + (long)g * G * hd; /* the group's G heads, hd each */
#if VEC_PATHS
    if (hd % PVW == 0) {
        pv_vec(vc, A->cfmt, hd, L, sc, L, G, dst);
        return;
    }
#endif
    /* o_i = sum_s p_is v_s in position order, four positions per pass over o (each o_i[j] still adds
     * them one by one: the same sums as one position per pass); fp32 value rows are read in place */
    memset(o, 0, (size_t)G * hd * sizeof(float));
    for (long s = 0; s < L; s += 4) {
        const int R = L - s < 4 ? (int)(L - s) : 4;
        const float *v[4];
        for (int r = 0; r < R; r++) {
            if (A->cfmt == FMT_F32)
                v[r] = (const float *)(vc + (s + r) * hd * es);
            else {
                load_row(vc + (s + r) * hd * es, A->cfmt, vr + r * hd, hd);
                v[r] = vr + r * hd;
            }
        }
        for (int i = 0; i < G; i++) {
            const float *p = sc + i * L + s;
            float *oi = o + i * hd;
            if (R == 4) {
                const float w0 = p[0], w1 = p[1], w2 = p[2], w3 = p[3];
                for (int j = 0; j < hd; j++) {
                    float a = oi[j];
                    a += w0 * v[0][j];
                    a += w1 * v[1][j];
                    a += w2 * v[2][j];
                    a += w3 * v[3][j];
                    oi[j] = a;
                }
            } else
                for (int r = 0; r < R; r++) {
                    const float w = p[r];
                    for (int j = 0; j < hd; j++) oi[j] += w * v[r][j];
                }
        }
    }
    memcpy(dst, o, (size_t)G * hd * sizeof(float));
}

/* Long windows attend in chunks (flash-decoding): at one row a call has only Hkv work items (4 for
 * Qwen3-30B-A3B), so a machine of more cores than kv heads left the rest idle at the longest, most
 * costly steps. A row whose window passes ATTN_CHUNK positions is split into chunks of ATTN_CHUNK
 * (counted from its window's start), one item each: its scores, their max m_c and sum l_c of
 * e^(s - m_c), and its values weighted by those unnormalised e^(s - m_c); attn_combine then merges the
 * chunks in order, each scaled by e^(m_c - m) (m the largest, the sink's logit included), over the
 * merged sum. The split depends on the row's own window only (not on the threads or the batch), so a
 * row's result is the same in any call; rows of ATTN_CHUNK positions or fewer take attn_item as
 * before. Vector builds only (the portable build attends each row whole). */
#ifndef ATTN_CHUNK
#define ATTN_CHUNK 2048
#endif

#if VEC_PATHS
static void attn_chunk_item(const void *arg, long item) {
    const attn_t *A = arg;
    const long bg = item / A->nchunk, c = item % A->nchunk, a0 = c * ATTN_CHUNK;
    const int b = (int)(bg / A->Hkv), g = (int)(bg % A->Hkv), hd = A->hd, G = A->H / A->Hkv;
    const long L = attn_len(A, b), rs = (A->cfmt == FMT_F32 ? 4 : 2) * (long)hd;
    if (L <= ATTN_CHUNK) { /* a short row: whole, as in a call without long rows */
        if (c == 0) attn_item(arg, bg);
        return;
    }
    if (a0 >= L) return;
    const long n = L - a0 < ATTN_CHUNK ? L - a0 : ATTN_CHUNK;
    uint8_t *kc, *vc;
    float q[MAX_GROUP * MAX_HD];
    attn_setup(A, b, g, q, &kc, &vc);
    float *sc = A->scores + bg * A->Lmax * G + a0, *ml = A->ml + item * G * 2; /* the chunk's scores: rows L apart */
    qk_vec(kc + a0 * rs, A->cfmt, hd, n, q, G, sc, L);
    for (int i = 0; i < G; i++) {
        const float m = max_of(sc + i * L, n);
        ml[2 * i] = m;
        ml[2 * i + 1] = exp_sub_sum(sc + i * L, n, m);
    }
    pv_vec(vc + a0 * rs, A->cfmt, hd, n, sc, L, G, A->part + item * G * hd);
}

/* the long rows' chunks merged into out, each (row, head) over its chunks in order */
static void attn_combine(const attn_t *A) {
    const int hd = A->hd, G = A->H / A->Hkv;
    for (int b = 0; b < A->B; b++) {
        const long L = attn_len(A, b), nc = (L + ATTN_CHUNK - 1) / ATTN_CHUNK;
        if (L <= ATTN_CHUNK) continue;
        for (int g = 0; g < A->Hkv; g++)
            for (int i = 0; i < G; i++) {
                /* head i of chunk c: its (max, sum) at ml + 2 * hc(c), its values at part + hd * hc(c) */
                const long h0 = ((long)b * A->Hkv + g) * A->nchunk * G + i, hs = G; /* hc(c) = h0 + c * hs */
                float *ml = A->ml + 2 * h0, m = A->sinks ? A->sinks[g * G + i] : -INFINITY, tot = 0.0f;
                const float *part = A->part + hd * h0;
                for (long c = 0; c < nc; c++) m = ml[2 * hs * c] > m ? ml[2 * hs * c] : m;
                for (long c = 0; c < nc; c++) { /* each chunk's weight e^(m_c - m) in place of its max */
                    float *mc = ml + 2 * hs * c;
                    mc[0] = expf(mc[0] - m);
                    tot += mc[0] * mc[1];
                }
                if (A->sinks) tot += expf(A->sinks[g * G + i] - m);
                float *dst = A->out + (long)b * A->H * hd + (long)(g * G + i) * hd;
                for (int j = 0; j < hd; j++) {
                    float o = 0.0f;
                    for (long c = 0; c < nc; c++) o += ml[2 * hs * c] * part[hd * hs * c + j];
                    dst[j] = o / tot;
                }
            }
    }
}
#endif

/* sinks [H] fp32 or NULL: a learned logit per head that joins each softmax's denominator (gpt-oss).
 * Returns 0; -1 for a shape past the kernel's stack buffers (the caller runs torch instead), -2
 * when the scores buffer cannot be allocated. */
int lynx_attn_decode(const float *qkv, int B, int H, int Hkv, int hd, int rd, const float *qn, const float *kn,
                     float eps, float scale, const float *cos, const float *sin, const int64_t *pos,
                     const int64_t *rows, uint8_t *kc, uint8_t *vc, int cfmt, long Bmax, long S, int window,
                     float *out, int nthreads, const float *sinks, int ring) {
    if (hd > MAX_HD || H % Hkv != 0 || H / Hkv > MAX_GROUP || rd > hd || rd % 2) return -1;
    if (ring && (window <= 0 || window > ring || S != 2L * ring)) return -1;
    long Lmax = 1;
    for (int b = 0; b < B; b++) {
        if (pos[b] < 0 || (!ring && pos[b] >= S) || rows[b] < 0 || rows[b] >= Bmax) return -1;
        Lmax = pos[b] + 1 > Lmax ? pos[b] + 1 : Lmax;
    }
    if (window > 0 && Lmax > window) Lmax = window;
    long nc = 1; /* chunks a (row, kv head) item splits into (attn_chunk_item): vector builds only */
#if VEC_PATHS
    if (hd % PVW == 0 && Lmax > ATTN_CHUNK) nc = (Lmax + ATTN_CHUNK - 1) / ATTN_CHUNK;
#endif
    /* scratch (kept when >= 1 MiB): 16 rows of gpt-oss-20b's 64 heads at 4096 positions are 16 MB a
     * layer a step, whose pages glibc would map fresh every call at longer contexts */
    const long n_items = (long)B * Hkv * nc, G = H / Hkv;
    const size_t sz[3] = {(size_t)B * H * Lmax * sizeof(float), nc > 1 ? (size_t)n_items * G * hd * sizeof(float) : 0,
                          nc > 1 ? (size_t)n_items * G * 2 * sizeof(float) : 0};
    void *sb[3];
    uint8_t *mem = scratch(sz, 3, sb);
    if (!mem) return -2;
    float *scores = sb[0];
    attn_t A = {qkv, B, H, Hkv, hd, rd, window, cfmt, qn, kn, eps, scale, cos, sin, pos, rows, kc, vc, S, out,
                scores, Lmax, sinks, ring, nc, sb[1], sb[2]};
    /* every key and value first: tokens of one row in one call (a mixed step's prompt chunk) attend
     * to each other's, whichever thread runs them */
    for (int b = 0; b < B; b++)
        for (int g = 0; g < Hkv; g++) kv_write(&A, b, g);
#if VEC_PATHS
    if (nc > 1) {
        parallel(attn_chunk_item, &A, n_items, nthreads);
        attn_combine(&A);
    } else
#endif
        parallel(attn_item, &A, (long)B * Hkv, nthreads);
    scratch_free(mem);
    return 0;
}

/* --- RMSNorm ---------------------------------------------------------------------------------- */

typedef struct {
    int fmt, D;
    const uint8_t *x, *w;
    float eps;
    long N;
    uint8_t *out;
} norm_t;

static inline float bf16_round(float v) {
    union { float f; uint32_t u; } c = {v};
    c.u = ((c.u + 0x7FFFu + ((c.u >> 16) & 1u)) >> 16) << 16; /* round to nearest even */
    return c.f;
}

/* v [D] <- wv * v * rsqrt(mean(v^2) + eps) in place, fp32 statistics; bf: rounded as the torch
 * path rounds a bf16 model's norm (the normalised row to bf16, then the product) */
static void rms_row(float *v, const float *wv, int D, float eps, int bf) {
    const float r = 1.0f / sqrtf(sum_sq(v, D) / (float)D + eps);
    if (!bf) {
        for (int j = 0; j < D; j++) v[j] = wv[j] * (v[j] * r);
    } else {
        for (int j = 0; j < D; j++) v[j] = bf16_round(wv[j] * bf16_round(v[j] * r));
    }
}

static void norm_item(const void *arg, long item) {
    const norm_t *P = arg;
    const int D = P->D;
    float v[4096], wv[4096];
    const long es = P->fmt == FMT_F32 ? 4 : 2;
    load_row(P->w, P->fmt, wv, D);
    for (long n = item * ROW_BLOCK; n < P->N && n < (item + 1) * ROW_BLOCK; n++) {
        load_row(P->x + n * D * es, P->fmt, v, D);
        rms_row(v, wv, D, P->eps, P->fmt == FMT_BF16);
        store_row(P->out + n * D * es, P->fmt, v, D);
    }
}

/* out [N, D] = w * x * rsqrt(mean(x^2) + eps) per row, fp32 statistics (x, w, out fp32 or bf16).
 * Returns -1 for D past the stack rows (the caller runs torch). */
int lynx_rmsnorm(int fmt, const uint8_t *x, const uint8_t *w, float eps, long N, int D, uint8_t *out, int nthreads) {
    if (D > 4096) return -1;
    norm_t P = {fmt, D, x, w, eps, N, out};
    parallel(norm_item, &P, (N + ROW_BLOCK - 1) / ROW_BLOCK, N >= 64 ? nthreads : 1);
    return 0;
}

/* --- LFM2's gated short convolution at decode --------------------------------------------------- */

static inline float ld_elem(const uint8_t *p, int fmt, long i) {
    return fmt == FMT_F32 ? ((const float *)p)[i] : bf16_f(((const uint16_t *)p)[i]);
}
static inline void st_elem(uint8_t *p, int fmt, long i, float v) { store_row(p + i * (fmt == FMT_F32 ? 4 : 2), fmt, &v, 1); }
/* v as the model dtype holds it (a 16-bit op's result, rounded to nearest even) */
static inline float as_dtype(int fmt, float v) { return fmt == FMT_F32 ? v : bf16_round(v); }

/* One token per row: bcx [B, 3D] fp32 (values in the model dtype fmt: the in_proj's B, C and x parts)
 * -> out [B, D] fp32 = C * conv(B * x) (values in the model dtype), where conv is the depthwise causal
 * conv of kernel L (w [D, L], bias [D] or NULL, model dtype) over the row's last L - 1 conv inputs,
 * kept in state [Bmax, D, L - 1] (model dtype; a row at position 0 starts a new sequence and reads
 * zeros) and this token's, which the state then keeps. Rounded where the torch path's 16-bit ops
 * round: B * x, the conv's output, C * y; the conv itself in fp32 (bias, then the taps oldest first).
 * Returns 0, -1 for a row outside [0, Bmax) (nothing written). */
static int short_conv_rows(int fmt, const float *bcx, int B, int D, int L, const uint8_t *w, const uint8_t *bias,
                           uint8_t *state, long Bmax, const int64_t *rows, const int64_t *pos, float *out) {
    const long es = fmt == FMT_F32 ? 4 : 2;
    for (int b = 0; b < B; b++)
        if (rows[b] < 0 || rows[b] >= Bmax) return -1;
    for (int b = 0; b < B; b++) {
        const float *row = bcx + (long)b * 3 * D;
        uint8_t *st = state + rows[b] * (long)D * (L - 1) * es;
        const int fresh = pos[b] == 0;
        for (int d = 0; d < D; d++) {
            const float bx = as_dtype(fmt, row[d] * row[2L * D + d]);
            float acc = bias ? ld_elem(bias, fmt, d) : 0.0f;
            for (int k = 0; k < L - 1; k++) {
                const float past = fresh ? 0.0f : ld_elem(st, fmt, (long)d * (L - 1) + k);
                acc += ld_elem(w, fmt, (long)d * L + k) * past;
            }
            acc += ld_elem(w, fmt, (long)d * L + L - 1) * bx;
            for (int k = 0; k < L - 2; k++) /* the state moves on by one input */
                st_elem(st, fmt, (long)d * (L - 1) + k, fresh ? 0.0f : ld_elem(st, fmt, (long)d * (L - 1) + k + 1));
            if (L > 1) st_elem(st, fmt, (long)d * (L - 1) + L - 2, bx);
            out[(long)b * D + d] = as_dtype(fmt, row[D + d] * as_dtype(fmt, acc));
        }
    }
    return 0;
}

/* short_conv_rows over bcx and out in the model dtype fmt ([B, 3D] -> [B, D]): the module path's
 * call (models/lfm2_moe.ShortConv). Returns 0, -1 for a row outside [0, Bmax), -2 out of memory. */
int lynx_short_conv(int fmt, const uint8_t *bcx, int B, int D, int L, const uint8_t *w, const uint8_t *bias,
                    uint8_t *state, long Bmax, const int64_t *rows, const int64_t *pos, uint8_t *out) {
    const long es = fmt == FMT_F32 ? 4 : 2;
    const size_t sz[2] = {sizeof(float) * 3 * B * (size_t)D, sizeof(float) * B * (size_t)D};
    void *buf[2];
    uint8_t *mem = scratch(sz, 2, buf);
    if (!mem) return -2;
    float *f = buf[0], *y = buf[1];
    for (int b = 0; b < B; b++) load_row(bcx + (long)b * 3 * D * es, fmt, f + (long)b * 3 * D, 3 * D);
    const int rc = short_conv_rows(fmt, f, B, D, L, w, bias, state, Bmax, rows, pos, y);
    if (rc == 0)
        for (int b = 0; b < B; b++) store_row(out + (long)b * D * es, fmt, y + (long)b * D, D);
    scratch_free(mem);
    return rc;
}

/* OLMoE's q/k: qkv [B, (H + 2 Hkv) hd] fp32 (values in the model dtype fmt) in place, q normed over
 * all its H hd values and k over its Hkv hd at once (not per head) by the weights qw [H hd], kw
 * [Hkv hd] (model dtype), then q, k and v clipped to [-clip, clip] (clip_qkv; 0: none) — the module
 * path's RMSNorm kernel and clamp, with its roundings (a bf16 model clamps to clip in bf16). Per-head
 * norms and RoPE follow in lynx_attn_decode. Returns -1 for widths past the stack rows. */
int lynx_qk_full(float *qkv, int B, int H, int Hkv, int hd, int fmt, const uint8_t *qw, const uint8_t *kw, float eps,
                 float clip) {
    const int nq = H * hd, nk = Hkv * hd, width = nq + 2 * nk, bf = fmt == FMT_BF16;
    if (nq > 4096 || nk > 4096) return -1;
    float wq[4096], wk[4096];
    load_row(qw, fmt, wq, nq);
    load_row(kw, fmt, wk, nk);
    const float c = bf ? bf16_round(clip) : clip;
    for (int b = 0; b < B; b++) {
        float *row = qkv + (long)b * width;
        rms_row(row, wq, nq, eps, bf);
        rms_row(row + nq, wk, nk, eps, bf);
        if (clip > 0.0f)
            for (int j = 0; j < width; j++) row[j] = row[j] > c ? c : row[j] < -c ? -c : row[j]; /* NaN stays */
    }
    return 0;
}

/* --- a whole decoder layer at decode, in two calls around the (Python) router ---------------------
 *
 * lynx_layer_attn: x -> RMSNorm -> fused q/k/v -> attention (cache write) -> o_proj -> + x = x1,
 * then RMSNorm(x1) = h2 and the router's logits; lynx_layer_moe: the experts over h2 -> + x1.
 * The routing decision itself stays in torch between the two (exact, LYNX or offload routers,
 * whose weights are bit-equal to transformers'). Each step rounds where the module path does (a
 * bf16 model: every projection's output, the attention output, the residual adds, the norms), so
 * for bf16 this equals the module path bit for bit; it saves the ~40 Python/torch calls per layer
 * around the same kernels (models/native_layer.py). Projections are dense fp32/bf16, INT4 or FP8. */

typedef struct {
    int kind; /* FMT_F32 / FMT_BF16 dense [N, K], FMT_INT4 packed (codes [N, K/2], scales, zeros, perm),
               * FMT_FP8 codes [N, K] with fp32 block scales s [ceil(N/bn), K/G], FMT_I8 int8 rows [N, K]
               * with fp32 row scales s [N] */
    const uint8_t *w;
    const uint16_t *s;
    const uint8_t *z;
    const int32_t *perm;
    const float *bias; /* fp32 [N] or NULL */
    int N, K, G, act, bn; /* act: INT4 rows' ACT_* mode; FMT_I8: 1 = int8 activations (i8q8_block) */
} lin_t;

static int lin_run(const lin_t *l, const float *x, int T, float *out, int nthreads) {
    if (l->kind == FMT_FP8) {
        lynx_linear_fp8(x, l->w, (const float *)l->s, l->bn, l->G, l->bias, T, l->K, l->N, out, nthreads);
        return 0;
    }
    if (l->kind == FMT_INT4)
        return lynx_linear_int4(x, l->w, l->s, l->z, l->perm, l->bias, T, l->K, l->N, l->G, out, nthreads, l->act);
    if (l->kind == FMT_I8)
        return lynx_linear_int8(x, (const int8_t *)l->w, (const float *)l->s, l->bias, T, l->K, l->N, out, nthreads,
                                l->act);
    lynx_linear(l->kind, x, l->w, l->bias, T, l->K, l->N, out, nthreads, l->act);
    return 0;
}

static void round_bf16(float *v, long n) {
    for (long j = 0; j < n; j++) v[j] = bf16_round(v[j]);
}

/* out [B, D] = x + y in the model dtype fmt, as torch adds a layer's output to the residual: y
 * (fp32) first rounds to the model dtype, the sum is fp32 and rounds once. r: a scratch row [D]. */
static void residual_add(const uint8_t *x, int fmt, const float *y, int B, int D, float *r, uint8_t *out) {
    const int bf = fmt == FMT_BF16;
    const size_t es = bf ? 2 : 4;
    for (int b = 0; b < B; b++) {
        load_row(x + (size_t)b * D * es, fmt, r, D);
        const float *yb = y + (size_t)b * D;
        if (bf) for (int j = 0; j < D; j++) r[j] += bf16_round(yb[j]);
        else for (int j = 0; j < D; j++) r[j] += yb[j];
        store_row(out + (size_t)b * D * es, fmt, r, D);
    }
}

typedef struct {
    int fmt; /* the model dtype: FMT_F32 or FMT_BF16 (residual stream, norm weights) */
    int D, H, Hkv, hd, rd, window;
    float eps1, eps2, eps_qk, scale;
    const uint8_t *norm1, *norm2; /* [D] in the model dtype */
    const float *qn, *kn;         /* q/k RMSNorm weights [hd] fp32, or NULL */
    lin_t qkv, o, gate;
    const uint8_t *qfw, *kfw;     /* OLMoE: q/k RMSNorm over all heads [H hd], [Hkv hd] (model dtype), or NULL */
    float clip;                   /* OLMoE's clip_qkv, 0: none */
    const float *sinks;           /* gpt-oss: a learned sink logit per head [H] fp32 (lynx_attn_decode), or NULL */
    int ring;                     /* > 0: a window layer's ring cache of `ring` positions (2 ring slots, whatever
                                   * S the call passes: a stack's layers share one S, their full caches') */
    const uint8_t *conv_w, *conv_b; /* LFM2's short convolution in attention's place: w [D, conv_L], bias [D] or
                                     * NULL (model dtype); qkv is its in_proj [3D, D], o its out_proj; the
                                     * cache kc its conv state [Bmax, D, conv_L - 1] in the model dtype */
    int conv_L;
} attn_layer_t;

/* x [B, D] (model dtype) -> x1 [B, D] (model dtype), h2 [B, D] fp32 (RMSNorm(x1) in the model
 * dtype's values), logits [B, E] fp32 (rounded as the model dtype). Caches kc/vc [Bmax, Hkv, S, hd]
 * in cfmt. Returns 0; -1 for a shape the attention kernel does not take (nothing written), -2 out of
 * memory. */
int lynx_layer_attn(const attn_layer_t *L, const uint8_t *x, int B, const float *cos, const float *sin,
                    const int64_t *pos, const int64_t *rows, uint8_t *kc, uint8_t *vc, int cfmt, long Bmax, long S,
                    uint8_t *x1, float *h2, float *logits, int nthreads) {
    const int D = L->D, bf = L->fmt == FMT_BF16, es = bf ? 2 : 4, nq = L->qkv.N, na = L->conv_w ? D : L->H * L->hd;
    if (D > 4096 || (L->conv_w && cfmt != L->fmt)) return -1;
    const size_t f4 = sizeof(float), sz[] = {(size_t)B * D * es, B * D * f4, B * nq * f4, B * na * f4, B * D * f4};
    void *buf[5];
    uint8_t *mem = scratch(sz, 5, buf);
    if (!mem) return -2;
    uint8_t *h = buf[0];
    float *hf = buf[1], *q = buf[2], *a = buf[3], *o = buf[4];
    int rc;
    lynx_rmsnorm(L->fmt, x, L->norm1, L->eps1, B, D, h, nthreads);
    for (int b = 0; b < B; b++) load_row(h + (size_t)b * D * es, L->fmt, hf + (size_t)b * D, D);
    if ((rc = lin_run(&L->qkv, hf, B, q, nthreads)) != 0) { rc = -2; goto done; }
    if (bf) round_bf16(q, (long)B * nq);
    if (L->conv_w) { /* the short convolution: its output rounded as the model dtype already */
        if ((rc = short_conv_rows(L->fmt, q, B, D, L->conv_L, L->conv_w, L->conv_b, kc, Bmax, rows, pos, a)) != 0)
            goto done;
        goto mixed;
    }
    if (L->qfw && lynx_qk_full(q, B, L->H, L->Hkv, L->hd, L->fmt, L->qfw, L->kfw, L->eps_qk, L->clip) != 0) {
        rc = -1;
        goto done;
    }
    rc = lynx_attn_decode(q, B, L->H, L->Hkv, L->hd, L->rd, L->qn, L->kn, L->eps_qk, L->scale, cos, sin, pos, rows,
                          kc, vc, cfmt, Bmax, L->ring ? 2L * L->ring : S, L->window, a, nthreads, L->sinks, L->ring);
    if (rc != 0) goto done;
    if (bf) round_bf16(a, (long)B * na);
mixed:
    if (lin_run(&L->o, a, B, o, nthreads) != 0) { rc = -2; goto done; }
    residual_add(x, L->fmt, o, B, D, hf, x1);
    lynx_rmsnorm(L->fmt, x1, L->norm2, L->eps2, B, D, h, nthreads);
    for (int b = 0; b < B; b++) load_row(h + (size_t)b * D * es, L->fmt, h2 + (size_t)b * D, D);
    if (lin_run(&L->gate, h2, B, logits, nthreads) != 0) { rc = -2; goto done; }
    if (bf) round_bf16(logits, (long)B * L->gate.N);
    rc = 0;
done:
    scratch_free(mem);
    return rc;
}

typedef struct {
    int fmt; /* FMT_INT4 blocks, or FMT_F32 / FMT_BF16 stacked experts */
    const uint8_t *data; /* int4: [E, nbytes] */
    long E, nbytes;      /* dense: nbytes = bytes per weight */
    const long *offs;    /* int4: part offsets [6] */
    const int32_t *perm; /* int4 act order [E, D] or NULL */
    const uint8_t *gu, *dn; /* dense: [E, 2I, D], [E, D, I] */
    int sym, G, D, I, act; /* act: the INT4 rows' ACT_* mode */
    const uint8_t *gus, *dns; /* fp8: the block scales (fp32) */
    int bn, bk;
    int stream; /* dense experts: read from DRAM at each use (lynx_moe's stream) */
    const struct shared_s *shared; /* the always-on shared expert (lynx_shared_expert), or NULL */
    const float *gub, *dnb; /* gpt-oss: gate_up [E, 2I] and down [E, D] biases fp32, or NULL */
    int act_kind;           /* 0: SwiGLU; 1: gpt-oss's clamped one (limit, alpha) */
    float limit, alpha;
} moe_layer_t;

/* A shared expert: an MLP every token runs beside its routed experts (Qwen2-MoE, Qwen3-Next,
 * DeepSeek), optionally scaled per token by sigmoid(sg . x) (Qwen2-MoE, Qwen3-Next). */
typedef struct shared_s {
    lin_t gate, up, down; /* gate / up [I, D], down [D, I] */
    lin_t sg;             /* the scale's row [1, D]; N = 0: no scale (DeepSeek) */
} shared_t;

/* out [B, D] fp32 = s(x) * down(silu(gate x) * up x), s(x) = sigmoid(sg . x) or 1, for x [B, D] fp32:
 * products and sums in fp32 on the layer calls' projections (no rounding between them, as the routed
 * experts keep h in fp32). The module path (MoEBlock) and lynx_layer_moe both call this, so a layer's
 * output is the same on either. Returns 0, -1 out of memory. */
int lynx_shared_expert(const shared_t *S, const float *x, int B, float *out, int nthreads) {
    const int I = S->gate.N, D = S->down.N;
    const size_t sz[3] = {(size_t)B * I * sizeof(float), (size_t)B * I * sizeof(float), (size_t)B * sizeof(float)};
    void *b[3];
    uint8_t *mem = scratch(sz, 3, b);
    if (!mem) return -1;
    float *g = b[0], *u = b[1], *sc = b[2];
    int rc = lin_run(&S->gate, x, B, g, nthreads);
    if (rc == 0) rc = lin_run(&S->up, x, B, u, nthreads);
    if (rc == 0) {
        lynx_silu_mul(g, u, (long)B * I);
        rc = lin_run(&S->down, g, B, out, nthreads);
    }
    if (rc == 0 && S->sg.N) {
        rc = lin_run(&S->sg, x, B, sc, nthreads);
        for (int t = 0; rc == 0 && t < B; t++) {
            const float s = 1.0f / (1.0f + expf(-sc[t]));
            for (int j = 0; j < D; j++) out[(size_t)t * D + j] *= s;
        }
    }
    scratch_free(mem);
    return rc ? -1 : 0;
}

/* out [B, D] (model dtype fmt) = x1 + round(sum_k w[b, k] * expert_{ids[b, k]}(h2[b])); h2 fp32.
 * With a shared expert: x1 + round(round(routed) + shared(h2)), the routed sum rounded to the model
 * dtype first as the module path's expert output is (MoEBlock).
 * Returns lynx_moe's code (0, -1 out of memory, -3 an expert id out of range: nothing written). */
int lynx_layer_moe(const moe_layer_t *M, int fmt, const float *h2, const int64_t *ids, const float *w, int B, int K,
                   const uint8_t *x1, uint8_t *out, int nthreads) {
    const int D = M->D;
    const size_t sz[3] = {(size_t)B * D * sizeof(float), (size_t)D * sizeof(float),
                          M->shared ? (size_t)B * D * sizeof(float) : 0};
    void *b[3];
    uint8_t *mem = scratch(sz, 3, b);
    if (!mem) return -1;
    float *y = b[0], *r = b[1], *sh = b[2];
    int rc = lynx_moe(M->fmt, h2, ids, w, M->perm, M->data, M->E, M->nbytes, M->offs, M->gu, M->dn, M->sym, M->G, D, M->I,
                  B, K, y, nthreads, M->gus, M->dns, M->gub, M->dnb, M->act_kind, M->limit, M->alpha, M->act, M->bn,
                  M->bk, M->stream);
    if (rc == 0 && M->shared && (rc = lynx_shared_expert(M->shared, h2, B, sh, nthreads)) == 0)
        for (long i = 0; i < (long)B * D; i++) y[i] = (fmt == FMT_BF16 ? bf16_round(y[i]) : y[i]) + sh[i];
    if (rc == 0) residual_add(x1, fmt, y, B, D, r, out);
    scratch_free(mem);
    return rc;
}

/* ---- routing: softmax, exact top-k and LYNX's all-decode selection in one call (lynx_route) ----
 * A port of lynx_host._route (numba) with the softmax inside: every integer and boolean decision
 * is made with the same arithmetic (fp32 gaps and levels, int64 votes, float64 mass tails rounded
 * to fp32, ties by higher score then lower id), so given the same probs the ids and weights are
 * bit-identical to lynx_host.route and lynx.lynx_select (tests/test_native_route.py). The softmax
 * is exp(z - max) with the C library's expf, summed left to right, times 1/sum (torch's formula,
 * not its vectorised exp): within a few ulp of torch.softmax, and the same on every CPU path of a model
 * (module path and native layer both route here). Glossary: T tokens, E experts, K top-k. */
#define ROUTE_EXACT (-1)
#define ROUTE_LYNX 0
#define ROUTE_BUDGET 1
#define ROUTE_MASS 2

typedef struct {
    int K, norm, kind; /* kind: ROUTE_EXACT, or LYNX's rule (lynx_host.KIND_*) */
    int beta, j, protect, pooled;
    float alpha, arg, slack, scale; /* scale: routed_scaling_factor (1: none) */
    int discard; /* LYNX computed in full (stats too), then the exact choice returned: its cost alone
                  * (benchmarks/lynx_overhead.py) */
} route_t;

/* the position of the highest key among allowed, unskipped positions; ties -> lower position */
static int best_f(const float *key, const uint8_t *skip, const uint8_t *allowed, int E) {
    int best = -1;
    for (int e = 0; e < E; e++) {
        if (skip[e] || (allowed && !allowed[e])) continue;
        if (best < 0 || key[e] > key[best]) best = e;
    }
    return best;
}

/* mark in out the m best-scoring positions not yet in allowed (ties -> lower position) */
static void ranked(const int64_t *score, int m, const uint8_t *allowed, uint8_t *out, uint8_t *skip, int E) {
    memcpy(skip, allowed, E);
    for (int r = 0; r < m; r++) {
        int best = -1;
        for (int e = 0; e < E; e++)
            if (!skip[e] && (best < 0 || score[e] > score[best])) best = e;
        if (best < 0) return;
        out[best] = 1;
        skip[best] = 1;
    }
}

static int64_t ipow(int64_t b, int e) {
    int64_t r = 1;
    while (e-- > 0) r *= b;
    return r;
}

/* LYNX's critical set and remap over the exact choice ids0 [T, K] (lynx_host._decide) and the
 * reweight (lynx_host._reweight): ids, w [T, K] in place; vec[3..6] its stats. */
static void lynx_decide(const float *z, const float *probs, int T, int E, const route_t *R, const int64_t *ids0,
                        const float *p0, const float *s0, const float *w0, int64_t *ids, float *w, double *vec,
                        int64_t *score, uint8_t *allowed, uint8_t *keep, uint8_t *skip, uint8_t *drop) {
    const int K = R->K, beta = R->beta;
    memset(score, 0, (size_t)E * sizeof(int64_t));
    for (int t = 0; t < T; t++) {
        const float *zt = z + (size_t)t * E;
        const float top = zt[ids0[(size_t)t * K]];
        for (int s = 0; s < K; s++) {
            float gap = top - zt[ids0[(size_t)t * K + s]];
            if (gap < 0.0f) gap = 0.0f;
            float f = floorf(gap * R->alpha); /* fp32, as torch: floor(gap * alpha).clamp(0, beta) */
            int lv = f >= (float)beta ? beta : (f > 0.0f ? (int)f : 0);
            score[ids0[(size_t)t * K + s]] += ipow(T, beta - lv);
        }
    }
    memset(allowed, 0, E);
    if (R->kind == ROUTE_BUDGET) {
        int m = (int)R->arg < E ? (int)R->arg : E;
        ranked(score, m, allowed, allowed, skip, E);
        for (int e = 0; e < E; e++) allowed[e] = allowed[e] && score[e] > 0;
    } else {
        const int64_t thr = ipow(T, beta - R->j > 0 ? beta - R->j : 0);
        for (int e = 0; e < E; e++) allowed[e] = score[e] >= thr;
    }
    if (R->protect)
        for (int t = 0; t < T; t++) allowed[ids0[(size_t)t * K]] = 1;
    if (R->kind == ROUTE_MASS) { /* keep slots while the droppable tail outweighs tau * (top-k mass) */
        memset(keep, 0, E);
        for (int t = 0; t < T; t++) {
            const float budget = R->arg * s0[t] * R->slack;
            double acc = 0.0; /* float64, as torch's CPU cumsum accumulates */
            for (int s = K - 1; s >= 0; s--) {
                const int64_t e = ids0[(size_t)t * K + s];
                if (!allowed[e]) {
                    acc += (double)p0[(size_t)t * K + s];
                    if ((float)acc > budget) keep[e] = 1;
                }
            }
        }
        for (int e = 0; e < E; e++) allowed[e] = allowed[e] || keep[e];
    }
    int n_allowed = 0;
    for (int e = 0; e < E; e++) n_allowed += allowed[e];
    if (n_allowed < K) ranked(score, K - n_allowed, allowed, allowed, skip, E); /* pad to K */
    memset(skip, 0, E); /* here: the experts a token holds */
    long changed = 0, n_drop = 0;
    double mass = 0.0;
    for (int t = 0; t < T; t++) {
        const float *zt = z + (size_t)t * E;
        const int64_t *it0 = ids0 + (size_t)t * K;
        int64_t *it = ids + (size_t)t * K;
        uint8_t *dt = drop + (size_t)t * K;
        int gaps = 0;
        for (int s = 0; s < K; s++) skip[it0[s]] = 1;
        for (int s = 0; s < K; s++) { /* the i-th dropped slot takes the i-th best allowed unchosen expert */
            dt[s] = 0;
            if (allowed[it0[s]]) continue;
            const int e = best_f(zt, skip, allowed, E);
            if (e < 0 || zt[e] == -INFINITY) continue;
            dt[s] = 1;
            it[s] = e;
            skip[e] = 1;
            gaps++;
        }
        for (int s = 0; s < K; s++) skip[it0[s]] = skip[it[s]] = 0;
        if (!gaps) continue;
        changed++;
        n_drop += gaps;
        /* reweight: the new experts' original probs, rescaled to the original top-k mass */
        const float *pt = probs + (size_t)t * E;
        float denom = 0.0f, m = 0.0f;
        for (int s = 0; s < K; s++) {
            if (dt[s]) mass += (double)p0[(size_t)t * K + s];
            denom += pt[it[s]];
        }
        for (int s = 0; s < K; s++) m += w0[(size_t)t * K + s];
        for (int s = 0; s < K; s++) {
            const float x = denom > 0.0f ? pt[it[s]] / denom : (float)(1.0 / K);
            w[(size_t)t * K + s] = R->norm ? x : x * m;
        }
    }
    int u0 = 0, u1 = 0;
    memset(keep, 0, E);
    memset(skip, 0, E);
    for (long i = 0; i < (long)T * K; i++) { keep[ids0[i]] = 1; skip[ids[i]] = 1; }
    for (int e = 0; e < E; e++) { u0 += keep[e]; u1 += skip[e]; }
    vec[3] = u0;
    vec[4] = changed ? u1 : u0;
    vec[5] = changed ? (double)n_drop : 0.0;
    vec[6] = changed ? mass : 0.0;
}

/* logits z [T, E] fp32 -> ids [T, K] int64, w [T, K] fp32 (x scale), vec [7] float64 (T, decode
 * tokens, decode slots, unique experts before, after, remapped slots, displaced mass: LynxResult's
 * stats). probs: [T, E] fp32 to use as the softmax (the tests' torch one), or NULL: computed here.
 * Returns 0, -1 for a shape it does not take, or -2 out of memory (nothing written). */
int lynx_route(const float *z, const float *probs_in, int T, int E, const route_t *R, int64_t *ids, float *w,
               double *vec) {
    const int K = R->K;
    if (T <= 0 || E <= 0 || K <= 0 || K > E) return -1;
    const size_t sz[4] = {probs_in ? 0 : (size_t)T * E * sizeof(float), (size_t)T * K * sizeof(float) * 2 + (size_t)T * sizeof(float),
                          (size_t)T * K * sizeof(int64_t) + (size_t)E * sizeof(int64_t), (size_t)4 * E + (size_t)T * K};
    void *b[4];
    uint8_t *mem = scratch(sz, 4, b);
    if (!mem) return -2;
    float *probs = b[0], *p0 = b[1];
    int64_t *ids0 = b[2];
    uint8_t *flags = b[3];
    float *w0 = p0 + (size_t)T * K, *s0 = w0 + (size_t)T * K;
    int64_t *score = ids0 + (size_t)T * K;
    uint8_t *skip = flags, *allowed = flags + E, *keep = flags + 2 * E, *seen = flags + 3 * E, *drop = flags + 4 * E;
    if (!probs_in) {
        for (int t = 0; t < T; t++) {
            const float *zt = z + (size_t)t * E;
            float *pt = probs + (size_t)t * E;
            float mx = zt[0], sum = 0.0f;
            for (int e = 1; e < E; e++) mx = zt[e] > mx ? zt[e] : mx;
            for (int e = 0; e < E; e++) { pt[e] = expf(zt[e] - mx); sum += pt[e]; }
            const float inv = 1.0f / sum;
            for (int e = 0; e < E; e++) pt[e] *= inv;
        }
    }
    const float *P = probs_in ? probs_in : probs;
    memset(skip, 0, E);
    memset(seen, 0, E);
    for (int t = 0; t < T; t++) { /* exact top-k: K passes of a max, ties -> lower id */
        const float *zt = z + (size_t)t * E, *pt = P + (size_t)t * E;
        int64_t *it = ids0 + (size_t)t * K;
        float acc = 0.0f;
        for (int s = 0; s < K; s++) {
            const int e = best_f(zt, skip, NULL, E);
            it[s] = e;
            skip[e] = 1;
            seen[e] = 1;
            p0[(size_t)t * K + s] = pt[e];
            acc += pt[e];
        }
        for (int s = 0; s < K; s++) skip[it[s]] = 0;
        s0[t] = acc;
        for (int s = 0; s < K; s++) w0[(size_t)t * K + s] = R->norm ? p0[(size_t)t * K + s] / acc : p0[(size_t)t * K + s];
    }
    memcpy(ids, ids0, (size_t)T * K * sizeof(int64_t));
    memcpy(w, w0, (size_t)T * K * sizeof(float));
    int u = 0;
    for (int e = 0; e < E; e++) u += seen[e];
    vec[0] = vec[1] = T;
    vec[2] = (double)T * K;
    vec[3] = vec[4] = u;
    vec[5] = vec[6] = 0.0;
    if (R->kind != ROUTE_EXACT && R->pooled) {
        lynx_decide(z, P, T, E, R, ids0, p0, s0, w0, ids, w, vec, score, allowed, keep, skip, drop);
        if (R->discard) {
            memcpy(ids, ids0, (size_t)T * K * sizeof(int64_t));
            memcpy(w, w0, (size_t)T * K * sizeof(float));
        }
    }
    if (R->scale != 1.0f)
        for (long i = 0; i < (long)T * K; i++) w[i] *= R->scale;
    scratch_free(mem);
    return 0;
}

/* A whole decoder layer at decode in one call: lynx_layer_attn, lynx_route on its router logits,
 * lynx_layer_moe with that choice. out [B, D] in the model dtype; ids [B, K], w [B, K], vec [7]
 * the routing (for the stats and LYNX's telemetry). Returns lynx_layer_attn's codes (-1: the
 * attention kernel does not take the shape, nothing written), -2 out of memory, or lynx_moe's. */
int lynx_layer(const attn_layer_t *L, const moe_layer_t *M, const route_t *R, const uint8_t *x, int B,
               const float *cos, const float *sin, const int64_t *pos, const int64_t *rows, uint8_t *kc, uint8_t *vc,
               int cfmt, long Bmax, long S, uint8_t *out, int64_t *ids, float *w, double *vec, int nthreads) {
    const int D = L->D, E = L->gate.N, es = L->fmt == FMT_BF16 ? 2 : 4;
    const size_t sz[3] = {(size_t)B * D * es, (size_t)B * D * sizeof(float), (size_t)B * E * sizeof(float)};
    void *b[3];
    uint8_t *mem = scratch(sz, 3, b);
    if (!mem) return -2;
    uint8_t *x1 = b[0];
    float *h2 = b[1], *logits = b[2];
    int rc = lynx_layer_attn(L, x, B, cos, sin, pos, rows, kc, vc, cfmt, Bmax, S, x1, h2, logits, nthreads);
    if (rc != 0) goto done;
    if ((rc = lynx_route(logits, NULL, B, E, R, ids, w, vec)) != 0) { rc = -2; goto done; }
    rc = lynx_layer_moe(M, L->fmt, h2, ids, w, B, R->K, x1, out, nthreads);
done:
    scratch_free(mem);
    return rc;
}

/* The whole decoder stack at decode: lynx_layer for layers 0..n-1, each reading the previous one's
 * output. x [B, D] (model dtype) is the input and, on return, the output of the last layer run;
 * kc[l], vc[l] layer l's caches; ids [n, B, K], w [n, B, K], vec [n, 7] each layer's routing.
 * *done = the number of layers run. head (or NULL): when all n ran, logits [B, N] fp32 = head(RMSNorm(x)
 * with norm_w, eps), rounded to the model dtype first (as the module path's norm, linear and .float()).
 * Returns 0, or the failing layer's lynx_layer code (-1: its attention kernel does not take the shape
 * and nothing of it was written: the caller goes on from layer *done with x as it stands). */
int lynx_layers(int n, const attn_layer_t *const *L, const moe_layer_t *const *M, const route_t *const *R,
                uint8_t *x, int B, const float *cos, const float *sin, const int64_t *pos, const int64_t *rows,
                uint8_t *const *kc, uint8_t *const *vc, int cfmt, long Bmax, long S, int64_t *ids, float *w,
                double *vec, int *done, const uint8_t *norm_w, float eps, const lin_t *head, float *logits,
                int nthreads) {
    const int D = L[0]->D, fmt = L[0]->fmt, es = fmt == FMT_BF16 ? 2 : 4;
    const size_t bytes = (size_t)B * D * es, sz[2] = {bytes, head ? (size_t)B * D * sizeof(float) : 0};
    void *buf[2];
    uint8_t *mem = scratch(sz, 2, buf);
    int rc = -2;
    *done = 0;
    if (!mem) return rc;
    uint8_t *y = buf[0];
    float *h = buf[1];
    for (int l = 0; l < n; l++) {
        const long off = (long)l * B * R[l]->K;
        rc = lynx_layer(L[l], M[l], R[l], x, B, cos, sin, pos, rows, kc[l], vc[l], cfmt, Bmax, S, y, ids + off,
                        w + off, vec + 7L * l, nthreads);
        if (rc != 0) break;
        memcpy(x, y, bytes);
        *done = l + 1;
    }
    if (rc == 0 && head) { /* the model's last norm and head, as the module path rounds them */
        lynx_rmsnorm(fmt, x, norm_w, eps, B, D, y, nthreads);
        for (int b = 0; b < B; b++) load_row(y + (size_t)b * D * es, fmt, h + (size_t)b * D, D);
        rc = lin_run(head, h, B, logits, nthreads) != 0 ? -2 : 0;
        if (fmt == FMT_BF16) round_bf16(logits, (long)B * head->N);
    }
    scratch_free(mem);
    return rc;
}

/* The first index of the largest of v[0..n) (n >= 1), a NaN counting as largest (the first NaN): torch.argmax's
 * choice. Eight lanes of running maxima, each keeping its first index (strict >), then the lanes' best with ties
 * to the lower index; a NaN anywhere goes back to the scalar loop (rare: a model that has gone wrong). Over the
 * demo's 4096 logits x 16 rows the scalar loop was ~2% of a greedy decode step. */
long lynx_argmax(const float *v, long n) {
    long i = 0, best = 0;
#if VEC_PATHS
    if (n >= 16) {
        __m256 mx = _mm256_loadu_ps(v), nan = _mm256_cmp_ps(mx, mx, _CMP_UNORD_Q);
        __m256i at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), cur = at;
        const __m256i eight = _mm256_set1_epi32(8);
        for (i = 8; i + 8 <= n; i += 8) {
            const __m256 x = _mm256_loadu_ps(v + i), gt = _mm256_cmp_ps(x, mx, _CMP_GT_OQ);
            cur = _mm256_add_epi32(cur, eight);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
            mx = _mm256_blendv_ps(mx, x, gt);
            at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(cur), gt));
        }
        if (_mm256_movemask_ps(nan)) {
            i = 0;
        } else {
            float m[8];
            int32_t ix[8];
            _mm256_storeu_ps(m, mx);
            _mm256_storeu_si256((__m256i *)ix, at);
            best = ix[0];
            for (int l = 1; l < 8; l++)
                if (m[l] > v[best] || (m[l] == v[best] && ix[l] < best)) best = ix[l];
        }
    }
#endif
    for (i = i ? i : 1; i < n; i++)
        if (v[i] > v[best] || (isnan(v[i]) && !isnan(v[best]))) best = i;
    return best;
}

/* Greedy decode in one call: up to `steps` decode steps of the whole model for B rows, each step's
 * argmax the next step's input, as the engine's greedy sampler would choose it (torch.argmax: the
 * first maximal index, NaN counting as maximal). emb [V, D] the embedding table (model dtype);
 * tok [B] each row's input token (in; the last chosen token on return); cos_tab / sin_tab [P, rd]
 * fp32 RoPE rows for positions < P; pos [B] each row's position (advanced in place by the steps
 * run); the rest as lynx_layers, per step: ids [steps, n, B, K], w [steps, n, B, K], vec [steps, n, 7];
 * out [steps, B] the chosen tokens. The burst ends after a step where a row chose one of stop[0..n_stop).
 * *ran = the steps that ran in full. Returns 0; -4 for an input token outside [0, V) or a position past
 * the table; or a failing step's lynx_layers code (steps before it ran in full: *ran says how many). */
int lynx_decode(int n, const attn_layer_t *const *L, const moe_layer_t *const *M, const route_t *const *R,
                const uint8_t *emb, long V, int64_t *tok, int B, const float *cos_tab, const float *sin_tab,
                long P, int64_t *pos, const int64_t *rows, uint8_t *const *kc, uint8_t *const *vc, int cfmt,
                long Bmax, long S, int64_t *ids, float *w, double *vec, const uint8_t *norm_w, float eps,
                const lin_t *head, int steps, const int64_t *stop, int n_stop, int64_t *out, int *ran,
                int nthreads) {
    const int D = L[0]->D, es = L[0]->fmt == FMT_BF16 ? 2 : 4, rd = L[0]->rd, K = R[0]->K, N = head->N;
    const size_t sz[3] = {(size_t)B * D * es, (size_t)B * rd * sizeof(float) * 2 + 1, (size_t)B * N * sizeof(float)};
    void *b[3];
    uint8_t *mem = scratch(sz, 3, b);
    *ran = 0;
    if (!mem) return -2;
    uint8_t *x = b[0];
    float *cs = b[1], *logits = b[2];
    int rc = -2, done = 0;
    float *sn = cs + (size_t)B * rd;
    for (int s = 0; s < steps; s++) {
        for (int b = 0; b < B; b++) {
            if (tok[b] < 0 || tok[b] >= V || pos[b] < 0 || pos[b] >= P) { rc = -4; goto end; }
            memcpy(x + (size_t)b * D * es, emb + (size_t)tok[b] * D * es, (size_t)D * es);
            memcpy(cs + (size_t)b * rd, cos_tab + pos[b] * rd, rd * sizeof(float));
            memcpy(sn + (size_t)b * rd, sin_tab + pos[b] * rd, rd * sizeof(float));
        }
        const long off = (long)s * n * B * K;
        rc = lynx_layers(n, L, M, R, x, B, cs, sn, pos, rows, kc, vc, cfmt, Bmax, S, ids + off, w + off,
                         vec + 7L * n * s, &done, norm_w, eps, head, logits, nthreads);
        if (rc != 0) goto end;
        int stopped = 0;
        for (int b = 0; b < B; b++) {
            const long best = lynx_argmax(logits + (size_t)b * N, N);
            tok[b] = out[(long)s * B + b] = best;
            pos[b]++;
            for (int i = 0; i < n_stop; i++) stopped |= stop[i] == best;
        }
        *ran = s + 1;
        if (stopped) break;
    }
end:
    scratch_free(mem);
    return rc;
}
