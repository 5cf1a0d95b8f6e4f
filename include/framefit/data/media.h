#pragma once
// Reading and writing video files and frame images with FFmpeg (libavformat, libavcodec,
// libswscale). Frames are RGB uint8 tensors, [3,H,W] for one frame and [N,3,H,W] for many,
// written straight into memory the caller owns (preallocated, pinned when training on CUDA).
// Every error is a c10::Error that names the file and what is wrong with it.
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace framefit::data {

struct VideoInfo {
  int64_t frames = 0;  // from the container, or duration x frame rate when it has no count
  // The container has no frame count (Matroska, WebM): `frames` is an estimate, and
  // VideoReader::frame_times counts them.
  bool frames_estimated = false;
  double fps = 0;     // average frame rate
  int64_t width = 0;  // as displayed: after `rotation`
  int64_t height = 0;
  std::string codec;  // e.g. "h264"
  // Counterclockwise quarter turns (0, 90, 180, 270 degrees) the container's display matrix asks
  // for, as phones record portrait video; frames are read upright, as players and the ffmpeg CLI
  // show them. Other angles and mirroring are not applied.
  int rotation = 0;
  // The stream's timestamps do not follow one rate (its base rate and average rate differ, as in
  // phone and screen recordings): frames are not i / fps apart, see VideoReader::frame_times.
  bool variable_rate = false;
};

// Source frame indices that sampling a video of `source_frames` frames at `source_fps` down to
// `target_fps` keeps: frame i of the result is the source frame nearest to time i / target_fps,
// round(i * source_fps / target_fps) with halves rounded up, for every time i / target_fps before
// the video's end source_frames / source_fps (so ceil(source_frames * target_fps / source_fps)
// frames). target_fps <= 0 or >= source_fps keeps every frame.
std::vector<int64_t> sample_indices(int64_t source_frames, double source_fps, double target_fps);

// The same for frames at the given presentation times (seconds, ascending, as
// VideoReader::frame_times gives them) in a video that ends at `end_seconds`: frame i of the
// result is the source frame nearest in time to i / target_fps (the later one on a tie), for
// every such time before the end. Frames closer than 1 / target_fps are skipped and frames
// further apart repeated, so the result has one frame per 1 / target_fps of video (as with the
// ffmpeg CLI's fps filter, which takes the last frame within half a period of each time instead
// of the nearest). On times i / fps this is sample_indices for target_fps < fps.
// target_fps <= 0 keeps every frame.
std::vector<int64_t> sample_times(const std::vector<double>& times, double end_seconds,
                                  double target_fps);

// Output size {height, width} that makes the shorter side `shorter_side` and keeps the aspect
// ratio: the longer side is longer * shorter_side / shorter rounded to the nearest pixel (halves
// up, e.g. 48x64 -> 112x149); a square stays square. shorter_side <= 0 keeps the source size.
std::pair<int64_t, int64_t> resized_hw(int64_t height, int64_t width, int64_t shorter_side);

// A crop taken while frames are converted, so a cropped video is never held at full size:
// frames are resized to height x width and the window of the output's size at (top, left) kept.
// The default (height 0) resizes to the output's size and keeps all of it.
struct FrameWindow {
  int64_t height = 0, width = 0;
  int64_t top = 0, left = 0;
};

// Decodes one video file. Not thread-safe; use one reader per thread. decoder_threads 0 lets
// FFmpeg choose. skip_unsampled: read() leaves out the frames it does not return that no other
// frame refers to (most B-frames), which the frames it returns do not depend on; false decodes
// every frame up to the last one asked for (for comparison).
class VideoReader {
 public:
  explicit VideoReader(const std::string& path, int decoder_threads = 1,
                       bool skip_unsampled = true);
  ~VideoReader();
  VideoReader(const VideoReader&) = delete;
  VideoReader& operator=(const VideoReader&) = delete;

  const VideoInfo& info() const;
  const std::string& path() const;

  // Presentation time of every frame, from the container's packets (the file is read once
  // more, without decoding). For a constant rate these are i / fps up to the container's rounding.
  struct FrameTimes {
    std::vector<double> seconds;  // per frame, from the first frame, in display order
    double end_seconds = 0;       // the last frame's time plus its duration
  };
  FrameTimes frame_times();

  // Decodes the source frames at `indices` (ascending, repeats allowed) into out[i], resizing to
  // out's H and W (or to `window`'s size, keeping its window). `out` is uint8
  // [indices.size(),3,H,W], contiguous. A stream that ends before
  // the last index is an error naming the file, the frames decoded and the frames expected
  // (truncated file; the frames before the cut still read); so is a packet the decoder rejects
  // (damage it can detect: some, such as zeroed bytes, decodes without a sign). A read whose
  // first index is past the frames an earlier read decoded continues from there (unless that
  // read skipped frames); otherwise decoding restarts from the first frame. When the indices
  // leave frames out, the container's packets are read once more first (without decoding), to
  // know which frame each packet holds.
  void read(const std::vector<int64_t>& indices, torch::Tensor out, const FrameWindow& window = {});

  // read() a piece at a time, for videos longer than memory holds: the frames at `indices`
  // go into `piece` [K,3,H,W] (uint8, contiguous) K at a time, and `on_piece(count)` is called
  // each time it holds the next K of them (the last call: the rest), before it is overwritten.
  // One pass over the video, as read() makes; errors as read()'s, and the pieces handed on
  // before an error are not handed on again.
  void read_pieces(const std::vector<int64_t>& indices, torch::Tensor piece,
                   const std::function<void(int64_t count)>& on_piece,
                   const FrameWindow& window = {});

  // Frames the decoder returned during the last read(): with skip_unsampled fewer than the
  // frames up to the last index when some were left out (a skipping attempt that had to decode
  // everything after all counts as well).
  int64_t frames_decoded() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Size of an image file {height, width}: read from the header of a JPEG or PNG (so a file whose
// pixels are damaged still has a size), by decoding for other formats. Errors call the file
// `role` ("image", "mask").
std::pair<int64_t, int64_t> image_size(const std::string& path, const std::string& role = "image");

// Decodes an image file (JPEG, PNG, BMP, WebP, TIFF or GIF, recognised by its first bytes; alpha is
// dropped) into `out` (uint8 [3,H,W], contiguous), resizing to out's H and W (or to `window`'s
// size, keeping its window). A missing, empty, truncated or corrupt file (damage the decoder can
// detect) is an error naming it.
void read_image(const std::string& path, torch::Tensor out, const FrameWindow& window = {});

// Reads a label image (a segmentation mask) as class ids [H,W] int64: the values of a gray PNG
// (8 or 16 bits; 1 bit as 0 and 1), the indices of a palette PNG (as Pascal VOC and LabelMe store
// masks; the palette's colours do not matter), or the value of an image whose R, G and B are
// equal (as masks are often saved). A colour mask (channels that differ: colour-coded
// classes need mapping to ids first) and a JPEG (its compression changes ids along every edge)
// are errors naming the file, as is a missing, empty or corrupt one.
torch::Tensor read_label_image(const std::string& path);

// Whether a file starts as a JPEG does (FF D8 FF); false when it cannot be read.
bool is_jpeg_file(const std::string& path);

// Writes class ids [H,W] (any integer type, 0-65535) as a gray PNG, 8-bit when every id is
// below 256, else 16-bit: the format read_label_image reads and most tools expect.
void write_label_image(const std::string& path, const torch::Tensor& ids);

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
