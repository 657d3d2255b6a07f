// Paged decode attention for CPU: one query token per request, reading K/V straight from
// the paged cache through the block table (no gathered copy of the context).
//
// Layout: key_cache / value_cache [num_blocks, block_size, num_kv_heads, head_dim];
// query [num_reqs, num_heads, head_dim]; block_table [num_reqs, max_blocks] int32;
// seq_lens [num_reqs] int32. Returns [num_reqs, num_heads, head_dim] in the query's dtype.
// Work is split over (request, kv head) pairs; each pair handles its group of query heads
// (GQA), with scores and accumulation in float32. Reference: attention/torch_ref.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename scalar_t>
void decode_kernel(const scalar_t* __restrict__ query, const scalar_t* __restrict__ key_cache,
                   const scalar_t* __restrict__ value_cache, const int32_t* __restrict__ block_table,
                   const int32_t* __restrict__ seq_lens, scalar_t* __restrict__ out,
                   int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  at::parallel_for(0, num_reqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_dim);
    std::vector<float> acc(group * head_dim);
    std::vector<float> scores;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t r = work / num_kv_heads;
      const int64_t kvh = work % num_kv_heads;
      const int64_t seq_len = seq_lens[r];
      const int32_t* table = block_table + r * max_blocks;
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* src = query + (r * num_heads + kvh * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) q[g * head_dim + d] = static_cast<float>(src[d]) * scale;
      }
      scores.assign(group * seq_len, 0.f);
      // Pass 1: scores = q . k for every cached position.
      for (int64_t t = 0; t < seq_len; ++t) {
        const int64_t slot = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
        const scalar_t* k = key_cache + (slot * num_kv_heads + kvh) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = q.data() + g * head_dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * static_cast<float>(k[d]);
          scores[g * seq_len + t] = s;
        }
      }
      // Softmax per query head.
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * seq_len;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < seq_len; ++t) m = sg[t] > m ? sg[t] : m;
        float sum = 0.f;
        // Vectorised exp (libmvec) needs -fno-math-errno; see kernels/paged_attention.py.
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < seq_len; ++t) {
          sg[t] = expf(sg[t] - m);
          sum += sg[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < seq_len; ++t) sg[t] *= inv;
      }
      // Pass 2: out = sum_t p_t * v_t.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < seq_len; ++t) {
        const int64_t slot = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
        const scalar_t* v = value_cache + (slot * num_kv_heads + kvh) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * seq_len + t];
          float* ag = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * static_cast<float>(v[d]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* dst = out + (r * num_heads + kvh * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[g * head_dim + d]);
      }
    }
  });
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache,
                                     torch::Tensor value_cache, torch::Tensor block_table,
                                     torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "inputs must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_table and seq_lens must be int32");
  auto table = block_table.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t num_reqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  auto out = torch::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(query.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(),
                            value_cache.data_ptr<scalar_t>(), table.data_ptr<int32_t>(),
                            lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), num_reqs, num_heads,
                            num_kv_heads, head_dim, block_size, table.size(1),
                            static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU)");
}
