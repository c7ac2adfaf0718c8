/* Large copies steered around `rep movsb`'s slow places (native/_native.c and native/_curl.c).
 *
 * Why: a copy of a few KiB or more is done with `rep movsb`, by the kernel for a read and by
 * glibc's memcpy, and on the benchmark machine (AMD EPYC, FSRM) that instruction runs at
 * 1.5-2.5 GB/s instead of 8-30 when the destination's place in its 64-byte line is 1-31
 * bytes past the source's (benchmarks/open/align.py draws the grid). A Python bytes
 * object's memory lands there for one large read in four, a raw body after its 38-byte
 * header for most destinations, and a received body's pieces half the time. So: scratch
 * buffers start on a line (a read into them is never such a copy), and such a copy in
 * user space goes through SSE2 loads and stores (line_copy: 5-38 GB/s where memcpy gave
 * 1.5-35). */
#ifndef FASTLOAD_LINES_H
#define FASTLOAD_LINES_H

#include <stdint.h>
#include <string.h>

#define LINE 64
#define LINE_COPY_MIN 2048 /* below it glibc copies with vector loads and stores already */

static inline int slow_copy(uintptr_t dst, uintptr_t src) {
    uintptr_t d = dst & (LINE - 1), s = src & (LINE - 1);
    return d > s && d - s < LINE / 2;
}

#if defined(__x86_64__)
#include <emmintrin.h>
static inline void line_copy(uint8_t *d, const uint8_t *s, size_t n) {
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (head > n) head = n;
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    for (; n >= 64; n -= 64, d += 64, s += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32)), e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_store_si128((__m128i *)d, a);
        _mm_store_si128((__m128i *)(d + 16), b);
        _mm_store_si128((__m128i *)(d + 32), c);
        _mm_store_si128((__m128i *)(d + 48), e);
    }
    memcpy(d, s, n);
}
#else
#define line_copy memcpy
#endif

/* memcpy, but not by `rep movsb` where that is slow. */
static inline void copy_out(void *dst, const void *src, size_t n) {
    if (n >= LINE_COPY_MIN && slow_copy((uintptr_t)dst, (uintptr_t)src))
        line_copy((uint8_t *)dst, (const uint8_t *)src, n);
    else
        memcpy(dst, src, n);
}

#endif
