#pragma once
// Per-frame features computed elsewhere, for training a temporal head on them alone (two-stage
// training, as MS-TCN and TeCNO do): NumPy .npy files (MS-TCN's I3D features are [D,T] float32)
// and tensors saved with torch.save (`framefit extract` writes [T,D]).
#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace framefit::data {

// A .npy file's header: element type ('<f4'), shape, and whether it is stored column-major.
struct NpyHeader {
  std::string descr;
  std::vector<int64_t> shape;
  bool fortran_order = false;
  int64_t data_offset = 0;  // bytes before the data
};
// Reads and checks the header (versions 1.0, 2.0 and 3.0), and that the file holds as many
// bytes of data as its shape says, no more, no fewer. Errors name the file and say what is
// wrong: not a .npy file, a structured or big-endian type, a malformed header, a truncated file.
NpyHeader read_npy_header(const std::string& path);
// The whole array as a tensor of its own type (float16/32/64, int8..64, uint8, bool), C order.
torch::Tensor read_npy(const std::string& path);

// How a features file's two axes are ordered: time first ([T,D], framefit extract), features
// first ([D,T], MS-TCN), or auto: the axis whose length is the frame count is time.
enum class FeatureLayout { Auto, TimeFirst, FeaturesFirst };
FeatureLayout parse_feature_layout(const std::string& text);  // "auto" | "T,D" | "D,T"

// Features are 2-D ([T,D] or [D,T]); any other shape is an error naming the file.
void check_feature_shape(const std::vector<int64_t>& shape, const std::string& path);

// A features file's shape without its data where the format allows (.npy: the header; a
// torch.save file is read whole). Any other extension is an error naming the formats.
std::vector<int64_t> feature_file_shape(const std::string& path);
// Whether `shape` is [T,D] for `layout`; auto decides by `frames` (the label count), or by
// `dim` (the model's feature size) when frames is 0. Not 2-D, ambiguous or matching neither:
// an error naming the file and what to set.
bool time_first(const std::vector<int64_t>& shape, FeatureLayout layout, int64_t frames,
                int64_t dim, const std::string& path);
// The file's features as float32 [T,D] (transposed when the file is [D,T]).
torch::Tensor read_features(const std::string& path, bool time_first);
// Rows 0, k, 2k, ... of features [T,D] (k >= 1), contiguous: MS-TCN's sample_rate.
torch::Tensor every_kth_row(const torch::Tensor& features, int64_t k);

}  // namespace framefit::data
