"""ARENA's balanced-bracket classifier section (interpretability on an algorithmic model), written once as
transformer-lens code: a bidirectional classifier built from HookedTransformerConfig with use_hook_tokens, whose
padding is masked by permanent hooks on hook_tokens and every hook_attn_scores. The oracle
(tests/saelens_oracle.py, HookedTransformer of transformer-lens 3) and tests/test_bidirectional.py (probe) each run
`brackets_idioms` on a model of the same config and weights. Attribute access only, no imports from either library.

Tokens: 0 start, 1 pad, 2 end, 3 "(", 4 ")"."""
from __future__ import annotations

import torch

START, PAD, END = 0, 1, 2
BRACKETS = ["()()", "(())", "))((", "()", "((()()()()))", "(()()()(()(())()", "()(()(((())())()))"]  # ARENA's examples
CONFIG = dict(n_ctx=42, d_model=56, d_head=28, n_heads=2, d_mlp=56, n_layers=3, attention_dir="bidirectional",
              act_fn="relu", d_vocab=5, d_vocab_out=2, use_attn_result=True, use_hook_tokens=True)


def tokenize(strings: list[str]) -> torch.Tensor:
    """ARENA's SimpleTokenizer("()"): [start] + brackets + [end], padded on the right with [pad]."""
    width = max(len(s) for s in strings) + 2
    rows = [[START] + [3 if c == "(" else 4 for c in s] + [END] for s in strings]
    return torch.tensor([row + [PAD] * (width - len(row)) for row in rows])


def add_perma_hooks_to_mask_pad_tokens(model, pad_token: int):
    def cache_padding_tokens_mask(tokens, hook) -> None:
        hook.ctx["padding_tokens_mask"] = (tokens == pad_token)[:, None, None, :]

    def apply_padding_tokens_mask(attn_scores, hook) -> None:
        attn_scores.masked_fill_(model.hook_dict["hook_tokens"].ctx["padding_tokens_mask"], -1e5)
        if hook.layer() == model.cfg.n_layers - 1:
            del model.hook_dict["hook_tokens"].ctx["padding_tokens_mask"]

    for name, hook in model.hook_dict.items():
        if name == "hook_tokens":
            hook.add_perma_hook(cache_padding_tokens_mask)
        elif name.endswith("attn_scores"):
            hook.add_perma_hook(apply_padding_tokens_mask)
    return model


def brackets_idioms(model, strings: list[str]) -> dict:
    out = {}
    toks = tokenize(strings)
    with torch.no_grad():
        model.reset_hooks(including_permanent=True)
        out["unmasked_logits"] = model(toks)[:, 0]
        model = add_perma_hooks_to_mask_pad_tokens(model, PAD)
        logits = model(toks)[:, 0]
        out["logits"] = logits
        out["prob_balanced"] = logits.softmax(-1)[:, 1]
        # a prompt alone gives what it gives in the padded batch: the hooks hide the padding
        out["first_alone"] = model(tokenize(strings[:1]))[:, 0]
        out["post_final_ln_dir"] = model.W_U[:, 0] - model.W_U[:, 1]

        def get_activations(names):
            names_list = [names] if isinstance(names, str) else names
            _, cache = model.run_with_cache(toks, return_type=None, names_filter=lambda name: name in names_list)
            return cache[names] if isinstance(names, str) else cache

        def ln_hook_names(layernorm):
            if layernorm.name == "ln_final":
                return f"blocks.{model.cfg.n_layers - 1}.hook_resid_post", "ln_final.hook_normalized"
            layer, ln = layernorm.name.split(".")[1:]
            return (f"blocks.{layer}.hook_{'resid_pre' if ln == 'ln1' else 'resid_mid'}",
                    f"blocks.{layer}.{ln}.hook_normalized")

        for i, layernorm in enumerate([model.ln_final, model.blocks[1].ln1, model.blocks[2].ln2]):
            inp_name, out_name = ln_hook_names(layernorm)
            cache = get_activations([inp_name, out_name])
            inputs, outputs = cache[inp_name][:, 0], cache[out_name][:, 0]
            # the linear fit of the norm at position 0 (ARENA uses sklearn; least squares with an intercept here)
            design = torch.cat([inputs, torch.ones(len(inputs), 1)], dim=1)
            out[f"ln_fit{i}"] = torch.linalg.lstsq(design.double(), outputs.double()).solution.float()
            out[f"ln_out{i}"] = outputs

        names = ["blocks.0.hook_resid_pre"]
        for layer in range(model.cfg.n_layers):
            names += [f"blocks.{layer}.attn.hook_result", f"blocks.{layer}.hook_mlp_out"]
        cache = get_activations(names)
        parts = [cache["blocks.0.hook_resid_pre"]]
        for layer in range(model.cfg.n_layers):
            parts += list(cache[f"blocks.{layer}.attn.hook_result"].unbind(2)) + [cache[f"blocks.{layer}.hook_mlp_out"]]
        out_by_components = torch.stack(parts)
        out["out_by_components"] = out_by_components
        out["summed_minus_ln_input"] = (out_by_components.sum(0) + model.b_O.sum(0)
                                        - get_activations(f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"))

        _, cache = model.run_with_cache(toks)
        out["pattern2"] = cache["pattern", 2]
        out["attn_scores0"] = cache["attn_scores", 0].clamp(min=-1e4)
        out["neuron_contributions"] = torch.einsum("bpn,nd->bpnd", cache["post", 1][:, :1], model.blocks[1].mlp.W_out)
        out["W_OV_2_0"] = model.W_V[2, 0] @ model.W_O[2, 0]
        out["scale_final"] = cache["ln_final.hook_scale"]
        stack, labels = cache.decompose_resid(return_labels=True)
        out["decompose_resid"] = stack
        out["ln_stack"] = cache.apply_ln_to_stack(stack)[:, :, 0]

        # the attention paid by the [start] token of layer 2 head 0, read by a hook
        store = {}

        def pattern_hook(pattern, hook):
            store["start"] = pattern[:, 0, 0]

        model.run_with_hooks(toks, return_type=None, fwd_hooks=[("blocks.2.attn.hook_pattern", pattern_hook)])
        out["start_attention"] = store["start"]
        model.reset_hooks(including_permanent=True)
        out["after_reset"] = model(toks)[:, 0]
    return {name: value.detach().float() for name, value in out.items()}
