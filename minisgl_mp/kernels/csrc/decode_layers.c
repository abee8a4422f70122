/*
 * Every decoder layer of a step in one call: the same kernels, in the same order and on the
 * same inputs, as the model's modules call one at a time from Python (engine/cpu_decode.py says
 * when it applies). At small batches each of those calls cost more around the kernel (Python,
 * ctypes, argument checks, caches the weights had just streamed through) than the kernel's own
 * work (docs/benchmarks.md section 21); here they are C calls. A step may mix decodes and short
 * extends (the paged kernel) with prompt chunks (the blocked kernel), as the attention backend
 * splits them.
 *
 * A layer (Qwen3's: pre-norm, fused qkv, per-head q/k RMSNorm and rotary, paged attention,
 * SwiGLU):
 *   h = RMSNorm(x += residual); residual = x
 *   q, k = norm_rope(qkv = h Wqkv); pool[out_loc] = k, v; a = attention(q, pool)
 *   o = a Wo; h = RMSNorm(o += residual); residual = o
 *   x = silu_mul(h Wgate_up) Wdown
 * x and the residual live in three [m, hidden] buffers taken in turn, so nothing is copied.
 */
#include <stddef.h>
#include <stdint.h>

/* The kernels of the other sources of this library. */
void add_rmsnorm_f32(float *x, const float *residual, const float *w, float eps, float *out, int64_t rows,
                     int64_t dim);
void qk_norm_rope_f32(const float *qkv, int64_t tokens, int64_t row_stride, int64_t hq, int64_t hkv, int64_t d,
                      const float *q_w, const float *k_w, float eps, const float *cos_sin, const int64_t *pos,
                      float *q_out, float *k_out);
void silu_mul_f32(const float *gate_up, int64_t rows, int64_t d, int64_t row_stride, float *out);
void kv_store_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride, const int64_t *loc,
                  int64_t tokens, int64_t row, void *k_pool, void *v_pool, int bf16);
int amx_gemm_bf16(const float *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                  const float *bias, float *y, int64_t ldy);
int bf16dot_gemm_bf16(const float *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                      const float *bias, float *y, int64_t ldy);
int weight_gemm(const float *x, int64_t m, int64_t k, const void *w, int fmt, const float *scale,
                const float *bias, float *y, int64_t ldy, int64_t n);
void packed_gemm_f32(const float *x, int64_t m, int64_t k, int64_t ldx, const float *panels, int64_t n,
                     const float *bias, float *y, int64_t ldy);
int paged_attention_f32(const float *q, const float *k, const float *v, const int64_t *kv_index, int64_t stride,
                        const int64_t *q_start, const int64_t *q_len, const int64_t *kv_len, float *out,
                        int64_t batch, int64_t hq, int64_t hkv, int64_t d, float scale, int64_t key_splits);
int paged_attention_bf16kv(const float *q, const uint16_t *k, const uint16_t *v, const int64_t *kv_index,
                           int64_t stride, const int64_t *q_start, const int64_t *q_len, const int64_t *kv_len,
                           float *out, int64_t batch, int64_t hq, int64_t hkv, int64_t d, float scale,
                           int64_t key_splits);
int extend_attention_f32(const float *q, const float *k, const float *v, const int64_t *kv_index, int64_t stride,
                         const int64_t *q_start, const int64_t *q_len, const int64_t *kv_len, float *out,
                         int64_t batch, int64_t hq, int64_t hkv, int64_t d, float scale);
int extend_attention_amx(const float *q, const float *k, const float *v, const int64_t *kv_index, int64_t stride,
                         const int64_t *q_start, const int64_t *q_len, const int64_t *kv_len, float *out,
                         int64_t batch, int64_t hq, int64_t hkv, int64_t d, float scale);
int extend_attention_bf16dot(const float *q, const float *k, const float *v, const int64_t *kv_index, int64_t stride,
                             const int64_t *q_start, const int64_t *q_len, const int64_t *kv_len, float *out,
                             int64_t batch, int64_t hq, int64_t hkv, int64_t d, float scale);

