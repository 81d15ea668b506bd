# mesh-llm tasks. `just` comes from the PyPI package rust-just (installed by `scripts/setup test`).
set shell := ["bash", "-euo", "pipefail", "-c"]

bin := ".venv/bin"

default:
    @just --list

# Build (or find in the cache) the patched and the stock llama.cpp binaries.
build:
    {{bin}}/mesh-llm build
    {{bin}}/mesh-llm build --stock

# Pack portable binaries, every wheel and an install script for machines with no compiler or package index.
bundle out="mesh-llm-bundle.tar.gz" *args="":
    {{bin}}/mesh-llm bundle {{out}} {{args}}

# Serve a model on :9337 (default: the tiny Gemma-3 270M).
serve model="gemma3-270m" *args="":
    {{bin}}/mesh-llm --model {{model}} {{args}}

# Everything CI runs: both builds, the tiny model, then the suite. Prints the time of each step.
test *pytest_args="":
    {{bin}}/python scripts/timed.py \
        "build patched=={{bin}}/mesh-llm build" \
        "build stock=={{bin}}/mesh-llm build --stock" \
        "build portable=={{bin}}/mesh-llm build --cpu portable" \
        "tiny model=={{bin}}/python -c 'from meshllm.models.tiny import tiny_model_path as p; print(p())'" \
        "every python=={{bin}}/python scripts/interpreters.py" \
        "lint=={{bin}}/ruff check src tests benchmarks scripts" \
        "mypy=={{bin}}/mypy --strict src" \
        "unit tests=={{bin}}/pytest -q -rs tests/unit {{pytest_args}}" \
        "simulation=={{bin}}/pytest -q -rs tests/sim {{pytest_args}}" \
        "integration tests=={{bin}}/pytest -q -rs tests/integration {{pytest_args}}" \
        "security tests=={{bin}}/pytest -q -s -rs tests/security {{pytest_args}}" \
        "NAT lab=={{bin}}/pytest -q -s -rs tests/netns {{pytest_args}}"

# Unit tests only (no binaries needed).
unit *args="":
    {{bin}}/pytest -q tests/unit {{args}}

lint:
    {{bin}}/ruff check src tests benchmarks scripts
    {{bin}}/mypy --strict src

# Benchmarks print tables; see benchmarks/README.md.
bench *args="":
    @ls benchmarks/*.py >/dev/null 2>&1 && for b in benchmarks/*.py; do {{bin}}/python "$b" {{args}}; done || echo "no benchmarks yet"
