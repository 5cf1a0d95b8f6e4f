#include "framefit/plan/records.h"

#include <c10/util/StringUtil.h>

#include <iomanip>
#include <sstream>

#include "framefit/memory/tracker.h"

namespace framefit::plan {

void to_json(nlohmann::json& j, const Breakdown& b) {
  j = {{"parameters", b.parameters},       {"gradients", b.gradients},
       {"gradient_sums", b.gradient_sums}, {"optimizer_state", b.optimizer_state},
       {"input_frames", b.input_frames},   {"features", b.features},
       {"activations", b.activations},     {"workspace", b.workspace},
       {"peak_phase", b.peak_phase},       {"phase_peaks", b.phase_peaks}};
}

void to_json(nlohmann::json& j, const StepSettings& s) {
  j = {{"chunk", s.naive() ? 0 : s.chunk},   {"keep", s.keep},
       {"cache_frozen", s.cache_frozen},     {"precision", engine::to_string(s.precision)},
       {"recompute_norm", s.recompute_norm}, {"videos_per_call", s.videos_per_call}};
}

void to_json(nlohmann::json& j, const Finding& f) {
  j = {{"severity", f.severity == Finding::Severity::Error ? "error" : "warning"},
       {"problem", f.problem},
       {"fix", f.fix}};
}

void to_json(nlohmann::json& j, const BatchRow& row) {
  j = {{"batch", row.batch},
       {"plain_peak_bytes", row.plain_peak_bytes},
       {"planned_peak_bytes", row.planned_peak_bytes},
       {"recomputed_stages", row.recomputed_stages},
       {"fits", row.fits}};
}

std::vector<std::string> breakdown_lines(const Breakdown& b, int64_t margin_bytes) {
  std::vector<std::string> lines;
  // "    {:<26} {:>12}": the name left in 26 columns, the size right in 12.
  const auto line = [&](const std::string& name, int64_t bytes, const std::string& after = "") {
    std::ostringstream out;
    out << "    " << std::left << std::setw(26) << name << " " << std::right << std::setw(12)
        << memory::format_bytes(bytes) << after;
    lines.push_back(out.str());
  };
  line("parameters and buffers", b.parameters);
  line("gradients", b.gradients);
  if (b.gradient_sums > 0) {
    lines.push_back(c10::str("      of them ", memory::format_bytes(b.gradient_sums),
                             " the encoder's gradients summed over later chunks, held while a"));
    lines.push_back("      recomputed chunk's backward writes its own");
  }
  line("optimizer state", b.optimizer_state);
  line("input frames and labels", b.input_frames);
  line("features (+ gradient)", b.features);
  line("activations", b.activations);
  line("workspace", b.workspace);
  line("predicted peak", b.peak_bytes, "   (in " + b.peak_phase + ")");
  if (margin_bytes > 0) line("safety margin", margin_bytes);
  return lines;
}

}  // namespace framefit::plan
