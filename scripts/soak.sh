#!/usr/bin/env bash
# cuflash soak run: the GPU test suite N times in a row, each run with fresh seeds, to catch the
# failures that show once in several runs, and the seed that replays each of them.
#
#   bash scripts/soak.sh [N]        (default N = 5)
#
# Each run: pytest -m "$SOAK_MARK" (default "gpu and not slow") with pytest-xdist workers sharing
# CUFLASH_CACHE_DIR (so only the first run compiles), a new --hypothesis-seed, and the tests' own
# fresh data seeds (CUFLASH_TEST_SEED is unset: every test draws a new one and prints it as
# `seed=<n>` in its assertion messages). Failures do not stop the soak (no -x).
#
# Files under $OUT (default ./out/soak): run_<i>.log and run_<i>.xml (junit) per run, failures.tsv
# (run, test id, data seeds, hypothesis seed, replay command), summary.txt (the summary, also
# printed last).
#
# Time: SOAK_BUDGET_S bounds the whole soak (default 0 = no bound; 560 fits a 600 s device call).
# A run starts only if SOAK_MIN_RUN_S (default 90) seconds are left, and is cut off at the budget
# (reported as cut off, its failures still counted).
#
# Exit status: 0 every run passed; 1 a run failed or was cut off; 2 bad usage; 3 no run
# completed; 4 no GPU (every gpu test was skipped: nothing was soaked).
# Knobs: SOAK_MARK, SOAK_BUDGET_S, SOAK_MIN_RUN_S, PYTEST_WORKERS (default 4; 0 = no xdist),
#   PYTEST_TIMEOUT (seconds per test, default 300, with pytest-timeout), SOAK_PRECOMPILE=1 (fill
#   the cache first, as scripts/device_check.sh does), SOAK_PYTEST_ARGS (extra arguments), PYTHON.

set -u
set -o pipefail

N="${1:-5}"
case "$N" in
  -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
  ''|*[!0-9]*) echo "usage: bash scripts/soak.sh [N]   (N: number of runs, a positive integer)" >&2; exit 2 ;;
esac
[ "$N" -ge 1 ] || { echo "usage: bash scripts/soak.sh [N]   (N >= 1)" >&2; exit 2; }

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export CUFLASH_CACHE_DIR="${CUFLASH_CACHE_DIR:-/tmp/cuflash_cache}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ -n "${CUFLASH_TEST_SEED:-}" ]; then
  echo "=== soak: unsetting CUFLASH_TEST_SEED=$CUFLASH_TEST_SEED (a soak needs fresh seeds)"
  unset CUFLASH_TEST_SEED
fi
OUT="${OUT:-./out/soak}"
mkdir -p "$OUT" "$CUFLASH_CACHE_DIR" || exit 2
rm -f "$OUT"/run_*.log "$OUT"/run_*.xml "$OUT"/failures.tsv "$OUT"/summary.txt "$OUT"/runs.tsv
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if command -v python3 >/dev/null 2>&1; then PY=python3; else PY=python; fi
fi
MARK="${SOAK_MARK:-gpu and not slow}"
BUDGET="${SOAK_BUDGET_S:-0}"
MIN_RUN="${SOAK_MIN_RUN_S:-90}"
case "$BUDGET$MIN_RUN" in *[!0-9]*) echo "SOAK_BUDGET_S and SOAK_MIN_RUN_S must be integers" >&2; exit 2 ;; esac

GPU_LINE="$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1)"
echo "=== cuflash soak: $N runs of pytest -m \"$MARK\"  $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "=== GPU: ${GPU_LINE:-none seen by nvidia-smi}  budget: $([ "$BUDGET" = 0 ] && echo none || echo "${BUDGET}s")  OUT=$OUT"
echo "=== CUFLASH_CACHE_DIR=$CUFLASH_CACHE_DIR  python=$(command -v "$PY")"

ARGS=(-m "$MARK" -q -rf -p no:randomly -p no:cacheprovider)
NW="${PYTEST_WORKERS:-4}"
if [ "$NW" != 0 ] && "$PY" -c "import xdist" >/dev/null 2>&1; then
  ARGS+=(-n "$NW" --dist loadgroup)
