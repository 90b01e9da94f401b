#!/bin/bash
# On the GPU machine, from the project's root, with the kit of bench/gpu/make_kit.sh in .gpu/:
# takes the kit's prebuilt llama.cpp when it loads here, else builds llama.cpp with CUDA
# (libraries + llama-server for one architecture, without the flash-attention kernels as the
# prebuilt one: at most the 270-340 s measured with them on 16 cores), and installs
# llama-cpp-python's package on those libraries, the kit's wheels and the project into
# $GPU_WORK (default /tmp/gw, outside the checkout, so a second run finds the build there and
# skips it). Skips what is already there. Then:
#   source /tmp/gw/env.sh     # PYTHONPATH, LD_LIBRARY_PATH, LLAMA_SERVER
# Environment: GPU_WORK, CUDA_ARCH (90 = H100/H200), CUDA (OFF: a CPU build, to try the kit on
# a machine without a GPU), BUILD_S (build time limit in seconds, default 480; a build cut short
# resumes where it stopped), PROJECT_SRC (a folder to install instead of .gpu/project.tgz, e.g.
# "." for the checkout itself, uncommitted changes included), PREBUILT (0: build even when the
# kit has a prebuilt llama.cpp), CUDA_HOME (where to look first for the CUDA libraries),
# STEP_S (the limit of each other step: the wheels' install, the project's, CMake's configure,
# the import test; default 240 s).
# The project is installed again only when its sources changed (a hash of the files git
# lists, or of the kit's project.tgz, kept in $GPU_WORK/projsite.hash).
set -u
K=$(pwd)/.gpu
W=${GPU_WORK:-/tmp/gw}; mkdir -p "$W"
T0=$SECONDS
say() { echo "[$((SECONDS - T0))s] $*"; }
step=${STEP_S:-240}
site=$W/site
if [[ ! -f $W/.wheels ]]; then
  timeout -k 10 "$step" python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$K"/whl/*.whl \
    > "$W/pip.log" 2>&1 || { say "wheels failed (exit $?; 124: not done in ${step}s): $(tail -3 "$W/pip.log")"; exit 1; }
  tar xzf "$K/llama_cpp_py.tgz" -C "$site" && touch "$W/.wheels"
fi
export PYTHONPATH=$site
# The project's sources as one hash: the files git lists (tracked and untracked, not ignored)
# where the folder is a checkout's root, else every file but hidden folders and build outputs.
tree_hash() {
  if [[ $(git -C "$1" rev-parse --show-toplevel 2> /dev/null) == "$(cd "$1" && pwd -P)" ]]; then
    (cd "$1" && git ls-files -z -co --exclude-standard | sort -z | xargs -0 -r sha256sum 2> /dev/null)
  else
    (cd "$1" && find . -mindepth 1 \( -name '.*' -o -name __pycache__ -o -name build -o -name dist \
      -o -name '*.egg-info' -o -name gpu-out \) -prune -o -type f -print0 | sort -z \
      | xargs -0 -r sha256sum)
  fi | sha256sum | cut -d' ' -f1
}
src=${PROJECT_SRC:-}
if [[ -z $src ]]; then
  hash=kit-$(sha256sum < "$K/project.tgz" | cut -d' ' -f1)
else
  hash=$(tree_hash "$src")
fi
if [[ -f $W/projsite.hash && $(cat "$W/projsite.hash") == "$hash" && -d $W/projsite ]]; then
  say "project unchanged since its install: kept"
  echo 0 > "$W/proj.rc"
  pj=
else
  if [[ -z $src ]]; then rm -rf "$W/proj"; mkdir -p "$W/proj"; tar xzf "$K/project.tgz" -C "$W/proj"; src=$W/proj; fi
  rm -rf "$W/projsite" "$W/projsite.hash"
  # The project installs (compiles its C core) while llama.cpp builds.
  ( timeout -k 10 "$step" python3 -m pip install -q --no-index --no-build-isolation --no-deps --no-compile \
      --target "$W/projsite" "$src" > "$W/proj-install.log" 2>&1
    rc=$?; [[ $rc == 0 ]] && echo "$hash" > "$W/projsite.hash"; echo $rc > "$W/proj.rc" ) &
  pj=$!
