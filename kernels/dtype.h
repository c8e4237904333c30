/* fsdp_dtype_t: the element types the kernels know, for C and CUDA code alike. */
#ifndef FSDP_KERNELS_DTYPE_H
#define FSDP_KERNELS_DTYPE_H

/* The element types of parameters and gradients. The values are stable (tables and tests
 * index by them) but are not a wire format: proto/ has its own DType. */
typedef enum fsdp_dtype {
  FSDP_DTYPE_FP32 = 0,
  FSDP_DTYPE_BF16 = 1,
  FSDP_DTYPE_FP16 = 2,
} fsdp_dtype_t;

#define FSDP_DTYPE_COUNT 3

#endif
