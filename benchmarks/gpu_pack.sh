#!/usr/bin/env bash
# Make the folder benchmarks/gpu_split.py needs on a GPU machine that has no network (the lent device):
#   benchmarks/gpu_pack.sh [DIR]        (default: gpuc, git-ignored through .git/info/exclude)
# It holds: whl/ (wheels of mesh-llm's dependencies the device's Python 3.12 may lack), llama-src.tar.xz (the
# pinned llama.cpp tree from the build cache, without docs, media, models and the web UI: ~8.5 MB), and
# vocab.gguf (the tree's Llama-3 BPE vocabulary, for the random-weight model), openssl/ (headers and link libraries
# for a device without libssl-dev), tc/ (iproute2's tc and its libraries: --netem-lo). Then, in one device call:
#   python3 benchmarks/gpu_split.py --carry gpuc          (with carry ["gpuc"])
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-gpuc}
grep -qx "/$dir/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/$dir/" >> .git/info/exclude; }
mkdir -p "$dir/whl"
src=$(.venv/bin/python -c 'from meshllm.llama.build import fetch_pinned_source as f; print(f(say=lambda m: None))')
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dir/whl" qh3 cryptography cffi pycparser gguf zeroconf ifaddr
cp "$src/models/ggml-vocab-llama-bpe.gguf" "$dir/vocab.gguf"
# OpenSSL's headers and link-time libraries, for a device without libssl-dev (the patched build's TLS direct path);
# the binaries load the device's own libssl.so.3 at run time
mkdir -p "$dir/openssl/include" "$dir/openssl/lib"
cp -r /usr/include/openssl "$dir/openssl/include/"
cp /usr/include/"$(gcc -dumpmachine)"/openssl/*.h "$dir/openssl/include/openssl/" 2>/dev/null || true
cp -L /usr/lib/"$(gcc -dumpmachine)"/libssl.so "/usr/lib/$(gcc -dumpmachine)/libcrypto.so" "$dir/openssl/lib/"
# tc (iproute2) and the libraries it needs beyond libc, for --netem-lo on a device without it
mkdir -p "$dir/tc"
cp /usr/sbin/tc "$dir/tc/"
for lib in $(ldd /usr/sbin/tc | awk '/=>/ {print $3}' | grep -Ev '/lib(c|m|z)\.so'); do cp -L "$lib" "$dir/tc/"; done
tar -cJf "$dir/llama-src.tar.xz" -C "$(dirname "$src")" \
  --exclude="$(basename "$src")/docs" --exclude="$(basename "$src")/media" --exclude="$(basename "$src")/models" \
  --exclude="$(basename "$src")/.github" --exclude="$(basename "$src")/benches" \
  --exclude="$(basename "$src")/tools/server/webui" "$(basename "$src")"
du -sh "$dir"
