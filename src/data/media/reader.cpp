// VideoReader: a video's frames through FFmpeg, decoded in order and taken where sampled.
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

}  // namespace framefit::data

#endif  // FRAMEFIT_WITH_FFMPEG
