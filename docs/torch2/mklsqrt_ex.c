/* Emulation of MKL VML vsSqrt HA, "EX" (SSE4.2) code path, as disassembled from
 * libtorch_cpu.so (torch 2.15.0 wheel, MKL 2024.2): mkl_vml_kernel_sSqrt_EXHAynn.
 * Main path (no FMA, every op rounded):
 *   r = rsqrtps(x); s = x*r; h = r*0.5; e = 0.5 - s*h; s1 = s*e + s; h1 = h*e + h;
 *   d = x - s1*s1; y = d*h1 + s1
 * Special lanes (x < FLT_MIN incl. 0 and denormals, x >= 0x7f7ff001, negative, inf, nan) are
 * assumed to take a correctly rounded scalar path: sqrtf. emulate.py loads it as libmklsqrt_ex.so:
 *   gcc -O2 -msse2 -ffp-contract=off -shared -fPIC -o libmklsqrt_ex.so mklsqrt_ex.c -lm */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
void mkl_ex_sqrt(const float *x, float *y, long n) {
  const __m128 half = _mm_set1_ps(0.5f);
  long i = 0;
  for (; i + 4 <= n; i += 4) {
    __m128 v = _mm_loadu_ps(x + i);
    __m128 r = _mm_rsqrt_ps(v);
    __m128 s = _mm_mul_ps(v, r);
    __m128 h = _mm_mul_ps(r, half);
    __m128 e = _mm_sub_ps(half, _mm_mul_ps(s, h));
    __m128 s1 = _mm_add_ps(_mm_mul_ps(s, e), s);
    __m128 h1 = _mm_add_ps(_mm_mul_ps(h, e), h);
    __m128 d = _mm_sub_ps(v, _mm_mul_ps(s1, s1));
    __m128 out = _mm_add_ps(_mm_mul_ps(d, h1), s1);
    _mm_storeu_ps(y + i, out);
  }
  for (; i < n; i++) { /* tail: same formula on one lane */
    __m128 v = _mm_set_ss(x[i]);
    __m128 r = _mm_rsqrt_ss(v);
    __m128 s = _mm_mul_ss(v, r);
    __m128 h = _mm_mul_ss(r, half);
    __m128 e = _mm_sub_ss(half, _mm_mul_ss(s, h));
    __m128 s1 = _mm_add_ss(_mm_mul_ss(s, e), s);
    __m128 h1 = _mm_add_ss(_mm_mul_ss(h, e), h);
    __m128 d = _mm_sub_ss(v, _mm_mul_ss(s1, s1));
    y[i] = _mm_cvtss_f32(_mm_add_ss(_mm_mul_ss(d, h1), s1));
  }
  for (i = 0; i < n; i++) {
    uint32_t b;
    memcpy(&b, x + i, 4);
    int32_t t = (int32_t)(b + 0x7f800000u);
    if (t > (int32_t)0xfefff000u) y[i] = sqrtf(x[i]);
  }
}
/* raw rsqrtps, for inspection */
void hw_rsqrt(const float *x, float *y, long n) {
  for (long i = 0; i < n; i++) y[i] = _mm_cvtss_f32(_mm_rsqrt_ss(_mm_set_ss(x[i])));
}
