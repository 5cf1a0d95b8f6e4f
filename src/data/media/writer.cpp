// VideoWriter: frames encoded into a video file through FFmpeg.
#ifdef FRAMEFIT_WITH_FFMPEG
#include "ffmpeg.h"

#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace framefit::data {

using namespace detail;

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

}  // namespace framefit::data

#endif  // FRAMEFIT_WITH_FFMPEG
