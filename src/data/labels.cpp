#include "framefit/data/labels.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

namespace framefit::data {

ClassList::ClassList(std::vector<std::string> names) : names_(std::move(names)) {
  for (size_t i = 0; i < names_.size(); ++i) {
    TORCH_CHECK(!names_[i].empty(), "class list: class ", i, " has an empty name");
    TORCH_CHECK(std::find(names_.begin(), names_.begin() + i, names_[i]) == names_.begin() + i,
                "class list: \"", names_[i], "\" appears twice");
  }
}

int64_t ClassList::find(const std::string& name) const {
  const auto it = std::find(names_.begin(), names_.end(), name);
  return it == names_.end() ? -1 : static_cast<int64_t>(it - names_.begin());
}

namespace {

std::ifstream open_for_reading(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), what, " ", path, ": cannot open (", std::strerror(errno), ")");
  // Spreadsheets and Windows editors start UTF-8 text with a byte-order mark; it would otherwise
  // become part of the first column's name or the first field.
  char bom[3] = {};
  if (!in.read(bom, 3) || bom[0] != '\xEF' || bom[1] != '\xBB' || bom[2] != '\xBF') {
    in.clear();
    in.seekg(0);
  }
  return in;
}

// A NUL byte means a binary or damaged file, and would cut every message quoting the line short.
void check_text(const std::string& line, const std::string& where) {
  TORCH_CHECK(line.find('\0') == std::string::npos, where,
              ": holds a NUL byte: not a text file, or a damaged one");
}

std::string trim(const std::string& s) {
  const auto begin = s.find_first_not_of(" \t\r\n");
  if (begin == std::string::npos) return "";
  const auto end = s.find_last_not_of(" \t\r\n");
  return s.substr(begin, end - begin + 1);
}

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

// Splits a CSV line; fields may be quoted ("a, b" and "" for a quote inside).
std::vector<std::string> split_csv(const std::string& line, const std::string& where) {
  std::vector<std::string> fields(1);
  bool quoted = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted) {
      if (c == '"' && i + 1 < line.size() && line[i + 1] == '"') {
        fields.back() += '"';
        ++i;
      } else if (c == '"') {
        quoted = false;
      } else {
        fields.back() += c;
      }
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      fields.emplace_back();
    } else if (c != '\r') {
      fields.back() += c;
    }
  }
  TORCH_CHECK(!quoted, where, ": unterminated quoted field");
  for (auto& f : fields) f = trim(f);
  return fields;
}

std::string csv_field(const std::string& value) {
  if (value.find_first_of(",\"") == std::string::npos) return value;
  std::string out = "\"";
  for (const char c : value) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

}  // namespace

std::vector<int64_t> read_phase_annotations(const std::string& path, const ClassList& classes) {
  auto in = open_for_reading(path, "annotation file");
  std::vector<int64_t> labels;
  std::string line;
  int64_t line_number = 0;
  enum class Layout { Unknown, Numbered, LabelPerLine } layout = Layout::Unknown;
  while (std::getline(in, line)) {
    ++line_number;
    const auto text = trim(line);
    if (text.empty()) continue;
    std::string frame_text, phase, extra;
    const auto tab = text.find('\t');
    if (tab != std::string::npos) {
      // Tab-separated: a phase name may hold spaces ("Calot triangle dissection").
      frame_text = trim(text.substr(0, tab));
      phase = trim(text.substr(tab + 1));
      if (phase.find('\t') != std::string::npos) extra = phase;
    } else {
      std::istringstream fields(text);
      fields >> frame_text >> phase >> extra;
    }
    const std::string where = path + ":" + std::to_string(line_number);
    check_text(line, where);
    if (layout == Layout::Unknown) {
      layout = phase.empty() ? Layout::LabelPerLine : Layout::Numbered;
      if (frame_text == "Frame") continue;  // Cholec80's header
    }
    if (layout == Layout::LabelPerLine) {
      // MS-TCN's ground truth: the line is the label (names hold no spaces there).
      TORCH_CHECK(phase.empty(), where,
                  ": expected one label per line, as the first line has, got \"", text, "\"");
      phase = frame_text;
    } else {
      TORCH_CHECK(!phase.empty() && extra.empty(), where,
                  ": expected `<frame><TAB><phase>`, got \"", text, "\"");
      char* end = nullptr;
      const long long frame = std::strtoll(frame_text.c_str(), &end, 10);
      TORCH_CHECK(end != frame_text.c_str() && *end == '\0' && frame >= 0, where,
                  ": frame number \"", frame_text, "\" is not a non-negative integer");
      TORCH_CHECK(frame == static_cast<long long>(labels.size()), where, ": frame ", frame,
                  " where frame ", labels.size(),
                  " was expected (frames must be numbered 0, 1, 2, ... without gaps or repeats)");
    }
    int64_t id = classes.find(phase);
    if (id < 0 && phase.find_first_not_of("0123456789") == std::string::npos && phase.size() < 10 &&
        std::stoll(phase) < classes.size()) {
      id = std::stoll(phase);  // a phase given by its index in the class list (0-based)
    }
    TORCH_CHECK(id >= 0, where, ": unknown phase \"", phase,
                "\"; the class list has: ", join(classes.names()), " (or their indices 0..",
                classes.size() - 1, ")");
    labels.push_back(id);
  }
  TORCH_CHECK(!labels.empty(), "annotation file ", path, ": no frames");
  return labels;
}

