// Every op bindings.cpp registers, and the ops' bodies over a range of rows that layer_stack.cpp shares.
// The bodies are noinline and compiled once: the per-op path and the layer stack run the same machine code,
// so a row's bits cannot depend on which of them ran it.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "barrier.h"

// ---- ops (one file each) ----
void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void rope(at::Tensor q, at::Tensor k, at::Tensor positions, at::Tensor cos, at::Tensor sin);
void write_kv(at::Tensor key, at::Tensor value, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping);
void silu_and_mul(at::Tensor out, at::Tensor x);
void paged_attention(at::Tensor out, at::Tensor query, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                     at::Tensor seq_lens, double scale, int64_t window);
void linear(at::Tensor out, at::Tensor x, at::Tensor packed, std::optional<at::Tensor> bias,
            int64_t min_macs_per_thread);
void argmax_rows(at::Tensor out, at::Tensor logits);
void gumbel_noise(at::Tensor out, at::Tensor keys, at::Tensor hashed);
bool gumbel_vector_logs();  // whether the noise's logs are SLEEF's vectors (else a scalar call per lane)
void gumbel_argmax(at::Tensor out, at::Tensor logits, at::Tensor temperature, at::Tensor keys, at::Tensor hashed,
                   std::optional<at::Tensor> floor);
at::Tensor gguf_pack(at::Tensor raw, int64_t qtype, int64_t N, int64_t K);
void gguf_linear(at::Tensor out, at::Tensor x, at::Tensor packed, int64_t qtype, int64_t N, int64_t K,
                 std::optional<at::Tensor> bias, int64_t min_macs_per_thread);
void gguf_embedding_rows(at::Tensor out, at::Tensor ids, at::Tensor packed, int64_t qtype, int64_t N, int64_t K);
bool supports_f32();
bool supports_bf16();
bool amx_for(int64_t K);
void lora_apply(at::Tensor out, at::Tensor x, at::Tensor a, at::Tensor b, at::Tensor offsets, at::Tensor token_slots,
                int64_t min_macs_per_thread);
at::Tensor moe_pack(at::Tensor w, bool gate_up);
void fused_moe(at::Tensor out, at::Tensor x, at::Tensor w13, at::Tensor w2, at::Tensor topk_weights,
               at::Tensor topk_ids, int64_t min_macs_per_thread);
// CPU tensor-parallel collectives over a shared-memory segment (shm.h): x summed over the ranks in place; x
// gathered into rank 0's out [size, ...] (None on the other ranks).
void shm_all_reduce(at::Tensor x, at::Tensor flags, at::Tensor slots, int64_t rank, double timeout_s);
void shm_gather(std::optional<at::Tensor> out, at::Tensor x, at::Tensor flags, at::Tensor slots, int64_t rank,
                double timeout_s);
void moe_route(at::Tensor topk_weights, at::Tensor topk_ids, at::Tensor x, at::Tensor weight, bool renormalize,
               int64_t min_macs_per_thread);
void llama_forward(at::Tensor out, at::Tensor h, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                   at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor seq_lens,
                   std::vector<at::Tensor> weights, std::vector<at::Tensor> kv_caches, at::Tensor final_norm,
                   int64_t Hq, int64_t Hkv, int64_t D, int64_t I, double eps, double qk_eps, double scale,
                   std::vector<at::Tensor> segments, at::Tensor segment_table, std::vector<at::Tensor> lora,
                   at::Tensor token_slots, std::vector<at::Tensor> moe, int64_t top_k, bool renormalize);

// ---- bodies over rows begin..end; inputs already checked (nothing here throws) ----
template <typename T>
void rms_norm_rows(T* out, int64_t os, T* x, int64_t xs, T* res, int64_t rs, const T* w, int64_t H, float eps,
                   int64_t begin, int64_t end);
template <typename T>
void rope_rows(T* q, int64_t qs, int64_t Hq, T* k, int64_t ks, int64_t Hkv, int64_t D, const int64_t* pos,
               const float* cp, const float* sp, int64_t begin, int64_t end);
void write_kv_rows(char* kc, char* vc, const char* kp, int64_t ks, const char* vp, int64_t vs, const int64_t* slots,
                   int64_t row_bytes, int64_t begin, int64_t end);
template <typename T>
void silu_and_mul_rows(T* op, int64_t os, const T* xp, int64_t xs, int64_t I, int64_t begin, int64_t end);

