#include "framefit/data/media.h"

#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#ifdef FRAMEFIT_WITH_FFMPEG
extern "C" {
#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libavutil/display.h>
#include <libavutil/mem.h>
#include <libavutil/opt.h>
#include <libavutil/pixdesc.h>
#include <libswscale/swscale.h>
}
#endif

namespace framefit::data {

std::vector<int64_t> sample_indices(int64_t source_frames, double source_fps, double target_fps) {
  TORCH_CHECK(source_frames >= 0, "sample_indices: source_frames must be >= 0, got ",
              source_frames);
  std::vector<int64_t> indices;
  if (target_fps <= 0 || target_fps >= source_fps) {
    indices.resize(static_cast<size_t>(source_frames));
    for (int64_t i = 0; i < source_frames; ++i) indices[static_cast<size_t>(i)] = i;
    return indices;
  }
  TORCH_CHECK(source_fps > 0 && std::isfinite(source_fps),
              "sample_indices: source_fps must be a positive frame rate, got ", source_fps);
  // The small slack keeps exact ratios (50 frames at 25 -> 5 fps: 10 frames; 1.5 + 0.5 rounds up)
  // exact despite floating-point error.
  constexpr double kSlack = 1e-9;
  const auto count =
      static_cast<int64_t>(std::ceil(source_frames * target_fps / source_fps - kSlack));
  indices.reserve(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    const auto j = static_cast<int64_t>(std::floor(i * source_fps / target_fps + 0.5 + kSlack));
    indices.push_back(std::min(j, source_frames - 1));
  }
  return indices;
}

std::vector<int64_t> sample_times(const std::vector<double>& times, double end_seconds,
                                  double target_fps) {
  TORCH_CHECK(std::is_sorted(times.begin(), times.end()),
              "sample_times: the frame times must be ascending");
  std::vector<int64_t> indices;
  const auto n = static_cast<int64_t>(times.size());
  if (target_fps <= 0 || n == 0) {
    indices.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) indices[static_cast<size_t>(i)] = i;
    return indices;
  }
  TORCH_CHECK(std::isfinite(target_fps) && std::isfinite(end_seconds),
              "sample_times: the frame rate and the end must be finite, got ", target_fps, " and ",
              end_seconds);
  constexpr double kSlack = 1e-9;  // as in sample_indices: exact ratios stay exact
  int64_t j = 0;                   // the last frame at or before the current time
  for (int64_t i = 0;; ++i) {
    const double t = times.front() + static_cast<double>(i) / target_fps;
    if (t >= end_seconds - kSlack) break;
    while (j + 1 < n && times[j + 1] <= t + kSlack) ++j;
    const bool later = j + 1 < n && times[j + 1] - t <= t - times[j] + kSlack;
    indices.push_back(later ? j + 1 : j);
  }
  return indices;
}

bool is_jpeg_file(const std::string& path) {
  unsigned char magic[3] = {0, 0, 0};
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) return false;
  const size_t n = std::fread(magic, 1, sizeof(magic), file);
  std::fclose(file);
  return n == 3 && magic[0] == 0xFF && magic[1] == 0xD8 && magic[2] == 0xFF;
}

std::pair<int64_t, int64_t> resized_hw(int64_t height, int64_t width, int64_t shorter_side) {
  TORCH_CHECK(height > 0 && width > 0, "resized_hw: the source size must be positive, got ", height,
              "x", width, " (height x width)");
  if (shorter_side <= 0) return {height, width};
  // round(longer * shorter_side / shorter) with halves up, in integers.
  auto scale = [&](int64_t longer, int64_t shorter) {
    return std::max<int64_t>(1, (2 * longer * shorter_side + shorter) / (2 * shorter));
  };
  if (height <= width) return {shorter_side, scale(width, height)};
  return {scale(height, width), shorter_side};
}

#ifdef FRAMEFIT_WITH_FFMPEG

namespace {

void quiet_ffmpeg() {
  // FFmpeg logs to stderr by default; errors reach the caller as exceptions instead.
  static const bool quiet = [] {
    av_log_set_level(AV_LOG_QUIET);
    return true;
  }();
  (void)quiet;
}

// av_err2str is a C compound-literal macro, not usable from C++.
std::string av_error(int err) {
  char buf[AV_ERROR_MAX_STRING_SIZE] = {0};
  if (av_strerror(err, buf, sizeof(buf)) < 0) return "FFmpeg error " + std::to_string(err);
  return buf;
}

// An error reading a file's packets, with what it means there: a packet of absurd size is what
// a damaged header makes, and FFmpeg reports it as out of memory.
std::string read_error(int err) {
  if (err == AVERROR(ENOMEM)) {
    return av_error(err) + " (a damaged packet header can ask for more memory than there is)";
  }
  return av_error(err);
}

struct InputDeleter {
  void operator()(AVFormatContext* p) const { avformat_close_input(&p); }
};
struct OutputDeleter {
  void operator()(AVFormatContext* p) const {
    if (p->pb && !(p->oformat->flags & AVFMT_NOFILE)) avio_closep(&p->pb);
    avformat_free_context(p);
  }
};
struct CodecDeleter {
  void operator()(AVCodecContext* p) const { avcodec_free_context(&p); }
};
struct FrameDeleter {
  void operator()(AVFrame* p) const { av_frame_free(&p); }
};
struct PacketDeleter {
  void operator()(AVPacket* p) const { av_packet_free(&p); }
};
struct SwsDeleter {
  void operator()(SwsContext* p) const { sws_freeContext(p); }
};
struct AvFree {
  void operator()(uint8_t* p) const { av_free(p); }
};
using InputPtr = std::unique_ptr<AVFormatContext, InputDeleter>;
using OutputPtr = std::unique_ptr<AVFormatContext, OutputDeleter>;
using CodecPtr = std::unique_ptr<AVCodecContext, CodecDeleter>;
using FramePtr = std::unique_ptr<AVFrame, FrameDeleter>;
using PacketPtr = std::unique_ptr<AVPacket, PacketDeleter>;
using SwsPtr = std::unique_ptr<SwsContext, SwsDeleter>;

FramePtr new_frame() {
  FramePtr frame(av_frame_alloc());
  TORCH_CHECK(frame, "FFmpeg: out of memory allocating a frame");
  return frame;
}
PacketPtr new_packet() {
  PacketPtr packet(av_packet_alloc());
  TORCH_CHECK(packet, "FFmpeg: out of memory allocating a packet");
  return packet;
}
CodecPtr new_codec_context(const AVCodec* codec) {
  CodecPtr context(avcodec_alloc_context3(codec));
  TORCH_CHECK(context, "FFmpeg: out of memory allocating a codec context");
  return context;
}

// A frame's decoder reported concealed errors or marked it corrupt.
bool damaged(const AVFrame* frame) {
  return frame->decode_error_flags != 0 || (frame->flags & AV_FRAME_FLAG_CORRUPT) != 0;
}

// Checks that `t` is a contiguous CPU uint8 tensor of `dims` dimensions whose first sizes match
// `expected` (-1: any positive size); `what` names the file, `shape` the shape expected.
void check_frames_tensor(const torch::Tensor& t, const std::vector<int64_t>& expected,
                         const std::string& what, const std::string& shape) {
  TORCH_CHECK(t.defined(), what, ": the output tensor is undefined; expected uint8 ", shape);
  bool ok = t.scalar_type() == torch::kUInt8 && t.device().is_cpu() && t.is_contiguous() &&
            t.dim() == static_cast<int64_t>(expected.size());
  for (size_t d = 0; ok && d < expected.size(); ++d) {
    ok = expected[d] < 0 ? t.size(static_cast<int64_t>(d)) > 0
                         : t.size(static_cast<int64_t>(d)) == expected[d];
  }
  TORCH_CHECK(ok, what, ": expected a contiguous CPU uint8 tensor of shape ", shape, ", got ",
              t.scalar_type(), " ", t.sizes(), " on ", t.device(),
              t.is_contiguous() ? "" : " (not contiguous: call .contiguous())");
}

// The YUV format with full range instead of a deprecated "J" format; swscale's cached contexts
// would otherwise be rebuilt for every J frame.
AVPixelFormat without_jpeg_range(AVPixelFormat format, bool* full_range) {
  switch (format) {
    case AV_PIX_FMT_YUVJ420P: *full_range = true; return AV_PIX_FMT_YUV420P;
    case AV_PIX_FMT_YUVJ422P: *full_range = true; return AV_PIX_FMT_YUV422P;
    case AV_PIX_FMT_YUVJ444P: *full_range = true; return AV_PIX_FMT_YUV444P;
    case AV_PIX_FMT_YUVJ440P: *full_range = true; return AV_PIX_FMT_YUV440P;
    case AV_PIX_FMT_YUVJ411P: *full_range = true; return AV_PIX_FMT_YUV411P;
    default: return format;
  }
}

bool is_yuv(AVPixelFormat format) {
  const auto* desc = av_pix_fmt_desc_get(format);
  return desc && !(desc->flags & (AV_PIX_FMT_FLAG_RGB | AV_PIX_FMT_FLAG_PAL)) &&
         desc->nb_components >= 3;
}

// Converts decoded frames of any pixel format and size to planar RGB of the output's size.
// swscale writes planar GBRP into an aligned, padded scratch buffer (its SIMD code may write past
// a row's end, so never straight into the tensor) and the rows are then copied out in RGB order.
class ToRgb {
 public:
  // `out` holds the window of `out_height` x `out_width` at (top, left) of the converted frame
  // (by default all of it).
  void convert(const AVFrame* frame, uint8_t* out, int height, int width, const std::string& what,
               int top = 0, int left = 0, int out_height = 0, int out_width = 0) {
    if (out_height == 0) out_height = height;
    if (out_width == 0) out_width = width;
    bool full_range = frame->color_range == AVCOL_RANGE_JPEG;
    const auto format = without_jpeg_range(static_cast<AVPixelFormat>(frame->format), &full_range);
    Key key;
    key.src_w = frame->width;
    key.src_h = frame->height;
    key.src_format = format;
    key.dst_w = width;
    key.dst_h = height;
    key.colorspace = frame->colorspace;
    key.full_range = full_range;
    if (!sws_ || !(key == key_)) configure(key, what);
    const auto plane = static_cast<size_t>(stride_) * static_cast<size_t>(height);
    uint8_t* r = scratch_.get();
    uint8_t* dst[4] = {r + plane, r + 2 * plane, r, nullptr};  // GBRP plane order
    const int dst_stride[4] = {stride_, stride_, stride_, 0};
    const int rows =
        sws_scale(sws_.get(), frame->data, frame->linesize, 0, frame->height, dst, dst_stride);
    TORCH_CHECK(rows == height, what, ": cannot convert a ", frame->width, "x", frame->height,
                " frame to ", width, "x", height, " RGB");
    for (size_t c = 0; c < 3; ++c) {
      for (int y = 0; y < out_height; ++y) {
        std::memcpy(
            out + (c * static_cast<size_t>(out_height) + y) * static_cast<size_t>(out_width),
            r + c * plane + static_cast<size_t>(top + y) * stride_ + left,
            static_cast<size_t>(out_width));
      }
    }
  }

