/* Decode attention of the embedded engine on CPU, float32: one query token per row against the keys/values
 * that row's slot holds in the position-major KV pool (see kv_pool.py), read in place.
 *
 * Shapes are compile-time constants (the loader builds one library per model shape):
 *   MILES_KVH  KV heads, MILES_GRP  query heads per KV head, MILES_D  head dim (a multiple of 8).
 * Layouts (float32, contiguous unless a stride is given):
 *   q       [rows, H, D]                   queries, already multiplied by the softmax scale (H = KVH * GRP;
 *                                          query head h * GRP + g reads KV head h)
 *   pool    [capacity, slots, KVH, D]      one layer's keys (or values); `pos_stride` floats between positions
 *   slot    [rows] int64                   each row's slot in the pool
 *   len     [rows] int64                   each row's visible keys: positions 0 .. len - 1 (len >= 1)
 *   scores  [L, rows, H]                   q . k per position (-inf at positions >= len); L = max(len)
 *   probs   [L, rows, H]                   softmax of scores over positions
 *   out     [rows, H, D]                   sum over positions of probs * v
 * Positions at or past a row's length are never read: their pool memory may hold anything.
 *
 * Both passes walk positions in tiles of TILE: for one row and KV head, the tile's keys (values) are TILE runs of
 * D floats, one per position, with the queries (the output accumulators) held in registers across the tile, and
 * the next runs prefetched. Sweeping all positions for every row first would re-read the queries (accumulators)
 * from cache once per position, and sweeping a whole position block at a time keeps more in flight than the core's
 * out-of-order window covers: both measured at about twice the time of this order (batch 64, 56 positions).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if !defined(MILES_KVH) || !defined(MILES_GRP) || !defined(MILES_D)
#error "compile with -DMILES_KVH=.. -DMILES_GRP=.. -DMILES_D=.."
#endif
#if MILES_D % 8 != 0
#error "MILES_D must be a multiple of 8"
#endif

#define KVH MILES_KVH
#define GRP MILES_GRP
#define D MILES_D
#define H (KVH * GRP)
#if D % 16 == 0
#define W 16
#else
#define W 8
#endif
#define NV (D / W)
#define TILE 8
#define AHEAD 1024 /* bytes past the current run to prefetch (into L2: locality 2) */

typedef float vec __attribute__((vector_size(W * 4), aligned(4)));

static inline vec load(const float *p) { return *(const vec *)p; }
static inline void store(float *p, vec v) { *(vec *)p = v; }

typedef float half_vec __attribute__((vector_size(32)));
typedef float quarter_vec __attribute__((vector_size(16)));

/* the lanes' sum as a tree of halves (a loop over lanes compiles to a chain of W dependent scalar adds) */
static inline float hsum(vec a) {
#if W == 16
  half_vec h = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  half_vec h = a;
#endif
  quarter_vec f = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (f[0] + f[2]) + (f[1] + f[3]);
}

static inline void prefetch_run(const float *run) {
  for (int b = 0; b < D * 4; b += 64) __builtin_prefetch((const char *)run + AHEAD + b, 0, 2);
}

void miles_shape(int64_t *kvh_grp_d) {
  kvh_grp_d[0] = KVH;
  kvh_grp_d[1] = GRP;
  kvh_grp_d[2] = D;
}

void miles_decode_scores(const float *q, const float *keys, const int64_t *slot, const int64_t *len, int64_t rows,
                         int64_t L, int64_t pos_stride, float *scores) {
  for (int64_t p0 = 0; p0 < L; p0 += TILE) {
    const int64_t p1 = p0 + TILE < L ? p0 + TILE : L;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t end = p1 < len[r] ? p1 : len[r];
      for (int64_t p = end > p0 ? end : p0; p < p1; ++p)
        for (int j = 0; j < H; ++j) scores[(p * rows + r) * H + j] = -INFINITY;
      if (end <= p0) continue;
      const float *kr = keys + slot[r] * (KVH * D);
      const float *qr = q + r * (H * D);
      for (int h = 0; h < KVH; ++h) {
        vec qv[GRP][NV];
        for (int g = 0; g < GRP; ++g)
          for (int c = 0; c < NV; ++c) qv[g][c] = load(qr + (h * GRP + g) * D + c * W);
        for (int64_t p = p0; p < end; ++p) {
          const float *kh = kr + p * pos_stride + h * D;
          prefetch_run(kh);
          vec kv[NV];
          for (int c = 0; c < NV; ++c) kv[c] = load(kh + c * W);
          float *s = scores + (p * rows + r) * H + h * GRP;
          for (int g = 0; g < GRP; ++g) {
            vec a = qv[g][0] * kv[0];
            for (int c = 1; c < NV; ++c) a += qv[g][c] * kv[c];
            s[g] = hsum(a);
          }
        }
      }
    }
  }
}

void miles_decode_values(const float *probs, const float *values, const int64_t *slot, const int64_t *len,
                         int64_t rows, int64_t L, int64_t pos_stride, float *out) {
  memset(out, 0, sizeof(float) * (size_t)(rows * H * D));
  for (int64_t p0 = 0; p0 < L; p0 += TILE) {
    const int64_t p1 = p0 + TILE < L ? p0 + TILE : L;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t end = p1 < len[r] ? p1 : len[r];
      if (end <= p0) continue;
      const float *vr = values + slot[r] * (KVH * D);
      float *orow = out + r * (H * D);
      for (int h = 0; h < KVH; ++h) {
        vec acc[GRP][NV];
        for (int g = 0; g < GRP; ++g)
          for (int c = 0; c < NV; ++c) acc[g][c] = load(orow + (h * GRP + g) * D + c * W);
        for (int64_t p = p0; p < end; ++p) {
          const float *vh = vr + p * pos_stride + h * D;
          prefetch_run(vh);
          const float *w = probs + (p * rows + r) * H + h * GRP;
          for (int g = 0; g < GRP; ++g)
            for (int c = 0; c < NV; ++c) acc[g][c] += w[g] * load(vh + c * W);
        }
        for (int g = 0; g < GRP; ++g)
          for (int c = 0; c < NV; ++c) store(orow + (h * GRP + g) * D + c * W, acc[g][c]);
      }
    }
  }
}
