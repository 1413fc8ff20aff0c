// The Llama layer stack as one call a step: every op of every layer inside one parallel region, the threads
// woken once a step and meeting at a barrier between ops (llama.cpp's design). The ops are the per-op path's
// own row and task functions (ops.h, gemm.h): a step gives the same bits either way. A layer's MLP is either
// dense (SwiGLU on our GEMM) or a Mixture-of-Experts block (the router, then the grouped expert GEMM).
#include <omp.h>

#include <atomic>
#include <type_traits>
#include <vector>

#include "common.h"
#include "gemm.h"
#include "gguf_gemm.h"
#include "ops.h"

static inline void share(int64_t n, int tid, int nt, int64_t& b, int64_t& e) {
  b = n * tid / nt;
  e = n * (tid + 1) / nt;
}

template <typename G>
struct Gemm {
  const G* w;
  const G* bias;
  int64_t N, K;
};

constexpr int WEIGHTS_PER_LAYER = 12;  // in_ln, qkv, qkv_b, q_norm, k_norm, o, o_b, post_ln, gu, gu_b, down, down_b
constexpr int GEMMS_PER_LAYER = 4;     // qkv, o, gate_up, down

// A GGUF-quantized GEMM's outputs start..start+N, computed on a packed GGUF weight (gguf_gemm.h); a GEMM
// whose slot holds no packed panels is a list of these (parts of different block types: one each).
struct QuantSegment {
  const uint8_t* w;
  int64_t qtype, start, N;
};

template <typename S>
struct MoeLayer {
  const S *router, *w13, *w2;
};

// S: the ops' element type (float, c10::BFloat16); G: the GEMM's (float, uint16_t), the same bits.
template <typename S, typename G>
struct Step {
  int64_t T, H, Hq, Hkv, D, I, L;
  float eps, qk_eps;
  const int64_t* pos;
  const float *cos, *sin;
  const int64_t* slots;
  AttentionArgs<S> attn;  // per layer: caches, query and out filled in
  const S* final_norm;
  std::vector<const void*> w;                    // L * WEIGHTS_PER_LAYER (nullptr where absent)
  std::vector<std::vector<QuantSegment>> quant;  // L * GEMMS_PER_LAYER: empty where the slot is packed panels
  std::vector<LoraWeights> lora;                 // L * GEMMS_PER_LAYER: a == nullptr where a GEMM has no adapters
  const int32_t* lora_slots;                     // [T]: each row's adapter slot, -1 for none; nullptr: no adapter row
  std::vector<S*> k_caches, v_caches;
  S *h, *x, *qkv, *att, *gu, *act, *dn;
  std::atomic<int64_t>* attn_next;  // [L]: the next unclaimed attention task of each layer
  SpinBarrier bar;
  // Mixture-of-Experts layers: their router [E, H] and moe_pack'ed experts (router nullptr: a dense MLP)
  std::vector<MoeLayer<S>> moe;
  MoeShape moe_shape{};
  int64_t top_k = 0;
  bool renormalize = false;
  float *topk_weights = nullptr, *route_scratch = nullptr, *xf = nullptr;  // xf: bf16 rows widened (none in fp32)
  float *moe_act = nullptr, *moe_weighted = nullptr;
  int32_t* topk_ids = nullptr;
  MoeTasks* moe_tasks = nullptr;  // [L]

  // The MoE block on x's rows (the post-attention norm's) into dn: each thread routes its own rows, then every
  // thread takes tasks of the grouped GEMM; the k-way sum leaves each thread its rows rb..re of dn.
  void moe_mlp(int64_t l, int tid, int nt, int64_t rb, int64_t re) {
    const MoeLayer<S>& m = moe[l];
    const int64_t E = moe_shape.E;
    moe_route_rows<S>(x, H, m.router, E, H, top_k, renormalize, topk_weights, topk_ids, route_scratch + tid * (H + E),
                      rb, re);
    const float* xin;
    if constexpr (std::is_same_v<S, float>) {
      xin = x;
    } else {
      for (int64_t i = rb * H; i < re * H; ++i) xf[i] = to_f(x[i]);
      xin = xf;
    }
    bar.wait(nt);
    moe_experts_region<S>(moe_shape, xin, H, m.w13, m.w2, topk_weights, topk_ids, T, top_k, moe_act, moe_weighted, dn,
                          H, moe_tasks[l], bar, tid, nt);
  }

