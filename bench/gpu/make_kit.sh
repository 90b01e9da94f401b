#!/bin/bash
# Builds a GPU kit in .gpu/ of the current directory, for a machine with an NVIDIA GPU and nvcc
# but no package index (bench/gpu/README.md). Run it from the project's root on a machine that
# has a package index; it adds /.gpu/ to .git/info/exclude. The kit:
#   llama.cpp.tgz    the llama.cpp that llama-cpp-python 0.3.36 vendors: libraries and llama-server
#   llama_cpp_py.tgz llama-cpp-python 0.3.36's Python package (no libraries: built there)
#   project.tgz      the project at the checkout's HEAD
#   whl/             wheels (CPython 3.12, manylinux) for what the serve extra and the
#                    benchmark clients (httpx, openai) need
#   device_setup.sh  the setup to run there (a copy of the one beside this script)
#   llama-cuda-sm90.tar.xz  where this machine has nvcc: that llama.cpp built with CUDA
#                    (bench/gpu/prebuild_cuda.sh), which the GPU machine uses when it loads there
# Usage: bench/gpu/make_kit.sh [SDIST_DIR]   (an unpacked llama-cpp-python 0.3.36 sdist; default:
# downloads and unpacks it)
set -eu
P=$(pwd)
S=${1:-}
if [[ -z $S ]]; then
  d=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36 -d "$d"  # the sdist, not its build tools: those come as wheels
  tar xzf "$d"/llama_cpp_python-0.3.36.tar.gz -C "$d"; S=$d/llama_cpp_python-0.3.36
fi
K=$(pwd)/.gpu; rm -rf "$K"; mkdir -p "$K/whl"
ex=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$ex")"  # a worktree's too
grep -qx '/.gpu/' "$ex" 2> /dev/null || echo '/.gpu/' >> "$ex"
# llama.cpp trimmed to what the libraries and llama-server build from: no other backends, no
# examples, the web UI's build files without its assets.
t=$(mktemp -d); L=$S/vendor/llama.cpp; D=$t/llama.cpp; mkdir -p "$D/tools/ui" "$D/scripts"
cp -r "$L"/{ggml,src,include,common,cmake,vendor,licenses,LICENSE,CMakeLists.txt} "$D/"
cp -r "$L/tools/server" "$L/tools/mtmd" "$D/tools/"
cp "$L"/tools/ui/{CMakeLists.txt,ui.cpp.in,ui.h.in,sources.cmake} "$D/tools/ui/"
cp "$L/scripts/ui-assets.cmake" "$D/scripts/"
for b in cann et hexagon hip metal musa opencl openvino sycl virtgpu vulkan webgpu zdnn zendnn; do rm -rf "$D/ggml/src/ggml-$b"; done
printf '%s\n' 'find_package(Threads REQUIRED)' 'llama_add_compile_flags()' 'add_subdirectory(mtmd)' 'add_subdirectory(ui)' 'add_subdirectory(server)' > "$D/tools/CMakeLists.txt"
tar czf "$K/llama.cpp.tgz" -C "$t" llama.cpp
tar czf "$K/llama_cpp_py.tgz" -C "$S" --exclude='llama_cpp/server' --exclude='llama_cpp/lib' llama_cpp
git -C "$P" archive --format=tar.gz -o "$K/project.tgz" HEAD
plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any"
# The closure of the serve extra, gguf, httpx (the load client of bench/serve_load.py) and
# openai (the client of bench/gpu/check_offload.py) for CPython 3.12, less numpy and
# prometheus_client, which that machine has (fastapi 0.165 does not import without
# opentelemetry-api, annotated-doc and anyio; uvicorn needs click).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d "$K/whl" \
  cffi==2.1.1 pycparser==3.12 fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 \
  typing-inspection==0.4.5 annotated-types==0.8.0 uvicorn==0.55.0 msgspec==0.23.0 pyzmq==27.3.0 gguf==0.19.0 diskcache==5.6.3 \
  opentelemetry-api importlib-metadata zipp lazy-importer annotated-doc==0.0.7 anyio==4.16.0 \
  typing-extensions==4.16.0 click==8.5.1 httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 certifi idna \
  pyyaml==6.0.4 tqdm==4.70.1 requests==2.34.2 urllib3==2.8.0 charset-normalizer==3.5.3 \
  openai==3.63.0 jiter==0.19.0 sniffio==1.3.1 httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5
cp "$(dirname "$0")/device_setup.sh" "$K/"
# With nvcc here, llama.cpp prebuilt with CUDA (about 20 minutes on 2 cores the first time, kept
# for the next kit), so that the GPU machine need not build it; PREBUILT=0 leaves it out.
if [[ ${PREBUILT:-1} != 0 ]]; then
  rc=0; bash "$(dirname "$0")/prebuild_cuda.sh" "$L" "$K/llama-cuda-sm${CUDA_ARCH:-90}.tar.xz" || rc=$?
  case $rc in
    0) ;;
    3) echo "make_kit: no nvcc here: the GPU machine will build llama.cpp (about 5 minutes)" >&2 ;;
    *) echo "make_kit: the prebuild failed ($rc): the GPU machine will build llama.cpp" >&2
       rm -f "$K/llama-cuda-sm${CUDA_ARCH:-90}.tar.xz" ;;
  esac
fi
rm -rf "$t"; du -sh "$K" "$K"/*
