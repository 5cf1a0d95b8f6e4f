#!/usr/bin/env bash
# Builds framefit against the CUDA LibTorch of the python3 on PATH (a GPU machine's PyTorch)
# and runs the fast tests, the CUDA ones included. No Debian packages are needed there: the CLI
# and FFmpeg are left out, GoogleTest is built from the source tree given as $1, and
# nlohmann-json and yaml-cpp come from copies of Debian's under the prefixes given as $3 and $4
# (defaults .device/json: /usr/include/nlohmann and /usr/share/cmake/nlohmann_json as include/
# and share/cmake/; .device/yaml: /usr/include/yaml-cpp, libyaml-cpp.so* and its cmake folder
# under include/ and lib/x86_64-linux-gnu/).
#   scripts/cuda_check.sh /path/to/googletest-source [build-dir] [json-prefix] [yaml-prefix]
set -euo pipefail
cd "$(dirname "$0")/.."
gtest_src=$(realpath "$1")
build=${2:-build-cuda}
json_prefix=$(realpath "${3:-.device/json}")
yaml_prefix=$(realpath "${4:-.device/yaml}")
torch_dir=$(python3 -c 'import os, torch; print(os.path.join(torch.utils.cmake_prefix_path, "Torch"))')
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTorch_DIR="$torch_dir" \
  -DCMAKE_CXX_STANDARD=20 -DFRAMEFIT_BUILD_CLI=OFF -DFRAMEFIT_WITH_FFMPEG=OFF \
  -DFRAMEFIT_GTEST_SOURCE_DIR="$gtest_src" -DCMAKE_PREFIX_PATH="$json_prefix;$yaml_prefix"
cmake --build "$build" --parallel "$(nproc)" --target framefit_tests_fast
"$build/tests/framefit_tests_fast"
