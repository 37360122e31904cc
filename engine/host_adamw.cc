#include "engine/host_adamw.h"

#include <algorithm>
#include <cmath>

#include <torch/torch.h>

#ifdef ODYSSEY_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace odyssey::engine {

struct HostAdamW::Param {
  torch::Tensor param;                      // the model's tensor (contiguous)
  torch::Tensor master;                     // (numel,) fp32 host
  torch::Tensor exp_avg, exp_avg_sq;        // (numel,) host, fp32 (bf16 with bf16_moments)
  // (numel,) param dtype, host (pinned on CUDA): where the gradient lands (CUDA, deferred_cpu);
  // on CUDA a bf16 param's update replaces it there in place for the upload (one buffer each way).
  torch::Tensor grad_staging;
  bool decay = false;
  bool bf16 = false;
  // Guarded by HostAdamW::mu_ (the fields below).
  bool sent = false;     // this step's gradient is in grad_staging or on its way there
  bool released = false; // sent, and the device's .grad() dropped (ReleaseGrads)
  bool busy = false;     // Step started its update; not yet published
  bool waited = true;    // the compute stream already waits for its last upload (CUDA)
  int64_t chunks_left = 0;
  AdamWConstants k;                // this step's
  const void* grad = nullptr;      // this step's gradient: grad_staging or .grad() (CPU)
  torch::Tensor grad_ref;          // CPU: keeps that .grad() alive until the update ran
#ifdef ODYSSEY_WITH_CUDA
  at::cuda::CUDAEvent copied;      // on the D2H stream: grad_staging holds the gradient
  at::cuda::CUDAEvent uploaded;    // on the H2D stream: the parameter holds the update
#endif
};

struct HostAdamW::Cuda {
#ifdef ODYSSEY_WITH_CUDA
  c10::DeviceIndex device = 0;
  // Two streams so gradients going down and parameters going up use both PCIe directions.
  c10::cuda::CUDAStream d2h, h2d;
  explicit Cuda(c10::DeviceIndex d)
      : device(d), d2h(c10::cuda::getStreamFromPool(false, d)), h2d(c10::cuda::getStreamFromPool(false, d)) {}
#endif
};

bool HostAdamW::NotBusy(Param* p) { return !p->busy; }
bool HostAdamW::HasWorkOrStop() const { return stop_ || next_chunk_ < chunks_.size(); }
bool HostAdamW::Idle() const { return busy_ == 0; }

HostAdamW::HostAdamW(std::vector<torch::Tensor> params, const HostOptimizerOptions& options) : options_(options) {
  TORCH_CHECK(options_.chunk_elements > 0, "host optimizer: chunk_elements (", options_.chunk_elements,
              ") must be > 0");
  torch::NoGradGuard no_grad;
  cuda_ = !params.empty() && params.front().is_cuda();
#ifndef ODYSSEY_WITH_CUDA
  TORCH_CHECK(!cuda_, "host optimizer: CUDA parameters in a build without CUDA");
#endif
  TORCH_CHECK(!(cuda_ && options_.deferred_cpu), "host optimizer: deferred_cpu is for CPU parameters only");
  states_ = std::make_unique<memory::HostPool>(/*budget_bytes=*/0, /*pinned=*/false);
  staging_ = std::make_unique<memory::HostPool>(/*budget_bytes=*/0, /*pinned=*/cuda_);
  int64_t state_block = 0, staging_block = 0;
  for (torch::Tensor& p : params) {
    TORCH_CHECK(p.device() == params.front().device(), "optimizer_on_host: every parameter on one device (",
                params.front().device().str(), "), not ", p.device().str());
    TORCH_CHECK(p.scalar_type() == torch::kFloat32 || p.scalar_type() == torch::kBFloat16,
                "optimizer_on_host: parameters must be float32 or bfloat16, not ", p.scalar_type());
    TORCH_CHECK(p.is_contiguous(), "optimizer_on_host: parameters must be contiguous");
    auto q = std::make_unique<Param>();
    q->param = p;
    q->decay = DecaysWeights(p);
    q->bf16 = p.scalar_type() == torch::kBFloat16;
    const int64_t n = p.numel();
    auto state = [&](torch::Dtype dtype) { return states_->Slot(state_block++, n, dtype).value(); };
    if (!cuda_ && !q->bf16) {
      q->master = p.detach().view({-1});  // an fp32 CPU parameter is its own master: no copy
    } else {
      q->master = state(torch::kFloat32);
      q->master.copy_(p.detach().reshape({-1}).to(torch::kCPU, torch::kFloat32));
    }
    const torch::Dtype moments = options_.bf16_moments ? torch::kBFloat16 : torch::kFloat32;
    q->exp_avg = state(moments).zero_();
    q->exp_avg_sq = state(moments).zero_();
    if (cuda_ || options_.deferred_cpu) q->grad_staging = staging_->Slot(staging_block++, n, p.scalar_type()).value();
    params_.push_back(std::move(q));
  }
#ifdef ODYSSEY_WITH_CUDA
  if (cuda_) cuda_state_ = std::make_unique<Cuda>(params.front().device().index());
#endif
  int threads = options_.threads;
  if (threads <= 0) threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) - 1);
  if (options_.deferred_cpu) threads = 0;  // the waits run the updates
  for (int t = 0; t < threads; ++t) workers_.emplace_back([this] { WorkerLoop(); });
}

