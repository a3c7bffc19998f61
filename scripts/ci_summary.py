#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""The summary table at the end of `scripts/run.sh test`.

Reads what run.sh left in REPORT_DIR:
  stages.tsv            stage, seconds, rc (0, 1 or "skip"), note
  plugins.json          `ferry info --json` of the plain build
  junit-STAGE.xml       ctest --output-junit of each ctest stage
  tests-STAGE.json      ctest --show-only=json-v1 of that build (the labels)
and prints, per backend, whether it was built and how many test cases ran,
passed, were skipped (and why) or failed in each stage, then the time of each
stage. A gtest binary counts its cases; pytest its tests; any other test is one
case.

Exit 1 when a backend was not built, has a failed case, had no case pass in any
stage, or had a whole ctest test skipped in every stage it was in, unless
FERRY_ALLOWED_SKIPS (",a,b,") names it; and when any other test failed. Tests of
no backend that were skipped everywhere are listed with their reason. Standard
library only.

A stage may also have junit-STAGE-rerun.xml: the tests whose only failure was
LeakSanitizer's own tracer crashing at exit (`--lsan-crashes` lists them for
run.sh, which runs them once more); a rerun's result replaces the first one's,
and the summary says which tests it was.

`ci_summary.py --lsan-crashes JUNIT` prints the failed tests of that file,
joined with '|', when every one of them failed only so; otherwise nothing,
exit 1.
"""
import json
import os
import re
import sys
import xml.etree.ElementTree as ET

BACKENDS = {"tcp": "tcp", "ofi": "ofi", "rdma": "rdma", "xgmi": "gpu", "cma": "cma"}
OTHER = "core/other"


def read_stages(report):
    stages = []
    path = os.path.join(report, "stages.tsv")
    if os.path.exists(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) >= 4:
                    stages.append(parts[:4])
    return stages


def read_labels(report, stage):
    """ctest test name -> list of labels, from ctest --show-only=json-v1."""
    path = os.path.join(report, "tests-%s.json" % stage)
    labels = {}
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return labels
    for t in doc.get("tests", []):
        for prop in t.get("properties", []):
            if prop.get("name") == "LABELS":
                labels[t["name"]] = list(prop.get("value", []))
        labels.setdefault(t["name"], [])
    return labels


GTEST_TOTAL = re.compile(r"^\[==========\] (\d+) tests? from .* ran\.", re.M)
GTEST_PASSED = re.compile(r"^\[  PASSED  \] (\d+) tests?", re.M)
GTEST_SKIPPED = re.compile(r"^\[  SKIPPED \] (\d+) tests?, listed below", re.M)
GTEST_FAILED = re.compile(r"^\[  FAILED  \] (\d+) tests?, listed below", re.M)
# gtest prints "file:line: Skipped", then the message, then "[  SKIPPED ] Case";
# log lines of the test may come in between.
GTEST_SKIP_CASE = re.compile(r"^[^\n]*: Skipped\n([^\n]*)", re.M)
PYTEST = re.compile(r"^=+ (.*\d+ (?:passed|failed|skipped|error).*) in [\d.]+s", re.M)


def count_cases(status, out):
    """(passed, skipped, failed, skip reasons) of one ctest test's output."""
    reasons = []
    totals = GTEST_TOTAL.findall(out)
    if totals:
        p = sum(int(x) for x in GTEST_PASSED.findall(out))
        s = sum(int(x) for x in GTEST_SKIPPED.findall(out))
        f = sum(int(x) for x in GTEST_FAILED.findall(out))
        reasons = [m.strip() for m in GTEST_SKIP_CASE.findall(out)]
        if status == "fail" and f == 0:
            f = 1  # the binary failed outside a case (a crash, a timeout)
        return p, s, f, reasons
    m = PYTEST.findall(out)
    if m:
        words = dict((k, int(v)) for v, k in re.findall(r"(\d+) (\w+)", m[-1]))
        f = words.get("failed", 0) + words.get("error", 0) + words.get("errors", 0)
        if status == "fail" and f == 0:
            f = 1
        return words.get("passed", 0), words.get("skipped", 0), f, reasons
    if status == "fail":
        return 0, 0, 1, reasons
    if status == "skip":
        return 0, 1, 0, reasons
    return 1, 0, 0, reasons


