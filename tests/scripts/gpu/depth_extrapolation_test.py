#!/usr/bin/env python3
"""scripts/gpu/depth_extrapolation.py on exl3-engine-bench JSON lines written here: a step linear in
the depth is carried exactly; floors too; records only one run has are left out; bad input is
refused with a message."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SCRIPT = os.path.join(ROOT, "scripts", "gpu", "depth_extrapolation.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
import depth_extrapolation as dx  # noqa: E402


def bench_lines(layers, contexts=(1024,), batches=(1, 8)):
    """A run whose decode step is 0.3 ms + 0.25 ms a layer (floor 0.1 + 0.05 a layer) and whose
    prefill is 2 ms + 5 ms a layer, at every context and batch."""
    out = []
    for c in contexts:
        out.append({"bench": "engine_prefill", "experts": "in-process", "context": c,
                    "ttft_s": 2e-3 + 5e-3 * layers, "tokens_per_s": 0, "floor_s": 0.0})
        for b in batches:
            step = 3e-4 + 2.5e-4 * layers
            out.append({"bench": "engine_decode", "experts": "in-process", "graphs": True, "context": c,
                        "batch": b, "step_s": step, "tokens_per_s": b / step,
                        "floor_s": 1e-4 + 5e-5 * layers, "bytes_per_step": 1})
    return out


class DepthExtrapolationTest(unittest.TestCase):
    def write(self, name, records):
        path = os.path.join(self.dir.name, name)
        with open(path, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        return path

    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()

    def tearDown(self):
        self.dir.cleanup()

    def test_a_linear_step_is_carried_exactly(self):
        a = self.write("a.json", bench_lines(6))
        b = self.write("b.json", bench_lines(10))
        _, ra = dx.load(f"6:{a}")
        _, rb = dx.load(f"10:{b}")
        rows = dx.extrapolate(10, rb, 6, ra, 45)  # either order
        decode = [r for r in rows if r["kind"] == "decode"]
        self.assertEqual([r["batch"] for r in decode], [1, 8])
        for r in decode:
            self.assertAlmostEqual(r["step_s"], 3e-4 + 2.5e-4 * 45)
            self.assertAlmostEqual(r["per_layer_s"], 2.5e-4)
            self.assertAlmostEqual(r["floor_s"], 1e-4 + 5e-5 * 45)
            self.assertAlmostEqual(r["tokens_per_s"], r["batch"] / (3e-4 + 2.5e-4 * 45))
        prefill = [r for r in rows if r["kind"] == "prefill"]
        self.assertEqual(len(prefill), 1)
        self.assertAlmostEqual(prefill[0]["step_s"], 2e-3 + 5e-3 * 45)
        self.assertIsNone(prefill[0]["over_floor"])  # a floor of 0: not modelled

    def test_only_what_both_runs_have(self):
        a = self.write("a.json", bench_lines(6, contexts=(1024, 8192)))
        b = self.write("b.json", bench_lines(10, batches=(1,)))
        out = subprocess.run([sys.executable, SCRIPT, "--layers", "45", f"6:{a}", f"10:{b}"],
                             capture_output=True, text=True, check=True).stdout
        rows = [line for line in out.splitlines() if line.startswith("| decode") or line.startswith("| prefill")]
        self.assertEqual(len(rows), 2, out)  # decode 1024 x 1, prefill 1024
        self.assertIn("| decode | in-process | 1024 | 1 |", out)
        self.assertIn("+35 layers", out)

    def test_bad_input_is_refused_by_name(self):
        a = self.write("a.json", bench_lines(6))
        for args, says in ((["--layers", "45", a, a], "is not LAYERS:FILE"),
                           (["--layers", "45", f"6:{a}", f"6:{a}"], "must differ in depth")):
            r = subprocess.run([sys.executable, SCRIPT] + args, capture_output=True, text=True)
            self.assertNotEqual(r.returncode, 0)
            self.assertIn(says, r.stderr)


if __name__ == "__main__":
    unittest.main()