HostAdamW::~HostAdamW() {
  try {
    Finish();
  } catch (const std::exception&) {
    // A worker's failure was reported to the training thread already, or nobody is left to tell.
  }
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  for (std::thread& t : workers_) t.join();
#ifdef ODYSSEY_WITH_CUDA
  if (cuda_state_) {
    // Copies into and out of the staging buffers end before the pool frees them.
    cudaStreamSynchronize(cuda_state_->d2h.stream());
    cudaStreamSynchronize(cuda_state_->h2d.stream());
  }
#endif
}

HostAdamW::State HostAdamW::state(size_t i) const {
  const Param& p = *params_.at(i);
  const auto sizes = p.param.sizes();
  return State{p.master.view(sizes), p.exp_avg.view(sizes), p.exp_avg_sq.view(sizes)};
}

void HostAdamW::SendLocked(int64_t i, bool& recorded) {
  Param& q = *params_[static_cast<size_t>(i)];
  const torch::Tensor& g = q.param.grad();
  if (!g.defined() || q.sent) return;
  TORCH_CHECK(g.scalar_type() == q.param.scalar_type() && g.is_contiguous() && g.numel() == q.param.numel(),
              "host optimizer: a gradient must be contiguous and of its parameter's dtype and size");
  // The staging buffer is the previous update's input until that update is published.
  AwaitParamLocked(i);
#ifdef ODYSSEY_WITH_CUDA
  if (cuda_) {
    Cuda& c = *cuda_state_;
    c10::cuda::CUDAGuard guard(c.device);
    if (!recorded) {
      // After the kernels that produced the gradients (the caller's current stream: autograd
      // runs a node's backward on its forward's stream).
      at::cuda::CUDAEvent produced;
      produced.record(c10::cuda::getCurrentCUDAStream(c.device));
      produced.block(c.d2h);
      recorded = true;
    }
    // The staging buffer carried this param's last update up: that upload must have read it.
    q.uploaded.block(c.d2h);
    C10_CUDA_CHECK(cudaMemcpyAsync(q.grad_staging.data_ptr(), g.data_ptr(), g.nbytes(), cudaMemcpyDeviceToHost,
                                   c.d2h.stream()));
    // The caching allocator must not hand the gradient's memory out again (ZeroGrad frees it)
    // before the copy has read it.
    torch::Tensor(g).record_stream(c.d2h);
    q.copied.record(c.d2h);
    q.sent = true;
    return;
  }
#endif
  q.grad_staging.copy_(g.reshape({-1}));  // deferred_cpu: the "copy to the host" happens now
  q.sent = true;
}

void HostAdamW::GradsReady(const std::vector<int64_t>& indices) {
  if (!cuda_ && !options_.deferred_cpu) return;  // the CPU update reads .grad() itself
  torch::NoGradGuard no_grad;
  absl::MutexLock l(&mu_);
  bool recorded = false;
  for (int64_t i : indices) SendLocked(i, recorded);
}