  void gemm(int64_t l, int g, const S* in, int64_t M, const void* w_, const void* b_, int64_t N, int64_t K, S* out,
            int tid, int nt) {
    int64_t b, e;
    const std::vector<QuantSegment>& segs = quant[l * GEMMS_PER_LAYER + g];
    if (!segs.empty()) {  // each thread its share of every segment's tasks: disjoint columns, no barrier between
      for (const QuantSegment& s : segs) {
        share(gemm_tasks(M, s.N), tid, nt, b, e);
        gguf_gemm_range<G>(reinterpret_cast<const G*>(in), K, s.w, s.qtype, M, s.N, K,
                           reinterpret_cast<G*>(out) + s.start, N, b_ ? static_cast<const G*>(b_) + s.start : nullptr,
                           b, e);
      }
      return;
    }
    share(gemm_tasks(M, N), tid, nt, b, e);
    gemm_range<G>(reinterpret_cast<const G*>(in), K, static_cast<const G*>(w_), M, N, K, reinterpret_cast<G*>(out), N,
                  static_cast<const G*>(b_), b, e);
  }

  // The adapters' deltas on this thread's rows of GEMM g's output, after the barrier that ends the GEMM: the
  // per-op lora_apply's row function. The op that follows reads only these rows, so no barrier is needed before it.
  void add_lora(int64_t l, int g, const S* in, int64_t ldi, S* out, int64_t ldo, int64_t rb, int64_t re) {
    const LoraWeights& lw = lora[l * GEMMS_PER_LAYER + g];
    if (lora_slots != nullptr && lw.a != nullptr) lora_rows<S>(out, ldo, in, ldi, lw, lora_slots, rb, re);
  }

  void run(int tid, int nt) {
    const int64_t Nqkv = (Hq + 2 * Hkv) * D;
    int64_t rb, re;  // this thread's rows
    share(T, tid, nt, rb, re);
    S* res = h;  // the embeddings become the residual stream, as in LlamaForCausalLM.forward
    for (int64_t l = 0; l < L; ++l) {
      const void* const* lw = w.data() + l * WEIGHTS_PER_LAYER;
      S* xin;
      if (l == 0) {
        rms_norm_rows<S>(x, H, h, H, nullptr, 0, static_cast<const S*>(lw[0]), H, eps, rb, re);
        xin = x;
      } else {
        rms_norm_rows<S>(dn, H, dn, H, res, H, static_cast<const S*>(lw[0]), H, eps, rb, re);
        xin = dn;
      }
      bar.wait(nt);
      gemm(l, 0, xin, T, lw[1], lw[2], Nqkv, H, qkv, tid, nt);
      bar.wait(nt);
      add_lora(l, 0, xin, H, qkv, Nqkv, rb, re);
      if (lw[3] != nullptr) {  // Qwen3: RMSNorm over each head of q and k
        for (int64_t t = rb; t < re; ++t) {
          S* q = qkv + t * Nqkv;
          rms_norm_rows<S>(q, D, q, D, nullptr, 0, static_cast<const S*>(lw[3]), D, qk_eps, 0, Hq);
          rms_norm_rows<S>(q + Hq * D, D, q + Hq * D, D, nullptr, 0, static_cast<const S*>(lw[4]), D, qk_eps, 0, Hkv);
        }
      }
      rope_rows<S>(qkv, Nqkv, Hq, qkv + Hq * D, Nqkv, Hkv, D, pos, cos, sin, rb, re);
      write_kv_rows(reinterpret_cast<char*>(k_caches[l]), reinterpret_cast<char*>(v_caches[l]),
                    reinterpret_cast<const char*>(qkv + Hq * D), Nqkv * sizeof(S),
                    reinterpret_cast<const char*>(qkv + (Hq + Hkv) * D), Nqkv * sizeof(S), slots, Hkv * D * sizeof(S),
                    rb, re);
      bar.wait(nt);
      AttentionArgs<S> a = attn;
      a.k_cache = k_caches[l];
      a.v_cache = v_caches[l];
      // Claimed a few at a time from the end: rows differ in length, so fixed shares would leave a thread
      // waiting, and a prompt's last tiles (the longest contexts) go first, the short ones fill in at the end.
      const int64_t tasks = a.num_tiles * a.splits, chunk = std::max<int64_t>(1, tasks / (32 * nt));
      for (int64_t c; (c = attn_next[l].fetch_add(chunk, std::memory_order_relaxed)) < tasks;)
        attention_tasks_any<S>(a, std::max<int64_t>(0, tasks - c - chunk), tasks - c);
      bar.wait(nt);
      gemm(l, 1, att, T, lw[5], lw[6], H, Hq * D, x, tid, nt);
      bar.wait(nt);
      add_lora(l, 1, att, Hq * D, x, H, rb, re);
      rms_norm_rows<S>(x, H, x, H, res, H, static_cast<const S*>(lw[7]), H, eps, rb, re);
      if (moe[l].router != nullptr) {  // the next layer's norm reads only this thread's rows of dn
        moe_mlp(l, tid, nt, rb, re);
        continue;
      }
      bar.wait(nt);
      gemm(l, 2, x, T, lw[8], lw[9], 2 * I, H, gu, tid, nt);
      bar.wait(nt);
      add_lora(l, 2, x, H, gu, 2 * I, rb, re);
      silu_and_mul_rows<S>(act, I, gu, 2 * I, I, rb, re);
      bar.wait(nt);
      gemm(l, 3, act, T, lw[10], lw[11], H, I, dn, tid, nt);
      bar.wait(nt);
      add_lora(l, 3, act, I, dn, H, rb, re);  // the next layer's norm (or the final one) reads these rows
    }
    rms_norm_rows<S>(dn, H, dn, H, res, H, final_norm, H, eps, rb, re);
  }
};

