#include "model/causal_lm.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <optional>

#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

namespace odyssey::model {

DecoderModelImpl::DecoderModelImpl(const ModelConfig& c) {
  embed_tokens = register_module("embed_tokens", torch::nn::Embedding(c.vocab_size, c.hidden_size));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    DecoderLayer layer(c, i);
    layers->push_back(layer);
    layer_list.push_back(layer);
  }
  norm = register_module("norm", RMSNorm(c.hidden_size, c.rms_norm_eps));
}

CausalLMImpl::CausalLMImpl(const ModelConfig& c) : config_(c) {
  model = register_module("model", DecoderModel(c));
  if (!c.tie_word_embeddings) {
    lm_head = register_module("lm_head", torch::nn::Linear(torch::nn::LinearOptions(c.hidden_size, c.vocab_size).bias(false)));
  }
  backend_ = kernels::MakeAttentionBackend("auto").value();
  if (c.UsesRope()) inv_freq_cpu_ = RopeInvFreq(c, torch::kCPU);
}

torch::Tensor CausalLMImpl::HeadWeight() const {
  return lm_head ? lm_head->weight : model->embed_tokens->weight;
}

torch::Tensor CausalLMImpl::Hidden(const ForwardInputs& in, const LayerStackRunner& runner) {
  const torch::Tensor& ids = in.input_ids;  // (B, S)
  TORCH_CHECK(ids.dim() == 2, "input_ids must be (B, S)");
  const int64_t B = ids.size(0), S = ids.size(1);
  torch::Tensor pos = in.position_ids;
  if (!pos.defined()) {
    pos = torch::arange(S, torch::TensorOptions().dtype(torch::kInt64).device(ids.device())).unsqueeze(0).expand({B, S});
  }
  torch::Tensor h = model->embed_tokens(ids);  // (B, S, hidden)
  LayerContext ctx;
  // The hybrid family is NoPE: no tables.
  if (config_.UsesRope()) ctx.rope = MakeRopeTables(inv_freq_cpu_.to(ids.device()), pos, h.scalar_type());  // (B, S, D)
  ctx.attention.doc_lens = in.doc_lens;
  ctx.backend = backend_.get();
  ctx.sequence = sequence_.get();
  // The same lookup again, for a runner that would rather recompute h than keep it.
  ctx.stack_input = [embed = model->embed_tokens, ids]() mutable {
    torch::NoGradGuard no_grad;
    return embed(ids);
  };
  if (runner) {
    h = runner(model->layer_list, h, ctx);
  } else {
    for (DecoderLayer layer : model->layer_list) h = layer->forward(h, ctx);  // holders are shared_ptrs
  }
  return model->norm(h);
}

torch::Tensor CausalLMImpl::Logits(const ForwardInputs& in) {
  return torch::matmul(Hidden(in), HeadWeight().t());  // (B, S, vocab)
}

void CausalLMImpl::InitRandom(uint64_t seed, double std) {
  // Drawn on the parameters' own device (a 8B model initializes in seconds on a GPU, minutes
  // on a CPU). On a CPU from a generator of its own, seeded here: ranks run as threads of one
  // process (the CPU tests) build and initialize their models concurrently, and module
  // construction draws from the process generator. On a GPU from the process generator seeded
  // here, one init at a time per process (simulated ranks on one device). Both give the values
  // the process generator gives after manual_seed(seed).
  static std::mutex init_mutex;
  std::lock_guard<std::mutex> lock(init_mutex);
  torch::NoGradGuard no_grad;
  std::optional<at::Generator> gen;
  const std::vector<torch::Tensor> params = parameters();
  if (params.empty() || params[0].device().is_cpu()) {
    gen = at::detail::createCPUGenerator(seed);
  } else {
    torch::manual_seed(seed);
  }
  for (auto& p : named_parameters()) {
    torch::Tensor& t = p.value();
    const std::string& name = p.key();
    if (name.size() >= 7 && name.compare(name.size() - 7, 7, ".weight") == 0 && t.dim() == 2) {
      t.normal_(0.0, std, gen);
    } else if (name.find("norm") != std::string::npos) {
      t.fill_(1.0);
    } else {
      t.zero_();
    }
  }
  for (DecoderLayer& layer : model->layer_list) {  // what the generic rule cannot know
    if (layer->kda) layer->kda->InitSpecial(gen);
    if (layer->dsa) layer->dsa->InitSpecial(gen);
  }
}

torch::Tensor CausalLMImpl::IndexerLoss() const {
  torch::Tensor sum;
  for (const DecoderLayer& layer : model->layer_list) {
    if (!layer->dsa || !layer->dsa->last_indexer_loss().defined()) continue;
    sum = sum.defined() ? sum + layer->dsa->last_indexer_loss() : layer->dsa->last_indexer_loss();
  }
  return sum;
}

bool IsLoraParameter(const std::string& name) {
  return name.find(".lora_A.") != std::string::npos || name.find(".lora_B.") != std::string::npos;
}

