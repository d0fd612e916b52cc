#!/usr/bin/env python3
"""scripts/conformance/dspark_reference.py (DeepSeek-V4's DSPARK drafter in fp32 torch,
docs/dspark.md): its block equals transformers' DeepseekV4DecoderLayer under a causal window mask,
its draft attention sees the whole block and the last sliding_window history rows and nothing
older, and rope is undone by the negated rotation. Needs torch and transformers (DeepseekV4);
skipped without them (the system Python has neither: run it with the fixtures' Python).

    /tmp/hfvenv/bin/python tests/scripts/conformance/dspark_reference_test.py
"""
import os
import shutil
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "scripts", "conformance"))

try:
    import torch
    import transformers
    HAVE = hasattr(transformers, "DeepseekV4Config")
except ImportError:
    HAVE = False


@unittest.skipUnless(HAVE, "no torch / transformers with DeepseekV4")
class DsparkReferenceTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import engine_fixtures as ef
        import dspark_reference as dr
        from safetensors.torch import load_file
        torch.manual_seed(0)
        spec = ef.FAMILIES["deepseek_v4_release"]
        fields = dict(spec["fields"])
        fields.update(num_hidden_layers=4, layer_types=fields["layer_types"] + ["sliding_attention"],
                      mlp_layer_types=fields["mlp_layer_types"] + ["moe"])
        ef.FAMILIES["dspark_test_init"] = dict(spec, fields=fields)
        model, _ = ef.make_model("dspark_test_init", 9)
        d = tempfile.mkdtemp()
        try:
            model.save_pretrained(d)
            saved = {}
            for f in os.listdir(d):
                if f.endswith(".safetensors"):
                    saved.update(load_file(os.path.join(d, f)))
        finally:
            shutil.rmtree(d)
        tensors = {}
        for k, v in saved.items():
            name = ef.deepseek_v4_release_name(k)
            if name.startswith("layers.3."):
                tensors["mtp.0." + name[len("layers.3."):]] = v.float()
        config = dict(model.config.to_dict(), num_hidden_layers=3, dspark_block_size=4, dspark_noise_token_id=127,
                      dspark_markov_rank=64, dspark_target_layer_ids=[2, 0], compress_ratios=[0, 4, 128, 0],
                      qk_rope_head_dim=32)
        cls.cfg = dr.DsparkConfig.from_json(config)
        cls.model, cls.tensors, cls.dr = model, tensors, dr
        cls.block = dr.DsparkBlock(cls.cfg, tensors, 0)

    def test_config(self):
        c = self.cfg
        self.assertEqual((c.num_blocks, c.block_size, c.window, c.rope_dim), (1, 4, 8, 32))
        self.assertEqual(c.target_layer_ids, [0, 2])  # ascending: exllamav3 exports in layer order

    def test_block_is_transformers_decoder_layer_under_a_causal_window(self):
        for n, seed in ((11, 0), (20, 1)):
            diff = self.dr.check_against_transformers(self.block, self.model.model.layers[3],
                                                      self.model.model.rotary_emb, n=n, seed=seed)
            self.assertLess(diff, 1e-5, (n, seed))

    def test_draft_attention_reads_the_window_and_the_whole_block(self):
        c, b = self.cfg, self.block
        gen = torch.Generator().manual_seed(3)
        p0, n = 20, c.block_size
        history = torch.randn(p0, c.head_dim, generator=gen)
        x = torch.randn(n, c.hc_mult, c.hidden, generator=gen)
        base = b(x, history[p0 - c.window:], p0)
        # A later block position moves the first one's output: no causal mask inside the block.
        x2 = x.clone()
        x2[n - 1] += 1.0
        self.assertGreater((b(x2, history[p0 - c.window:], p0)[0] - base[0]).abs().max().item(), 1e-4)
        # The oldest row read moves it; a row just outside the window is never read (block_states
        # slices the last min(window, p0) rows).
        h2 = history.clone()
        h2[p0 - c.window] += 1.0
        self.assertGreater((b(x, h2[p0 - c.window:], p0) - base).abs().max().item(), 1e-4)

    def test_rope_is_undone_by_the_negated_rotation(self):
        dr = self.dr
        x = torch.randn(6, 2, self.cfg.head_dim)
        pos = torch.arange(10, 16)
        f = dr.inv_freq(self.cfg)
        back = dr.rope(dr.rope(x, pos, f), pos, f, sign=-1.0)
        self.assertLess((back - x).abs().max().item(), 1e-5)
        # Only the last rope_dim values turn.
        self.assertTrue(torch.equal(dr.rope(x, pos, f)[..., :-self.cfg.rope_dim], x[..., :-self.cfg.rope_dim]))


if __name__ == "__main__":
    unittest.main()