template <typename S, typename G>
static void forward_impl(at::Tensor out, at::Tensor h, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                         at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor seq_lens,
                         const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& kv_caches,
                         const std::vector<std::vector<QuantSegment>>& quant, at::Tensor final_norm, int64_t Hq,
                         int64_t Hkv, int64_t D, int64_t I, double eps, double qk_eps, double scale,
                         const std::vector<LoraWeights>& lora, const int32_t* lora_slots,
                         const std::vector<at::Tensor>& moe, const MoeShape& moe_shape, int64_t top_k,
                         bool renormalize) {
  const int64_t T = h.size(0), H = h.size(1), L = (int64_t)kv_caches.size() / 2;
  const auto opt = h.options();
  at::Tensor x = at::empty({T, H}, opt), qkv = at::empty({T, (Hq + 2 * Hkv) * D}, opt);
  at::Tensor att = at::empty({T, Hq * D}, opt), gu = at::empty({T, 2 * I}, opt), act = at::empty({T, I}, opt);
  Step<S, G> st;
  st.T = T, st.H = H, st.Hq = Hq, st.Hkv = Hkv, st.D = D, st.I = I, st.L = L;
  st.eps = float(eps), st.qk_eps = float(qk_eps);
  st.pos = positions.data_ptr<int64_t>();
  st.cos = cos.data_ptr<float>(), st.sin = sin.data_ptr<float>();
  st.slots = slot_mapping.data_ptr<int64_t>();
  st.final_norm = final_norm.data_ptr<S>();
  for (const at::Tensor& t : weights) st.w.push_back(t.numel() ? t.data_ptr() : nullptr);
  st.quant = quant;
  st.lora = lora;
  st.lora_slots = lora_slots;
  for (int64_t l = 0; l < L; ++l) {
    st.k_caches.push_back(kv_caches[2 * l].data_ptr<S>());
    st.v_caches.push_back(kv_caches[2 * l + 1].data_ptr<S>());
  }
  st.h = h.data_ptr<S>(), st.x = x.data_ptr<S>(), st.qkv = qkv.data_ptr<S>(), st.att = att.data_ptr<S>();
  st.gu = gu.data_ptr<S>(), st.act = act.data_ptr<S>(), st.dn = out.data_ptr<S>();
  const at::Tensor& kc = kv_caches[0];
  const int nt = std::max(1, at::get_num_threads());
  // MoE: the routing of the step's rows and the grouped GEMM's scratch, shared by the MoE layers in turn (a dense
  // model allocates none of it)
  at::Tensor topk_w, topk_ids, route, xf, moe_act, moe_weighted;
  std::vector<MoeTasks> moe_tasks(moe.empty() ? 0 : L);
  st.moe.assign(L, MoeLayer<S>{nullptr, nullptr, nullptr});
  if (!moe.empty()) {
    const int64_t E = moe_shape.E, pairs = top_k * T;
    const auto f32 = opt.dtype(at::kFloat);
    topk_w = at::empty({pairs}, f32), topk_ids = at::empty({pairs}, opt.dtype(at::kInt));
    route = at::empty({nt * (H + E)}, f32), xf = at::empty({std::is_same_v<S, float> ? 0 : T * H}, f32);
    moe_act = at::empty({pairs * moe_shape.Ip}, f32), moe_weighted = at::empty({pairs * moe_shape.Hp}, f32);
    for (int64_t l = 0; l < L; ++l) {
      const at::Tensor* m = moe.data() + 3 * l;
      if (m[0].numel()) st.moe[l] = MoeLayer<S>{m[0].data_ptr<S>(), m[1].data_ptr<S>(), m[2].data_ptr<S>()};
    }
    st.moe_shape = moe_shape, st.top_k = top_k, st.renormalize = renormalize;
    st.topk_weights = topk_w.data_ptr<float>(), st.topk_ids = topk_ids.data_ptr<int32_t>();
    st.route_scratch = route.data_ptr<float>(), st.xf = xf.numel() ? xf.data_ptr<float>() : nullptr;
    st.moe_act = moe_act.data_ptr<float>(), st.moe_weighted = moe_weighted.data_ptr<float>();
    st.moe_tasks = moe_tasks.data();
  }
  const std::vector<int64_t> tiles = attention_tiles(block_tables.data_ptr<int32_t>(), block_tables.stride(0),
                                                     seq_lens.data_ptr<int32_t>(), T, kc.size(1));
  const int64_t num_tiles = (int64_t)tiles.size() - 1;
  st.attn = AttentionArgs<S>{att.data_ptr<S>(),
                             Hq * D,
                             qkv.data_ptr<S>(),
                             (Hq + 2 * Hkv) * D,
                             nullptr,
                             nullptr,
                             kc.size(1),
                             Hkv,
                             Hq,
                             D,
                             block_tables.data_ptr<int32_t>(),
                             block_tables.stride(0),
                             seq_lens.data_ptr<int32_t>(),
                             tiles.data(),
                             num_tiles,
                             static_cast<float>(scale),
                             attention_splits(Hkv, num_tiles, nt),
                             0};  // no sliding window: CpuForward.supported() refuses models with one
  std::vector<std::atomic<int64_t>> next(L);
  for (auto& n : next) n.store(0);
  st.attn_next = next.data();
  if (nt == 1) {
    st.run(0, 1);
    return;
  }
#pragma omp parallel num_threads(nt)
  st.run(omp_get_thread_num(), omp_get_num_threads());
}

