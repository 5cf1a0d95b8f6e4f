#include "framefit/memory/tracker.h"

#include <c10/util/StringUtil.h>

#include <algorithm>
#include <chrono>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <malloc.h>
#include <unistd.h>

#include "backends.h"

namespace framefit::memory {

namespace {
std::string sentence(std::string text) {
  text[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(text[0])));
  return text.back() == '.' ? text : text + ".";
}

std::string oom_message(c10::Device device, int64_t requested, int64_t budget, int64_t in_use,
                        const std::string& phase, bool system_refused, const std::string& advice) {
  const std::string budget_text =
      budget > 0 ? c10::str("budget ", format_bytes(budget), "; in use ", format_bytes(in_use),
                            "; free ", format_bytes(std::max<int64_t>(0, budget - in_use)))
                 : c10::str("no budget set; in use ", format_bytes(in_use));
  const std::string fix =
      !advice.empty()
          ? advice
          : c10::str("lower the chunk size or batch, use --precision bf16, or ",
                     system_refused ? "set a budget the machine has" : "raise the budget");
  return c10::str("framefit: out of memory on ", device.str(), ": tried to allocate ",
                  format_bytes(requested),
                  system_refused ? ", which the system could not give; " : "; ", budget_text,
                  "; phase '", phase.empty() ? "none" : phase, "'. ", sentence(fix));
}
}  // namespace

OutOfMemoryError::OutOfMemoryError(c10::Device device, int64_t requested_bytes,
                                   int64_t budget_bytes, int64_t in_use_bytes, std::string phase,
                                   bool system_refused, const std::string& advice)
    : c10::Error(c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                 oom_message(device, requested_bytes, budget_bytes, in_use_bytes, phase,
                             system_refused, advice)),
      device_(device),
      requested_bytes_(requested_bytes),
      budget_bytes_(budget_bytes),
      in_use_bytes_(in_use_bytes),
      phase_(std::move(phase)) {}

bool is_out_of_memory(const std::exception& error) {
  if (dynamic_cast<const OutOfMemoryError*>(&error) != nullptr) return true;
  // LibTorch's CUDA allocator raises a c10::Error (an OutOfMemoryError subclass from 2.0 on)
  // whose message starts with "CUDA out of memory".
  const std::string what = error.what();
  return what.find("CUDA out of memory") != std::string::npos ||
         what.find("out of memory on cuda") != std::string::npos;
}

std::string format_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (std::fabs(value) >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  char buf[32];
  if (unit == 0) {
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(bytes));
  } else {
    std::snprintf(buf, sizeof buf, "%.2f %s", value, units[unit]);
  }
  return buf;
}

