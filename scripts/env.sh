# Sourced by the scripts: puts nvcc on PATH when the CUDA toolkit is in its usual place.
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
JOBS=${JOBS:-$(nproc)}
# rustup's default location, when cargo is not already on PATH
if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
  export PATH=$HOME/.cargo/bin:$PATH
fi