void HostAdamW::ReleaseGrads(const std::vector<int64_t>& indices) {
  if (!cuda_ && !options_.deferred_cpu) return;  // the CPU update reads .grad() itself
  torch::NoGradGuard no_grad;
  absl::MutexLock l(&mu_);
  std::vector<torch::Tensor> grads;
  std::vector<Param*> released;
  for (int64_t i : indices) {
    Param& q = *params_[static_cast<size_t>(i)];
    if (!q.sent || q.released || !q.param.grad().defined()) continue;
    grads.push_back(q.param.grad());
    released.push_back(&q);
  }
  if (grads.empty()) return;
  // Queued behind the kernels that produced the gradients, before their memory is freed (the
  // allocator reuses it in stream order; the copy to the host holds it by recordStream).
  const torch::Tensor sq = torch::stack(at::_foreach_norm(grads, 2, torch::kFloat32)).square().sum();
  released_sq_ = released_sq_.defined() ? released_sq_ + sq : sq;
  for (Param* q : released) {
    q->param.mutable_grad() = torch::Tensor();
    q->released = true;
  }
}

torch::Tensor HostAdamW::ReleasedGradSquares() const {
  absl::MutexLock l(&mu_);
  return released_sq_;
}

void HostAdamW::AwaitParamLocked(int64_t i) {
  Param* q = params_[static_cast<size_t>(i)].get();
  if (!q->busy) return;
  if (options_.deferred_cpu) {
    Update(*q, 0, q->param.numel());
    q->busy = false;
    q->grad_ref = torch::Tensor();
    --busy_;
    return;
  }
  mu_.Await(absl::Condition(&HostAdamW::NotBusy, q));
}

void HostAdamW::Step(const AdamWStep& step) {
  Finish();  // a second Step waits for the first
  torch::NoGradGuard no_grad;
#ifdef ODYSSEY_WITH_CUDA
  if (cuda_) {
    Cuda& c = *cuda_state_;
    c10::cuda::CUDAGuard guard(c.device);
    // No upload may overwrite a parameter that work queued so far (backward) still reads.
    at::cuda::CUDAEvent queued;
    queued.record(c10::cuda::getCurrentCUDAStream(c.device));
    queued.block(c.h2d);
  }
#endif
  absl::MutexLock l(&mu_);
  bool recorded = false;
  chunks_.clear();
  released_sq_ = torch::Tensor();  // read by the clip before this step
  next_chunk_ = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    Param& q = *params_[i];
    if (!q.param.grad().defined() && !q.released) continue;  // no gradient: the state does not advance
    if (cuda_ || options_.deferred_cpu) {
      SendLocked(static_cast<int64_t>(i), recorded);
      q.grad = q.grad_staging.data_ptr();
    } else {
      q.grad_ref = q.param.grad().contiguous();
      q.grad = q.grad_ref.data_ptr();
    }
    q.sent = false;  // consumed: the next step's gradient is sent anew
    q.released = false;
    q.k = AdamWConstants::For(step, q.decay);
    q.busy = true;
    q.waited = false;
    ++busy_;
    if (options_.deferred_cpu) continue;  // WaitParams / Finish run it
    const int64_t n = q.param.numel();
    q.chunks_left = 0;
    for (int64_t b = 0; b == 0 || b < n; b += options_.chunk_elements) {
      chunks_.push_back(Chunk{static_cast<int64_t>(i), b, std::min(n, b + options_.chunk_elements)});
      ++q.chunks_left;
    }
  }
  if (cuda_ || options_.deferred_cpu) return;
  // CPU: synchronous (the caller reads the parameters next).
  mu_.Await(absl::Condition(this, &HostAdamW::Idle));
}