std::vector<int64_t> labels_at_times(const std::vector<int64_t>& labels, double labels_fps,
                                     const std::vector<double>& seconds) {
  TORCH_CHECK(labels_fps > 0 && !labels.empty(), "labels_at_times: needs labels and a rate");
  std::vector<int64_t> out;
  out.reserve(seconds.size());
  const auto last = static_cast<int64_t>(labels.size()) - 1;
  for (const double t : seconds) {
    // The epsilon keeps k / fps * fps from landing just below k.
    const auto line = static_cast<int64_t>(std::floor(t * labels_fps + 1e-6));
    out.push_back(labels[static_cast<size_t>(std::clamp<int64_t>(line, 0, last))]);
  }
  return out;
}

void write_phase_annotations(const std::string& path, const std::vector<int64_t>& labels,
                             const ClassList& classes) {
  std::ofstream out(path);
  TORCH_CHECK(out.good(), "annotation file ", path, ": cannot write");
  out << "Frame\tPhase\n";
  for (size_t i = 0; i < labels.size(); ++i) {
    TORCH_CHECK(labels[i] >= 0 && labels[i] < classes.size(), "label ", labels[i], " of frame ", i,
                " is not a class id");
    out << i << '\t' << classes.names()[labels[i]] << '\n';
  }
  TORCH_CHECK(out.good(), "annotation file ", path, ": write failed");
}

const float* ToolAnnotations::at(int64_t frame) const {
  const auto it = std::lower_bound(frames.begin(), frames.end(), frame);
  if (it == frames.end() || *it != frame) return nullptr;
  return presence.data() + (it - frames.begin()) * static_cast<int64_t>(tools.size());
}

ToolAnnotations read_tool_annotations(const std::string& path,
                                      const std::vector<std::string>& tools) {
  TORCH_CHECK(!tools.empty(), "read_tool_annotations: name the tools to read");
  auto in = open_for_reading(path, "tool annotation file");
  ToolAnnotations out;
  out.tools = tools;
  std::vector<size_t> columns;  // of each asked-for tool
  size_t width = 0;
  std::string line;
  int64_t line_number = 0;
  while (std::getline(in, line)) {
    ++line_number;
    const auto text = trim(line);
    if (text.empty()) continue;
    std::istringstream stream(text);
    std::vector<std::string> fields;
    for (std::string f; stream >> f;) fields.push_back(f);
    const std::string where = path + ":" + std::to_string(line_number);
    check_text(line, where);
    if (columns.empty()) {
      TORCH_CHECK(fields.size() >= 2 && fields[0] == "Frame", where,
                  ": expected a header `Frame<TAB><tool><TAB>...` naming the tools, got \"", text,
                  "\"");
      const std::vector<std::string> header(fields.begin() + 1, fields.end());
      for (const auto& tool : tools) {
        const auto it = std::find(header.begin(), header.end(), tool);
        TORCH_CHECK(it != header.end(), where, ": no column \"", tool,
                    "\" (data.tools); the file has ", join(header));
        columns.push_back(static_cast<size_t>(it - header.begin()) + 1);
      }
      width = fields.size();
      continue;
    }
    TORCH_CHECK(fields.size() == width, where, ": ", fields.size(), " fields where the header has ",
                width);
    char* end = nullptr;
    const long long frame = std::strtoll(fields[0].c_str(), &end, 10);
    TORCH_CHECK(end != fields[0].c_str() && *end == '\0' && frame >= 0, where, ": frame number \"",
                fields[0], "\" is not a non-negative integer");
    TORCH_CHECK(out.frames.empty() || frame > out.frames.back(), where, ": frame ", frame,
                " after frame ", out.frames.empty() ? 0 : out.frames.back(),
                " (frames must increase)");
    out.frames.push_back(frame);
    for (size_t k = 0; k < columns.size(); ++k) {
      const auto& value = fields[columns[k]];
      TORCH_CHECK(value == "0" || value == "1", where, ": tool ", tools[k], " is \"", value,
                  "\"; expected 0 (absent) or 1 (present)");
      out.presence.push_back(value == "1" ? 1.0F : 0.0F);
    }
  }
  TORCH_CHECK(!columns.empty(), "tool annotation file ", path, ": empty (expected a header)");
  TORCH_CHECK(!out.frames.empty(), "tool annotation file ", path, ": no annotated frames");
  return out;
}

