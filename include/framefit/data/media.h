#pragma once
// Reading and writing video files and frame images with FFmpeg (libavformat, libavcodec,
// libswscale). Frames are RGB uint8 tensors, [3,H,W] for one frame and [N,3,H,W] for many,
// written straight into memory the caller owns (preallocated, pinned when training on CUDA).
// Every error is a c10::Error that names the file and what is wrong with it.
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

namespace framefit::data {

struct VideoInfo {
  int64_t frames = 0;  // from the container, or duration x frame rate when it has no count
  double fps = 0;      // average frame rate
  int64_t width = 0;
  int64_t height = 0;
  std::string codec;  // e.g. "h264"
};

// Source frame indices that sampling a video of `source_frames` frames at `source_fps` down to
// `target_fps` keeps: frame i of the result is the source frame nearest to time i / target_fps,
// round(i * source_fps / target_fps) with halves rounded up, for every time i / target_fps before
// the video's end source_frames / source_fps (so ceil(source_frames * target_fps / source_fps)
// frames). target_fps <= 0 or >= source_fps keeps every frame.
std::vector<int64_t> sample_indices(int64_t source_frames, double source_fps, double target_fps);

// Output size {height, width} that makes the shorter side `shorter_side` and keeps the aspect
// ratio: the longer side is longer * shorter_side / shorter rounded to the nearest pixel (halves
// up, e.g. 48x64 -> 112x149); a square stays square. shorter_side <= 0 keeps the source size.
std::pair<int64_t, int64_t> resized_hw(int64_t height, int64_t width, int64_t shorter_side);

// Decodes one video file. Not thread-safe; use one reader per thread. decoder_threads 0 lets
// FFmpeg choose.
class VideoReader {
 public:
  explicit VideoReader(const std::string& path, int decoder_threads = 1);
  ~VideoReader();
  VideoReader(const VideoReader&) = delete;
  VideoReader& operator=(const VideoReader&) = delete;

  const VideoInfo& info() const;
  const std::string& path() const;

  // Decodes the source frames at `indices` (ascending, repeats allowed) into out[i], resizing to
  // out's H and W. `out` is uint8 [indices.size(),3,H,W], contiguous. A stream that ends before
  // the last index is an error naming the file, the frames decoded and the frames expected
  // (truncated file; the frames before the cut still read); so is a packet the decoder rejects
  // (damage it can detect: some, such as zeroed bytes, decodes without a sign). A read whose
  // first index is past the frames an earlier read decoded continues from there; otherwise
  // decoding restarts from the first frame.
  void read(const std::vector<int64_t>& indices, torch::Tensor out);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Size of an image file {height, width}: read from the header of a JPEG or PNG (so a file whose
// pixels are damaged still has a size), by decoding for other formats.
std::pair<int64_t, int64_t> image_size(const std::string& path);

// Decodes an image file (JPEG, PNG, BMP or WebP, recognised by its first bytes; alpha is
// dropped) into `out` (uint8 [3,H,W], contiguous), resizing to out's H and W.
// A missing, empty, truncated or corrupt file (damage the decoder can detect) is an error naming
// it.
void read_image(const std::string& path, torch::Tensor out);

// Writes an image; the format follows the extension (.jpg/.jpeg: JPEG at `quality` 1-31, lower
// is better, FFmpeg's qscale; .png: PNG). `frame` is uint8 [3,H,W].
void write_image(const std::string& path, const torch::Tensor& frame, int quality = 3);

// Encodes frames into a video file (container from the extension: .mp4, .avi, .mkv). H.264
// (libx264) when available, else MPEG-4 part 2. Width and height must be even.
class VideoWriter {
 public:
  VideoWriter(const std::string& path, int64_t width, int64_t height, double fps);
  ~VideoWriter();  // finishes the file if finish() was not called (errors then are swallowed)
  VideoWriter(const VideoWriter&) = delete;
  VideoWriter& operator=(const VideoWriter&) = delete;

  void write(const torch::Tensor& frame);  // uint8 [3,H,W]
  void finish();                           // flushes the encoder and writes the trailer

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace framefit::data
