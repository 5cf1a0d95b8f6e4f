// framefit's CPU allocator: counts every tensor byte, enforces the budget, and keeps large
// blocks mapped for reuse.
//
// Why a block cache: glibc hands blocks above its mmap threshold (32 MiB at most) back to the
// kernel on free, so every large activation is page-faulted in again on the next step; that
// alone made a 3x3 conv 5x slower here. Like CUDA's caching allocator we keep freed large
// blocks, and count them as "reserved" rather than "in use".
//
// oneDNN frees through raw_deleter(), which receives only the data pointer, so each block
// carries a 64-byte header (size, kind) just before its data; 64 bytes keep the alignment
// LibTorch expects.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/version.h>

#include <sys/mman.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <new>
#include <string>

#include "backends.h"

#if TORCH_VERSION_MAJOR >= 2
#define FRAMEFIT_ALLOCATE_CONST
#else
#define FRAMEFIT_ALLOCATE_CONST const
#endif

namespace framefit::memory {
namespace {

constexpr size_t kHeaderBytes = 64;
constexpr size_t kLargeBlockBytes = size_t(1) << 20;  // from here on: mapped and cached
constexpr size_t kSmallGranule = size_t(64) << 10;
constexpr size_t kHugePage = size_t(2) << 20;
// Blocks from here on are rounded to huge pages and asked to use them (fewer page faults); below
// it a huge page could double a block's resident size.
constexpr size_t kHugeBlockBytes = size_t(8) << 20;
constexpr int64_t kDefaultCacheLimit = int64_t(4) << 30;
constexpr uint32_t kMagic = 0xF7A3EF17u;

enum class BlockKind : uint32_t { Heap = 1, Mapped = 2 };

struct alignas(kHeaderBytes) BlockHeader {
  uint64_t requested;  // tensor bytes
  uint64_t block;      // bytes held from the system, header included
  uint32_t magic;
  BlockKind kind;
  uint32_t pipeline;  // allocated on a data-loading thread (PipelineThreadScope)
};
static_assert(sizeof(BlockHeader) == kHeaderBytes, "header must keep 64-byte alignment");

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

thread_local bool t_pipeline_thread = false;

class TrackingCpuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) FRAMEFIT_ALLOCATE_CONST override {
    // LibTorch 1.13 declares allocate() const; the one instance is never a const object.
    return const_cast<TrackingCpuAllocator*>(this)->allocate_tracked(n);
  }

