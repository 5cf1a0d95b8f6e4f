#pragma once
// Watching memory over a run: a Chrome trace of phases and bytes in use (opens in Perfetto or
// chrome://tracing), and a leak detector for steady-state growth between steps (seeds/003).
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "framefit/memory/tracker.h"

namespace framefit::memory {

// Records every named phase of `tracker` while alive: phases become slices ("B"/"E" events),
// bytes in use and each phase's peak counters ("C" events), in the Trace Event JSON format.
class TraceRecorder {
 public:
  explicit TraceRecorder(Tracker& tracker);
  ~TraceRecorder();
  TraceRecorder(const TraceRecorder&) = delete;
  TraceRecorder& operator=(const TraceRecorder&) = delete;

  // A marker at this moment (e.g. "step 12"), shown as an instant event.
  void mark(const std::string& name);
  size_t event_count() const;
  std::string json() const;
  void write(const std::string& path) const;  // atomically: temp file, then rename

 private:
  struct Event {
    char phase;  // 'B', 'E', 'C', 'i'
    std::string name;
    int64_t time_ns;
    int64_t bytes;
  };
  void record(Event event);
  Tracker& tracker_;
  int listener_;
  int64_t start_ns_;
  mutable std::mutex mutex_;
  std::vector<Event> events_;
};

// One line per training step: "allocated 1.2 GiB, step peak 3.4 GiB" plus "reserved 4.0 GiB"
// where the device has a caching allocator (CUDA) or a budget.
std::string memory_line(const Tracker& tracker, int64_t step_peak_bytes);

struct LeakDetectorOptions {
  int64_t warmup_steps = 2;  // the first steps fill caches and optimizer state: not counted
  int64_t window = 10;       // steps compared
  double threshold = 0.10;   // growth of the steady-state bytes in use that triggers a warning
  int64_t min_growth_bytes = 0;  // ... and at least this much (tiny models: a few KiB is noise)
};

// Fed the bytes in use at the end of each step (and the step's phase statistics), it warns once
// the steady-state use has grown by more than the threshold across the window, naming the phase
// that left the most bytes allocated behind it over the window (where phases are given).
class LeakDetector {
 public:
  explicit LeakDetector(LeakDetectorOptions options = {});
  // Returns a warning when a leak is detected (at most once per window).
  std::optional<std::string> record(int64_t in_use_bytes,
                                    const std::map<std::string, PhaseStats>& phases = {});

 private:
  LeakDetectorOptions options_;
  int64_t steps_ = 0;
  std::deque<int64_t> in_use_;
  std::deque<std::map<std::string, int64_t>> retained_;  // per step: bytes each phase left
  int64_t quiet_until_ = 0;
};

}  // namespace framefit::memory
