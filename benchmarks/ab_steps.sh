#!/usr/bin/env bash
# A/B of the denoise step within one GPU machine (between machines the same code's steps
# move by up to 3%, more than most changes): the working tree against a base revision, each
# built into a package of its own, then benchmarks/step_latency.py with the given options
# for base, new, base, new. The base is the working tree with cpp/, cuda/ and python/ taken
# from a tarball, made where the history is (the device machine's copy has none):
#
#     git archive BASE_REV cpp cuda python > .device/base.tar
#     bash benchmarks/ab_steps.sh .device/base.tar --activations bfloat16 --grid 1x1024,16x1024
#
# With AB_TESTS set (test files, e.g. AB_TESTS=tests/test_cuda.py), pytest runs them on the
# new build first, on the GPU (DIFFUSERVE_TEST_DEVICE=cuda), so one call's builds serve the
# tests and the timings; a failure is reported and the timings still run.
# Prints each run's table; logs go to $OUT (or ./gpu-logs).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [ ! -f "$1" ]; then
  echo "usage: bash benchmarks/ab_steps.sh BASE_TAR [step_latency.py options] (no tarball '${1:-}')" >&2
  exit 2
fi
base_tar=$(realpath "$1")
shift
out=$(realpath -m "${OUT:-gpu-logs}")
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/base_src"
cp -r CMakeLists.txt pyproject.toml README.md cmake python "$work/base_src/"
tar -xf "$base_tar" -C "$work/base_src" || { echo "ab_steps.sh: cannot unpack $base_tar" >&2; exit 2; }
start=$(date +%s)
jobs=$(( ($(nproc) + 1) / 2 ))
build() {  # build SOURCE TARGET LOG
  (cd "$1" && CMAKE_BUILD_PARALLEL_LEVEL=$jobs python3 -m pip install -q --no-build-isolation --no-deps --target "$2" . \
    > "$3" 2>&1) || { echo "ab_steps.sh: the build in $1 failed (see $3)" >&2; return 1; }
}
build "$PWD" "$work/new" "$out/ab_build_new.log" & new_build=$!
build "$work/base_src" "$work/base" "$out/ab_build_base.log" & base_build=$!
wait $new_build && wait $base_build || exit 1
echo "builds: $(( $(date +%s) - start )) s"
status=0
if [ -n "${AB_TESTS:-}" ]; then
  tests=$(for t in $AB_TESTS; do realpath "$t"; done)
  # from outside the tree, so that the package imported is the new build's
  # shellcheck disable=SC2086  # the test files split into words
  (cd "$work" && PYTHONPATH="$work/new${PYTHONPATH:+:$PYTHONPATH}" DIFFUSERVE_TEST_DEVICE=cuda \
    python3 -m pytest -q -p no:cacheprovider $tests > "$out/ab_tests.log" 2>&1) || status=1
  echo "tests ($AB_TESTS): $(tail -1 "$out/ab_tests.log")"
fi
cd benchmarks
for run in 1 2; do
  for side in base new; do
    echo "== $side (run $run)"
    log="$out/ab_${side}_${run}.txt"
    PYTHONPATH="$work/$side" python3 step_latency.py "$@" > "$log" 2>&1 || { status=1; tail -3 "$log"; continue; }
    grep -E "^\|" "$log"
  done
done
exit $status