def read_junit(report, stage):
    """[(test name, status 'pass'|'fail'|'skip', output)] of one stage."""
    path = os.path.join(report, "junit-%s.xml" % stage)
    if not os.path.exists(path):
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        print("ci_summary: cannot read %s: %s" % (path, e))
        return None
    results = []
    for case in root.iter("testcase"):
        out = "".join((e.text or "") for e in case.iter("system-out"))
        st = case.get("status", "run")
        if case.find("failure") is not None or case.find("error") is not None or st == "fail":
            status = "fail"
        elif case.find("skipped") is not None or st in ("notrun", "disabled"):
            status = "skip"
            for e in case.iter("skipped"):
                msg = e.get("message") or ""
                if msg:
                    out += "\n" + msg
        else:
            status = "pass"
        results.append((case.get("name"), status, out))
    return results


# LeakSanitizer's tracer thread sometimes dies at exit (a sanitizer bug seen
# across projects: google/sanitizers#1353): the leak check never ran, nothing
# was found wrong. Anything a sanitizer or a test reported is a real failure.
LSAN_TRACER_CRASH = re.compile(r"^Tracer caught signal \d+: .*\n(?:.*\n)?==\d+==LeakSanitizer has "
                               r"encountered a fatal error", re.M)
REAL_FAILURE = re.compile(r"ERROR: (?:AddressSanitizer|LeakSanitizer|ThreadSanitizer)|"
                          r"runtime error:|^\[  FAILED  \]|: Failure$|^FAILED ", re.M)


def lsan_tracer_crashes(junit):
    """Names of the failed tests of one junit file if each failed only by LSan's tracer crash."""
    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError):
        return None
    names = []
    for case in root.iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None or \
            case.get("status") == "fail"
        if not failed:
            continue
        out = "".join((e.text or "") for e in case.iter("system-out"))
        if not LSAN_TRACER_CRASH.search(out) or REAL_FAILURE.search(out):
            return None
        names.append(case.get("name"))
    return names or None


