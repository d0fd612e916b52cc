#!/usr/bin/env python3
"""scripts/conformance/exllamav3_mtp_drafts.py on the CPU machine (its drafts need the GPU:
scripts/gpu/exllamav3_mtp.sh): the families it refuses by name are those exllamav3 1.6.5's wheel
has no MTP architecture for, its arguments are checked, DeepSeek-V4's DSPARK fixture is read and
compared as the device run compares it (those parts need torch and safetensors; skipped without
them), and exllamav3_config_check.py's emulated loader says what exllamav3 makes of the MTP
fixtures' heads (the config checks need numpy and the wheel in ../shared/exllamav3; skipped
without them).

    python3 exllamav3_mtp_drafts_test.py
"""
import functools
import glob
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
import zipfile
from contextlib import redirect_stdout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "scripts", "conformance"))
import exllamav3_mtp_drafts as drafts  # noqa: E402
import exllamav3_config_check as check  # noqa: E402

SCRIPT = os.path.join(ROOT, "scripts", "conformance", "exllamav3_mtp_drafts.py")
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "engine")
WHEELS = sorted(glob.glob(str(check.DEFAULT_WHEELS / "exllamav3-*.whl")))


@functools.lru_cache(maxsize=None)
def exllamav3():
    try:
        with redirect_stdout(io.StringIO()):
            Config, Model, _ = check.import_exllamav3(None)
    except ImportError:
        return None
    return Config, Model


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, cwd=ROOT)


class MtpDraftsArgumentsTest(unittest.TestCase):
    def test_list_refuses_families_without_mtp_by_name(self):
        r = run("--fixtures", FIXTURES, "--list")
        self.assertEqual(r.returncode, 0, r.stderr)
        lines = r.stdout.splitlines()
        self.assertIn("check glm_moe_dsa_mtp", lines)
        self.assertIn("check glm_moe_dsa_release_mtp", lines)
        self.assertIn("check glm5_next_release_mtp", lines)
        self.assertIn("check glm5_next_mtp", lines)
        self.assertIn("check qwen4_exp_mtp", lines)
        self.assertIn("check qwen4_exp_release_mtp", lines)
        self.assertIn("check deepseek_v4_release_mtp", lines)  # the DSPARK drafter (check_dspark)
        refused = [l for l in lines if l.startswith("refuse ")]
        self.assertEqual(sorted(l.split(":")[0] for l in refused),
                         ["refuse deepseek_v3_mtp", "refuse glm4_moe_mtp"])
        self.assertTrue(any("DeepseekV3ForCausalLM" in l for l in refused))

    def test_bad_arguments(self):
        r = run("--fixtures", FIXTURES, "--alignment", "fixture,sideways")
        self.assertEqual(r.returncode, 2)
        self.assertIn("--alignment sideways", r.stderr)
        r = run("--fixtures", FIXTURES, "--names", "glm_moe_dsa_mtp")
        self.assertEqual(r.returncode, 2)
        self.assertIn("--out is required", r.stderr)
        empty = tempfile.mkdtemp()
        try:
            r = run("--fixtures", empty, "--list")
            self.assertEqual(r.returncode, 2)
            self.assertIn("no *_mtp fixture", r.stderr)
        finally:
            shutil.rmtree(empty)

    def test_refusal_reads_the_family(self):
        tmp = tempfile.mkdtemp()
        try:
            self.assertEqual(drafts.refusal(tmp), "no reference.json")
            for family, refused in (("deepseek_v3", True), ("glm4_moe", True), ("glm_moe_dsa", False),
                                    ("glm_moe_dsa_release", False), ("glm5_next_release", False),
                                    ("qwen4_exp_release", False), ("deepseek_v4_release", False),
                                    ("mixtral", True)):
                with open(os.path.join(tmp, "reference.json"), "w") as f:
                    json.dump({"family": family}, f)
                self.assertEqual(drafts.refusal(tmp) is not None, refused, family)
        finally:
            shutil.rmtree(tmp)

    @unittest.skipUnless(WHEELS, "no exllamav3 wheel in ../shared/exllamav3")
    def test_families_match_the_wheels_mtp_architectures(self):
        with zipfile.ZipFile(WHEELS[-1]) as wheel:
            names = set(wheel.namelist())
        for family in drafts.HAS_MTP:
            self.assertIn(f"exllamav3/architecture/{family}_mtp.py", names, family)
        for family in drafts.NO_MTP:
            self.assertIn(f"exllamav3/architecture/{family}.py", names, family)
            self.assertNotIn(f"exllamav3/architecture/{family}_mtp.py", names, family)


