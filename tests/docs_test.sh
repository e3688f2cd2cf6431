#!/usr/bin/env bash
# Holds the documentation to the repository and the CLI:
#   - every relative link in README.md and docs/*.md names a file or folder that exists
#     (an anchor after # is not checked);
#   - every TrainingJob shown in a ```yaml block of README.md or docs/*.md, and every file of
#     examples/*.yaml and examples/*.json, passes `meshtrain validate` with exit 0 and no warning;
#   - every `meshtrain COMMAND` (and `meshtrain bench COMMAND`) named in inline code or a
#     code block of those pages is one that `meshtrain --help` (`meshtrain bench --help`) lists.
# Each failure is printed as FILE:LINE: what is wrong.
# Usage: docs_test.sh PATH/TO/meshtrain   (run from the repository root)
set -uo pipefail
meshtrain=${1:?usage: docs_test.sh PATH/TO/meshtrain}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The commands the CLI has: the names under "Subcommands:" in its help.
subcommands() { "$@" --help 2>&1 | awk '/^Subcommands:/ { on = 1; next } on && /^  [a-z]/ { print $1 }'; }
subcommands "$meshtrain" > "$tmp/commands"
subcommands "$meshtrain" bench > "$tmp/bench-commands"
if [ ! -s "$tmp/commands" ] || [ ! -s "$tmp/bench-commands" ]; then
  echo "FAIL: no subcommands in the help of $meshtrain and of $meshtrain bench"
  exit 1
fi

pages=(README.md docs/*.md)
python3 - "$tmp" "${pages[@]}" <<'EOF'
# Writes, for the shell below: links.txt (FILE:LINE<TAB>TARGET), commands.txt
# (FILE:LINE<TAB>COMMAND [BENCH_COMMAND]) and one manifests/N.yaml per TrainingJob block, with
# manifests.txt (N<TAB>FILE:LINE).
import os, re, sys

out, pages = sys.argv[1], sys.argv[2:]
os.makedirs(os.path.join(out, "manifests"), exist_ok=True)
links = open(os.path.join(out, "links.txt"), "w")
commands = open(os.path.join(out, "commands.txt"), "w")
manifests = open(os.path.join(out, "manifests.txt"), "w")
problems = open(os.path.join(out, "problems.txt"), "w")
fence = re.compile(r"^\s*(```+|~~~+)\s*([A-Za-z0-9_+-]*)")
link = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
reference = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(\s|$)")
inline_code = re.compile(r"(`+)(.+?)\1")
# `meshtrain WORD` where meshtrain starts a command (a line's or a code span's first word, or
# after |, ;, &, ( or $( and any VAR=value), possibly as a path (build/default/cli/meshtrain
# run), and is a word of its own: not meshtrain-worker, nor `helm install meshtrain helm/...`.
command = re.compile(r"(?:^|[|;&(])\s*(?:\$\s+)?(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*(?:[\w./~-]*/)?meshtrain"
                     r"(?:\s+--?[A-Za-z][A-Za-z-]*(?:[ =](?:trace|debug|info|warn|error|critical|off))?)*"
                     r"\s+([a-z][a-z0-9-]*)(?:\s+([a-z][a-z0-9-]*))?", re.M)
count = 0

def commands_in(text, where):
    for m in command.finditer(text):
        sub, nxt = m.group(1), m.group(2)
        commands.write(f"{where}\t{sub} {nxt if sub == 'bench' and nxt else ''}\n".replace(" \n", "\n"))

for page in pages:
    lines = open(page, encoding="utf-8").read().split("\n")
    in_block, lang, block, start = False, "", [], 0
    for number, line in enumerate(lines, 1):
        where = f"{page}:{number}"
        m = fence.match(line)
        if m and not in_block:
            in_block, lang, block, start = True, m.group(2).lower(), [], number
            continue
        if m and in_block and not m.group(2):
            in_block = False
            text = "\n".join(block)
            if lang in ("yaml", "yml") and re.search(r"^\s*kind:\s*[\"']?TrainingJob\b", text, re.M):
                count += 1
                with open(os.path.join(out, "manifests", f"{count}.yaml"), "w") as f:
                    f.write(text + "\n")
                manifests.write(f"{count}\t{page}:{start}\n")
            continue
        if in_block:
            block.append(line)
            if lang not in ("yaml", "yml", "json"):
                commands_in(line, where)
            continue
        for target in link.findall(line) + [m.group(1) for m in [reference.match(line)] if m]:
            links.write(f"{where}\t{target}\n")
        for m in inline_code.finditer(line):
            commands_in(m.group(2), where)
    if in_block:
        problems.write(f"{page}:{start}: a code block that never ends\n")
EOF
[ $? -eq 0 ] || { echo "FAIL: could not read the pages"; exit 1; }

failures=0
checks=0
fail() { echo "FAIL $*"; failures=$((failures + 1)); }

while IFS= read -r problem; do fail "$problem"; done < "$tmp/problems.txt"

# Links, relative to the page that holds them.
while IFS=$'\t' read -r where target; do
  checks=$((checks + 1))
  case $target in
    http://* | https://* | mailto:* | \#*) continue ;;
  esac
  file=${where%:*}
  path=${target%%#*}
  path=${path%%\?*}
  case $path in
    /*) fail "$where: link $target is absolute; link within the repository by a relative path" ;;
    *) [ -e "$(dirname "$file")/$path" ] || fail "$where: link $target: no such file ($(dirname "$file")/$path)" ;;
  esac
done < "$tmp/links.txt"

# validate_file LABEL FILE: exit 0 and no warning.
validate_file() {
  local label=$1 file=$2 output rc
  checks=$((checks + 1))
  output=$(timeout 60 "$meshtrain" validate "$file" 2>&1); rc=$?
  if [ $rc -ne 0 ]; then
    fail "$label: meshtrain validate exits $rc"
    sed 's/^/     | /' <<<"$output"
  elif grep -qi warning <<<"$output"; then
    fail "$label: meshtrain validate warns"
    grep -i warning <<<"$output" | sed 's/^/     | /'
  fi
}

# The TrainingJobs the pages show.
while IFS=$'\t' read -r n where; do
  validate_file "$where (a TrainingJob in a yaml block)" "$tmp/manifests/$n.yaml"
done < "$tmp/manifests.txt"

# Every example.
shopt -s nullglob
examples=(examples/*.yaml examples/*.json)
[ ${#examples[@]} -gt 0 ] || fail "examples/: no *.yaml or *.json"
for example in "${examples[@]}"; do
  validate_file "$example" "$example"
done

# The commands the pages name.
while IFS=$'\t' read -r where named; do
  checks=$((checks + 1))
  read -r sub bench_sub <<<"$named"
  if ! grep -qx -- "$sub" "$tmp/commands"; then
    fail "$where: \`meshtrain $sub\` is no command of meshtrain (meshtrain --help lists $(paste -sd, "$tmp/commands"))"
  elif [ "$sub" = bench ] && [ -n "${bench_sub:-}" ] && ! grep -qx -- "$bench_sub" "$tmp/bench-commands"; then
    fail "$where: \`meshtrain bench $bench_sub\` is no benchmark (meshtrain bench --help lists $(paste -sd, "$tmp/bench-commands"))"
  fi
done < "$tmp/commands.txt"

echo "$checks checks of ${#pages[@]} pages and ${#examples[@]} examples: $failures failed" \
  "($(wc -l < "$tmp/links.txt") links, $(wc -l < "$tmp/manifests.txt") TrainingJobs shown, $(wc -l < "$tmp/commands.txt") commands named)"
[ $failures -eq 0 ]
