#!/usr/bin/env bash
# Rerun the benchmarks and the demo behind README.md's generated figures, then regenerate every
# generated table from their rows (benchmarks/docs_tables.py). Each row is stamped with its machine,
# date and commit (benchmarks/_timing.py; k3 demo's report.json), and each table names them.
#
#   benchmarks/refresh_docs.sh [--force] [STEP ...]          (make docs-figures [DOCS_FIGURES_ARGS=...])
#   benchmarks/refresh_docs.sh --quick --root DIR [STEP ...]  (a pipeline check: small sizes, few repeats)
#
# STEPs (default: all), in this order, with their wall time on 2 idle cores (AMD EPYC, 2026-12-05;
# each step prints its own):
#   kda         benchmarks/kda.py (T up to 16384; vs recurrent_kda and transformers)   80 s
#   model       benchmarks/model.py (small, B2 T512; vs transformers kimi_linear)      5.5 min
#   moe         benchmarks/moe.py --threads 2 (small, N=2048)                          10 s
#   checkpoint  benchmarks/checkpoint.py (small, bf16)                                 20 s
#   mx          benchmarks/mx.py --threads 1 (quantize; small packed experts, decode)  25 s
#   ablations   benchmarks/ablations.py (9 nano runs of 300 steps, two at a time)      4 min
#   demo        k3 demo --out runs/demo (560 steps; a first run about 1 min more)      8-9.5 min
#   infer       benchmarks/infer.py (small, --gen 256; the speed_infer table)          3.5 min
#   train       benchmarks/train.py --what mfu (small, B8 T512; the speed_train table) 1.5 min
#   all: about 25 minutes, then docs_tables.py (a second). --quick: about 5 minutes on an idle machine.
#
# Figures measured beside other jobs are misleading: it refuses to start while a pytest runs or the
# 1-minute load average is above K3_REFRESH_MAX_LOAD (default 0.5), and stops before the docs are
# written when a pytest ran during a step (checked every 2 s), unless --force. The rows go to
# benchmarks/results/refresh-TIME/ (K3_RESULTS_DIR; docs_tables.py copies them into docs/data/).
# --quick writes them to DIR/results instead and needs --root DIR: its tables are rendered into a
# copy of README.md and docs/ under DIR, never into the repository's.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
K3=${K3:-.venv/bin/k3}
ALL=(kda model moe checkpoint mx ablations demo infer train)
quick=0 force=0 root="" steps=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --force) force=1 ;;
    --root) root=$2; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) [[ " ${ALL[*]} " == *" $1 "* ]] || { echo "refresh_docs: unknown step $1 (steps: ${ALL[*]})" >&2; exit 2; }
       steps+=("$1") ;;
  esac
  shift
