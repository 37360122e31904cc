#!/usr/bin/env python3
"""bench/hf_bench.py's --alst pieces on the CPU: the tiled MLP and the host-offloaded checkpointing
give plain autograd's loss and gradients, the checkpoints save exactly one tensor per decoder layer
(its input) through save_on_cpu, and HostAdamW updates as AdamW over fp32 masters does. And
--fidelity's blocked float32 reference attention equals SDPA's causal attention."""
import os
import sys
import unittest

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import hf_bench  # noqa: E402


def tiny_model(seed=0):
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=72, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).to(torch.float64)


def loss_and_grads(model, ids):
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


class AlstPiecesTest(unittest.TestCase):
    def test_tiled_mlp_equals_the_plain_mlp(self):
        model = tiny_model()
        mlp = model.model.layers[0].mlp
        x = torch.randn(1, 23, 32, dtype=torch.float64, requires_grad=True)
        want = mlp(x)
        gw = torch.autograd.grad(want.square().sum(), [x, *hf_bench._mlp_weights(mlp)])
        for tile in (1, 5, 23, 64):
            x2 = x.detach().clone().requires_grad_(True)
            got = hf_bench.TiledMLP.apply(x2, mlp, tile, *hf_bench._mlp_weights(mlp))
            gg = torch.autograd.grad(got.square().sum(), [x2, *hf_bench._mlp_weights(mlp)])
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"tile {tile}")
            for a, b in zip(gg, gw):
                torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12, msg=f"tile {tile}")

    def test_offloaded_checkpoints_and_tiles_equal_plain_autograd(self):
        ids = torch.randint(0, 97, (1, 29), generator=torch.Generator().manual_seed(3))
        want_loss, want = loss_and_grads(tiny_model(), ids)
        model = tiny_model()
        hf_bench.offload_checkpointing(model)
        hf_bench.tile_mlps(model, 7)
        packed = []
        real = torch.autograd.graph.save_on_cpu

        class Counting(real):
            def __init__(self, pin_memory=False, device_type="cuda"):
                super().__init__(pin_memory, device_type)
                pack = self.pack_hook
                self.pack_hook = lambda t: (packed.append(tuple(t.shape)), pack(t))[1]
                torch.autograd.graph.saved_tensors_hooks.__init__(self, self.pack_hook, self.unpack_hook)

        torch.autograd.graph.save_on_cpu = Counting
        try:
            got_loss, got = loss_and_grads(model, ids)
        finally:
            torch.autograd.graph.save_on_cpu = real
        self.assertEqual(packed, [(1, 29, 32)] * 3, "one saved tensor per decoder layer: its input")
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-12, atol=0)
        self.assertEqual(sorted(got), sorted(want))
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-10, atol=1e-12, msg=n)

    def test_host_adamw_updates_fp32_masters(self):
        model = tiny_model().to(torch.bfloat16)
        lr, b1, b2, eps, wd = 1e-2, 0.9, 0.999, 1e-8, 0.1
        # AdamW by its formula in fp64 over the fp32 masters' starting values.
        ref = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        m1 = {n: torch.zeros_like(t) for n, t in ref.items()}
        m2 = {n: torch.zeros_like(t) for n, t in ref.items()}
        opt = hf_bench.HostAdamW(model.parameters(), lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
        gen = torch.Generator().manual_seed(5)
        for step in (1, 2):
            for n, p in model.named_parameters():
                p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
                g = p.grad.double()
                ref[n].mul_(1 - lr * wd)
                m1[n].mul_(b1).add_(g, alpha=1 - b1)
                m2[n].mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (m2[n] / (1 - b2 ** step)).sqrt().add_(eps)
                ref[n].addcdiv_(m1[n], denom, value=-lr / (1 - b1 ** step))
            opt.step()
            opt.zero_grad()
            for (n, p), m in zip(model.named_parameters(), opt.master):
                self.assertIsNone(p.grad)
                self.assertEqual((p.dtype, m.dtype, m.device.type), (torch.bfloat16, torch.float32, "cpu"))
                torch.testing.assert_close(m.double(), ref[n], rtol=1e-5, atol=1e-6, msg=n)
                torch.testing.assert_close(p, m.to(torch.bfloat16), rtol=0, atol=0, msg=n)
        # The masters keep what bf16 rounds away (lr 1e-2 moves weights by less than their bf16 ulp).
        finer = sum(int(not torch.equal(p.float(), m)) for p, m in zip(model.parameters(), opt.master))
        self.assertGreater(finer, 0)


class BlockedFp32AttentionTest(unittest.TestCase):
    def test_equals_causal_sdpa_for_every_block_size(self):
        torch.manual_seed(3)
        B, H, Hkv, S, D = 2, 6, 2, 37, 8
        q = torch.randn(B, H, S, D, dtype=torch.float64)
        k = torch.randn(B, Hkv, S, D, dtype=torch.float64)
        v = torch.randn(B, Hkv, S, D, dtype=torch.float64)
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1), is_causal=True,
            scale=0.3).transpose(1, 2)
        for block in (1, 5, 37, 512):
            got, _ = hf_bench.blocked_fp32_attention(None, q, k, v, None, scaling=0.3, block=block)
            self.assertEqual(got.shape, (B, S, H, D))
            self.assertLess((got - want).abs().max().item(), 1e-12, block)
        with self.assertRaisesRegex(ValueError, "attention mask"):
            hf_bench.blocked_fp32_attention(None, q, k, v, torch.ones(S, S, dtype=torch.bool))

    def test_the_model_under_it_gives_sdpas_logits(self):
        ids = torch.randint(0, 97, (1, 29))
        model = tiny_model(seed=4)
        model.eval()
        with torch.no_grad():
            want = model(input_ids=ids).logits
            hf_bench.use_blocked_fp32_attention(model)
            self.assertEqual(model.config._attn_implementation, hf_bench.BLOCKED_FP32)
            got = model(input_ids=ids).logits
        self.assertLess((got - want).abs().max().item(), 1e-10)


if __name__ == "__main__":
    unittest.main()