 private:
  struct Key {
    int src_w = 0, src_h = 0;
    AVPixelFormat src_format = AV_PIX_FMT_NONE;
    int dst_w = 0, dst_h = 0;
    AVColorSpace colorspace = AVCOL_SPC_UNSPECIFIED;
    bool full_range = false;
    bool operator==(const Key& o) const {
      return src_w == o.src_w && src_h == o.src_h && src_format == o.src_format &&
             dst_w == o.dst_w && dst_h == o.dst_h && colorspace == o.colorspace &&
             full_range == o.full_range;
    }
  };

  void configure(const Key& key, const std::string& what) {
    const char* name = av_get_pix_fmt_name(key.src_format);
    // SWS_AREA averages when shrinking (no aliasing) and is bilinear when enlarging.
    sws_.reset(sws_getContext(key.src_w, key.src_h, key.src_format, key.dst_w, key.dst_h,
                              AV_PIX_FMT_GBRP, SWS_AREA, nullptr, nullptr, nullptr));
    TORCH_CHECK(sws_, what, ": cannot convert ", key.src_w, "x", key.src_h,
                " frames of pixel format ", name ? name : "unknown", " to ", key.dst_w, "x",
                key.dst_h, " RGB");
    if (is_yuv(key.src_format)) {
      // The frame's matrix (BT.601 when unspecified) and range, instead of swscale's defaults.
      int *inv_table = nullptr, *table = nullptr;
      int src_range = 0, dst_range = 0, brightness = 0, contrast = 0, saturation = 0;
      if (sws_getColorspaceDetails(sws_.get(), &inv_table, &src_range, &table, &dst_range,
                                   &brightness, &contrast, &saturation) >= 0) {
        sws_setColorspaceDetails(sws_.get(), sws_getCoefficients(key.colorspace), key.full_range,
                                 table, dst_range, brightness, contrast, saturation);
      }
    }
    stride_ = FFALIGN(key.dst_w, 64);
    // Padding past the last plane for SIMD writes beyond the end of a row.
    const size_t bytes = 3 * static_cast<size_t>(stride_) * key.dst_h + 256;
    scratch_.reset(static_cast<uint8_t*>(av_malloc(bytes)));
    TORCH_CHECK(scratch_, what, ": out of memory allocating ", bytes, " bytes");
    key_ = key;
  }

  SwsPtr sws_;
  Key key_;
  int stride_ = 0;
  std::unique_ptr<uint8_t, AvFree> scratch_;
};

// Copies a [3,H,W] uint8 frame into `dst` (any pixel format, same size) via swscale.
class FromRgb {
 public:
  FromRgb(int width, int height, AVPixelFormat dst_format, const std::string& what)
      : rgb_(new_frame()) {
    rgb_->format = AV_PIX_FMT_GBRP;
    rgb_->width = width;
    rgb_->height = height;
    // av_frame_get_buffer pads the planes, so swscale may read past a row's end.
    TORCH_CHECK(av_frame_get_buffer(rgb_.get(), 0) >= 0, what, ": out of memory for a ", width, "x",
                height, " frame");
    sws_.reset(sws_getContext(width, height, AV_PIX_FMT_GBRP, width, height, dst_format,
                              SWS_BILINEAR, nullptr, nullptr, nullptr));
    TORCH_CHECK(sws_, what, ": cannot convert RGB to ", av_get_pix_fmt_name(dst_format));
  }

  void convert(const torch::Tensor& frame, AVFrame* dst, const std::string& what) {
    const auto f = frame.contiguous();
    const auto* src = f.data_ptr<uint8_t>();
    const auto width = static_cast<size_t>(rgb_->width), height = static_cast<size_t>(rgb_->height);
    const int plane_of_channel[3] = {2, 0, 1};  // R, G, B -> GBRP planes
    for (size_t c = 0; c < 3; ++c) {
      auto* plane = rgb_->data[plane_of_channel[c]];
      for (size_t y = 0; y < height; ++y) {
        std::memcpy(plane + y * rgb_->linesize[plane_of_channel[c]], src + (c * height + y) * width,
                    width);
      }
    }
    const int rows = sws_scale(sws_.get(), rgb_->data, rgb_->linesize, 0, rgb_->height, dst->data,
                               dst->linesize);
    TORCH_CHECK(rows == rgb_->height, what, ": cannot convert the frame from RGB");
  }

 private:
  FramePtr rgb_;
  SwsPtr sws_;
};

std::vector<uint8_t> read_file(const std::string& path, const std::string& what) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path.c_str(), "rb"),
                                                       &std::fclose);
  TORCH_CHECK(file, what, ": cannot open: ", std::strerror(errno));
  std::vector<uint8_t> bytes;
  uint8_t buf[1 << 16];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof(buf), file.get())) > 0) {
    bytes.insert(bytes.end(), buf, buf + n);
  }
  TORCH_CHECK(!std::ferror(file.get()), what, ": cannot read: ", std::strerror(errno));
  TORCH_CHECK(!bytes.empty(), what, ": the file is empty");
  return bytes;
}

bool starts_with(const std::vector<uint8_t>& bytes, const char* magic, size_t offset = 0) {
  const size_t n = std::strlen(magic);
  return bytes.size() >= offset + n && std::memcmp(bytes.data() + offset, magic, n) == 0;
}

AVCodecID image_codec(const std::vector<uint8_t>& bytes) {
  if (bytes.size() >= 3 && bytes[0] == 0xFF && bytes[1] == 0xD8 && bytes[2] == 0xFF) {
    return AV_CODEC_ID_MJPEG;
  }
  if (starts_with(bytes, "\x89PNG\r\n\x1a\n")) return AV_CODEC_ID_PNG;
  if (starts_with(bytes, "BM")) return AV_CODEC_ID_BMP;
  if (starts_with(bytes, "RIFF") && starts_with(bytes, "WEBP", 8)) return AV_CODEC_ID_WEBP;
  if (starts_with(bytes, "GIF87a") || starts_with(bytes, "GIF89a")) return AV_CODEC_ID_GIF;
  const bool big_endian_tiff =
      starts_with(bytes, "MM") && bytes.size() >= 4 && bytes[2] == 0 && bytes[3] == 42;
  if (starts_with(bytes, "II*") || big_endian_tiff) {
    return AV_CODEC_ID_TIFF;  // CVC-ClinicDB and much medical imaging ship TIFF
  }
  return AV_CODEC_ID_NONE;
}

