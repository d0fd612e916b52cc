#!/usr/bin/env python3
"""The parts of scripts/gpu/exllamav3_kernels.py and scripts/gpu/side_by_side_kernels.py that run
without a GPU: the case lists against exl3-bench's source, the port of exl3-bench's random layers
against the C++ (random_exl3_dump, given as --random-exl3-dump), the reference decoder against the
golden vectors (tests/golden), the routing port, the Markdown tables and the merge of both JSON
outputs. The generator and decoder tests need numpy (skipped without it).

    python3 exllamav3_kernels_test.py [--random-exl3-dump PATH]
"""
import argparse
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SCRIPTS = os.path.join(ROOT, "scripts", "gpu")
sys.path.insert(0, SCRIPTS)
import exllamav3_kernels as xk  # noqa: E402
import side_by_side_kernels as sbs  # noqa: E402

try:
    import numpy as np
except ImportError:
    np = None

DUMP = None  # random_exl3_dump, from --random-exl3-dump
GOLDEN = os.path.join(ROOT, "tests", "golden")


def read_safetensors(path):
    """{name: numpy array} of a safetensors file (the dtypes the golden files use)."""
    dtypes = {"I16": np.int16, "F16": np.float16, "F32": np.float32, "I32": np.int32}
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        data = f.read()
    return {k: np.frombuffer(data[v["data_offsets"][0]:v["data_offsets"][1]], dtype=dtypes[v["dtype"]])
            .reshape(v["shape"]) for k, v in header.items() if k != "__metadata__"}


