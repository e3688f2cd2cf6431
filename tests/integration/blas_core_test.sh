#!/usr/bin/env bash
# OpenBLAS's core as the ranks of a real two-rank job report it (worker/kernels/cpu/blas_core.h).
#
#   blas_core_test.sh MESHTRAIN adopted    the variable unset: where OpenBLAS's own choice is
#                                          older than this CPU runs, rank 0 (a meshtrain-worker
#                                          process) reports the better core; elsewhere exits 77
#                                          (skipped), saying why
#   blas_core_test.sh MESHTRAIN user-set   OPENBLAS_CORETYPE=Prescott: kept by the CLI, the ranks
#                                          and bench train, and said to be the user's
#   blas_core_test.sh MESHTRAIN simulated SHIM
#                                          under SHIM (tests/support/openblas_fallback_shim.cc),
#                                          an OpenBLAS that reports the Prescott fallback: the
#                                          CLI checks and adopts this CPU's best core, and the
#                                          ranks report it with the fallback it replaced
#   blas_core_test.sh MESHTRAIN failed-check SHIM
#                                          the same, with every self-check failing (the shim
#                                          reports Prescott whatever core is asked for): the
#                                          job keeps Prescott and warns, naming the core that
#                                          failed and why
# Run from the repository root.
set -uo pipefail
meshtrain=$1 mode=$2 shim=${3:-}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$meshtrain" prepare-data examples/data/pride-and-prejudice.txt "$tmp/train.bin" --validation "$tmp/val.bin" >/dev/null ||
  { echo "FAIL prepare-data"; exit 1; }
sed -e "s|examples/data/corpus.train.bin|$tmp/train.bin|; s|examples/data/corpus.val.bin|$tmp/val.bin|" \
    -e 's/steps: 300/steps: 2/; s/warmupSteps: 20/warmupSteps: 1/; s/evalInterval: 50/evalInterval: 2/' \
    examples/gpt2-tiny-fsdp.yaml > "$tmp/job.yaml"

run_job() {  # the job, with the environment given; prints rank 0's job line
  env "$@" timeout 120 "$meshtrain" run "$tmp/job.yaml" --no-resume --sample-tokens 0 > "$tmp/out.log" 2>&1 ||
    { sed 's/^/     | /' "$tmp/out.log"; echo "FAIL the job did not run"; exit 1; }
  grep -E '^job gpt2-tiny-fsdp: 2 rank\(s\) .* rank 0 on cpu in fp32, kernels ' "$tmp/out.log" ||
    { sed 's/^/     | /' "$tmp/out.log"; echo "FAIL no job line naming rank 0's kernels"; exit 1; }
}