void write_tool_annotations(const std::string& path, const std::vector<std::string>& tools,
                            const std::vector<float>& presence) {
  const auto k = tools.size();
  TORCH_CHECK(k > 0 && presence.size() % k == 0, "tool annotation file ", path, ": ",
              presence.size(), " values are not rows of ", k, " tools");
  std::ofstream out(path);
  TORCH_CHECK(out.good(), "tool annotation file ", path, ": cannot write");
  out << "Frame";
  for (const auto& t : tools) out << '\t' << t;
  out << '\n';
  for (size_t row = 0; row * k < presence.size(); ++row) {
    if (presence[row * k] < 0) continue;  // not annotated
    out << row;
    for (size_t j = 0; j < k; ++j) out << '\t' << (presence[row * k + j] > 0.5F ? 1 : 0);
    out << '\n';
  }
  TORCH_CHECK(out.good(), "tool annotation file ", path, ": write failed");
}

std::vector<float> tools_of_frames(const ToolAnnotations& annotations,
                                   const std::vector<int64_t>& annotation_frames) {
  const auto k = annotations.tools.size();
  std::vector<float> out;
  out.reserve(annotation_frames.size() * k);
  for (const int64_t frame : annotation_frames) {
    const float* row = annotations.at(frame);
    for (size_t j = 0; j < k; ++j) out.push_back(row ? row[j] : -1.0F);
  }
  return out;
}

