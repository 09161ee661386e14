/* Unit tests of torch's fp32 2-norm order (kernels/grad_norm.h).
 *
 * The scalar reference is pinned to torch by golden norms measured with torch.linalg.vector_norm
 * on Debian's torch 1.13.1 and PyPI's 2.6.0 and 2.15.0 (docs/torch2/clip_emulate.py is the model
 * they were checked with over millions of elements): inputs chosen so that the three orders give
 * different bits, at tail lengths 4 to 7 and 0 to 3 and in the vector body. The AVX2 path, where
 * the CPU runs it, must equal the reference bit for bit on random tensors of every length up to
 * 300 and a few large ones, special values included. A norm taken in parts (a parameter split
 * across ranks' shards) must equal the one-piece norm over any split points, and the total over
 * the parameters present the norm of their stack alone.
 */
#include <math.h>

#include "check.h"
#include "grad_norm.h"

static uint32_t bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

/* The golden inputs: an LCG's top 24 bits, centred, times 2^-20, times 0.7f (two fp32 roundings
 * that numpy reproduces). */
static void golden_input(float *x, uint32_t n, uint32_t seed) {
  uint32_t s = seed;
  for (uint32_t i = 0; i < n; i++) {
    s = s * 1664525u + 1013904223u;
    x[i] = ((float)((int32_t)(s >> 8) - (1 << 23)) * 0x1p-20f) * 0.7f;
  }
}

static const struct {
  uint32_t n, seed;
  uint32_t norm[3]; /* indexed by zd__norm_order_t: torch 1.13.1, 2.6.0, 2.15.0 */
} golden[] = {
    {4, 21, {0x40b6a11c, 0x40b6a11b, 0x40b6a11c}},
    {4, 26, {0x40731a2e, 0x40731a2f, 0x40731a2e}},
    {5, 1, {0x40ce0ea9, 0x40ce0ea8, 0x40ce0ea9}},
    {5, 10, {0x410c1b71, 0x410c1b70, 0x410c1b71}},
    {7, 10, {0x411fdec2, 0x411fdec1, 0x411fdec2}},
    {7, 21, {0x40c97f00, 0x40c97eff, 0x40c97f00}},
    {12, 24, {0x410b23eb, 0x410b23ea, 0x410b23eb}},
    {12, 27, {0x4134f1d5, 0x4134f1d6, 0x4134f1d5}},
    {13, 24, {0x41200f9f, 0x41200f9e, 0x41200f9f}},
    {13, 27, {0x41490d9a, 0x41490d9b, 0x41490d9a}},
    {16, 22, {0x416bc31a, 0x416bc31a, 0x416bc319}},
    {16, 55, {0x4144b562, 0x4144b562, 0x4144b561}},
    {20, 16, {0x41654f48, 0x41654f47, 0x41654f48}},
    {20, 2267, {0x4167e890, 0x4167e891, 0x4167e892}},
    {21, 3, {0x41577400, 0x415773ff, 0x41577400}},
    {21, 2424, {0x416821a9, 0x416821a8, 0x416821a7}},
    {27, 1, {0x417dd7ba, 0x417dd7ba, 0x417dd7b9}},
    {27, 5, {0x4186c100, 0x4186c100, 0x4186c0ff}},
    {29, 5, {0x4186d5f7, 0x4186d5f7, 0x4186d5f6}},
    {29, 14, {0x416b9aee, 0x416b9aee, 0x416b9aef}},
    {31, 5, {0x418a8ae5, 0x418a8ae5, 0x418a8ae4}},
    {31, 9, {0x41970d40, 0x41970d3f, 0x41970d40}},
    {36, 13, {0x41a2197c, 0x41a2197c, 0x41a2197b}},
    {36, 599, {0x419af95d, 0x419af95c, 0x419af95e}},
    {64, 5, {0x41c797c6, 0x41c797c6, 0x41c797c5}},
    {64, 11, {0x41cfc16d, 0x41cfc16d, 0x41cfc16c}},
    {100, 23, {0x42052565, 0x42052565, 0x42052566}},
    {100, 2149, {0x41ff418e, 0x41ff418d, 0x41ff418f}},
    {1000, 8, {0x42d32172, 0x42d32172, 0x42d32171}},
    {1000, 19, {0x42c9115a, 0x42c9115a, 0x42c91159}},
    {4097, 3, {0x434be1c2, 0x434be1c2, 0x434be1c3}},
    {4097, 17, {0x434fd2b2, 0x434fd2b2, 0x434fd2b1}},
};