namespace {
// A layer's projections that may carry adapters, by their name under the layer: the token
// mixer's (dense attention, KDA or DSA: q, k, v, o) and the dense MLP's.
struct LoraSlot {
  std::string name;  // "self_attn.q_proj"
  torch::nn::Linear* linear;
  LoraAdapter* adapter;
};
std::vector<LoraSlot> LoraSlots(DecoderLayerImpl& layer) {
  std::vector<LoraSlot> out;
  auto mixer = [&](torch::nn::Linear& q, LoraAdapter& ql, torch::nn::Linear& k, LoraAdapter& kl, torch::nn::Linear& v,
                   LoraAdapter& vl, torch::nn::Linear& o, LoraAdapter& ol) {
    out.push_back({"self_attn.q_proj", &q, &ql});
    out.push_back({"self_attn.k_proj", &k, &kl});
    out.push_back({"self_attn.v_proj", &v, &vl});
    out.push_back({"self_attn.o_proj", &o, &ol});
  };
  if (layer.kda) {
    KdaAttentionImpl& a = *layer.kda;
    mixer(a.q_proj, a.q_lora, a.k_proj, a.k_lora, a.v_proj, a.v_lora, a.o_proj, a.o_lora);
  } else if (layer.dsa) {
    DsaAttentionImpl& a = *layer.dsa;
    mixer(a.q_proj, a.q_lora, a.k_proj, a.k_lora, a.v_proj, a.v_lora, a.o_proj, a.o_lora);
  } else {
    AttentionImpl& a = *layer.self_attn;
    mixer(a.q_proj, a.q_lora, a.k_proj, a.k_lora, a.v_proj, a.v_lora, a.o_proj, a.o_lora);
  }
  if (layer.mlp) {
    MlpImpl& f = *layer.mlp;
    out.push_back({"mlp.gate_proj", &f.gate_proj, &f.gate_lora});
    out.push_back({"mlp.up_proj", &f.up_proj, &f.up_lora});
    out.push_back({"mlp.down_proj", &f.down_proj, &f.down_lora});
  }
  return out;
}
}  // namespace

absl::Status AttachLora(CausalLMImpl& m, const LoraConfig& lora, uint64_t seed) {
  if (m.lora_.enabled()) return absl::FailedPreconditionError("lora: the model already has adapters");
  if (absl::Status s = lora.Validate("lora", &m.config_); !s.ok()) return s;
  if (!lora.enabled()) return absl::OkStatus();
  const std::vector<std::string> targets = lora.Targets();
  auto wanted = [&](const char* name) { return std::find(targets.begin(), targets.end(), name) != targets.end(); };
  torch::NoGradGuard no_grad;
  for (auto& p : m.parameters()) p.set_requires_grad(false);
  // Its own generator: attaching adapters leaves the process's random stream alone.
  at::Generator gen = at::detail::createCPUGenerator(seed);
  auto attach = [&](torch::nn::Linear& linear, LoraAdapter& adapter, const char* name) {
    if (!wanted(name)) return;
    const torch::Tensor& w = linear->weight;  // (out, in)
    const int64_t out = w.size(0), in = w.size(1);
    adapter.A = linear->register_module("lora_A", torch::nn::Linear(torch::nn::LinearOptions(in, lora.rank).bias(false)));
    adapter.B = linear->register_module("lora_B", torch::nn::Linear(torch::nn::LinearOptions(lora.rank, out).bias(false)));
    // nn.Linear's default init (kaiming_uniform_(a=sqrt(5))): U(-1/sqrt(in), 1/sqrt(in)).
    const double bound = 1.0 / std::sqrt(static_cast<double>(in));
    torch::Tensor a = torch::empty({lora.rank, in}, torch::kFloat32);  // (rank, in)
    a.uniform_(-bound, bound, gen);
    adapter.A->weight.set_data(a.to(w.device(), w.scalar_type()));
    adapter.B->weight.set_data(torch::zeros({out, lora.rank}, w.options()));  // (out, rank)
    adapter.A->weight.set_requires_grad(true);
    adapter.B->weight.set_requires_grad(true);
    adapter.scale = lora.scale();
  };
  for (DecoderLayer& layer : m.model->layer_list) {
    for (const LoraSlot& slot : LoraSlots(*layer))
      attach(*slot.linear, *slot.adapter, slot.name.substr(slot.name.find('.') + 1).c_str());
  }
  m.lora_ = lora;
  return absl::OkStatus();
}

std::vector<std::pair<std::string, torch::Tensor>> MergedParameters(CausalLMImpl& m) {
  torch::NoGradGuard no_grad;
  std::vector<std::pair<std::string, torch::Tensor>> out;
  // Merged weights by the name of the projection's weight.
  std::map<std::string, torch::Tensor> merged;
  if (m.lora().enabled()) {
    for (size_t i = 0; i < m.model->layer_list.size(); ++i) {
      const std::string prefix = "model.layers." + std::to_string(i) + ".";
      DecoderLayer& layer = m.model->layer_list[i];
      for (const LoraSlot& slot : LoraSlots(*layer)) {
        const std::string& name = slot.name;
        const LoraAdapter& lora = *slot.adapter;
        if (!lora) continue;
        const torch::Tensor& w = (*slot.linear)->weight;  // (out, in)
        torch::Tensor delta = torch::matmul(lora.B->weight.to(torch::kFloat32), lora.A->weight.to(torch::kFloat32));
        merged[prefix + name + ".weight"] = (w.to(torch::kFloat32) + delta * lora.scale).to(w.scalar_type());
      }
    }
  }
  for (auto& p : m.named_parameters()) {
    if (IsLoraParameter(p.key())) continue;
    auto it = merged.find(p.key());
    out.emplace_back(p.key(), it != merged.end() ? it->second : p.value().detach());
  }
  return out;
}

absl::StatusOr<CausalLM> MakeCausalLM(const ModelConfig& config) {
  if (absl::Status s = config.Validate(); !s.ok()) return s;
  return CausalLM(config);
}

}  // namespace odyssey::model
