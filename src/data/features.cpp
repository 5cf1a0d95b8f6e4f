#include "framefit/data/features.h"

#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "framefit/models/weights.h"

namespace framefit::data {

namespace {

std::string extension_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  const auto dot = path.find_last_of('.');
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) return "";
  std::string ext = path.substr(dot);
  for (auto& c : ext) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return ext;
}

// The text after `'key':` in a .npy header (a Python dict literal), spaces skipped.
size_t value_of(const std::string& header, const std::string& key, const std::string& path) {
  auto at = header.find("'" + key + "'");
  if (at == std::string::npos) at = header.find("\"" + key + "\"");
  TORCH_CHECK(at != std::string::npos, "features file ", path, ": its .npy header has no '", key,
              "': ", header);
  at = header.find(':', at);
  TORCH_CHECK(at != std::string::npos, "features file ", path, ": malformed .npy header: ", header);
  ++at;
  while (at < header.size() && std::isspace(static_cast<unsigned char>(header[at]))) ++at;
  return at;
}

// The tensor type of a NumPy type string ('<f4'); little-endian only, as x86 and ARM write.
torch::ScalarType scalar_type_of(const std::string& descr, const std::string& path) {
  TORCH_CHECK(descr.size() >= 3 && descr.size() <= 4 &&
                  descr.find_first_not_of("0123456789", 2) == std::string::npos,
              "features file ", path, ": unknown .npy type '", descr, "'");
  const char order = descr[0], kind = descr[1];
  const int size = std::atoi(descr.c_str() + 2);
  TORCH_CHECK(order != '>' || size == 1, "features file ", path, ": big-endian data ('", descr,
              "'); save it little-endian, e.g. np.save(path, a.astype('<f4'))");
  if (kind == 'f' && size == 2) return torch::kHalf;
  if (kind == 'f' && size == 4) return torch::kFloat32;
  if (kind == 'f' && size == 8) return torch::kFloat64;
  if (kind == 'i' && size == 1) return torch::kInt8;
  if (kind == 'i' && size == 2) return torch::kInt16;
  if (kind == 'i' && size == 4) return torch::kInt32;
  if (kind == 'i' && size == 8) return torch::kInt64;
  if (kind == 'u' && size == 1) return torch::kUInt8;
  if (kind == 'b' && size == 1) return torch::kBool;
  TORCH_CHECK(false, "features file ", path, ": .npy type '", descr,
              "' is not supported (floating point, signed integers, uint8 or bool)");
}

}  // namespace

