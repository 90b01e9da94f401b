#!/bin/bash
# Builds llama.cpp's libraries and llama-server with CUDA on a machine that has nvcc but no GPU,
# so that a GPU machine can skip its own build (about 5 of its minutes on 16 cores). What the
# toolkit here may lack comes from the package index: cuBLAS's headers and libraries (the
# nvidia-cublas wheel of the toolkit's version); the driver library libcuda is only linked
# against, so a link stub with its soname stands in for it (the GPU machine's driver provides the
# real one). The build:
#   - one CUDA architecture (CUDA_ARCH, default 90: H100/H200), no flash-attention kernels
#     (GGML_CUDA_FA=OFF: a third of the build; `-fa auto` then resolves to off, and the
#     benchmark runs both servers with `-fa off`), CPU code for x86-64 with AVX2/FMA/F16C rather
#     than this machine's own instructions;
#   - every library and llama-server find each other through RUNPATH $ORIGIN; cuBLAS and the
#     CUDA runtime come from the GPU machine's toolkit (bench/gpu/device_setup.sh puts its
#     library folder on LD_LIBRARY_PATH).
# Usage: bench/gpu/prebuild_cuda.sh LLAMA_CPP_SRC OUT.tar.xz
# Environment: CUDA_ARCH, NVCC (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc),
# PREBUILD_DIR (the build and the downloads, kept for the next run; default
# ~/.cache/skippy-gpu-prebuild), JOBS (default: the cores). Exit 3: no nvcc here (nothing built).
set -eu
say() { echo "prebuild: $*" >&2; }
OUT=$2
ARCH=${CUDA_ARCH:-90}
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
[[ -x $NVCC ]] || { echo "prebuild: no nvcc on this machine; the GPU machine builds llama.cpp itself"; exit 3; }
C=${PREBUILD_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/skippy-gpu-prebuild}
mkdir -p "$C"
# The source is copied into the cache folder (the build folder's CMake cache names its source),
# anew only when its content differs, so that a second run with the same llama.cpp builds nothing.
sum=$(cd "$1" && find . -type f -print0 | sort -z | xargs -0 md5sum | md5sum | cut -c1-16)
SRC=$C/src
if [[ $(cat "$SRC/.content" 2> /dev/null) != "$sum" ]]; then
  rm -rf "$SRC" "$C"/build-*; mkdir -p "$SRC"; cp -a "$1"/. "$SRC/"; echo "$sum" > "$SRC/.content"