// One linear's adapter slots (models/lora.py's LoRASlots), stored transposed: A^T fp32 [S, L, K, R], B^T fp32
// [L, R, N] with the scale folded in, R a multiple of 16; slice s owns outputs offsets[s]..offsets[s + 1].
struct LoraWeights {
  const float* a;
  const float* b;
  const int64_t* offsets;
  int64_t S, L, R, K, N;
};
constexpr int64_t MAX_LORA_RANK = 512;  // vLLM's largest max_lora_rank: a row's shrink result stays on the stack
// out's rows begin..end += their adapter's delta (slots[row] >= 0; -1 rows untouched): lora_apply's body.
template <typename T>
void lora_rows(T* out, int64_t os, const T* x, int64_t xs, const LoraWeights& w, const int32_t* slots, int64_t begin,
               int64_t end);
// The checked view of a linear's slots for x [T, K] -> out [T, N], and each row's slot in -1..L-1 (these throw).
LoraWeights lora_weights(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets, int64_t K, int64_t N);
void check_lora_slots(const at::Tensor& token_slots, int64_t T, int64_t L);

// Mixture-of-Experts. The router over rows begin..end: each row's top-k weights (fp32) and experts (moe_route's body;
// scratch: H + E floats).
template <typename T>
void moe_route_rows(const T* x, int64_t xs, const T* w, int64_t E, int64_t H, int64_t k, bool renormalize,
                    float* weights, int32_t* ids, float* scratch, int64_t begin, int64_t end);
// A layer's moe_pack'ed experts: E experts of width I over H, in P1 gate/up and P2 down panels; a pair's scratch
// is Ip floats of activations and Hp of weighted outputs.
struct MoeShape {
  int64_t E, H, I, P1, P2, Ip, Hp;
};
MoeShape moe_shape(const at::Tensor& w13, const at::Tensor& w2, int64_t H, at::ScalarType dt);  // checks; throws
struct MoeTasks {  // the next unclaimed task of each pass: fresh for each call
  std::atomic<int64_t> gate_up{0}, down{0};
};
// fused_moe's body, called by every thread of a parallel region with the same arguments: tokens x (fp32 [tokens,
// xs]) through their k experts (ids, topk_weights [tokens, k]), act [tokens * k, Ip] and weighted [tokens * k, Hp]
// fp32 scratch. Thread tid writes out's rows tokens * tid / nt .. tokens * (tid + 1) / nt, the only rows it may read
// after the call without a barrier.
template <typename T>
void moe_experts_region(const MoeShape& s, const float* x, int64_t xs, const T* w13, const T* w2,
                        const float* topk_weights, const int32_t* ids, int64_t tokens, int64_t k, float* act,
                        float* weighted, T* out, int64_t os, MoeTasks& tasks, SpinBarrier& bar, int tid, int nt);

void check_positions(const int64_t* pos, int64_t n, int64_t max_pos);
void check_slots(const int64_t* slots, int64_t n, int64_t num_slots);

// Paged attention: each query row has its own block table row and context length.
template <typename scalar_t>
struct AttentionArgs {
  scalar_t* out;
  int64_t o_stride;
  const scalar_t* query;
  int64_t q_stride;
  const scalar_t* k_cache;
  const scalar_t* v_cache;
  int64_t bs, Hkv, Hq, D;
  const int32_t* tables;
  int64_t table_stride;
  const int32_t* lens;
  const int64_t* tiles;  // [num_tiles + 1]: the first row of each tile (attention_tiles), then the row count
  int64_t num_tiles;
  float scale;
  int64_t splits;  // tasks per tile: KV-head ranges; a task's bits do not depend on how heads are split
  int64_t window;  // sliding window: a row of length L sees keys L - window..L - 1; 0 = its whole context
};

constexpr int64_t MAX_TILE_ROWS = 16;  // rows of one sequence that share each K/V block's reads

// Enough tasks for every thread when there are few tiles (batch 1: heads split across threads).
static inline int64_t attention_splits(int64_t Hkv, int64_t tiles, int64_t threads) {
  return std::min<int64_t>(Hkv, std::max<int64_t>(1, (2 * threads + tiles - 1) / tiles));
}

// The tiles of B rows (their first rows, then B); a row's bits do not depend on its tile.
std::vector<int64_t> attention_tiles(const int32_t* tables, int64_t table_stride, const int32_t* lens, int64_t B,
                                     int64_t bs);

// Tasks begin..end of num_tiles * splits (tile, KV-head range).
template <typename scalar_t>
void attention_tasks_any(const AttentionArgs<scalar_t>& a, int64_t begin, int64_t end);
