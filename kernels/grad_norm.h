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

/* A tensor's norm taken in parts, each continuing the chain the previous part left, so that a
 * tensor split across ranks' shards gets the norm the one-piece function gives (the same bits:
 * the chain is the same sequence of roundings). Lane j still adds the elements whose index within
 * the tensor is j mod 8, whichever part holds them. The state between parts: while the chain is
 * within the first n - n % 8 elements (its next offset at most that), the 8 lane accumulators;
 * past them, acc[0] is the running sum of the tail and acc[1..7] are unused. A chain starts from
 * a zeroed state. */
typedef struct zd__norm_state {
  float acc[8];
} zd__norm_state_t;

/* Continues the chain in st over the tensor's elements [offset, offset + count), read from x[0,
 * count), each taken as the fp32 product x[k] * scale (scale 1: x itself; 0.5: the average of a
 * sum over 2 ranks, exactly). offset + count at most n. Where offset + count == n the part ends
 * the tensor: returns its norm (the one-piece function's bits on the scaled elements); else
 * returns 0 and st holds the chain for the part at offset + count. */
typedef float (*zd__norm_part_fn)(zd__norm_state_t *st, const float *x, uint64_t n, uint64_t offset,
                                  uint64_t count, float scale, zd__norm_order_t order);

/* The scalar reference of the parts, and the implementation for an ISA (as zd__torch_norm2_impl).
 */
float zd__torch_norm2_part_ref(zd__norm_state_t *st, const float *x, uint64_t n, uint64_t offset,
                               uint64_t count, float scale, zd__norm_order_t order);
zd__norm_part_fn zd__torch_norm2_part_impl(zd__isa_t isa);
/* Internal: the AVX2 path of the parts (grad_norm_avx2.c). */
float zd__torch_norm2_part_avx2(zd__norm_state_t *st, const float *x, uint64_t n, uint64_t offset,
                                uint64_t count, float scale, zd__norm_order_t order);

/* clip_grad_norm_'s total from the per-parameter norms (norms[i]: parameter i's, in parameter
 * order): the norm `fn` takes in `order` of the stack of the norms of the parameters present, in
 * parameter order. present: bit i % 8 of present[i / 8] set where parameter i has a gradient (a
 * parameter whose grad is None is not in torch's stack); NULL: all present. No parameter present:
 * 0. scratch: room for nparams floats (the stack). */
float zd__torch_norm2_total(zd__norm_fn fn, const float *norms, uint32_t nparams,
                            const uint8_t *present, zd__norm_order_t order, float *scratch);

/* Internal: the part of [offset, end) past the lanes (both paths share it, after taking the part's
 * elements below n - n % 8 into the lanes): the lanes are summed into acc[0] once a part goes past
 * them or ends the tensor, the tail elements are added in order, and the norm is taken where end
 * == n (returned; else 0). */
float zd__norm_part_tail(zd__norm_state_t *st, const float *x, uint64_t n, uint64_t offset,
                         uint64_t end, float scale, zd__norm_order_t order);

#endif /* ZD_KERNELS_GRAD_NORM_H */
