#!/usr/bin/env bash
# On a lent GPU machine, from the repository root (see tests/gpu/device_pack.sh for the calls):
#   stash  keep the carried .device/pN in /tmp/varuna-device (it stays while the machine is warm)
#   go     stash, rebuild the NCCL wheel, install the MPI wheels and varuna's small dependencies next
#          to the machine's own torch, preload the newer NCCL and run the checks in BUDGET seconds
#          (default 420; QUICK=1: the quick run, DEVICE=cpu: on gloo, to try this script on a CPU);
#          the JSON report, the NCCL library's version and the job logs go to $OUT.
set -euo pipefail
store=/tmp/varuna-device
mkdir -p "$store"
for part in .device/p*; do [ -d "$part" ] && cp -r "$part"/. "$store"/; done
ls "$store" >&2
[ "${1:-stash}" = go ] || exit 0
out=${OUT:-/tmp/varuna-device/out}
mkdir -p "$out"
wheel="$store/$(cat "$store/nccl-wheel-name")"
cat "$store"/part* > "$wheel"
echo "$(cat "$store/nccl-wheel-sha256")  $wheel" | sha256sum -c - >&2
image=${PYTHON:-python3}  # the image's, with its CUDA torch
# A venv of its own, seeing the image's packages through a .pth (a venv made from a venv would not),
# so that the MPI wheel's library and mpiexec land beside its Python, where mpi4py and varuna look.
rm -rf "$store/venv" "$store/nccl" && mkdir -p "$store/nccl"
"$image" -m venv "$store/venv"
py="$store/venv/bin/python"
"$image" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
    > "$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/image-packages.pth"
"$py" -m pip install --quiet --no-index --find-links "$store/wheels" mpi4py mpich pyzmq
(cd "$store/nccl" && "$py" -m zipfile -e "$wheel" .)
lib=$(find "$store/nccl" -name 'libnccl.so.2' | head -1)
"$py" - "$lib" <<'PY' | tee "$out/environment.txt" >&2
import ctypes, sys, torch
v = ctypes.c_int()
ctypes.CDLL(sys.argv[1]).ncclGetVersion(ctypes.byref(v))
try:
    built = torch.cuda.nccl.version()
except Exception as exc:  # a CPU build of torch
    built = repr(exc)
print(f"torch {torch.__version__} cuda {torch.version.cuda} gpus {torch.cuda.device_count()} "
      f"nccl built {built} preloaded {v.value} ({sys.argv[1]})")
PY
export PATH="$store/venv/bin:$PATH" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
"$py" -c "from mpi4py import MPI; print('MPI', MPI.Get_library_version().splitlines()[0])" | tee -a "$out/environment.txt" >&2
LD_PRELOAD="$lib" "$py" tests/gpu/run_gpu_checks.py --device "${DEVICE:-cuda}" --budget-s "${BUDGET:-420}" --keep ${QUICK:+--quick} \
    --out "$out/report.json" 2> >(tee "$out/stderr.txt" >&2) || echo "checks exited $?" >&2
kept=$(sed -n 's/^jobs. folders and logs kept in //p' "$out/stderr.txt" | tail -1)
if [ -n "$kept" ] && [ -d "$kept" ]; then  # every job's logs (stacks at a timeout), small enough to bring back
    (cd "$kept" && find . -name '*.log' -size -2M -print0 | xargs -0 -r tar czf "$out/logs.tgz")
fi
ls -la "$out" >&2
