#pragma once
// A phase timeline as a picture, as surgical-workflow papers show recognition results: one
// colour ribbon per sequence of per-frame class ids (ground truth, prediction), time running
// left to right, a colour per class.
#include <torch/types.h>

#include <array>
#include <cstdint>
#include <vector>

namespace framefit::train {

// Class c's colour (RGB): matplotlib's tab20 order, repeating after 20 classes.
std::array<uint8_t, 3> class_color(int64_t c);

// uint8 [3,H,W] image (data::write_image writes it): `rows` ([T] int64 class ids each, all of
// one length T) as ribbons of `row_height` pixels, 4 white pixels apart. One column per frame
// up to `max_width` columns; longer sequences are shown by the frame nearest each column's
// centre. An id < 0 (not labelled) is light gray.
torch::Tensor timeline_image(const std::vector<torch::Tensor>& rows, int64_t max_width = 2000,
                             int64_t row_height = 24);

}  // namespace framefit::train
