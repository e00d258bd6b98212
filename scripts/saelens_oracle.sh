#!/usr/bin/env bash
# Creates the virtualenv that holds SAELens, the reference the SAE tests compare probe against.
# SAELens 6 requires transformer-lens < 4 while the main environment needs transformer-lens 4, so it lives
# in its own environment without the system's site packages; the tests call it through subprocess
# (tests/saelens_oracle.py) and skip, saying why, where it is absent. About 3 minutes and 1.9 GB here:
# torch 2.13.0 comes from the machine's CPU wheel, the rest from PyPI.
#   usage: bash scripts/saelens_oracle.sh [VENV]   (default: $PROBE_SAELENS_VENV or /tmp/saelens-venv)
set -euo pipefail
venv="${1:-${PROBE_SAELENS_VENV:-/tmp/saelens-venv}}"
# circuit-tracer 0.5 is an oracle too (tests/test_tree_setup.py); its own pins (transformers <= 4.57, nnsight) are for
# backends the tests do not use, so it goes in without its dependencies
circuit_tracer="circuit-tracer==0.5.0"
# so is auto_circuit 1.0.1, without its pins too (its notebooks' and plots' packages); blobfile, which it imports at
# module level, with its own
auto_circuit="auto_circuit==1.0.1 attrs ordered-set"
oracles() {
    "$1/bin/python" -c "import circuit_tracer" 2>/dev/null || "$1/bin/python" -m pip install -q --no-deps "$circuit_tracer"
    "$1/bin/python" -c "import auto_circuit, attr, ordered_set, blobfile" 2>/dev/null || {
        "$1/bin/python" -m pip install -q --no-deps $auto_circuit && "$1/bin/python" -m pip install -q blobfile; }
}
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import sae_lens" 2>/dev/null; then
    oracles "$venv"
    echo "SAELens oracle already at $venv"
    exit 0
fi
# built beside its final name and moved there only once SAELens imports: the tests look for the final name,
# and a half-built environment there would make them fail rather than skip
building="$venv.building"
rm -rf "$building" "$venv"
python -m venv "$building"
"$building/bin/pip" install -q torch==2.13.0
"$building/bin/pip" install -q "sae-lens==6.54.12"
oracles "$building"
"$building/bin/python" -c "import sae_lens" && mv "$building" "$venv"
"$venv/bin/python" -c "import sae_lens; print('SAELens', sae_lens.__version__, 'at $venv')"