// Decodes the one picture of an image file's `bytes`; every decoder complaint is an error.
FramePtr decode_image(const std::vector<uint8_t>& bytes, const std::string& what) {
  quiet_ffmpeg();
  const auto id = image_codec(bytes);
  TORCH_CHECK(
      id != AV_CODEC_ID_NONE, what,
      ": cannot decode (corrupt or not an image): not a JPEG, PNG, BMP, WebP, TIFF or GIF file");
  const AVCodec* codec = avcodec_find_decoder(id);
  TORCH_CHECK(codec, what, ": this FFmpeg has no ", avcodec_get_name(id), " decoder");
  auto context = new_codec_context(codec);
  // The MJPEG decoder conceals damaged data unless told to fail; CRCCHECK verifies PNG chunks.
  context->err_recognition = AV_EF_EXPLODE | AV_EF_CRCCHECK;
  context->thread_count = 1;
  int err = avcodec_open2(context.get(), codec, nullptr);
  TORCH_CHECK(err >= 0, what, ": cannot open the ", codec->name, " decoder: ", av_error(err));

  auto packet = new_packet();
  TORCH_CHECK(av_new_packet(packet.get(), static_cast<int>(bytes.size())) >= 0, what,
              ": out of memory for ", bytes.size(), " bytes");
  std::memcpy(packet->data, bytes.data(), bytes.size());
  packet->flags |= AV_PKT_FLAG_KEY;
  auto frame = new_frame();
  err = avcodec_send_packet(context.get(), packet.get());
  if (err >= 0) err = avcodec_send_packet(context.get(), nullptr);
  if (err >= 0) err = avcodec_receive_frame(context.get(), frame.get());
  TORCH_CHECK(err != AVERROR_EOF && err != AVERROR(EAGAIN), what,
              ": cannot decode (corrupt or not an image): the decoder found no picture");
  TORCH_CHECK(err >= 0, what, ": cannot decode (corrupt or not an image): ", av_error(err));
  TORCH_CHECK(!damaged(frame.get()), what,
              ": cannot decode (corrupt or not an image): the picture is damaged");
  TORCH_CHECK(frame->width > 0 && frame->height > 0, what,
              ": cannot decode (corrupt or not an image): the picture has no size");
  return frame;
}

uint32_t big_endian(const uint8_t* p, int bytes) {
  uint32_t v = 0;
  for (int i = 0; i < bytes; ++i) v = (v << 8) | p[i];
  return v;
}

// EXIF orientation (1-8) in a JPEG's APP1 segment `segment` (after the length field); 1 when it
// is not there or cannot be read.
int exif_orientation(const uint8_t* segment, size_t size) {
  if (size < 6 + 8 || std::memcmp(segment, "Exif\0\0", 6) != 0) return 1;
  const uint8_t* tiff = segment + 6;
  const size_t tiff_size = size - 6;
  const bool little = tiff[0] == 'I' && tiff[1] == 'I';
  if (!little && !(tiff[0] == 'M' && tiff[1] == 'M')) return 1;
  auto read = [&](size_t offset, int bytes) -> uint32_t {
    uint32_t v = 0;
    for (int i = 0; i < bytes; ++i) {
      const uint32_t byte = tiff[offset + static_cast<size_t>(little ? bytes - 1 - i : i)];
      v = (v << 8) | byte;
    }
    return v;
  };
  const size_t ifd = read(4, 4);
  if (ifd + 2 > tiff_size) return 1;
  const size_t entries = read(ifd, 2);
  for (size_t e = 0; e < entries && ifd + 2 + 12 * (e + 1) <= tiff_size; ++e) {
    const size_t entry = ifd + 2 + 12 * e;
    constexpr uint32_t kOrientationTag = 0x0112, kShort = 3;
    if (read(entry, 2) != kOrientationTag) continue;
    const uint32_t value = read(entry + 8, 2);
    return read(entry + 2, 2) == kShort && value >= 1 && value <= 8 ? static_cast<int>(value) : 1;
  }
  return 1;
}

// What a JPEG's header says: the stored picture size from its start-of-frame marker ({0, 0}
// when there is none) and the EXIF orientation found before it.
struct JpegHeader {
  int64_t height = 0, width = 0;
  int orientation = 1;
};

JpegHeader jpeg_header(const std::vector<uint8_t>& b) {
  JpegHeader header;
  size_t pos = 2;  // after SOI
  while (pos + 4 <= b.size()) {
    if (b[pos] != 0xFF) return header;
    const uint8_t marker = b[pos + 1];
    if (marker == 0xFF) {  // fill byte
      ++pos;
      continue;
    }
    pos += 2;
    if (marker == 0x01 || (marker >= 0xD0 && marker <= 0xD8)) continue;  // no length
    if (marker == 0xD9 || marker == 0xDA) return header;  // end or scan before a frame header
    const size_t length = big_endian(&b[pos], 2);
    if (length < 2 || pos + length > b.size()) return header;
    const bool start_of_frame =
        marker >= 0xC0 && marker <= 0xCF && marker != 0xC4 && marker != 0xC8 && marker != 0xCC;
    if (marker == 0xE1 && header.orientation == 1) {
      header.orientation = exif_orientation(&b[pos + 2], length - 2);
    }
    if (start_of_frame) {
      if (length < 7) return header;
      header.height = big_endian(&b[pos + 3], 2);
      header.width = big_endian(&b[pos + 5], 2);
      return header;
    }
    pos += length;
  }
  return header;
}

// EXIF orientations 5-8 store the picture turned a quarter: its sides are swapped.
bool swaps_sides(int orientation) { return orientation >= 5; }

// The picture `stored` [3,H,W] as EXIF `orientation` says to show it (what PIL's
// ImageOps.exif_transpose and the ffmpeg CLI show).
torch::Tensor oriented(const torch::Tensor& stored, int orientation) {
  switch (orientation) {
    case 2: return stored.flip({2});                     // mirrored left-right
    case 3: return torch::rot90(stored, 2, {1, 2});      // upside down
    case 4: return stored.flip({1});                     // mirrored top-bottom
    case 5: return stored.transpose(1, 2);               // mirrored along the diagonal
    case 6: return torch::rot90(stored, 3, {1, 2});      // turned a quarter clockwise
    case 7: return stored.transpose(1, 2).flip({1, 2});  // along the other diagonal
    case 8: return torch::rot90(stored, 1, {1, 2});      // a quarter counterclockwise
    default: return stored;
  }
}

// Converts `frame` to RGB as EXIF `orientation` says to show it, at `window`'s size (else out's):
// scaled as stored (its sides swapped for orientations 5-8), then turned or mirrored; `out`
// [3,out_height,out_width] receives the window at its top and left (all of it by default).
// `stored` holds the picture as stored, kept between calls of the same size.
void convert_oriented(ToRgb& to_rgb, const AVFrame* frame, uint8_t* out, int out_height,
                      int out_width, const FrameWindow& window, int orientation,
                      torch::Tensor& stored, const std::string& what) {
  const int height = window.height > 0 ? static_cast<int>(window.height) : out_height;
  const int width = window.height > 0 ? static_cast<int>(window.width) : out_width;
  const int top = static_cast<int>(window.top), left = static_cast<int>(window.left);
  if (orientation == 1) {
    to_rgb.convert(frame, out, height, width, what, top, left, out_height, out_width);
    return;
  }
  const bool swapped = swaps_sides(orientation);
  const int stored_height = swapped ? width : height, stored_width = swapped ? height : width;
  if (!stored.defined() || stored.size(1) != stored_height || stored.size(2) != stored_width) {
    stored = torch::empty({3, stored_height, stored_width}, torch::kUInt8);
  }
  to_rgb.convert(frame, stored.data_ptr<uint8_t>(), stored_height, stored_width, what);
  torch::from_blob(out, {3, out_height, out_width}, torch::kUInt8)
      .copy_(oriented(stored, orientation).narrow(1, top, out_height).narrow(2, left, out_width));
}