NpyHeader read_npy_header(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "features file ", path, ": cannot open");
  std::error_code error;
  const auto file_bytes = static_cast<int64_t>(std::filesystem::file_size(path, error));
  TORCH_CHECK(!error, "features file ", path, ": cannot read its size: ", error.message());
  char magic[8];
  in.read(magic, sizeof magic);
  TORCH_CHECK(in.gcount() == 8 && std::memcmp(magic, "\x93NUMPY", 6) == 0, "features file ", path,
              ": not a NumPy .npy file (it does not start with \\x93NUMPY)");
  const int major = static_cast<unsigned char>(magic[6]);
  TORCH_CHECK(major >= 1 && major <= 3, "features file ", path, ": .npy version ", major, ".",
              static_cast<int>(static_cast<unsigned char>(magic[7])),
              " is not supported (1.0 to 3.0)");
  // Version 1 gives the header length in 2 little-endian bytes, later versions in 4.
  const int length_bytes = major == 1 ? 2 : 4;
  unsigned char length_field[4] = {0, 0, 0, 0};
  in.read(reinterpret_cast<char*>(length_field), length_bytes);
  TORCH_CHECK(in.gcount() == length_bytes, "features file ", path, ": truncated .npy header");
  const uint32_t length = length_field[0] | (length_field[1] << 8) | (length_field[2] << 16) |
                          (static_cast<uint32_t>(length_field[3]) << 24);
  // Checked before allocating: a damaged length field can say 4 GiB.
  TORCH_CHECK(8 + length_bytes + static_cast<int64_t>(length) <= file_bytes, "features file ", path,
              ": truncated .npy header (", length, " bytes said, ", file_bytes - 8 - length_bytes,
              " in the file)");
  std::string header(length, '\0');
  in.read(header.data(), length);
  TORCH_CHECK(in.gcount() == static_cast<std::streamsize>(length), "features file ", path,
              ": truncated .npy header");
  // The padding (spaces and a newline) is not shown in messages.
  header.erase(header.find_last_not_of(" \n\r\t") + 1);

  NpyHeader result;
  result.data_offset = 8 + length_bytes + length;
  size_t at = value_of(header, "descr", path);
  TORCH_CHECK(at < header.size() && (header[at] == '\'' || header[at] == '"'), "features file ",
              path, ": a structured .npy type (", header,
              "); save a plain array of one number type");
  const auto end = header.find(header[at], at + 1);
  TORCH_CHECK(end != std::string::npos, "features file ", path, ": malformed .npy header");
  result.descr = header.substr(at + 1, end - at - 1);
  const auto type = scalar_type_of(result.descr, path);  // checked where the header is read

  at = value_of(header, "fortran_order", path);
  result.fortran_order = header.compare(at, 4, "True") == 0;
  TORCH_CHECK(result.fortran_order || header.compare(at, 5, "False") == 0, "features file ", path,
              ": malformed fortran_order in its .npy header: ", header);

  at = value_of(header, "shape", path);
  const auto close = header.find(')', at);
  TORCH_CHECK(at < header.size() && header[at] == '(' && close != std::string::npos,
              "features file ", path, ": malformed shape in its .npy header: ", header);
  std::string dims = header.substr(at + 1, close - at - 1);
  size_t begin = 0;
  while (begin <= dims.size()) {
    auto comma = dims.find(',', begin);
    if (comma == std::string::npos) comma = dims.size();
    std::string item = dims.substr(begin, comma - begin);
    item.erase(std::remove_if(item.begin(), item.end(),
                              [](char c) { return std::isspace(static_cast<unsigned char>(c)); }),
               item.end());
    if (!item.empty() && item.back() == 'L') item.pop_back();  // Python 2's long integers
    if (!item.empty()) {
      TORCH_CHECK(std::all_of(item.begin(), item.end(),
                              [](char c) { return std::isdigit(static_cast<unsigned char>(c)); }),
                  "features file ", path, ": malformed shape in its .npy header: ", header);
      errno = 0;
      const long long dim = std::strtoll(item.c_str(), nullptr, 10);
      TORCH_CHECK(errno == 0, "features file ", path,
                  ": a dimension out of range in its .npy header: ", header);
      result.shape.push_back(dim);
    }
    begin = comma + 1;
  }

  // The data's size from the shape, before anything is allocated for it: a damaged shape can
  // ask for terabytes, and a file shorter or longer than its shape says is damaged.
  uint64_t data_bytes = c10::elementSize(type);
  bool overflow = false;
  for (const int64_t dim : result.shape)
    overflow =
        overflow || __builtin_mul_overflow(data_bytes, static_cast<uint64_t>(dim), &data_bytes);
  const int64_t stored = file_bytes - result.data_offset;
  const bool short_data = overflow || static_cast<uint64_t>(stored) < data_bytes;
  TORCH_CHECK(!overflow && data_bytes == static_cast<uint64_t>(stored), "features file ", path,
              short_data ? ": truncated: " : ": damaged: ", stored,
              " bytes of data where its header's shape ", torch::IntArrayRef(result.shape), " of '",
              result.descr, "' needs ", overflow ? "more than 2^64" : std::to_string(data_bytes),
              short_data ? "" : " (the file is longer than its header says)");
  return result;
}

torch::Tensor read_npy(const std::string& path) {
  const auto header = read_npy_header(path);
  const auto type = scalar_type_of(header.descr, path);
  // Column-major data is the transpose of its reversed shape, stored row-major.
  auto stored_shape = header.shape;
  if (header.fortran_order) std::reverse(stored_shape.begin(), stored_shape.end());
  auto tensor = torch::empty(stored_shape, torch::TensorOptions(type));
  const auto bytes = static_cast<std::streamsize>(tensor.nbytes());
  std::ifstream in(path, std::ios::binary);
  in.seekg(header.data_offset);
  in.read(static_cast<char*>(tensor.data_ptr()), bytes);
  TORCH_CHECK(in.gcount() == bytes, "features file ", path, ": changed while read: ", in.gcount(),
              " bytes of data where its header's shape ", torch::IntArrayRef(header.shape), " of '",
              header.descr, "' needs ", bytes);
  if (header.fortran_order) {
    std::vector<int64_t> reverse(header.shape.size());
    for (size_t i = 0; i < reverse.size(); ++i)
      reverse[i] = static_cast<int64_t>(reverse.size() - 1 - i);
    tensor = tensor.permute(reverse).contiguous();
  }
  return tensor;
}

