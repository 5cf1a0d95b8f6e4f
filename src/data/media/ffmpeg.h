#pragma once
// FFmpeg plumbing shared by the video reader, the image reader and writer and the video writer:
// errors as text, owning pointers, frames checked for damage, and conversion to and from RGB
// (turned as EXIF says). Private to src/data/media; only built with FFmpeg.
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "framefit/data/media.h"

extern "C" {
#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libavutil/display.h>
#include <libavutil/mem.h>
#include <libavutil/opt.h>
#include <libavutil/pixdesc.h>
#include <libswscale/swscale.h>
}

namespace framefit::data::detail {

inline void quiet_ffmpeg() {
  // FFmpeg logs to stderr by default; errors reach the caller as exceptions instead.
  static const bool quiet = [] {
    av_log_set_level(AV_LOG_QUIET);
    return true;
  }();
  (void)quiet;
}

// av_err2str is a C compound-literal macro, not usable from C++.
inline std::string av_error(int err) {
  char buf[AV_ERROR_MAX_STRING_SIZE] = {0};
  if (av_strerror(err, buf, sizeof(buf)) < 0) return "FFmpeg error " + std::to_string(err);
  return buf;
}

// An error reading a file's packets, with what it means there: a packet of absurd size is what
// a damaged header makes, and FFmpeg reports it as out of memory.
inline std::string read_error(int err) {
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

inline FramePtr new_frame() {
  FramePtr frame(av_frame_alloc());
  TORCH_CHECK(frame, "FFmpeg: out of memory allocating a frame");
  return frame;
}
inline PacketPtr new_packet() {
  PacketPtr packet(av_packet_alloc());
  TORCH_CHECK(packet, "FFmpeg: out of memory allocating a packet");
  return packet;
}
inline CodecPtr new_codec_context(const AVCodec* codec) {
  CodecPtr context(avcodec_alloc_context3(codec));
  TORCH_CHECK(context, "FFmpeg: out of memory allocating a codec context");
  return context;
}

// A frame's decoder reported concealed errors or marked it corrupt.
inline bool damaged(const AVFrame* frame) {
  return frame->decode_error_flags != 0 || (frame->flags & AV_FRAME_FLAG_CORRUPT) != 0;
}

// Checks that `t` is a contiguous CPU uint8 tensor of `dims` dimensions whose first sizes match
// `expected` (-1: any positive size); `what` names the file, `shape` the shape expected.
inline void check_frames_tensor(const torch::Tensor& t, const std::vector<int64_t>& expected,
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
inline AVPixelFormat without_jpeg_range(AVPixelFormat format, bool* full_range) {
  switch (format) {
    case AV_PIX_FMT_YUVJ420P: *full_range = true; return AV_PIX_FMT_YUV420P;
    case AV_PIX_FMT_YUVJ422P: *full_range = true; return AV_PIX_FMT_YUV422P;
    case AV_PIX_FMT_YUVJ444P: *full_range = true; return AV_PIX_FMT_YUV444P;
    case AV_PIX_FMT_YUVJ440P: *full_range = true; return AV_PIX_FMT_YUV440P;
    case AV_PIX_FMT_YUVJ411P: *full_range = true; return AV_PIX_FMT_YUV411P;
    default: return format;
  }
}

inline bool is_yuv(AVPixelFormat format) {
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
inline bool swaps_sides(int orientation) { return orientation >= 5; }

// The picture `stored` [3,H,W] as EXIF `orientation` says to show it (what PIL's
// ImageOps.exif_transpose and the ffmpeg CLI show).
inline torch::Tensor oriented(const torch::Tensor& stored, int orientation) {
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
inline void convert_oriented(ToRgb& to_rgb, const AVFrame* frame, uint8_t* out, int out_height,
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

inline void check_window(const FrameWindow& window, int64_t out_height, int64_t out_width,
                  const std::string& what) {
  if (window.height == 0) return;
  TORCH_CHECK(
      window.width > 0 && window.top >= 0 && window.left >= 0 &&
          window.top + out_height <= window.height && window.left + out_width <= window.width,
      what, ": a ", out_height, "x", out_width, " window at (", window.top, ", ", window.left,
      ") does not fit in frames resized to ", window.height, "x", window.width);
}

}  // namespace framefit::data::detail
