#!/bin/sh
# The image's entrypoint: `pdserve "$@"` with OMP_NUM_THREADS set, unless given, to the cores this
# container may use: its CPU quota (compose `cpus:`, cgroup v2 or v1) when lower than its cpuset (nproc).
set -eu
if [ -z "${OMP_NUM_THREADS:-}" ]; then
    cores=$(nproc)
    quota=""
    if [ -r /sys/fs/cgroup/cpu.max ]; then
        read -r limit period < /sys/fs/cgroup/cpu.max
        [ "$limit" != max ] && quota=$(( (limit + period - 1) / period ))
    elif [ -r /sys/fs/cgroup/cpu/cpu.cfs_quota_us ]; then
        limit=$(cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us)
        period=$(cat /sys/fs/cgroup/cpu/cpu.cfs_period_us)
        [ "$limit" -gt 0 ] && quota=$(( (limit + period - 1) / period ))
    fi
    if [ -n "$quota" ] && [ "$quota" -lt "$cores" ]; then
        cores=$quota
    fi
    export OMP_NUM_THREADS="$cores"
fi
exec pdserve "$@"
