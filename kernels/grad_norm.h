/* The fp32 2-norm of one gradient tensor, computed in the order torch's CPU vector_norm(x, 2)
 * computes it, so that clipping can give torch.nn.utils.clip_grad_norm_'s total norm bit for bit
 * (docs/torch2/README.md, section 6: the model and how it was measured).
 *
 * torch reduces a contiguous fp32 tensor of n elements in ATen's reduce-last-dim kernel (the AVX2
 * copy; AVX-512 CPUs run it too, the AVX-512 slot of the dispatch being empty): 8 fp32 lanes, lane
 * j adding x[i]^2 for i = j (mod 8) over the first n - n % 8 elements, in increasing i; the lanes
 * summed ((l0 + l1) + l2) + ... + l7; the n % 8 tail elements added in order; a correctly rounded
 * sqrt. The C++ says acc + x * x everywhere; how GCC compiled it differs between builds, and that
 * is what the orders below name (each measured exact against that torch on every size and shape):
 *   ZD__NORM_TORCH113  Debian's python3-torch 1.13.1: lanes fma(x, x, acc); of the m tail
 *                      elements the first 4 * (m / 4) add a rounded product, the rest fma.
 *   ZD__NORM_TORCH26   PyPI torch 2.6: lanes fma; every tail element fma; one element: |x|.
 *   ZD__NORM_TORCH215  PyPI torch 2.15: lanes acc + rounded product; tail as TORCH113; one
 *                      element: |x| (2.x's linalg_vector_norm returns abs() for a 1-element input).
 * Non-finite inputs propagate as in torch (NaN, or inf for an inf). The shape does not matter for a
 * contiguous tensor; a strided (non-contiguous) gradient is outside this model.
 *
 * clip_grad_norm_'s total is the same function over the fp32 per-tensor norms in parameter order
 * (2.x: vector_norm(stack(norms)); 1.13: torch.norm of the same stack, the same kernel).
 */
#ifndef ZD_KERNELS_GRAD_NORM_H
#define ZD_KERNELS_GRAD_NORM_H

#include <stdint.h>

#include "adam.h"

typedef enum zd__norm_order {
  ZD__NORM_TORCH113 = 0,
  ZD__NORM_TORCH26 = 1,
  ZD__NORM_TORCH215 = 2,
} zd__norm_order_t;

/* ||x[0, n)||_2 in torch's order `order`; n == 0 gives 0. Reads x only; thread-safe. */
typedef float (*zd__norm_fn)(const float *x, uint64_t n, zd__norm_order_t order);

/* The scalar reference: the specification the fast path is tested against. */
float zd__torch_norm2_ref(const float *x, uint64_t n, zd__norm_order_t order);
/* The implementation for an ISA (AVX-512 CPUs get the AVX2 path: torch's order is 8 lanes); an ISA
 * the CPU lacks must not be asked for. */
zd__norm_fn zd__torch_norm2_impl(zd__isa_t isa);

/* Internal: the AVX2 path (grad_norm_avx2.c), built with -mavx2 -mfma. */
float zd__torch_norm2_avx2(const float *x, uint64_t n, zd__norm_order_t order);

#endif /* ZD_KERNELS_GRAD_NORM_H */