static void test_golden(void) {
  static float x[4097];
  for (size_t i = 0; i < sizeof golden / sizeof golden[0]; i++) {
    golden_input(x, golden[i].n, golden[i].seed);
    for (int o = ZD__NORM_TORCH113; o <= ZD__NORM_TORCH215; o++) {
      float r = zd__torch_norm2_ref(x, golden[i].n, (zd__norm_order_t)o);
      CHECK_MSG(bits(r) == golden[i].norm[o], "n=%u seed=%u order %d: 0x%08x vs torch's 0x%08x",
                golden[i].n, golden[i].seed, o, bits(r), golden[i].norm[o]);
    }
  }
  /* One element: 2.x returns |x|; 1.13 squares it (1e-30^2 underflows to 0). */
  float tiny = -1e-30f;
  CHECK_INT_EQ(bits(zd__torch_norm2_ref(&tiny, 1, ZD__NORM_TORCH113)), bits(0.0f));
  CHECK_INT_EQ(bits(zd__torch_norm2_ref(&tiny, 1, ZD__NORM_TORCH215)), bits(1e-30f));
  CHECK_INT_EQ(bits(zd__torch_norm2_ref(x, 0, ZD__NORM_TORCH26)), bits(0.0f));
  printf("golden: reference equals torch 1.13.1, 2.6.0, 2.15.0 on %zu tensors\n",
         sizeof golden / sizeof golden[0]);
}

static float rnd_float(void) {
  /* Mantissa and sign random, exponents over a wide range, now and then a special value. */
  uint64_t r = zd_test_rnd();
  switch (r % 200) {
    case 0:
      return NAN;
    case 1:
      return -INFINITY;
    case 2:
      return 0x1p-140f; /* subnormal */
    default: {
      uint32_t u = (uint32_t)(r >> 32) & 0x807fffffu;
      u |= (uint32_t)(127 - 40 + (r >> 8) % 80) << 23;
      float f;
      memcpy(&f, &u, sizeof f);
      return f;
    }
  }
}

static void test_isa(void) {
  if (zd__isa_detect() < ZD__ISA_AVX2) {
    printf("isa: no AVX2 here, the reference only\n");
    return;
  }
  zd__norm_fn fast = zd__torch_norm2_impl(ZD__ISA_AVX2);
  CHECK(zd__torch_norm2_impl(zd__isa_detect()) == fast);
  CHECK(zd__torch_norm2_impl(ZD__ISA_SCALAR) == zd__torch_norm2_ref);
  static float x[1 << 20];
  uint64_t cases = 0;
  for (int pass = 0; pass < 2; pass++) {
    /* pass 1: special values allowed */
    for (uint64_t n = 0; n < 300 + 4; n++) {
      uint64_t len = n < 300 ? n : (uint64_t)1 << (16 + n - 300) | (n & 7);
      for (int rep = 0; rep < (n < 300 ? 20 : 1); rep++) {
        for (uint64_t i = 0; i < len; i++) {
          float f = rnd_float();
          x[i] = pass == 0 && !isfinite(f) ? 1.5f : f;
        }
        for (int o = ZD__NORM_TORCH113; o <= ZD__NORM_TORCH215; o++) {
          float r = zd__torch_norm2_ref(x, len, (zd__norm_order_t)o);
          float f = fast(x, len, (zd__norm_order_t)o);
          CHECK_MSG(bits(r) == bits(f) || (isnan(r) && isnan(f)),
                    "n=%llu order %d: avx2 0x%08x vs reference 0x%08x", (unsigned long long)len, o,
                    bits(f), bits(r));
          cases++;
        }
      }
    }
  }
  printf("isa: avx2 equals the reference on %llu tensors\n", (unsigned long long)cases);
}

/* A tensor's norm taken in parts over random split points (none, several, some inside the tail,
 * at offsets not a multiple of 8, empty parts), each part continuing the chain the previous one
 * left: the one-piece function's bits, for every order, on the reference and the AVX2 path; and
 * with a scale, the one-piece function's bits on the scaled elements. */
