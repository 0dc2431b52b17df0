#!/bin/sh
# The image's entry point: pdserve with OMP_NUM_THREADS fitted to the cores this container may use
# (its CPU set, capped by a cgroup v2 or v1 CPU quota such as compose's `cpus:`), unless it is set already.
set -eu
if [ -z "${OMP_NUM_THREADS:-}" ]; then
    cores=$(nproc)
    cpu_max="${PDSERVE_CGROUP_CPU_MAX:-/sys/fs/cgroup/cpu.max}"
    if [ -r "$cpu_max" ]; then
        read -r quota period < "$cpu_max" || true
    elif [ -r /sys/fs/cgroup/cpu/cpu.cfs_quota_us ]; then  # cgroup v1; -1: no quota
        quota=$(cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us)
        period=$(cat /sys/fs/cgroup/cpu/cpu.cfs_period_us)
        [ "$quota" -gt 0 ] || quota=max
    fi
    if [ "${quota:-max}" != "max" ] && [ "${period:-0}" -gt 0 ]; then
        limit=$(( (quota + period - 1) / period ))
        if [ "$limit" -lt "$cores" ]; then
            cores=$limit
        fi
    fi
    OMP_NUM_THREADS=$cores
    export OMP_NUM_THREADS
fi
exec pdserve "$@"
