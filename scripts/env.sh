# Sourced by the scripts: puts nvcc on PATH when the CUDA toolkit is in its usual place.
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
JOBS=${JOBS:-$(nproc)}
