#!/usr/bin/env python3
"""scripts/gpu/test_checks.sh without a GPU: in a copy of the scripts it needs, with an unpacked
bundle of stand-in test binaries (shell scripts that print gtest's summary lines), it runs each
named binary with its filter, prints exit codes and the failed and passed lines, packs every log
in one tarball and exits 1 when any binary failed; a malformed NAME=BINARY[:FILTER] is refused
before anything is run or written."""
import os
import shutil
import subprocess
import tarfile
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

PASSING = """#!/bin/sh
echo "filter: $*"
echo "[  PASSED  ] 3 tests."
"""
FAILING = """#!/bin/sh
echo "[  FAILED  ] Suite.Case (12 ms)"
echo "[  PASSED  ] 1 test."
echo "[  FAILED  ] 1 test, listed below:"
exit 1
"""


class TestChecksTest(unittest.TestCase):
    def setUp(self):
        self.tree = tempfile.mkdtemp(prefix="test-checks-")
        self.addCleanup(shutil.rmtree, self.tree)
        os.makedirs(os.path.join(self.tree, "scripts", "gpu"))
        for name in ("test_checks.sh", "env.sh"):
            shutil.copy(os.path.join(ROOT, "scripts", "gpu", name), os.path.join(self.tree, "scripts", "gpu"))
        bin_dir = os.path.join(self.tree, ".gpu-deps", "bin")
        os.makedirs(bin_dir)
        for name, text in (("passing_test", PASSING), ("failing_test", FAILING)):
            path = os.path.join(bin_dir, name)
            with open(path, "w") as f:
                f.write(text)
            os.chmod(path, 0o755)
        self.out = os.path.join(self.tree, "out")

    def run_checks(self, *specs):
        env = dict(os.environ, OUT=self.out, KEEP_DEPS="1")
        return subprocess.run(["bash", os.path.join(self.tree, "scripts", "gpu", "test_checks.sh"), *specs],
                              env=env, capture_output=True, text=True, timeout=60)

    def logs(self):
        with tarfile.open(os.path.join(self.out, "logs.tar.xz")) as t:
            return {os.path.basename(m.name): t.extractfile(m).read().decode() for m in t.getmembers() if m.isfile()}

    def test_runs_each_binary_with_its_filter_and_packs_every_log(self):
        r = self.run_checks("a=passing_test:Suite.*:Other/*", "b=failing_test")
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("a (passing_test Suite.*:Other/*): exit 0", r.stdout)
        self.assertIn("[  PASSED  ] 3 tests.", r.stdout)
        self.assertIn("b (failing_test): exit 1", r.stdout)
        self.assertIn("[  FAILED  ] Suite.Case (12 ms)", r.stdout)
        self.assertNotIn("listed below", r.stdout)
        logs = self.logs()
        self.assertEqual(set(logs), {"a.log", "b.log"})
        self.assertIn("filter: --gtest_filter=Suite.*:Other/*", logs["a.log"])

    def test_all_passing_exits_0(self):
        r = self.run_checks("a=passing_test")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_a_missing_binary_fails_its_line(self):
        r = self.run_checks("gone=no_such_test")
        self.assertEqual(r.returncode, 1)
        self.assertIn("gone (no_such_test): exit 127", r.stdout)

    def test_malformed_specs_are_refused_before_anything_runs(self):
        for spec in ("no_equals", "=passing_test", "a=", "a b=passing_test"):
            with self.subTest(spec=spec):
                r = self.run_checks("a=passing_test", spec)
                self.assertEqual(r.returncode, 2)
                self.assertIn("is not NAME=BINARY[:FILTER]", r.stderr)
                self.assertEqual(r.stdout, "")
                self.assertFalse(os.path.exists(self.out))

    def test_no_arguments_print_the_usage(self):
        r = self.run_checks()
        self.assertEqual(r.returncode, 2)
        self.assertIn("NAME=BINARY[:GTEST_FILTER]", r.stdout)


if __name__ == "__main__":
    unittest.main()