void check_window(const FrameWindow& window, int64_t out_height, int64_t out_width,
                  const std::string& what) {
  if (window.height == 0) return;
  TORCH_CHECK(
      window.width > 0 && window.top >= 0 && window.left >= 0 &&
          window.top + out_height <= window.height && window.left + out_width <= window.width,
      what, ": a ", out_height, "x", out_width, " window at (", window.top, ", ", window.left,
      ") does not fit in frames resized to ", window.height, "x", window.width);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// VideoReader

namespace {

// Base and average frame rates further apart than this mark a variable-rate stream.
constexpr double kVariableRateTolerance = 0.005;

// The counterclockwise quarter turns of `stream`'s display matrix in degrees; 0 without one, for
// a degenerate one, or for an angle more than 2 degrees from a quarter turn (as the ffmpeg CLI,
// which leaves such angles alone).
int display_rotation(const AVStream* stream) {
  const uint8_t* matrix = av_stream_get_side_data(stream, AV_PKT_DATA_DISPLAYMATRIX, nullptr);
  if (matrix == nullptr) return 0;
  const double angle = av_display_rotation_get(reinterpret_cast<const int32_t*>(matrix));
  if (!std::isfinite(angle)) return 0;
  const double quarters = std::round(angle / 90);
  if (std::abs(angle - 90 * quarters) > 2) return 0;
  return static_cast<int>((static_cast<int64_t>(quarters) % 4 + 4) % 4) * 90;
}

// Frames the container counts but never shows: an MP4 cut with `ffmpeg -ss T -c copy` keeps
// the packets from the keyframe before T and an edit list that drops the frames before T.
int64_t discarded_frames(AVStream* stream) {
  int64_t discarded = 0;
  const int entries = avformat_index_get_entries_count(stream);
  for (int i = 0; i < entries; ++i) {
    const AVIndexEntry* entry = avformat_index_get_entry(stream, i);
    if (entry != nullptr && (entry->flags & AVINDEX_DISCARD_FRAME)) ++discarded;
  }
  return discarded;
}

}  // namespace

// Where read() and read_pieces() put the frames they decode: output frame i goes to slot
// i % piece of `base`, and each full piece (at the end, the rest) is handed on.
struct FrameOutput {
  uint8_t* base = nullptr;
  size_t frame_bytes = 0;
  int64_t piece = 1;      // frames per piece: all of them for read()
  int64_t handed_on = 0;  // output frames handed on so far
  const std::function<void(int64_t)>* on_piece = nullptr;
  bool piece_failed = false;  // on_piece threw: its error, not a decoding one

  uint8_t* slot(int64_t i) const { return base + static_cast<size_t>(i % piece) * frame_bytes; }
  // Output frames [0, written) hold their frames. A read that decodes again from the first frame
  // writes frames already handed on once more, and hands on only those after them.
  void ready(int64_t written) {
    if (written - handed_on == piece) hand_on(written);
  }
  void finish(int64_t written) {
    if (written > handed_on) hand_on(written);
  }

 private:
  void hand_on(int64_t written) {
    const int64_t count = written - handed_on;
    handed_on = written;
    if (!on_piece || !*on_piece) return;
    try {
      (*on_piece)(count);
    } catch (...) {
      piece_failed = true;
      throw;
    }
  }
};

struct VideoReader::State {
  std::string path, what;
  int threads = 1;
  VideoInfo info;
  InputPtr input;
  int stream = -1;
  CodecPtr decoder;
  PacketPtr packet = new_packet();
  FramePtr frame = new_frame();
  ToRgb to_rgb;
  torch::Tensor stored;    // a rotated video's frame as stored, before turning it
  FrameWindow window;      // the current read()'s
  int64_t next = 0;        // index of the next frame the decoder returns
  bool flushed = false;    // end of input reached and the decoder told so
  bool truncated = false;  // the input ended inside a packet
  bool ended = false;      // decode_next() returned false
  bool reusable = false;   // the decoder is positioned after a successful read
  bool untouched = false;  // no packet read from `input` since it was opened
  // Timestamps of consecutive frames, to notice frames missing from a truncated file.
  int64_t start_pts = AV_NOPTS_VALUE, expected_pts = AV_NOPTS_VALUE;
  double pts_step = 0;
  bool skip_unsampled = true;  // read() may skip frames it does not want (read_skipping)
  // While read_skipping() decodes: the timestamps of the frames it wants, ascending. Any other
  // frame that no frame refers to (a non-reference B-frame) is not decoded at all.
  std::vector<int64_t> wanted_pts;
  int64_t decoded = 0;  // frames the decoder returned since read() began

  // VideoReader::read and read_pieces: `piece` frames of `out` at a time.
  void read(const std::vector<int64_t>& indices, torch::Tensor out, int64_t piece,
            const std::function<void(int64_t)>* on_piece, const FrameWindow& frame_window);

  // Opens (or reopens) the file and decoder at the first frame.
  void open() {
    reusable = false;
    untouched = true;
    decoder.reset();
    input.reset();
    AVFormatContext* raw = nullptr;
    int err = avformat_open_input(&raw, path.c_str(), nullptr, nullptr);
    // An MP4 cut short before its index (at the end unless written with +faststart) lands here.
    TORCH_CHECK(err >= 0, what, ": cannot open: ", av_error(err),
                err == AVERROR_INVALIDDATA ? " (not a video, or a damaged or truncated file)"
                : err == AVERROR_EOF       ? " (the file ends before its index: truncated?)"
                                           : "");
    input.reset(raw);
    err = avformat_find_stream_info(input.get(), nullptr);
    TORCH_CHECK(err >= 0, what,
                ": cannot read the stream information (damaged file?): ", av_error(err));
    const AVCodec* codec = nullptr;
    stream = av_find_best_stream(input.get(), AVMEDIA_TYPE_VIDEO, -1, -1, &codec, 0);
    TORCH_CHECK(stream != AVERROR_STREAM_NOT_FOUND, what, ": the file has no video stream");
    if (stream < 0 || !codec) {
      // No decoder for any video stream (a damaged header can also name an unknown codec).
      AVCodecID id = AV_CODEC_ID_NONE;
      for (unsigned i = 0; i < input->nb_streams && id == AV_CODEC_ID_NONE; ++i) {
        const AVCodecParameters* par = input->streams[i]->codecpar;
        if (par->codec_type == AVMEDIA_TYPE_VIDEO) id = par->codec_id;
      }
      TORCH_CHECK(false, what, ": this FFmpeg has no decoder for its ",
                  id == AV_CODEC_ID_NONE ? "unknown (damaged file?)" : avcodec_get_name(id),
                  " video");
    }
    AVStream* s = input->streams[stream];
    decoder = new_codec_context(codec);
    err = avcodec_parameters_to_context(decoder.get(), s->codecpar);
    TORCH_CHECK(err >= 0, what, ": bad codec parameters: ", av_error(err));
    // Damaged packets are errors rather than concealed frames.
    decoder->err_recognition = AV_EF_EXPLODE;
    decoder->thread_count = threads;
    err = avcodec_open2(decoder.get(), codec, nullptr);
    TORCH_CHECK(err >= 0, what, ": cannot open the ", codec->name, " decoder: ", av_error(err));
    // Only the decoder is told the rest of the streams do not matter.
    for (unsigned i = 0; i < input->nb_streams; ++i) {
      if (static_cast<int>(i) != stream) input->streams[i]->discard = AVDISCARD_ALL;
    }

    info.codec = avcodec_get_name(s->codecpar->codec_id);
    info.width = s->codecpar->width;
    info.height = s->codecpar->height;
    TORCH_CHECK(info.width > 0 && info.height > 0, what, ": the video stream has no frame size");
    AVRational rate = s->avg_frame_rate;
    if (rate.num <= 0 || rate.den <= 0) rate = s->r_frame_rate;
    info.fps = rate.num > 0 && rate.den > 0 ? av_q2d(rate) : 0;
    double duration = 0;
    if (s->duration != AV_NOPTS_VALUE && s->duration > 0) {
      duration = static_cast<double>(s->duration) * av_q2d(s->time_base);
    } else if (input->duration != AV_NOPTS_VALUE && input->duration > 0) {
      duration = static_cast<double>(input->duration) / AV_TIME_BASE;
    }
    info.frames_estimated = s->nb_frames <= 0;
    info.frames = info.frames_estimated ? std::llround(duration * info.fps)
                                        : s->nb_frames - discarded_frames(s);
    const AVRational base = s->r_frame_rate, average = s->avg_frame_rate;
    info.variable_rate = base.num > 0 && base.den > 0 && average.num > 0 && average.den > 0 &&
                         std::abs(av_q2d(average) / av_q2d(base) - 1) > kVariableRateTolerance;
    info.rotation = display_rotation(s);
    if (info.rotation % 180 != 0) std::swap(info.width, info.height);

    next = 0;
    flushed = truncated = ended = false;
    start_pts = expected_pts = s->start_time;
    pts_step = info.fps > 0 ? 1 / (info.fps * av_q2d(s->time_base)) : 0;
  }

  // Whether `frame` is the one that follows the previous frame (the first: the stream's start)
  // in time; false when that cannot be known.
  bool follows(const AVFrame* f) const {
    const int64_t pts = f->best_effort_timestamp;
    return pts != AV_NOPTS_VALUE && expected_pts != AV_NOPTS_VALUE && pts_step > 0 &&
           std::abs(static_cast<double>(pts - expected_pts)) <= pts_step / 2;
  }

  // Decodes the next frame into `frame`; false at the end of the stream.
  bool decode_next() {
    if (ended) return false;
    for (;;) {
      int err = avcodec_receive_frame(decoder.get(), frame.get());
      if (err >= 0) {
        TORCH_CHECK(!damaged(frame.get()), what, ": frame ", next,
                    " is damaged (the decoder concealed errors in it)");
        // Frames are counted, so after a cut, where the decoder releases the frames it holds
        // without the ones whose data is missing (B-frames shown before a later P-frame), only
        // the frames that follow without a gap are frames `next`, `next + 1`, ...
        if (truncated && !follows(frame.get())) {
          av_frame_unref(frame.get());
          ended = true;
          return false;
        }
        const int64_t pts = frame->best_effort_timestamp;
        expected_pts = pts != AV_NOPTS_VALUE ? pts + std::llround(pts_step) : AV_NOPTS_VALUE;
        ++decoded;
        return true;
      }
      if (err == AVERROR_EOF) {
        ended = true;
        return false;
      }
      TORCH_CHECK(err == AVERROR(EAGAIN), what, ": cannot decode the data after frame ", next,
                  " (damaged data): ", av_error(err));
      TORCH_CHECK(!flushed, what, ": the decoder stalled after the end of the stream");
      untouched = false;
      err = av_read_frame(input.get(), packet.get());
      if (err == AVERROR_EOF) {
        err = avcodec_send_packet(decoder.get(), nullptr);  // drains the delayed frames
        TORCH_CHECK(err >= 0, what, ": cannot finish decoding: ", av_error(err));
        flushed = true;
        continue;
      }
      TORCH_CHECK(err >= 0, what, ": cannot read the packet after frame ", next, ": ",
                  read_error(err));
      const bool ours = packet->stream_index == stream;
      // A packet cut short by the end of the file is what a truncated file ends with; it is not
      // decoded, the frames before it are.
      if (ours && (packet->flags & AV_PKT_FLAG_CORRUPT) && input->pb && avio_feof(input->pb)) {
        truncated = true;
      }
      if (ours && !truncated) {
        if (!wanted_pts.empty()) {
          const bool wanted = std::binary_search(wanted_pts.begin(), wanted_pts.end(), packet->pts);
          decoder->skip_frame = wanted ? AVDISCARD_DEFAULT : AVDISCARD_NONREF;
        }
        err = avcodec_send_packet(decoder.get(), packet.get());
      }
      const std::string where = err < 0 ? packet_frame() : "";
      av_packet_unref(packet.get());
      TORCH_CHECK(err >= 0, what, ": cannot decode ", where, " (damaged data): ", av_error(err));
    }
  }

  // A video packet as the container lists it, without decoding.
  struct Stamp {
    int64_t pts, duration;  // pts: the decoding timestamp where the packet has none
    bool key, discard, corrupt, pts_missing;
  };

  // The stream's packets in decoding order, read through the reader's own input from its start;
  // the next read() opens the file afresh to decode.
  std::vector<Stamp> scan_packets() {
    if (!untouched) open();
    untouched = false;
    reusable = false;
    std::vector<Stamp> packets;
    auto pkt = new_packet();
    for (;;) {
      const int err = av_read_frame(input.get(), pkt.get());
      if (err == AVERROR_EOF) break;
      TORCH_CHECK(err >= 0, what, ": cannot read the packet after ", packets.size(),
                  " frame packets: ", read_error(err));
      if (pkt->stream_index == stream) {
        const int64_t pts = pkt->pts != AV_NOPTS_VALUE ? pkt->pts : pkt->dts;
        packets.push_back({pts, pkt->duration, (pkt->flags & AV_PKT_FLAG_KEY) != 0,
                           (pkt->flags & AV_PKT_FLAG_DISCARD) != 0,
                           (pkt->flags & AV_PKT_FLAG_CORRUPT) != 0, pkt->pts == AV_NOPTS_VALUE});
      }
      av_packet_unref(pkt.get());
    }
    return packets;
  }

  // Decodes the frames at `indices` (ascending) into out[i] as read() does, without decoding the
  // frames between them that no other frame refers to: sampling a 25 fps video at 1 fps leaves
  // out most B-frames. The frames decoded are the same pixels, since nothing refers to the ones
  // left out. A decoded frame is found by its timestamp among the stream's packets, so only a
  // plain stream qualifies: a timestamp on every packet, none twice, a keyframe first and nothing
  // shown before it, no edit-list discards, no damaged packet. False, with nothing promised about
  // `out`, when the stream does not qualify or anything goes differently (damage, a cut, a frame
  // that does not come): read() then decodes every frame, and reports what is wrong as usual.
  // Only H.264, HEVC and MPEG-4 Part 2, progressive, whose packets hold one shown frame each
  // (VP8's hidden frames, or fields in packets of their own, would shift the frames' numbers).
  // The decoded frame as output frame i and the repeats of its index after it; returns the
  // next output frame.
  int64_t put(FrameOutput& out, const std::vector<int64_t>& indices, int64_t i, int height,
              int width) {
    const auto n = static_cast<int64_t>(indices.size());
    const int64_t index = indices[i];
    uint8_t* dst = out.slot(i);
    convert(dst, height, width);
    for (out.ready(++i); i < n && indices[i] == index; out.ready(++i)) {
      uint8_t* copy = out.slot(i);
      if (copy != dst) std::memcpy(copy, dst, out.frame_bytes);
      dst = copy;
    }
    return i;
  }

  bool read_skipping(const std::vector<int64_t>& indices, FrameOutput& out, int height, int width) {
    const AVCodecID codec = input->streams[stream]->codecpar->codec_id;
    if (codec != AV_CODEC_ID_H264 && codec != AV_CODEC_ID_HEVC && codec != AV_CODEC_ID_MPEG4) {
      return false;
    }
    const std::vector<Stamp> packets = scan_packets();
    if (packets.empty() || !packets.front().key) return false;
    std::vector<int64_t> shown;  // every frame's timestamp in display order
    shown.reserve(packets.size());
    for (const Stamp& p : packets) {
      if (p.pts_missing || p.discard || p.corrupt || p.pts < packets.front().pts) {
        return false;
      }
      shown.push_back(p.pts);
    }
    std::sort(shown.begin(), shown.end());
    if (std::adjacent_find(shown.begin(), shown.end()) != shown.end()) return false;
    const auto n = static_cast<int64_t>(indices.size());
    if (indices.back() >= static_cast<int64_t>(shown.size())) return false;

    open();
    wanted_pts.clear();
    for (const int64_t index : indices) wanted_pts.push_back(shown[index]);
    wanted_pts.erase(std::unique(wanted_pts.begin(), wanted_pts.end()), wanted_pts.end());
    int64_t i = 0;
    try {
      while (i < n && decode_next() && !truncated) {
        if (frame->interlaced_frame) break;
        const int64_t pts = frame->pts;  // its packet's
        const auto at = std::lower_bound(shown.begin(), shown.end(), pts);
        if (at == shown.end() || *at != pts) break;
        const auto index = static_cast<int64_t>(at - shown.begin());
        if (index > indices[i]) break;  // a wanted frame was not shown
        if (index == indices[i]) {
          next = index + 1;
          i = put(out, indices, i, height, width);
        }
        av_frame_unref(frame.get());
      }
    } catch (const c10::Error&) {
      if (out.piece_failed) throw;
      i = -1;  // read() decodes again and reports it
    }
    av_frame_unref(frame.get());
    wanted_pts.clear();
    decoder->skip_frame = AVDISCARD_DEFAULT;
    return i == n;
  }

  // Converts the decoded frame to RGB at the displayed size (height x width), upright: the
  // display matrix's counterclockwise quarter turns are EXIF orientations 1, 8, 3 and 6.
  void convert(uint8_t* out, int height, int width) {
    constexpr int kOrientationOfQuarterTurns[4] = {1, 8, 3, 6};
    convert_oriented(to_rgb, frame.get(), out, height, width, window,
                     kOrientationOfQuarterTurns[info.rotation / 90], stored, what);
  }

  // The frame `packet` holds, by its timestamp: packets come in decode order, not frame order.
  std::string packet_frame() const {
    if (packet->pts == AV_NOPTS_VALUE || start_pts == AV_NOPTS_VALUE || pts_step <= 0) {
      return "the data after frame " + std::to_string(next);
    }
    const int64_t index = std::llround((packet->pts - start_pts) / pts_step);
    // A damaged timestamp can lie outside the stream.
    if (index < 0 || (!info.frames_estimated && index >= info.frames)) {
      return "the data after frame " + std::to_string(next);
    }
    return "frame " + std::to_string(index);
  }
};

VideoReader::VideoReader(const std::string& path, int decoder_threads, bool skip_unsampled)
    : state_(std::make_unique<State>()) {
  quiet_ffmpeg();
  TORCH_CHECK(decoder_threads >= 0, "video ", path, ": decoder_threads must be >= 0, got ",
              decoder_threads);
  state_->path = path;
  state_->what = "video " + path;
  state_->threads = decoder_threads;
  state_->skip_unsampled = skip_unsampled;
  state_->open();
  state_->reusable = true;
}

VideoReader::~VideoReader() = default;

const VideoInfo& VideoReader::info() const { return state_->info; }
const std::string& VideoReader::path() const { return state_->path; }
int64_t VideoReader::frames_decoded() const { return state_->decoded; }

VideoReader::FrameTimes VideoReader::frame_times() {
  auto& s = *state_;
  const std::vector<State::Stamp> packets = s.scan_packets();
  const double time_base = av_q2d(s.input->streams[s.stream]->time_base);
  // The frames the decoder shows: not the discarded ones (before an edit list's start), and, in
  // a stream cut in the middle of a group of pictures (a recorder's segment), neither those
  // before its first keyframe nor those shown before that keyframe (they refer to pictures
  // before the cut); the decoder and the ffmpeg CLI drop them all.
  const auto first_key =
      std::find_if(packets.begin(), packets.end(), [](const State::Stamp& p) { return p.key; });
  const bool keyed = first_key != packets.end() && first_key->pts != AV_NOPTS_VALUE;
  std::vector<std::pair<int64_t, int64_t>> stamps;  // {pts, duration} per frame shown
  for (auto it = keyed ? first_key : packets.begin(); it != packets.end(); ++it) {
    if (it->discard) continue;
    TORCH_CHECK(it->pts != AV_NOPTS_VALUE, s.what, ": frame packet ", it - packets.begin(),
                " has no timestamp, so the frames' times are unknown");
    if (keyed && it->pts < first_key->pts) continue;
    stamps.emplace_back(it->pts, it->duration);
  }
  FrameTimes times;
  if (stamps.empty()) return times;
  std::sort(stamps.begin(), stamps.end());
  const int64_t first = stamps.front().first;
  for (const auto& [pts, duration] : stamps) {
    times.seconds.push_back(static_cast<double>(pts - first) * time_base);
  }
  // Without the last packet's duration, the last frame lasts as long as the one before it, or
  // as long as the average rate says for a single frame.
  double last = static_cast<double>(stamps.back().second) * time_base;
  if (last <= 0) {
    const size_t n = times.seconds.size();
    last =
        n > 1 ? times.seconds[n - 1] - times.seconds[n - 2] : (s.info.fps > 0 ? 1 / s.info.fps : 0);
  }
  times.end_seconds = times.seconds.back() + last;
  return times;
}

void VideoReader::read(const std::vector<int64_t>& indices, torch::Tensor out,
                       const FrameWindow& window) {
  const auto n = static_cast<int64_t>(indices.size());
  check_frames_tensor(out, {n, 3, -1, -1}, state_->what,
                      "[" + std::to_string(n) + ",3,H,W] (one frame per index)");
  state_->read(indices, out, std::max<int64_t>(1, n), nullptr, window);
}

void VideoReader::read_pieces(const std::vector<int64_t>& indices, torch::Tensor piece,
                              const std::function<void(int64_t count)>& on_piece,
                              const FrameWindow& window) {
  check_frames_tensor(piece, {-1, 3, -1, -1}, state_->what, "[K,3,H,W] (K frames a piece)");
  state_->read(indices, piece, piece.size(0), &on_piece, window);
}

void VideoReader::State::read(const std::vector<int64_t>& indices, torch::Tensor out, int64_t piece,
                              const std::function<void(int64_t)>* on_piece,
                              const FrameWindow& frame_window) {
  const auto n = static_cast<int64_t>(indices.size());
  check_window(frame_window, out.size(2), out.size(3), what);
  window = frame_window;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(indices[i] >= 0 && (i == 0 || indices[i] >= indices[i - 1]), what,
                ": frame indices must be >= 0 and ascending; index ", i, " is ", indices[i],
                i > 0 ? " after " + std::to_string(indices[i - 1]) : std::string());
  }
  decoded = 0;
  if (n == 0) return;
  const int height = static_cast<int>(out.size(2)), width = static_cast<int>(out.size(3));
  FrameOutput output;
  output.base = out.data_ptr<uint8_t>();
  output.frame_bytes = static_cast<size_t>(3) * height * width;
  output.piece = piece;
  output.on_piece = on_piece;
  if (skip_unsampled && (!reusable || indices.front() < next || next == 0)) {
    // Decoding from the first frame: when frames are left out, skip those nothing refers to.
    // The decoder then lacks them, so a later read starts afresh too.
    int64_t distinct = 0;
    for (int64_t k = 0; k < n; ++k) distinct += k == 0 || indices[k] != indices[k - 1];
    if (indices.back() + 1 > distinct && read_skipping(indices, output, height, width)) {
      output.finish(n);
      return;
    }
  }
  if (!reusable || indices.front() < next) open();
  reusable = false;  // until this read succeeds

  int64_t i = 0;
  while (i < n) {
    if (!decode_next()) {
      const int64_t wanted = indices[n - 1];
      TORCH_CHECK(next >= info.frames && !truncated, what, ": stream ended after ", next, " of ",
                  std::max(info.frames, wanted + 1), " frames",
                  truncated ? " (truncated file)" : " (truncated or damaged file)");
      TORCH_CHECK(false, what, ": frame ", wanted, " was requested but the video has ", next,
                  " frames");
    }
    const int64_t index = next++;
    if (index == indices[i]) i = put(output, indices, i, height, width);
    av_frame_unref(frame.get());
  }
  output.finish(n);
  reusable = true;
}

