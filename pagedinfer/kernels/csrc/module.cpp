// Python bindings of pagedinfer's CPU kernels (one extension module, built by kernels/cpu.py).
#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache,
                                     torch::Tensor value_cache, torch::Tensor block_table,
                                     torch::Tensor seq_lens, double scale, int64_t sliding_window,
                                     double soft_cap);
torch::Tensor paged_decode_step(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor key,
                                torch::Tensor value, torch::Tensor slot_mapping,
                                torch::Tensor block_table, torch::Tensor seq_lens, double scale,
                                int64_t sliding_window, double soft_cap);
void paged_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                     torch::Tensor value_cache, torch::Tensor block_table, torch::Tensor q_start,
                     torch::Tensor q_end, torch::Tensor seq_lens, double scale,
                     int64_t sliding_window, double soft_cap);
void write_kv(torch::Tensor kv_cache, torch::Tensor key, torch::Tensor value, torch::Tensor slot_mapping);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor gelu_tanh_and_mul(torch::Tensor x);
void rotary_embedding(torch::Tensor x, torch::Tensor positions, torch::Tensor cos,
                      torch::Tensor sin, int64_t num_heads, int64_t head_dim);
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor packed, int64_t format,
                           int64_t out_features, bool int8_activations);
bool quant_linear_uses_int8_activations();
torch::Tensor kquant_linear(torch::Tensor x, torch::Tensor packed, int64_t format,
                            int64_t out_features, bool int8_activations);
bool kquant_linear_uses_int8_activations();
int64_t kquant_record_bytes(int64_t format);
torch::Tensor argmax_rows(torch::Tensor x);
bool prefill_attention_available();
void paged_prefill_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                             torch::Tensor value_cache, torch::Tensor block_table,
                             torch::Tensor q_start, torch::Tensor q_end, torch::Tensor seq_lens,
                             double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Paged decode attention (CPU); sliding_window and soft_cap: 0 = off");
  m.def("paged_decode_step", &paged_decode_step,
        "Write the new K/V rows into their slots, then paged decode attention (every row a decode)");
  m.def("paged_attention", &paged_attention,
        "Causal attention of query rows over their request's paged context, into out "
        "(prefills, chunks and decodes; float or int8 cache)");
  m.def("write_kv", &write_kv,
        "Write K/V rows into their cache slots (quantised for an int8 cache)");
  m.def("rms_norm", &rms_norm, "RMSNorm, float32 inside, one rounding");
  m.def("fused_add_rms_norm", &fused_add_rms_norm,
        "In place: residual = x + residual; x = rms_norm(residual)");
  m.def("silu_and_mul", &silu_and_mul, "[rows, 2d] -> silu(gate) * up");
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "[rows, 2d] -> gelu_tanh(gate) * up");
  m.def("rotary_embedding", &rotary_embedding, "In-place rotate-half RoPE on the first heads");
  m.def("quant_linear", &quant_linear, "x @ W.T, W in packed Q4/Q8 blocks (model/quant.py)");
  m.def("quant_linear_uses_int8_activations", &quant_linear_uses_int8_activations,
        "Whether quant_linear has an int8-activation path here (AVX512-VNNI or AVX2)");
  m.def("kquant_linear", &kquant_linear,
        "x @ W.T, W in packed Q5_0/Q4_K/Q5_K/Q6_K planes (model/quant.py); format: GGUF type id");
  m.def("kquant_linear_uses_int8_activations", &kquant_linear_uses_int8_activations,
        "Whether kquant_linear has an int8-activation path here (AVX2)");
  m.def("kquant_record_bytes", &kquant_record_bytes,
        "Bytes of one (16 features, super-block) record of a K-quant format");
  m.def("prefill_attention_available", &prefill_attention_available,
        "Whether paged_prefill_attention can run here (AMX-BF16 built in and permitted)");
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "Causal attention of prefill rows over their paged context, AMX bf16 (writes out)");
  m.def("argmax_rows", &argmax_rows, "Row-wise argmax, torch's semantics (first max, NaN wins)");
}
