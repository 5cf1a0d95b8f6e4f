#!/usr/bin/env bash
# Installs every framefit dependency from Debian 12 packages and builds the project.
# Idempotent: re-running it only rebuilds what changed.
#   scripts/setup.sh            install + configure + build (Release, build/)
#   FRAMEFIT_SKIP_BUILD=1 ...   install only
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  build-essential cmake ninja-build pkg-config git
  libtorch-dev libopenblas0-pthread libgloo-dev
  libavformat-dev libavcodec-dev libswscale-dev libavutil-dev ffmpeg
  libcli11-dev libyaml-cpp-dev nlohmann-json3-dev libfmt-dev libspdlog-dev libzip-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3 python3-torch python3-torchvision python3-matplotlib python3-pil python3-numpy
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo_cmd apt-get update -qq
  $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

[ "${FRAMEFIT_SKIP_BUILD:-0}" = 1 ] && exit 0
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build --parallel "$(nproc)"