class CaseListTest(unittest.TestCase):
    def test_cases_are_exl3_benchs(self):
        """The shape, row, token and seed lists are the ones tools/exl3_bench/exl3_bench.cc loops
        over (a change there must be carried over)."""
        with open(os.path.join(ROOT, "tools", "exl3_bench", "exl3_bench.cc")) as f:
            src = f.read()
        shapes = re.search(r"const Shape shapes\[\] = \{(.*?)\};", src, re.S).group(1)
        self.assertEqual(tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+), (\d+)\}", shapes)),
                         xk.GEMV_SHAPES)
        gemv = src[src.index("void BenchGemv"):src.index("struct MoeShape")]
        rows = re.search(r"for \(int m : \{([\d, ]+)\}\)", gemv).group(1)
        self.assertEqual(tuple(int(v) for v in rows.split(",")), xk.GEMV_ROWS)
        moe_tokens = re.search(r"for \(int T : \{([\d, ]+)\}\)", src[src.index("void BenchMoe"):]).group(1)
        self.assertEqual(tuple(int(v) for v in moe_tokens.split(",")), xk.MOE_TOKENS)
        gemm_rows = re.search(r"for \(int m : \{([\d, ]+)\}\)", src[src.index("void BenchGemm"):]).group(1)
        self.assertEqual(tuple(int(v) for v in gemm_rows.split(",")), xk.GEMM_ROWS)
        for text in ("if (cb != Codebook::kMcg && !(K == 2 && s.k == 4096 && s.n == 14336 && (m == 1 || m == 8))) continue;",
                     "if (m != 1 && K != 2) continue;", "RandomLinear L(s.k, s.n, K, cb, 100 + K);",
                     "if (s.experts != 288 && (K != 2 || cb != Codebook::kMcg)) continue;",
                     "if (cb == Codebook::kMul1 && K != 2) continue;", "p, p, p, 10.0f, 11 + K);",
                     "benchutil::Rng rng(T * 31 + K);", "const int sets = 8;",
                     "RandomLinear L(k, n, K, Codebook::kMcg, 500 + K);"):
            self.assertIn(text, src)
        moe = re.findall(r'\{"([^"]+)", (\d+), (\d+), (\d+), (\d+), (\d+)\}', src)
        self.assertEqual([(m, *map(int, v)) for m, *v in moe],
                         [(s.model, s.hidden, s.inter, s.experts, s.topk, s.shared_inter)
                          for s in xk.MOE_SHAPES if s.in_exl3_bench])

    def test_counts_and_names(self):
        gemv = xk.gemv_cases()
        self.assertEqual(len(gemv), 74)  # m=1: 7 shapes x 3 K + 2 codebooks; m=8: 7 + 2; six more m: 7
        names = [c.name for c in gemv]
        self.assertEqual(names[0], "m=1 4096\u00d714336 K=2 MCG")  # as h200.md's rows
        self.assertIn("m=1 4096\u00d714336 K=2 3INST", names)
        self.assertIn("m=8 4096\u00d714336 K=2 MUL1", names)
        self.assertNotIn("m=2 4096\u00d714336 K=2 MUL1", names)
        self.assertNotIn("m=2 4096\u00d72048 K=3 MCG", names)
        self.assertEqual({c.seed for c in gemv}, {102, 103, 104})
        moe = xk.moe_cases()
        self.assertEqual(len(moe), 7 * 4)  # GLM-5.3: 4 layers, DeepSeek, Qwen, GLM-4.5-Air: 1 each
        self.assertEqual(moe[0].name, "GLM-5.3-Flash K=2 MCG T=1")
        self.assertEqual(moe[0].seed, 13)
        self.assertEqual(sorted({c.layer for c in moe}),
                         ["DeepSeek-V4.1-Flash K=2 MCG", "GLM-4.5-Air K=2 MCG", "GLM-5.3-Flash K=2 MCG",
                          "GLM-5.3-Flash K=2 MUL1", "GLM-5.3-Flash K=3 MCG", "GLM-5.3-Flash K=4 MCG",
                          "Qwen3.8-Flash-Next K=2 MCG"])
        gemm = xk.gemm_cases()
        self.assertEqual([c.name for c in gemm][:2], ["m=128 4096\u00d714336 K=2 MCG", "m=256 4096\u00d714336 K=2 MCG"])
        self.assertEqual(len(gemm), 14)

    def test_selection(self):
        self.assertEqual(len(xk.select_cases("gemv,moe,gemm")), 74 + 28 + 14)
        only = xk.select_cases(["moe"], "GLM-5.3-Flash K=2 MCG")
        self.assertEqual([c.T for c in only], [1, 8, 16, 64])
        self.assertEqual(len(xk.select_cases("gemv", "^m=1 ")), 23)
        with self.assertRaisesRegex(ValueError, "unknown group"):
            xk.select_cases("gemv,moes")

    def test_list_needs_no_torch(self):
        out = subprocess.run([sys.executable, os.path.join(SCRIPTS, "exllamav3_kernels.py"), "--list",
                              "--groups", "moe", "--only", "Qwen"], capture_output=True, text=True, check=True)
        self.assertEqual(out.stdout.splitlines(), [f"moe\tQwen3.8-Flash-Next K=2 MCG T={t}" for t in (1, 8, 16, 64)])
        bad = subprocess.run([sys.executable, os.path.join(SCRIPTS, "exllamav3_kernels.py"), "--list",
                              "--groups", "gemv", "--only", "m=3 "], capture_output=True, text=True)
        self.assertNotEqual(bad.returncode, 0)
        self.assertIn("no case selected", bad.stderr)

    def test_exllamav3_rules(self):
        self.assertTrue(xk.gemv_eligible(1, 4096, 14336, 2, "mcg"))
        self.assertTrue(xk.gemv_eligible(8, 4096, 2048, 4, "3inst"))
        self.assertFalse(xk.gemv_eligible(1, 4096, 2048, 2, "3inst"))
        self.assertFalse(xk.gemv_eligible(16, 4096, 2048, 2, "mcg"))
        self.assertEqual(xk.gemm_kernel_name(90, "mcg"), "GEMV")
        self.assertEqual(xk.gemm_kernel_name(0, "mul1"), "int8 GEMV")
        self.assertEqual(xk.gemm_kernel_name(3, "mcg"), "GEMM shape 3")
        self.assertEqual([xk.linear_default_path(m) for m in (64, 144, 145, 1023, 1024)],
                         [xk.P_GEMM, xk.P_GEMM, xk.P_RECON, xk.P_RECON, xk.P_RECON_HAD])
        self.assertEqual(xk.coop_ctr_len(64, 8, 2048, 4096), 64 * 16 + 8 * 32 + 2 + 65 + 64)

    def test_fused_host_tables(self):
        # experts 0..3, picks of one call: expert 2 twice, 0 once, 3 once (1 none)
        base, start, kind, active = xk.fused_host_tables([2, 0, 2, 3], 4, 128)
        self.assertEqual(start, [0, 1, 1, 3, 4])  # first sorted assignment per expert (+ sentinel)
        self.assertEqual(base, [0, 0, 1, 3, 0])
        self.assertEqual(kind, [1, 0, 1, 1, 0])
        self.assertEqual(active, 3)
        with self.assertRaisesRegex(ValueError, "over the fused tier"):
            xk.fused_host_tables([1] * 5, 4, 4)