// ---------------------------------------------------------------------------------------------
// Images

std::pair<int64_t, int64_t> image_size(const std::string& path, const std::string& role) {
  quiet_ffmpeg();
  const std::string what = role + " " + path;
  const auto bytes = read_file(path, what);
  switch (image_codec(bytes)) {
    case AV_CODEC_ID_MJPEG: {
      const auto header = jpeg_header(bytes);
      TORCH_CHECK(header.height > 0 && header.width > 0, what,
                  ": damaged JPEG (no valid frame header with the picture size)");
      if (swaps_sides(header.orientation)) return {header.width, header.height};
      return {header.height, header.width};
    }
    case AV_CODEC_ID_PNG: {
      TORCH_CHECK(bytes.size() >= 24 && std::memcmp(&bytes[12], "IHDR", 4) == 0, what,
                  ": damaged PNG (no IHDR header)");
      const int64_t width = big_endian(&bytes[16], 4), height = big_endian(&bytes[20], 4);
      TORCH_CHECK(width > 0 && height > 0, what, ": damaged PNG (its header has size ", width, "x",
                  height, ")");
      return {height, width};
    }
    default: {
      const auto frame = decode_image(bytes, what);
      return {frame->height, frame->width};
    }
  }
}

void read_image(const std::string& path, torch::Tensor out, const FrameWindow& window) {
  const std::string what = "image " + path;
  check_frames_tensor(out, {3, -1, -1}, what, "[3,H,W]");
  check_window(window, out.size(1), out.size(2), what);
  quiet_ffmpeg();
  const auto bytes = read_file(path, what);
  const auto frame = decode_image(bytes, what);
  const int orientation =
      image_codec(bytes) == AV_CODEC_ID_MJPEG ? jpeg_header(bytes).orientation : 1;
  ToRgb to_rgb;
  torch::Tensor stored;
  convert_oriented(to_rgb, frame.get(), out.data_ptr<uint8_t>(), static_cast<int>(out.size(1)),
                   static_cast<int>(out.size(2)), window, orientation, stored, what);
}

