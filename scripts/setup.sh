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
  # apt's own output (about a thousand lines) goes to a log, shown only if it fails.
  apt_log=$(mktemp /tmp/framefit-apt.XXXXXX.log)
  echo "setup: installing ${#missing[@]} Debian packages (log: $apt_log)"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  export DEBIAN_FRONTEND=noninteractive
  if ! { $sudo_cmd apt-get update -qq &&
         $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"; } \
       > "$apt_log" 2>&1; then
    tail -n 40 "$apt_log"
    echo "setup: installing packages failed; the whole log is $apt_log" >&2
    exit 1
  fi
  echo "setup: packages installed in $SECONDS s"
fi

[ "${FRAMEFIT_SKIP_BUILD:-0}" = 1 ] && exit 0
build_start=$SECONDS
echo "setup: building (Release, build/; about 6 minutes on 2 cores the first time)"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build build --parallel "$(nproc)"
echo "setup: done in $((SECONDS - build_start)) s of building; the command is $PWD/build/src/cli/framefit"