  c10::DataPtr allocate_tracked(size_t n) {
    if (n == 0) return {nullptr, nullptr, &release, c10::Device(c10::kCPU)};
    const auto bytes = static_cast<int64_t>(n);
    const int64_t in_use = current_.fetch_add(bytes) + bytes;
    const int64_t budget = budget_.load();
    if (budget > 0 && in_use > budget) {
      current_.fetch_sub(bytes);
      throw OutOfMemoryError(c10::Device(c10::kCPU), bytes, budget, in_use - bytes, phase_name());
    }
    void* data = nullptr;
    try {
      data = n + kHeaderBytes < kLargeBlockBytes ? allocate_heap(n) : allocate_mapped(n);
    } catch (...) {
      current_.fetch_sub(bytes);
      throw;
    }
    raise_peak(in_use);
    count_.fetch_add(1);
    header_of(data)->pipeline = t_pipeline_thread;
    if (t_pipeline_thread) pipeline_.fetch_add(bytes);
    return {data, data, &release, c10::Device(c10::kCPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
#endif

  static TrackingCpuAllocator& instance() {
    static auto* allocator = new TrackingCpuAllocator();  // never destroyed: tensors outlive main
    return *allocator;
  }

  int64_t current() const { return current_.load(); }
  int64_t pipeline() const { return pipeline_.load(); }
  int64_t peak() const { return peak_.load(); }
  void reset_peak() { peak_.store(current_.load()); }
  int64_t reserved() const { return reserved_.load(); }
  int64_t count() const { return count_.load(); }
  int64_t budget() const { return budget_.load(); }
  void set_budget(int64_t bytes) {
    budget_.store(bytes);
    std::lock_guard<std::mutex> lock(cache_mutex_);
    trim_cache_locked(cache_limit_locked(0));
  }
  void set_held_limit(int64_t bytes) {
    held_limit_.store(bytes);
    std::lock_guard<std::mutex> lock(cache_mutex_);
    trim_cache_locked(cache_limit_locked(0));
  }
  void release_cache() {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    trim_cache_locked(0);
  }
  void set_phase_name(const std::string& name) {
    std::lock_guard<std::mutex> lock(phase_mutex_);
    phase_ = name;
  }

 private:
  static BlockHeader* header_of(void* data) {
    return reinterpret_cast<BlockHeader*>(static_cast<char*>(data) - kHeaderBytes);
  }

  static void release(void* data) {
    if (data == nullptr) return;
    auto* header = header_of(data);
    TORCH_INTERNAL_ASSERT(header->magic == kMagic,
                          "framefit: freeing memory the tracking allocator did not allocate");
    instance().free_block(header);
  }

  void free_block(BlockHeader* header) {
    current_.fetch_sub(static_cast<int64_t>(header->requested));
    if (header->pipeline) pipeline_.fetch_sub(static_cast<int64_t>(header->requested));
    if (header->kind == BlockKind::Heap) {
      reserved_.fetch_sub(static_cast<int64_t>(header->block));
      header->magic = 0;
      std::free(header);
      return;
    }
    std::lock_guard<std::mutex> lock(cache_mutex_);
    cache_.emplace(header->block, header);
    cached_bytes_ += static_cast<int64_t>(header->block);
    trim_cache_locked(cache_limit_locked(0));
  }

  void* allocate_heap(size_t n) {
    const size_t block = round_up(n + kHeaderBytes, kHeaderBytes);
    void* base = std::aligned_alloc(kHeaderBytes, block);
    if (base == nullptr) throw_system_oom(n);
    reserved_.fetch_add(static_cast<int64_t>(block));
    return init_header(base, n, block, BlockKind::Heap);
  }

  void* allocate_mapped(size_t n) {
    const bool huge = n + kHeaderBytes >= kHugeBlockBytes;
    const size_t block = round_up(n + kHeaderBytes, huge ? kHugePage : kSmallGranule);
    {
      std::lock_guard<std::mutex> lock(cache_mutex_);
      // Best fit, accepting up to 25% slack so one size does not pin a much larger block.
      auto it = cache_.lower_bound(block);
      if (it != cache_.end() && it->first <= block + block / 4) {
        BlockHeader* header = it->second;
        cached_bytes_ -= static_cast<int64_t>(it->first);
        cache_.erase(it);
        header->requested = n;
        return reinterpret_cast<char*>(header) + kHeaderBytes;
      }
      trim_cache_locked(cache_limit_locked(static_cast<int64_t>(block)));
    }
    void* base = mmap(nullptr, block, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) {
      release_cache();
      base = mmap(nullptr, block, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (base == MAP_FAILED) throw_system_oom(n);
    }
    if (huge) madvise(base, block, MADV_HUGEPAGE);  // fewer page faults on first touch
    reserved_.fetch_add(static_cast<int64_t>(block));
    return init_header(base, n, block, BlockKind::Mapped);
  }

  static void* init_header(void* base, size_t n, size_t block, BlockKind kind) {
    auto* header = static_cast<BlockHeader*>(base);
    header->requested = n;
    header->block = block;
    header->magic = kMagic;
    header->kind = kind;
    return static_cast<char*>(base) + kHeaderBytes;
  }

  [[noreturn]] void throw_system_oom(size_t n) {
    // current_ counts the request already (allocate_tracked takes it back).
    throw OutOfMemoryError(c10::Device(c10::kCPU), static_cast<int64_t>(n), budget_.load(),
                           current_.load() - static_cast<int64_t>(n), phase_name(), true);
  }

  // What the cache may hold with `incoming` bytes about to be mapped. The budget counts tensor
  // bytes, so the cache never causes a budget OOM; under a budget it is trimmed only as far as
  // keeps the memory held from the system within the held limit where one is set (a training
  // run whose budget is the process's resident memory sets it to the tensors' budget), else
  // within twice the budget. Trimming it to the budget's headroom made every step near the
  // budget map and page-fault its memory afresh (2-3x slower steps), and trimming it to the
  // budget on each release still made a UNet's step 12% slower with a budget than without, and
  // the demo's steps 1.25-1.29x slower held within it (bench/results/held_limit_speed.md).
  int64_t cache_limit_locked(int64_t incoming) const {
    const int64_t budget = budget_.load(), held_limit = held_limit_.load();
    if (budget <= 0 && held_limit <= 0) return kDefaultCacheLimit;
    const int64_t limit = held_limit > 0 ? held_limit : 2 * budget;
    const int64_t outside_cache = reserved_.load() - cached_bytes_ + incoming;
    return std::min(kDefaultCacheLimit, std::max<int64_t>(0, limit - outside_cache));
  }

  void trim_cache_locked(int64_t limit) {
    // Largest blocks first: they are the rarest to be reused at the same size.
    while (cached_bytes_ > limit && !cache_.empty()) {
      auto it = std::prev(cache_.end());
      BlockHeader* header = it->second;
      const size_t block = it->first;
      cache_.erase(it);
      cached_bytes_ -= static_cast<int64_t>(block);
      reserved_.fetch_sub(static_cast<int64_t>(block));
      header->magic = 0;
      munmap(header, block);
    }
  }

  void raise_peak(int64_t value) {
    int64_t seen = peak_.load();
    while (value > seen && !peak_.compare_exchange_weak(seen, value)) {
    }
  }

  std::string phase_name() {
    std::lock_guard<std::mutex> lock(phase_mutex_);
    return phase_;
  }

  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> pipeline_{0};  // of current_: allocated on data-loading threads
  std::atomic<int64_t> peak_{0};
  std::atomic<int64_t> reserved_{0};
  std::atomic<int64_t> count_{0};
  std::atomic<int64_t> budget_{0};
  std::atomic<int64_t> held_limit_{0};  // 0: twice the budget
  std::mutex cache_mutex_;
  std::multimap<size_t, BlockHeader*> cache_;
  int64_t cached_bytes_ = 0;
  std::mutex phase_mutex_;
  std::string phase_;
};

// Installed when libframefit is loaded, before the program's first tensor: oneDNN frees
// through the *current* allocator's raw_deleter, so it must never change once tensors exist.
struct InstallAtLoad {
  InstallAtLoad() { c10::SetCPUAllocator(&TrackingCpuAllocator::instance(), /*priority=*/100); }
} install_at_load;

class CpuBackend final : public Backend {
 public:
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  int64_t current_bytes() const override { return alloc().current(); }
  int64_t pipeline_bytes() const override { return alloc().pipeline(); }
  int64_t peak_bytes() const override { return alloc().peak(); }
  void reset_peak() override { alloc().reset_peak(); }
  int64_t reserved_bytes() const override { return alloc().reserved(); }
  int64_t allocation_count() const override { return alloc().count(); }
  void set_budget(int64_t bytes) override {
    TORCH_CHECK(bytes >= 0, "a memory budget cannot be negative; got ", bytes);
    alloc().set_budget(bytes);
  }
  int64_t budget_bytes() const override { return alloc().budget(); }
  void set_held_limit(int64_t bytes) override {
    TORCH_CHECK(bytes >= 0, "a held-memory limit cannot be negative; got ", bytes);
    alloc().set_held_limit(bytes);
  }
  void release_cache() override { alloc().release_cache(); }
  void set_phase_name(const std::string& name) override { alloc().set_phase_name(name); }
  int64_t capacity_bytes() const override {
    std::ifstream meminfo("/proc/meminfo");
    std::string line;
    long long kib = 0;
    while (std::getline(meminfo, line)) {
      if (std::sscanf(line.c_str(), "MemAvailable: %lld kB", &kib) == 1) break;
    }
    return current_bytes() + kib * 1024;
  }

 private:
  static TrackingCpuAllocator& alloc() { return TrackingCpuAllocator::instance(); }
};

}  // namespace

bool tracking_allocator_installed() {
  return c10::GetCPUAllocator() == &TrackingCpuAllocator::instance();
}

namespace detail {
bool set_pipeline_thread(bool on) {
  const bool previous = t_pipeline_thread;
  t_pipeline_thread = on;
  return previous;
}

std::unique_ptr<Backend> make_cpu_backend() {
  TORCH_CHECK(tracking_allocator_installed(),
              "framefit's CPU tracking allocator was replaced by another allocator "
              "(c10::SetCPUAllocator with a higher priority); CPU memory cannot be tracked");
  return std::make_unique<CpuBackend>();
}
}  // namespace detail

}  // namespace framefit::memory
