// Images through FFmpeg: JPEG and PNG read (turned as their EXIF orientation says) and written,
// and label images (masks) read and written exactly.
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

namespace {


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
}  // namespace

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

}  // namespace framefit::data

#endif  // FRAMEFIT_WITH_FFMPEG