def short(reason):
    reason = re.sub(r"\s+", " ", reason).strip()
    return reason if len(reason) <= 110 else reason[:107] + "..."


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--lsan-crashes":
        names = lsan_tracer_crashes(sys.argv[2])
        if not names:
            return 1
        print("|".join(re.escape(n) for n in names))
        return 0
    report = sys.argv[1]
    allowed = os.environ.get("FERRY_ALLOWED_SKIPS", ",")
    stages = read_stages(report)
    try:
        with open(os.path.join(report, "plugins.json"), encoding="utf-8") as f:
            plugins = {p["name"]: p for p in json.load(f)}
    except (OSError, ValueError):
        plugins = {}

    # Stages that ran ctest, in order; a stage may have several junit files (tsan + tsan-heavy).
    ctest_stages = []
    for name, _, _, _ in stages:
        parts = [n for n in (name, name + "-heavy")
                 if os.path.exists(os.path.join(report, "junit-%s.xml" % n))]
        if parts:
            ctest_stages.append((name, parts))

    rows = list(BACKENDS) + [OTHER]
    # counts[row][stage] = [passed, skipped, failed]
    counts = {r: {} for r in rows}
    reasons = {r: {} for r in rows}
    whole_skips = {r: {} for r in rows}  # test name -> set of stages where the whole test skipped
    ran_somewhere = {r: set() for r in rows}  # tests that did not skip as a whole somewhere
    reruns = []
    # run.sh's last resort: tests whose tracer crashed four times, run once
    # more without the leak check (their rerun file is that run).
    noleak = set()
    if os.path.exists(os.path.join(report, "asan-noleak.txt")):
        with open(os.path.join(report, "asan-noleak.txt")) as f:
            noleak = set(f.read().strip().split("|"))
    for stage, files in ctest_stages:
        for part in files:
            labels = read_labels(report, part)
            again = {n: (st, o) for n, st, o in read_junit(report, part + "-rerun") or []}
            for name, status, out in read_junit(report, part) or []:
                if name in again and status == "fail":
                    reruns.append("  %-10s %s: LeakSanitizer's tracer crashed at exit; run again: %s%s"
                                  % (stage, name, "passed" if again[name][0] == "pass" else "FAILED",
                                     " (NO LEAK CHECK: the tracer crashed 4 times; ASan + UBSan only)"
                                     if stage == "asan" and name in noleak else ""))
                    status, out = again[name]
                labs = labels.get(name, [])
                hit = [b for b, lab in BACKENDS.items() if lab in labs] or [OTHER]
                p, s, f, why = count_cases(status, out)
                for r in hit:
                    c = counts[r].setdefault(stage, [0, 0, 0])
                    c[0] += p
                    c[1] += s
                    c[2] += f
                    for w in why or ([] if status != "skip" else ["%s: skipped as a whole" % name]):
                        key = short(w)
                        reasons[r][key] = reasons[r].get(key, 0) + 1
                    if status == "skip":
                        whole_skips[r].setdefault(name, set()).add(stage)
                    else:
                        ran_somewhere[r].add(name)

    stage_names = [s for s, _ in ctest_stages]
    failed = []
    table = []
    notes = []
    for r in rows:
        cells = []
        for st in stage_names:
            c = counts[r].get(st)
            cells.append("-" if not c else "%d/%d/%d" % tuple(c))
        passed = sum(c[0] for c in counts[r].values())
        fails = sum(c[2] for c in counts[r].values())
        never = sorted(n for n in whole_skips[r] if n not in ran_somewhere[r])
        if r == OTHER:
            built = "-"
            problems = []
        else:
            info = plugins.get(r)
            if info is None:
                built = "NO"
                problems = ["not built"]
            else:
                built = "yes" if info.get("loaded") else "yes, not loaded"
                if not info.get("loaded"):
                    notes.append("  %-10s not loaded here: %s" % (r, short(info.get("error", ""))))
                problems = []
            if passed == 0:
                problems.append("no test case passed")
        if fails:
            problems.append("%d failed" % fails)
        if never and r != OTHER:
            problems.append("never ran: " + ", ".join(never))
        elif never:
            # Not a backend's test (a fault case the kernel cannot stage, ...):
            # reported with its reason below, not a failure of the run.
            notes.append("  %-10s not run anywhere: %s" % (r, ", ".join(never)))
        if not problems:
            verdict = "ok"
        elif r != OTHER and not fails and allowed.find("," + r + ",") >= 0:
            verdict = "skipped (allowed: " + "; ".join(problems) + ")"
        else:
            verdict = "FAIL: " + "; ".join(problems)
            failed.append(r)
        table.append([r, built] + cells + [verdict])

    head = ["backend", "built"] + stage_names + ["verdict"]
    widths = [max(len(str(row[i])) for row in table + [head]) for i in range(len(head) - 1)]
    print("\n== summary: test cases passed/skipped/failed per backend and stage")
    fmt = "  ".join("%%-%ds" % w for w in widths) + "  %s"
    print(fmt % tuple(head))
    for row in table:
        print(fmt % tuple(row))
    for n in notes + reruns:
        print(n)
    for r in rows:
        for why, n in sorted(reasons[r].items(), key=lambda kv: -kv[1]):
            print("  %-10s skipped x%-3d %s" % (r, n, why))

    print("\n== stages")
    for name, secs, rc, note in stages:
        secs = int(secs)
        result = {"0": "passed", "skip": "skipped"}.get(rc, "FAILED")
        print("  %-8s %3dm%02ds  %-8s %s" % (name, secs // 60, secs % 60, result, note))
        if rc not in ("0", "skip"):
            failed.append("stage " + name)
    total = sum(int(s[1]) for s in stages)
    print("  %-8s %3dm%02ds" % ("total", total // 60, total % 60))
    if failed:
        print("== summary: FAILED: " + ", ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