// One forward of the layer stack: out [T, H] <- the final norm's output, from h [T, H] (the embeddings,
// used as scratch). Everything is checked here, before the parallel region: nothing inside it throws.
void llama_forward(at::Tensor out, at::Tensor h, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                   at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor seq_lens,
                   std::vector<at::Tensor> weights, std::vector<at::Tensor> kv_caches, at::Tensor final_norm,
                   int64_t Hq, int64_t Hkv, int64_t D, int64_t I, double eps, double qk_eps, double scale,
                   std::vector<at::Tensor> segments, at::Tensor segment_table, std::vector<at::Tensor> lora,
                   at::Tensor token_slots, std::vector<at::Tensor> moe, int64_t top_k, bool renormalize) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && out.is_contiguous() && out.sizes() == h.sizes() &&
                  out.scalar_type() == h.scalar_type(),
              "h, out: contiguous [T, H]");
  const int64_t T = h.size(0), H = h.size(1), L = (int64_t)kv_caches.size() / 2;
  const auto dt = h.scalar_type();
  TORCH_CHECK(L >= 1 && (int64_t)kv_caches.size() == 2 * L && (int64_t)weights.size() == L * WEIGHTS_PER_LAYER,
              "weights: 12 per layer, kv_caches: 2 per layer");
  TORCH_CHECK(D % 2 == 0 && D <= 512 && Hq % Hkv == 0, "D even and <= 512, Hq a multiple of Hkv");
  const int64_t Nqkv = (Hq + 2 * Hkv) * D;
  // (slot of the packed weight, N, K) per GEMM; norms are [width]; biases [N] or empty.
  const int64_t gemm_shapes[4][3] = {{1, Nqkv, H}, {5, H, Hq * D}, {8, 2 * I, H}, {10, H, I}};
  // GGUF segments: row s of the int64 table [S, 5] is (layer, gemm 0-3, qtype, start, N) of segments[s]; a
  // GEMM's segments come in column order and cover its outputs.
  std::vector<std::vector<QuantSegment>> quant(L * GEMMS_PER_LAYER);
  TORCH_CHECK(segment_table.scalar_type() == at::kLong && segment_table.is_contiguous() && segment_table.dim() == 2 &&
                  segment_table.size(1) == 5 && segment_table.size(0) == (int64_t)segments.size(),
              "segment_table: int64 [segments, 5]");
  const int64_t* st = segment_table.data_ptr<int64_t>();
  for (size_t s = 0; s < segments.size(); ++s) {
    const int64_t l = st[5 * s], g = st[5 * s + 1], qtype = st[5 * s + 2], start = st[5 * s + 3], n = st[5 * s + 4];
    TORCH_CHECK(l >= 0 && l < L && g >= 0 && g < GEMMS_PER_LAYER && gguf_known(qtype), "a bad GGUF segment");
    const int64_t N = gemm_shapes[g][1], K = gemm_shapes[g][2];
    auto& segs = quant[l * GEMMS_PER_LAYER + g];
    TORCH_CHECK(start == (segs.empty() ? 0 : segs.back().start + segs.back().N) && n > 0 && start + n <= N,
                "GGUF segments must tile their GEMM's outputs in order");
    TORCH_CHECK(K % gguf_block_size(qtype) == 0 && segments[s].scalar_type() == at::kByte &&
                    segments[s].is_contiguous() && segments[s].numel() == gguf_packed_bytes(qtype, n, K),
                "a GGUF segment does not match its layer's shape");
    TORCH_CHECK(dt != at::kBFloat16 || K % 2 == 0, "bf16 GEMMs need an even K");
    segs.push_back(QuantSegment{segments[s].data_ptr<uint8_t>(), qtype, start, n});
  }
  // MoE: (router [E, H], w13, w2 moe_pack'ed) per layer, three empty tensors for a dense layer (or no list at all);
  // every MoE layer of one shape.
  TORCH_CHECK(moe.empty() || (int64_t)moe.size() == 3 * L, "moe: 3 tensors per layer");
  MoeShape moe_s{0, H, 0, 0, 0, 0, 0};
  std::vector<bool> sparse(L, false);
  for (int64_t l = 0; l < L && !moe.empty(); ++l) {
    const at::Tensor* m = moe.data() + 3 * l;
    if (!m[0].numel()) continue;
    const MoeShape s = moe_shape(m[1], m[2], H, dt);
    TORCH_CHECK(moe_s.E == 0 || (s.E == moe_s.E && s.I == moe_s.I), "every MoE layer of one shape");
    TORCH_CHECK(
        m[0].dim() == 2 && m[0].is_contiguous() && m[0].scalar_type() == dt && m[0].size(0) == s.E && m[0].size(1) == H,
        "a router: [E, H] contiguous, h's dtype");
    TORCH_CHECK(top_k >= 1 && top_k <= s.E, "top_k: 1..E");
    moe_s = s;
    sparse[l] = true;
  }
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* lw = weights.data() + l * WEIGHTS_PER_LAYER;
    for (int i = 0; i < WEIGHTS_PER_LAYER; ++i)
      TORCH_CHECK(!lw[i].numel() || (lw[i].is_contiguous() && lw[i].scalar_type() == dt),
                  "weights: contiguous, h's dtype");
    for (int gi = 0; gi < GEMMS_PER_LAYER; ++gi) {
      const int64_t* g = gemm_shapes[gi];
      const auto& segs = quant[l * GEMMS_PER_LAYER + gi];
      if (sparse[l] && gi >= 2) {  // an MoE layer has no dense MLP
        TORCH_CHECK(segs.empty() && !lw[g[0]].numel() && !lw[g[0] + 1].numel(), "an MoE layer with a dense MLP");
        continue;
      }
      if (segs.empty()) {
        TORCH_CHECK(lw[g[0]].numel() == panel_elems(g[1], g[2]), "a packed weight does not match the model's shape");
      } else {
        TORCH_CHECK(!lw[g[0]].numel() && segs.back().start + segs.back().N == g[1],
                    "a GEMM is either packed panels or GGUF segments covering its outputs");
      }
      TORCH_CHECK(!lw[g[0] + 1].numel() || lw[g[0] + 1].numel() == g[1], "a bias does not match its layer");
      TORCH_CHECK(dt != at::kBFloat16 || g[2] % 2 == 0, "bf16 GEMMs need an even K");
    }
    TORCH_CHECK(lw[0].numel() == H && lw[7].numel() == H, "layer norms: [H]");
    TORCH_CHECK((lw[3].numel() == D && lw[4].numel() == D) || (!lw[3].numel() && !lw[4].numel()), "q/k norms: [D]");
    for (int c = 0; c < 2; ++c) {
      const at::Tensor& kv = kv_caches[2 * l + c];
      TORCH_CHECK(kv.is_contiguous() && kv.scalar_type() == dt && kv.dim() == 4 && kv.sizes() == kv_caches[0].sizes() &&
                      kv.size(2) == Hkv && kv.size(3) == D,
                  "kv caches: contiguous [blocks, block_size, Hkv, D]");
    }
  }
  TORCH_CHECK(final_norm.is_contiguous() && final_norm.numel() == H && final_norm.scalar_type() == dt, "norm: [H]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == T,
              "positions: int64 [T]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.sizes() == cos.sizes() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == D / 2,
              "cos, sin: float32 [max_pos, D/2]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == T,
              "slot_mapping: int64 [T]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.size(0) == T &&
                  block_tables.stride(1) == 1,
              "block_tables: int32 [T, W], rows contiguous");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() && seq_lens.numel() == T,
              "seq_lens: int32 [T]");
  const int64_t blocks = kv_caches[0].size(0), bs = kv_caches[0].size(1);
  check_positions(positions.data_ptr<int64_t>(), T, cos.size(0));
  check_slots(slot_mapping.data_ptr<int64_t>(), T, blocks * bs);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(lens[t] > 0 && lens[t] <= block_tables.size(1) * bs, "a context longer than its block table");
    for (int64_t j = 0; j < (lens[t] + bs - 1) / bs; ++j) {
      const int32_t blk = tables[t * block_tables.stride(0) + j];
      TORCH_CHECK(blk >= 0 && blk < blocks, "a block id outside the cache");
    }
  }
  // LoRA: (a, b, offsets) per layer and GEMM, three empty tensors where a GEMM has none (or no list at all);
  // an empty token_slots: no row has an adapter this step, and no LoRA work is done.
  TORCH_CHECK(lora.empty() || (int64_t)lora.size() == 3 * L * GEMMS_PER_LAYER, "lora: 3 tensors per layer and GEMM");
  std::vector<LoraWeights> lora_w(L * GEMMS_PER_LAYER, LoraWeights{nullptr, nullptr, nullptr, 0, 0, 0, 0, 0});
  const int32_t* lora_slots = nullptr;
  if (token_slots.numel() && !lora.empty()) {
    for (int64_t i = 0; i < L * GEMMS_PER_LAYER; ++i) {
      const at::Tensor* t = lora.data() + 3 * i;
      if (!t[0].numel()) continue;
      const int64_t* g = gemm_shapes[i % GEMMS_PER_LAYER];
      lora_w[i] = lora_weights(t[0], t[1], t[2], g[2], g[1]);
      check_lora_slots(token_slots, T, lora_w[i].L);
      lora_slots = token_slots.data_ptr<int32_t>();
    }
  }
  if (T == 0) return;
  if (dt == at::kFloat) {
#if GEMM_F32
    forward_impl<float, float>(out, h, positions, cos, sin, slot_mapping, block_tables, seq_lens, weights, kv_caches,
                               quant, final_norm, Hq, Hkv, D, I, eps, qk_eps, scale, lora_w, lora_slots, moe, moe_s,
                               top_k, renormalize);
    return;
#endif
  } else if (dt == at::kBFloat16) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    forward_impl<c10::BFloat16, uint16_t>(out, h, positions, cos, sin, slot_mapping, block_tables, seq_lens, weights,
                                          kv_caches, quant, final_norm, Hq, Hkv, D, I, eps, qk_eps, scale, lora_w,
                                          lora_slots, moe, moe_s, top_k, renormalize);
    return;
#endif
  }
  TORCH_CHECK(false, "this build has no layer stack for ", dt);
}
