// Devices, streams, events, guards and error checking; and the "no GPU" registration path,
// which runs on machines without a GPU too.
#include <gtest/gtest.h>

#include "cuda_test_util.h"
#ifdef SHARDTRAIN_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace shardtrain {
namespace {

#ifdef SHARDTRAIN_HAVE_CUDA

// Without a driver cudaGetDeviceCount fails ("CUDA driver version is insufficient"); that and a
// count of 0 must both mean "no GPU": nothing registered, the CPU backend still serves.
TEST(CudaRuntime, RegistrationFollowsDeviceCount) {
  const int count = cuda::device_count();
  EXPECT_GE(count, 0);
  EXPECT_EQ(cuda_backend_available(), count > 0) << testing::no_cuda_reason();
  EXPECT_EQ(backend_for(Device::cpu()).device(), Device::cpu());
  if (count == 0) {
    EXPECT_THROW(backend_for(Device::cuda(0)), Error);
    EXPECT_THROW(allocator_for(Device::cuda(0)), Error);
  }
}

TEST(CudaRuntime, ErrorsNameTheCall) {
  REQUIRE_CUDA();
  try {
    ST_CUDA_CHECK(cudaSetDevice(100000));
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("cudaSetDevice(100000)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("cudaErrorInvalidDevice"), std::string::npos) << msg;
  }
  // The failure does not linger for later checks.
  EXPECT_NO_THROW(ST_CUDA_CHECK(cudaGetLastError()));
}

TEST(CudaRuntime, DeviceGuardRestores) {
  REQUIRE_CUDA();
  const int before = cuda::current_device();
  {
    cuda::DeviceGuard guard(cuda::device_count() - 1);
    EXPECT_EQ(cuda::current_device(), cuda::device_count() - 1);
  }
  EXPECT_EQ(cuda::current_device(), before);
  EXPECT_FALSE(cuda::device_description(0).empty());
  EXPECT_GT(cuda::multiprocessor_count(0), 0);
}

TEST(CudaRuntime, StreamGuardSetsThisThreadsStream) {
  REQUIRE_CUDA();
  const cuda::StreamView original = cuda::current_stream(0);
  EXPECT_EQ(original.handle(), nullptr) << "threads start on the legacy default stream";
  cuda::Stream s(0);
  {
    cuda::StreamGuard guard(s.view());
    EXPECT_EQ(cuda::current_stream(0), s.view());
    // Kernels follow the current stream: work issued here is finished after s.synchronize().
    Tensor t = empty({1 << 20}, DType::F32, Device::cuda(0));
    backend_for(Device::cuda(0)).fill(t, 4.0f);
    s.synchronize();
    EXPECT_TRUE(s.view().query());
    EXPECT_EQ(t.to_float_vector().back(), 4.0f);
  }
  EXPECT_EQ(cuda::current_stream(0), original);
  cuda::Stream moved = std::move(s);
  EXPECT_NE(moved.handle(), nullptr);
  EXPECT_EQ(s.handle(), nullptr);
}

TEST(CudaRuntime, EventsTimeAndOrder) {
  REQUIRE_CUDA();
  cuda::Stream producer(0), consumer(0);
  cuda::Event start(true), stop(true);
  Tensor t;
  {
    cuda::StreamGuard guard(producer.view());
    start.record(producer.view());
    t = empty({1 << 24}, DType::F32, Device::cuda(0));
    backend_for(Device::cuda(0)).fill(t, 1.5f);
    stop.record(producer.view());
  }
  stop.block(consumer.view());
  consumer.synchronize();  // ordered after the fill through the event
  EXPECT_TRUE(stop.query());
  EXPECT_GE(start.elapsed_ms(stop), 0.0f);
  cuda::Event plain;
  EXPECT_TRUE(plain.query()) << "an event never recorded counts as complete";
  EXPECT_THROW(plain.elapsed_ms(stop), Error);
}

// zeros() on a GPU is a memset queued on the current stream: a block the caching allocator hands
// back still holding old values must read as zeros, also on a side stream, and also when the
// previous owner's last write was still queued.
TEST(CudaRuntime, ZerosClearsReusedDeviceMemoryInStreamOrder) {
  REQUIRE_CUDA();
  const Shape shape{3, 1000003};
  {
    Tensor dirty = full(shape, 7.5f, DType::F32, testing::cuda0());
    testing::gpu().scale(dirty, dirty, 2.0f);  // still queued when the block is freed
  }
  Tensor z = zeros(shape, DType::F32, testing::cuda0());
  const std::vector<float> host = z.to_float_vector();
  EXPECT_EQ(std::count(host.begin(), host.end(), 0.0f), static_cast<std::ptrdiff_t>(host.size()));
  cuda::Stream side(0);
  {
    cuda::StreamGuard on_side(side.view());
    Tensor dirty = full({1, 4097}, -1.0f, DType::BF16, testing::cuda0());
  }
  cuda::StreamGuard on_side(side.view());
  Tensor z16 = zeros({1, 4097}, DType::BF16, testing::cuda0());
  for (float v : z16.to_float_vector()) ASSERT_EQ(v, 0.0f);
}

#else

TEST(CudaRuntime, NoCudaBuildHasNoCudaBackend) {
  EXPECT_FALSE(cuda_backend_available());
  REQUIRE_CUDA();
}

#endif

}  // namespace
}  // namespace shardtrain