done
[ ${#steps[@]} -gt 0 ] || steps=("${ALL[@]}")
if [ $quick = 1 ] && [ -z "$root" ]; then
  echo "refresh_docs: --quick needs --root DIR (a pipeline check's figures never go into the docs)" >&2; exit 2
fi
busy=${K3_REFRESH_BUSY:-pytest}   # pgrep -f pattern of the jobs that must not run beside the benchmarks
no_tests() {  # a test run beside the benchmarks makes their figures misleading: stop before any reach the docs
  if [ $quick = 0 ] && [ $force = 0 ] && pgrep -f "$busy" >/dev/null; then
    echo "refresh_docs: a test is running (pgrep -f $busy) $1; rerun on an idle machine (or --force)" >&2; exit 3
  fi
}
no_tests "before the start"
if [ $quick = 0 ] && [ $force = 0 ]; then
  load=$(cut -d' ' -f1 /proc/loadavg)
  if awk -v l="$load" -v m="${K3_REFRESH_MAX_LOAD:-0.5}" 'BEGIN { exit !(l > m) }'; then
    echo "refresh_docs: 1-minute load average $load > ${K3_REFRESH_MAX_LOAD:-0.5}; rerun on an idle machine (or --force)" >&2
    exit 3
  fi
fi

# this refresh's rows in a folder of their own: a step stopped by a test run leaves its rows there, where no
# later --save-micro of benchmarks/results/*.jsonl takes them for a last run
results=benchmarks/results/refresh-$(date +%Y%m%dT%H%M%S) demo_out=runs/demo
render=()
if [ -n "$root" ]; then
  mkdir -p "$root"
  root=$(cd "$root" && pwd)
  [ "$root" != "$(pwd)" ] || { echo "refresh_docs: --root is a copy's folder, not the repository" >&2; exit 2; }
  cp README.md "$root/README.md"
  rm -rf "$root/docs" && cp -r docs "$root/docs"
  render=(--root "$root")
fi
[ $quick = 0 ] || results=$root/results demo_out=$root/demo
export K3_RESULTS_DIR=$results
flag=$(mktemp) && rm -f "$flag"
watcher=""
trap '[ -z "$watcher" ] || kill "$watcher" 2>/dev/null; rm -f "$flag"' EXIT
watch_tests() {  # while a step runs: note any pytest started beside it
  while sleep 2; do if pgrep -f "$busy" >/dev/null; then touch "$flag"; fi; done
}

run() {  # step name, then the command
  local name=$1 t0=$SECONDS; shift
  echo "== $name: $*"
  watch_tests & watcher=$!
  "$@"
  kill "$watcher"; watcher=""
  echo "== $name: $((SECONDS - t0)) s"
  if [ -e "$flag" ] && [ $quick = 0 ] && [ $force = 0 ]; then
    echo "refresh_docs: a test ran during step $name (pgrep -f $busy); its rows stay in $results, not in the docs; rerun on an" \
         "idle machine (or --force)" >&2
    exit 3
  fi
  rm -f "$flag"
  no_tests "after step $name (its rows stay in $results, not in the docs)"
}
save=()
for s in "${steps[@]}"; do
  if [ $quick = 1 ]; then
    case $s in
      kda) run kda "$PY" benchmarks/kda.py --quick ;;
      model) run model "$PY" benchmarks/model.py --preset nano --batch 1 --seq 64 --repeats 1 --min-seconds 0.2 ;;
      moe) run moe "$PY" benchmarks/moe.py --preset nano --tokens 256 --repeats 1 --threads 2 ;;
      checkpoint) run checkpoint "$PY" benchmarks/checkpoint.py --preset nano --repeats 1 ;;
      mx) run mx "$PY" benchmarks/mx.py --repeats 1 --decode-tokens 2 --threads 1 ;;
      ablations) run ablations "$PY" benchmarks/ablations.py --steps 4 --seq-len 32 --batch-size 2 --groups balance ;;
      demo) run demo "$K3" demo --out "$demo_out" --steps 4 --samples-tokens 4 ;;
      infer) run infer "$PY" benchmarks/infer.py --preset nano --gen 8 --ttft-len 64 --skip-transformers ;;
      train) run train "$PY" benchmarks/train.py --what mfu --preset nano --batch-size 2 --seq-len 64 --steps 2 \
               --threads 2 --matmul-n 256 ;;
    esac
  else
    case $s in
      kda) run kda "$PY" benchmarks/kda.py ;;
      model) run model "$PY" benchmarks/model.py ;;
      moe) run moe "$PY" benchmarks/moe.py --threads 2 ;;
      checkpoint) run checkpoint "$PY" benchmarks/checkpoint.py ;;
      mx) run mx "$PY" benchmarks/mx.py --threads 1 ;;
      ablations) run ablations "$PY" benchmarks/ablations.py ;;
      demo) run demo "$K3" demo --out "$demo_out" ;;
      infer) run infer "$PY" benchmarks/infer.py ;;
      train) run train "$PY" benchmarks/train.py --what mfu --batch-size 8 --seq-len 512 --threads 2 ;;
    esac
  fi
done
micro=() speed=()
for s in "${steps[@]}"; do
  case $s in
    kda|model|moe|checkpoint|mx) micro+=("$results/$s.jsonl") ;;
    ablations) save+=(--save-ablations "$results/ablations.jsonl") ;;
    demo) save+=(--save-demo "$demo_out/report.json") ;;
    infer|train) speed+=("$results/$s.jsonl") ;;
  esac
done
[ ${#micro[@]} = 0 ] || save+=(--save-micro "${micro[@]}")
[ ${#speed[@]} = 0 ] || save+=(--save-speed "${speed[@]}")
echo "== docs_tables: $PY benchmarks/docs_tables.py ${save[*]} ${render[*]}"
"$PY" benchmarks/docs_tables.py "${save[@]}" "${render[@]}"
