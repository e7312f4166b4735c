#!/usr/bin/env bash
# The long4x plan (docs/results.md, "The 4800-step plan"), in its order: two lanes of one run at a time, so both
# cores stay busy while a suite waits on its own sweep (an extension past a grid's end is one run). Every
# finished run is saved at once; running this again continues where it stopped (finished runs are skipped).
#   bash scripts/long4x.sh [RESULTS_FOLDER]      (default results/long4x)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/long4x}

lane() {
    for suite in "$@"; do
        # shellcheck disable=SC2086  # "SUITE --optimizers A,B" splits into its words on purpose
        bubblefree reproduce $suite --scale long4x --out "$out" --jobs 1 || return $?
    done
}

lane "error-feedback --optimizers muon,adamw" "error-feedback --optimizers soap,adan,lion,mars" \
     "schedules --optimizers muon" &
lane "moe --optimizers muon,adamw" "momentum --optimizers adamw" &
wait