torch::Tensor read_label_image(const std::string& path) {
  quiet_ffmpeg();
  const std::string what = "mask " + path;
  const auto bytes = read_file(path, what);
  TORCH_CHECK(image_codec(bytes) != AV_CODEC_ID_MJPEG, what,
              ": is a JPEG, whose compression changes class ids along every edge; save masks "
              "losslessly, as PNG, or list the class values in data.mask_values (each pixel "
              "then takes the nearest)");
  const auto frame = decode_image(bytes, what);
  const int64_t height = frame->height, width = frame->width;
  auto ids = torch::empty({height, width}, torch::kLong);
  auto* out = ids.data_ptr<int64_t>();
  // `value(row, x)`: the id of pixel x of a row of the frame's first plane.
  auto read_each = [&](auto value) {
    for (int64_t y = 0; y < height; ++y) {
      const uint8_t* row = frame->data[0] + y * frame->linesize[0];
      for (int64_t x = 0; x < width; ++x) out[y * width + x] = value(row, x);
    }
  };
  auto bit = [](const uint8_t* row, int64_t x) -> int64_t {
    return (row[x / 8] >> (7 - x % 8)) & 1;
  };
  auto u16 = [](const uint8_t* p, bool big) -> int64_t {
    return big ? (p[0] << 8) | p[1] : (p[1] << 8) | p[0];
  };
  switch (frame->format) {
    case AV_PIX_FMT_PAL8:  // indices; data[1] holds the palette
    case AV_PIX_FMT_GRAY8:
      read_each([](const uint8_t* row, int64_t x) -> int64_t { return row[x]; });
      break;
    case AV_PIX_FMT_YA8:  // gray and alpha
      read_each([](const uint8_t* row, int64_t x) -> int64_t { return row[2 * x]; });
      break;
    case AV_PIX_FMT_MONOBLACK:  // 1 bit, 1 is white
      read_each(bit);
      break;
    case AV_PIX_FMT_MONOWHITE:  // 1 bit, 1 is black
      read_each([&](const uint8_t* row, int64_t x) { return 1 - bit(row, x); });
      break;
    case AV_PIX_FMT_GRAY16BE:
    case AV_PIX_FMT_GRAY16LE: {
      const bool big = frame->format == AV_PIX_FMT_GRAY16BE;
      read_each([&](const uint8_t* row, int64_t x) { return u16(row + 2 * x, big); });
      break;
    }
    case AV_PIX_FMT_YA16BE:
    case AV_PIX_FMT_YA16LE: {
      const bool big = frame->format == AV_PIX_FMT_YA16BE;
      read_each([&](const uint8_t* row, int64_t x) { return u16(row + 4 * x, big); });
      break;
    }
    default: {
      auto rgb = torch::empty({3, height, width}, torch::kUInt8);
      ToRgb().convert(frame.get(), rgb.data_ptr<uint8_t>(), static_cast<int>(height),
                      static_cast<int>(width), what);
      const auto differ = rgb[0].ne(rgb[1]).logical_or(rgb[0].ne(rgb[2])).flatten();
      if (differ.any().item<bool>()) {
        const int64_t at = differ.nonzero()[0][0].item<int64_t>();
        const int64_t y = at / width, x = at % width;
        const auto* p = rgb.data_ptr<uint8_t>();
        const auto plane = static_cast<size_t>(height * width), i = static_cast<size_t>(at);
        TORCH_CHECK(false, what, ": is a colour mask (pixel x=", x, " y=", y, " is RGB ", int(p[i]),
                    ",", int(p[plane + i]), ",", int(p[2 * plane + i]),
                    "); class ids must be gray values, palette indices or equal R, G and B: map "
                    "its colours to ids (framefit train: list each class's colour in "
                    "data.mask_values)");
      }
      ids.copy_(rgb[0]);
    }
  }
  return ids;
}