int vnni_gemm(const float *x, int64_t m, int64_t k, int64_t ldx, int fmt, const uint8_t *packed,
              const float *scale, const float *bias, float *y, int64_t ldy, int64_t n);

/* One Linear: its weight as float32 panels (fmt -1, packed_gemm.c), as bfloat16 AMX tiles (fmt
 * FMT_AMX, amx_gemm.c), as bfloat16 pair panels (fmt FMT_BF16DOT, bf16dot_gemm.c), in
 * vnni_gemm.c's int8 or int4 layout (FMT_VNNI_I8, FMT_VNNI_Q4) or in a weight_gemm.c format
 * (0-3, 6). */
enum { FMT_AMX = 4, FMT_BF16DOT = 5, FMT_VNNI_I8 = 7, FMT_VNNI_Q4 = 8 };
typedef struct {
    const void *w;
    const float *scale; /* int8's per-channel scale, else NULL */
    const float *bias;  /* or NULL */
    int64_t n, k, fmt;
} dl_product;

typedef struct {
    const float *in_norm, *post_norm, *q_norm, *k_norm;
    float eps, qk_eps;
    dl_product qkv, o, gate_up, down;
    void *k_pool, *v_pool; /* this layer's K and V: [slots, hkv, d] */
} dl_layer;

/* The requests of one attention kernel: page-table rows and, per request, its first token row
 * in the step, its new tokens and its keys (attention/cpu.py's KernelRun). */
typedef struct {
    const int64_t *kv_index;
    int64_t stride, batch; /* batch 0: no request for this kernel */
    const int64_t *q_start, *q_len, *kv_len;
} dl_run;

enum { EXT_F32 = 0, EXT_AMX = 1, EXT_BF16DOT = 2 };

typedef struct {
    int64_t m, hidden, hq, hkv, d, inter, kv_bf16;
    const float *cos_sin;
    const int64_t *pos, *out_loc;
    dl_run paged;  /* decodes and short extends: paged_attention.c */
    dl_run extend; /* prompt chunks: the blocked kernel, float32 pools only */
    int64_t key_splits, extend_kind;
    float scale, unused;
    float *bufs[3]; /* [m, hidden] each; bufs[0] holds the embeddings on entry */
    float *h, *qkv, *q, *k, *attn, *gate_up, *act;
} dl_step;

/* 0, or -1 when a bfloat16 or VNNI product could not allocate its copy of x. */
static int product(const dl_product *p, const float *x, int64_t m, float *y) {
    if (p->fmt < 0)
        packed_gemm_f32(x, m, p->k, p->k, (const float *)p->w, p->n, p->bias, y, p->n);
    else if (p->fmt == FMT_AMX)
        return amx_gemm_bf16(x, m, p->k, p->k, (const uint16_t *)p->w, p->n, p->bias, y, p->n);
    else if (p->fmt == FMT_BF16DOT)
        return bf16dot_gemm_bf16(x, m, p->k, p->k, (const uint16_t *)p->w, p->n, p->bias, y, p->n);
    else if (p->fmt == FMT_VNNI_I8 || p->fmt == FMT_VNNI_Q4)
        return vnni_gemm(x, m, p->k, p->k, (int)(p->fmt - FMT_VNNI_I8), (const uint8_t *)p->w, p->scale, p->bias, y,
                         p->n, p->n) == 0 ? 0 : -1;
    else
        weight_gemm(x, m, p->k, p->w, (int)p->fmt, p->scale, p->bias, y, p->n, p->n);
    return 0;
}

/* Attention for every request of the step, from the pool this layer's K/V were just stored in:
 * 0, or the first kernel's error. */
