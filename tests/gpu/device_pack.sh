#!/usr/bin/env bash
# Pack what a lent GPU machine (no network; torch with CUDA already there) needs for the NCCL checks
# into .device/p0 .. .device/p3 (git-ignored), each under the 64 MiB a `run` call carries:
# a newer NCCL (2.30+ lets two ranks share one GPU), the MPI wheels and what varuna needs beyond the
# machine's image (PYTHONS: the Python versions to fetch them for; the H200 image has 3.12). Then, from the session (each call a `run`, one after another, the machine warm):
#
#   carry [".device/p0"]: bash tests/gpu/device_run.sh stash
#   carry [".device/p1"]: bash tests/gpu/device_run.sh stash
#   carry [".device/p2"]: bash tests/gpu/device_run.sh stash
#   carry [".device/p3"]: BUDGET=420 bash tests/gpu/device_run.sh go      (timeout_s ~ BUDGET + 60)
#
# NCCL=... picks another nvidia-nccl wheel (default nvidia-nccl-cu13==2.32.6, for a CUDA 13 torch).
set -euo pipefail
cd "$(dirname "$0")/../.."
NCCL=${NCCL:-nvidia-nccl-cu13==2.32.6}
PART_MB=${PART_MB:-56}
out=.device
rm -rf "$out" && mkdir -p "$out/dl" "$out/p0" "$out/p1" "$out/p2" "$out/p3/wheels"
python3 -m pip download --quiet --no-deps -d "$out/dl" "$NCCL"
for v in ${PYTHONS:-3.12}; do
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$v" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$out/p3/wheels" mpi4py mpich pyzmq
done
wheel=$(ls "$out"/dl/*.whl)
split -b "${PART_MB}m" -d -a 2 "$wheel" "$out/dl/part"
parts=("$out"/dl/part*)
if [ "${#parts[@]}" -gt 4 ]; then
    echo "the NCCL wheel needs ${#parts[@]} parts of ${PART_MB} MiB; raise PART_MB or add calls" >&2
    exit 1
fi
for i in "${!parts[@]}"; do mv "${parts[$i]}" "$out/p$i/"; done
basename "$wheel" > "$out/p3/nccl-wheel-name"
sha256sum "$wheel" | cut -d' ' -f1 > "$out/p3/nccl-wheel-sha256"
rm -rf "$out/dl"
du -sh "$out"/p* >&2