namespace {

// Encodes `picture` (its format, size and quality set) with `context`'s codec and writes the
// one packet to `path`.
void write_picture(const std::string& path, const std::string& what, AVCodecContext* context,
                   const AVFrame* picture) {
  auto packet = new_packet();
  int err = avcodec_send_frame(context, picture);
  if (err >= 0) err = avcodec_send_frame(context, nullptr);
  if (err >= 0) err = avcodec_receive_packet(context, packet.get());
  TORCH_CHECK(err >= 0, what, ": cannot encode: ", av_error(err));

  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path.c_str(), "wb"),
                                                       &std::fclose);
  TORCH_CHECK(file, what, ": cannot create: ", std::strerror(errno));
  const auto size = static_cast<size_t>(packet->size);
  const bool written = std::fwrite(packet->data, 1, size, file.get()) == size;
  const bool closed = std::fclose(file.release()) == 0;
  TORCH_CHECK(written && closed, what, ": cannot write: ", std::strerror(errno));
}

// An encoder context for one `format` picture of width x height, and the picture to fill.
std::pair<CodecPtr, FramePtr> image_encoder(AVCodecID id, AVPixelFormat format, int width,
                                            int height, const std::string& what, int quality = 0) {
  const AVCodec* codec = avcodec_find_encoder(id);
  TORCH_CHECK(codec, what, ": this FFmpeg has no ", avcodec_get_name(id), " encoder");
  auto context = new_codec_context(codec);
  context->width = width;
  context->height = height;
  context->time_base = AVRational{1, 25};  // required by encoders, meaningless for one picture
  context->pix_fmt = format;
  // JPEG: full-range 4:2:0, what JPEG files usually hold.
  const bool jpeg = id == AV_CODEC_ID_MJPEG;
  context->color_range = jpeg ? AVCOL_RANGE_JPEG : AVCOL_RANGE_UNSPECIFIED;
  if (quality > 0) {
    context->flags |= AV_CODEC_FLAG_QSCALE;
    context->global_quality = quality * FF_QP2LAMBDA;
  }
  const int err = avcodec_open2(context.get(), codec, nullptr);
  TORCH_CHECK(err >= 0, what, ": cannot open the ", codec->name, " encoder: ", av_error(err));
  auto picture = new_frame();
  picture->format = format;
  picture->width = width;
  picture->height = height;
  picture->color_range = context->color_range;
  picture->quality = context->global_quality;
  TORCH_CHECK(av_frame_get_buffer(picture.get(), 0) >= 0, what, ": out of memory for a ", width,
              "x", height, " picture");
  return {std::move(context), std::move(picture)};
}

}  // namespace

void write_image(const std::string& path, const torch::Tensor& frame, int quality) {
  quiet_ffmpeg();
  const std::string what = "image " + path;
  TORCH_CHECK(frame.defined() && frame.scalar_type() == torch::kUInt8 && frame.dim() == 3 &&
                  frame.size(0) == 3 && frame.size(1) > 0 && frame.size(2) > 0,
              what, ": expected a uint8 tensor of shape [3,H,W], got ",
              frame.defined() ? c10::toString(frame.scalar_type()) : "undefined", " ",
              frame.defined() ? frame.sizes() : c10::IntArrayRef{});
  std::string ext = path.substr(std::min(path.size(), path.find_last_of('.')));
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  const bool jpeg = ext == ".jpg" || ext == ".jpeg";
  TORCH_CHECK(jpeg || ext == ".png", what, ": unknown image extension '", ext,
              "' (use .jpg, .jpeg or .png)");
  TORCH_CHECK(!jpeg || (quality >= 1 && quality <= 31), what,
              ": JPEG quality must be 1-31 (lower is better), got ", quality);
  const int height = static_cast<int>(frame.size(1)), width = static_cast<int>(frame.size(2));
  auto [context, picture] = image_encoder(jpeg ? AV_CODEC_ID_MJPEG : AV_CODEC_ID_PNG,
                                          jpeg ? AV_PIX_FMT_YUVJ420P : AV_PIX_FMT_RGB24, width,
                                          height, what, jpeg ? quality : 0);
  FromRgb(width, height, context->pix_fmt, what).convert(frame.cpu(), picture.get(), what);
  write_picture(path, what, context.get(), picture.get());
}

void write_label_image(const std::string& path, const torch::Tensor& ids) {
  quiet_ffmpeg();
  const std::string what = "mask " + path;
  TORCH_CHECK(ids.defined() && ids.dim() == 2 && ids.size(0) > 0 && ids.size(1) > 0 &&
                  !ids.is_floating_point() && !ids.is_complex(),
              what, ": expected class ids of shape [H,W] (integers), got ",
              ids.defined() ? c10::toString(ids.scalar_type()) : "undefined", " ",
              ids.defined() ? ids.sizes() : c10::IntArrayRef{});
  const auto values = ids.cpu().to(torch::kLong).contiguous();
  const auto [low, high] = torch::aminmax(values);
  TORCH_CHECK(low.item<int64_t>() >= 0 && high.item<int64_t>() <= 65535, what,
              ": class ids must be 0-65535 to be stored in a PNG, got ", low.item<int64_t>(),
              " to ", high.item<int64_t>());
  const bool wide = high.item<int64_t>() > 255;
  const int height = static_cast<int>(values.size(0)), width = static_cast<int>(values.size(1));
  auto [context, picture] = image_encoder(
      AV_CODEC_ID_PNG, wide ? AV_PIX_FMT_GRAY16BE : AV_PIX_FMT_GRAY8, width, height, what);
  const auto* v = values.data_ptr<int64_t>();
  for (int y = 0; y < height; ++y) {
    uint8_t* row = picture->data[0] + static_cast<ptrdiff_t>(y) * picture->linesize[0];
    for (int x = 0; x < width; ++x) {
      const int64_t id = v[static_cast<size_t>(y) * width + x];
      if (wide) {
        row[2 * x] = static_cast<uint8_t>(id >> 8);
        row[2 * x + 1] = static_cast<uint8_t>(id & 255);
      } else {
        row[x] = static_cast<uint8_t>(id);
      }
    }
  }
  write_picture(path, what, context.get(), picture.get());
}

