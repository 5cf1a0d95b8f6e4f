#!/usr/bin/env bash
# Writes the dependency prefixes that scripts/cuda_check.sh builds against on a GPU machine
# without Debian's packages (a copy of the working tree travels there; name the folder in the
# device tool's `carry`): copies of the files of Debian's packages that scripts/setup.sh
# installed, and FFmpeg built from Debian's source with only what framefit's tests and demo use.
#   scripts/device_deps.sh [dir]     default: .device (ignore it: .git/info/exclude)
# The FFmpeg build takes about 8 minutes on 2 cores; its source is downloaded with apt's help
# (a sources list of its own under the build folder; the system's apt setup is not touched).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-.device}")
arch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo x86_64-linux-gnu)
mkdir -p "$out"

# Copies a package's headers, libraries and CMake/pkg-config files into $out/$2, /usr stripped.
copy_package() {
  local package=$1 dest=$out/$2
  dpkg -L "$package" | grep -E "^/usr/(include|lib|share/cmake|share/pkgconfig)/" |
    while read -r path; do
      [[ -f $path || -L $path ]] || continue
      mkdir -p "$dest/$(dirname "${path#/usr/}")"
      cp -a "$path" "$dest/${path#/usr/}"
    done
}
rm -rf "$out"/{googletest,json,yaml,cli11,fmt,pkgconf}
cp -a /usr/src/googletest "$out/googletest"
copy_package nlohmann-json3-dev json
copy_package libyaml-cpp-dev yaml
copy_package libyaml-cpp0.7 yaml
copy_package libcli11-dev cli11
copy_package libfmt-dev fmt
copy_package libfmt9 fmt

# Debian's pkgconf and its library, run through a wrapper that finds the library.
mkdir -p "$out/pkgconf"
cp /usr/bin/pkgconf "/usr/lib/$arch/libpkgconf.so.3" "$out/pkgconf/"
cat > "$out/pkgconf/pkg-config" << 'EOF'
#!/bin/sh
# Debian's pkgconf, for machines without a pkg-config (scripts/cuda_check.sh).
dir=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$dir/pkgconf" "$@"
EOF
chmod +x "$out/pkgconf/pkg-config"

# FFmpeg: Debian's version, shared, no assembly (5.1 built with --disable-x86asm alone, inline
# assembly still on, converts planar RGB to YUV with wrong chroma: every written JPEG and video
# came out in the wrong colours), each library finding the others beside it ($ORIGIN).
if [[ ${FRAMEFIT_DEVICE_FFMPEG:-1} != 0 ]]; then
  work=$(mktemp -d /tmp/framefit-ffmpeg.XXXXXX)
  mkdir -p "$work/lists/partial"
  printf 'deb-src http://deb.debian.org/debian bookworm main\n%s\n' \
    'deb-src http://deb.debian.org/debian-security bookworm-security main' > "$work/sources.list"
  apt_options=(-o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o "Dir::State::Lists=$work/lists")
  apt-get "${apt_options[@]}" -qq update
  (cd "$work" && apt-get "${apt_options[@]}" -qq source --download-only ffmpeg)
  tar -xf "$work"/ffmpeg_*.orig.tar.xz -C "$work"
  cd "$work"/ffmpeg-*/
  rm -rf "$out/ffmpeg"
  ./configure --prefix="$out/ffmpeg" --enable-shared --disable-static --enable-pic \
    --disable-programs --disable-doc --disable-asm --disable-everything --disable-autodetect \
    --enable-zlib --disable-avdevice --disable-avfilter --disable-swresample --disable-postproc \
    --enable-protocol=file \
    --enable-decoder=h264,hevc,mpeg4,mpeg1video,mpeg2video,mjpeg,png,gif,tiff,bmp,webp,rawvideo,vp9 \
    --enable-demuxer=mov,matroska,mpegts,avi,image2,gif,image_jpeg_pipe,image_png_pipe,image_tiff_pipe,image_gif_pipe,image_bmp_pipe,image_webp_pipe \
    --enable-parser=h264,hevc,mpeg4video,mpegvideo,mjpeg,png,vp9 \
    --enable-encoder=mjpeg,png,mpeg4 --enable-muxer=mp4,mov,matroska,avi,image2 \
    --enable-bsf=h264_mp4toannexb,hevc_mp4toannexb > "$work/configure.log"
  sed -i 's/^LDSOFLAGS=.*/LDSOFLAGS= -Wl,-rpath,\\$$$$ORIGIN/' ffbuild/config.mak
  make -j"$(nproc)" > "$work/make.log" 2>&1
  make install > /dev/null
  rm -rf "$out/ffmpeg/share"
  # Relocatable: the prefix is where the .pc file lies.
  sed -i -e 's|^prefix=.*|prefix=${pcfiledir}/../..|' -e 's|^libdir=.*|libdir=${prefix}/lib|' \
    -e 's|^includedir=.*|includedir=${prefix}/include|' "$out"/ffmpeg/lib/pkgconfig/*.pc
  rm -rf "$work"
fi
du -sh "$out"