fi
if "$PY" -c "import pytest_timeout" >/dev/null 2>&1; then
  ARGS+=(--timeout="${PYTEST_TIMEOUT:-300}" --timeout-method=thread)
fi
HAVE_HYPOTHESIS=0
"$PY" -c "import hypothesis" >/dev/null 2>&1 && HAVE_HYPOTHESIS=1
# shellcheck disable=SC2206  # SOAK_PYTEST_ARGS is split on purpose
EXTRA=(${SOAK_PYTEST_ARGS:-})

left() { if [ "$BUDGET" = 0 ]; then echo 1000000; else echo $(( BUDGET - SECONDS )); fi; }

if [ "${SOAK_PRECOMPILE:-0}" = 1 ]; then
  PT=$(( $(left) / 3 )); [ "$PT" -gt 240 ] && PT=240
  echo "=== precompile into $CUFLASH_CACHE_DIR (limit ${PT}s)"
  timeout -k 10 "$PT" "$PY" -c "
import cuflash
n = cuflash.precompile(head_dims=[8, 32, 40, 64, 96, 128, 136, 200, 256], features=True)
print('precompiled', len(n), 'specializations')" 2>&1 | tail -n 2 || echo "(precompile failed or cut off: kernels compile at first use)"
fi

RUNS_DONE=0
for i in $(seq 1 "$N"); do
  L=$(left)
  LIMIT=$(( L > 100000 ? 86400 : L - 5 ))
  if [ "$LIMIT" -lt "$MIN_RUN" ] || [ "$LIMIT" -lt 1 ]; then
    echo "=== budget: ${L}s left, less than SOAK_MIN_RUN_S=${MIN_RUN}s for a run; stopping before run $i"
    break
  fi
  HSEED=$(( (RANDOM << 15 | RANDOM) ))
  RUN_ARGS=("${ARGS[@]}" --junitxml="$OUT/run_$i.xml")
  [ "$HAVE_HYPOTHESIS" = 1 ] && RUN_ARGS+=(--hypothesis-seed="$HSEED") || HSEED="-"
  echo "=== run $i/$N  hypothesis seed $HSEED  (limit ${LIMIT}s)"
  T0=$SECONDS
  timeout -k 20 "$LIMIT" "$PY" -m pytest tests "${RUN_ARGS[@]}" ${EXTRA[@]+"${EXTRA[@]}"} > "$OUT/run_$i.log" 2>&1
  RC=$?
  printf '%s\t%s\t%s\t%s\n' "$i" "$RC" "$((SECONDS - T0))" "$HSEED" >> "$OUT/runs.tsv"
  tail -n 1 "$OUT/run_$i.log" | sed "s/^/    run $i: /"
  RUNS_DONE=$i
  # No GPU: every gpu test is skipped, and more runs would only skip again.
  if ! grep -qE "[0-9]+ (passed|failed)" "$OUT/run_$i.log" && grep -qE "[0-9]+ skipped" "$OUT/run_$i.log"; then
    break
  fi
done

echo
"$PY" - "$OUT" "$N" "$MARK" "${GPU_LINE:-}" <<'EOF'
import os, re, sys
import xml.etree.ElementTree as ET

out, requested, mark, gpu = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
runs = []
if os.path.isfile(os.path.join(out, "runs.tsv")):
    for line in open(os.path.join(out, "runs.tsv")):
        i, rc, secs, hseed = line.rstrip("\n").split("\t")
        runs.append((int(i), int(rc), int(secs), hseed))

SEED = re.compile(r"(?:CUFLASH_TEST_SEED=|seed=)(\d+)")
BLOB = re.compile(r"@reproduce_failure\([^)]*\)")


