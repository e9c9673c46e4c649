#!/usr/bin/env bash
# Installs the peer software that kvpool's optional integration tests run against.
#
#   scripts/install-peers.sh torch         CPU torch 2.13.0 (from this machine's disk) + transformers
#   scripts/install-peers.sh mooncake      Debian libibverbs1 + the real Mooncake Store (non-CUDA wheel)
#   scripts/install-peers.sh sglang        SGLang without its CUDA dependencies
#   scripts/install-peers.sh vllm          vLLM without its CUDA dependencies
#   scripts/install-peers.sh lmcache       LMCache without its CUDA dependencies
#   scripts/install-peers.sh redis         Debian redis-server + redis-py (benchmarks/bench_peers.py)
#   scripts/install-peers.sh all           all of the above
#
# Every pip call is constrained to torch==2.13.0: SGLang, vLLM and LMCache pin or pull CUDA
# builds of torch (several GB), so they are installed with --no-deps plus the pure-Python
# packages that the modules kvpool's tests import need. That is enough for their storage,
# connector and config classes on the CPU, not for serving a model. PYTHON selects the
# interpreter (default python3). Versions are pinned to the ones the tests were written against.
# Checked in a new virtual environment: `all` took 5.5 minutes and 3.8 GB (torch 754 MB, vllm
# 877 MB, triton 999 MB); pip reports the skipped dependencies as conflicts, which is expected.
set -euo pipefail

PYTHON="${PYTHON:-python3}"
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==2.13.0" > "$CONSTRAINTS"

pip_install() {
    "$PYTHON" -m pip install --quiet --disable-pip-version-check -c "$CONSTRAINTS" "$@"
}

install_torch() {
    pip_install "torch==2.13.0" "transformers>=5.4,<6"
}

# apt_install PACKAGE WHAT: the Debian package, as root; else say what needs it and fail.
apt_install() {
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" >/dev/null
    else
        echo "install-peers: $2 needs $1 (apt-get install $1, as root)" >&2
        return 1
    fi
}

install_mooncake() {
    if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
        apt_install libibverbs1 Mooncake
    fi
    pip_install "mooncake-transfer-engine-non-cuda==0.3.13.post1"
}

install_sglang() {
    install_torch
    pip_install --no-deps "sglang==0.5.23"
    # triton (about 1 GB) because sglang.srt.utils imports it at module level.
    pip_install psutil pybase64 pillow starlette pyzmq orjson IPython triton
}

install_vllm() {
    install_torch
    pip_install --no-deps "vllm==0.34.0"
    pip_install cbor2 openai-harmony openai cachetools xgrammar==0.2.8 fastapi partial-json-parser requests \
        llguidance py-cpuinfo pyzmq pillow psutil pybase64 pyyaml cloudpickle einops
}

install_lmcache() {
    install_torch
    pip_install --no-deps "lmcache==0.5.6"
    pip_install numba aiofile aiofiles sortedcontainers psutil py-cpuinfo pyyaml pyzmq \
        prometheus-client safetensors blake3 cachetools cryptography
}

install_redis() {
    # bench_peers.py starts its own redis-server on 127.0.0.1, persistence off; the Debian
    # package's own service is left as Debian starts it.
    if ! command -v redis-server >/dev/null; then
        apt_install redis-server "The Redis benchmark"
    fi
    pip_install "redis>=5"
}

if [ "$#" -eq 0 ]; then
    sed -n '2,10p' "$0"
    exit 2
fi
for peer in "$@"; do
    case "$peer" in
        torch) install_torch ;;
        mooncake) install_mooncake ;;
        sglang) install_sglang ;;
        vllm) install_vllm ;;
        lmcache) install_lmcache ;;
        redis) install_redis ;;
        all) install_torch; install_mooncake; install_sglang; install_vllm; install_lmcache; install_redis ;;
        *) echo "install-peers: unknown peer '$peer'" >&2; exit 2 ;;
    esac
done