def have_torch():
    try:
        import safetensors  # noqa: F401
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


DSPARK_FIXTURE = os.path.join(FIXTURES, "deepseek_v4_release_mtp")


@unittest.skipUnless(have_torch(), "no torch / safetensors")
class DsparkJudgeTest(unittest.TestCase):
    """What the DSPARK judge (check_dspark) does short of running exllamav3: reading the fixture's
    draft tensors and comparing a run's with them."""

    def test_dry_run_reads_the_draft_calls(self):
        r = drafts.dry_run(DSPARK_FIXTURE)
        self.assertEqual(r["judge"], "dspark")
        self.assertEqual(r["family"], "deepseek_v4")
        self.assertEqual(r["prompts"], 2)
        self.assertEqual(r["draft_calls"], 13 + 32 + 29 + 32)   # one per position of prompt + greedy
        self.assertEqual(r["drafts"], 4 * r["draft_calls"])    # dspark_block_size 4
        self.assertEqual(sum(r["lengths"].values()), r["draft_calls"])
        with open(os.path.join(DSPARK_FIXTURE, "reference.json")) as f:
            meta = json.load(f)
        self.assertGreaterEqual(r["min_abs_confidence"], meta["min_abs_confidence"] * 0.999)

    def test_the_reference_against_itself_and_a_changed_draft(self):
        import torch
        (_, ids, t), = [p for p in drafts.read_dspark_reference(DSPARK_FIXTURE) if p[0] == 1]
        got = {"taps": t["taps"].float(), "main_kv": t["main_kv"][0].float(), "drafts": t["drafts"].long(),
               "length": t["length"].long(), "logits": t["logits"].float(), "confidence": t["confidence"].float()}
        same = drafts.compare_dspark(got, t)
        self.assertEqual(same["equal"], ids.numel())
        self.assertEqual(same["drafts_equal"], 4 * ids.numel())
        self.assertEqual(same["lengths_equal"], ids.numel())
        self.assertEqual(same["worst_row_rel"], 0.0)
        self.assertNotIn("first_difference", same)
        changed = dict(got, drafts=got["drafts"].clone(), length=got["length"].clone())
        changed["drafts"][7, 2] = (changed["drafts"][7, 2] + 1) % 128
        changed["length"][9] += 1
        diff = drafts.compare_dspark(changed, t)
        self.assertEqual(diff["equal"], ids.numel() - 1)
        self.assertEqual(diff["first_difference"]["row"], 7)
        self.assertEqual(diff["first_difference"]["block_position"], 2)
        self.assertEqual(diff["first_length_difference"]["row"], 9)
        self.assertEqual(diff["lengths_equal"], ids.numel() - 1)
        line = drafts.summary("x", {"architecture": "DeepseekV4ForCausalLM", "alignments": {"dspark": {
            **{k: diff[k] for k in ("compared", "equal", "drafts_compared", "drafts_equal", "lengths_equal")},
            "first_difference": {"prompt": 1, **diff["first_difference"]},
            "prompts": [diff]}}})
        self.assertIn("rows of drafts equal", line)
        self.assertIn("row 7 position 2", line)

    def test_a_short_draft_tensor_is_refused(self):
        from safetensors.torch import load_file, save_file
        tmp = tempfile.mkdtemp()
        try:
            for f in ("reference.json", "config.json"):
                shutil.copy(os.path.join(DSPARK_FIXTURE, f), tmp)
            t = load_file(os.path.join(DSPARK_FIXTURE, "reference.safetensors"))
            t["dspark_length.0"] = t["dspark_length.0"][:-1].contiguous()
            save_file(t, os.path.join(tmp, "reference.safetensors"))
            with self.assertRaisesRegex(ValueError, "length"):
                drafts.read_dspark_reference(tmp)
        finally:
            shutil.rmtree(tmp)


