#!/usr/bin/env bash
# bench/digits_throughput.sh: training throughput of examples/digits with 1 and 2 replicas next to
# the same MLP in PyTorch DDP (gloo) with 1 and 2 processes, in the same run, as ratios; then
# --reduce reproducible --bn ghost next to --reduce bucketed --bn local.
# SPDX-License-Identifier: Apache-2.0
#
# usage: bench/digits_throughput.sh [--csv FILE] [path/to/digits] (default:
#        $BUILD/examples/digits/digits, BUILD defaults to ./build). --csv FILE: one row per
#        replica count and side (lockstep, torch_ddp) with samples/s, test accuracy and the ratio
#        to torch. Without torch the lockstep rows run alone (torch columns "-", a note says
#        so). A second section measures what reproducibility costs: --reduce reproducible
#        --bn ghost next to --reduce bucketed --bn local on 1 and 2 thread replicas and, when
#        the binary has MPI and mpiexec is on PATH, `mpiexec -n 2 digits --mpi`; its CSV rows
#        have bench "digits_reproducible", variant "<threads|mpi>/<bucketed|reproducible>" and
#        in the last column the ratio reproducible / bucketed samples/s (1 on bucketed rows).
#        Knobs (environment): EPOCHS (20), BATCH (64, global),
#        HIDDEN (128), REPEAT (3: the median of 3 runs is reported), REPRO_EPOCHS (60) and
#        REPRO_REPEAT (21: alternating pairs; the ratio is the median of the pairs' ratios) for
#        the second section, CORES (nproc), PYTHON (/usr/bin/python3, the interpreter with
#        Debian's python3-torch).
# Fairness: both sides get the same cores. lockstep's thread group gives each replica
# cores / replicas OpenMP threads; the torch script sets torch.set_num_threads(cores / procs).
# Both use the same data, split, batch, epochs, network and optimizer (SGD, momentum 0.9), and
# both count training samples per second of the training loop only.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
csv=""
if [[ "${1:-}" == "--csv" ]]; then
  if [[ $# -lt 2 ]]; then echo "digits_throughput: --csv needs a file name" >&2; exit 2; fi
  csv=$2
  shift 2
fi
digits=${1:-${BUILD:-build}/examples/digits/digits}
epochs=${EPOCHS:-20}
batch=${BATCH:-64}
hidden=${HIDDEN:-128}
repeat=${REPEAT:-3}
repro_epochs=${REPRO_EPOCHS:-60}
repro_repeat=${REPRO_REPEAT:-21}
cores=${CORES:-$(nproc)}
python=${PYTHON:-/usr/bin/python3}

if [[ ! -x "$digits" ]]; then
  echo "digits_throughput: $digits is not an executable (build the 'digits' target first)" >&2
  exit 2
fi
have_torch=1
if ! "$python" -c "import torch" 2>/dev/null; then
  have_torch=0
fi
if [[ -n "$csv" ]]; then
  echo "bench,replicas,variant,samples_per_s,test_accuracy_pct,ratio_to_torch" >"$csv"
fi

median() { sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }

# lockstep: prints "... = N samples/s ..." and "test accuracy: A %"
lockstep_run() { # replicas -> "samples_per_s accuracy"
  local out rate acc
  out=$(OMP_NUM_THREADS=$cores "$digits" --replicas "$1" --epochs "$epochs" --batch "$batch" \
        --hidden "$hidden" --quiet)
  rate=$(sed -n 's/.* = \([0-9.]*\) samples\/s.*/\1/p' <<<"$out")
  acc=$(sed -n 's/.*test accuracy: \([0-9.]*\) %.*/\1/p' <<<"$out")
  echo "$rate $acc"
}
torch_run() { # procs -> "samples_per_s accuracy"
  local out rate acc
  out=$(timeout 600 "$python" "$here/torch_ddp_digits.py" --procs "$1" --epochs "$epochs" --batch "$batch" \
        --hidden "$hidden" --cores "$cores" --port $((29500 + RANDOM % 400)))
  rate=$(sed -n 's/.*samples_per_s=\([0-9.]*\).*/\1/p' <<<"$out")
  acc=$(sed -n 's/.*test_accuracy=\([0-9.]*\).*/\1/p' <<<"$out")
  echo "$rate $(awk -v a="$acc" 'BEGIN {printf "%.2f", 100 * a}')"
}

echo "digits training throughput: $epochs epochs, global batch $batch, hidden $hidden," \
     "$cores cores, median of $repeat runs"
printf '%-9s %16s %16s %10s %12s %12s\n' replicas "lockstep smp/s" "torch DDP smp/s" \
       "lockstep/" "lockstep acc" "torch acc"
printf '%-9s %16s %16s %10s %12s %12s\n' "" "" "" "torch" "(%)" "(%)"
declare -A ls_rate
for n in 1 2; do
  ls_rates=() ; t_rates=() ; ls_acc="" ; t_acc=""
  for ((i = 0; i < repeat; ++i)); do
    read -r r a < <(lockstep_run "$n"); ls_rates+=("$r"); ls_acc=$a
    if ((have_torch)); then
      read -r r a < <(torch_run "$n"); t_rates+=("$r"); t_acc=$a
    fi
  done
  l=$(printf '%s\n' "${ls_rates[@]}" | median)
  ls_rate[$n]=$l
  if ((have_torch)); then
    t=$(printf '%s\n' "${t_rates[@]}" | median)
    ratio=$(awk -v a="$l" -v b="$t" 'BEGIN {print a / b}')
    printf '%-9s %16.0f %16.0f %10.2f %12s %12s\n' "$n" "$l" "$t" "$ratio" "$ls_acc" "$t_acc"
  else
    t="" ; ratio=""
    printf '%-9s %16.0f %16s %10s %12s %12s\n' "$n" "$l" - - "$ls_acc" -
  fi
  if [[ -n "$csv" ]]; then
    echo "digits,$n,lockstep,$l,$ls_acc,$ratio" >>"$csv"
    if ((have_torch)); then echo "digits,$n,torch_ddp,$t,$t_acc,1" >>"$csv"; fi
  fi
done
if ((!have_torch)); then
  echo "torch DDP: skipped ($python cannot import torch; bash scripts/deps --bench installs it)"
fi
echo "lockstep scaling 1 -> 2 replicas: $(awk -v a="${ls_rate[2]}" -v b="${ls_rate[1]}" \
      'BEGIN {printf "%.2f", a / b}')x"

# ---- what reproducibility costs: reduce::reproducible<16> + bn::ghost<16> vs bucketed + local
have_mpi=0
if "$digits" --help | grep -q -- '--mpi  *one replica' && command -v mpiexec >/dev/null; then
  have_mpi=1
fi
policy_run() { # backend replicas policy -> "samples_per_s accuracy"
  local out rate acc flags launch=() threads=$cores
  if [[ $3 == reproducible ]]; then flags=(--reduce reproducible --bn ghost)
  else flags=(--reduce bucketed --bn local); fi
  # OMP_NUM_THREADS is each process's budget: MPI processes share the cores.
  if [[ $1 == mpi ]]; then
    launch=(mpiexec -n "$2" "$digits" --mpi)
    threads=$((cores / $2 > 0 ? cores / $2 : 1))
  else
    launch=("$digits" --replicas "$2")
  fi
  out=$(OMP_NUM_THREADS=$threads "${launch[@]}" "${flags[@]}" --epochs "$repro_epochs" \
        --batch "$batch" --hidden "$hidden" --quiet)
  rate=$(sed -n 's/.* = \([0-9.]*\) samples\/s.*/\1/p' <<<"$out")
  acc=$(sed -n 's/.*test accuracy: \([0-9.]*\) %.*/\1/p' <<<"$out")
  echo "$rate $acc"
}
echo
echo "reproducibility: --reduce reproducible --bn ghost (chunks of 16) vs --reduce bucketed" \
     "--bn local, $repro_epochs epochs, $repro_repeat alternating pairs: median rates, median of" \
     "the pairs' ratios"
printf '%-8s %9s %16s %16s %14s %10s %10s\n' backend replicas "bucketed smp/s" \
       "reprod. smp/s" "reprod./bucket" "acc b. %" "acc r. %"
configs=("threads 1" "threads 2")
if ((have_mpi)); then configs+=("mpi 2"); fi
for c in "${configs[@]}"; do
  read -r backend n <<<"$c"
  b_rates=() ; r_rates=() ; ratios=() ; b_acc="" ; r_acc=""
  for ((i = 0; i < repro_repeat; ++i)); do
    read -r rb a < <(policy_run "$backend" "$n" bucketed); b_rates+=("$rb"); b_acc=$a
    read -r rr a < <(policy_run "$backend" "$n" reproducible); r_rates+=("$rr"); r_acc=$a
    ratios+=("$(awk -v a="$rr" -v b="$rb" 'BEGIN {print a / b}')")
  done
  b=$(printf '%s\n' "${b_rates[@]}" | median)
  r=$(printf '%s\n' "${r_rates[@]}" | median)
  # The machine's slow spells hit both runs of a pair alike: the median of the pairs' ratios.
  ratio=$(printf '%s\n' "${ratios[@]}" | median)
  printf '%-8s %9s %16.0f %16.0f %14.2f %10s %10s\n' "$backend" "$n" "$b" "$r" "$ratio" \
         "$b_acc" "$r_acc"
  if [[ -n "$csv" ]]; then
    echo "digits_reproducible,$n,$backend/bucketed,$b,$b_acc,1" >>"$csv"
    echo "digits_reproducible,$n,$backend/reproducible,$r,$r_acc,$ratio" >>"$csv"
  fi
done
if ((!have_mpi)); then
  echo "MPI rows: skipped ($digits has no MPI or mpiexec is not on PATH)"
fi