void HostAdamW::Update(const Param& p, int64_t begin, int64_t end) const {
  const int64_t elem = p.bf16 ? 2 : 4;
  const void* grad = static_cast<const char*>(p.grad) + begin * elem;
  uint16_t* out = nullptr;
  if (p.bf16) {
    // CUDA: over the gradient in the staging buffer, for the upload; CPU: into the parameter.
    torch::Tensor dst = cuda_ ? p.grad_staging : p.param;
    out = reinterpret_cast<uint16_t*>(dst.data_ptr()) + begin;
  }
  float* master = p.master.data_ptr<float>() + begin;
  if (options_.bf16_moments) {
    HostAdamWUpdateBf16Moments(p.k, end - begin, grad, p.bf16, master,
                               reinterpret_cast<uint16_t*>(p.exp_avg.data_ptr()) + begin,
                               reinterpret_cast<uint16_t*>(p.exp_avg_sq.data_ptr()) + begin, out);
  } else {
    HostAdamWUpdate(p.k, end - begin, grad, p.bf16, master, p.exp_avg.data_ptr<float>() + begin,
                    p.exp_avg_sq.data_ptr<float>() + begin, out);
  }
}

void HostAdamW::Publish(int64_t i) {
  Param& q = *params_[static_cast<size_t>(i)];
  std::string error;
#ifdef ODYSSEY_WITH_CUDA
  if (cuda_) {
    Cuda& c = *cuda_state_;
    // bf16: from the pinned staging buffer; fp32: from the (pageable) master itself, which
    // cudaMemcpyAsync has staged by the time it returns.
    const void* src = q.bf16 ? q.grad_staging.data_ptr() : q.master.data_ptr();
    const cudaError_t e = cudaMemcpyAsync(q.param.data_ptr(), src, q.param.nbytes(), cudaMemcpyHostToDevice,
                                          c.h2d.stream());
    if (e != cudaSuccess) {
      error = std::string("host optimizer: upload failed: ") + cudaGetErrorString(e);
      cudaGetLastError();
    } else {
      q.uploaded.record(c.h2d);
    }
  }
#endif
  absl::MutexLock l(&mu_);
  if (!error.empty() && error_.empty()) error_ = error;
  q.busy = false;
  q.grad_ref = torch::Tensor();
  --busy_;
}

void HostAdamW::WorkerLoop() {
#ifdef ODYSSEY_WITH_CUDA
  std::unique_ptr<c10::cuda::CUDAGuard> guard;
  if (cuda_) guard = std::make_unique<c10::cuda::CUDAGuard>(cuda_state_->device);
#endif
  for (;;) {
    Chunk c;
    {
      absl::MutexLock l(&mu_);
      mu_.Await(absl::Condition(this, &HostAdamW::HasWorkOrStop));
      if (next_chunk_ >= chunks_.size()) return;  // stop_
      c = chunks_[next_chunk_++];
    }
    Param& q = *params_[static_cast<size_t>(c.param)];
    bool ok = true;
#ifdef ODYSSEY_WITH_CUDA
    if (cuda_) {
      const cudaError_t e = cudaEventSynchronize(q.copied.event());  // the gradient has landed
      if (e != cudaSuccess) {
        cudaGetLastError();
        ok = false;
        absl::MutexLock l(&mu_);
        if (error_.empty()) error_ = std::string("host optimizer: gradient copy failed: ") + cudaGetErrorString(e);
      }
    }
#endif
    if (ok) Update(q, c.begin, c.end);
    bool last = false;
    {
      absl::MutexLock l(&mu_);
      last = --q.chunks_left == 0;
    }
    if (last) Publish(c.param);
  }
}

void HostAdamW::WaitParams(const std::vector<int64_t>& indices) {
  absl::MutexLock l(&mu_);
  for (int64_t i : indices) {
    AwaitParamLocked(i);
    TORCH_CHECK(error_.empty(), error_);
#ifdef ODYSSEY_WITH_CUDA
    Param& q = *params_[static_cast<size_t>(i)];
    if (cuda_ && !q.waited) {
      q.uploaded.block(c10::cuda::getCurrentCUDAStream(cuda_state_->device));
      q.waited = true;
    }
#endif
  }
}

void HostAdamW::Finish() {
  std::vector<int64_t> all(params_.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
  WaitParams(all);
}

void HostAdamW::DropGrads() {
  absl::MutexLock l(&mu_);
  for (auto& q : params_) q->sent = q->released = false;
  released_sq_ = torch::Tensor();
}

}  // namespace odyssey::engine