case $mode in
  adopted)
    line=$(run_job -u OPENBLAS_CORETYPE -u MESHTRAIN_BLAS_CORE)
    echo "$line"
    if [[ $line =~ kernels\ OpenBLAS\ [0-9.]+\ ([A-Za-z0-9_]+)\ \(detected\;\ (.*)\)$ ]]; then
      echo "skipped: OpenBLAS's own choice here, ${BASH_REMATCH[1]}, is already the best core it has for this CPU (${BASH_REMATCH[2]})"
      exit 77
    fi
    if [[ $line =~ kernels\ OpenBLAS\ [0-9.]+\ ([A-Za-z0-9_]+)\ \(([A-Za-z0-9_]+)\ detected\;\ CPU\ has\ .*\)$ ]] &&
       [ "${BASH_REMATCH[1]}" != "${BASH_REMATCH[2]}" ]; then
      echo "ok   rank 0 runs ${BASH_REMATCH[1]}, better than the ${BASH_REMATCH[2]} OpenBLAS detected"
      grep -q 'failed its self-check' "$tmp/out.log" && echo "note: a better core failed its self-check"
      exit 0
    fi
    echo "FAIL the job line does not say which core was detected and which runs"
    exit 1 ;;
  user-set)
    line=$(run_job -u MESHTRAIN_BLAS_CORE OPENBLAS_CORETYPE=Prescott)
    echo "$line"
    [[ $line =~ kernels\ OpenBLAS\ [0-9.]+\ Prescott\ \(set\ by\ OPENBLAS_CORETYPE=Prescott\)$ ]] ||
      { echo "FAIL rank 0 does not keep the user's Prescott"; exit 1; }
    ! grep -q 'self-check' "$tmp/out.log" || { echo "FAIL a core the user set was checked"; exit 1; }
    OPENBLAS_CORETYPE=Prescott timeout 120 "$meshtrain" bench train --model gpt2-tiny --batch 2 --seq 64 --steps 2 \
      > "$tmp/bench.log" 2>&1 || { cat "$tmp/bench.log"; echo "FAIL bench train"; exit 1; }
    grep -E '^model gpt2-tiny .*, fp32 on CPU, [0-9]+ threads, OpenBLAS [0-9.]+ Prescott \(set by OPENBLAS_CORETYPE=Prescott\)$' \
      "$tmp/bench.log" || { cat "$tmp/bench.log"; echo "FAIL bench train does not name the user's core"; exit 1; }
    echo "ok   the user's OPENBLAS_CORETYPE=Prescott is kept and named"
    exit 0 ;;
  simulated)
    line=$(run_job -u OPENBLAS_CORETYPE -u MESHTRAIN_BLAS_CORE -u OPENBLAS_FALLBACK_SHIM LD_PRELOAD="$shim")
    echo "$line"
    if [[ $line =~ kernels\ OpenBLAS\ [0-9.]+\ Prescott\ \(detected\;\ CPU\ has\ (SSE3|no\ SSE3)\)$ ]]; then
      echo "skipped: this CPU runs nothing newer than Prescott's kernels"
      exit 77
    fi
    [[ $line =~ kernels\ OpenBLAS\ [0-9.]+\ ([A-Za-z0-9_]+)\ \(Prescott\ detected\;\ CPU\ has\ [^\)]+\)$ ]] &&
      [ "${BASH_REMATCH[1]}" != Prescott ] || { echo "FAIL rank 0 does not run a better core than the fallback"; exit 1; }
    ! grep -q 'self-check' "$tmp/out.log" || { sed 's/^/     | /' "$tmp/out.log"; echo "FAIL a warning"; exit 1; }
    echo "ok   rank 0 runs ${BASH_REMATCH[1]} in place of the Prescott fallback"
    exit 0 ;;
  failed-check)
    line=$(run_job -u OPENBLAS_CORETYPE -u MESHTRAIN_BLAS_CORE LD_PRELOAD="$shim" OPENBLAS_FALLBACK_SHIM=always)
    echo "$line"
    if [[ $line =~ \(detected\;\ CPU\ has\ (SSE3|no\ SSE3)\)$ ]]; then
      echo "skipped: this CPU runs nothing newer than Prescott's kernels, so there is nothing to check"
      exit 77
    fi
    [[ $line =~ kernels\ OpenBLAS\ [0-9.]+\ Prescott\ \(detected\;\ ([A-Za-z0-9_]+)\ failed\ its\ self-check\ \(OpenBLAS\ ran\ Prescott,\ not\ ([A-Za-z0-9_]+)\)(,\ and\ [0-9]+\ more)?\;\ CPU\ has\ [^\)]+\)$ ]] &&
      [ "${BASH_REMATCH[1]}" = "${BASH_REMATCH[2]}" ] ||
      { sed 's/^/     | /' "$tmp/out.log"; echo "FAIL rank 0 does not keep Prescott naming the core that failed"; exit 1; }
    grep -E "^warning: OpenBLAS chose Prescott, older than this CPU runs \(.+\), and ${BASH_REMATCH[1]} failed its self-check .*; keeping Prescott$" \
      "$tmp/out.log" || { sed 's/^/     | /' "$tmp/out.log"; echo "FAIL no warning of the failed self-check"; exit 1; }
    echo "ok   a failed self-check keeps Prescott, and the job warns"
    exit 0 ;;
  *) echo "usage: blas_core_test.sh MESHTRAIN adopted|user-set|simulated SHIM|failed-check SHIM" >&2; exit 2 ;;
esac
