// g++ -O3 -march=x86-64-v4 repro.cpp && ./a.out
// Torch-free copy of ATen's transpose_mxn<BFloat16>(src, ld_src, dst, ld_dst, M, N) from
// ATen/cpu/vec/vec512/vec512_bfloat16.h (16-bit lanes as uint16_t), called the way inductor's kernel calls it.
#include <immintrin.h>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>

static inline void tr32(__m512i r[], __m512i d[]) {  // = _transpose_mxn_half_32_32
  for (int i = 0; i < 16; ++i) {
    d[i * 2] = _mm512_unpacklo_epi16(r[i * 2], r[i * 2 + 1]);
    d[i * 2 + 1] = _mm512_unpackhi_epi16(r[i * 2], r[i * 2 + 1]);
  }
  for (int i = 0; i < 8; ++i) {
    r[i * 4] = _mm512_unpacklo_epi32(d[i * 4], d[i * 4 + 2]);
    r[i * 4 + 1] = _mm512_unpackhi_epi32(d[i * 4], d[i * 4 + 2]);
    r[i * 4 + 2] = _mm512_unpacklo_epi32(d[i * 4 + 1], d[i * 4 + 3]);
    r[i * 4 + 3] = _mm512_unpackhi_epi32(d[i * 4 + 1], d[i * 4 + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    d[i * 8] = _mm512_unpacklo_epi64(r[i * 8], r[i * 8 + 4]);
    d[i * 8 + 1] = _mm512_unpackhi_epi64(r[i * 8], r[i * 8 + 4]);
    d[i * 8 + 2] = _mm512_unpacklo_epi64(r[i * 8 + 1], r[i * 8 + 5]);
    d[i * 8 + 3] = _mm512_unpackhi_epi64(r[i * 8 + 1], r[i * 8 + 5]);
    d[i * 8 + 4] = _mm512_unpacklo_epi64(r[i * 8 + 2], r[i * 8 + 6]);
    d[i * 8 + 5] = _mm512_unpackhi_epi64(r[i * 8 + 2], r[i * 8 + 6]);
    d[i * 8 + 6] = _mm512_unpacklo_epi64(r[i * 8 + 3], r[i * 8 + 7]);
    d[i * 8 + 7] = _mm512_unpackhi_epi64(r[i * 8 + 3], r[i * 8 + 7]);
  }
  __m512i c1 = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0);
  __m512i c2 = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_permutex2var_epi64(d[i], c1, d[i + 8]);
    r[i + 8] = _mm512_permutex2var_epi64(d[i], c2, d[i + 8]);
    r[i + 16] = _mm512_permutex2var_epi64(d[i + 16], c1, d[i + 24]);
    r[i + 24] = _mm512_permutex2var_epi64(d[i + 16], c2, d[i + 24]);
  }
  __m512i c3 = _mm512_set_epi64(11, 10, 9, 8, 3, 2, 1, 0);
  __m512i c4 = _mm512_set_epi64(15, 14, 13, 12, 7, 6, 5, 4);
  for (int i = 0; i < 16; ++i) {
    d[i] = _mm512_permutex2var_epi64(r[i], c3, r[i + 16]);
    d[i + 16] = _mm512_permutex2var_epi64(r[i], c4, r[i + 16]);
  }
}

// 32x32 transpose of 16-bit elements; M, N are runtime (always 32 here).
inline void transpose(const uint16_t* src, int64_t ld_src, uint16_t* dst, int64_t ld_dst, int M, int N) {
  if (!(M <= 32 && N <= 32)) throw std::runtime_error("M, N <= 32");  // TORCH_CHECK, STANDALONE_TORCH_HEADER form
  __m512i r[32];
  int i;
  if (N == 32) {
    for (i = 0; i < M; ++i) r[i] = _mm512_loadu_si512(&src[i * ld_src]);
  } else {
    __mmask32 m = (1u << N) - 1;
    for (i = 0; i < M; ++i) r[i] = _mm512_maskz_loadu_epi16(m, &src[i * ld_src]);
  }
  for (; i < 32; ++i) r[i] = _mm512_setzero_si512();
  __m512i d[32];
  tr32(r, d);
  if (M == 32) {
    for (i = 0; i < N; ++i) _mm512_storeu_si512(&dst[i * ld_dst], d[i]);
  } else {
    __mmask32 m = (1u << M) - 1;
    for (i = 0; i < N; ++i) _mm512_mask_storeu_epi16(&dst[i * ld_dst], m, d[i]);
  }
}

// out_b = in[b].T for b = 0, 1   (in: 2 x 128 x 512 uint16, out: 512 x 128)
__attribute__((noinline)) void kernel(const uint16_t* in, uint16_t* out0, uint16_t* out1) {
  for (int64_t x0 = 0; x0 < 512; x0 += 32)
    for (int64_t x1 = 0; x1 < 128; x1 += 32) {
      alignas(32) uint16_t tmp[32 * 32];
      transpose(in + x0 + 512 * x1, 512, tmp, 32, 32, 32);
      for (int64_t k = 0; k < 32; k++)
        _mm512_storeu_si512(out0 + x1 + 128 * (x0 + k), _mm512_loadu_si512(tmp + 32 * k));
    }
  for (int64_t x0 = 0; x0 < 512; x0 += 32)
    for (int64_t x1 = 0; x1 < 128; x1 += 32) {
      alignas(32) uint16_t tmp[32 * 32];
      transpose(in + 65536 + x0 + 512 * x1, 512, tmp, 32, 32, 32);
      for (int64_t k = 0; k < 32; k++)
        _mm512_storeu_si512(out1 + x1 + 128 * (x0 + k), _mm512_loadu_si512(tmp + 32 * k));
    }
}

static uint16_t x[2 * 128 * 512], o[2][512 * 128];
int main() {
  for (int k = 0; k < 2 * 128 * 512; k++) x[k] = uint16_t(k * 7 + 1);
  kernel(x, o[0], o[1]);
  long bad = 0;
  for (int b = 0; b < 2; b++)
    for (int r = 0; r < 512; r++)
      for (int c = 0; c < 128; c++) bad += o[b][r * 128 + c] != x[b * 65536 + c * 512 + r];
  std::printf("%ld of %d elements wrong\n", bad, 2 * 512 * 128);
  return bad != 0;
}
