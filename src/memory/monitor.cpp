#include "framefit/memory/monitor.h"

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "backends.h"

namespace framefit::memory {

namespace {

// Phase names are framefit's own, but escape them anyway: the file must stay valid JSON.
std::string quoted(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}
}  // namespace

TraceRecorder::TraceRecorder(Tracker& tracker)
    : tracker_(tracker), start_ns_(detail::steady_now_ns()) {
  listener_ = tracker_.add_listener([this](const PhaseEvent& e) {
    record({e.kind == PhaseEvent::Kind::Begin ? 'B' : 'E', e.name, e.time_ns, e.in_use_bytes});
    record({'C', "bytes in use", e.time_ns, e.in_use_bytes});
    // Between two events the allocator's high-water mark is not sampled: show each phase's peak
    // as its own counter so short spikes inside a phase stay visible.
    if (e.kind == PhaseEvent::Kind::End) record({'C', "peak in phase", e.time_ns, e.peak_bytes});
  });
  record({'C', "bytes in use", start_ns_, tracker_.current_bytes()});
}

TraceRecorder::~TraceRecorder() { tracker_.remove_listener(listener_); }

void TraceRecorder::record(Event event) {
  std::lock_guard<std::mutex> lock(mutex_);
  events_.push_back(std::move(event));
}

void TraceRecorder::mark(const std::string& name) {
  record({'i', name, detail::steady_now_ns(), tracker_.current_bytes()});
}

size_t TraceRecorder::event_count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return events_.size();
}

std::string TraceRecorder::json() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::ostringstream out;
  out << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[";
  bool first = true;
  for (const auto& e : events_) {
    out << (first ? "" : ",") << "\n{\"name\":" << quoted(e.name) << ",\"ph\":\"" << e.phase
        << "\",\"ts\":" << (e.time_ns - start_ns_) / 1000.0 << ",\"pid\":1,\"tid\":1";
    if (e.phase == 'C') out << ",\"args\":{\"bytes\":" << e.bytes << "}";
    if (e.phase == 'i') out << ",\"s\":\"g\"";
    if (e.phase == 'B' || e.phase == 'E') out << ",\"args\":{\"bytes_in_use\":" << e.bytes << "}";
    out << "}";
    first = false;
  }
  out << "\n]}\n";
  return out.str();
}

void TraceRecorder::write(const std::string& path) const {
  const std::string temp = path + ".tmp";
  {
    std::ofstream file(temp, std::ios::trunc);
    TORCH_CHECK(file.good(), "cannot write trace file '", temp, "'");
    file << json();
    file.flush();
    TORCH_CHECK(file.good(), "writing trace file '", temp, "' failed");
  }
  TORCH_CHECK(std::rename(temp.c_str(), path.c_str()) == 0, "cannot rename '", temp, "' to '",
              path, "'");
}

LeakDetector::LeakDetector(LeakDetectorOptions options) : options_(options) {
  TORCH_CHECK(options.window >= 2 && options.threshold > 0 && options.warmup_steps >= 0,
              "leak detector needs window >= 2, threshold > 0, warmup_steps >= 0");
}

std::optional<std::string> LeakDetector::record(int64_t in_use_bytes,
                                                const std::map<std::string, PhaseStats>& phases) {
  if (++steps_ <= options_.warmup_steps) return std::nullopt;
  in_use_.push_back(in_use_bytes);
  std::map<std::string, int64_t> retained;
  for (const auto& [name, stats] : phases) retained[name] = stats.retained_bytes;
  retained_.push_back(std::move(retained));
  if (static_cast<int64_t>(in_use_.size()) > options_.window) {
    in_use_.pop_front();
    retained_.pop_front();
  }
  if (static_cast<int64_t>(in_use_.size()) < options_.window || steps_ < quiet_until_) {
    return std::nullopt;
  }
  const int64_t first = in_use_.front(), last = in_use_.back();
  const double growth = first > 0 ? static_cast<double>(last - first) / static_cast<double>(first) : 0;
  if (growth <= options_.threshold || last - first < options_.min_growth_bytes) return std::nullopt;
  std::map<std::string, int64_t> left_behind;
  for (const auto& step : retained_) {
    for (const auto& [name, bytes] : step) left_behind[name] += bytes;
  }
  std::string phase = "no phase (between steps)";
  int64_t most = 0;
  for (const auto& [name, bytes] : left_behind) {
    if (bytes > most) {
      most = bytes;
      phase = "phase '" + name + "'";
    }
  }
  quiet_until_ = steps_ + options_.window;
  std::ostringstream out;
  out << "possible memory leak: bytes in use after a step grew " << static_cast<int>(growth * 100)
      << "% over the last " << options_.window << " steps (" << format_bytes(first) << " -> "
      << format_bytes(last) << ")";
  // Without the steps' phases there is nothing to say where: "between steps" could mislead.
  if (!left_behind.empty()) out << "; most growth in " << phase;
  out << ". Tensors kept across steps (losses with their graph, lists of outputs) are the usual "
         "cause.";
  return out.str();
}

std::string memory_line(const Tracker& tracker, int64_t step_peak_bytes) {
  std::string line = "allocated " + format_bytes(tracker.current_bytes()) + ", step peak " +
                     format_bytes(step_peak_bytes);
  if (tracker.device().is_cuda()) line += ", reserved " + format_bytes(tracker.reserved_bytes());
  if (tracker.budget_bytes() > 0) line += " of a " + format_bytes(tracker.budget_bytes()) + " budget";
  return line;
}

}  // namespace framefit::memory
