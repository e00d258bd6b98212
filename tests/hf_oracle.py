"""Independent values read from `transformers`' own forward, for tests to compare against."""
from __future__ import annotations

import torch


def hf_forward_states(hf, tokens):
    """logits, every block's attention output, all hidden states, and the residual entering ln_f
    (transformers' last hidden state is after ln_f), from one forward of a GPT2LMHeadModel."""
    attn_out, final = {}, {}
    handles = [block.attn.register_forward_hook(
        lambda mod, args, out, l=l: attn_out.__setitem__(l, out[0])) for l, block in enumerate(hf.transformer.h)]
    handles.append(hf.transformer.ln_f.register_forward_pre_hook(lambda mod, args: final.__setitem__("x", args[0])))
    try:
        with torch.no_grad():
            out = hf(tokens, output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    return out.logits, [attn_out[l] for l in range(len(attn_out))], out.hidden_states, final["x"]