int64_t parse_bytes(const std::string& text) {
  std::string s;
  for (char c : text) {
    if (!std::isspace(static_cast<unsigned char>(c))) s.push_back(c);
  }
  size_t pos = 0;
  double number = 0;
  // Decimal only: std::stod would also read hexadecimal ("0x10" as 16 bytes).
  bool ok = !s.empty() && (std::isdigit(static_cast<unsigned char>(s[0])) || s[0] == '.') &&
            s.find_first_of("xX") == std::string::npos;
  if (ok) {
    try {
      number = std::stod(s, &pos);
    } catch (const std::exception&) {
      ok = false;
    }
  }
  std::string unit = ok ? s.substr(pos) : "";
  std::transform(unit.begin(), unit.end(), unit.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  // SI units as SI: a user who writes 4GB and gets 4 GiB has 7% more budget than the limit
  // they meant. The bare letters stay binary, as in sort -S and GPU tools.
  struct Unit {
    const char* name;
    int power;
    double base;
  };
  static const Unit units[] = {
      {"", 0, 1024},     {"b", 0, 1024},    {"k", 1, 1024},    {"kib", 1, 1024},
      {"m", 2, 1024},    {"mib", 2, 1024},  {"g", 3, 1024},    {"gib", 3, 1024},
      {"t", 4, 1024},    {"tib", 4, 1024},  {"kb", 1, 1000},   {"mb", 2, 1000},
      {"gb", 3, 1000},   {"tb", 4, 1000}};
  int power = -1;
  double base = 1024;
  for (const auto& u : units) {
    if (unit == u.name) power = u.power, base = u.base;
  }
  TORCH_CHECK(ok && power >= 0 && number >= 0 && std::isfinite(number),
              "cannot read '", text, "' as a byte size: write a number with an optional unit, "
              "e.g. 8GiB, 512MiB, 1.5G (binary), 4GB (SI: 4e9 bytes) or 4096");
  // llround of a value beyond int64 is undefined: 1e30GiB came back negative, which reads as
  // "no budget".
  const double bytes = number * std::pow(base, power);
  TORCH_CHECK(bytes < 0x1p62, "'", text, "' is too large a byte size (over 2^62 bytes)");
  return static_cast<int64_t>(std::llround(bytes));
}

// ---------------------------------------------------------------------------------------------
// Tracker

PipelineThreadScope::PipelineThreadScope() : previous_(detail::set_pipeline_thread(true)) {}
PipelineThreadScope::~PipelineThreadScope() { detail::set_pipeline_thread(previous_); }

Tracker::Tracker(std::unique_ptr<Backend> backend) : backend_(std::move(backend)) {}

Tracker& Tracker::of(c10::Device device) {
  if (device.is_cpu()) {
    static Tracker* cpu = new Tracker(detail::make_cpu_backend());  // lives as long as tensors
    return *cpu;
  }
  TORCH_CHECK(device.is_cuda(), "framefit tracks CPU and CUDA memory; got device ", device.str());
  static std::mutex mutex;
  static std::map<c10::DeviceIndex, Tracker*> cuda;
  std::lock_guard<std::mutex> lock(mutex);
  const auto index = device.has_index() ? device.index() : c10::DeviceIndex(0);
  auto& slot = cuda[index];
  if (slot == nullptr) slot = new Tracker(detail::make_cuda_backend(index));
  return *slot;
}

int64_t Tracker::window_peak_locked(size_t depth) const {
  // Only the innermost window sees the backend's live peak; an outer one also holds what its
  // inner windows carried up when they closed.
  int64_t peak = std::max(carried_, backend_->peak_bytes());
  for (size_t i = frames_.size(); i-- > depth + 1;) peak = std::max(peak, frames_[i].outer_peak);
  return peak;
}

int64_t Tracker::available_bytes() const {
  const int64_t budget = backend_->budget_bytes();
  return budget > 0 ? budget : backend_->capacity_bytes();
}

int64_t Tracker::peak_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t peak = std::max(carried_, backend_->peak_bytes());
  for (const auto& f : frames_) peak = std::max(peak, f.outer_peak);
  return peak;
}

void Tracker::reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(frames_.empty(), "Tracker::reset_peak() called while ", frames_.size(),
              " phase/mark window(s) are open; close them first");
  backend_->reset_peak();
  carried_ = 0;
}

Snapshot Tracker::snapshot() const {
  Snapshot s;
  s.device = backend_->device();
  s.current_bytes = backend_->current_bytes();
  s.peak_bytes = peak_bytes();
  s.reserved_bytes = backend_->reserved_bytes();
  s.allocation_count = backend_->allocation_count();
  s.budget_bytes = backend_->budget_bytes();
  return s;
}

PeakWindow Tracker::mark() { return open(""); }

PeakWindow Tracker::phase(std::string name) {
  TORCH_CHECK(!name.empty(), "a memory phase needs a name");
  return open(std::move(name));
}

PeakWindow Tracker::open(std::string name) {
  PhaseEvent event{PhaseEvent::Kind::Begin, name, 0, 0, detail::steady_now_ns()};
  size_t depth = 0;
  int64_t entry = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t outer = std::max(carried_, backend_->peak_bytes());
    backend_->reset_peak();
    carried_ = 0;
    entry = backend_->current_bytes();
    if (!name.empty()) backend_->set_phase_name(name);
    frames_.push_back(Frame{std::move(name), entry, outer});
    depth = frames_.size() - 1;
  }
  if (!event.name.empty()) {
    event.in_use_bytes = event.peak_bytes = entry;
    notify(event);
  }
  return PeakWindow(this, depth, entry);
}