fi
# A prebuilt llama.cpp in the kit (bench/gpu/prebuild_cuda.sh, on a machine with nvcc) saves the
# build when it loads here: every library it needs is found (cuBLAS and the CUDA runtime, each
# in whichever folder has it) and llama-server lists the GPU. The driver's libcuda.so.1 is not
# looked for: `--list-devices` naming CUDA0 proves it. Otherwise, or with PREBUILT=0, build.
unpack_xz() {  # archive, folder: tar, or Python's tarfile where this machine has no xz
  if command -v xz > /dev/null; then tar xJf "$1" -C "$2"; else
    python3 -c 'import sys, tarfile
with tarfile.open(sys.argv[1], "r:xz") as t:
    t.extractall(sys.argv[2], **({"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}))' "$1" "$2"
  fi
}
cuda_lib=
pre=$K/llama-cuda-sm${CUDA_ARCH:-90}.tar.xz
if [[ ! -x $W/b/bin/llama-server && ! -f $pre && ${PREBUILT:-1} != 0 && ${CUDA:-ON} != OFF ]]; then
  say "the kit has no prebuilt llama.cpp ($(basename "$pre"): bench/gpu/make_kit.sh adds it on a machine with nvcc); building it here, at most 270-340 s on 16 cores"
fi
if [[ ! -x $W/b/bin/llama-server && -f $pre && ${PREBUILT:-1} != 0 && ${CUDA:-ON} != OFF ]]; then
  rm -rf "$W/pre"; mkdir -p "$W/pre"
  why=
  if ! unpack_xz "$pre" "$W/pre" 2> "$W/prebuilt.log"; then
    why="the kit's archive does not unpack: $(tail -1 "$W/prebuilt.log")"
  else
    nv=$(command -v nvcc || true); [[ -n $nv ]] && nv=$(dirname "$(readlink -f "$nv")")/..
    dirs=(${CUDA_HOME:+$CUDA_HOME/lib64 $CUDA_HOME/lib $CUDA_HOME/targets/x86_64-linux/lib}
          ${nv:+$nv/lib64 $nv/lib $nv/targets/x86_64-linux/lib}
          /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib
          /usr/local/cuda-*/lib64 /usr/local/cuda-*/lib /usr/local/cuda-*/targets/x86_64-linux/lib
          /usr/lib/x86_64-linux-gnu
          $(python3 -c 'import glob, site; print(" ".join(d for p in site.getsitepackages() for d in glob.glob(p + "/nvidia/*/lib")))' 2> /dev/null))
    # Each library in the first folder that has it; again with those folders on the path, for
    # what the libraries found need in turn.
    # (Without ldd the start of the prebuilt llama-server below decides alone.)
    command -v ldd > /dev/null || say "no ldd here: the prebuilt llama-server's start decides"
    missing=
    for pass in 1 2 3; do
      command -v ldd > /dev/null || break
      missing=$(LD_LIBRARY_PATH=$W/pre/bin${cuda_lib:+:$cuda_lib} ldd "$W"/pre/bin/libggml-cuda.so 2>&1 \
        | awk '/not found/ {print $1}' | grep -v '^libcuda\.so' | sort -u)
      [[ -z $missing ]] && break
      notfound=
      for l in $missing; do
        found=
        for d in "${dirs[@]}"; do [[ -e $d/$l ]] && { found=$(cd "$d" && pwd); break; }; done
        if [[ -z $found ]]; then notfound="$notfound $l"
        elif [[ ":$cuda_lib:" != *":$found:"* ]]; then cuda_lib=${cuda_lib:+$cuda_lib:}$found; fi
      done
      [[ -n $notfound ]] && { why="not found:$notfound"; break; }
    done
    [[ -z $why && -n $missing ]] && why="not found: $(echo $missing)"
  fi
  if [[ -n $why ]]; then
    say "prebuilt llama.cpp not usable here ($why); building it"; cuda_lib=
  elif ! LD_LIBRARY_PATH=$W/pre/bin${cuda_lib:+:$cuda_lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} timeout 120 "$W/pre/bin/llama-server" --list-devices > "$W/prebuilt.log" 2>&1; then
    say "prebuilt llama-server does not start here ($(tail -1 "$W/prebuilt.log")); building it"; cuda_lib=
  elif command -v nvidia-smi > /dev/null && nvidia-smi -L 2> /dev/null | grep -q '^GPU' \
      && ! grep -q 'CUDA0' "$W/prebuilt.log"; then
    say "prebuilt llama.cpp sees no GPU here ($(grep -m1 -i 'cuda' "$W/prebuilt.log")); building it"; cuda_lib=
  else
    mkdir -p "$W/b" && rm -rf "$W/b/bin" && mv "$W/pre/bin" "$W/b/bin"
    say "prebuilt llama.cpp: $(head -2 "$W/b/bin/PREBUILT" | tail -1)${cuda_lib:+, CUDA libraries from $cuda_lib}"
  fi
  rm -rf "$W/pre"
fi
# The CUDA library folders a prebuilt llama.cpp was found to need (none for one built here).
if [[ -x $W/b/bin/llama-server && -z $cuda_lib && -f $W/cuda_lib ]]; then cuda_lib=$(cat "$W/cuda_lib"); fi
echo "$cuda_lib" > "$W/cuda_lib"
if [[ ! -x $W/b/bin/llama-server ]]; then
  [[ -d $W/src/llama.cpp ]] || { mkdir -p "$W/src" && tar xzf "$K/llama.cpp.tgz" -C "$W/src"; }
  say "configure"
  # Without the flash-attention kernels, as the prebuilt one: both servers run with -fa off.
  timeout -k 10 "$step" cmake -S "$W/src/llama.cpp" -B "$W/b" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=${CUDA:-ON} \
    -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90} -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF > "$W/cmake.log" 2>&1 || { say "configure failed (exit $?; 124: not done in ${step}s)"; tail -20 "$W/cmake.log"; exit 1; }
  say "build (resumes where a timed-out one stopped)"
  timeout "${BUILD_S:-480}" cmake --build "$W/b" -j "$(nproc)" --target llama-server llama > "$W/build.log" 2>&1 \
    || { say "build failed or timed out"; grep -m3 -A6 -E "error|FAILED" "$W/build.log"; tail -2 "$W/build.log"; exit 1; }
  say "built"
fi
# llama-cpp-python loads the libraries from its package's lib/ folder: the same build as llama-server.
mkdir -p "$site/llama_cpp/lib" && cp -a "$W"/b/bin/*.so* "$site/llama_cpp/lib/"
[[ -n $pj ]] && wait "$pj"
[[ $(cat "$W/proj.rc") == 0 ]] || { say "project install failed (exit $(cat "$W/proj.rc"); 124: not done in ${step}s)"; tail -15 "$W/proj-install.log"; exit 1; }
cat > "$W/env.sh" <<ENV
export PYTHONPATH=$W/projsite:$site LD_LIBRARY_PATH=$W/b/bin${cuda_lib:+:$cuda_lib}\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH} LLAMA_SERVER=$W/b/bin/llama-server
ENV
. "$W/env.sh"
# From $W: in the project's root, python3 -c would import the source tree (no compiled modules).
(cd "$W" && timeout -k 10 "$step" python3 -c "import llama_cpp, skippy_scheduler; print('ready: llama-cpp-python', llama_cpp.__version__, 'GPU offload', llama_cpp.llama_supports_gpu_offload())") \
  || { say "the installed packages do not import"; exit 1; }
say "done"
