#!/bin/sh
# The "python" that mlx.launch runs on every host, in the project directory: records this
# rank's pid (stop uses it; mlx.launch's own pid file is hidden in a temp file), preloads
# Debian's OpenBLAS where it exists (MLX's Linux CPU wheel ships a slow BLAS), then
# becomes the venv's Python. Each step is `exec`, so the recorded pid is the rank itself.
mkdir -p run
echo $$ >"run/rank-${MLX_RANK:-0}.pid"
openblas=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
if [ -e "$openblas" ]; then
    export LD_PRELOAD="$openblas${LD_PRELOAD:+:$LD_PRELOAD}"
fi
exec "$(pwd)/.venv/bin/python" "$@"