std::vector<VideoEntry> read_manifest(const std::string& path) {
  auto in = open_for_reading(path, "manifest");
  const auto folder = std::filesystem::path(path).parent_path();
  auto resolve = [&](const std::string& p) {
    if (p.empty() || std::filesystem::path(p).is_absolute()) return p;
    return (folder / p).lexically_normal().string();
  };
  std::string line;
  int64_t line_number = 0;
  std::map<std::string, size_t> column;
  size_t columns = 0;
  std::vector<VideoEntry> entries;
  std::map<std::string, int64_t> first_line;  // video name -> its line
  while (std::getline(in, line)) {
    ++line_number;
    if (trim(line).empty() || trim(line)[0] == '#') continue;
    const std::string where = path + ":" + std::to_string(line_number);
    check_text(line, where);
    const auto fields = split_csv(line, where);
    if (column.empty()) {
      for (size_t i = 0; i < fields.size(); ++i) {
        TORCH_CHECK(column.emplace(fields[i], i).second, where, ": column \"", fields[i],
                    "\" appears twice");
        static const std::vector<std::string> known = {"name", "video",      "labels",   "split",
                                                       "fps",  "labels_fps", "features", "tools"};
        TORCH_CHECK(std::find(known.begin(), known.end(), fields[i]) != known.end(), where,
                    ": unknown column \"", fields[i], "\" (known: ", join(known), ")");
      }
      TORCH_CHECK((column.count("video") || column.count("features")) && column.count("labels"),
                  where, ": the header must name the columns `video` (or `features`) and `labels`");
      columns = fields.size();
      continue;
    }
    TORCH_CHECK(fields.size() == columns, where, ": ", fields.size(),
                " fields where the header has ", columns);
    auto get = [&](const char* name) {
      const auto it = column.find(name);
      return it == column.end() ? std::string() : fields[it->second];
    };
    VideoEntry entry;
    entry.video = resolve(get("video"));
    entry.labels = resolve(get("labels"));
    entry.features = resolve(get("features"));
    entry.tools = resolve(get("tools"));
    TORCH_CHECK((!entry.video.empty() || !entry.features.empty()) && !entry.labels.empty(), where,
                ": `labels` and one of `video` and `features` must not be empty");
    entry.name = get("name");
    if (entry.name.empty()) {
      entry.name =
          std::filesystem::path(entry.video.empty() ? entry.features : entry.video).stem().string();
    }
    entry.split = get("split");
    if (entry.split.empty()) entry.split = "train";
    const auto rate = [&](const char* name) {
      const auto text = get(name);
      if (text.empty()) return 0.0;
      char* end = nullptr;
      const double value = std::strtod(text.c_str(), &end);
      TORCH_CHECK(*end == '\0' && value > 0 && std::isfinite(value), where, ": ", name, " \"", text,
                  "\" is not a positive number");
      return value;
    };
    entry.fps = rate("fps");
    entry.labels_fps = rate("labels_fps");
    // Outputs (predictions, features, metrics) are named by video; a line given twice would also
    // train its video twice as often.
    const auto first = first_line.emplace(entry.name, line_number);
    TORCH_CHECK(first.second, where, ": a second video named \"", entry.name,
                "\" (the first is on line ", first.first->second,
                "); give each video its own `name`");
    entries.push_back(std::move(entry));
  }
  TORCH_CHECK(!column.empty(), "manifest ", path,
              ": empty (expected a header line and one line per video)");
  return entries;
}

void write_manifest(const std::string& path, const std::vector<VideoEntry>& entries) {
  std::ofstream out(path);
  TORCH_CHECK(out.good(), "manifest ", path, ": cannot write");
  const bool labels_fps = std::any_of(entries.begin(), entries.end(),
                                      [](const VideoEntry& e) { return e.labels_fps > 0; });
  const bool features = std::any_of(entries.begin(), entries.end(),
                                    [](const VideoEntry& e) { return !e.features.empty(); });
  const bool tools = std::any_of(entries.begin(), entries.end(),
                                 [](const VideoEntry& e) { return !e.tools.empty(); });
  out << "name,video,labels,split,fps" << (labels_fps ? ",labels_fps" : "")
      << (features ? ",features" : "") << (tools ? ",tools" : "") << "\n";
  for (const auto& e : entries) {
    out << csv_field(e.name) << ',' << csv_field(e.video) << ',' << csv_field(e.labels) << ','
        << csv_field(e.split) << ',';
    if (e.fps > 0) out << e.fps;
    if (labels_fps) {
      out << ',';
      if (e.labels_fps > 0) out << e.labels_fps;
    }
    if (features) out << ',' << csv_field(e.features);
    if (tools) out << ',' << csv_field(e.tools);
    out << '\n';
  }
  TORCH_CHECK(out.good(), "manifest ", path, ": write failed");
}

std::vector<VideoEntry> select_split(const std::vector<VideoEntry>& entries,
                                     const std::string& split) {
  std::vector<VideoEntry> out;
  for (const auto& e : entries) {
    if (e.split == split) out.push_back(e);
  }
  return out;
}

std::string unused_splits(const std::vector<VideoEntry>& entries,
                          const std::vector<std::string>& used) {
  std::map<std::string, std::vector<std::string>> unused;  // split -> its videos' names
  for (const auto& e : entries) {
    if (std::find(used.begin(), used.end(), e.split) == used.end())
      unused[e.split].push_back(e.name);
  }
  if (unused.empty()) return {};
  std::string text;
  for (const auto& [split, names] : unused) {
    text +=
        c10::str(text.empty() ? "" : "; ", names.size(), names.size() == 1 ? " video" : " videos",
                 " in split \"", split, "\" (", c10::Join(", ", names), ")");
  }
  return text + c10::str(" used by none of the splits ", c10::Join(", ", used),
                         ": check the manifest's split column");
}

}  // namespace framefit::data
