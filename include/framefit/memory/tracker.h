#pragma once
// Memory accounting for tensors: current and peak bytes, peaks per named phase, and an
// optional hard budget that fails allocations the way a full GPU does.
//
// On CPU every tensor byte goes through framefit's tracking allocator (installed when the
// library is loaded, before any tensor of the program exists). On CUDA the same interface
// reads the caching allocator's statistics and enforces the budget with its memory fraction.

#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace framefit::memory {

// Raised when an allocation would exceed the budget, or (`system_refused`) when the system had
// no memory to give it. A c10::Error, so it crosses LibTorch's autograd engine and parallel
// regions like any LibTorch error and can be caught by type. `advice`, when the caller knows
// what would fit (a planner's answer), replaces the generic "lower the chunk size" advice.
class OutOfMemoryError : public c10::Error {
 public:
  OutOfMemoryError(c10::Device device, int64_t requested_bytes, int64_t budget_bytes,
                   int64_t in_use_bytes, std::string phase, bool system_refused = false,
                   const std::string& advice = {});
  c10::Device device() const { return device_; }
  int64_t requested_bytes() const { return requested_bytes_; }
  int64_t budget_bytes() const { return budget_bytes_; }
  int64_t in_use_bytes() const { return in_use_bytes_; }
  const std::string& phase() const { return phase_; }

 private:
  c10::Device device_;
  int64_t requested_bytes_;
  int64_t budget_bytes_;
  int64_t in_use_bytes_;
  std::string phase_;
};

// True for framefit's budget error and for LibTorch's CUDA out-of-memory error.
bool is_out_of_memory(const std::exception& error);

// "1.50 GiB", "12.0 MiB", "512 B".
std::string format_bytes(int64_t bytes);
// Parses "8GiB", "512MiB", "1.5G", "4096" (bytes): binary units for K/M/G/T with or without
// "i"; "4GB", "512MB" are SI (4e9, 512e6 bytes). Throws c10::Error naming the text on anything
// else.
int64_t parse_bytes(const std::string& text);

// What one device's allocator reports. Backends differ only in how they get these numbers.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual c10::Device device() const = 0;
  virtual int64_t current_bytes() const = 0;   // bytes held by live tensors
  virtual int64_t peak_bytes() const = 0;      // highest current_bytes since reset_peak()
  virtual void reset_peak() = 0;               // peak := current
  virtual int64_t reserved_bytes() const = 0;  // held from the system, cache included
  virtual int64_t allocation_count() const = 0;
  virtual void set_budget(int64_t bytes) = 0;  // 0 = no budget
  virtual int64_t budget_bytes() const = 0;
  virtual void release_cache() = 0;            // give cached blocks back to the system
  // What the allocator may hold from the system, its tensors and cached blocks together, where
  // that is not the allocator's own policy (CPU: twice the budget; CUDA: its caching allocator's
  // fraction, unchanged here). 0 = the default.
  virtual void set_held_limit(int64_t /*bytes*/) {}
  virtual void set_phase_name(const std::string& name) = 0;  // named in budget errors
  // What tensors could use at most without a budget: the device's memory (CUDA), or the bytes
  // in use plus what the system has available (CPU).
  virtual int64_t capacity_bytes() const = 0;
  // Of current_bytes, those allocated on data-loading threads (PipelineThreadScope).
  virtual int64_t pipeline_bytes() const { return 0; }
  // Of current_bytes, what the device's math libraries took when first used and keep (CUDA).
  virtual int64_t library_bytes() const { return 0; }
};

// Marks the calling thread as a data-loading thread while alive (the prefetching workers): the
// CPU tensors it allocates count as the data pipeline's until they are freed, by whichever
// thread (Tracker::pipeline_bytes). What training keeps between steps can then be told apart
// from the videos decoded ahead of it, whose size varies from step to step. On CUDA the
// pipeline's tensors are on the host and the device's bytes are training's alone.
class PipelineThreadScope {
 public:
  PipelineThreadScope();
  ~PipelineThreadScope();
  PipelineThreadScope(const PipelineThreadScope&) = delete;
  PipelineThreadScope& operator=(const PipelineThreadScope&) = delete;

 private:
  bool previous_;
};

struct PhaseStats {
  int64_t calls = 0;
  int64_t peak_bytes = 0;           // highest in-use bytes seen inside the phase
  int64_t peak_increase_bytes = 0;  // highest (in-use inside - in-use at entry)
  int64_t retained_bytes = 0;       // last call: in-use at exit - in-use at entry
};

struct Snapshot {
  c10::Device device{c10::kCPU};
  int64_t current_bytes = 0;
  int64_t peak_bytes = 0;
  int64_t reserved_bytes = 0;
  int64_t allocation_count = 0;
  int64_t budget_bytes = 0;
};

class Tracker;

// A named phase opening or closing, for monitors (trace files, leak detection).
struct PhaseEvent {
  enum class Kind { Begin, End };
  Kind kind;
  std::string name;
  int64_t in_use_bytes;  // at the event
  int64_t peak_bytes;    // End: the phase's peak; Begin: equal to in_use_bytes
  int64_t time_ns;       // steady clock
};
using PhaseListener = std::function<void(const PhaseEvent&)>;

// Opened by Tracker::phase() or Tracker::mark(); closing it (destructor) records the peak.
// Windows nest and must close in reverse order of opening.
class PeakWindow {
 public:
  PeakWindow(PeakWindow&& other) noexcept;
  PeakWindow& operator=(PeakWindow&&) = delete;
  PeakWindow(const PeakWindow&) = delete;
  ~PeakWindow();
  // Peak in-use bytes since the window opened (live while open, final once closed).
  int64_t peak_bytes() const;
  int64_t entry_bytes() const { return entry_bytes_; }
  void close();