def counts_of(i):
    """(passed, failed, errors, skipped, failures [(test id, text)]) of run i, from junit or the log."""
    xml, log = os.path.join(out, f"run_{i}.xml"), os.path.join(out, f"run_{i}.log")
    fails = []
    if os.path.isfile(xml):
        try:
            root = ET.parse(xml).getroot()
            suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
            t = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
            for tc in root.iter("testcase"):
                for tag in ("failure", "error"):
                    el = tc.find(tag)
                    if el is not None:
                        tid = f"{tc.get('classname', '').replace('.', '/')}.py::{tc.get('name', '')}"
                        fails.append((tid, (el.get("message") or "") + "\n" + (el.text or "")))
            return (t["tests"] - t["failures"] - t["errors"] - t["skipped"], t["failures"], t["errors"],
                    t["skipped"], fails)
        except Exception as e:  # a run cut off mid-write
            print(f"(run {i}: junit unreadable: {e}; reading the log)")
    text = open(log, errors="replace").read() if os.path.isfile(log) else ""
    found = {}
    lines = [l for l in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", l)]
    if lines:
        found = {w: int(n) for n, w in re.findall(r"(\d+) (passed|failed|skipped|errors?)", lines[-1])}
    else:  # cut off before pytest's summary line: count the progress characters of -q
        prog = "".join(m.group(1) for m in re.finditer(r"^([.FEsxX]+)(?:\s+\[\s*\d+%\])?\s*$", text, re.M))
        found = {"passed": prog.count("."), "failed": prog.count("F"), "errors": prog.count("E"),
                 "skipped": prog.count("s")}
    for m in re.finditer(r"^(?:FAILED|ERROR) (\S+)(?: - (.*))?$", text, re.M):
        fails.append((m.group(1), m.group(2) or ""))
    return (found.get("passed", 0), found.get("failed", 0), found.get("error", 0) + found.get("errors", 0),
            found.get("skipped", 0), fails)


lines, tsv = [], ["run\ttest\tdata seeds\thypothesis seed\treplay"]
passed_runs = 0
skipped_only = False
for i, rc, secs, hseed in runs:
    p, f, e, s, fails = counts_of(i)
    cut = rc in (124, 137)
    ok = rc == 0 and p > 0 and f == 0 and e == 0
    passed_runs += ok
    if p == 0 and f == 0 and e == 0 and s > 0:
        skipped_only = True
    state = "PASS" if ok else ("CUT OFF" if cut else ("NO TEST RAN" if p + f + e == 0 else "FAIL"))
    lines.append(f"run {i}: {state}: {p} passed, {f} failed, {e} errors, {s} skipped in {secs} s "
                 f"(rc {rc}, hypothesis seed {hseed})")
    for tid, text in fails:
        seeds = sorted(set(SEED.findall(text)), key=text.find)
        blob = BLOB.search(text)
        if blob or "Falsifying example" in text or "hypothesis" in text.lower():
            # a hypothesis test: its seed= is a hypothesis draw; the run's hypothesis seed (or the blob) replays it
            replay = f"python -m pytest '{tid}'" + (f" --hypothesis-seed={hseed}" if hseed != "-" else "")
        else:
            replay = (f"CUFLASH_TEST_SEED={seeds[0]} " if seeds else "") + f"python -m pytest '{tid}'"
        lines.append(f"    FAILED {tid}  seed={','.join(seeds) or '(none printed)'}"
                     + (f"  {blob.group(0)}" if blob else ""))
        lines.append(f"        replay: {replay}")
        tsv.append(f"{i}\t{tid}\t{','.join(seeds)}\t{hseed}\t{replay}")

with open(os.path.join(out, "failures.tsv"), "w") as fh:
    fh.write("\n".join(tsv) + "\n")
head = [f"==================== cuflash soak summary ====================",
        f"GPU: {gpu or 'none seen by nvidia-smi'}",
        f"pytest -m \"{mark}\": {len(runs)} of {requested} runs done, {passed_runs} passed"]
if skipped_only and passed_runs == 0:
    verdict, code = "RESULT: no GPU: all gpu tests skipped (nothing was soaked)", 4
elif not runs:
    verdict, code = "RESULT: no run completed (time budget too small?)", 3
elif passed_runs == len(runs):
    verdict, code = f"RESULT: PASS ({passed_runs} runs in a row without a failure)", 0
else:
    verdict, code = f"RESULT: FAIL ({len(runs) - passed_runs} of {len(runs)} runs failed or were cut off; " \
                    f"seeds in {os.path.join(out, 'failures.tsv')})", 1
text = "\n".join(head + lines + [verdict])
with open(os.path.join(out, "summary.txt"), "w") as fh:
    fh.write(text + "\n")
print(text)
sys.exit(code)
EOF