fi
ver=$("$NVCC" --version | sed -n 's/.*release \([0-9][0-9]*\)\.\([0-9][0-9]*\).*/\1.\2/p')
major=${ver%%.*}; minor=${ver#*.}
[[ -n $major && -n $minor ]] || { say "cannot read nvcc's version"; exit 1; }
# The toolkit's folder (nvcc on PATH may be a wrapper script elsewhere).
tk=
for d in "${CUDA_HOME:-}" "$(dirname "$(readlink -f "$NVCC")")/.." /usr/local/cuda; do
  [[ -n $d && ( -f $d/include/cuda.h || -f $d/targets/x86_64-linux/include/cuda.h ) ]] && tk=$(cd "$d" && pwd) && break
done
[[ -n $tk ]] || { say "cannot find the CUDA toolkit's folder (set CUDA_HOME)"; exit 1; }
[[ -x $tk/bin/nvcc ]] && NVCC=$tk/bin/nvcc

# cuBLAS: the toolkit's own when it has one, else the wheel of the same CUDA release.
cublas_inc= cublas_lib=
for d in "$tk/include" "$tk/targets/x86_64-linux/include"; do [[ -f $d/cublas_v2.h ]] && cublas_inc=$d && break; done
for d in "$tk/lib64" "$tk/targets/x86_64-linux/lib"; do [[ -e $d/libcublas.so.$major ]] && cublas_lib=$d && break; done
if [[ -z $cublas_inc || -z $cublas_lib ]]; then
  w=$C/cublas-$ver
  if [[ ! -f $w/.done ]]; then
    say "cuBLAS for CUDA $ver from the package index (about 420 MB)"
    rm -rf "$w"; mkdir -p "$w"
    python3 -m pip download -q --no-deps "nvidia-cublas>=$major.$minor,<$major.$((minor + 1))" -d "$w/dl"
    python3 -m zipfile -e "$w"/dl/nvidia_cublas-*.whl "$w/x"
    rm -rf "$w/dl"; touch "$w/.done"
  fi
  root=$(dirname "$(find "$w/x" -name cublas_v2.h | head -1)")/..
  cublas_inc=$(cd "$root/include" && pwd); cublas_lib=$(cd "$root/lib" && pwd)
  # CMake finds a library by its development name; the wheel has only the sonames.
  for l in cublas cublasLt; do ln -sf "lib$l.so.$major" "$cublas_lib/lib$l.so"; done
fi

# The driver library: a link stub with the real one's soname, defining the driver calls that
# ggml-cuda makes under the names cuda.h gives them.
stub=$C/stub-$ver; mkdir -p "$stub"
calls=$(grep -ohE '\bcu[A-Z][A-Za-z0-9_]+[[:space:]]*\(' "$SRC"/ggml/src/ggml-cuda/*.cu "$SRC"/ggml/src/ggml-cuda/*.cuh \
  | tr -d ' (' | grep -v '^cuBLAS$' | sort -u)
{ echo '#include <cuda.h>'; for f in $calls; do echo "SKIPPY_STUB $f"; done; } \
  | gcc -E -P -I"$tk/include" -I"$tk/targets/x86_64-linux/include" - | sed -n 's/^SKIPPY_STUB \([A-Za-z0-9_]*\).*/\1/p' \
  | sed 's/.*/void &(void) {}/' > "$stub/stub.c"
grep -q void "$stub/stub.c" || { say "no driver calls found for the link stub"; exit 1; }
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stub/libcuda.so" "$stub/stub.c"
ln -sf libcuda.so "$stub/libcuda.so.1"
say "link stub for libcuda: $(grep -c void "$stub/stub.c") calls"

b=$C/build-sm$ARCH
# A build folder configured otherwise, or moved, is started afresh (CMake would drop every option
# given here when the CUDA compiler changes under an existing cache).
if [[ -f $b/CMakeCache.txt ]] && ! { grep -qxE "CMAKE_CUDA_COMPILER:[A-Z]+=$NVCC" "$b/CMakeCache.txt" \
    && grep -qx "GGML_CUDA:BOOL=ON" "$b/CMakeCache.txt" \
    && grep -qx "CMAKE_CACHEFILE_DIR:INTERNAL=$b" "$b/CMakeCache.txt"; }; then
  rm -rf "$b"
fi
say "configure ($b)"
cmake -S "$SRC" -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_COMPILER="$NVCC" \
  -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF -DGGML_NATIVE=OFF \
  -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DBUILD_SHARED_LIBS=ON \
  -DCUDA_cublas_LIBRARY="$cublas_lib/libcublas.so" -DCUDA_cublasLt_LIBRARY="$cublas_lib/libcublasLt.so" \
  -DCUDA_cuda_driver_LIBRARY="$stub/libcuda.so" \
  -DCMAKE_CUDA_FLAGS="-I$cublas_inc" -DCMAKE_CXX_FLAGS="-I$cublas_inc" \
  -DCMAKE_EXE_LINKER_FLAGS="-Wl,-rpath-link,$cublas_lib:$stub" \
  -DCMAKE_SHARED_LINKER_FLAGS="-Wl,-rpath-link,$cublas_lib:$stub" \
  -DCMAKE_SKIP_BUILD_RPATH=OFF -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON -DCMAKE_INSTALL_RPATH='$ORIGIN' \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF > "$C/cmake-sm$ARCH.log" 2>&1 \
  || { say "configure failed:"; tail -20 "$C/cmake-sm$ARCH.log" >&2; exit 1; }
say "build (resumes where an interrupted one stopped; about 20 minutes on 2 cores)"
cmake --build "$b" -j "${JOBS:-$(nproc)}" --target llama-server llama > "$C/build-sm$ARCH.log" 2>&1 \
  || { say "build failed:"; grep -m3 -A6 -E "error|FAILED" "$C/build-sm$ARCH.log" >&2; exit 1; }

[[ -f $b/bin/libggml-cuda.so ]] || { say "the build has no libggml-cuda.so (see $C/cmake-sm$ARCH.log)"; exit 1; }
# What the GPU machine needs: the shared libraries, llama-server, and what this build is.
p=$(mktemp -d); mkdir -p "$p/bin"
cp -a "$b"/bin/*.so* "$b/bin/llama-server" "$p/bin/"
strip --strip-unneeded "$p"/bin/*.so* "$p/bin/llama-server" 2> /dev/null || true
cat > "$p/bin/PREBUILT" <<EOF
llama.cpp from $1 (content $sum)
CUDA $ver ($("$NVCC" --version | tail -1)), architecture sm_$ARCH, flash-attention kernels off
host compiler $(gcc -dumpfullversion), glibc $(ldd --version | head -1 | awk '{print $NF}')
needs at run time: libcudart.so.$major, libcublas.so.$major, libcublasLt.so.$major, libcuda.so.1
EOF
tar cJf "$OUT" -C "$p" bin
rm -rf "$p"
say "wrote $OUT ($(du -h "$OUT" | cut -f1))"