 private:
  friend class Tracker;
  PeakWindow(Tracker* tracker, size_t depth, int64_t entry_bytes);
  Tracker* tracker_;
  size_t depth_;
  int64_t entry_bytes_;
  int64_t final_peak_ = -1;
};

// Thread-safe accounting on top of a Backend. Allocation counting happens in the backend;
// the tracker adds peak windows and named phases.
class Tracker {
 public:
  explicit Tracker(std::unique_ptr<Backend> backend);

  // The tracker of a device: the process-wide CPU tracker, or one per CUDA device.
  static Tracker& of(c10::Device device);
  static Tracker& cpu() { return of(c10::Device(c10::kCPU)); }

  c10::Device device() const { return backend_->device(); }
  int64_t current_bytes() const { return backend_->current_bytes(); }
  int64_t reserved_bytes() const { return backend_->reserved_bytes(); }
  int64_t allocation_count() const { return backend_->allocation_count(); }
  // Of current_bytes, the data pipeline's (PipelineThreadScope).
  int64_t pipeline_bytes() const { return backend_->pipeline_bytes(); }
  // What the device's math libraries keep once used, for the process's life: on CUDA the
  // cuBLAS/cuBLASLt workspaces LibTorch takes from the caching allocator per handle and stream
  // (32 MiB each on Hopper), measured when the tracker is made by running them once; 0 on the
  // CPU. Workspaces taken before (by code that ran matrix products before framefit asked for
  // the tracker) are not seen.
  int64_t library_bytes() const { return backend_->library_bytes(); }
  int64_t peak_bytes() const;  // since construction or reset_peak()
  void reset_peak();           // only when no window is open
  Snapshot snapshot() const;

  // Budget: allocations beyond it raise OutOfMemoryError. 0 removes it.
  void set_budget(int64_t bytes) { backend_->set_budget(bytes); }
  int64_t budget_bytes() const { return backend_->budget_bytes(); }
  void release_cache() { backend_->release_cache(); }
  // On the CPU, where a memory limit sees the process's resident memory: the tensors and the
  // cached blocks together stay within `bytes` (at least the budget; 0: twice the budget).
  void set_held_limit(int64_t bytes) { backend_->set_held_limit(bytes); }
  // The budget if set, else the device's capacity: what a planner may plan for.
  int64_t available_bytes() const;

  // A window measuring the peak from now on, without a name.
  [[nodiscard]] PeakWindow mark();
  // A named window; its peak is added to phase_stats() under `name` when it closes.
  [[nodiscard]] PeakWindow phase(std::string name);
  std::map<std::string, PhaseStats> phase_stats() const;
  void clear_phase_stats();
  std::string current_phase() const;

  // Listeners see every named phase begin and end, on the thread that opened or closed it,
  // outside the tracker's lock. Returns an id for remove_listener().
  int add_listener(PhaseListener listener);
  void remove_listener(int id);

 private:
  friend class PeakWindow;
  struct Frame {
    std::string name;  // empty for marks
    int64_t entry_bytes;
    int64_t outer_peak;  // the enclosing window's peak when this one opened
  };
  PeakWindow open(std::string name);
  int64_t window_peak_locked(size_t depth) const;
  int64_t close(size_t depth);

  std::unique_ptr<Backend> backend_;
  mutable std::mutex mutex_;
  std::vector<Frame> frames_;
  // Peaks hidden by backend resets: the innermost window's peak is max(carried_, backend peak).
  int64_t carried_ = 0;
  std::map<std::string, PhaseStats> phases_;
  std::map<int, PhaseListener> listeners_;
  int next_listener_ = 0;
  void notify(const PhaseEvent& event);
};

// A budget on `tracker` for the scope's lifetime, and with `held_limit` > 0 that held limit
// (Tracker::set_held_limit). However the scope ends (an exception, a failed test assertion) the
// earlier budget comes back and the held limit goes back to its default, so that no budget
// reaches work that did not ask for it.
class ScopedBudget {
 public:
  ScopedBudget(Tracker& tracker, int64_t budget, int64_t held_limit = 0)
      : tracker_(tracker), earlier_budget_(tracker.budget_bytes()) {
    tracker_.set_budget(budget);
    if (held_limit > 0) tracker_.set_held_limit(held_limit);
  }
  ~ScopedBudget() {
    tracker_.set_held_limit(0);
    tracker_.set_budget(earlier_budget_);
  }
  ScopedBudget(const ScopedBudget&) = delete;
  ScopedBudget& operator=(const ScopedBudget&) = delete;

 private:
  Tracker& tracker_;
  int64_t earlier_budget_;
};

// Makes sure the CPU tracking allocator is installed (it is, from library load on); returns
// false if another allocator replaced it.
bool tracking_allocator_installed();

// Resident set size of this process (everything: tensors, BLAS buffers, code, malloc caches).
struct ProcessMemory {
  int64_t rss_bytes = 0;
  int64_t rss_peak_bytes = 0;  // VmHWM: since start or the last reset_rss_peak()
  // Of rss_bytes, what the CPU tracking allocator does not hold (its tensors and cached blocks
  // are Tracker::cpu().reserved_bytes()): code, thread stacks, the libraries' own buffers,
  // malloc's free lists. Never negative.
  int64_t untracked_bytes = 0;
};
ProcessMemory process_memory();
// Resets the kernel's high-water mark (Linux /proc/self/clear_refs); false if not permitted.
bool reset_rss_peak();
// Gives the C library's free heap pages back to the system (glibc's malloc_trim). Blocks below
// the tracking allocator's mapping size, and the libraries' own allocations, come from malloc,
// whose freed pages otherwise stay resident: 50 MiB over one epoch of the demo. Milliseconds.
void release_free_heap();

}  // namespace framefit::memory
