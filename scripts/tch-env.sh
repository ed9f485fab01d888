# Sourced by the LibTorch scripts: makes sure PyTorch 2.9.0 is in a virtual environment
# (installed from PyPI the first time) and points the build and the test binaries at it.
# burn-tch 0.21 builds against exactly that version; LIBTORCH_USE_PYTORCH=1 makes torch-sys
# link the venv's torch instead of downloading libtorch at build time.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/burn-accelerate/target}"
venv="${TORCH_VENV:-$HOME/.cache/burn-accelerate/torch-venv}"

if ! "$venv/bin/python" -c \
  'import sys, torch; sys.exit(torch.__version__.split("+")[0] != "2.9.0")' 2>/dev/null; then
  # Debian's python3 ships venv's pip bootstrap separately.
  if ! python3 -c 'import ensurepip' 2>/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null \
      || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null; }
  fi
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet torch==2.9.0
fi

# torch-sys asks `python` (with VIRTUAL_ENV set) where torch's headers and libraries are.
export VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" LIBTORCH_USE_PYTORCH=1
# The binaries load libtorch at run time from the wheel's lib/.
torch_lib="$(python -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null)"
export LD_LIBRARY_PATH="$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
