#!/usr/bin/env python3
# tests/tools/test_lockstep_run.py: tools/lockstep-run's decisions, each over real mpiexec jobs
# of small shell programs that die, fail or succeed on chosen ranks and launches: a lost rank
# shrinks the job, --min and --max-restarts stop it, an error stops it at once, status 75
# relaunches at the same count, --slots gives the count back (and a bad --slots file is refused
# before the first launch), a rank's SIGABRT stops it like an error, SIGTERM to the launcher
# stops the job without a relaunch. Every rank writes what it saw.
# Usage: test_lockstep_run.py <tools/lockstep-run> <mpiexec>
# SPDX-License-Identifier: Apache-2.0
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

LAUNCHER, MPIEXEC = sys.argv[1], sys.argv[2]

# What every rank of every launch runs: it records "<launch> <ranks> <rank>" in seen/, then
# behaves as $ACTION says for its launch and rank ("kill", "exit C" or nothing). A rank that
# mpiexec's clean-up ends early may record nothing.
RANK_PROGRAM = r'''
rank=${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-$PMIX_RANK}}
seen="$SEEN/$LOCKSTEP_RUN_ATTEMPT.$rank"
echo "$LOCKSTEP_RUN_ATTEMPT $LOCKSTEP_RUN_REPLICAS $rank" > "$seen.tmp" && mv "$seen.tmp" "$seen"
action=$(sh -c "$ACTION" x "$LOCKSTEP_RUN_ATTEMPT" "$rank")
case "$action" in
  kill) kill -KILL $$ ;;
  abort) kill -ABRT $$ ;;
  exit*) exit ${action#exit } ;;
esac
exit 0
'''


