#!/usr/bin/env bash
# `make test`'s pytest: two processes at once. The `serial` tests (end-to-end runs, chaos, and the
# files whose tests kill, hang or time processes: tests/conftest.py) run one after the other at
# normal priority; every other test runs beside them at nice 19, on the CPU they leave idle. Both
# print their progress prefixed; the exit status is the first failing one's. Extra arguments go to
# both pytest processes.
set -uo pipefail
PY=${PY:-.venv/bin/python}

run() {  # run <label> <nice> <marker expression> [pytest args]
    local label=$1 niceness=$2 expr=$3
    shift 3
    nice -n "$niceness" "$PY" -m pytest tests -q -m "$expr" "$@" 2>&1 | sed -u "s/^/[$label] /"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 5 ] && rc=0  # no test of this part selected (extra arguments named only the other's)
    return "$rc"
}

start=$(date +%s)
run serial 0 "serial" --durations=20 "$@" &
serial=$!
run unit 19 "not serial" --durations=10 "$@" &
unit=$!
wait "$serial"; serial_rc=$?
wait "$unit"; unit_rc=$?
echo "make test: serial part rc=$serial_rc, unit part rc=$unit_rc, $(( $(date +%s) - start )) s in all"
[ "$serial_rc" -eq 0 ] || exit "$serial_rc"
exit "$unit_rc"
