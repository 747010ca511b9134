#!/bin/bash
# The GPU test suite on the offline GPU host (device tool), as run for the README: installs the
# wheels carried in .whl (../shared/gpu/wheelhouse.sh), runs pytest and writes a
# `<UTC stamp>-gpu-tests` result folder (log, JUnit XML, summary, command, environment) to $OUT.
#   bash benchmarks/gpu_tests.sh                 # pytest -m gpu tests/
#   bash benchmarks/gpu_tests.sh tests/kernels   # any pytest arguments instead
# GIT_REV=<revision> names the working tree in command.txt (the host's copy has no .git).
# GPU_TESTS_LIMIT_S (default 540) stops pytest in time for the summary to be written inside one
# 10-minute device call; the summary then shows exit code 124, and log.txt (pytest -v) names the
# tests that passed before it (pytest writes junit.xml only when it finishes).
# On a host of several GPUs, GPU_TESTS_DEVICES=0,1 with pytest-xdist's -n spreads the workers
# over the GPUs (tests/conftest.py pins worker gwN to device N mod 2). Instances may also run side
# by side (the wheels are installed once, under a lock; GPU_TESTS_TAG keeps their folders apart).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
(
  flock 9
  [ -f /tmp/site/.installed ] || {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && touch /tmp/site/.installed
  }
) 9>/tmp/site.lock
[ -f /tmp/site/.installed ] || exit 1
export PYTHONPATH=/tmp/site:$PWD
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(-m gpu tests/)
d=${OUT:-/tmp}/$(date -u +%Y%m%dT%H%M%SZ)-gpu-tests${GPU_TESTS_TAG:+-$GPU_TESTS_TAG}
mkdir -p "$d"
start=$(date +%s)
timeout "${GPU_TESTS_LIMIT_S:-540}" python3 -m pytest -v -p no:cacheprovider -rfE --junitxml="$d/junit.xml" "${args[@]}" > "$d/log.txt" 2>&1
code=$?
tail -n 40 "$d/log.txt"
python3 - "$d" "$code" "$(( $(date +%s) - start ))" "${args[*]}" <<'X'
import json, os, re, sys, xml.etree.ElementTree as ET
from pathlib import Path
from inferengine.bench.environment import environment_text
folder, code, seconds, args = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
junit = folder / "junit.xml"
suite = ET.parse(junit).getroot().find("testsuite") if junit.exists() else None
if suite is None:
    suite = ET.Element("testsuite")
counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
failed = [
    f"{case.get('classname')}::{case.get('name')}"
    for case in suite.iter("testcase")
    if case.find("failure") is not None or case.find("error") is not None
]
lines = (folder / "log.txt").read_text(errors="replace").splitlines()
if not junit.exists():  # stopped by the limit: count the -v lines of the tests that ended
    ended = [m.groups() for m in map(re.compile(r"(PASSED|FAILED|ERROR|SKIPPED) (tests/\S+)").search, lines) if m]
    keys = {"PASSED": "passed", "FAILED": "failures", "ERROR": "errors", "SKIPPED": "skipped"}
    counts = {key: sum(1 for s, _ in ended if s == status) for status, key in keys.items()}
    failed = [name for status, name in ended if status in ("FAILED", "ERROR")]
summary = {"pytest_args": args, "exit_code": code, "wall_s": seconds, "finished": junit.exists(), **counts, "failed": failed}
(folder / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
command = f"bash benchmarks/gpu_tests.sh {args}"
revision = os.environ.get("GIT_REV", "see environment.txt")
(folder / "command.txt").write_text(f"# device tool, working tree {revision}\n{command}\n")
(folder / "environment.txt").write_text(environment_text({"gpu-tests": command}))
# Keep the log to its failures and summary, not every test's line.
kept = [line for line in lines[:-400] if "FAILED" in line or "ERROR" in line] + lines[-400:]
(folder / "log.txt").write_text("\n".join(kept) + "\n")
print(json.dumps(summary))
X
exit $code