class LockstepRun(unittest.TestCase):
    def run_job(self, n, action, *options):
        """Runs lockstep-run -n n over RANK_PROGRAM; `action` is a shell snippet given the launch
        ($1) and the rank ($2) that prints the rank's action. Returns (status, log, launches)
        where launches lists, per launch, its rank count as every rank saw it."""
        self.work = tempfile.mkdtemp(prefix="lockstep-run-test.")
        self.addCleanup(shutil.rmtree, self.work)
        seen = os.path.join(self.work, "seen")
        os.makedirs(seen)
        env = dict(os.environ, SEEN=seen, ACTION=action)
        proc = subprocess.run([sys.executable, LAUNCHER, "-n", str(n), "--backoff", "0.05",
                               "--mpiexec", MPIEXEC, *options, "--", "sh", "-c", RANK_PROGRAM],
                              env=env, capture_output=True, text=True, timeout=120)
        launches = {}
        for name in os.listdir(seen):
            if name.endswith(".tmp"):
                continue  # a rank that mpiexec's clean-up ended while it wrote
            with open(os.path.join(seen, name), encoding="ascii") as f:
                attempt, ranks, _rank = f.read().split()
            launches.setdefault(int(attempt), set()).add(int(ranks))
        counts = []
        for a in sorted(launches):
            self.assertEqual(len(launches[a]), 1, f"launch {a}: ranks saw {launches[a]}")
            counts.append(launches[a].pop())
        self.assertEqual(sorted(launches), list(range(len(counts))))
        return proc.returncode, proc.stderr, counts

    def test_success_is_one_launch(self):
        status, log, counts = self.run_job(3, "true")
        self.assertEqual((status, counts), (0, [3]), log)
        self.assertIn("launch 0 succeeded with 3 rank(s)", log)

    def test_lost_rank_relaunches_with_the_survivors(self):
        status, log, counts = self.run_job(3, 'if [ $1 = 0 ] && [ $2 = 1 ]; then echo kill; fi',
                                           "--min", "2")
        self.assertEqual((status, counts), (0, [3, 2]), log)
        self.assertIn("launch 0 lost rank 1 (SIGKILL)", log)
        self.assertIn("launch 1 succeeded with 2 rank(s)", log)

    def test_stops_below_min(self):
        status, log, counts = self.run_job(3, 'if [ $2 = 0 ]; then echo kill; fi', "--min", "2")
        self.assertNotEqual(status, 0)
        self.assertEqual(counts, [3, 2], log)
        self.assertIn("stopping: 1 rank(s) left, fewer than --min 2", log)

    def test_stops_after_max_restarts(self):
        status, log, counts = self.run_job(4, 'if [ $2 = 0 ]; then echo kill; fi',
                                           "--max-restarts", "1")
        self.assertNotEqual(status, 0)
        self.assertEqual(counts, [4, 3], log)
        self.assertIn("stopping: --max-restarts 1 relaunches made", log)

    def test_error_stops_at_once(self):
        status, log, counts = self.run_job(2, 'if [ $2 = 1 ]; then echo exit 3; fi')
        self.assertEqual((status, counts), (3, [2]), log)
        self.assertIn("rank 1 exit 3", log)
        self.assertIn("not relaunching", log)

    def test_abort_stops_at_once(self):
        # SIGABRT is the program's own abort (an uncaught exception), not a lost rank.
        status, log, counts = self.run_job(3, 'if [ $2 = 2 ]; then echo abort; fi', "--min", "1")
        self.assertNotEqual(status, 0)
        self.assertEqual(counts, [3], log)
        self.assertIn("rank 2 aborted (SIGABRT", log)
        self.assertNotIn("relaunching with", log)

    def test_try_again_relaunches_with_as_many(self):
        status, log, counts = self.run_job(2, 'if [ $1 = 0 ]; then echo exit 75; fi')
        self.assertEqual((status, counts), (0, [2, 2]), log)
        self.assertIn("relaunching with as many ranks", log)

    def test_slots_give_the_count_back(self):
        slots = tempfile.NamedTemporaryFile("w", suffix=".slots", delete=False)
        slots.write("3\n")
        slots.close()
        status, log, counts = self.run_job(3, 'if [ $1 = 0 ] && [ $2 = 2 ]; then echo kill; fi',
                                           "--slots", slots.name)
        os.unlink(slots.name)
        self.assertEqual((status, counts), (0, [3, 3]), log)
        self.assertIn("lost rank 2", log)

    def test_unreadable_slots_are_refused_before_the_first_launch(self):
        slots = tempfile.NamedTemporaryFile("w", suffix=".slots", delete=False)
        slots.write("abc\n")
        slots.close()
        self.addCleanup(os.unlink, slots.name)
        for path in (slots.name, slots.name + ".missing"):
            proc = subprocess.run([sys.executable, LAUNCHER, "-n", "2", "--slots", path, "--",
                                   "true"], capture_output=True, text=True, timeout=30)
            self.assertEqual(proc.returncode, 2, proc.stderr)
            self.assertIn(path, proc.stderr)
            self.assertNotIn("Traceback", proc.stderr)
            self.assertNotIn("launch 0", proc.stderr)

    def test_sigterm_stops_without_relaunch(self):
        work = tempfile.mkdtemp(prefix="lockstep-run-test.")
        self.addCleanup(shutil.rmtree, work)
        seen = os.path.join(work, "seen")
        os.makedirs(seen)
        env = dict(os.environ, SEEN=seen, ACTION="sleep 60")
        proc = subprocess.Popen([sys.executable, LAUNCHER, "-n", "2", "--backoff", "0.05",
                                 "--mpiexec", MPIEXEC, "--", "sh", "-c", RANK_PROGRAM],
                                env=env, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while len([n for n in os.listdir(seen) if not n.endswith(".tmp")]) < 2:
            self.assertLess(time.monotonic(), deadline, "the ranks did not start")
            time.sleep(0.05)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, log = proc.communicate(timeout=30)
        self.assertLess(time.monotonic() - started, 20, log)
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("stopped by SIGTERM: not relaunching", log)
        self.assertNotIn("launch 1", log)

    def test_missing_mpiexec(self):
        proc = subprocess.run([sys.executable, LAUNCHER, "-n", "2", "--mpiexec",
                               "/nonexistent/mpiexec", "--", "true"],
                              capture_output=True, text=True, timeout=30)
        self.assertEqual(proc.returncode, 127)
        self.assertIn("cannot start /nonexistent/mpiexec", proc.stderr)

    def test_refuses_bad_options(self):
        proc = subprocess.run([sys.executable, LAUNCHER, "-n", "2", "--min", "3", "--", "true"],
                              capture_output=True, text=True, timeout=30)
        self.assertEqual(proc.returncode, 2)
        self.assertIn("--min 3", proc.stderr)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
