// A build without FFmpeg: every reader and writer says how to build with it.
#ifndef FRAMEFIT_WITH_FFMPEG
#include "framefit/data/media.h"

#include <torch/torch.h>

#include <cstdlib>

namespace framefit::data {

namespace {
[[noreturn]] void no_ffmpeg() {
  TORCH_CHECK(false,
              "framefit was built without FFmpeg (configure with -DFRAMEFIT_WITH_FFMPEG=ON and "
              "the libavformat/libavcodec/libswscale development packages)");
  std::abort();  // not reached; TORCH_CHECK(false) throws
}
}  // namespace

struct VideoReader::State {
  VideoInfo info;
  std::string path;
};
VideoReader::VideoReader(const std::string&, int, bool) { no_ffmpeg(); }
VideoReader::~VideoReader() = default;
const VideoInfo& VideoReader::info() const { return state_->info; }
const std::string& VideoReader::path() const { return state_->path; }
int64_t VideoReader::frames_decoded() const { no_ffmpeg(); }
void VideoReader::read(const std::vector<int64_t>&, torch::Tensor, const FrameWindow&) {
  no_ffmpeg();
}
void VideoReader::read_pieces(const std::vector<int64_t>&, torch::Tensor,
                              const std::function<void(int64_t)>&, const FrameWindow&) {
  no_ffmpeg();
}
VideoReader::FrameTimes VideoReader::frame_times() { no_ffmpeg(); }

std::pair<int64_t, int64_t> image_size(const std::string&, const std::string&) { no_ffmpeg(); }
void read_image(const std::string&, torch::Tensor, const FrameWindow&) { no_ffmpeg(); }
torch::Tensor read_label_image(const std::string&) { no_ffmpeg(); }
void write_image(const std::string&, const torch::Tensor&, int) { no_ffmpeg(); }
void write_label_image(const std::string&, const torch::Tensor&) { no_ffmpeg(); }

struct VideoWriter::State {};
VideoWriter::VideoWriter(const std::string&, int64_t, int64_t, double) { no_ffmpeg(); }
VideoWriter::~VideoWriter() = default;
void VideoWriter::write(const torch::Tensor&) { no_ffmpeg(); }
void VideoWriter::finish() { no_ffmpeg(); }

}  // namespace framefit::data

#endif  // FRAMEFIT_WITH_FFMPEG