FeatureLayout parse_feature_layout(const std::string& text) {
  if (text == "auto") return FeatureLayout::Auto;
  if (text == "T,D") return FeatureLayout::TimeFirst;
  if (text == "D,T") return FeatureLayout::FeaturesFirst;
  TORCH_CHECK(false, "unknown features layout '", text,
              "': auto, T,D (time first, as framefit extract writes) or D,T (features first, as "
              "MS-TCN's .npy files)");
}

void check_feature_shape(const std::vector<int64_t>& shape, const std::string& path) {
  TORCH_CHECK(shape.size() == 2, "features file ", path, ": an array of shape ",
              torch::IntArrayRef(shape), "; features are 2-D, [T,D] or [D,T]");
  TORCH_CHECK(shape[0] > 0 && shape[1] > 0, "features file ", path, ": an empty array (shape ",
              torch::IntArrayRef(shape), "); features need at least one frame of one feature");
}

namespace {
void check_format(const std::string& path) {
  const auto ext = extension_of(path);
  TORCH_CHECK(ext == ".npy" || ext == ".pt" || ext == ".pth", "features file ", path, ": ",
              ext.empty() ? "no extension to tell its format by" : "unknown format '" + ext + "'",
              " (a NumPy .npy file, or a tensor saved with torch.save as .pt or .pth)");
}
}  // namespace

std::vector<int64_t> feature_file_shape(const std::string& path) {
  check_format(path);
  if (extension_of(path) == ".npy") return read_npy_header(path).shape;
  return models::read_tensor(path).sizes().vec();
}

bool time_first(const std::vector<int64_t>& shape, FeatureLayout layout, int64_t frames,
                int64_t dim, const std::string& path) {
  check_feature_shape(shape, path);
  if (layout != FeatureLayout::Auto) return layout == FeatureLayout::TimeFirst;
  const bool by_frames = frames > 0;
  const int64_t length = by_frames ? frames : dim;
  const bool first = shape[0] == length, second = shape[1] == length;
  TORCH_CHECK(!(first && second), "features file ", path, ": both axes of its shape ",
              torch::IntArrayRef(shape), " are ", length,
              " long, so which one is time is not clear: set data.features_layout to T,D or D,T");
  TORCH_CHECK(first || second, "features file ", path, ": neither axis of its shape ",
              torch::IntArrayRef(shape), " is ", length, " long, ",
              by_frames ? "the number of labels in its annotation: one row of features per "
                          "labelled frame is needed"
                        : "the model's feature size");
  return by_frames ? first : second;
}

torch::Tensor read_features(const std::string& path, bool time_first) {
  check_format(path);
  auto tensor = extension_of(path) == ".npy" ? read_npy(path) : models::read_tensor(path);
  check_feature_shape(tensor.sizes().vec(), path);
  if (!time_first) tensor = tensor.t();
  tensor = tensor.to(torch::kFloat32).contiguous();
  const auto finite = torch::isfinite(tensor).all(1);
  if (!finite.all().item<bool>()) {
    const int64_t row = torch::logical_not(finite).nonzero()[0][0].item<int64_t>();
    TORCH_CHECK(false, "features file ", path, ": frame ", row,
                "'s features are not finite (NaN or infinity)");
  }
  return tensor;
}

torch::Tensor every_kth_row(const torch::Tensor& features, int64_t k) {
  TORCH_CHECK(k >= 1, "a features stride must be >= 1 (1 takes every row), got ", k);
  return k == 1 ? features : features.slice(0, 0, features.size(0), k).contiguous();
}

}  // namespace framefit::data