class RoutingTest(unittest.TestCase):
    def test_routing_sets(self):
        ids, weights, touched = xk.moe_routing(8, 8, 288, 2)
        self.assertEqual((len(ids), len(ids[0]), len(ids[0][0])), (8, 8, 8))
        for s in ids:
            for row in s:
                self.assertEqual(len(set(row)), 8)
                self.assertTrue(all(0 <= e < 288 for e in row))
        self.assertEqual(touched, sum(len({e for row in s for e in row}) for s in ids) / 8)
        for s in weights:
            for row in s:
                self.assertTrue(all(0 <= w < 1 and (w * 2**24).is_integer() for w in row))
        self.assertEqual(xk.moe_routing(8, 8, 288, 2), (ids, weights, touched))
        self.assertNotEqual(xk.moe_routing(8, 8, 288, 3)[0], ids)  # seeded by T * 31 + K

    def test_rng_matches_the_cpp(self):
        if DUMP is None:
            self.skipTest("no --random-exl3-dump")
        out = subprocess.run([DUMP, "rng", "11", "5"], capture_output=True, text=True, check=True).stdout.split()
        rng = xk.Rng(11)
        self.assertEqual([int(v, 16) for v in out[1:]], [rng.next() for _ in range(5)])


@unittest.skipIf(np is None, "numpy is not installed")
class GeneratorTest(unittest.TestCase):
    def test_random_linear_matches_exl3_bench(self):
        if DUMP is None:
            self.skipTest("no --random-exl3-dump")
        ops = xk.NumpyOps()
        for k, n, K, seed in ((128, 128, 2, 7), (256, 384, 3, 102), (384, 128, 4, 13999), (128, 256, 1, 5)):
            out = subprocess.run([DUMP, "linear", str(k), str(n), str(K), str(seed)], capture_output=True,
                                 text=True, check=True).stdout
            cpp = {line.split()[0]: [int(w, 16) for w in line.split()[1:]] for line in out.splitlines()}
            trellis, suh, svh = xk.random_linear(ops, k, n, K, seed)
            self.assertEqual(trellis.shape, (k // 16, n // 16, 16 * K))
            self.assertEqual(trellis.view(np.uint16).reshape(-1).tolist(), cpp["trellis"], (k, n, K, seed))
            self.assertEqual(suh.view(np.uint16).tolist(), cpp["suh"], (k, n, K, seed))
            self.assertEqual(svh.view(np.uint16).tolist(), cpp["svh"], (k, n, K, seed))

    def test_rng_values_is_the_sequence(self):
        ops = xk.NumpyOps()
        rng = xk.Rng(42)
        seq = [rng.next() for _ in range(10)]
        self.assertEqual([int(v) & xk.MASK64 for v in xk.rng_values(ops, 42, 3, 7)], seq[3:])

    def test_decoder_matches_golden(self):
        """decode_inner gives exllamav3's reconstruct output bit for bit at every K and codebook,
        and linear_ref the golden products."""
        paths = [os.path.join(GOLDEN, f"exl3_reference_k{k}_n{n}.safetensors") for k, n in ((128, 256), (256, 384))]
        if not all(os.path.exists(p) for p in paths):
            self.skipTest("tests/golden/*.safetensors not present (scripts/dev/fixtures_aside.sh in)")
        ops, had = xk.NumpyOps(), xk.hadamard128()
        for path in paths:
            g = read_safetensors(path)
            for K in range(1, 9):
                for cb, name in enumerate(("3inst", "mcg", "mul1")):
                    p = f"K{K}_cb{cb}"
                    w = xk.decode_inner(ops, g[p + ".trellis"], K, xk.codebook_table(name))
                    self.assertTrue(np.array_equal(w.astype(np.float16).view(np.uint16),
                                                   g[p + ".weight_inner"].view(np.uint16)), (path, p))
                    y = xk.linear_ref(g[p + ".x"].astype(np.float64), w.astype(np.float64),
                                      g[p + ".suh"].astype(np.float64), g[p + ".svh"].astype(np.float64), had)
                    ref = g[p + ".y"].astype(np.float64)
                    self.assertLess(np.linalg.norm(y - ref) / np.linalg.norm(ref), 1e-6, (path, p))


def device_record():
    return {"bench": "exllamav3_device", "exllamav3": "1.6.5", "torch": "2.11.0+cu130", "device": "NVIDIA H100",
            "sms": 132, "reps": 30, "int8_gemv": "unset"}


def gemv_record(m, k, n, K, cb, paths, default=xk.P_GEMM):
    rec = {"bench": "exllamav3_gemv", "case": xk.linear_case_name(m, k, n, K, cb), "m": m, "k": k, "n": n,
           "K": K, "codebook": cb, "paths": paths}
    return xk.finish_record(rec, default)


def moe_record(model, K, cb, T, touched, paths, default):
    rec = {"bench": "exllamav3_moe", "layer": xk.moe_layer_name(model, K, cb), "model": model, "K": K,
           "codebook": cb, "T": T, "experts_touched": touched, "paths": paths}
    return xk.finish_record(rec, default)


def ok(us, err=3e-4, **extra):
    return dict(us=us, timing="graph", rel_err=err, ok=True, **extra)


def table_records():
    """exllamav3_kernels records: a device, GEMV (one with an int8 choice and a failed path), MoE
    (one with a path error) and a skipped case."""
    return [
        device_record(),
        gemv_record(1, 4096, 14336, 2, "mcg", {xk.P_GEMM: ok(31.0, kernel="GEMV"), xk.P_GEMV: ok(30.2),
                                               xk.P_GEMM_NO_GEMV: ok(40.0, kernel="GEMM shape 2")}),
        gemv_record(1, 4096, 14336, 2, "mul1", {xk.P_GEMM: ok(20.0, 9e-3, kernel="int8 GEMV"),
                                                xk.P_GEMV: {"us": 25.0, "timing": "eager", "rel_err": 0.5,
                                                            "ok": False}}),
        moe_record("GLM-5.3-Flash", 2, "mcg", 8, 53.25, {xk.P_COOP: ok(900.0), xk.P_COOP_CHAIN: ok(950.0)},
                   xk.P_COOP),
        moe_record("GLM-5.3-Flash", 2, "mcg", 64, 240.5, {xk.P_FUSED: {"us": None, "error": "RuntimeError: no"}},
                   xk.P_FUSED),
        {"bench": "exllamav3_skipped", "case": "m=64 5120\u00d75120 K=2 MCG", "group": "gemv"},
    ]


class TableTest(unittest.TestCase):
    def test_best_path(self):
        r = table_records()
        self.assertEqual((r[1]["best_path"], r[1]["best_us"], r[1]["default_us"]), (xk.P_GEMV, 30.2, 31.0))
        self.assertEqual(r[2]["best_path"], xk.P_GEMM)  # the failed path is never best
        self.assertIsNone(r[4]["best_path"])

    def test_markdown(self):
        md = xk.format_table(table_records())
        self.assertIn("| m=1 4096\u00d714336 K=2 MCG | 30.2 | exl3_gemv | 31.0 | 30.2 | 40.0 | 3.0e-04 |", md)
        self.assertIn("| m=1 4096\u00d714336 K=2 MUL1 | 20.0 | exl3_gemm (int8 GEMV) | 20.0 | "
                      "25.0 (eager) (failed check) | - | 9.0e-03 |", md)
        self.assertIn("| GLM-5.3-Flash K=2 MCG | 8 | 53.2 | 900.0 | coop | 900.0 | 950.0 | - | 3.0e-04 |", md)
        self.assertIn("| GLM-5.3-Flash K=2 MCG | 64 | 240.5 | - | - | - | - | n/a | - |", md)
        self.assertIn("- GLM-5.3-Flash K=2 MCG T=64, fused: RuntimeError: no", md)
        self.assertIn("Not run (time budget): m=64 5120\u00d75120 K=2 MCG.", md)
        self.assertIn("NVIDIA H100 (132 SMs)", md)


def exl3_bench_records():
    """exl3-bench's --json objects (tools/exl3_bench/exl3_bench.cc) for the cases above."""
    return [
        {"bench": "ceiling", "what": "copy", "bytes_per_s": 4.2e12},
        {"bench": "gemv", "m": 1, "k": 4096, "n": 14336, "K": 2, "codebook": "mcg", "launches": 1, "native_us": 21.4,
         "one_launch_us": 21.4, "three_launch_us": 25.0, "gemm_us": 60.0, "floor_us": 11.4, "bytes_floor_us": 3.5,
         "decode_floor_us": 11.4, "reference_us": 124.0},
        {"bench": "gemv-slice", "m": 1, "k": 4096, "n": 14336, "K": 2, "slice": 2, "native_us": 40.0},
        {"bench": "gemv", "m": 2, "k": 4096, "n": 2048, "K": 2, "codebook": "mcg", "launches": 0, "native_us": 7.0,
         "one_launch_us": 7.0, "three_launch_us": 9.5, "gemm_us": 8.0, "floor_us": 2.1, "bytes_floor_us": 0.5,
         "decode_floor_us": 2.1, "reference_us": 22.0},
        {"bench": "moe", "model": "GLM-5.3-Flash", "K": 2, "codebook": "mcg", "T": 8, "experts_touched": 53.25,
         "native_us": 468.4, "coop_us": 450.0, "floor_us": 286.1, "bytes_floor_us": 30.0, "decode_floor_us": 286.1,
         "reference_us": 3572.0},
        {"bench": "moe", "model": "GLM-5.3-Flash", "K": 2, "codebook": "mcg", "T": 64, "experts_touched": 239.0,
         "native_us": 1756.0, "coop_us": None, "floor_us": 1190.4, "bytes_floor_us": 100.0,
         "decode_floor_us": 1190.4, "reference_us": 15409.0},
        {"bench": "gemm", "m": 512, "k": 4096, "n": 14336, "K": 2, "fused_us": 414.9, "tflops": 145.0,
         "cublas_us": 85.9, "reference_us": 208.1, "native_us": 207.8},
    ]


class MergeTest(unittest.TestCase):
    def exllamav3_records(self):
        recs = table_records()
        gemm = {"bench": "exllamav3_gemm", "case": xk.linear_case_name(512, 4096, 14336, 2, "mcg"), "m": 512,
                "k": 4096, "n": 14336, "K": 2, "codebook": "mcg",
                "paths": {xk.P_RECON: ok(300.0), xk.P_RECON_HAD: ok(350.0)}}
        return recs + [xk.finish_record(gemm, xk.P_RECON)]

    def test_rows(self):
        merged = sbs.merge(exl3_bench_records(), self.exllamav3_records())
        gemv = {r["case"]: r for r in merged["gemv"]}
        row = gemv["m=1 4096\u00d714336 K=2 MCG"]
        self.assertEqual((row["native_us"], row["native_path"], row["exllamav3_us"]), (21.4, "1L", 30.2))
        self.assertAlmostEqual(row["ratio"], 30.2 / 21.4)
        self.assertIsNone(gemv["m=2 4096\u00d72048 K=2 MCG"]["exllamav3_us"])  # only exl3-bench has it
        self.assertIsNone(gemv["m=1 4096\u00d714336 K=2 MUL1"]["native_us"])  # only exllamav3 has it
        moe = {(r["layer"], r["T"]): r for r in merged["moe"]}
        t8 = moe[("GLM-5.3-Flash K=2 MCG", 8)]
        self.assertEqual((t8["ours_us"], t8["exllamav3_us"]), (450.0, 900.0))  # ours: the better of chain, coop
        self.assertEqual(t8["notes"], [])
        t64 = moe[("GLM-5.3-Flash K=2 MCG", 64)]
        self.assertIsNone(t64["exllamav3_us"])
        self.assertIn("experts touched: exl3-bench 239.00, exllamav3_kernels 240.50", t64["notes"])
        (gemm,) = merged["gemm"]
        self.assertEqual((gemm["native_us"], gemm["exllamav3_us"], gemm["exllamav3_path"]), (207.8, 300.0, xk.P_RECON))

    def test_markdown_and_cli(self):
        with tempfile.TemporaryDirectory() as d:
            ours = os.path.join(d, "bench-gemv.json")
            with open(ours, "w") as f:  # exl3-bench writes one JSON array
                json.dump(exl3_bench_records(), f)
            theirs = os.path.join(d, "exllamav3-kernels.json")
            with open(theirs, "w") as f:  # exllamav3_kernels.py writes JSON lines
                f.writelines(json.dumps(r) + "\n" for r in self.exllamav3_records())
            out = subprocess.run([sys.executable, os.path.join(SCRIPTS, "side_by_side_kernels.py"),
                                  "--exl3-bench", ours, "--exllamav3", theirs], capture_output=True, text=True,
                                 check=True).stdout
        self.assertIn("| m=1 4096\u00d714336 K=2 MCG | 21.4 (1L) | 11.4 | 1.88\u00d7 | 30.2 | exl3_gemv | 1.41\u00d7 |", out)
        self.assertIn("| m=2 4096\u00d72048 K=2 MCG | 7.0 (G) | 2.1 | 3.33\u00d7 | - | - | - |", out)
        self.assertIn("| GLM-5.3-Flash K=2 MCG | 8 | 53.2 | 468.4 | 450.0 | 286.1 | 900.0 | coop | 2.00\u00d7 |", out)
        self.assertIn("| m=512 4096\u00d714336 K=2 MCG | 207.8 | 208.1 | 300.0 | reconstruct+hgemm | 1.44\u00d7 |", out)
        self.assertIn("experts touched: exl3-bench 239.00, exllamav3_kernels 240.50", out)

    def test_bad_input_is_refused(self):
        with tempfile.TemporaryDirectory() as d:
            bad = os.path.join(d, "bad.json")
            with open(bad, "w") as f:
                f.write("not json\n")
            r = subprocess.run([sys.executable, os.path.join(SCRIPTS, "side_by_side_kernels.py"),
                                "--exl3-bench", bad, "--exllamav3", bad], capture_output=True, text=True)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("bad.json", r.stderr)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--random-exl3-dump", help="the random_exl3_dump binary (tests/CMakeLists.txt builds it)")
    args, rest = ap.parse_known_args()
    DUMP = args.random_exl3_dump
    unittest.main(argv=[sys.argv[0]] + rest)
