#!/usr/bin/env bash
# mypy over the product packages as the installed `slora` package lays them out (kernels/ is slora.kernels,
# adapters/ slora.adapters, api/ slora.api): a tree of links, since mypy cannot follow the editable install.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/slora"
for entry in "$root"/slora/*; do ln -s "$entry" "$tree/slora/"; done
for package in kernels adapters api; do ln -s "$root/$package" "$tree/slora/$package"; done
cd "$tree"
"${VENV:-$root/.venv}/bin/mypy" --config-file "$root/pyproject.toml" --python-executable "${VENV:-$root/.venv}/bin/python" -p slora
