"""transformer-lens 3.9's way of loading GPT-OSS (its GPT_OSS_Demo, rewritten): a HookedTransformer built from a
hand-written config with a transformers tokenizer, left on the CPU, then filled layer by layer from the released
file's tensors (the experts' MXFP4 weights dequantised by transformers) with partial load_state_dict calls; then
the demo's analyses. Written once: the oracle (tests/saelens_oracle.py `gpt_oss_demo`, transformer-lens 3.9) and
tests/test_gpt_oss.py (probe) each run it with their own classes on the same MXFP4 directory."""
from __future__ import annotations

import einops
import torch
from safetensors import safe_open


def demo_config(config_class, n_layers: int, d_vocab: int):
    # the demo's settings, at a stand-in's size: no sinks and no windows, as the demo's config has none
    return config_class(n_layers=n_layers, d_model=64, d_head=16, n_heads=8, d_mlp=64, n_ctx=64, d_vocab=d_vocab,
                        act_fn="silu", normalization_type="RMS", positional_embedding_type="rotary",
                        rotary_base=150000, eps=1e-5, n_key_value_heads=2, gated_mlp=True, use_local_attn=False,
                        rotary_dim=16, num_experts=4, experts_per_token=2, dtype=torch.float32, device="cpu",
                        original_architecture="GptOssForCausalLM", model_name="openai/gpt-oss-20b")


def layer_state(get, l: int, cfg) -> dict:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    p, heads, kv = f"model.layers.{l}", cfg.n_heads, cfg.n_key_value_heads
    state = {f"blocks.{l}.ln1.w": get(f"{p}.input_layernorm.weight"),
             f"blocks.{l}.ln2.w": get(f"{p}.post_attention_layernorm.weight"),
             f"blocks.{l}.attn.b_O": get(f"{p}.self_attn.o_proj.bias"),
             f"blocks.{l}.mlp.W_gate.weight": get(f"{p}.mlp.router.weight"),
             f"blocks.{l}.mlp.W_gate.bias": get(f"{p}.mlp.router.bias")}
    for ours, theirs, n in (("W_Q", "q", heads), ("_W_K", "k", kv), ("_W_V", "v", kv)):
        state[f"blocks.{l}.attn.{ours}"] = einops.rearrange(get(f"{p}.self_attn.{theirs}_proj.weight"),
                                                            "(n h) m -> n m h", n=n)
        state[f"blocks.{l}.attn.{ours.replace('W', 'b')}"] = einops.rearrange(get(f"{p}.self_attn.{theirs}_proj.bias"),
                                                                              "(n h) -> n h", n=n)
    state[f"blocks.{l}.attn.W_O"] = einops.rearrange(get(f"{p}.self_attn.o_proj.weight"), "m (n h) -> n h m", n=heads)
    gate_up = convert_moe_packed_tensors(get(f"{p}.mlp.experts.gate_up_proj_blocks"),
                                         get(f"{p}.mlp.experts.gate_up_proj_scales"), dtype=torch.float32)
    down = convert_moe_packed_tensors(get(f"{p}.mlp.experts.down_proj_blocks"), get(f"{p}.mlp.experts.down_proj_scales"),
                                      dtype=torch.float32)
    gate_up_bias, down_bias = get(f"{p}.mlp.experts.gate_up_proj_bias"), get(f"{p}.mlp.experts.down_proj_bias")
    for e in range(cfg.num_experts):
        x = f"blocks.{l}.mlp.experts.{e}"
        state[f"{x}.W_gate.weight"], state[f"{x}.W_gate.bias"] = gate_up[e, :, ::2].T.contiguous(), gate_up_bias[e, ::2]
        state[f"{x}.W_in.weight"], state[f"{x}.W_in.bias"] = gate_up[e, :, 1::2].T.contiguous(), gate_up_bias[e, 1::2]
        state[f"{x}.W_out.weight"], state[f"{x}.W_out.bias"] = down[e].T.contiguous(), down_bias[e]
    return state


def gpt_oss_demo(model_class, config_class, model_dir: str) -> dict:
    from transformers import AutoTokenizer

    get = safe_open(f"{model_dir}/model.safetensors", framework="pt", device="cpu").get_tensor
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cfg = demo_config(config_class, 2, get("model.embed_tokens.weight").shape[0])
    model = model_class(cfg, tokenizer, move_to_device=False)
    model.load_state_dict({"embed.W_E": get("model.embed_tokens.weight")}, strict=False)
    for l in range(cfg.n_layers):
        for key, value in layer_state(get, l, cfg).items():
            model.load_state_dict({key: value}, strict=False)
    model.load_state_dict({"ln_final.w": get("model.norm.weight")}, strict=False)
    model.load_state_dict({"unembed.W_U": get("lm_head.weight").T}, strict=False)
    model.load_state_dict({"unembed.b_U": torch.zeros(cfg.d_vocab, dtype=cfg.dtype)}, strict=False)
    out = {}
    with torch.no_grad():
        out["logits"] = model(model.to_tokens("The capital of France is"))
        tokens = model.to_tokens("The cat sat on the mat")
        _, cache = model.run_with_cache(tokens)
        out["expert_indices"] = cache["blocks.0.mlp.hook_expert_indices"]
        out["expert_weights"] = cache["blocks.0.mlp.hook_expert_weights"]
        out["pattern"] = cache["blocks.0.attn.hook_pattern"][0, 0]
        out["lens"] = model.ln_final(cache["blocks.1.hook_resid_post"]) @ model.unembed.W_U + model.unembed.b_U
        clean = {}
        model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_post",
                                                 lambda t, hook: clean.__setitem__(hook.name, t.detach().clone()))])
        corrupt = torch.cat([tokens[:, :1], tokens[:, 1:].flip(-1)], dim=1)  # (the same length as a corrupted prompt)
        out["patched"] = model.run_with_hooks(corrupt, fwd_hooks=[("blocks.0.hook_resid_post",
                                                                    lambda t, hook: clean[hook.name])])
    return {k: v.detach().clone().contiguous() for k, v in out.items()}
