// ProbeCapabilities as odyssey-worker calls it at start: the first thing of the process that
// touches the device (a test binary of its own, so no earlier test has initialized CUDA). A
// worker on a GPU once died here, asking libtorch's caching allocator for statistics before
// any tensor had initialized it ("Invalid device argument").
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "worker/job_runner.h"

namespace odyssey::worker {
namespace {

TEST(DeviceProbeTest, DescribesTheDeviceBeforeAnyTensorExists) {
  absl::StatusOr<v1::WorkerCapabilities> caps = ProbeCapabilities("auto");
  ASSERT_TRUE(caps.ok()) << caps.status();
  EXPECT_FALSE(caps->hostname().empty());
  EXPECT_GT(caps->host_memory_bytes(), 0);
  if (caps->device() == "cpu") {
    absl::StatusOr<v1::WorkerCapabilities> gpu = ProbeCapabilities("cuda:0");
    ASSERT_FALSE(gpu.ok());
    EXPECT_TRUE(absl::StrContains(gpu.status().message(), "no CUDA device")) << gpu.status();
    GTEST_SKIP() << "no CUDA device (checked that cuda:0 is refused with a message)";
  }
  EXPECT_EQ(caps->device(), "cuda:0");
  EXPECT_FALSE(caps->device_name().empty());
  EXPECT_GT(caps->device_memory_bytes(), int64_t{1} << 30);
  absl::StatusOr<v1::WorkerCapabilities> missing = ProbeCapabilities("cuda:64");
  ASSERT_FALSE(missing.ok());
  EXPECT_TRUE(absl::StrContains(missing.status().message(), "CUDA devices")) << missing.status();
}

}  // namespace
}  // namespace odyssey::worker
