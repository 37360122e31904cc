#!/usr/bin/env python3
"""Hugging Face transformers peers for odyssey-bench: the same named shape, random init, bf16,
SDPA attention, gradient checkpointing (non-reentrant), torch.optim.AdamW, one sequence of random
tokens. With --liger, Liger kernels patched in first (RoPE, RMSNorm, SwiGLU, fused linear
cross-entropy): the peer long-context users pick on one GPU. Prints one JSON line and one table
row per length; an out-of-memory length is reported as such.

  python3 bench/hf_bench.py --liger --model llama-3.2-3b --seq-len 65536 131072 --steps 2

--fidelity times nothing: it prints the per-token logprobs' mean and max |d| of the bf16 forward
(Liger's kernels too with --liger) against a float32 forward of the same weights and tokens, the
measure odyssey-bench --fidelity prints for odyssey: how far the peer's bf16 path is from float32.

--alst: the single-GPU parts of Snowflake's ALST recipe on top of transformers + Liger, as this
file implements them with torch (not DeepSpeed's or Arctic Training's code: Arctic Training pins
transformers < 5, and on one GPU ZeRO-3's sharding has nothing to shard): every decoder layer's
input offloaded to host memory by reentrant checkpointing under torch's save_on_cpu (the one
tensor such a checkpoint saves), the MLP computed in sequence tiles (ALST's default tile: hidden
size tokens) with its backward recomputing one tile at a time, Liger's fused linear cross-entropy
for the loss, and AdamW's fp32 master weights and moments in host memory, updated by torch's
AdamW on the CPU (ZeRO-Offload's placement; the GPU holds only bf16 weights and gradients).
Its memory and longest length are the recipe's; its step time is a lower bound on ALST's (the
offload copies are synchronous, as Arctic Training's checkpoint offload is, but torch's fused CPU
AdamW is not DeepSpeed's CPU Adam).

liger-kernel is a benchmark peer, not a dependency: install it where the benchmark runs.
"""
import argparse
import json
import time

import torch
import transformers

SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, tie_word_embeddings=True),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, tie_word_embeddings=True),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, tie_word_embeddings=False),
}


class TiledMLP(torch.autograd.Function):
    """down(act(gate(x)) * up(x)) over `tile` positions at a time. The forward keeps only x; the
    backward recomputes one tile's MLP with autograd at a time, so no buffer is ever (S, intermediate)
    wide. Weight gradients are summed over the tiles in fp32 (or wider) and rounded once."""

    @staticmethod
    def forward(ctx, x, mlp, tile, *weights):
        ctx.mlp, ctx.tile = mlp, tile
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([_mlp(mlp, x[:, i:i + tile]) for i in range(0, x.size(1), tile)], dim=1)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        mlp, tile = ctx.mlp, ctx.tile
        weights = _mlp_weights(mlp)
        dx = torch.empty_like(x)
        sums = [torch.zeros_like(w, dtype=torch.promote_types(w.dtype, torch.float32)) for w in weights]
        for i in range(0, x.size(1), tile):
            xt = x[:, i:i + tile].detach().requires_grad_(True)
            with torch.enable_grad():
                yt = _mlp(mlp, xt)
            g = torch.autograd.grad(yt, [xt, *weights], dy[:, i:i + tile])
            dx[:, i:i + tile] = g[0]
            for acc, gw in zip(sums, g[1:]):
                acc += gw
        return (dx, None, None, *[acc.to(w.dtype) for acc, w in zip(sums, weights)])


def _mlp(mlp, x):
    return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))


def _mlp_weights(mlp):
    return [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]


