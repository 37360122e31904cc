#include "model/causal_lm.h"

#include <torch/torch.h>

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
  // on a CPU), from the process generator seeded here.
  torch::NoGradGuard no_grad;
  torch::manual_seed(seed);
  for (auto& p : named_parameters()) {
    torch::Tensor& t = p.value();
    const std::string& name = p.key();
    if (name.size() >= 7 && name.compare(name.size() - 7, 7, ".weight") == 0 && t.dim() == 2) {
      t.normal_(0.0, std);
    } else if (name.find("norm") != std::string::npos) {
      t.fill_(1.0);
    } else {
      t.zero_();
    }
  }
  for (DecoderLayer& layer : model->layer_list) {  // what the generic rule cannot know
    if (layer->kda) layer->kda->InitSpecial();
    if (layer->dsa) layer->dsa->InitSpecial();
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

absl::StatusOr<CausalLM> MakeCausalLM(const ModelConfig& config) {
  if (absl::Status s = config.Validate(); !s.ok()) return s;
  return CausalLM(config);
}

}  // namespace odyssey::model
