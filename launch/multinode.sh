#!/usr/bin/env bash
# Train on the nodes of a DeepSpeed hostfile with DeepSpeed's default multi-node launcher (pdsh over ssh).
#
#   launch/multinode.sh SPEC HOSTFILE [DEEPSPEED FLAGS...] [-- TRAIN ARGS...]
#
#   DEEPSPEED FLAGS  passed to `deepspeed` (e.g. --include 'worker-0@worker-1:0,1', --exclude ..., --num_nodes 2,
#                    --num_gpus 4, --master_addr 10.0.0.1, --master_port 29500, --launcher openmpi)
#   TRAIN ARGS       passed to dstune/train.py (e.g. --resume latest, --set output.dir=/shared/runs/x)
#
# First runs `dstune validate SPEC --hostfile HOSTFILE` with the same --include/--exclude/--num_nodes/--num_gpus and
# --set overrides, and stops (exit 1) when the spec is invalid for those nodes, before any node starts. Then prints the
# exact deepspeed command and runs it from the repository root (pdsh runs it in the same folder on every node).
# DSTUNE_DRY_RUN=1 validates and prints the command without launching. PYTHON picks the interpreter (python3).
set -euo pipefail

usage() { echo "usage: $0 SPEC HOSTFILE [DEEPSPEED FLAGS...] [-- TRAIN ARGS...]" >&2; exit 2; }
[[ $# -ge 2 ]] || usage
spec=$1 hostfile=$2
shift 2
[[ -f $spec ]] || { echo "$0: spec $spec: no such file" >&2; exit 2; }
[[ -f $hostfile ]] || { echo "$0: hostfile $hostfile: no such file" >&2; exit 2; }
spec=$(cd "$(dirname "$spec")" && pwd)/$(basename "$spec")
hostfile=$(cd "$(dirname "$hostfile")" && pwd)/$(basename "$hostfile")

ds_args=() train_args=() validate_args=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --) shift; train_args=("$@"); break ;;
        --include|--exclude|--num_nodes|--num_gpus)
            [[ $# -ge 2 ]] || usage
            ds_args+=("$1" "$2"); validate_args+=("$1" "$2"); shift 2 ;;
        --include=*|--exclude=*|--num_nodes=*|--num_gpus=*)
            ds_args+=("$1"); validate_args+=("${1%%=*}" "${1#*=}"); shift ;;
        *) ds_args+=("$1"); shift ;;
    esac
done
for ((i = 0; i < ${#train_args[@]}; i++)); do  # the spec overrides change the plan: validate with them too
    if [[ ${train_args[i]} == --set && $((i + 1)) -lt ${#train_args[@]} ]]; then
        validate_args+=(--set "${train_args[i + 1]}")
    fi
done

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
python=${PYTHON:-python3}

echo "+ dstune validate $spec --hostfile $hostfile ${validate_args[*]}" >&2
if ! "$python" -m dstune validate "$spec" --hostfile "$hostfile" "${validate_args[@]}"; then
    echo "$0: dstune validate failed for this spec and hostfile; nothing was launched." >&2
    exit 1
fi

cmd=(deepspeed --hostfile "$hostfile" "${ds_args[@]}" dstune/train.py "$spec" "${train_args[@]}")  # from a checkout of dstune
printf 'launching (in %s):\n ' "$repo"
printf ' %q' "${cmd[@]}"
printf '\n'
if [[ ${DSTUNE_DRY_RUN:-0} == 1 ]]; then
    echo "DSTUNE_DRY_RUN=1: not launched."
    exit 0
fi
exec "${cmd[@]}"