def tile_mlps(model, tile):
    """Every decoder layer's MLP through TiledMLP (Llama's bias-free gated MLP)."""
    for layer in model.model.layers:
        mlp = layer.mlp
        if any(getattr(mlp, n).bias is not None for n in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError("tile_mlps: the MLP projections must be bias-free")
        mlp.forward = lambda x, mlp=mlp: TiledMLP.apply(x, mlp, tile, *_mlp_weights(mlp))


def offload_checkpointing(model):
    """Gradient checkpointing with each decoder layer's saved input in host memory: reentrant
    checkpoints save exactly their tensor arguments (the layer's hidden states), and save_on_cpu
    moves what is saved to (pinned, where there is a GPU) host memory and back for the backward."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    pin = torch.cuda.is_available()

    def checkpoint(fn, *args):
        with torch.autograd.graph.save_on_cpu(pin_memory=pin):
            return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)

    for m in model.model.layers:
        if not getattr(m, "gradient_checkpointing", False) or not hasattr(m, "_gradient_checkpointing_func"):
            raise RuntimeError("offload_checkpointing: a decoder layer without transformers' checkpointing hook "
                               f"({type(m).__name__}, transformers {transformers.__version__})")
        m._gradient_checkpointing_func = checkpoint


class HostAdamW:
    """AdamW with the fp32 master weights and both moments in host memory: step() brings the
    gradients to the host in fp32, runs torch's AdamW there and writes the weights back in their
    own dtype. The device holds no fp32 copy."""

    def __init__(self, params, **adamw):
        self.params = [p for p in params if p.requires_grad]
        self.master = [p.detach().to("cpu", torch.float32, copy=True) for p in self.params]
        # torch's fused AdamW: vectorized and threaded on the CPU, as DeepSpeed's CPU Adam is.
        self.opt = torch.optim.AdamW(self.master, fused=True, **adamw)

    @torch.no_grad()
    def step(self):
        for p, m in zip(self.params, self.master):
            m.grad = None if p.grad is None else p.grad.to("cpu", torch.float32)
        self.opt.step()
        for p, m in zip(self.params, self.master):
            p.copy_(m)

    def zero_grad(self, set_to_none=True):
        for p, m in zip(self.params, self.master):
            p.grad = None
            m.grad = None


def build_model(args, seq_len, device, fused_linear_cross_entropy):
    """The named shape (cut to --layers), SDPA attention, Liger's kernels patched in under --liger
    (its SwiGLU left out under --alst, whose tiled MLP replaces it), random init from --seed, in
    bf16 on `device`."""
    cfg = transformers.LlamaConfig(vocab_size=128256, max_position_embeddings=max(seq_len, 131072), rms_norm_eps=1e-5,
                                   rope_theta=500000.0, **SHAPES[args.model])
    if args.layers:
        cfg.num_hidden_layers = args.layers
    cfg._attn_implementation = "sdpa"
    if args.liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=not args.alst, cross_entropy=False,
                                    fused_linear_cross_entropy=fused_linear_cross_entropy)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    return cfg, model


def run(args, seq_len):
    cfg, model = build_model(args, seq_len, "cuda", fused_linear_cross_entropy=True)
    if args.alst:
        offload_checkpointing(model)
        tile_mlps(model, args.mlp_tile or cfg.hidden_size)
    elif args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = HostAdamW(model.parameters(), lr=1e-5) if args.alst else torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, cfg.vocab_size, (1, seq_len), device="cuda")
    times = []
    impl = ("hf+liger" if args.liger else "hf") + ("+alst-style" if args.alst else "")
    try:
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        sec = sorted(times)[len(times) // 2]
        res = dict(impl=impl, model=args.model, layers=cfg.num_hidden_layers, seq_len=seq_len,
                   checkpointing=args.checkpointing, seconds_per_step=sec, tokens_per_second=seq_len / sec,
                   gpu_peak_allocated_bytes=torch.cuda.max_memory_allocated(),
                   gpu_peak_reserved_bytes=torch.cuda.max_memory_reserved(), loss=float(loss))
    except torch.OutOfMemoryError:
        res = dict(impl=impl, model=args.model, layers=cfg.num_hidden_layers, seq_len=seq_len,
                   checkpointing=args.checkpointing, oom=True)
    del model, opt
    torch.cuda.empty_cache()
    return res


BLOCKED_FP32 = "odyssey_blocked_fp32"


def blocked_fp32_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, block=512, **kwargs):
    """Causal attention in query blocks, each KV head's query heads in one product: the float32
    reference of --fidelity. SDPA has no float32 kernel for GQA (flash is 16-bit only and the
    memory-efficient one takes no enable_gqa), so a float32 model falls back to the math path's
    whole (H, S, S) scores: 384 GiB at 64K. Here a block holds (H, block, S) scores. One unpadded
    causal sequence only (the fidelity run's input): any mask is refused."""
    if attention_mask is not None:
        raise ValueError("blocked_fp32_attention: one unpadded causal sequence only (got an attention mask)")
    if dropout:
        raise ValueError("blocked_fp32_attention: no dropout")
    B, H, S, D = query.shape
    Hkv = key.shape[1]
    G = H // Hkv
    scale = D ** -0.5 if scaling is None else scaling
    q = query.reshape(B, Hkv, G, S, D)
    out = torch.empty_like(q)
    for r0 in range(0, S, block):
        n = min(block, S - r0)
        kv = r0 + n
        s = torch.matmul(q[:, :, :, r0:kv], key[:, :, None, :kv].transpose(-1, -2)) * scale  # (B, Hkv, G, n, kv)
        s[..., r0:].masked_fill_(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        out[:, :, :, r0:kv] = torch.matmul(torch.softmax(s, -1), value[:, :, None, :kv])
    return out.reshape(B, H, S, D).transpose(1, 2).contiguous(), None  # (B, S, H, D) as transformers' SDPA


def use_blocked_fp32_attention(model):
    """Switches `model` to blocked_fp32_attention (registered with transformers' attention
    interface, the SDPA mask rules: no mask for one causal sequence)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask
    AttentionInterface.register(BLOCKED_FP32, blocked_fp32_attention)
    AttentionMaskInterface.register(BLOCKED_FP32, sdpa_mask)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(BLOCKED_FP32)
    else:
        model.config._attn_implementation = BLOCKED_FP32


def fidelity(args, seq_len):
    """Per-token logprobs of the bf16 model (under --liger, its kernels) against float32 on the
    same weights and tokens. Logits are formed in query blocks of --fidelity-block positions (bf16
    logits as the bf16 model gives them, then float32 log-softmax), so no buffer is S x vocab."""
    cfg, model = build_model(args, seq_len, args.device, fused_linear_cross_entropy=False)
    model.eval()
    if args.save_weights:
        model.save_pretrained(args.save_weights)  # config.json + safetensors: odyssey-bench --model DIR loads them
    ids = torch.randint(0, cfg.vocab_size, (1, seq_len + 1), device=args.device)

    def logprobs(m):
        with torch.no_grad():
            hidden = m.model(input_ids=ids[:, :-1]).last_hidden_state[0]  # (S, hidden)
            out = []
            for r0 in range(0, seq_len, args.fidelity_block):
                logits = m.lm_head(hidden[r0:r0 + args.fidelity_block]).float()  # (block, vocab)
                out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1 + r0:1 + r0 + logits.size(0), None])[:, 0])
            return torch.cat(out)

    t0 = time.perf_counter()
    a = logprobs(model)
    t_bf16 = time.perf_counter() - t0
    model = model.float()  # the same weights, widened
    use_blocked_fp32_attention(model)
    t0 = time.perf_counter()
    b = logprobs(model)
    t_fp32 = time.perf_counter() - t0
    d = (a - b).abs()
    impl = "hf+liger" if args.liger else "hf"
    res = dict(impl=impl, model=args.model, layers=cfg.num_hidden_layers, seq_len=seq_len, tokens=int(d.numel()),
               fidelity_mean_abs_logprob_diff=float(d.mean()), fidelity_max_abs_logprob_diff=float(d.max()),
               bf16_seconds=t_bf16, reference_seconds=t_fp32)
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-3b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--seq-len", type=int, nargs="+", default=[65536])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    ap.add_argument("--liger", action="store_true", help="patch in Liger kernels (liger-kernel installed)")
    ap.add_argument("--alst", action="store_true",
                    help="with --liger: ALST's single-GPU recipe (layer inputs offloaded to the host, tiled MLP, "
                         "AdamW state on the host; see the module's doc)")
    ap.add_argument("--mlp-tile", type=int, default=0,
                    help="--alst: positions per MLP tile (0: the hidden size, ALST's default)")
    ap.add_argument("--json", default="")
    ap.add_argument("--fidelity", action="store_true",
                    help="instead of timing: bf16 per-token logprobs against a float32 forward of the same weights")
    ap.add_argument("--fidelity-block", type=int, default=8192, help="positions per block of logits (--fidelity)")
    ap.add_argument("--save-weights", default="",
                    help="--fidelity: save the bf16 model's weights to this folder (odyssey-bench --model DIR, same weights)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the random init and the random tokens")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for --fidelity on small shapes")
    args = ap.parse_args()
    if args.fidelity_block < 1:
        ap.error(f"--fidelity-block must be >= 1 (got {args.fidelity_block})")
    if args.save_weights and not args.fidelity:
        ap.error("--save-weights is for --fidelity only")
    if args.alst and (not args.liger or args.fidelity or not args.checkpointing):
        ap.error("--alst needs --liger (its fused linear cross-entropy is the recipe's tiled loss) and times a step: "
                 "not with --fidelity or --no-checkpointing")
    if args.mlp_tile < 0 or (args.mlp_tile and not args.alst):
        ap.error(f"--mlp-tile must be >= 1 and is for --alst only (got {args.mlp_tile})")
    if args.device != "cuda" and not args.fidelity:
        ap.error("--device cpu is for --fidelity only: the timed peer runs on a GPU")
    for s in args.seq_len:
        res = fidelity(args, s) if args.fidelity else run(args, s)
        print(json.dumps(res), flush=True)
        if args.fidelity:
            print(f"| fidelity {res['impl']} | {args.model} | {s} | mean |d| {res['fidelity_mean_abs_logprob_diff']:.4f} | "
                  f"max |d| {res['fidelity_max_abs_logprob_diff']:.4f} |", flush=True)
        elif res.get("oom"):
            print(f"| {res['impl']} {args.model} | {s} | out of memory |", flush=True)
        else:
            gib = 1 << 30
            print(f"| {res['impl']} {args.model} | {s} | {res['gpu_peak_allocated_bytes'] / gib:.2f} / "
                  f"{res['gpu_peak_reserved_bytes'] / gib:.2f} GiB | {res['seconds_per_step']:.2f} s | "
                  f"{res['tokens_per_second']:.0f} tok/s |", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