class MtpConfigCheckTest(unittest.TestCase):
    """What exllamav3's reader and loader (emulated on the headers) make of the MTP fixtures."""

    @classmethod
    def setUpClass(cls):
        if exllamav3() is None:
            raise unittest.SkipTest("no exllamav3 wheel in ../shared/exllamav3 or no numpy")
        cls.tmp = tempfile.mkdtemp(prefix="exl3v3-mtp-check-")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def check(self, directory, components="text,mtp"):
        out = io.StringIO()
        with redirect_stdout(out):
            ok = check.check(directory, components.split(","), *exllamav3())
        return ok, out.getvalue()

    def relaxed(self, name, **changes):
        """A copy of the fixture (tensors linked) with config.json's settings changed."""
        d = os.path.join(self.tmp, name)
        os.makedirs(d)
        for f in os.listdir(os.path.join(FIXTURES, name)):
            if f != "config.json":
                os.symlink(os.path.join(FIXTURES, name, f), os.path.join(d, f))
        with open(os.path.join(FIXTURES, name, "config.json")) as f:
            config = json.load(f)
        config.update(changes)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f)
        return d

    def test_glm4_moe_has_no_mtp_component(self):
        ok, out = self.check(os.path.join(FIXTURES, "glm4_moe_mtp"))
        self.assertFalse(ok)
        self.assertIn("has no component 'mtp'", out)

    def test_base_settings_are_refused_by_the_config(self):
        ok, out = self.check(os.path.join(FIXTURES, "glm_moe_dsa_mtp"))
        self.assertFalse(ok)
        self.assertIn("Group-limited expert routing", out)

    def test_glm_moe_dsa_mtp_head_is_found_but_for_kv_b_proj(self):
        # With the release settings' n_group 1 the config passes and exllamav3 builds the MTP head
        # from model.layers.1.* (mtp.safetensors): every tensor is where it looks except the MTP
        # layer's kv_b_proj, stored EXL3 (exl3-tool quantize-tensor) where exllamav3 reads only a
        # weight, as for the trunk's (tests/fixtures/engine/README.md, issue 34).
        d = self.relaxed("glm_moe_dsa_mtp", n_group=1, topk_group=1)
        ok, out = self.check(d, "mtp")
        self.assertFalse(ok)
        self.assertIn("mtp: 1 load problems", out)
        self.assertIn("model.layers.1.self_attn.kv_b_proj.weight not found", out)

    def test_release_mtp_fixtures_are_accepted(self):
        # The release twins (n_group 1, the release config layout, the MTP layer's kv_b_proj and
        # indexer wk bf16; Qwen4-Exp: its release shapes, full_attention, mtp_num_hidden_layers 1:
        # engine_fixtures.py --mtp-families glm_moe_dsa_release,glm5_next_release,qwen4_exp_release)
        # load as exllamav3 reads them, trunk and head.
        # DeepSeek-V4's DSPARK drafter: compress_ratios' MTP entry, mtp.* (main_proj, attention and
        # experts EXL3 as exl3-tool quantize writes them, the Markov and confidence heads bf16).
        for name in ("glm_moe_dsa_release_mtp", "glm5_next_release_mtp", "qwen4_exp_release_mtp",
                     "deepseek_v4_release_mtp"):
            ok, out = self.check(os.path.join(FIXTURES, name))
            self.assertTrue(ok, out)
            self.assertIn("mtp: ", out)
            self.assertNotIn("problems", out)


    def test_dspark_needs_the_mtp_entry_of_compress_ratios(self):
        # exllamav3 counts the DSPARK blocks from compress_ratios' entries past num_hidden_layers;
        # without them it builds no "mtp" component (num_nextn_predict_layers is not read).
        d = self.relaxed("deepseek_v4_release_mtp", compress_ratios=[0, 4, 128])
        ok, out = self.check(d)
        self.assertFalse(ok)
        self.assertIn("has no component 'mtp'", out)


if __name__ == "__main__":
    unittest.main()
