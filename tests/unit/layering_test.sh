#!/usr/bin/env bash
# The layering of the engine (docs/design.md, "The device seam"; issue 27, "The model is math
# over views"): nothing in worker/model/ or worker/parallel/ names the CPU kernels
# (kernels::cpu, worker/kernels/cpu/), reaches into device memory from the host
# (DeviceSide, worker/runtime/device_side.h), depends on the CPU stream
# (worker/runtime/cpu_stream.h), or fills and copies memory itself (std::fill, memcpy,
# memset, memmove): all of that goes through the backend and the kernel table, so the
# same code runs on a GPU. worker/train/ does host I/O (token files, checkpoints), so it is
# held only to the first rule that matters for device memory: no DeviceSide. And
# worker/runtime/ takes its allocator's size classes from common/allocator_blocks.h, not
# from the API library's memory model (api/engine_memory.h), which counts them.
#
# Prints file:line: the line, and the rule it breaks, for every violation, and fails if
# there is any. Comments (// to the end of the line) do not count. Before it checks the
# tree it checks itself on a planted file, so a rule that matches nothing fails too.
#
# Usage: layering_test.sh [repository root]

set -euo pipefail

root=${1:-$(cd "$(dirname "$0")/../.." && pwd)}

# rule NAME PATTERN: an extended regular expression (awk), matched against code with its
# // comments removed.
word='(^|[^A-Za-z0-9_])'
end='([^A-Za-z0-9_]|$)'
include='#[[:space:]]*include[[:space:]]*["<]'
device_side_rules=(
  "includes worker/runtime/device_side.h (device memory is touched by the backend and the kernel table only)"
  "${include}worker/runtime/device_side\\.h"
  "names DeviceSide (device memory is touched by the backend and the kernel table only)"
  "${word}DeviceSide${end}"
)
engine_rules=(
  "${device_side_rules[@]}"
  "includes worker/runtime/cpu_stream.h (streams are runtime::Stream, on every device)"
  "${include}worker/runtime/cpu_stream\\.h"
  "includes a CPU kernel header (the layers run the kernel table, kernels/ops.h)"
  "${include}worker/kernels/cpu/"
  "names kernels::cpu (the layers run the kernel table, kernels/ops.h)"
  "${word}(kernels::cpu${end}|cpu::)"
  "calls std::fill (device memory is filled by Backend::Fill or Zero)"
  "${word}std::fill(_n)?${end}"
  "calls memcpy, memset or memmove (device memory is copied and filled by the backend)"
  "${word}(std::)?mem(cpy|set|move)${end}"
)
runtime_rules=(
  "includes api/engine_memory.h (the allocator's size classes are common/allocator_blocks.h)"
  "${include}api/engine_memory\\.h"
)

# check DIRECTORY RULES...: prints every violation under DIRECTORY; returns how many (capped).
check() {
  local dir=$1
  shift
  local count=0 hits
  [[ -d $dir ]] || { echo "layering_test: $dir: no such directory" >&2; return 1; }
  while (($# >= 2)); do
    local reason=$1 pattern=$2
    shift 2
    hits=$(find "$dir" -type f \( -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' \) -print0 | sort -z |
      xargs -0 -r awk -v pattern="$pattern" -v reason="$reason" '
        { code = $0; sub(/\/\/.*/, "", code) }
        code ~ pattern { printf "%s:%d: %s\n    %s\n", FILENAME, FNR, $0, reason }')
    if [[ -n $hits ]]; then
      echo "$hits"
      count=$((count + $(grep -c '^    ' <<<"$hits")))
    fi
  done
  return $((count > 200 ? 200 : count))
}

# The checker on a planted file: every rule must fire on its own line, and a comment
# that names everything must not.
fixture=$(mktemp -d)
trap 'rm -rf "$fixture"' EXIT
mkdir -p "$fixture/model"
cat >"$fixture/model/planted.cc" <<'EOF'
// DeviceSide, kernels::cpu, std::fill, memcpy and device_side.h named in a comment are fine.
#include "worker/runtime/device_side.h"
#include "worker/runtime/cpu_stream.h"
#include "worker/kernels/cpu/kernels.h"
namespace k = kernels::cpu;
float* p = runtime::DeviceSide::Address(handle);
void f() { std::fill(a, a + n, 0.0f); }
void g() { std::memcpy(a, b, n); }
void h() { memset(a, 0, n); }
int fillet = my_memcpy_count;  // names that only contain the words are fine
EOF
planted_hits=$(check "$fixture/model" "${engine_rules[@]}" || true)
expected_lines=(2 3 4 5 6 7 8 9)
got_lines=($(grep -oE '^[^ ]+:[0-9]+:' <<<"$planted_hits" | cut -d: -f2 | sort -n | tr '\n' ' '))
if [[ ${got_lines[*]} != "${expected_lines[*]}" ]]; then
  echo "layering_test: the checker itself is broken: on the planted file it flagged lines (${got_lines[*]})," \
    "but lines (${expected_lines[*]}) break the rules:" >&2
  echo "$planted_hits" >&2
  exit 2
fi

status=0
check "$root/worker/model" "${engine_rules[@]}" || status=1
check "$root/worker/parallel" "${engine_rules[@]}" || status=1
check "$root/worker/train" "${device_side_rules[@]}" || status=1
check "$root/worker/runtime" "${runtime_rules[@]}" || status=1
if ((status != 0)); then
  echo "layering_test: the lines above break the engine's layering (docs/design.md, \"The device seam\")" >&2
  exit 1
fi
echo "layering_test: worker/model, worker/parallel and worker/train keep the device seam;" \
  "worker/runtime takes its size classes from common/"