static void test_parts(void) {
  zd__norm_part_fn impls[2] = {zd__torch_norm2_part_ref, NULL};
  if (zd__isa_detect() >= ZD__ISA_AVX2) impls[1] = zd__torch_norm2_part_impl(ZD__ISA_AVX2);
  CHECK(zd__torch_norm2_part_impl(ZD__ISA_SCALAR) == zd__torch_norm2_part_ref);
  static float x[70000], xs[70000];
  uint64_t cases = 0, inside_tail = 0, unaligned = 0;
  for (int rep = 0; rep < 6000; rep++) {
    uint64_t r = zd_test_rnd();
    uint64_t n = rep < 400 ? (uint64_t)rep % 40 : r % 8 == 0 ? 60000 + r % 9000 : r % 700;
    int special = rep % 3 == 2;
    for (uint64_t i = 0; i < n; i++) {
      float f = rnd_float();
      x[i] = !special && !isfinite(f) ? 0.75f : f;
    }
    /* up to 6 cuts, sorted (equal cuts make empty parts) */
    uint64_t cuts[8], ncuts = zd_test_rnd() % 7;
    for (uint64_t c = 0; c < ncuts; c++) {
      uint64_t t = zd_test_rnd();
      /* now and then a cut inside the tail, or at the lanes' end */
      cuts[c] = n == 0 ? 0 : t % 4 == 0 ? n - n % 8 + (t >> 8) % (n % 8 + 1) : (t >> 8) % (n + 1);
    }
    for (uint64_t a = 1; a < ncuts; a++)
      for (uint64_t b = a; b > 0 && cuts[b - 1] > cuts[b]; b--) {
        uint64_t t = cuts[b];
        cuts[b] = cuts[b - 1];
        cuts[b - 1] = t;
      }
    cuts[ncuts] = n;
    for (uint64_t c = 0; c < ncuts; c++) {
      inside_tail += cuts[c] > n - n % 8 && cuts[c] < n;
      unaligned += cuts[c] % 8 != 0;
    }
    float scale = rep % 5 == 4 ? 0.5f : rep % 11 == 10 ? 0.3f : 1.0f;
    for (uint64_t i = 0; i < n; i++) xs[i] = x[i] * scale;
    for (int o = ZD__NORM_TORCH113; o <= ZD__NORM_TORCH215; o++) {
      float want = zd__torch_norm2_ref(xs, n, (zd__norm_order_t)o);
      for (int k = 0; k < 2; k++) {
        if (!impls[k]) continue;
        zd__norm_state_t st = {{0}};
        uint64_t at = 0;
        float got = -1;
        for (uint64_t c = 0; c <= ncuts; c++) {
          float v = impls[k](&st, x + at, n, at, cuts[c] - at, scale, (zd__norm_order_t)o);
          at = cuts[c];
          if (at < n) {
            CHECK_MSG(v == 0, "a part that does not end the tensor returned %g", v);
          } else {
            got = v; /* the part that ends the tensor ends the chain */
            break;
          }
        }
        CHECK_MSG(bits(got) == bits(want) || (isnan(got) && isnan(want)),
                  "n=%llu order %d %s scale %g, %llu cuts (first %llu): 0x%08x vs one piece "
                  "0x%08x",
                  (unsigned long long)n, o, k ? "avx2" : "reference", (double)scale,
                  (unsigned long long)ncuts, (unsigned long long)(ncuts ? cuts[0] : 0), bits(got),
                  bits(want));
        cases++;
      }
    }
  }
  CHECK(inside_tail > 100 && unaligned > 1000);
  printf(
      "parts: %llu chains equal the one-piece norm (%llu cuts inside a tail, %llu at offsets "
      "not a multiple of 8)\n",
      (unsigned long long)cases, (unsigned long long)inside_tail, (unsigned long long)unaligned);
}

/* The total over the stack of the norms of the parameters present: the norm of the stack of those
 * alone, in parameter order; NULL: every parameter. */
static void test_total_presence(void) {
  float norms[37], stack[37], scratch[37];
  for (int i = 0; i < 37; i++) norms[i] = fabsf(rnd_float()) + 0.25f * (float)i;
  uint8_t present[5] = {0};
  uint32_t k = 0;
  for (uint32_t i = 0; i < 37; i++)
    if (i % 3 != 1 && i != 36) {
      present[i / 8] |= (uint8_t)(1u << (i % 8));
      stack[k++] = norms[i];
    }
  for (int o = ZD__NORM_TORCH113; o <= ZD__NORM_TORCH215; o++) {
    zd__norm_order_t ord = (zd__norm_order_t)o;
    float all = zd__torch_norm2_total(zd__torch_norm2_ref, norms, 37, NULL, ord, scratch);
    CHECK_INT_EQ(bits(all), bits(zd__torch_norm2_ref(norms, 37, ord)));
    float some = zd__torch_norm2_total(zd__torch_norm2_ref, norms, 37, present, ord, scratch);
    CHECK_INT_EQ(bits(some), bits(zd__torch_norm2_ref(stack, k, ord)));
    CHECK(bits(some) != bits(all));
    uint8_t none[5] = {0}, one[5] = {0};
    CHECK_INT_EQ(bits(zd__torch_norm2_total(zd__torch_norm2_ref, norms, 37, none, ord, scratch)),
                 bits(0.0f));
    one[2] = 1u << 3; /* parameter 19 alone: 2.x's one-element norm is its |x| */
    float lone = zd__torch_norm2_total(zd__torch_norm2_ref, norms, 37, one, ord, scratch);
    CHECK_INT_EQ(bits(lone), bits(zd__torch_norm2_ref(&norms[19], 1, ord)));
  }
  printf("total: the stack of the parameters present, in parameter order\n");
}

int main(void) {
  test_golden();
  test_isa();
  test_parts();
  test_total_presence();
  printf("PASS\n");
  return 0;
}
