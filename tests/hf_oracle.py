"""Independent values read from `transformers`' own forward, for tests to compare against."""
from __future__ import annotations

import torch

from family_checks import seen_in_forward


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


def hf_head_inputs(hf, tokens) -> dict[int, torch.Tensor]:
    """Every layer's merged head outputs (c_proj's input) [batch pos n_head*d_head]."""
    seen = seen_in_forward(hf, tokens, {layer: block.attn.c_proj for layer, block in enumerate(hf.transformer.h)})
    return {layer: inputs[0] for layer, (inputs, _) in seen.items()}


def hf_head_writes(hf, tokens):
    """[layer] of [batch pos head d_model]: what each head writes to the residual stream (without c_proj's
    bias), from its slice of c_proj's input (the merged heads) times its rows of c_proj (Conv1D: [in, out])."""
    merged = hf_head_inputs(hf, tokens)
    n_head = hf.config.n_head
    writes = []
    for l, block in enumerate(hf.transformer.h):
        z = merged[l].unflatten(-1, (n_head, -1))  # [batch pos head d_head]
        weight = block.attn.c_proj.weight.unflatten(0, (n_head, -1))  # [head d_head d_model]
        writes.append(torch.einsum("bphd,hdm->bphm", z, weight))
    return writes


def next_token_logprob(logits, tokens):
    """Mean log-probability of each next token: a scalar to differentiate."""
    return logits[:, :-1].float().log_softmax(-1).gather(-1, tokens[:, 1:, None]).mean()


def hf_gradients(hf, tokens):
    """d next_token_logprob / d (every block's input residual, every attention pattern), by
    transformers' autograd (eager attention, so its attention weights are the ones multiplied into V)."""
    out = hf(tokens, output_hidden_states=True, output_attentions=True)
    n_layers = len(out.attentions)
    wanted = list(out.hidden_states[:n_layers]) + list(out.attentions)
    grads = torch.autograd.grad(next_token_logprob(out.logits, tokens), wanted)
    return list(grads[:n_layers]), list(grads[n_layers:])