int64_t Tracker::close(size_t depth) {
  PhaseEvent event{PhaseEvent::Kind::End, "", 0, 0, detail::steady_now_ns()};
  int64_t peak = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(depth + 1 == frames_.size(),
                "memory phase/mark windows must close in reverse order of opening");
    peak = std::max(carried_, backend_->peak_bytes());
    Frame frame = std::move(frames_.back());
    frames_.pop_back();
    carried_ = std::max(frame.outer_peak, peak);
    if (!frame.name.empty()) {
      auto& stats = phases_[frame.name];
      stats.calls += 1;
      stats.peak_bytes = std::max(stats.peak_bytes, peak);
      stats.peak_increase_bytes = std::max(stats.peak_increase_bytes, peak - frame.entry_bytes);
      stats.retained_bytes = backend_->current_bytes() - frame.entry_bytes;
    }
    std::string innermost;
    for (const auto& f : frames_) {
      if (!f.name.empty()) innermost = f.name;
    }
    backend_->set_phase_name(innermost);
    event.name = std::move(frame.name);
    event.in_use_bytes = backend_->current_bytes();
    event.peak_bytes = peak;
  }
  if (!event.name.empty()) notify(event);
  return peak;
}

int Tracker::add_listener(PhaseListener listener) {
  TORCH_CHECK(listener, "add_listener: empty listener");
  std::lock_guard<std::mutex> lock(mutex_);
  listeners_[next_listener_] = std::move(listener);
  return next_listener_++;
}

void Tracker::remove_listener(int id) {
  std::lock_guard<std::mutex> lock(mutex_);
  listeners_.erase(id);
}

void Tracker::notify(const PhaseEvent& event) {
  std::vector<PhaseListener> listeners;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [id, l] : listeners_) listeners.push_back(l);
  }
  for (const auto& l : listeners) l(event);
}

std::map<std::string, PhaseStats> Tracker::phase_stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return phases_;
}

void Tracker::clear_phase_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  phases_.clear();
}

std::string Tracker::current_phase() const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = frames_.rbegin(); it != frames_.rend(); ++it) {
    if (!it->name.empty()) return it->name;
  }
  return "";
}

// ---------------------------------------------------------------------------------------------
// PeakWindow

PeakWindow::PeakWindow(Tracker* tracker, size_t depth, int64_t entry_bytes)
    : tracker_(tracker), depth_(depth), entry_bytes_(entry_bytes) {}

PeakWindow::PeakWindow(PeakWindow&& other) noexcept
    : tracker_(other.tracker_),
      depth_(other.depth_),
      entry_bytes_(other.entry_bytes_),
      final_peak_(other.final_peak_) {
  other.tracker_ = nullptr;
}

PeakWindow::~PeakWindow() {
  try {
    close();
  } catch (...) {
    // Out-of-order close during unwinding: the accounting of this window is lost, nothing else.
  }
}

void PeakWindow::close() {
  if (tracker_ == nullptr) return;
  final_peak_ = tracker_->close(depth_);  // throws if out of order: the window stays open
  tracker_ = nullptr;
}

int64_t PeakWindow::peak_bytes() const {
  if (tracker_ == nullptr) return final_peak_;
  std::lock_guard<std::mutex> lock(tracker_->mutex_);
  return tracker_->window_peak_locked(depth_);
}

// ---------------------------------------------------------------------------------------------
// Process memory

ProcessMemory process_memory() {
  ProcessMemory m;
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    long long kib = 0;
    if (std::sscanf(line.c_str(), "VmRSS: %lld kB", &kib) == 1) m.rss_bytes = kib * 1024;
    if (std::sscanf(line.c_str(), "VmHWM: %lld kB", &kib) == 1) m.rss_peak_bytes = kib * 1024;
  }
  m.untracked_bytes = std::max<int64_t>(0, m.rss_bytes - Tracker::cpu().reserved_bytes());
  return m;
}

void release_free_heap() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

bool reset_rss_peak() {
  std::ofstream clear("/proc/self/clear_refs");
  if (!clear) return false;
  clear << "5";
  clear.flush();
  return static_cast<bool>(clear);
}

}  // namespace framefit::memory