static int attention(const dl_layer *L, const dl_step *s) {
    const int64_t hq = s->hq, hkv = s->hkv, d = s->d;
    const dl_run *p = &s->paged, *e = &s->extend;
    if (p->batch) {
        const int rc = s->kv_bf16
            ? paged_attention_bf16kv(s->q, (const uint16_t *)L->k_pool, (const uint16_t *)L->v_pool, p->kv_index,
                                     p->stride, p->q_start, p->q_len, p->kv_len, s->attn, p->batch, hq, hkv, d,
                                     s->scale, s->key_splits)
            : paged_attention_f32(s->q, (const float *)L->k_pool, (const float *)L->v_pool, p->kv_index, p->stride,
                                  p->q_start, p->q_len, p->kv_len, s->attn, p->batch, hq, hkv, d, s->scale,
                                  s->key_splits);
        if (rc != 0) return rc;
    }
    if (e->batch) {
        if (s->kv_bf16) return -2; /* the blocked kernels read float32 pools only */
        const float *k = (const float *)L->k_pool, *v = (const float *)L->v_pool;
        if (s->extend_kind == EXT_AMX)
            return extend_attention_amx(s->q, k, v, e->kv_index, e->stride, e->q_start, e->q_len, e->kv_len, s->attn,
                                        e->batch, hq, hkv, d, s->scale);
        if (s->extend_kind == EXT_BF16DOT)
            return extend_attention_bf16dot(s->q, k, v, e->kv_index, e->stride, e->q_start, e->q_len, e->kv_len,
                                            s->attn, e->batch, hq, hkv, d, s->scale);
        return extend_attention_f32(s->q, k, v, e->kv_index, e->stride, e->q_start, e->q_len, e->kv_len, s->attn,
                                    e->batch, hq, hkv, d, s->scale);
    }
    return 0;
}

/* Returns x's buffer index * 4 + the residual's, -1 when attention or a bfloat16 product could
 * not allocate its scratch space, or -2 when a blocked attention kernel cannot take the step (its
 * build, the head dim, a bfloat16 pool: the attention backend chooses so that this does not
 * happen, and the check keeps a disagreement from reading the pool wrong). The outputs are then
 * incomplete. */
int decode_layers(const dl_layer *layers, int64_t n_layers, const dl_step *s) {
    const int64_t m = s->m, hq = s->hq, hkv = s->hkv, d = s->d;
    const int64_t qkv_n = (hq + 2 * hkv) * d;
    int xi = 0, ri = -1;
    for (int64_t l = 0; l < n_layers; ++l) {
        const dl_layer *L = layers + l;
        add_rmsnorm_f32(s->bufs[xi], ri < 0 ? NULL : s->bufs[ri], L->in_norm, L->eps, s->h, m, s->hidden);
        ri = xi;
        if (product(&L->qkv, s->h, m, s->qkv)) return -1;
        qk_norm_rope_f32(s->qkv, m, qkv_n, hq, hkv, d, L->q_norm, L->k_norm, L->qk_eps, s->cos_sin, s->pos, s->q,
                         s->k);
        kv_store_f32(s->k, hkv * d, s->qkv + (hq + hkv) * d, qkv_n, s->out_loc, m, hkv * d, L->k_pool, L->v_pool,
                     (int)s->kv_bf16);
        const int rc = attention(L, s);
        if (rc != 0) return rc == -2 ? -2 : -1;
        const int oi = (ri + 1) % 3;
        if (product(&L->o, s->attn, m, s->bufs[oi])) return -1;
        add_rmsnorm_f32(s->bufs[oi], s->bufs[ri], L->post_norm, L->eps, s->h, m, s->hidden);
        ri = oi;
        if (product(&L->gate_up, s->h, m, s->gate_up)) return -1;
        silu_mul_f32(s->gate_up, m, s->inter, 2 * s->inter, s->act);
        xi = (ri + 1) % 3;
        if (product(&L->down, s->act, m, s->bufs[xi])) return -1;
    }
    return xi * 4 + (ri < 0 ? 3 : ri);
}
