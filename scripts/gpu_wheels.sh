#!/usr/bin/env bash
# Fill .gpu-wheels/ (git-ignored) with what scripts/gpu_check.sh needs on a GPU machine that
# cannot reach a package registry: the cp312 manylinux wheels of the packages its image lacks
# (torch, transformers, aiohttp, uvloop, tokenizers, pytest and their kin are there), and
# SmolLM2's tokenizer files, exported from the default model's GGUF (the checkpoints made there
# use them). Run it here, then carry .gpu-wheels along to the GPU machine (about 12 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
target=.gpu-wheels
mkdir -p "$target"
platforms=()
for n in 17 24 26 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
# One version of each, pinned to what this project is tested with; openai 3 needs httpx2,
# httpcore2 and truststore; typing-extensions, idna and h11 at least as new as they ask.
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" --platform manylinux2014_x86_64 -d "$target" \
    pyzmq==27.3.0 msgspec==0.23.0 llguidance==1.9.1 gguf==0.19.0 honcho==2.0.0 \
    pytest-asyncio==1.5.0 openai==3.3.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 \
    distro==1.9.0 jiter==0.14.0 sniffio==1.3.1 pydantic==2.14.4 pydantic_core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 idna==3.20 \
    h11==0.16.0
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" scripts/gpu_checkpoints.py tokenizer \
    "$target/smollm2-tokenizer"
du -sh "$target"
