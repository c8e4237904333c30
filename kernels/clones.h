/* KERNEL: how the kernels' loop drivers are compiled, once per instruction-set level. */
#ifndef FSDP_KERNELS_CLONES_H
#define FSDP_KERNELS_CLONES_H

/* One clone per x86-64 level that changes the vector width: SSE2, AVX2, AVX-512 (with BW,
 * for 16-bit lanes). The cloned functions inline every helper they call, so each clone is
 * fully specialized. GCC 12 accepts only the arch= spelling for AVX-512BW clones, and clang
 * 14 silently drops arch=x86-64-v3, hence two spellings. Other compilers and architectures,
 * and -DFSDP_KERNELS_NO_CLONES (to test the portable path on a machine that would pick the
 * AVX-512 clone), get one plain build. */
#if defined(__x86_64__) && !defined(FSDP_KERNELS_NO_CLONES) && defined(__clang__) && \
    __clang_major__ >= 14
#define KERNEL __attribute__((target_clones("avx512bw", "avx2", "default")))
#elif defined(__x86_64__) && !defined(FSDP_KERNELS_NO_CLONES) && !defined(__clang__) && \
    __GNUC__ >= 12
#define KERNEL __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KERNEL
#endif

#endif