// ---------------------------------------------------------------------------------------------
// VideoWriter

struct VideoWriter::State {
  std::string path, what;
  OutputPtr output;
  CodecPtr encoder;
  AVStream* stream = nullptr;
  FramePtr yuv = new_frame();
  PacketPtr packet = new_packet();
  std::unique_ptr<FromRgb> from_rgb;
  int64_t frames = 0;
  bool finished = false;

  // Sends `frame` (nullptr: end of stream) and muxes the packets the encoder has ready.
  void encode(const AVFrame* frame) {
    int err = avcodec_send_frame(encoder.get(), frame);
    TORCH_CHECK(err >= 0, what, ": cannot encode frame ", frames, ": ", av_error(err));
    for (;;) {
      err = avcodec_receive_packet(encoder.get(), packet.get());
      if (err == AVERROR(EAGAIN) || err == AVERROR_EOF) return;
      TORCH_CHECK(err >= 0, what, ": cannot encode frame ", frames, ": ", av_error(err));
      av_packet_rescale_ts(packet.get(), encoder->time_base, stream->time_base);
      packet->stream_index = stream->index;
      err = av_interleaved_write_frame(output.get(), packet.get());  // takes the packet's data
      TORCH_CHECK(err >= 0, what, ": cannot write: ", av_error(err));
    }
  }
};

VideoWriter::VideoWriter(const std::string& path, int64_t width, int64_t height, double fps)
    : state_(std::make_unique<State>()) {
  quiet_ffmpeg();
  auto& s = *state_;
  s.path = path;
  s.what = "video " + path;
  TORCH_CHECK(width > 0 && height > 0 && width % 2 == 0 && height % 2 == 0 && width <= 16384 &&
                  height <= 16384,
              s.what, ": width and height must be even and positive (4:2:0 video), got ", width,
              "x", height);
  TORCH_CHECK(fps > 0 && std::isfinite(fps), s.what, ": fps must be positive, got ", fps);

  AVFormatContext* raw = nullptr;
  int err = avformat_alloc_output_context2(&raw, nullptr, nullptr, path.c_str());
  TORCH_CHECK(err >= 0 && raw, s.what,
              ": no container format for this file name (use .mp4, .avi or .mkv)");
  s.output.reset(raw);
  const AVOutputFormat* format = s.output->oformat;

  const AVCodec* codec = avcodec_find_encoder_by_name("libx264");
  if (!codec || avformat_query_codec(format, codec->id, FF_COMPLIANCE_NORMAL) != 1) {
    codec = avcodec_find_encoder(AV_CODEC_ID_MPEG4);
  }
  TORCH_CHECK(codec, s.what, ": this FFmpeg has neither a libx264 nor an MPEG-4 encoder");
  s.encoder = new_codec_context(codec);
  auto* enc = s.encoder.get();
  enc->width = static_cast<int>(width);
  enc->height = static_cast<int>(height);
  enc->pix_fmt = AV_PIX_FMT_YUV420P;
  enc->framerate = av_d2q(fps, 1 << 20);
  enc->time_base = av_inv_q(enc->framerate);
  // BT.601 limited range, which readers (and ours) assume for unlabelled video.
  enc->color_range = AVCOL_RANGE_MPEG;
  enc->colorspace = AVCOL_SPC_SMPTE170M;
  // One encoder thread: x264's automatic thread count follows the machine's cores, and the
  // bytes follow the thread count.
  enc->thread_count = 1;
  if (codec->id == AV_CODEC_ID_MPEG4) {
    // MPEG-4's default is a low constant bitrate; a fixed quantiser keeps quality like x264's CRF.
    enc->flags |= AV_CODEC_FLAG_QSCALE;
    enc->global_quality = 3 * FF_QP2LAMBDA;
  } else {
    // x264's macroblock tree reads memory it never wrote when frames are small: the same frames
    // encoded to different bytes depending on what the heap held (80x64 and 320x256 frames under
    // glibc's MALLOC_PERTURB_, with the ffmpeg CLI too; 14 of 19 demo videos differed from run
    // to run, decoded pixels by up to 22 levels). Without it the video is reproducible, at
    // about 3.5x the demo's bitrate for the same quality setting.
    err = av_opt_set(enc->priv_data, "mbtree", "0", 0);
    TORCH_CHECK(err >= 0, s.what, ": cannot switch off ", codec->name,
                "'s macroblock tree: ", av_error(err));
  }
  if (format->flags & AVFMT_GLOBALHEADER) enc->flags |= AV_CODEC_FLAG_GLOBAL_HEADER;
  err = avcodec_open2(enc, codec, nullptr);
  TORCH_CHECK(err >= 0, s.what, ": cannot open the ", codec->name, " encoder: ", av_error(err));

  s.stream = avformat_new_stream(s.output.get(), nullptr);
  TORCH_CHECK(s.stream, s.what, ": out of memory adding a stream");
  s.stream->time_base = enc->time_base;
  s.stream->avg_frame_rate = enc->framerate;
  err = avcodec_parameters_from_context(s.stream->codecpar, enc);
  TORCH_CHECK(err >= 0, s.what, ": bad codec parameters: ", av_error(err));

  if (!(format->flags & AVFMT_NOFILE)) {
    err = avio_open(&s.output->pb, path.c_str(), AVIO_FLAG_WRITE);
    TORCH_CHECK(err >= 0, s.what, ": cannot create: ", av_error(err));
  }
  err = avformat_write_header(s.output.get(), nullptr);
  TORCH_CHECK(err >= 0, s.what, ": cannot write the header: ", av_error(err));

  s.yuv->format = enc->pix_fmt;
  s.yuv->width = enc->width;
  s.yuv->height = enc->height;
  s.yuv->color_range = enc->color_range;
  s.yuv->colorspace = enc->colorspace;
  TORCH_CHECK(av_frame_get_buffer(s.yuv.get(), 0) >= 0, s.what, ": out of memory for a frame");
  s.from_rgb = std::make_unique<FromRgb>(enc->width, enc->height, enc->pix_fmt, s.what);
}

VideoWriter::~VideoWriter() {
  try {
    finish();
  } catch (const std::exception&) {
    // A destructor must not throw; call finish() to see the error.
  }
}

void VideoWriter::write(const torch::Tensor& frame) {
  auto& s = *state_;
  TORCH_CHECK(!s.finished, s.what, ": write() after finish()");
  const int64_t height = s.encoder->height, width = s.encoder->width;
  TORCH_CHECK(frame.defined() && frame.scalar_type() == torch::kUInt8 && frame.dim() == 3 &&
                  frame.size(0) == 3 && frame.size(1) == height && frame.size(2) == width,
              s.what, ": expected a uint8 frame of shape [3,", height, ",", width, "], got ",
              frame.defined() ? c10::toString(frame.scalar_type()) : "undefined", " ",
              frame.defined() ? frame.sizes() : c10::IntArrayRef{});
  // The encoder may still hold the previous frame's buffer.
  const int err = av_frame_make_writable(s.yuv.get());
  TORCH_CHECK(err >= 0, s.what, ": out of memory for a frame: ", av_error(err));
  s.from_rgb->convert(frame.cpu(), s.yuv.get(), s.what);
  s.yuv->pts = s.frames;
  s.encode(s.yuv.get());
  ++s.frames;
}

void VideoWriter::finish() {
  auto& s = *state_;
  if (s.finished) return;
  s.finished = true;  // even if it fails: the file cannot be finished twice
  s.encode(nullptr);
  const int err = av_write_trailer(s.output.get());
  TORCH_CHECK(err >= 0, s.what, ": cannot write the trailer: ", av_error(err));
  if (!(s.output->oformat->flags & AVFMT_NOFILE)) {
    const int closed = avio_closep(&s.output->pb);
    TORCH_CHECK(closed >= 0, s.what, ": cannot write: ", av_error(closed));
  }
}

#else  // FRAMEFIT_WITH_FFMPEG

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

#endif  // FRAMEFIT_WITH_FFMPEG

}  // namespace framefit::data
